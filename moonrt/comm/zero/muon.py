"""ZeRO-1 for Per-Head Muon: each orthogonalization unit is owned, whole, by one data-parallel rank.

:class:`ZeroMuon` is the Muon strategy on :class:`moonrt.comm.zero.core.ZeroCore` (buckets, the packed layout and
its collectives, the exact global norm, composition with the pipeline and expert parts, checkpoints) for ``--zero
1 --optimizer muon`` (K3 report §2.7 and its infrastructure section: each rank fetches only the pieces of the
matrices it owns). A flat ZeRO-1 partition (:mod:`moonrt.comm.zero.adamw`) cuts matrices at arbitrary elements, but
Newton-Schulz needs a whole block on one rank, so here the units are those of :mod:`moonrt.scheduler.muon_plan`:
every Muon block (a head's rows of a Q/K/V projection, one expert's matrix, a whole dense matrix: ``[a, b]``
row-major in the segment) and every AdamW parameter (embedding, norms, router, LM head: whole, AdamW is
element-wise) goes to exactly one rank of its replica group, balanced by optimizer FLOPs (:func:`plan_units`, per
bucket: each expert's matrix within its ``dp_cp`` group, each dense unit within ``dp_ep_cp``).

Per step, after the core's reduce-scatter and clip, :meth:`ZeroMuon.step` runs on the owner the momentum,
Newton-Schulz and update of its Muon blocks (the arithmetic of :class:`moonrt.ops.muon.Muon`, per block) and
torch's AdamW on its AdamW parameters, writes the new values into ``[S]``, and one ``all_gather_single`` ``[S] ->
[n * S]`` gives every rank every parameter.

State: the momentum of owned Muon blocks (``[a, b]`` each) and the two moments of owned AdamW parameters; nothing
else (``optimizer_state_bytes`` per rank in the metrics). In DCP checkpoints each owned block's momentum is a box of
the parameter's single-process shape, rows or columns, several per parameter on one rank.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from moonrt.comm.zero.core import Slot, ZeroCore, gather_shards
from moonrt.config import ConfigError
from moonrt.ops.muon import (
    NS_DTYPES,
    Blocking,
    Muon,
    adamw_update,
    adjusted_lr,
    momentum_update,
    step_count,
    zeropower_via_newtonschulz,
)
from moonrt.scheduler.muon_plan import Unit, plan_units, unit_layout


class ZeroMuon(ZeroCore):
    """Muon + AdamW with unit ownership inside each parameter's replica group (see the module docstring).

    Args: those of :class:`~moonrt.comm.zero.core.ZeroCore`, and ``assign``: ``model -> {parameter name:
    blocking}`` of the parameters Muon updates (the job's :func:`moonrt.jobs.train.optimizers.muon_blocks`); every
    other trainable parameter is AdamW.
    """

    def __init__(self, dense: Any = None, experts: Any = None, *, assign: Callable[[nn.Module], dict[str, Blocking]],
                 **kwargs: Any) -> None:
        super().__init__(dense, experts, **kwargs)
        self.assign = assign
        self.state: dict[int, dict[str, torch.Tensor]] = {}
        """Owned unit -> ``momentum_buffer [a, b]`` (Muon) or ``step``/``exp_avg``/``exp_avg_sq`` (AdamW)."""
        self._units: tuple[list[Unit], list[tuple[int, int, int, int]]] | None = None

    # ---- layout and state --------------------------------------------------------------------------
    def _plan(self, model: nn.Module, members: list[int], size: int) -> tuple[list[list[Slot]], float]:
        """The members' units (:func:`unit_layout`) owned as :func:`plan_units` balances them."""
        if self._units is None:
            blocks = self.assign(model)
            _, units, raw = unit_layout(model, blocks)
            self.blocks = {i: blocks[n] for i, n in enumerate(self.names) if n in blocks}
            self._units = units, raw
        units, raw = self._units
        member = set(members)
        ids = [u for u, r in enumerate(raw) if r[0] in member]
        plan = plan_units([units[u] for u in ids], size)
        slots: list[list[Slot]] = []
        for r in range(size):
            slots.append([])
            for j in plan.units[r]:
                i, k, a, b = raw[ids[j]]
                slots[r].append(Slot(i, k, 0, (a, b) if k >= 0 else tuple(self.params[i].shape), r, plan.offsets[j]))
        return slots, plan.imbalance

    def _reset_state(self) -> None:
        self.state = {u: self._fresh(self.slots[u]) for u in self.mine}

    def _fresh(self, s: Slot) -> dict[str, torch.Tensor]:
        p = self.params[s.param]
        if s.block >= 0:
            return {"momentum_buffer": torch.zeros(s.shape, dtype=p.dtype, device=p.device)}
        return {"step": step_count(), "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}

    def _unit_state(self, u: int) -> dict[str, torch.Tensor]:
        return self.state[u]

    def _state_shard(self, j: int, key: str) -> torch.Tensor:
        b = self.buckets[j]
        mine = torch.zeros_like(b.grad)
        for u in b.mine:
            s, st = self.slots[u], self.state[u]
            k = key if s.block < 0 else ("momentum_buffer" if key == "exp_avg" else None)
            if k is not None:
                self._seg(mine, u).copy_(st[k])
        return mine

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
            g, muon = group_of.get(id(p)), i in self.blocks
            if g is None or g["use_muon"] != muon or (muon and optim.blocking(p) != self.blocks[i]):
                raise ConfigError(f"parameter {self.names[i]}: its optimizer group or blocking differs from the "
                                  "ZeroMuon layout (expected the job's build_optimizer over the same model)")
            out[i] = g
        return out

    # ---- the update --------------------------------------------------------------------------------
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
                    dst.add_(o, alpha=-adjusted_lr(g["lr"], g["adjust_lr_fn"], *s.shape))
                else:
                    adamw_update([dst], [grad], [st["exp_avg"]], [st["exp_avg_sq"]], [st["step"]], g)
            self._unpack(b, gather_shards(out, b.group, b.size), targets)
        self.steps += self.had_grad.double()
        return True

    # ---- accounting --------------------------------------------------------------------------------
    def state_bytes(self) -> int:
        """Optimizer-state bytes this rank holds (owned momentum / moments, the ``[P]`` step counts)."""
        return sum(t.nbytes for st in self.state.values() for k, t in st.items() if k != "step") + self.steps.nbytes

    def step_metrics(self, step: int, model: nn.Module, record: dict[str, Any]) -> None:
        """The core's ``optimizer_state_bytes``, ``optimizer_comm_bytes`` (this rank) and ``muon_flops_imbalance``
        (the worst bucket's largest owner FLOPs over the mean)."""
        super().step_metrics(step, model, record)
        record["optimizer_comm_bytes"] = self.comm_bytes()
        record["muon_flops_imbalance"] = max((b.imbalance for b in self.buckets), default=1.0)
