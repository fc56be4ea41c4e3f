"""The attention seam: how KDA and MLA layers reach tokens outside their own slice of the sequence.

The model is single-device code (STYLE habit 1). Its attention layers never talk to process groups;
they call the three methods of an :class:`AttentionContext` that the caller passes in. The base
class is the single-device behaviour; context parallelism (``moonrt.comm``) subclasses it and
overrides the methods with collectives, each differentiable (its backward sends the gradient the
other way). Nothing here is a global: pass the context to ``model(tokens, ctx=...)``.
"""

from __future__ import annotations

import torch


class AttentionContext:
    """Single-device attention context (the whole sequence is local).

    Args:
        kda_kernel: the KDA backend (``kernels.kda`` of a job: auto, torch, numba, triton, fla;
            :mod:`moonrt.ops.kernels`), passed to every KDA call made through this context.
    """

    kda_kernel: str = "auto"
    """The KDA backend (a subclass that does not call ``__init__`` keeps ``auto``)."""

    def __init__(self, *, kda_kernel: str = "auto") -> None:
        from moonrt.ops.kernels import check_choice

        self.kda_kernel = check_choice("kda", kda_kernel)

    def kda(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        *,
        scale: float | None = None,
        initial_state: torch.Tensor | None = None,
        output_final_state: bool = False,
        cu_seqlens: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """KDA over this rank's tokens; same contract as :func:`moonrt.ops.kda.kda_chunk` (``cu_seqlens``: packed
        documents, single device only; callers pass it only when packing).

        A context-parallel override runs KCP (K3_SYSTEMS §7): the state entering this rank's slice
        is the merged state of all earlier ranks.
        """
        from moonrt.ops.kernels import kernel

        kda_chunk = kernel("kda_chunk", self.kda_kernel, q.device)
        return kda_chunk(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                         output_final_state=output_final_state, cu_seqlens=cu_seqlens)

    def conv_prefix(self, x: torch.Tensor, width: int) -> torch.Tensor:
        """The ``width`` pre-conv tokens that precede this slice: ``x [B, T, C]`` -> ``[B, width, C]``.

        Single device: zeros (causal padding). Context parallel: the previous rank's last ``width``
        tokens (the short-conv halo), whose gradient flows back to that rank.
        """
        return x.new_zeros(x.shape[0], width, x.shape[2])

    def gather_sequence(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        """All tokens of the sequence up to the end of the last slice, and this slice's offset.

        ``x [B, T, C]`` (e.g. the MLA compressed latent) -> ``(x_full [B, T_total, C], offset)``,
        where this rank's queries sit at global positions ``offset + arange(T)`` for causal masking.
        Single device: ``(x, 0)``. Context parallel: an all-gather whose backward is a
        reduce-scatter.
        """
        return x, 0


LOCAL = AttentionContext()
"""The default single-device context (``kda_kernel`` auto)."""
