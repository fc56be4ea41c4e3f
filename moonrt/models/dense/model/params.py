"""Parameter counts of a :class:`DenseModel` from its config alone (a test checks them against ``numel``).

**Active per token** follows K3's convention (its ``params.py``): every parameter except the input embedding
table (a lookup, no matmul); with tied embeddings the table is the LM head and counts once, as active.

**Model FLOPs per token** (:func:`flops_per_token`): PaLM's ``6 N + 12 L H Q T`` (N active parameters).
"""

from __future__ import annotations

import dataclasses

from .config import DenseConfig


@dataclasses.dataclass(frozen=True)
class ParamCounts:
    """``total`` and ``active`` (per token) parameters, ``by_part`` (total per component), ``per_layer``
    (one decoder layer: attention, FFN and its two norms; every layer is the same)."""

    total: int
    active: int
    by_part: dict[str, int]
    per_layer: int

    def table(self) -> str:
        """A readable breakdown, one component per line (exact counts)."""
        rows = [f"{name:<26} {n:>19,}" for name, n in self.by_part.items()]
        rows += [f"{'total':<26} {self.total:>19,}", f"{'active per token':<26} {self.active:>19,}"]
        return "\n".join(rows)


def attention_params(c: DenseConfig) -> int:
    """One attention sub-layer: ``q_proj``, ``kv_proj`` (``3 H hd D`` together) and ``o_proj`` (``H hd D``)."""
    return 4 * c.num_attention_heads * c.head_dim * c.hidden_size


def ffn_params(c: DenseConfig) -> int:
    """One SwiGLU FFN: gate, up, down (``3 D F``)."""
    return 3 * c.hidden_size * c.intermediate_size


def count_params(c: DenseConfig) -> ParamCounts:
    """Total and active-per-token parameters of ``DenseModel(c)``."""
    d, n = c.hidden_size, c.num_hidden_layers
    embed = c.vocab_size * d
    per_layer = attention_params(c) + ffn_params(c) + 2 * d
    parts = {
        "embedding": embed,
        "attention": n * attention_params(c),
        "ffn": n * ffn_params(c),
        "norms": 2 * d * n + d,
        "lm_head": 0 if c.tie_word_embeddings else c.vocab_size * d,
    }
    total = sum(parts.values())
    return ParamCounts(total=total, active=total - (0 if c.tie_word_embeddings else embed), by_part=parts,
                       per_layer=per_layer)


def flops_per_token(c: DenseConfig, seq_len: int) -> int:
    """Training FLOPs (forward + backward, 2 per multiply-add, backward 2x forward) per token at ``seq_len``:
    PaLM's estimate (appendix B) ``6 N + 12 L H Q T`` with ``N`` the active parameters (:func:`count_params`),
    ``L`` layers, ``H`` heads of width ``Q`` (``head_dim``) and ``T = seq_len``: ``6 N`` for every weight's
    multiply-add forward and two backward, ``12 L H Q T`` for the score and value products of softmax attention
    (``2 T H Q`` each forward, times 3; PaLM's non-causal convention: every query against all ``T`` keys).
    Element-wise work (norms, softmax, SwiGLU's product, rotary) is not counted."""
    attn = 12 * c.num_hidden_layers * c.num_attention_heads * c.head_dim * seq_len
    return 6 * count_params(c).active + attn


def stage_sizes(c: DenseConfig) -> dict[str, object]:
    """The fields of the memory planner's ``ParamSizes`` (built by the job layer, which may import the planner):
    ``layers`` ``[L]`` (attention + FFN + 2 norms each), ``expert`` ``[L]`` zeros (no routed experts), ``embed``
    (``V D``), ``lm_head`` (what the last stage holds after the last layer: final norm + head, ``D + V D``; the
    norm only with tied embeddings). The four sum to :func:`count_params` ``.total``."""
    counts = count_params(c)
    n = c.num_hidden_layers
    return {"layers": (counts.per_layer,) * n, "expert": (0,) * n, "embed": counts.by_part["embedding"],
            "lm_head": c.hidden_size + counts.by_part["lm_head"]}


__all__ = ["ParamCounts", "attention_params", "count_params", "ffn_params", "flops_per_token", "stage_sizes"]
