"""Pipeline executor: runs one rank's lowered action list over torch.distributed point-to-point (K3_SYSTEMS §9).

The model is cut into ``C = pp * vpp`` contiguous decoder-layer ranges (``model.stages(C)``); stage ``s``
runs on rank ``schedule.rank_of(s)``. Stage 0 embeds the tokens, the last stage runs the head and the loss
(summed over tokens, times ``scale`` = 1 / global token count, so the pipeline's loss is the
single-process global-batch mean). The runtime reaches the model only through its stage API
(``embed_tokens``, ``run_layers``, ``head``; the stream is an object with ``blocks`` and ``partial``).

Actions (the schedule IR of :mod:`moonrt.scheduler.pipeline`): ``F`` forward, ``B`` full backward, ``I``
input-gradient backward (``torch.autograd.backward(inputs=<the stage's received tensors>,
retain_graph=True)``), ``W`` weight-gradient backward (``inputs=<the stage's parameters>``), and
``SEND_F`` / ``RECV_F`` / ``SEND_B`` / ``RECV_B``. Communication goes out in
:class:`~moonrt.scheduler.pipeline_p2p.P2PGroup` s (:func:`moonrt.scheduler.pipeline_p2p.p2p_groups`), each one
``dist.batch_isend_irecv`` of all its sends and receives, which is what NCCL needs (tags ignored, one stream per
communicator: a send and a receive between two ranks that wait on each other must be in one group; the groups'
order is proven deadlock-free there); a bare communication action in the list is a group of its own. A receive is
posted with its group and waited on right before the compute action that reads it (``recv_wait_s``); a send's
handle is kept with its buffers and waited on before they are released (completed sends are reaped after every
action; the rest at the backward that frees the buffers, and at the end of the step). Every tensor of a hop has its
own tag, unique per (stage, micro-batch, direction, tensor index) within a step (gloo matches by tag; NCCL pairs a
pair's operations in order, which the grouping makes the same pairs).

AttnRes (K3_SYSTEMS §9): a forward hop ``s -> s+1`` carries the blocks of the hop plan (``sends[s]``), then
the open partial block when one is open at the cut; the backward hop carries the accumulated gradient
of every one of those blocks (:class:`moonrt.comm.pp.cache.BlockCache`, one buffer per block), then
the partial block's gradient.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from moonrt.comm.pp.cache import BlockCache, BlockPlan
from moonrt.comm.pp.idle import IdleClock
from moonrt.ops.precision import token_loss_sum
from moonrt.parallel.context import LOCAL, AttentionContext
from moonrt.parallel.model import trainable
from moonrt.scheduler.pipeline_ir import COMM_OPS
from moonrt.scheduler.pipeline_p2p import P2PGroup


class PipelineError(RuntimeError):
    """A pipeline action failed (usually: a peer rank died); the message names this rank, the action and the peer."""


@dataclasses.dataclass
class _Saved:
    """What a stage's forward of one micro-batch leaves for its backward."""

    leaves: dict[int, torch.Tensor]  # block id -> grad-requiring view used as input
    partial_in: torch.Tensor | None  # the received / handed-over partial block (leaf)
    partial_out: torch.Tensor | None
    produced: dict[int, torch.Tensor]
    loss: torch.Tensor | None
    out_grads: tuple[list[torch.Tensor], list[torch.Tensor | None]] | None = None
    sends: list[Any] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class StepStats:
    """One step of this rank: forward blocks and bytes sent (blocks + partial), backward bytes, wait and wall time."""

    blocks_sent: int = 0
    bytes_sent: int = 0
    bytes_sent_bwd: int = 0
    hops: dict[int, int] = dataclasses.field(default_factory=dict)  # stage s -> blocks sent on hop s -> s+1
    recv_wait_s: float = 0.0
    """Seconds blocked waiting for received tensors (the rank's measured idle time: bubble plus transfer): the host's
    wait on gloo, the CUDA stream's on NCCL (:class:`moonrt.comm.pp.idle.IdleClock`)."""
    wall_s: float = 0.0
    """Seconds of the whole action list (on CUDA: of the stream, between events at its start and end)."""


class _Handle:
    """Completion of one operation of a ``batch_isend_irecv``: its own work where the backend returns one per
    operation (gloo), else every work of the group (NCCL coalesces a group into one)."""

    def __init__(self, works: list[Any]) -> None:
        self.works = works

    def wait(self) -> None:
        for w in self.works:
            w.wait()

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)


@dataclasses.dataclass
class _Posted:
    """A posted receive: its buffers (filled once ``handle`` completes), the peer and what it is for."""

    bufs: list[torch.Tensor]
    handle: _Handle
    src: int
    what: str


class PipelineExecutor:
    """Runs ``actions`` (this rank's list: compute actions and :class:`P2PGroup` s from
    :func:`moonrt.scheduler.pipeline_p2p.p2p_groups`, or a lowered list) of a schedule over the pp ``group``.

    ``plan`` is the :class:`BlockPlan` of the stages; ``rank_of(stage)`` the pipeline rank (index in
    ``group``) that runs a stage; ``stage_of(chunk)`` this rank's global stage of a local chunk;
    ``params_of(stage)`` the stage's parameters (for ``W``).
    """

    def __init__(self, model: nn.Module, plan: BlockPlan, actions: Sequence[Any], *, rank: int,
                 rank_of: Callable[[int], int], stage_of: Callable[[int], int], group: Any,
                 params_of: Callable[[int], Sequence[torch.Tensor]]) -> None:
        self.model, self.plan, self.actions = model, plan, list(actions)
        self.rank, self.rank_of, self.stage_of, self.group = rank, rank_of, stage_of, group
        self.params_of = params_of
        self.last = plan.num_stages - 1
        self.stats = StepStats()
        self.caches: dict[Any, BlockCache] = {}
        self.peak_storages: dict[Any, int] = {}
        self.peak_blocks: dict[Any, int] = {}
        self.keep_outputs = False
        self.outputs: dict[int, torch.Tensor] = {}

    # ---- one step ------------------------------------------------------------------------------
    def run(self, xs: list[torch.Tensor], ys: list[torch.Tensor], scale: float, width: int, dtype: torch.dtype,
            ctx: AttentionContext = LOCAL, saved: Any = None, forward_only: bool = False) -> torch.Tensor:
        """Run every action for micro-batches ``xs[m]`` / ``ys[m]`` ``[b, t]``; returns this rank's summed
        scaled loss (0 on ranks without the last stage) as a detached fp32 scalar.

        ``width``/``dtype``: the stream's ``D`` and dtype (receive buffers); ``saved``: a reusable
        context manager entered around every forward (the activation manager), or None; ``forward_only``:
        the actions have no backward (eval), the state is dropped at the end.
        """
        self.xs, self.ys, self.scale, self.ctx = xs, ys, scale, ctx
        self.shape = (xs[0].shape[0], xs[0].shape[1], width)
        self.dtype = dtype
        self.saved_cm = saved
        self.stats = StepStats()
        self.caches = {}
        self.peak_storages = {}
        self.peak_blocks = {}
        self.outputs = {}
        self.fwd_in: dict[tuple[int, int], torch.Tensor | None] = {}
        self.out_grad: dict[tuple[int, int], torch.Tensor | None] = {}
        self.in_grad: dict[tuple[int, int], torch.Tensor | None] = {}
        self.saved: dict[tuple[int, int], _Saved] = {}
        self.pending: list[tuple[Any, Any, int]] = []  # (send handle, its buffer, peer)
        self.posted: dict[tuple[str, int, int], _Posted] = {}  # (RECV op, stage, micro-batch) -> posted receive
        self.device = xs[0].device
        self.loss = torch.zeros((), dtype=torch.float32, device=self.device)
        self.clock = IdleClock(self.device)  # NCCL: CUDA events (work.wait() does not block the host there)
        self.clock.start()
        for item in self.actions:
            group = item.actions if isinstance(item, P2PGroup) else (item,) if item.op in COMM_OPS else None
            try:
                if group is not None:
                    self._issue(group)
                else:
                    s = self.stage_of(item.chunk)
                    self._arrive(item.op, s, item.microbatch)
                    getattr(self, "_" + item.op.lower())(s, item.microbatch)
            except (RuntimeError, ValueError) as exc:
                if isinstance(exc, PipelineError):
                    raise
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
                what = (f"{item.label()}" if group is not None else
                        f"{item.op} of stage {self.stage_of(item.chunk)}, micro-batch {item.microbatch}")
                raise PipelineError(f"pipeline rank {self.rank}: {what} failed: {first}") from exc
            self.pending = [p for p in self.pending if not p[0].is_completed()]
        for w, _, peer in self.pending:
            self._wait(w, "a send", peer)
        self.pending = []
        if self.posted:
            raise PipelineError(f"pipeline rank {self.rank}: step ended with receives nothing read "
                                f"({sorted(self.posted)}): the action list is incomplete")
        self.stats.recv_wait_s, self.stats.wall_s = self.clock.stop()
        if forward_only:
            self.saved, self.caches = {}, {}
        leftover = [k for k, c in self.caches.items() if c.data]
        if self.saved or leftover:
            raise PipelineError(f"pipeline rank {self.rank}: step ended with live state (stages {sorted(self.saved)}, "
                                f"caches {leftover}): the action list is incomplete")
        return self.loss

    # ---- scopes --------------------------------------------------------------------------------
    def _cache(self, stage: int, mb: int) -> BlockCache:
        key = mb if self.plan.mode == "cached" else (stage, mb)
        if key not in self.caches:
            self.caches[key] = BlockCache()
        return self.caches[key]

    def _note_peak(self, stage: int, mb: int) -> None:
        key = mb if self.plan.mode == "cached" else (stage, mb)
        c = self.caches[key]
        self.peak_storages[key] = max(self.peak_storages.get(key, 0), len(c.storages()))
        self.peak_blocks[key] = max(self.peak_blocks.get(key, 0), c.peak)
        if len(c.storages()) != len(c.data):
            raise RuntimeError(f"micro-batch {mb}: {len(c.data)} cached blocks in {len(c.storages())} storages: "
                               "expected each block stored once")

    def _tag(self, stage: int, mb: int, backward: bool, index: int) -> int:
        """Unique per (stage, micro-batch, direction, tensor index) within a step."""
        k = sum(len(p) for p in self.plan.produced) + 1  # more than the tensors of any hop
        return ((stage * len(self.xs) + mb) * 2 + int(backward)) * k + index

    def _wait(self, work: Any, what: str, peer: int) -> None:
        try:
            work.wait()
        except RuntimeError as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
            dead = self._first_dead(peer)
            lost = f" (this rank lost pipeline rank {peer}, which stopped after it)" if dead != peer else ""
            who = f"pipeline rank {dead}" if dead >= 0 else "a peer pipeline rank"
            raise PipelineError(f"pipeline rank {self.rank}: {what} failed: {who} died or left the job{lost}: "
                                f"{first}") from exc

    def _first_dead(self, peer: int) -> int:
        """The first pipeline rank of this pipeline reported lost (by any of its ranks), else ``peer``.

        The first rank that loses a peer records it in the job's rendezvous store; ranks that fail later
        (because that rank stopped in turn) name the original one. Without a reachable store: ``peer``.
        """
        try:
            store = dist.distributed_c10d._get_default_store()
            key = f"moonrt/pp/dead/{self._global(0)}"
            return int(store.compare_set(key, "", str(peer)).decode())
        except (AttributeError, RuntimeError, ValueError):
            return peer

    def _global(self, pp_rank: int) -> int:
        return dist.get_global_rank(self.group, pp_rank) if self.group is not None else pp_rank

    def _exchange(self, sends: list[tuple[list[torch.Tensor], int, int, bool, int]],
                  recvs: list[tuple[int, int, int, bool, int, str]]) -> tuple[list[list[Any]], list[_Posted]]:
        """One ``batch_isend_irecv`` of every tensor of ``sends`` (``(tensors, hop stage, micro-batch, backward,
        dst)``) and of ``recvs`` (``(n, hop stage, micro-batch, backward, src, what)``: ``n`` fresh buffers of the
        stream's shape and dtype on this step's device). The hop stage is the sending stage, so a send and its
        receive have the same tags. Returns per send its ``(handle, tensor, dst)`` triples (also kept in
        ``pending``), per receive its :class:`_Posted` (wait with :meth:`_recv_wait`)."""
        ops: list[dist.P2POp] = []
        sent: list[list[Any]] = []
        for tensors, stage, mb, backward, dst in sends:
            row = []
            for i, t in enumerate(tensors):
                t = t.detach().contiguous()
                ops.append(dist.P2POp(dist.isend, t, self._global(dst), self.group, self._tag(stage, mb, backward, i)))
                row.append((t, dst))
                nbytes = t.numel() * t.element_size()
                if backward:
                    self.stats.bytes_sent_bwd += nbytes
                else:
                    self.stats.bytes_sent += nbytes
            sent.append(row)
        got: list[list[torch.Tensor]] = []
        for n, stage, mb, backward, src, _ in recvs:
            bufs = [torch.empty(self.shape, dtype=self.dtype, device=self.device) for _ in range(n)]
            ops += [dist.P2POp(dist.irecv, b, self._global(src), self.group, self._tag(stage, mb, backward, i))
                    for i, b in enumerate(bufs)]
            got.append(bufs)
        works = list(dist.batch_isend_irecv(ops)) if ops else []
        per_op = len(works) == len(ops)
        handles = iter([_Handle([w]) for w in works] if per_op else [_Handle(works)] * len(ops))
        sends_out = [[(next(handles), t, dst) for t, dst in row] for row in sent]
        for sends_posted in sends_out:
            self.pending.extend(sends_posted)
        posted = []
        for (_, _, _, _, src, what), bufs in zip(recvs, got):
            mine = [next(handles) for _ in bufs]
            posted.append(_Posted(bufs, _Handle([w for h in mine for w in h.works] if per_op else works), src, what))
        return sends_out, posted

    def _recv_wait(self, posted: _Posted) -> list[torch.Tensor]:
        """Wait for a posted receive; its buffers."""
        self.clock.wait(lambda: self._wait(posted.handle, posted.what, posted.src))
        return posted.bufs

    def _issue(self, group: tuple[Any, ...]) -> None:
        """Post one group of communication actions (one ``batch_isend_irecv``)."""
        sends, senders, recvs, keys = [], [], [], []
        for a in group:
            s, mb = self.stage_of(a.chunk), a.microbatch
            if a.op == "SEND_F":
                sends.append((self._send_f_tensors(s, mb), s, mb, False, self.rank_of(s + 1)))
                senders.append((a.op, s, mb))
            elif a.op == "SEND_B":
                sends.append((self._send_b_tensors(s, mb), s - 1, mb, True, self.rank_of(s - 1)))
                senders.append((a.op, s, mb))
            elif a.op == "RECV_F":
                recvs.append((len(self.plan.sends[s - 1]) + int(self.plan.partial_in[s]), s - 1, mb, False,
                              self.rank_of(s - 1), f"{a.op} of stage {s}, micro-batch {mb}"))
                keys.append((a.op, s, mb))
            else:
                recvs.append((len(self.plan.sends[s]) + int(self.plan.partial_in[s + 1]), s, mb, True,
                              self.rank_of(s + 1), f"{a.op} of stage {s}, micro-batch {mb}"))
                keys.append((a.op, s, mb))
        sent, posted = self._exchange(sends, recvs)
        for (op, s, mb), row in zip(senders, sent):
            if op == "SEND_F":  # waited on before the backward of (s, mb) frees what it sent
                self.saved[(s, mb)].sends = row
            else:  # the gradients sent are held by the send until it completes
                self._drop_introduced(s, mb)
        for key, p in zip(keys, posted):
            if key in self.posted:
                raise RuntimeError(f"{key[0]} of stage {key[1]}, micro-batch {key[2]} posted twice")
            self.posted[key] = p

    def _arrive(self, op: str, s: int, mb: int) -> None:
        """Before compute ``op`` of (stage ``s``, ``mb``): wait for the receive it reads (posted earlier) and put it
        in place."""
        if op == "F" and s > 0 and self.rank_of(s - 1) != self.rank:
            self._recv_f(s, mb, self._recv_wait(self._take("RECV_F", s, mb)))
        elif op in ("B", "I") and s < self.last and self.rank_of(s + 1) != self.rank:
            self._recv_b(s, mb, self._recv_wait(self._take("RECV_B", s, mb)))

    def _take(self, op: str, s: int, mb: int) -> _Posted:
        posted = self.posted.pop((op, s, mb), None)
        if posted is None:
            raise RuntimeError(f"its {op} was not posted before it (the action list lacks it)")
        return posted

    # ---- compute -------------------------------------------------------------------------------
    def _f(self, s: int, mb: int) -> None:
        plan, model = self.plan, trainable(self.model)
        cache = self._cache(s, mb)
        cm = self.saved_cm if self.saved_cm is not None else contextlib.nullcontext()
        leaves: dict[int, torch.Tensor] = {}
        partial_in = None
        with cm:
            if s == 0:
                state = model.embed_tokens(self.xs[mb])
            else:
                if self.rank_of(s - 1) == self.rank:
                    self._local_forward(s, mb)
                leaves = {b: cache.leaf(b) for b in range(plan.n_in[s])}
                if plan.partial_in[s]:
                    partial_in = self.fwd_in.pop((s, mb))
                state = model.stream([leaves[b] for b in range(plan.n_in[s])], partial_in)
            n0 = len(state.blocks)
            state = model.run_layers(state, plan.layers[s], self.ctx)
            produced = dict(zip(plan.produced[s], state.blocks[n0 - (s == 0):]))
            for b, t in produced.items():
                cache.put(b, t)
            loss = None
            if s == self.last:
                logits = model.head(state)
                if self.keep_outputs:
                    self.outputs[mb] = logits.detach()
                loss = token_loss_sum(logits, self.ys[mb]) * self.scale  # fp32 under bf16 autocast
                self.loss = self.loss + loss.detach().float()
        self._note_peak(s, mb)
        self.saved[(s, mb)] = _Saved(leaves, partial_in, state.partial, produced, loss)

    def _local_forward(self, s: int, mb: int) -> None:
        """Same-rank hop ``s-1 -> s``: the partial block is handed over as a fresh leaf, blocks stay cached."""
        prev = self.saved[(s - 1, mb)]
        if self.plan.partial_in[s]:
            self.fwd_in[(s, mb)] = prev.partial_out.detach().requires_grad_(True)
        if self.plan.mode == "naive":
            src, dst = self._cache(s - 1, mb), self._cache(s, mb)
            for b in range(self.plan.n_in[s]):
                dst.put(b, src.data[b])

    def _output_grads(self, s: int, mb: int) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        sv = self.saved[(s, mb)]
        if sv.loss is not None:
            return [sv.loss], [None]
        cache = self._cache(s, mb)
        tensors: list[torch.Tensor] = []
        grads: list[torch.Tensor | None] = []
        g = self.out_grad.pop((s, mb), None)
        if sv.partial_out is not None and g is not None:
            tensors.append(sv.partial_out)
            grads.append(g)
        for b, t in sv.produced.items():
            if b in cache.grad and t.requires_grad:
                tensors.append(t)
                grads.append(cache.grad[b])
        return tensors, grads

    def _inputs(self, s: int, mb: int) -> list[torch.Tensor]:
        sv = self.saved[(s, mb)]
        return list(sv.leaves.values()) + ([sv.partial_in] if sv.partial_in is not None else [])

    def _b(self, s: int, mb: int) -> None:
        tensors, grads = self._output_grads(s, mb)
        torch.autograd.backward(tensors, grads)
        self._after_input_grads(s, mb)
        self._release(s, mb)

    def _i(self, s: int, mb: int) -> None:
        tensors, grads = self._output_grads(s, mb)
        inputs = self._inputs(s, mb)
        if inputs:
            torch.autograd.backward(tensors, grads, inputs=inputs, retain_graph=True)
        self.saved[(s, mb)].out_grads = (tensors, grads)
        self._after_input_grads(s, mb)

    def _w(self, s: int, mb: int) -> None:
        sv = self.saved[(s, mb)]
        if sv.out_grads is None:
            raise RuntimeError(f"W of stage {s}, micro-batch {mb} before its I")
        tensors, grads = sv.out_grads
        params = [p for p in self.params_of(s) if p.requires_grad]
        torch.autograd.backward(tensors, grads, inputs=params)
        self._release(s, mb)

    def _after_input_grads(self, s: int, mb: int) -> None:
        """Fold the stage's input gradients into the block buffers; hand the partial's grad to a same-rank stage."""
        sv = self.saved[(s, mb)]
        cache = self._cache(s, mb)
        for b, leaf in sv.leaves.items():
            if leaf.grad is not None:
                cache.add_grad(b, leaf.grad)
                leaf.grad = None
        if sv.partial_in is not None:
            self.in_grad[(s, mb)] = sv.partial_in.grad
            sv.partial_in.grad = None
        if s > 0 and self.rank_of(s - 1) == self.rank:  # same-rank hop: no comm action
            if sv.partial_in is not None:
                self.out_grad[(s - 1, mb)] = self.in_grad.pop((s, mb))
            if self.plan.mode == "naive":
                src, dst = self._cache(s, mb), self._cache(s - 1, mb)
                for b in range(self.plan.n_in[s]):
                    if b in src.grad:
                        dst.add_grad(b, src.grad[b])
            self._drop_introduced(s, mb)
        elif s == 0:
            self._drop_introduced(s, mb)

    def _release(self, s: int, mb: int) -> None:
        """Backward of (s, mb) complete: wait on its forward sends, free its saved state."""
        sv = self.saved.pop((s, mb))
        for w, _, _ in sv.sends:
            self._wait(w, f"SEND_F of stage {s}, micro-batch {mb}", self.rank_of(s + 1))

    def _drop_introduced(self, s: int, mb: int) -> None:
        """Free the blocks stage ``s`` brought to this scope (received or produced): their last local use is done."""
        cache = self._cache(s, mb)
        intro = set(self.plan.produced[s])
        if s > 0 and self.rank_of(s - 1) != self.rank:
            intro |= set(self.plan.sends[s - 1])
        elif s > 0 and self.plan.mode == "naive":
            intro |= set(range(self.plan.n_in[s]))
        for b in intro:
            cache.drop(b)
        key = mb if self.plan.mode == "cached" else (s, mb)
        if not cache.data:
            self.caches.pop(key, None)

    # ---- communication: what a hop carries ----------------------------------------------------------
    def _send_f_tensors(self, s: int, mb: int) -> list[torch.Tensor]:
        sv = self.saved[(s, mb)]
        cache = self._cache(s, mb)
        ids = self.plan.sends[s]
        tensors = [cache.data[b] for b in ids]
        if self.plan.partial_in[s + 1]:
            tensors.append(sv.partial_out)
        self.stats.blocks_sent += len(ids)
        self.stats.hops[s] = self.stats.hops.get(s, 0) + len(ids)
        return tensors

    def _recv_f(self, s: int, mb: int, bufs: list[torch.Tensor]) -> None:
        ids = self.plan.sends[s - 1]
        cache = self._cache(s, mb)
        for b, t in zip(ids, bufs):
            cache.put(b, t)
        if self.plan.partial_in[s]:
            self.fwd_in[(s, mb)] = bufs[-1].requires_grad_(True)

    def _send_b_tensors(self, s: int, mb: int) -> list[torch.Tensor]:
        cache = self._cache(s, mb)
        ids = self.plan.sends[s - 1]
        tensors = [cache.grad_or_zeros(b) for b in ids]
        if self.plan.partial_in[s]:
            g = self.in_grad.pop((s, mb))
            tensors.append(g if g is not None else torch.zeros(self.shape, dtype=self.dtype, device=self.device))
        return tensors

    def _recv_b(self, s: int, mb: int, bufs: list[torch.Tensor]) -> None:
        ids = self.plan.sends[s]
        cache = self._cache(s, mb)
        for b, g in zip(ids, bufs):
            cache.add_grad(b, g)
        self.out_grad[(s, mb)] = bufs[-1] if self.plan.partial_in[s + 1] else None


__all__ = ["PipelineError", "PipelineExecutor", "StepStats"]
