"""ZeRO-1 with AdamW on flat shards (K3_SYSTEMS §10): AdamW states sharded over the data-parallel replicas.

:class:`Zero1` is the AdamW strategy on :class:`moonrt.comm.zero.core.ZeroCore` (buckets, the packed layout and
its collectives, the exact global norm, composition with the pipeline and expert parts, checkpoints in the
single-process and the DCP layout, and why the partition is flat: see there). Per step the loop calls
``sync_grads`` (reduce-scatter), ``clip_grad_norm`` and :meth:`Zero1.step` (AdamW on this rank's shard, then
all-gather of the updated shard) *instead of* ``optimizer.step()``, whose state stays empty.

Layout (:meth:`Zero1._plan`): a bucket's parameters are concatenated in ``model.named_parameters()`` order into
``L`` elements and padded with zeros to ``n * S`` with ``S = ceil(L / n)`` for ``n`` replicas; replica ``r`` owns
elements ``[r*S, (r+1)*S)``. Its units are the pieces of the parameters in that range (a parameter may straddle
owners: one unit per owner), so the packed gradient is the concatenation itself. Its AdamW ``exp_avg`` /
``exp_avg_sq`` are two ``[S]`` buffers, and a step updates each owner's pieces with the same per-element AdamW
arithmetic (``torch.optim.AdamW`` itself, run on ``[S]``-buffer views, so the semantics, param groups, lr and
weight decay are torch's). With one replica per group (dp 1: ``--zero 1`` is allowed there) nothing is sharded
and no collective runs; the update is torch's AdamW on whole parameters.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from moonrt.comm.zero.core import Slot, ZeroCore, gather_shards
from moonrt.config import ConfigError
from moonrt.ops.muon import step_count

_MOMENTS = ("exp_avg", "exp_avg_sq")


class Zero1(ZeroCore):
    """ZeRO-1 data parallelism with AdamW on flat shards (see the module docstring; arguments:
    :class:`~moonrt.comm.zero.core.ZeroCore`)."""

    def __init__(self, dense: Any = None, experts: Any = None, **kwargs: Any) -> None:
        super().__init__(dense, experts, **kwargs)
        self.flat: list[dict[str, torch.Tensor]] = []
        """Per bucket, this rank's ``[S]`` buffers: ``param`` (the working copy AdamW updates) and the moments."""
        self._inner: torch.optim.AdamW | None = None
        self._outer: torch.optim.Optimizer | None = None
        self._seg_group: list[int] = []  # inner group index -> outer group index
        self._views: list[tuple[int, int, torch.Tensor]] = []  # (bucket, unit, its view of the param buffer)

    def _plan(self, model: nn.Module, members: list[int], size: int) -> tuple[list[list[Slot]], float]:
        """Rank ``r``'s units: the pieces of the concatenated parameters in ``[r*S, (r+1)*S)``, flat."""
        shard = -(-sum(self.params[i].numel() for i in members) // size)
        plan: list[list[Slot]] = [[] for _ in range(size)]
        off = 0
        for i in members:
            n = self.params[i].numel()
            for r in range(off // shard, -(-(off + n) // shard)) if n else ():
                a, b = max(off, r * shard), min(off + n, (r + 1) * shard)
                plan[r].append(Slot(i, -1, a - off, (b - a,), r, a - r * shard))
            off += n
        return plan, 1.0

    def _reset_state(self) -> None:
        if len(self.flat) != len(self.buckets):
            self.flat = [{key: torch.zeros_like(b.grad) for key in ("param", *_MOMENTS)} for b in self.buckets]
        for f in self.flat:
            for key in _MOMENTS:
                f[key].zero_()

    def _unit_state(self, u: int) -> dict[str, torch.Tensor]:
        f = self.flat[self.bucket_of[u]]
        return {key: self._seg(f[key], u) for key in _MOMENTS}

    def _state_shard(self, j: int, key: str) -> torch.Tensor:
        return self.flat[j][key]

    def _prepare(self, model: nn.Module | None, optim: torch.optim.Optimizer) -> None:
        """Build the inner AdamW over this rank's units, in the outer optimizer's param groups.

        Rebinding (another optimizer object over the same parameters) keeps the state: it lives in
        the bucket buffers, the inner optimizer only holds views of them.
        """
        if self._outer is optim:
            return
        if model is not None:
            self._layout(model)
        if not isinstance(optim, torch.optim.AdamW):
            raise ConfigError(f"optimizer = {type(optim).__name__}: expected torch.optim.AdamW for ZeRO-1")
        if any(g.get("amsgrad") for g in optim.param_groups):
            raise ConfigError("optimizer amsgrad = True: expected False for ZeRO-1 (max_exp_avg_sq is not sharded)")
        group_of = {id(p): gi for gi, g in enumerate(optim.param_groups) for p in g["params"]}
        inner_groups: dict[int, list[torch.Tensor]] = {}
        self._views = []
        for j, b in enumerate(self.buckets):
            for i in b.params:
                if id(self.params[i]) not in group_of:
                    raise ConfigError(f"parameter {self.names[i]}: trainable but not in the optimizer's param groups")
            for u in b.mine:
                view = self._seg(self.flat[j]["param"], u)
                self._views.append((j, u, view))
                inner_groups.setdefault(group_of[id(self.params[self.slots[u].param])], []).append(view)
        self._seg_group = sorted(inner_groups)
        self._inner = None
        if inner_groups:
            self._inner = torch.optim.AdamW([{**_hyper(optim.param_groups[gi]), "params": inner_groups[gi]}
                                             for gi in self._seg_group])
            for _, u, view in self._views:  # the moments are views of the flat [S] buffers
                self._inner.state[view] = {"step": step_count(), **self._unit_state(u)}
        self._outer = optim

    def step(self, optim: torch.optim.Optimizer) -> bool:
        """AdamW on this rank's shard with ``optim``'s current hyperparameters, then all-gather the
        updated shards into the parameters. Called instead of ``optim.step()`` (whose state stays empty)."""
        if not self.buckets:
            raise RuntimeError("Zero1.step: call sync_grads(model) first (no gradients were reduced)")
        self._prepare(None, optim)
        for j, u, view in self._views:
            i = self.slots[u].param
            view.copy_(self._piece(self.params[i].detach(), self.slots[u]))
            view.grad = self._seg(self.buckets[j].grad, u) if bool(self.had_grad[i]) else None
            self._inner.state[view]["step"].fill_(float(self.steps[i]))
        if self._inner is not None:
            for inner, gi in zip(self._inner.param_groups, self._seg_group):
                inner.update(_hyper(optim.param_groups[gi]))
            self._inner.step()
        self.steps += self.had_grad.double()
        targets = [p.detach() for p in self.params]
        for b, f in zip(self.buckets, self.flat):
            self._unpack(b, gather_shards(f["param"], b.group, b.size, copy=False), targets)
        for _, _, view in self._views:
            view.grad = None
        return True

    # ---- accounting --------------------------------------------------------------------------------
    def state_bytes(self) -> int:
        """Bytes of AdamW state this rank holds: the ``[S]`` moment shards and the ``[P]`` step counts."""
        return sum(f[key].nbytes for f in self.flat for key in _MOMENTS) + self.steps.nbytes

    def memory_bytes(self) -> dict[str, int]:
        """Per-rank persistent bytes: ``optimizer_state``, ``grad_shard``, ``param_shard`` (working copy)."""
        return {"optimizer_state": self.state_bytes(), "grad_shard": sum(b.grad.nbytes for b in self.buckets),
                "param_shard": sum(f["param"].nbytes for f in self.flat)}


def _hyper(group: dict[str, Any]) -> dict[str, Any]:
    """A param group's hyperparameters (everything but ``params``)."""
    return {k: v for k, v in group.items() if k != "params"}
