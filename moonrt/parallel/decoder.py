"""The two ends of a decoder and the stream between them, as the pieces every model family shares: what the first
pipeline stage takes in, what crosses a stage boundary, what the last stage's head is.

- :func:`check_tokens`: the token contract of :meth:`~moonrt.parallel.model.TrainableModel.embed_tokens` (and so of
  a model's forward): ``tokens [B, T]`` int64 (int32 accepted) with ids in ``[0, vocab_size)``.
- :func:`token_embedding` and :func:`lm_head`: the embedding ``[vocab, D]`` and the LM head, tied to it or not
  (:attr:`~moonrt.parallel.model.PipelineLayout.tied_embeddings`), initialized N(0, std).
- :class:`BlockStream`: a :class:`~moonrt.parallel.model.Stream` (finished ``blocks``, the open ``partial`` block)
  with the accumulation that is the same in every model: :meth:`~BlockStream.add` sums sub-layer outputs into the
  partial block in the stream's dtype, :meth:`~BlockStream.close_block` finishes it, :meth:`~BlockStream.sources`
  lists both. The dense residual stream (one block, a plain sum: ``moonrt.models.dense.model.stream``) and K3's
  Block AttnRes state (``moonrt.models.k3.model.attnres``) extend it with how they read it.
- :class:`RMSNorm`: the norm module of every model (the ``weight`` around :func:`moonrt.ops.rmsnorm.rms_norm`).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from moonrt.ops.rmsnorm import rms_norm


def check_tokens(tokens: torch.Tensor, vocab_size: int) -> None:
    """ValueError naming the shape and dtype unless ``tokens`` is ``[B, T]`` int64 / int32, or the id range unless
    every id is in ``[0, vocab_size)`` (one host sync)."""
    if tokens.dim() != 2 or tokens.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"tokens: shape {tuple(tokens.shape)} dtype {tokens.dtype}: expected [B, T] int64")
    if tokens.numel():
        lo, hi = torch.stack(torch.aminmax(tokens)).tolist()  # one host sync
        if lo < 0 or hi >= vocab_size:
            raise ValueError(f"tokens: ids in [{lo}, {hi}]: expected [0, vocab_size = {vocab_size})")


def token_embedding(vocab_size: int, dim: int, init_std: float) -> nn.Embedding:
    """The token embedding ``weight [vocab_size, dim]`` ~ N(0, ``init_std``)."""
    embed = nn.Embedding(vocab_size, dim)
    nn.init.normal_(embed.weight, std=init_std)
    return embed


def lm_head(embed: nn.Embedding, tie: bool, init_std: float) -> nn.Linear:
    """The LM head ``weight [vocab_size, dim]`` (no bias) of a decoder embedding with ``embed``: sharing its weight
    (``tie``), else its own ~ N(0, ``init_std``)."""
    head = nn.Linear(embed.embedding_dim, embed.num_embeddings, bias=False)
    if tie:
        head.weight = embed.weight
    else:
        nn.init.normal_(head.weight, std=init_std)
    return head


@dataclasses.dataclass
class BlockStream:
    """The residual stream between decoder layers: what a pipeline stage boundary carries.

    ``blocks``: finished block representations ``[B, T, D]`` (``blocks[0]`` is the token embedding); ``partial``: the
    running sum ``[B, T, D]`` of the open block's sub-layer outputs, or None at a block boundary.
    """

    blocks: list[torch.Tensor]
    partial: torch.Tensor | None = None

    def add(self, out: torch.Tensor) -> None:
        """Accumulate one sub-layer output ``[B, T, D]`` into the partial block in the stream's dtype: the embedding's,
        or the output's if wider. Under a bf16 autocast region the sub-layers return bf16 and the embedding is fp32
        (fp32 parameters), so the stream stays fp32, as type promotion keeps torchtitan's ``h = x + attn(x)``; the
        pipeline's receive buffers are allocated in it."""
        out = out.to(torch.promote_types(out.dtype, self.blocks[0].dtype))
        self.partial = out if self.partial is None else self.partial + out

    def close_block(self) -> None:
        """End of a block: the partial sum becomes a finished block representation."""
        if self.partial is not None:
            self.blocks.append(self.partial)
        self.partial = None

    def sources(self) -> list[torch.Tensor]:
        """Finished blocks then the open partial (the pipeline executor's and AttnRes's vocabulary)."""
        return self.blocks + ([self.partial] if self.partial is not None else [])


__all__ = ["BlockStream", "check_tokens", "lm_head", "token_embedding"]


class RMSNorm(nn.Module):
    """``y = x / sqrt(mean(x^2) + eps) * weight`` over the last dimension (:func:`rms_norm`: fp32 math whatever the
    input dtype, fp64 stays fp64, out in ``x``'s dtype; one autograd node).

    Args:
        dim: size of the last dimension of the input, an integer >= 1.
        eps: added to the mean square before the reciprocal square root, > 0.

    Parameters: ``weight [dim]`` (init 1), kept in whatever dtype the module is cast to.
    """

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        if not (isinstance(dim, int) and dim >= 1):
            raise ValueError(f"RMSNorm: dim={dim!r}, expected an integer >= 1")
        if not eps > 0:
            raise ValueError(f"RMSNorm: eps={eps!r}, expected a positive number")
        self.dim, self.eps = dim, float(eps)
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., dim]`` any float dtype -> ``[..., dim]`` in ``x.dtype``."""
        if x.shape[-1] != self.dim:
            raise ValueError(f"RMSNorm: input last dimension {x.shape[-1]}, expected dim={self.dim}")
        return rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}"
