"""The context-parallel attention context: KCP for KDA, the conv halo, and MLA latent all-gather (K3_SYSTEMS §7).

The model is single-device code that reaches other ranks' tokens only through the three methods of
its :class:`~moonrt.parallel.context.AttentionContext` (``kda``, ``conv_prefix``, ``gather_sequence``).
:class:`ContextParallel` overrides them with the differentiable collectives of
:mod:`moonrt.comm.cp.kcp` and :mod:`moonrt.comm.cp.ops` over one CP process group (the mesh's ``cp``
group, innermost), so ``model(tokens_slice, ctx=ContextParallel(mesh.group(Group.CP)))`` runs the
model on this rank's contiguous slice of every sequence (rank ``r`` owns ``[r*T//c, (r+1)*T//c)``,
:meth:`ContextParallel.slice`).

Accounting (K3_SYSTEMS §7 "communication per KDA layer per rank"): every call appends a
:class:`~moonrt.comm.cp.ops.CommRecord` to :attr:`ContextParallel.log` with the bytes this rank sent
and received in the forward and (when it runs) the backward pass. Records are labelled with the
module name set by :meth:`ContextParallel.tag_layers` (forward pre-hooks applied from outside the
model), else ``"<op>#<n>"`` by call order within a step. Call :meth:`ContextParallel.new_step`
before each step to start fresh counters.

This runtime module imports only the context *base class* from ``moonrt.models.k3.model`` (the seam it
implements); it knows nothing else of the model.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from moonrt.comm.cp.gather import build_summary_gather
from moonrt.comm.cp.kcp import kcp_kda
from moonrt.comm.cp.ops import CommLog, CommRecord, gather_prefix, halo_exchange, slice_bounds
from moonrt.parallel.context import AttentionContext

if TYPE_CHECKING:
    from torch import nn
    from torch.distributed import ProcessGroup
    from torch.utils.hooks import RemovableHandle


class ContextParallel(AttentionContext):
    """Attention context of one rank of a CP group (K3_SYSTEMS §7).

    Args:
        group: the CP process group (``None``: the default group). Every rank of it must run the
            same model on its slice of the same sequences, calling the methods in the same order.
        chunk_size: chunk length of the local chunked KDA.
        kda_kernel: the KDA backend of the local pieces (``kernels.kda``: auto, torch, numba, triton).
        transport: what carries KCP's summaries (``parallel.cp_transport``: auto, shm, collectives;
            :func:`moonrt.comm.cp.gather.build_summary_gather`, collective over ``group``); :attr:`transport` is the
            backend it resolved to. ``device_type``: where the tensors live (``cpu`` or ``cuda``); ``backend``: the
            job's process-group backend (default: the group's; the heap needs gloo).
    """

    def __init__(self, group: ProcessGroup | None, *, chunk_size: int = 64, kda_kernel: str = "auto",
                 transport: str = "collectives", device_type: str = "cpu", backend: str | None = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError("ContextParallel needs torch.distributed initialized (moonrt.cluster.init_distributed)")
        super().__init__(kda_kernel=kda_kernel)
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.chunk_size = chunk_size
        self.gather = build_summary_gather(transport, group, device_type, backend=backend)
        self.transport: str = self.gather.name
        self.log = CommLog()
        self._layer: str | None = None
        self._calls: dict[str, int] = {}

    # ---- the slice rule ------------------------------------------------------------------------
    def bounds(self, total: int) -> tuple[int, int]:
        """``(start, end)`` of this rank's slice of a sequence of ``total`` tokens."""
        return slice_bounds(total, self.size, self.rank)

    def slice(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's contiguous slice of a whole-sequence tensor along ``dim`` (e.g. tokens ``[B, T]``)."""
        start, end = self.bounds(x.shape[dim])
        return x.narrow(dim, start, end - start)

    # ---- accounting ----------------------------------------------------------------------------
    def new_step(self) -> None:
        """Clear the byte records and per-step call counters (call before each forward)."""
        self.log.reset()
        self._calls.clear()

    def tag_layers(self, modules: Iterable[tuple[str, nn.Module]]) -> list[RemovableHandle]:
        """Label the records of calls made inside each ``(name, module)``'s forward with ``name``.

        Registers a forward pre-hook and a forward hook per module (from outside the model); returns
        their handles.
        """

        def enter(name: str):  # noqa: ANN202
            def hook(_module: nn.Module, _args: object) -> None:
                self._layer = name

            return hook

        def leave(_module: nn.Module, _args: object, _out: object) -> None:
            self._layer = None

        handles = []
        for name, module in modules:
            handles.append(module.register_forward_pre_hook(enter(name)))
            handles.append(module.register_forward_hook(leave))
        return handles

    def _record(self, op: str) -> CommRecord:
        n = self._calls.get(op, 0)
        self._calls[op] = n + 1
        return self.log.new(op, self._layer if self._layer is not None else f"{op}#{n}")

    # ---- the seam ------------------------------------------------------------------------------
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
        """KCP over the CP group (:func:`moonrt.comm.cp.kcp.kcp_kda`): this slice's outputs, entering state merged.

        ``q, k [B, T_r, H, K]``, ``v [B, T_r, H, V]``, ``g [B, T_r, H, K]``, ``beta [B, T_r, H]``;
        ``initial_state [B, H, K, V]`` fp32 on CP rank 0 only; the final state comes back on the last
        CP rank (None elsewhere). ``cu_seqlens`` (packed documents) is the single-device contract's only: refused.
        """
        if cu_seqlens is not None:
            raise ValueError("cu_seqlens: expected None under context parallelism (packed documents run on a single "
                             "device; the job refuses packing with cp > 1)")
        return kcp_kda(q, k, v, g, beta, self.group, scale=scale, initial_state=initial_state,
                       output_final_state=output_final_state, chunk_size=self.chunk_size,
                       record=self._record("kcp"), kernel=self.kda_kernel, gather=self.gather)

    def conv_prefix(self, x: torch.Tensor, width: int) -> torch.Tensor:
        """The previous rank's last ``width`` pre-conv tokens (the short-conv halo, zeros on CP rank 0).

        ``x [B, T_r, C]`` -> ``[B, width, C]`` in ``x.dtype``; its gradient returns to the previous rank.
        """
        if width == 0:
            return x.new_zeros(x.shape[0], 0, x.shape[-1])
        return halo_exchange(x, width, self.group, record=self._record("halo"))

    def close(self) -> None:
        """Release the summary gather's buffers (a heap's mappings; its segments were unlinked when mapped)."""
        self.gather.close()

    def gather_sequence(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        """All-gather ``x [B, T_r, C]`` (the MLA latent): ``(x [B, offset + T_r, C], offset)``.

        Returns every token up to the end of this rank's slice (later ones are causally masked
        anyway); backward reduce-scatters the latent gradient back to the owning ranks.
        """
        return gather_prefix(x, self.group, record=self._record("gather"))


def comm_table(rows: dict[str, dict[str, int]], title: str = "CP bytes per layer (this rank)") -> str:
    """Plain-text table of :meth:`CommLog.by_layer` (or ``by_op``) rows, bytes in KiB."""
    lines = [title, f"{'layer':<28}{'fwd sent':>12}{'fwd recv':>12}{'bwd sent':>12}{'bwd recv':>12}  (KiB)"]
    for name, r in rows.items():
        lines.append(f"{name:<28}" + "".join(f"{r[k] / 1024:>12.1f}" for k in ("fwd_sent", "fwd_recv", "bwd_sent",
                                                                                "bwd_recv")))
    return "\n".join(lines)


__all__ = ["ContextParallel", "comm_table"]
