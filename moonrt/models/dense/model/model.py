"""The dense baseline decoder: embedding, pre-norm attention + SwiGLU layers, final norm, LM head.

Layer ``l`` (0-indexed), with ``h`` the residual stream (:class:`DenseStream`: ``h = e + partial``)::

    partial += attn(attn_norm(h))          causal softmax attention (rotary or NoPE)
    partial += ffn(ffn_norm(h))            SwiGLU

then ``logits = lm_head(norm(h))`` in fp32.

Module names follow K3's where the roles match (memory policies, the CP context's ``*.attn`` tags and
checkpoints key on them): ``embed``, ``layers.{l}.attn_norm``, ``layers.{l}.attn``, ``layers.{l}.ffn_norm``,
``layers.{l}.ffn``, ``norm``, ``lm_head``.

Seams (the model holds no process groups): ``ctx`` (an ``AttentionContext``: context parallelism gathers
each attention's ``[k | v]``), and the stage API :meth:`DenseModel.embed_tokens` / :meth:`DenseModel.run_layers`
/ :meth:`DenseModel.head` with :meth:`DenseModel.stages`, :meth:`DenseModel.stage_modules` and
:meth:`DenseModel.stream` for pipeline parallelism: the stream crossing stages has the executor's
``blocks`` / ``partial`` shape, one block of ``num_hidden_layers`` layers (:meth:`DenseModel.pipeline_layout`).
The MoE members of :class:`moonrt.parallel.model.TrainableModel` come from :class:`~moonrt.parallel.model.NoMoE`:
the model has no experts.
"""

from __future__ import annotations

import torch
from torch import nn

from moonrt.ops.precision import token_loss_sum
from moonrt.parallel.context import LOCAL, AttentionContext
from moonrt.parallel.decoder import check_tokens, lm_head, token_embedding
from moonrt.parallel.model import NoMoE, ParamGroups, PipelineLayout, default_param_groups

from .attention import CausalSelfAttention, Packing
from .config import DenseConfig
from .layers import RMSNorm, SwiGLUFFN
from .stream import DenseStream


class DenseLayer(nn.Module):
    """One decoder layer: ``attn_norm``, ``attn``, ``ffn_norm``, ``ffn``."""

    def __init__(self, config: DenseConfig, index: int) -> None:
        super().__init__()
        self.index = index
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = CausalSelfAttention(config)
        self.ffn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.ffn = SwiGLUFFN(config.hidden_size, config.intermediate_size, config.initializer_range)

    def forward(self, state: DenseStream, ctx: AttentionContext = LOCAL, packing: Packing | None = None) -> None:
        """Run both sub-layers on ``state`` (its ``partial`` grows by their outputs ``[B, T, D]``)."""
        state.add(self.attn(self.attn_norm(state.residual()), ctx=ctx, packing=packing))
        state.add(self.ffn(self.ffn_norm(state.residual())))


class DenseModel(NoMoE, nn.Module):
    """The dense decoder-only language model (the baseline of K3 at equal width and vocabulary).

    Args:
        config: a :class:`DenseConfig` (validated here: ConfigError naming the field).
    """

    def __init__(self, config: DenseConfig) -> None:
        super().__init__()
        config.validate()
        self.config = config
        d = config.hidden_size
        self.embed = token_embedding(config.vocab_size, d, config.initializer_range)
        self.layers = nn.ModuleList(DenseLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(d, config.rms_norm_eps)
        self.lm_head = lm_head(self.embed, config.tie_word_embeddings, config.initializer_range)

    # ---- pipeline-stage API ----------------------------------------------------------------------
    def pipeline_layout(self) -> PipelineLayout:
        """Depth, stream width and block size (:meth:`DenseConfig.pipeline_layout`: one block of every layer)."""
        return self.config.pipeline_layout()

    def stages(self, num_stages: int, align_to_blocks: bool = False) -> list[range]:
        """Split the decoder layers into ``num_stages`` contiguous, near-equal layer ranges (K3's rule).

        ``align_to_blocks``: cuts on block boundaries; the dense stream is one block, so only
        ``num_stages = 1`` is possible then (ValueError otherwise, as K3 with more stages than blocks).
        """
        n = self.config.num_hidden_layers
        top = 1 if align_to_blocks else n
        if not (isinstance(num_stages, int) and 1 <= num_stages <= top):
            what = "the stream's one block" if align_to_blocks else "decoder layers"
            raise ValueError(f"num_stages = {num_stages}: expected 1..{top} ({what})")
        cuts = [i * n // num_stages for i in range(num_stages + 1)]
        return [range(cuts[i], cuts[i + 1]) for i in range(num_stages)]

    def stage_modules(self, layers: range, first: bool, last: bool) -> list[str]:
        """Names of the modules a pipeline stage running decoder ``layers`` uses (``first``: it embeds the
        tokens; ``last``: it runs the head). No module is shared by every stage (K3's ``attn_res`` has no
        counterpart)."""
        names = [f"layers.{i}" for i in layers]
        return names + (["embed"] if first else []) + (["norm", "lm_head"] if last else [])

    @staticmethod
    def stream(blocks: list[torch.Tensor], partial: torch.Tensor | None = None) -> DenseStream:
        """The stream a pipeline stage starts from: ``blocks`` (``[e]``) and the running ``partial`` ``[B, T, D]``."""
        return DenseStream(blocks=list(blocks), partial=partial)

    def embed_tokens(self, tokens: torch.Tensor) -> DenseStream:
        """``tokens [B, T]`` int64 -> the initial stream (block 0 = token embedding ``[B, T, D]``, no partial)."""
        check_tokens(tokens, self.config.vocab_size)
        return DenseStream(blocks=[self.embed(tokens)])

    def run_layers(self, state: DenseStream, layers: range, ctx: AttentionContext = LOCAL, two_phase: bool = False,
                   packing: Packing | None = None) -> DenseStream:
        """Run decoder ``layers`` on the stream ``state`` (mutated and returned); the last decoder layer closes
        the block. ``two_phase`` (K3's AttnRes inference form) changes nothing here: there is no mix to
        reorder. ``packing``: packed documents (single-device context)."""
        n = self.config.num_hidden_layers
        for i in layers:
            if not 0 <= i < n:
                raise ValueError(f"layers: index {i}: expected decoder layers in [0, {n})")
            if len(state.blocks) != 1:
                raise ValueError(f"layer {i}: the stream's block is already closed (the last layer ran)")
            self.layers[i](state, ctx, packing)
            if i == n - 1:
                state.close_block()
        return state

    def head(self, state: DenseStream) -> torch.Tensor:
        """Final norm and LM head on the residual: ``logits [B, T, vocab]`` fp32 (fp64 for an fp64 model, so a
        float64 run is a float64 reference of the same code)."""
        logits = self.lm_head(self.norm(state.residual()))
        return logits.to(torch.promote_types(logits.dtype, torch.float32))

    # ---- whole model -----------------------------------------------------------------------------
    def forward(self, tokens: torch.Tensor, ctx: AttentionContext = LOCAL,
                packing: Packing | None = None) -> torch.Tensor:
        """``tokens [B, T]`` int64 (this rank's sequence slice under CP) -> ``logits [B, T, vocab]`` fp32 (see head).

        ``packing``: the documents packed in the rows (single-device context); no token sees another document.
        """
        state = self.embed_tokens(tokens)
        if packing is not None:
            B, T = tokens.shape
            packing.check(B, T, "packing")
            packing.check_context(ctx)
        return self.head(self.run_layers(state, range(self.config.num_hidden_layers), ctx, packing=packing))

    def loss_sum(self, tokens: torch.Tensor, targets: torch.Tensor, ctx: AttentionContext = LOCAL,
                 packing: Packing | None = None) -> torch.Tensor:
        """Summed next-token cross-entropy (fp32 scalar) over all ``targets [B, T]`` except those equal to -100
        (torch's ``ignore_index``). Sum, not mean: the runtime divides by the global token count."""
        logits = self(tokens, ctx=ctx, packing=packing)
        return token_loss_sum(logits, targets)  # fp32 even under a bf16 autocast region (the loss island)

    # ---- optimizer groups ------------------------------------------------------------------------
    def param_groups(self) -> ParamGroups:
        """The token embedding takes no weight decay (:func:`moonrt.parallel.model.default_param_groups`)."""
        return default_param_groups(self)


__all__ = ["DenseLayer", "DenseModel"]
