"""Differentiable collectives of context parallelism, the slice rule, and byte accounting (K3_SYSTEMS §7).

A CP group of ``c`` ranks splits one sequence of ``T`` tokens into contiguous slices: rank ``r``
owns tokens ``[r*T//c, (r+1)*T//c)`` (:func:`split_sizes`, :func:`slice_bounds`). The same split
serves KCP (:mod:`moonrt.comm.cp.kcp`), the short-conv halo and MLA context parallelism, so one mesh
dimension (``cp``, innermost) carries all three.

Collectives here, each an autograd function whose backward sends the gradient the other way:

- :func:`halo_exchange`: the previous rank's last ``width`` tokens (the causal short-conv halo);
  backward returns the halo's gradient to the previous rank (point-to-point, both directions, each rank's
  send and receive in one ``batch_isend_irecv``).
- :func:`gather_prefix`: all-gather of a per-token tensor (the MLA latent), returning every token up
  to the end of this rank's slice; backward is a reduce-scatter (sum) of the gathered gradient.

Bad input must fail on *every* rank instead of hanging the others inside a collective:
:func:`exchange_metadata` runs one small all-gather of integer metadata (plus a per-rank ok flag)
before any real collective, and every rank raises the same :class:`ValueError` when the ranks
disagree or one of them received invalid input.

Byte accounting (:class:`CommLog`): ``sent`` counts the bytes of this rank's own payload that leave
the rank (data multicast to several peers counted once, the convention of K3_SYSTEMS §7's
"H*K*(K+V)*4 bytes per rank"), ``recv`` the bytes of other ranks' payloads that arrive; separately
for the forward and the backward pass.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

# ---------------------------------------------------------------------------------------------
# The slice rule


def split_sizes(total: int, parts: int) -> list[int]:
    """Lengths of the contiguous CP slices of ``total`` tokens over ``parts`` ranks.

    Rank ``r`` owns ``[r*total//parts, (r+1)*total//parts)``; lengths differ by at most one.
    """
    if parts < 1 or total < 0:
        raise ValueError(f"split_sizes(total={total!r}, parts={parts!r}): expected total >= 0 and parts >= 1")
    return [(r + 1) * total // parts - r * total // parts for r in range(parts)]


def slice_bounds(total: int, parts: int, index: int) -> tuple[int, int]:
    """``(start, end)`` of CP slice ``index`` of ``total`` tokens over ``parts`` ranks."""
    if not 0 <= index < parts:
        raise ValueError(f"index = {index!r}: expected 0 <= index < parts ({parts})")
    return index * total // parts, (index + 1) * total // parts


# ---------------------------------------------------------------------------------------------
# Byte accounting


@dataclasses.dataclass(slots=True)
class CommRecord:
    """Bytes moved by one call of one CP collective on this rank (K3_SYSTEMS §7 accounting).

    ``op``: ``"kcp"``, ``"halo"`` or ``"gather"``; ``layer``: the caller's tag (a module name, or
    ``"<op>#<n>"`` for the n-th call of a step when untagged).
    """

    op: str
    layer: str
    fwd_sent: int = 0
    fwd_recv: int = 0
    bwd_sent: int = 0
    bwd_recv: int = 0


class CommLog:
    """Per-layer, per-rank byte counters of the CP collectives of one rank (append-only; ``reset`` per step)."""

    def __init__(self) -> None:
        self.records: list[CommRecord] = []

    def new(self, op: str, layer: str) -> CommRecord:
        rec = CommRecord(op=op, layer=layer)
        self.records.append(rec)
        return rec

    def reset(self) -> None:
        self.records.clear()

    def by_layer(self) -> dict[str, dict[str, int]]:
        """``{layer: {"fwd_sent", "fwd_recv", "bwd_sent", "bwd_recv"}}`` summed over the records, in call order."""
        out: dict[str, dict[str, int]] = {}
        for rec in self.records:
            row = out.setdefault(rec.layer, {"fwd_sent": 0, "fwd_recv": 0, "bwd_sent": 0, "bwd_recv": 0})
            row["fwd_sent"] += rec.fwd_sent
            row["fwd_recv"] += rec.fwd_recv
            row["bwd_sent"] += rec.bwd_sent
            row["bwd_recv"] += rec.bwd_recv
        return out

    def by_op(self) -> dict[str, dict[str, int]]:
        """Like :meth:`by_layer`, keyed by ``op``."""
        out: dict[str, dict[str, int]] = {}
        for rec in self.records:
            row = out.setdefault(rec.op, {"fwd_sent": 0, "fwd_recv": 0, "bwd_sent": 0, "bwd_recv": 0})
            for key in row:
                row[key] += getattr(rec, key)
        return out

    def total(self) -> dict[str, int]:
        keys = ("fwd_sent", "fwd_recv", "bwd_sent", "bwd_recv")
        return {key: sum(getattr(r, key) for r in self.records) for key in keys}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# ---------------------------------------------------------------------------------------------
# Metadata check: one small all-gather before the real collectives

_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def dtype_code(dtype: torch.dtype) -> int:
    """Small integer naming a floating dtype (for metadata exchange); -1 for anything else."""
    return _DTYPES.index(dtype) if dtype in _DTYPES else -1


def dtype_name(code: int) -> str:
    return str(_DTYPES[code]).removeprefix("torch.") if 0 <= code < len(_DTYPES) else "<unsupported>"


def exchange_metadata(
    what: str,
    group: ProcessGroup | None,
    fields: Sequence[str],
    values: Sequence[int] | None,
    error: str | None = None,
    device: torch.device | str | None = None,
) -> list[dict[str, int]]:
    """All-gather one small int64 record per rank; raise on every rank if any rank reported an error.

    ``values`` (one int per name in ``fields``) is this rank's metadata; ``error`` a message when
    this rank's input is already invalid locally (then ``values`` may be ``None``). Returns the
    records of all ranks of ``group`` in group-rank order. The rank with the error raises
    ``ValueError(error)``; the others raise a ``ValueError`` naming that rank, so no rank is left
    waiting in a later collective. ``device``: where the record lives (the inputs' device, so an NCCL
    group gets a CUDA tensor).
    """
    size = dist.get_world_size(group)
    rank = dist.get_rank(group)
    mine = torch.zeros(len(fields) + 1, dtype=torch.int64, device=device)
    if error is None:
        if values is None or len(values) != len(fields):
            raise ValueError(f"{what}: metadata {values!r} does not match fields {list(fields)}")
        mine[0] = 1
        mine[1:] = torch.tensor([int(v) for v in values], dtype=torch.int64, device=device)
    bufs = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(bufs, mine, group=group)
    bad = [r for r in range(size) if int(bufs[r][0]) != 1]
    if error is not None:
        raise ValueError(f"{what}: {error} (CP rank {rank} of {size})")
    if bad:
        raise ValueError(
            f"{what}: CP rank(s) {bad} of {size} received invalid input (their own error names the field); "
            f"this rank (CP rank {rank}) stops too instead of waiting in the next collective"
        )
    return [dict(zip(fields, (int(x) for x in b[1:].tolist()))) for b in bufs]


def require_same(what: str, table: list[dict[str, int]], field: str, label: str | None = None) -> int:
    """Raise ``ValueError`` unless ``table[r][field]`` is equal on every rank; return the common value."""
    vals = [row[field] for row in table]
    if any(v != vals[0] for v in vals):
        shown = [dtype_name(v) for v in vals] if field == "dtype" else vals
        raise ValueError(
            f"{what}: {label or field} differs across CP ranks: {shown} (rank 0..{len(vals) - 1}); "
            f"expected the same value on every rank"
        )
    return vals[0]


def require_split(what: str, lengths: list[int], minimum: int = 1) -> None:
    """Raise ``ValueError`` unless the slice lengths are the contiguous split of their sum (:func:`split_sizes`)."""
    total = sum(lengths)
    expected = split_sizes(total, len(lengths))
    if lengths != expected:
        raise ValueError(
            f"{what}: slice lengths T_r = {lengths} across CP ranks: expected the contiguous split of "
            f"T = {total} over {len(lengths)} ranks, {expected} (rank r owns [r*T//c, (r+1)*T//c))"
        )
    if min(lengths) < minimum:
        raise ValueError(
            f"{what}: slice lengths T_r = {lengths}: expected every slice to hold at least {minimum} token(s) "
            f"(T = {total} is too short for {len(lengths)} CP ranks)"
        )


# ---------------------------------------------------------------------------------------------
# Short-conv halo (point-to-point to the next rank; gradient back to the previous rank)


def _p2p(send: torch.Tensor | None, dst: int | None, recv: torch.Tensor | None, src: int | None,
         group: ProcessGroup | None) -> None:
    """One ``batch_isend_irecv`` of this rank's send (to group rank ``dst``) and receive (from ``src``), waited on.

    The halo is a chain (every rank sends to the next and receives from the previous), so each link's two ranks
    meet in their one group per call: the order NCCL needs (its point-to-point ignores tags and runs in issue
    order per communicator)."""
    ops = []
    if recv is not None:
        ops.append(dist.P2POp(dist.irecv, recv, group=group, group_peer=src))
    if send is not None:
        ops.append(dist.P2POp(dist.isend, send.contiguous(), group=group, group_peer=dst))
    for w in dist.batch_isend_irecv(ops) if ops else []:
        w.wait()


class _Halo(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, width: int, group: ProcessGroup | None, rank: int, size: int,
                record: CommRecord | None) -> torch.Tensor:
        ctx.meta = (width, group, rank, size, record, x.shape)
        b, _, c = x.shape
        prefix = x.new_zeros(b, width, c)
        send = x[:, -width:, :] if rank < size - 1 else None
        _p2p(send, rank + 1, prefix if rank > 0 else None, rank - 1, group)
        if record is not None:
            record.fwd_sent += _nbytes(send) if send is not None else 0
            record.fwd_recv += _nbytes(prefix) if rank > 0 else 0
        return prefix

    @staticmethod
    def backward(ctx: Any, grad_prefix: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        width, group, rank, size, record, shape = ctx.meta
        grad_x = grad_prefix.new_zeros(shape)
        tail = grad_x[:, -width:, :].contiguous() if rank < size - 1 else None
        _p2p(grad_prefix if rank > 0 else None, rank - 1, tail, rank + 1, group)
        if tail is not None:
            grad_x[:, -width:, :] = tail
        if record is not None:
            record.bwd_sent += _nbytes(grad_prefix) if rank > 0 else 0
            record.bwd_recv += _nbytes(tail) if tail is not None else 0
        return grad_x, None, None, None, None, None


def halo_exchange(x: torch.Tensor, width: int, group: ProcessGroup | None,
                  record: CommRecord | None = None) -> torch.Tensor:
    """The ``width`` tokens before this rank's slice (K3_SYSTEMS §7, short-conv halo).

    ``x [B, T_r, C]`` (any float dtype): this rank's pre-conv activations. Returns ``[B, width, C]``
    in ``x.dtype``: the previous CP rank's last ``width`` tokens, zeros on CP rank 0 (causal
    padding). Backward: the halo's gradient goes back to the previous rank and is added to the
    gradient of its last ``width`` tokens. Collective over ``group`` (every rank must call it with
    the same ``width``, ``B``, ``C`` and dtype, and ``T_r >= width``: checked by one metadata
    all-gather, raising ``ValueError`` on every rank otherwise).
    """
    what = "conv halo"
    error = None
    if x.dim() != 3:
        error = f"x shape {tuple(x.shape)}: expected [B, T, C]"
    elif width < 1:
        error = f"width = {width!r}: expected an integer >= 1"
    values = None if error else [x.shape[0], x.shape[1], x.shape[2], width, dtype_code(x.dtype)]
    table = exchange_metadata(what, group, ("B", "T", "C", "width", "dtype"), values, error, device=x.device)
    for field, label in (("B", "batch size B"), ("C", "channel count C"), ("width", "halo width"),
                         ("dtype", "dtype")):
        require_same(what, table, field, label)
    require_split(what, [row["T"] for row in table], minimum=width)
    return _Halo.apply(x, width, group, dist.get_rank(group), dist.get_world_size(group), record)


# ---------------------------------------------------------------------------------------------
# Sequence all-gather (MLA latent) with reduce-scatter backward


class _GatherPrefix(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, lengths: list[int], group: ProcessGroup | None, rank: int,
                record: CommRecord | None) -> torch.Tensor:
        ctx.meta = (lengths, group, rank, record)
        b, t, c = x.shape
        tmax = max(lengths)
        padded = x.new_zeros(b, tmax, c)
        padded[:, :t] = x
        bufs = [torch.empty_like(padded) for _ in lengths]
        dist.all_gather(bufs, padded, group=group)
        bufs[rank] = x  # keep the local slice itself (exact, no copy in the gradient path)
        out = torch.cat([bufs[j][:, : lengths[j]] for j in range(rank + 1)], dim=1)
        if record is not None:
            record.fwd_sent += _nbytes(x)
            record.fwd_recv += (sum(lengths) - t) * b * c * x.element_size()
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        lengths, group, rank, record = ctx.meta
        b, _, c = grad_out.shape
        tmax = max(lengths)
        pieces = []
        start = 0
        for j, length in enumerate(lengths):
            piece = grad_out.new_zeros(b, tmax, c)
            if j <= rank:  # positions past this slice's end were not gathered: zero gradient
                piece[:, :length] = grad_out[:, start:start + length]
            pieces.append(piece)
            start += length
        out = grad_out.new_empty(b, tmax, c)
        dist.reduce_scatter(out, pieces, op=dist.ReduceOp.SUM, group=group)
        t = lengths[rank]
        if record is not None:
            elt = grad_out.element_size()
            record.bwd_sent += (sum(lengths) - t) * b * c * elt
            record.bwd_recv += (len(lengths) - 1) * t * b * c * elt
        return out[:, :t], None, None, None, None


def gather_prefix(x: torch.Tensor, group: ProcessGroup | None,
                  record: CommRecord | None = None) -> tuple[torch.Tensor, int]:
    """All tokens of the sequence up to the end of this rank's slice, and the slice's offset.

    ``x [B, T_r, C]`` (e.g. the MLA latent ``[RMSNorm(c) | k_r]``, K3_SYSTEMS §3): this rank's
    slice. Returns ``(x_prefix [B, offset + T_r, C] in x.dtype, offset)`` where ``offset`` is the
    global position of this slice's first token; later tokens are never needed under a causal mask.
    Backward: a reduce-scatter (sum over ranks) of the gathered gradient returns to each rank the
    gradient of its own slice. Collective over ``group``; B, C and dtype must agree and the slice
    lengths must follow :func:`split_sizes` (checked by one metadata all-gather on every rank).
    """
    what = "sequence all-gather"
    error = None if x.dim() == 3 else f"x shape {tuple(x.shape)}: expected [B, T, C]"
    values = None if error else [x.shape[0], x.shape[1], x.shape[2], dtype_code(x.dtype)]
    table = exchange_metadata(what, group, ("B", "T", "C", "dtype"), values, error, device=x.device)
    for field, label in (("B", "batch size B"), ("C", "channel count C"), ("dtype", "dtype")):
        require_same(what, table, field, label)
    lengths = [row["T"] for row in table]
    require_split(what, lengths)
    rank = dist.get_rank(group)
    return _GatherPrefix.apply(x, lengths, group, rank, record), sum(lengths[:rank])
