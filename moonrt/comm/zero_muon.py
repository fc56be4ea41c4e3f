"""ZeRO-1 for Per-Head Muon: each orthogonalization unit is owned, whole, by one data-parallel rank.

:class:`ZeroMuon` is a :class:`moonrt.comm.parallelism.Part` for ``--zero 1 --optimizer muon`` (K3 report
§2.7 and its infrastructure section: each rank fetches only the pieces of the matrices it owns). A flat
ZeRO-1 partition (:mod:`moonrt.comm.zero`) cuts matrices at arbitrary elements, but Newton-Schulz needs a
whole block on one rank, so here the partition follows the units of :mod:`moonrt.scheduler.muon_plan`:
every Muon block (a head's rows of a Q/K/V projection, one expert's matrix, a whole dense matrix) and every
AdamW parameter (embedding, norms, router, LM head: whole, AdamW is element-wise) goes to exactly one rank,
balanced by optimizer FLOPs.

Layout: rank ``r``'s **segment** is the concatenation of its units' elements (block layout ``[a, b]``
row-major, units in index order), padded with zeros to ``S`` = the largest segment. Per step and bucket:

- :meth:`ZeroMuon.sync_grads`: every rank packs its full gradient into ``[n * S]`` in the owners' layout
  and one ``reduce_scatter_single`` (sum) leaves rank ``r`` the summed gradient of its own units ``[S]``
  (no whole-matrix gather); one all-reduce of ``[P]`` "had a gradient" flags (torch skips ``grad is None``);
- the clip: the global norm from the disjoint segments (one fp64 all-reduce; the core's ``grad_norm``);
- :meth:`ZeroMuon.step`: the owner runs the momentum, Newton-Schulz and update of its Muon blocks (the
  arithmetic of :class:`moonrt.ops.muon.Muon`, per block) and torch's AdamW on its AdamW parameters, writes
  the new values into ``[S]``, and one ``all_gather_single`` ``[S] -> [n * S]`` gives every rank every
  parameter.

State: the momentum of owned Muon blocks (``[a, b]`` fp32 each) and the two moments of owned AdamW
parameters; nothing else (``optimizer_state_bytes`` per rank in the metrics). Checkpoints speak the
single-process layout: gathered (:meth:`ZeroMuon.full_state_dict` gathers the segments with the same collective)
or sharded for DCP (:meth:`ZeroMuon.sharded_state_dict`: each owned block's momentum is a box of the parameter's
single-process shape, rows or columns, several per parameter on one rank; owned AdamW moments flat ranges).

The buckets, collectives, norm contribution, Part plumbing and checkpoint frame are the shared core's
(:mod:`moonrt.comm.zero_core`, as for :class:`moonrt.comm.zero.Zero1`); this module is the Muon strategy on it.
Buckets: the units of parameters with the same replica group and dtype
are planned, packed and reduced together. Dense parameters are replicated over ``dp_ep_cp`` (data, expert and
context parallel ranks hold the same weight); routed experts under expert parallelism (pass the
:class:`~moonrt.comm.ep_parallel.ExpertParallel` part as ``ep``; ZeroMuon comes *before* it in
``Parallelism.parts``) only over ``dp_cp``, the ranks with the same EP coordinate: each expert's matrix is
owned by one rank of its ``dp_cp`` group, each dense unit by one rank of ``dp_ep_cp``. Checkpoint state is
first (un)sharded over those groups here, then over the EP group by the EP part.

Pipeline parallelism: the mesh groups lie inside one ``pp`` coordinate, so each pipeline rank plans only its
stages' parameters. The pipeline part runs its pseudo-query gradient sum first, then hands clipping to this part
(its norm is global: every rank's units are disjoint, summed over the default group), naming in
:attr:`ZeroMuon.duplicates` the pseudo-queries another pp rank counts; it combines this part's single-process
state of its stages over the pipeline (this part is its ``inner``), as for :class:`~moonrt.comm.zero.Zero1`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from moonrt.comm.zero_core import ZeroCore, gather_shards, scatter_grads
from moonrt.config import ConfigError
from moonrt.ops.muon import (
    NS_DTYPES,
    Blocking,
    Muon,
    adamw_update,
    adjusted_lr,
    block_grid,
    block_view,
    momentum_update,
    zeropower_via_newtonschulz,
)
from moonrt.scheduler.muon_plan import MuonPlan, Unit, plan_units

if TYPE_CHECKING:
    from moonrt.comm.dcp_state import Shard


@dataclasses.dataclass(frozen=True, slots=True)
class _Slot:
    """Unit ``u``: parameter ``param``, block ``block`` (-1: the whole AdamW parameter), of bucket ``bucket``, in its
    owner's segment at ``[offset, offset + numel)``."""

    param: int
    block: int
    rows: int
    cols: int
    bucket: int
    owner: int
    offset: int

    @property
    def numel(self) -> int:
        return self.rows * self.cols


@dataclasses.dataclass
class _Bucket:
    """The units of the parameters with one replica group (dense: ``dp_ep_cp``; routed experts: ``dp_cp``) and
    dtype: ``params`` (parameter indices), ``units`` (global unit ids, ``named_parameters`` order), their ownership
    ``plan`` over the group's ``size`` ranks, and ``grad [S]``: the summed gradient of this rank's units."""

    kind: str
    group: Any
    size: int
    rank: int
    params: list[int]
    units: list[int]
    plan: MuonPlan
    grad: torch.Tensor

    @property
    def mine(self) -> list[int]:
        """Global ids of the units this rank owns, in segment order."""
        return [self.units[j] for j in self.plan.units[self.rank]]


def unit_layout(model: nn.Module, blocks: dict[str, Blocking]
                ) -> tuple[list[tuple[str, nn.Parameter]], list[Unit], list[tuple[int, int, int, int]]]:
    """The trainable parameters, their units (Muon blocks of ``blocks``' parameters, whole AdamW parameters
    otherwise) and per unit ``(parameter index, block index or -1, rows, cols)``, in ``named_parameters`` order."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    units: list[Unit] = []
    raw: list[tuple[int, int, int, int]] = []
    for i, (name, p) in enumerate(named):
        if name in blocks:
            stack, heads, a, b = block_grid(p.shape, blocks[name])
            units += [Unit(a, b)] * (stack * heads)
            raw += [(i, k, a, b) for k in range(stack * heads)]
        else:
            units.append(Unit(p.numel(), 1, muon=False))
            raw.append((i, -1, p.numel(), 1))
    return named, units, raw


class ZeroMuon(ZeroCore):
    """Muon + AdamW with unit ownership inside each parameter's replica group (see the module docstring).

    Args: those of :class:`~moonrt.comm.zero_core.ZeroCore`, and ``assign``: ``model -> {parameter name:
    blocking}`` of the parameters Muon updates (the job's :func:`moonrt.jobs.train.optimizers.muon_blocks`); every
    other trainable parameter is AdamW.
    """

    def __init__(self, dense: Any = None, experts: Any = None, *, assign: Callable[[nn.Module], dict[str, Blocking]],
                 **kwargs: Any) -> None:
        super().__init__(dense, experts, **kwargs)
        self.assign = assign
        self.names: list[str] = []
        self.params: list[nn.Parameter] = []
        self.specs: list[Blocking | None] = []
        self.is_muon: list[bool] = []
        self.slots: list[_Slot] = []
        self.buckets: list[_Bucket] = []
        self.state: dict[int, dict[str, torch.Tensor]] = {}
        """Owned unit -> ``momentum_buffer [a, b]`` (Muon) or ``step``/``exp_avg``/``exp_avg_sq`` (AdamW)."""
        self.steps = torch.zeros(0, dtype=torch.float64)
        """``[P]`` replicated: optimizer steps taken by each parameter (state exists when > 0)."""
        self.had_grad = torch.zeros(0, dtype=torch.bool)

    @property
    def mine(self) -> list[int]:
        """Global ids of every unit this rank owns (all buckets)."""
        return [u for b in self.buckets for u in b.mine]

    # ---- layout ------------------------------------------------------------------------------------
    def _layout(self, model: nn.Module) -> None:
        """Plan the buckets once (after every part's ``parallelize``, which may replace parameters)."""
        if self.buckets or self.params:
            return
        blocks = self.assign(model)
        named, units, raw = unit_layout(model, blocks)
        for name, p in named:
            self.names.append(name)
            self.params.append(p)
            self.is_muon.append(name in blocks)
            self.specs.append(blocks.get(name))
        slots: list[_Slot | None] = [None] * len(raw)
        for kind, group, size, rank, params in self.replica_buckets(named):
            member, dtype = set(params), self.params[params[0]].dtype
            ids = [u for u, r in enumerate(raw) if r[0] in member]
            plan = plan_units([units[u] for u in ids], size)
            for j, u in enumerate(ids):
                slots[u] = _Slot(*raw[u], len(self.buckets), plan.owner[j], plan.offsets[j])
            dev = self.params[params[0]].device
            self.buckets.append(_Bucket(kind, group, size, rank, params, ids, plan,
                                        torch.zeros(plan.shard, dtype=dtype, device=dev)))
        self.slots = [s for s in slots if s is not None]
        self.steps = torch.zeros(len(self.params), dtype=torch.float64)
        self.had_grad = torch.zeros(len(self.params), dtype=torch.bool)
        for b in self.buckets:
            for u in b.mine:
                self.state[u] = self._fresh(self.slots[u])

    def _fresh(self, s: _Slot) -> dict[str, torch.Tensor]:
        p = self.params[s.param]
        if s.block >= 0:
            return {"momentum_buffer": torch.zeros(s.rows, s.cols, dtype=p.dtype, device=p.device)}
        return {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}

    def _piece(self, t: torch.Tensor, s: _Slot) -> torch.Tensor:
        """Unit ``s`` of a tensor shaped like its parameter: ``[a, b]`` block view or the whole tensor."""
        return block_view(t, self.specs[s.param], s.block) if s.block >= 0 else t

    def _pack(self, b: _Bucket, tensors: list[torch.Tensor | None]) -> torch.Tensor:
        """``[n * S]``: every rank's segment of bucket ``b`` from per-parameter ``tensors`` (None: zeros)."""
        plan, pieces = b.plan, []
        for r in range(b.size):
            for j in plan.units[r]:
                s = self.slots[b.units[j]]
                t = tensors[s.param]
                pieces.append(self._piece(t, s).reshape(-1) if t is not None else b.grad.new_zeros(s.numel))
            pad = plan.shard - plan.sizes[r]
            if pad:
                pieces.append(b.grad.new_zeros(pad))
        return torch.cat(pieces) if pieces else b.grad.new_zeros(0)

    def _seg(self, flat: torch.Tensor, u: int) -> torch.Tensor:
        """Unit ``u``'s ``[a, b]`` (or parameter-shaped) piece of its owner's ``[S]`` segment buffer ``flat``."""
        s = self.slots[u]
        piece = flat[s.offset:s.offset + s.numel]
        return piece.view(s.rows, s.cols) if s.block >= 0 else piece.view_as(self.params[s.param])

    def _unpack(self, b: _Bucket, full: torch.Tensor, targets: list[torch.Tensor]) -> None:
        """Copy every unit of bucket ``b``'s gathered ``[n * S]`` into the matching piece of ``targets[param]``."""
        for u in b.units:
            s = self.slots[u]
            src = full[s.owner * b.plan.shard + s.offset:][:s.numel]
            dst = self._piece(targets[s.param], s)
            dst.copy_(src.view(dst.shape))

    @staticmethod
    def _gather(b: _Bucket, mine: torch.Tensor) -> torch.Tensor:
        """``[S] -> [n * S]`` over the bucket's group (a copy with one replica)."""
        return gather_shards(mine, b.group, b.size)

    # ---- per-step verbs ----------------------------------------------------------------------------
    def sync_grads(self, model: nn.Module) -> bool:
        """Reduce-scatter (sum) every gradient into its owner's segment, per bucket; frees ``p.grad``."""
        self._layout(model)
        for b in self.buckets:
            flags = torch.tensor([self.params[i].grad is not None for i in b.params], dtype=torch.float32)
            flat = self._pack(b, [p.grad for p in self.params])
            self.had_grad[b.params] = scatter_grads(flat, b.grad, flags, b.group, b.size)
            del flat
        for p in self.params:
            p.grad = None
        return True

    def _grad_shards(self) -> list[torch.Tensor]:
        return [b.grad for b in self.buckets]

    def _owned_grads(self) -> Iterator[tuple[str, torch.Tensor]]:
        return ((self.names[self.slots[u].param], self._seg(b.grad, u)) for b in self.buckets for u in b.mine)

    def _trainable(self) -> list[tuple[str, nn.Parameter]]:
        return list(zip(self.names, self.params))

    def _prepare(self, model: nn.Module | None, optim: torch.optim.Optimizer) -> None:
        if model is not None:
            self._layout(model)
        self._check(optim)

    def _check(self, optim: torch.optim.Optimizer) -> dict[int, dict[str, Any]]:
        """Parameter index -> its param group; the optimizer must be the job's Muon with this layout."""
        if not isinstance(optim, Muon):
            raise ConfigError(f"optimizer = {type(optim).__name__}: expected moonrt.ops.muon.Muon for ZeroMuon")
        group_of = {id(p): g for g in optim.param_groups for p in g["params"]}
        out = {}
        for i, p in enumerate(self.params):
            g = group_of.get(id(p))
            same = g is not None and g["use_muon"] == self.is_muon[i]
            if not same or (self.is_muon[i] and optim.blocking(p) != self.specs[i]):
                raise ConfigError(f"parameter {self.names[i]}: its optimizer group or blocking differs from the "
                                  "ZeroMuon layout (expected the job's build_optimizer over the same model)")
            out[i] = g
        return out

    @torch.no_grad()
    def step(self, optim: torch.optim.Optimizer) -> bool:
        """Update the owned units, then all-gather every bucket's parameters (one collective per bucket)."""
        groups = self._check(optim)
        targets = [p.detach() for p in self.params]
        for b in self.buckets:
            out = torch.zeros_like(b.grad)
            for u in b.mine:
                s = self.slots[u]
                g = groups[s.param]
                dst = self._seg(out, u)
                dst.copy_(self._piece(targets[s.param], s))
                if not self.had_grad[s.param]:
                    continue
                grad, st = self._seg(b.grad, u), self.state[u]
                if s.block >= 0:
                    upd = momentum_update(grad, st["momentum_buffer"], g["momentum"], g["nesterov"])
                    o = zeropower_via_newtonschulz(upd, g["ns_coefficients"], g["ns_steps"], g["eps"],
                                                   NS_DTYPES[g["ns_dtype"]])
                    dst.mul_(1 - g["lr"] * g["weight_decay"])
                    dst.add_(o, alpha=-adjusted_lr(g["lr"], g["adjust_lr_fn"], s.rows, s.cols))
                else:
                    adamw_update([dst], [grad], [st["exp_avg"]], [st["exp_avg_sq"]], [st["step"]], g)
            self._unpack(b, self._gather(b, out), targets)
        self.steps += self.had_grad.double()
        return True

    # ---- checkpoints (single-process layout) -------------------------------------------------------
    def _gather_state(self, b: _Bucket, key: str) -> torch.Tensor:
        """``[n * S]``: bucket ``b``'s owned units' ``key`` state (Muon: ``momentum_buffer``; AdamW: ``exp_avg``
        or ``exp_avg_sq``; zeros where the unit has no such state) gathered in the owners' layout."""
        mine = torch.zeros_like(b.grad)
        for u in b.mine:
            s, st = self.slots[u], self.state[u]
            k = key if s.block < 0 else ("momentum_buffer" if key == "exp_avg" else None)
            if k is not None:
                self._seg(mine, u).copy_(st[k])
        return self._gather(b, mine)

    def _put_state(self) -> dict[nn.Parameter, dict[str, torch.Tensor]]:
        """Every parameter's state as the single-process :class:`Muon` holds it (gathered per bucket)."""
        m1 = [torch.zeros_like(p) for p in self.params]
        m2 = [torch.zeros_like(p) for p in self.params]
        for b in self.buckets:
            self._unpack(b, self._gather_state(b, "exp_avg"), m1)
            self._unpack(b, self._gather_state(b, "exp_avg_sq"), m2)
        out = {}
        for i, p in enumerate(self.params):
            if self.steps[i] <= 0:
                continue
            if self.is_muon[i]:
                out[p] = {"momentum_buffer": m1[i]}
            else:
                out[p] = {"step": torch.tensor(float(self.steps[i])), "exp_avg": m1[i], "exp_avg_sq": m2[i]}
        return out

    def _take_state(self, state: dict[Any, dict[str, torch.Tensor]]) -> None:
        """Step counts per parameter, the owned units' state sliced out of the whole tensors."""
        for i, p in enumerate(self.params):
            st = state.get(p, {})
            self.steps[i] = float(st["step"]) if "step" in st else float("momentum_buffer" in st)
        for u in self.state:
            s = self.slots[u]
            st = state.get(self.params[s.param], {})
            self.state[u] = self._fresh(s)
            for key, t in self.state[u].items():
                if key == "step":
                    t.fill_(self.steps[s.param])
                elif key in st:
                    t.copy_(self._piece(st[key], s))

    def sharded_state_dict(self, model: nn.Module, optim: torch.optim.Optimizer,
                           save: bool = True) -> dict[str, Any]:
        """DCP state without a gather (:mod:`moonrt.comm.dcp_state`): the model as the EP part (or one process)
        gives it; per parameter with an owned unit, the owned Muon blocks' ``momentum_buffer`` as boxes of the
        single-process shape (:func:`block_box`; several blocks of one parameter: :class:`Boxes`) or an owned
        AdamW parameter's moments as its flat range (under EP from row ``first`` of ``[E, ...]``); ``.step`` of
        every parameter (replicated: DCP writes one copy). The same dict is the load target: the boxes are views
        of the owned state tensors (a unit with no step yet holds zeros, which Muon's first step treats as no
        buffer, bit for bit: ``Muon._muon_param`` starts an absent buffer as zeros)."""
        from moonrt.comm.dcp_state import MOMENTS, MOMENTUM, Boxes, flat_shard, model_entries

        self._prepare(model, optim)
        shards = self.ep.shard_map(model) if self.ep is not None else {}
        out = model_entries(model, shards)
        boxes: dict[int, list[Shard]] = {}
        for u in self.mine:
            s, st = self.slots[u], self.state[u]
            p, name = self.params[s.param], self.names[s.param]
            shape, first = shards.get(id(p), (tuple(p.shape), 0))
            if s.block >= 0:
                boxes.setdefault(s.param, []).append(
                    block_box(st[MOMENTUM], p.shape, self.specs[s.param], s.block, shape, first))
            else:
                row = p[0].numel() if p.dim() else 1
                for key in MOMENTS:
                    out[f"optimizer.{name}.{key}"] = flat_shard(st[key], math.prod(shape), first * row)
        for i, parts in boxes.items():
            out[f"optimizer.{self.names[i]}.{MOMENTUM}"] = parts[0] if len(parts) == 1 else Boxes(parts[0].shape, parts)
        for i, name in enumerate(self.names):
            out[f"optimizer.{name}.step"] = self.steps[i].clone()
        return out

    def load_sharded_state_dict(self, model: nn.Module, optim: torch.optim.Optimizer, state: dict[str, Any]) -> bool:
        """The owned momenta and moments were read into the state tensors in place; take the step counts (the
        owned AdamW units' ``step`` too), keep ``optim.state`` empty."""
        for i, name in enumerate(self.names):
            self.steps[i] = float(state[f"optimizer.{name}.step"])
        for u, st in self.state.items():
            if "step" in st:
                st["step"].fill_(self.steps[self.slots[u].param])
        optim.state.clear()
        return True

    # ---- accounting --------------------------------------------------------------------------------
    def state_bytes(self) -> int:
        """Optimizer-state bytes this rank holds (owned momentum / moments, the ``[P]`` step counts)."""
        return sum(t.nbytes for st in self.state.values() for k, t in st.items() if k != "step") + self.steps.nbytes

    def comm_bytes(self) -> int:
        """Bytes one rank sends and receives per step in the bucketed collectives (ring: ``(n-1) * S`` elements
        each way for the reduce-scatter and again for the all-gather, per bucket)."""
        return sum(4 * (b.size - 1) * b.plan.shard * b.grad.element_size() for b in self.buckets)

    def step_metrics(self, step: int, model: nn.Module, record: dict[str, Any]) -> None:
        """The core's ``optimizer_state_bytes``, ``optimizer_comm_bytes`` (this rank) and ``muon_flops_imbalance``
        (the worst bucket's largest owner FLOPs over the mean)."""
        super().step_metrics(step, model, record)
        record["optimizer_comm_bytes"] = self.comm_bytes()
        record["muon_flops_imbalance"] = max((b.plan.imbalance for b in self.buckets), default=1.0)


def block_box(buf: torch.Tensor, local_shape: torch.Size, spec: Blocking | None, k: int, shape: tuple[int, ...],
              first: int = 0) -> Shard:
    """Block ``k`` (``block_view``'s numbering) of a parameter of this rank's shape ``local_shape`` as a box of its
    single-process ``shape``: ``buf [a, b]`` viewed ``[1, ..., 1, a, b]`` at the block's stack index, row or
    column offset, shifted by ``first`` rows along dim 0 (EP: the rank's first home expert)."""
    from moonrt.comm.dcp_state import Shard

    stack, heads, a, b = block_grid(local_shape, spec)
    sd = spec.stack_dims if spec is not None else 0
    s, h = divmod(k, heads)
    index = []
    for n in reversed(local_shape[:sd]):  # the stack index s over the stacked dims, row-major
        s, i = divmod(s, n)
        index.insert(0, i)
    offsets = index + ([h * a, 0] if heads == 1 or spec.axis == 0 else [0, h * b])
    offsets[0] += first
    return Shard(buf.view(*([1] * sd), a, b), tuple(shape), tuple(offsets))
