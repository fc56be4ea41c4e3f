"""ZeRO-1 for Per-Head Muon: each orthogonalization unit is owned, whole, by one data-parallel rank.

:class:`ZeroMuon` is a :class:`moonrt.comm.parallelism.Part` for ``--zero 1 --optimizer muon`` (K3 report
§2.7 and its infrastructure section: each rank fetches only the pieces of the matrices it owns). A flat
ZeRO-1 partition (:mod:`moonrt.comm.zero`) cuts matrices at arbitrary elements, but Newton-Schulz needs a
whole block on one rank, so here the partition follows the units of :mod:`moonrt.scheduler.muon_plan`:
every Muon block (a head's rows of a Q/K/V projection, one expert's matrix, a whole dense matrix) and every
AdamW parameter (embedding, norms, router, LM head: whole, AdamW is element-wise) goes to exactly one rank,
balanced by optimizer FLOPs.

Layout: rank ``r``'s **segment** is the concatenation of its units' elements (block layout ``[a, b]``
row-major, units in index order), padded with zeros to ``S`` = the largest segment. Per step:

- :meth:`ZeroMuon.sync_grads`: every rank packs its full gradient into ``[n * S]`` in the owners' layout
  and one ``reduce_scatter_single`` (sum) leaves rank ``r`` the summed gradient of its own units ``[S]``
  (no whole-matrix gather); one all-reduce of ``[P]`` "had a gradient" flags (torch skips ``grad is None``);
- :meth:`ZeroMuon.clip_grad_norm`: the global norm from the disjoint segments (one fp64 all-reduce);
- :meth:`ZeroMuon.step`: the owner runs the momentum, Newton-Schulz and update of its Muon blocks (the
  arithmetic of :class:`moonrt.ops.muon.Muon`, per block) and torch's AdamW on its AdamW parameters, writes
  the new values into ``[S]``, and one ``all_gather_single`` ``[S] -> [n * S]`` gives every rank every
  parameter.

State: the momentum of owned Muon blocks (``[a, b]`` fp32 each) and the two moments of owned AdamW
parameters; nothing else (``optimizer_state_bytes`` per rank in the metrics). Checkpoints speak the
single-process layout (:meth:`ZeroMuon.full_state_dict` gathers the segments with the same collective).

Scope: data parallelism (and context parallelism: its ranks hold replicas too) over one replica group; with
expert or pipeline parallelism ``moonrt.assemble`` refuses ``--zero 1 --optimizer muon`` (experts would be
owned within their ``dp_cp`` replica group and stages per ``pp`` rank: not built yet).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from moonrt.comm.parallelism import Part
from moonrt.comm.zero import _all_gather, _size_rank, every_rank, scatter_grads
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


@dataclasses.dataclass(frozen=True, slots=True)
class _Slot:
    """Unit ``u``: parameter ``param``, block ``block`` (-1: the whole AdamW parameter), in its owner's segment
    at ``[offset, offset + numel)``."""

    param: int
    block: int
    rows: int
    cols: int
    owner: int
    offset: int

    @property
    def numel(self) -> int:
        return self.rows * self.cols


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


class ZeroMuon(Part):
    """Muon + AdamW with unit ownership over one replica group (see the module docstring).

    Args:
        group: the replicas of every parameter (mesh ``dp_ep_cp`` with ep 1; None: the default group).
        assign: ``model -> {parameter name: blocking}`` of the parameters Muon updates (the job's
            :func:`moonrt.optimizers.muon_blocks`); every other trainable parameter is AdamW.
    """

    def __init__(self, group: Any = None, *, assign: Callable[[nn.Module], dict[str, Blocking]]) -> None:
        self.group, self.assign = group, assign
        self.size, self.rank = _size_rank(group)
        self.names: list[str] = []
        self.params: list[nn.Parameter] = []
        self.specs: list[Blocking | None] = []
        self.is_muon: list[bool] = []
        self.slots: list[_Slot] = []
        self.plan: MuonPlan | None = None
        self.mine: list[int] = []
        self.grad: torch.Tensor = torch.zeros(0)
        self.state: dict[int, dict[str, torch.Tensor]] = {}
        """Owned unit -> ``momentum_buffer [a, b]`` (Muon) or ``step``/``exp_avg``/``exp_avg_sq`` (AdamW)."""
        self.steps = torch.zeros(0, dtype=torch.float64)
        """``[P]`` replicated: optimizer steps taken by each parameter (state exists when > 0)."""
        self.had_grad = torch.zeros(0, dtype=torch.bool)
        self._checked: torch.optim.Optimizer | None = None

    # ---- layout ------------------------------------------------------------------------------------
    def _layout(self, model: nn.Module) -> None:
        if self.plan is not None:
            return
        blocks = self.assign(model)
        named, units, raw = unit_layout(model, blocks)
        for name, p in named:
            self.names.append(name)
            self.params.append(p)
            self.is_muon.append(name in blocks)
            self.specs.append(blocks.get(name))
        self.plan = plan_units(units, self.size)
        self.slots = [_Slot(i, k, a, b, self.plan.owner[u], self.plan.offsets[u]) for u, (i, k, a, b) in enumerate(raw)]
        self.mine = list(self.plan.units[self.rank])
        dev = self.params[0].device if self.params else None
        self.grad = torch.zeros(self.plan.shard, device=dev)
        self.steps = torch.zeros(len(self.params), dtype=torch.float64)
        self.had_grad = torch.zeros(len(self.params), dtype=torch.bool)
        for u in self.mine:
            self.state[u] = self._fresh(self.slots[u])

    def _fresh(self, s: _Slot) -> dict[str, torch.Tensor]:
        p = self.params[s.param]
        if s.block >= 0:
            return {"momentum_buffer": torch.zeros(s.rows, s.cols, dtype=p.dtype, device=p.device)}
        return {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}

    def _piece(self, t: torch.Tensor, s: _Slot) -> torch.Tensor:
        """Unit ``s`` of a tensor shaped like its parameter: ``[a, b]`` block view or the whole tensor."""
        return block_view(t, self.specs[s.param], s.block) if s.block >= 0 else t

    def _pack(self, tensors: list[torch.Tensor | None]) -> torch.Tensor:
        """``[n * S]``: every rank's segment of per-parameter ``tensors`` (None: zeros), in the owners' layout."""
        plan = self.plan
        pieces = []
        for r in range(self.size):
            for u in plan.units[r]:
                s = self.slots[u]
                t = tensors[s.param]
                pieces.append(self._piece(t, s).reshape(-1) if t is not None else
                              self.grad.new_zeros(s.numel))
            pad = plan.shard - plan.sizes[r]
            if pad:
                pieces.append(self.grad.new_zeros(pad))
        return torch.cat(pieces) if pieces else self.grad.new_zeros(0)

    def _seg(self, flat: torch.Tensor, u: int) -> torch.Tensor:
        """Unit ``u``'s ``[a, b]`` (or ``[numel]``) piece of this rank's ``[S]`` segment buffer ``flat``."""
        s = self.slots[u]
        piece = flat[s.offset:s.offset + s.numel]
        return piece.view(s.rows, s.cols) if s.block >= 0 else piece.view_as(self.params[s.param])

    def _unpack(self, full: torch.Tensor, targets: list[torch.Tensor]) -> None:
        """Copy every unit of the gathered ``[n * S]`` into the matching piece of ``targets[param]``."""
        for s in self.slots:
            src = full[s.owner * self.plan.shard + s.offset:][:s.numel]
            dst = self._piece(targets[s.param], s)
            dst.copy_(src.view(dst.shape))

    # ---- per-step verbs ----------------------------------------------------------------------------
    def sync_grads(self, model: nn.Module) -> bool:
        """Reduce-scatter (sum) every gradient into its owner's segment; frees ``p.grad``."""
        self._layout(model)
        flags = torch.tensor([p.grad is not None for p in self.params], dtype=torch.float32)
        flat = self._pack([p.grad for p in self.params])
        self.had_grad = scatter_grads(flat, self.grad, flags, self.group, self.size)
        for p in self.params:
            p.grad = None
        return True

    def clip_grad_norm(self, params: list[torch.Tensor], max_norm: float) -> float:
        """Scale the owned gradients to global norm ``max_norm`` if above (torch's rule); returns the norm."""
        sq = self.grad.double().pow(2).sum()
        if self.size > 1:
            dist.all_reduce(sq, group=self.group)
        norm = math.sqrt(float(sq))
        self.grad.mul_(min(1.0, max_norm / (norm + 1e-6)))
        return norm

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
        """Update the owned units, then all-gather every parameter (one collective)."""
        groups = self._check(optim)
        out = torch.zeros_like(self.grad)
        for u in self.mine:
            s = self.slots[u]
            p, g = self.params[s.param], groups[s.param]
            dst = self._seg(out, u)
            dst.copy_(self._piece(p.detach(), s))
            if not self.had_grad[s.param]:
                continue
            grad, st = self._seg(self.grad, u), self.state[u]
            if s.block >= 0:
                upd = momentum_update(grad, st["momentum_buffer"], g["momentum"], g["nesterov"])
                o = zeropower_via_newtonschulz(upd, g["ns_coefficients"], g["ns_steps"], g["eps"],
                                               NS_DTYPES[g["ns_dtype"]])
                dst.mul_(1 - g["lr"] * g["weight_decay"])
                dst.add_(o, alpha=-adjusted_lr(g["lr"], g["adjust_lr_fn"], s.rows, s.cols))
            else:
                adamw_update([dst], [grad], [st["exp_avg"]], [st["exp_avg_sq"]], [st["step"]], g)
        full = torch.empty(self.size * self.plan.shard, dtype=out.dtype, device=out.device)
        if self.size > 1:
            _all_gather(full, out, self.group)
        else:
            full.copy_(out)
        self._unpack(full, [p.detach() for p in self.params])
        self.steps += self.had_grad.double()
        return True

    # ---- checkpoints (single-process layout) -------------------------------------------------------
    def _gather_state(self, key: str) -> torch.Tensor:
        """``[n * S]``: every owned unit's ``key`` state (Muon: ``momentum_buffer``; AdamW: ``exp_avg`` or
        ``exp_avg_sq``; zeros where the unit has no such state) gathered in the owners' layout."""
        mine = torch.zeros_like(self.grad)
        for u in self.mine:
            s, st = self.slots[u], self.state[u]
            k = key if s.block < 0 else ("momentum_buffer" if key == "exp_avg" else None)
            if k is not None:
                self._seg(mine, u).copy_(st[k])
        full = torch.empty(self.size * self.plan.shard, dtype=mine.dtype, device=mine.device)
        if self.size > 1:
            _all_gather(full, mine, self.group)
        else:
            full.copy_(mine)
        return full

    def full_state_dict(self, model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
        """``{"model", "optimizer"}`` as the single-process :class:`Muon` would hold them (collective)."""
        self._layout(model)
        self._check(optim)
        m1 = [torch.zeros_like(p) for p in self.params]
        m2 = [torch.zeros_like(p) for p in self.params]
        self._unpack(self._gather_state("exp_avg"), m1)
        self._unpack(self._gather_state("exp_avg_sq"), m2)
        try:
            for i, p in enumerate(self.params):
                if self.steps[i] <= 0:
                    continue
                if self.is_muon[i]:
                    optim.state[p] = {"momentum_buffer": m1[i]}
                else:
                    optim.state[p] = {"step": torch.tensor(float(self.steps[i])), "exp_avg": m1[i], "exp_avg_sq": m2[i]}
            return {"model": model.state_dict(), "optimizer": optim.state_dict()}
        finally:
            optim.state.clear()

    def load_full_state_dict(self, model: nn.Module, optim: torch.optim.Optimizer, state: dict[str, Any]) -> bool:
        """Load a single-process-layout state: parameters whole, owned units' optimizer state sliced out.

        ValueError (own state unchanged) when a saved state tensor has the wrong shape.
        """
        model.load_state_dict(state["model"])
        optim.load_state_dict(state["optimizer"])
        self._layout(model)
        self._check(optim)
        try:
            for i, p in enumerate(self.params):
                for key, t in optim.state.get(p, {}).items():
                    if key != "step" and t.shape != p.shape:
                        raise ValueError(f"checkpoint optimizer state of {self.names[i]}: {key} shape "
                                         f"{tuple(t.shape)}, expected {tuple(p.shape)}")
            for i, p in enumerate(self.params):
                st = optim.state.get(p, {})
                self.steps[i] = float(st["step"]) if "step" in st else float("momentum_buffer" in st)
            for u in self.mine:
                s = self.slots[u]
                st = optim.state.get(self.params[s.param], {})
                self.state[u] = self._fresh(s)
                for key, t in self.state[u].items():
                    if key == "step":
                        t.fill_(self.steps[s.param])
                    elif key in st:
                        t.copy_(self._piece(st[key], s))
        finally:
            optim.state.clear()
        return True

    # ---- accounting --------------------------------------------------------------------------------
    def state_bytes(self) -> int:
        """Optimizer-state bytes this rank holds (owned momentum / moments, the ``[P]`` step counts)."""
        return sum(t.nbytes for st in self.state.values() for k, t in st.items() if k != "step") + self.steps.nbytes

    def comm_bytes(self) -> int:
        """Bytes one rank sends and receives per step in the two bucketed collectives (ring: ``(n-1) * S``
        elements each way for the reduce-scatter and again for the all-gather)."""
        return 2 * 2 * (self.size - 1) * self.plan.shard * self.grad.element_size() if self.plan else 0

    def step_metrics(self, step: int, model: nn.Module, record: dict[str, Any]) -> None:
        """``optimizer_state_bytes`` (every rank's, global rank order) and ``optimizer_comm_bytes`` (this rank)."""
        record["optimizer_state_bytes"] = every_rank(self.state_bytes())
        record["optimizer_comm_bytes"] = self.comm_bytes()
        record["muon_flops_imbalance"] = self.plan.imbalance if self.plan else 1.0
