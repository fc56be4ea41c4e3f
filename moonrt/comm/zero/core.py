"""The ZeRO-1 sharding core (K3_SYSTEMS §10) that both optimizers' parts stand on: :class:`moonrt.comm.zero.adamw.Zero1`
(AdamW, flat element partition) and :class:`moonrt.comm.zero.muon.ZeroMuon` (Muon, whole blocks per owner, planned
by :mod:`moonrt.scheduler.muon_plan`).

**Buckets.** A bucket is the trainable parameters with the same replica group and dtype: dense parameters over
mesh ``dp_ep_cp`` (every replica of the weight), routed experts under expert parallelism over ``dp_cp`` (the ranks
that hold the same experts). **Units.** A strategy cuts each bucket into units (:class:`Slot`), each owned by one
of the bucket's ``n`` ranks: a piece of a parameter (a flat element range, the whole parameter, or one ``[a, b]``
Muon block of it) at an offset in its owner's **segment**. Rank ``r``'s segment is its units in order, padded with
zeros to ``S`` (the largest segment), so a bucket's packed ``[n * S]`` tensor is every rank's segment in rank order.
Per step and bucket there is one ``reduce_scatter_single`` (sum) of the packed gradient ``[n * S] -> [S]`` (each
owner receives the summed gradient of its units, no whole-matrix gather; sent and summed in the job's reduce dtype,
:mod:`moonrt.comm.grad_reduce`, into the fp32 shard), one ``all_gather_single`` ``[S] -> [n *
S]`` of the updated units, unpacked into every parameter, and one small all-reduce of ``[P]`` "had a gradient"
flags (``P`` parameters: one no rank produced a gradient for is skipped exactly as torch skips ``grad is None``).
Gloo implements both bucketed collectives; on torch versions without the ``*_single`` names the ``*_tensor``
names are used. The ``[P]`` step counts are the only replicated optimizer state.

**Why two partitions.** A flat partition (Zero1: the bucket's parameters concatenated into ``L`` elements, ``S =
ceil(L / n)``, rank ``r`` owning ``[r*S, (r+1)*S)``; a parameter may straddle owners) balances bytes to within
``n - 1`` padding elements; per-parameter ownership of ~200 tensors of very uneven size leaves the largest owner far
above ``1/n``. But Newton-Schulz needs a whole matrix block on one rank, which a flat cut can split, so ZeroMuon's
units are whole blocks and whole AdamW parameters, balanced by optimizer FLOPs (greedy LPT), with shards padded to
the largest owner. Both are the same packed layout here; only the plan and the update differ.

**Norm.** Every rank of the job owns a disjoint piece of every parameter it contributes to (dense pieces over
``dp_ep_cp`` at each stage, expert pieces over ``dp_cp`` at each EP rank), so the fp64 sum over *all* ranks of the
squared segment gradients is the squared single-process gradient norm (:attr:`Part.counts_every_rank`; one
all-reduce over ``norm_group``); the clip scales the segments.

**Composition** (kind ``zero`` of :data:`moonrt.comm.compose.COMPOSITION`). Expert parallelism: the EP part is
``ep`` (set by :meth:`ZeroCore.wrap`), after this part in ``Parallelism.parts``; it says which parameters are experts
and which rows of the experts' checkpoint state this rank holds. Pipeline parallelism: the
mesh groups lie inside one ``pp`` coordinate, so each pipeline rank shards only its stages' parameters; the
pipeline part sums the pseudo-query gradients over pp first (its ``sync_grads`` returns False), names in
:attr:`ZeroCore.duplicates` those another pp rank counts in the norm, delegates the clip here and combines this
part's single-process state over the stages.

**Checkpoints** speak the single-process layout: :meth:`ZeroCore.describe` says which pieces of the optimizer state
this rank owns (an owned flat piece is a range of the flattened parameter, an owned Muon block a box of its shape)
and the generic functions of :mod:`moonrt.comm.state.describe` gather them, scatter into them or hand them to DCP.
A strategy (the subclass) supplies :meth:`ZeroCore._plan` (its units), :meth:`ZeroCore._prepare` (the
optimizer check), :meth:`ZeroCore.step`, :meth:`ZeroCore._unit_state` / :meth:`ZeroCore._state_shard` (where its
state lives) and :meth:`ZeroCore._reset_state`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from moonrt.comm.grad_reduce import reduce_scatter_grad
from moonrt.comm.mesh import Group
from moonrt.comm.parallelism import ExpertSharding, GradNorm, Part
from moonrt.config import ConfigError
from moonrt.ops.muon import Blocking, block_view

if TYPE_CHECKING:
    from moonrt.comm.mesh import ProcessMesh
    from moonrt.comm.state.describe import StateDescription
    from moonrt.comm.state.shards import Shard


def size_rank(group: Any) -> tuple[int, int]:
    """``(size, rank)`` of ``group`` (None: the default group); ``(1, 0)`` without torch.distributed."""
    if not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def all_gather(out: torch.Tensor, shard: torch.Tensor, group: Any) -> None:
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, shard, group=group)


def gather_shards(shard: torch.Tensor, group: Any, size: int, copy: bool = True) -> torch.Tensor:
    """``[S] -> [size * S]`` over ``group`` in rank order; with one replica ``shard`` itself (a copy if ``copy``)."""
    if size == 1:
        return shard.clone() if copy else shard
    full = shard.new_empty(size * shard.numel())
    all_gather(full, shard, group)
    return full


def scatter_grads(flat: torch.Tensor, out: torch.Tensor, flags: torch.Tensor, group: Any, size: int,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The gradient tail of a sharded step: reduce-scatter (sum) ``flat [size * S]``, laid out in the owners'
    order, into this rank's ``out [S]``, sent and summed in ``dtype``
    (:func:`moonrt.comm.grad_reduce.reduce_scatter_grad`; a copy with one replica) and sum the ``[P]`` "had a
    gradient" flags (fp32) over ``group`` (``flags`` on the device of ``out``: the collectives' device); returns
    ``[P]`` bool on the host (the step bookkeeping reads it per parameter), True where any replica produced that
    parameter's gradient."""
    if size > 1:
        reduce_scatter_grad(out, flat, group, dtype)
        dist.all_reduce(flags, group=group)
    else:
        out.copy_(flat)
    return (flags > 0).cpu()


def _host_counts(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[n]`` fp64 step counts and ``[n]`` bool had-a-gradient flags, zero, on the host: per-parameter bookkeeping
    that the step reads as Python numbers (one host copy of the flags per bucket and step, none per parameter)."""
    return torch.zeros(n, dtype=torch.float64, device="cpu"), torch.zeros(n, dtype=torch.bool, device="cpu")


def every_rank(value: int, device: torch.device | None = None) -> list[int]:
    """``value`` of every rank of the default group, in global rank order (one all-gather; ``[value]`` alone)."""
    mine = torch.tensor([value], dtype=torch.int64, device=device)
    world = size_rank(None)[0]
    if world == 1:
        return [value]
    rows = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(rows, mine)
    return [int(r) for r in rows]


@dataclasses.dataclass(frozen=True, slots=True)
class Slot:
    """One unit: elements ``[start, start + numel)`` of parameter ``param`` flattened (``block`` -1), or its Muon
    block ``block`` (``block_view``'s numbering), at ``[offset, offset + numel)`` of rank ``owner``'s segment and
    viewed there as ``shape`` (a block: ``(a, b)``)."""

    param: int
    block: int
    start: int
    shape: tuple[int, ...]
    owner: int
    offset: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclasses.dataclass
class Bucket:
    """One replica group (``kind`` ``"dense"`` / ``"expert"``, ``size`` ranks, this one ``rank``) and dtype:
    ``params`` (parameter indices), ``owned[r]`` (rank ``r``'s unit ids, segment order), the segment size ``shard``
    ``S``, ``grad [S]`` (the summed gradient of this rank's units) and the plan's ``imbalance`` (largest owner's
    cost over the mean)."""

    kind: str
    group: Any
    size: int
    rank: int
    params: list[int]
    owned: list[list[int]]
    shard: int
    grad: torch.Tensor
    imbalance: float = 1.0

    @property
    def mine(self) -> list[int]:
        """This rank's unit ids, in segment order."""
        return self.owned[self.rank]


class ZeroCore(Part):
    """A ZeRO-1 part's shared frame (see the module docstring); a strategy subclasses it.

    Args:
        dense: group of the dense parameters' replicas (mesh ``dp_ep_cp``; None: the default group).
        experts: group of the routed experts' replicas (mesh ``dp_cp``); needed when ``ep`` is given.
        ep: the job's expert-parallel part, as the :class:`~moonrt.comm.parallelism.ExpertSharding` ZeRO asks
            of it (which parameters are experts, EP gather of checkpoints); also set by
            :func:`moonrt.comm.compose.compose` (:meth:`wrap`).
        norm_group: the ranks whose shards together hold the whole model once (None: the default group).
    """

    kind = "zero"
    counts_every_rank = True

    def __init__(self, dense: Any = None, experts: Any = None, *, ep: ExpertSharding | None = None,
                 norm_group: Any = None) -> None:
        if ep is not None and experts is None and size_rank(None)[0] > 1:
            raise ConfigError(f"{type(self).__name__}: ep given without the experts' replica group "
                              f"(mesh group {Group.DP_CP.value!r})")
        self.dense, self.experts, self.ep, self.norm_group = dense, experts, ep, norm_group
        self.duplicates: set[str] = set()
        """Names of parameters whose (synced) gradient on this rank is a copy of another rank's that the norm
        already counts (given by the pipeline part through :meth:`accept_duplicates`: the pseudo-queries on all pp
        ranks but one)."""
        self.names: list[str] = []
        self.params: list[nn.Parameter] = []
        self.blocks: dict[int, Blocking | None] = {}
        """Parameter index -> blocking, for the parameters cut into Muon blocks (the rest: flat units)."""
        self.slots: list[Slot] = []
        self.bucket_of: list[int] = []
        """Unit id -> index of its bucket."""
        self.buckets: list[Bucket] = []
        self.reduce_dtype = torch.float32
        """The dtype the last :meth:`sync_grads` summed gradients in (its wire dtype; :meth:`comm_bytes`)."""
        self.steps, self.had_grad = _host_counts(0)
        """``[P]`` replicated, on the host: optimizer steps taken by each parameter (state exists when > 0), and
        whether it had a gradient in the last step."""

    @classmethod
    def from_mesh(cls, mesh: ProcessMesh, ep: ExpertSharding | None = None, **kwargs: Any) -> ZeroCore:
        """Dense parameters over ``dp_ep_cp``, experts over ``dp_cp``, norm over the default group."""
        return cls(mesh.group(Group.DP_EP_CP), mesh.group(Group.DP_CP), ep=ep, **kwargs)

    def wrap(self, inner: Part) -> None:
        """The expert part (:func:`moonrt.comm.compose.compose`): which parameters are experts, their EP gather.
        TypeError for a part that is not an :class:`~moonrt.comm.parallelism.ExpertSharding`."""
        if not isinstance(inner, ExpertSharding):
            raise TypeError(f"{type(self).__name__} wraps an expert-sharding part (is_expert, shard_map); "
                            f"got {type(inner).__name__}")
        self.ep = inner

    def wrapped(self) -> Part | None:
        """The expert part, whose checkpoint description this one refines (None when the experts are not sharded by
        a part, e.g. an :class:`~moonrt.comm.parallelism.ExpertSharding` given to :meth:`from_mesh` alone)."""
        return self.ep if isinstance(self.ep, Part) else None

    def accept_duplicates(self, names: set[str]) -> None:
        """Leave ``names`` out of the norm (:meth:`grad_norm`): another pp rank counts their gradient."""
        self.duplicates = set(names)

    @property
    def mine(self) -> list[int]:
        """Ids of every unit this rank owns (all buckets)."""
        return [u for b in self.buckets for u in b.mine]

    # ---- the strategy's hooks ---------------------------------------------------------------------
    def _plan(self, model: nn.Module, members: list[int], size: int) -> tuple[list[list[Slot]], float]:
        """Units of one bucket's parameters ``members`` over ``size`` ranks: per rank its slots in segment order
        (offsets from 0, no gaps), and the plan's imbalance."""
        raise NotImplementedError

    def _prepare(self, model: nn.Module | None, optim: torch.optim.Optimizer) -> None:
        """Layout (when ``model`` is given) and check that ``optim`` is the optimizer this strategy shards."""
        raise NotImplementedError

    def _reset_state(self) -> None:
        """Make this rank's owned state fresh (zeros, step 0)."""
        raise NotImplementedError

    def _unit_state(self, u: int) -> dict[str, torch.Tensor]:
        """The state of owned unit ``u`` by single-process key (``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``,
        ``step``), each shaped like the unit's piece; views of this rank's state (DCP loads into them)."""
        raise NotImplementedError

    def _state_shard(self, j: int, key: str) -> torch.Tensor:
        """``[S]``: this rank's segment of bucket ``j`` filled with its units' ``key`` state (Muon blocks put
        their momentum at ``exp_avg``; zeros where a unit has no such state)."""
        raise NotImplementedError

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds."""
        raise NotImplementedError

    # ---- layout ------------------------------------------------------------------------------------
    def _layout(self, model: nn.Module) -> list[Bucket]:
        """Plan the buckets once (after every part's ``parallelize``, which may replace parameters)."""
        if self.buckets or self.params:
            return self.buckets
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.names, self.params = [n for n, _ in named], [p for _, p in named]
        for kind, group, size, rank, members in self.replica_buckets(named):
            plan, imbalance = self._plan(model, members, size)
            owned = []
            for slots in plan:
                owned.append(list(range(len(self.slots), len(self.slots) + len(slots))))
                self.slots += slots
                self.bucket_of += [len(self.buckets)] * len(slots)
            shard = max((sum(s.numel for s in slots) for slots in plan), default=0)
            p = self.params[members[0]]
            self.buckets.append(Bucket(kind, group, size, rank, members, owned, shard,
                                       torch.zeros(shard, dtype=p.dtype, device=p.device), imbalance))
        self.steps, self.had_grad = _host_counts(len(self.params))
        self._reset_state()
        return self.buckets

    def replica_buckets(self, named: list[tuple[str, nn.Parameter]]) -> Iterator[tuple[str, Any, int, int, list[int]]]:
        """``(kind, group, size, rank, members)`` per bucket: ``members`` the indices into ``named`` (trainable
        parameters) with the same replica kind (``"dense"`` / ``"expert"``) and dtype, buckets in first-appearance
        order; ``size``/``rank`` of this rank in the bucket's group."""
        keys: dict[tuple[str, torch.dtype], list[int]] = {}
        for i, (_, p) in enumerate(named):
            kind = "expert" if self.ep is not None and self.ep.is_expert(p) else "dense"
            keys.setdefault((kind, p.dtype), []).append(i)
        for (kind, _), members in keys.items():
            group = self.experts if kind == "expert" else self.dense
            yield (kind, group, *size_rank(group), members)

    def _piece(self, t: torch.Tensor, s: Slot) -> torch.Tensor:
        """Unit ``s`` of a tensor shaped like its parameter: its ``[a, b]`` block or its elements viewed as
        ``s.shape`` (views of a contiguous ``t``: writes go to ``t``)."""
        if s.block >= 0:
            return block_view(t, self.blocks[s.param], s.block)
        return t.reshape(-1)[s.start:s.start + s.numel].view(s.shape)

    def _seg(self, flat: torch.Tensor, u: int) -> torch.Tensor:
        """Unit ``u``'s piece (viewed as its ``shape``) of its owner's ``[S]`` segment buffer ``flat``."""
        s = self.slots[u]
        return flat[s.offset:s.offset + s.numel].view(s.shape)

    def _pack(self, b: Bucket, tensors: list[torch.Tensor | None]) -> torch.Tensor:
        """``[n * S]``: every rank's segment of bucket ``b`` from per-parameter ``tensors`` (None: zeros), each
        segment padded with zeros to ``S``."""
        pieces = []
        for units in b.owned:
            for u in units:
                s = self.slots[u]
                t = tensors[s.param]
                pieces.append(self._piece(t, s).reshape(-1) if t is not None else b.grad.new_zeros(s.numel))
            pad = b.shard - sum(self.slots[u].numel for u in units)
            if pad:
                pieces.append(b.grad.new_zeros(pad))
        return torch.cat(pieces) if pieces else b.grad.new_zeros(0)

    def _unpack(self, b: Bucket, full: torch.Tensor, targets: list[torch.Tensor]) -> None:
        """Copy every unit of bucket ``b``'s gathered ``[n * S]`` into its piece of ``targets[param]``."""
        for r, units in enumerate(b.owned):
            for u in units:
                s = self.slots[u]
                dst = self._piece(targets[s.param], s)
                dst.copy_(full[r * b.shard + s.offset:][:s.numel].view(dst.shape))

    # ---- per-step verbs ----------------------------------------------------------------------------
    def sync_grads(self, model: nn.Module, reduce_dtype: torch.dtype = torch.float32) -> bool:
        """Reduce-scatter (sum, in ``reduce_dtype``) every gradient into its owners' segments, per bucket; frees
        ``p.grad``."""
        self.reduce_dtype = reduce_dtype
        for b in self._layout(model):
            flags = torch.tensor([self.params[i].grad is not None for i in b.params], dtype=torch.float32,
                                 device=b.grad.device)
            flat = self._pack(b, [p.grad for p in self.params])
            self.had_grad[b.params] = scatter_grads(flat, b.grad, flags, b.group, b.size, reduce_dtype)
            del flat
        for p in self.params:
            p.grad = None
        return True

    def grad_norm(self, params: list[torch.Tensor]) -> GradNorm:
        """The segment gradients' squares (fp64) summed over ``norm_group`` (every rank: disjoint units), the
        units of :attr:`duplicates` left out; the clip scales the segments."""
        shards = [b.grad for b in self.buckets]
        sq = torch.zeros((), dtype=torch.float64, device=shards[0].device if shards else None)
        for g in shards:
            sq += g.double().pow(2).sum()
        for b in self.buckets:  # copies counted on another rank (pipeline: pseudo-queries)
            for u in b.mine:
                if self.names[self.slots[u].param] in self.duplicates:
                    sq -= self._seg(b.grad, u).double().pow(2).sum()
        return GradNorm([(sq, (self.norm_group,))], shards)

    def step_metrics(self, step: int, model: nn.Module, record: dict[str, Any]) -> None:
        """``optimizer_state_bytes``: every rank's optimizer state bytes (:meth:`state_bytes`), global rank order."""
        dev = self.buckets[0].grad.device if self.buckets else None
        record["optimizer_state_bytes"] = every_rank(self.state_bytes(), dev)

    def comm_bytes(self) -> int:
        """Bytes one rank sends and receives per step in the bucketed collectives (ring: ``(n-1) * S`` elements
        each way for the reduce-scatter, in :attr:`reduce_dtype`, and again for the all-gather, in the parameters'
        dtype, per bucket)."""
        wire = self.reduce_dtype.itemsize
        return sum(2 * (b.size - 1) * b.shard * (wire + b.grad.element_size()) for b in self.buckets)

    # ---- checkpoint state: this rank's owned pieces (moonrt.comm.state.describe does the rest) -----------------
    def describe(self, model: nn.Module, optim: torch.optim.Optimizer, desc: StateDescription) -> StateDescription:
        """The optimizer state of every parameter as this rank holds it (:meth:`_owned_entries`), loaded back by
        :meth:`_finish_load`; the model as ``desc`` (the expert part's, or one process's) has it."""
        self._prepare(model, optim)
        desc.optimizer = self._owned_entries
        desc.finish = lambda entries: self._finish_load(optim, entries)
        return desc

    def _owned_entries(self, desc: StateDescription) -> dict[str, Any]:
        """Per parameter with an owned unit, an owned flat piece's moments as the range ``[start, start + numel)`` of
        the flattened single-process parameter (under EP, ``desc.shards``: from row ``first`` of ``[E, ...]``) and
        the owned Muon blocks' ``momentum_buffer`` as boxes of the single-process shape (:func:`block_box`; several
        blocks of one parameter: :class:`Boxes`); ``.step`` of every parameter (replicated: DCP writes one copy).
        The entries are views of this rank's state, so they are also the load targets (a Muon unit with no step yet
        holds zeros, which Muon's first step treats as no buffer, bit for bit)."""
        from moonrt.comm.state.shards import MOMENTS, MOMENTUM, Boxes, block_box, flat_shard

        out: dict[str, Any] = {}
        boxes: dict[int, list[Shard]] = {}
        for u in self.mine:
            s, st = self.slots[u], self._unit_state(u)
            p, name = self.params[s.param], self.names[s.param]
            shape, first = desc.shards.get(id(p), (tuple(p.shape), 0))
            if s.block >= 0:
                boxes.setdefault(s.param, []).append(
                    block_box(st[MOMENTUM], p.shape, self.blocks[s.param], s.block, shape, first))
            else:
                row = p[0].numel() if p.dim() else 1
                for key in MOMENTS:
                    out[f"optimizer.{name}.{key}"] = flat_shard(st[key], math.prod(shape), first * row + s.start)
        for i, parts in boxes.items():
            out[f"optimizer.{self.names[i]}.{MOMENTUM}"] = parts[0] if len(parts) == 1 else Boxes(parts[0].shape, parts)
        for i, name in enumerate(self.names):
            out[f"optimizer.{name}.step"] = self.steps[i].clone()
        return out

    def _finish_load(self, optim: torch.optim.Optimizer, entries: dict[str, Any]) -> None:
        """The owned state was read into the :meth:`_owned_entries` views in place; take the step counts (the owned
        units' ``step`` too), keep ``optim.state`` empty."""
        for i, name in enumerate(self.names):
            self.steps[i] = float(entries[f"optimizer.{name}.step"])
        for u in self.mine:
            st = self._unit_state(u)
            if "step" in st:
                st["step"].fill_(self.steps[self.slots[u].param])
        optim.state.clear()
