"""ZeRO-1: AdamW states sharded over the data-parallel replicas of each parameter (K3_SYSTEMS §10).

:class:`Zero1` is a :class:`moonrt.comm.parallelism.Part`. Per step the loop calls
:meth:`Zero1.sync_grads` (reduce-scatter), :meth:`Zero1.clip_grad_norm` (exact global norm from the
shards, the core's ``grad_norm``) and :meth:`Zero1.step` (AdamW on this rank's shard, then all-gather of the
updated shard)
*instead of* ``optimizer.step()``; :meth:`Zero1.full_state_dict` / :meth:`Zero1.load_full_state_dict`
speak the single-process ``{"model", "optimizer"}`` layout, so a ZeRO checkpoint resumes in one
process and a single-process checkpoint resumes under ZeRO; :meth:`Zero1.sharded_state_dict` gives DCP each
rank's flat moment range as 1-D shards of the flattened parameters instead (no gather).
With one replica per group (dp 1: ``--zero 1`` is allowed there) nothing is sharded and no
collective runs; the update is torch's AdamW on whole parameters.

Layout: one **flat buffer per bucket**, a bucket being the parameters with the same replica group
and dtype (dense parameters: group ``dp_ep_cp``, every replica of the weight; routed experts: group
``dp_cp``, the ranks that hold the same experts). The bucket's parameters are concatenated in
``model.named_parameters()`` order into ``L`` elements, padded with zeros to ``n * S`` with
``S = ceil(L / n)`` for ``n`` replicas, and replica ``r`` owns elements ``[r*S, (r+1)*S)``: its AdamW
``exp_avg`` / ``exp_avg_sq`` are two ``[S]`` buffers. A parameter may straddle two owners; a step of
a parameter updates each owner's piece with the same per-element AdamW arithmetic
(``torch.optim.AdamW`` itself, run on ``[S]``-buffer views, so the semantics, param groups, lr and
weight decay are torch's). Per step and bucket there is one ``reduce_scatter_single`` of the flat
gradient (``[n*S] -> [S]``, sum), one ``all_gather_single`` of the updated parameter shard
(``[S] -> [n*S]``) and one small all-reduce of ``[P]`` "had a gradient" flags (``P`` parameters, so
a parameter no rank produced a gradient for is skipped exactly as torch skips ``grad is None``).
Gloo implements both bucketed collectives (checked in ``tests/runtime/test_zero.py``); on torch versions
without the ``*_single`` names the ``*_tensor`` names are used.

Why flat, not per-parameter ownership: a flat partition balances bytes to within ``n - 1``
padding elements and needs one collective per bucket with equal-size shards, which is what
``reduce_scatter_single`` requires; per-parameter ownership with ~200 tensors of very uneven size
leaves the largest owner far above ``1/n`` and needs uneven gathers. The trade-off: an optimizer
that needs whole matrices on one owner (a later Per-Head Muon orthogonalises each head's or each
expert's ``[d_out, d_in]`` block) cannot run on a flat shard that cuts a matrix in two. For it the
partition boundaries must move to block boundaries (greedy ownership of whole head/expert blocks,
shards padded to the largest owner), or the owner of a straddling block gathers its missing part
first; the bucket bookkeeping here (``_Bucket.offsets``, ``segments``) is where that would change.

The buckets, collectives, norm contribution, Part plumbing and checkpoint frame are the shared core's
(:mod:`moonrt.comm.zero_core`); this module is the AdamW strategy on it. Global-norm clipping is exact: every rank
of the job owns a disjoint piece of every parameter it contributes to (dense pieces over ``dp_ep_cp`` at each
stage, expert pieces over ``dp_cp`` at each EP rank), so the sum over *all* ranks of the squared shard gradients
is the squared norm of the single-process gradient (one fp64 all-reduce over the default group).

Composition with pipeline parallelism: each pipeline rank shards only its stages' parameters (the mesh
groups ``dp_ep_cp`` / ``dp_cp`` lie inside one pp coordinate). The parameters every pp rank holds (the
AttnRes pseudo-queries) get their gradients summed over the pp group by the pipeline part's
``sync_grads``, which returns False and comes *before* :class:`Zero1` in ``Parallelism.parts``, so it
runs before the reduce-scatter; after it those gradients are equal on every pp rank, so the pipeline part
names them in :attr:`Zero1.duplicates` on all pp ranks but the lowest holding them, and the norm skips
their shard pieces there (each counted once). The pipeline part takes :class:`Zero1` as its ``inner``: it
delegates the clip to it (already global) and combines its single-process-layout state over the stages.

Composition with expert parallelism: pass the :class:`~moonrt.comm.ep_parallel.ExpertParallel` part
as ``ep`` and put :class:`Zero1` *before* it in ``Parallelism.parts`` (the first part that handles
sync/clip/state wins). Checkpoint state is first (un)sharded over the data-parallel replicas here,
then over the EP group by the EP part.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from moonrt.comm.zero_core import ZeroCore, gather_shards, scatter_grads
from moonrt.config import ConfigError

_MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclasses.dataclass
class _Bucket:
    """The parameters of one (replica group, dtype): flat layout and this rank's shard buffers.

    ``offsets[i]`` is parameter ``i``'s first element in the flat ``[L]`` concatenation; this rank
    owns flat elements ``[lo, lo + S)``; ``segments`` lists ``(i, a, b)``: elements ``[a, b)`` of the
    flat buffer that belong to parameter ``i`` and to this shard. ``steps [P]`` float64, replicated
    on every replica: the AdamW step count of every parameter of the bucket.
    """

    kind: str
    group: Any
    size: int
    rank: int
    dtype: torch.dtype
    params: list[nn.Parameter]
    names: list[str]
    offsets: list[int]
    numel: int
    shard: int
    segments: list[tuple[int, int, int]]
    param_shard: torch.Tensor
    grad_shard: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    steps: torch.Tensor
    had_grad: torch.Tensor

    @property
    def lo(self) -> int:
        return self.rank * self.shard

    @property
    def padding(self) -> int:
        return self.size * self.shard - self.numel

    def owners(self, i: int) -> list[int]:
        """Replica indices whose shard holds part of parameter ``i``."""
        a, b = self.offsets[i], self.offsets[i] + self.params[i].numel()
        return [r for r in range(self.size) if a < (r + 1) * self.shard and r * self.shard < b] if b > a else []

    def view(self, flat_shard: torch.Tensor, seg: tuple[int, int, int]) -> torch.Tensor:
        """The ``[b - a]`` piece of a ``[S]`` shard buffer for segment ``(i, a, b)``."""
        _, a, b = seg
        return flat_shard[a - self.lo:b - self.lo]

    def param_slice(self, seg: tuple[int, int, int]) -> torch.Tensor:
        """The same piece of the parameter itself (a flat view of its data)."""
        i, a, b = seg
        return self.params[i].detach().view(-1)[a - self.offsets[i]:b - self.offsets[i]]


class Zero1(ZeroCore):
    """ZeRO-1 data parallelism with AdamW on flat shards (see the module docstring; arguments:
    :class:`~moonrt.comm.zero_core.ZeroCore`)."""

    def __init__(self, dense: Any = None, experts: Any = None, **kwargs: Any) -> None:
        super().__init__(dense, experts, **kwargs)
        self.buckets: list[_Bucket] = []
        self._inner: torch.optim.AdamW | None = None
        self._outer: torch.optim.Optimizer | None = None
        self._seg_group: list[int] = []  # inner group index -> outer group index
        self._segs: list[tuple[_Bucket, tuple[int, int, int], torch.Tensor]] = []

    # ---- layout ------------------------------------------------------------------------------------
    def _layout(self, model: nn.Module) -> list[_Bucket]:
        """Build the buckets once (after every part's ``parallelize``, which may replace parameters)."""
        if self.buckets:
            return self.buckets
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        for kind, group, size, rank, idx in self.replica_buckets(named):
            members, dtype = [named[i] for i in idx], named[idx[0]][1].dtype
            offsets, total = [], 0
            for _, p in members:
                offsets.append(total)
                total += p.numel()
            shard = -(-total // size)
            lo, hi = rank * shard, (rank + 1) * shard
            segments = [(i, max(lo, off), min(hi, off + p.numel())) for i, (off, (_, p)) in
                        enumerate(zip(offsets, members)) if max(lo, off) < min(hi, off + p.numel())]
            dev = members[0][1].device
            param_shard, grad_shard, exp_avg, exp_avg_sq = (torch.zeros(shard, dtype=dtype, device=dev)
                                                            for _ in range(4))
            self.buckets.append(_Bucket(
                kind=kind, group=group, size=size, rank=rank, dtype=dtype, params=[p for _, p in members],
                names=[n for n, _ in members], offsets=offsets, numel=total, shard=shard, segments=segments,
                param_shard=param_shard, grad_shard=grad_shard, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq,
                steps=torch.zeros(len(members), dtype=torch.float64),
                had_grad=torch.zeros(len(members), dtype=torch.bool)))
        return self.buckets

    def _prepare(self, model: nn.Module | None, optim: torch.optim.Optimizer) -> None:
        """Build the inner AdamW over this rank's segments, in the outer optimizer's param groups.

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
        self._segs = []
        for b in self.buckets:
            for i, p in enumerate(b.params):
                if id(p) not in group_of:
                    raise ConfigError(f"parameter {b.names[i]}: trainable but not in the optimizer's param groups")
            for seg in b.segments:
                view = b.view(b.param_shard, seg)
                self._segs.append((b, seg, view))
                inner_groups.setdefault(group_of[id(b.params[seg[0]])], []).append(view)
        self._seg_group = sorted(inner_groups)
        self._inner = None
        if inner_groups:
            self._inner = torch.optim.AdamW([{**_hyper(optim.param_groups[gi]), "params": inner_groups[gi]}
                                             for gi in self._seg_group])
            for b, seg, view in self._segs:  # the moments are views of the flat [S] buffers
                self._inner.state[view] = {"step": torch.tensor(0.0), "exp_avg": b.view(b.exp_avg, seg),
                                           "exp_avg_sq": b.view(b.exp_avg_sq, seg)}
        self._outer = optim

    # ---- per-step verbs ----------------------------------------------------------------------------
    def sync_grads(self, model: nn.Module) -> bool:
        """Reduce-scatter (sum) every bucket's flat gradient to this rank's ``[S]`` shard; frees ``p.grad``."""
        for b in self._layout(model):
            flags = torch.tensor([p.grad is not None for p in b.params], dtype=torch.float32)
            pieces = [p.grad.reshape(-1) if p.grad is not None else p.new_zeros(p.numel()) for p in b.params]
            if b.padding:
                pieces.append(b.params[0].new_zeros(b.padding))
            b.had_grad = scatter_grads(torch.cat(pieces), b.grad_shard, flags, b.group, b.size)
            del pieces
            for p in b.params:
                p.grad = None
        return True

    def _grad_shards(self) -> list[torch.Tensor]:
        return [b.grad_shard for b in self.buckets]

    def _owned_grads(self) -> Iterator[tuple[str, torch.Tensor]]:
        return ((b.names[seg[0]], b.view(b.grad_shard, seg)) for b in self.buckets for seg in b.segments)

    def _trainable(self) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for b in self.buckets for n, p in zip(b.names, b.params)]

    def step(self, optim: torch.optim.Optimizer) -> bool:
        """AdamW on this rank's shard with ``optim``'s current hyperparameters, then all-gather the
        updated shards into the parameters. Called instead of ``optim.step()`` (whose state stays empty)."""
        if not self.buckets:
            raise RuntimeError("Zero1.step: call sync_grads(model) first (no gradients were reduced)")
        self._prepare(None, optim)
        for b, seg, view in self._segs:
            view.copy_(b.param_slice(seg))
            i = seg[0]
            view.grad = b.view(b.grad_shard, seg) if bool(b.had_grad[i]) else None
            self._inner.state[view]["step"].fill_(float(b.steps[i]))
        if self._inner is not None:
            for inner, gi in zip(self._inner.param_groups, self._seg_group):
                inner.update(_hyper(optim.param_groups[gi]))
            self._inner.step()
        for b in self.buckets:
            b.steps += b.had_grad.double()
            full = gather_shards(b.param_shard, b.group, b.size, copy=False)
            with torch.no_grad():
                for p, off in zip(b.params, b.offsets):
                    p.copy_(full[off:off + p.numel()].view_as(p))
        for _, _, view in self._segs:
            view.grad = None
        return True

    # ---- checkpoints -------------------------------------------------------------------------------
    def _put_state(self) -> dict[nn.Parameter, dict[str, torch.Tensor]]:
        """The moment shards all-gathered per bucket into whole ``[*p.shape]`` tensors, with the step counts."""
        out = {}
        for b in self.buckets:
            full = {key: gather_shards(getattr(b, key), b.group, b.size, copy=False) for key in _MOMENTS}
            for i, (p, off) in enumerate(zip(b.params, b.offsets)):
                if b.steps[i] > 0:
                    out[p] = {"step": torch.tensor(float(b.steps[i]))} | {
                        k: full[k][off:off + p.numel()].view_as(p).clone() for k in _MOMENTS}
        return out

    def _take_state(self, state: dict[Any, dict[str, torch.Tensor]]) -> None:
        """AdamW moments sliced to this rank's shard, step counts per parameter."""
        for b in self.buckets:
            for key in _MOMENTS:
                getattr(b, key).zero_()
            for i, p in enumerate(b.params):
                st = state.get(p, {})
                b.steps[i] = float(st["step"]) if "step" in st else 0.0
            for seg in b.segments:
                i, a, c = seg
                st = state.get(b.params[i], {})
                for key in _MOMENTS:
                    if key in st:
                        lo = a - b.offsets[i]
                        b.view(getattr(b, key), seg).copy_(st[key].reshape(-1)[lo:lo + c - a])

    def sharded_state_dict(self, model: nn.Module, optim: torch.optim.Optimizer,
                           save: bool = True) -> dict[str, Any]:
        """DCP state without a gather: the model as the EP part (or one process) gives it, and per parameter
        this rank's piece of each moment as a 1-D ``Shard`` of the flattened single-process parameter (a
        segment ``(i, a, b)`` is elements ``[a - offsets[i], b - offsets[i])`` of the local parameter, which
        under EP starts at row ``first`` of ``[E, ...]``); ``.step`` replicated (DCP writes one copy)."""
        from moonrt.comm.dcp_state import Shard, model_entries

        self._prepare(model, optim)
        shards = self.ep.shard_map(model) if self.ep is not None else {}
        out = model_entries(model, shards)
        for b in self.buckets:
            for i, (name, p) in enumerate(zip(b.names, b.params)):
                shape, first = shards.get(id(p), (tuple(p.shape), 0))
                base = first * (p[0].numel() if p.dim() else 1) - b.offsets[i]
                for seg in (s for s in b.segments if s[0] == i):
                    for key in _MOMENTS:
                        out[f"optimizer.{name}.{key}"] = Shard(b.view(getattr(b, key), seg), (math.prod(shape),),
                                                               (base + seg[1],))
                out[f"optimizer.{name}.step"] = b.steps[i].clone()
        return out

    def load_sharded_state_dict(self, model: nn.Module, optim: torch.optim.Optimizer, state: dict[str, Any]) -> bool:
        """The moments were read into the shard buffers in place; copy the step counts, keep ``optim.state`` empty."""
        for b in self.buckets:
            for i, name in enumerate(b.names):
                b.steps[i] = float(state[f"optimizer.{name}.step"])
        optim.state.clear()
        return True

    # ---- accounting --------------------------------------------------------------------------------
    def state_bytes(self) -> int:
        """Bytes of AdamW state this rank holds: the ``[S]`` moment shards and the ``[P]`` step counts."""
        return sum(b.exp_avg.nbytes + b.exp_avg_sq.nbytes + b.steps.nbytes for b in self.buckets)

    def memory_bytes(self) -> dict[str, int]:
        """Per-rank persistent bytes: ``optimizer_state``, ``grad_shard``, ``param_shard`` (working copy)."""
        return {"optimizer_state": self.state_bytes(),
                "grad_shard": sum(b.grad_shard.nbytes for b in self.buckets),
                "param_shard": sum(b.param_shard.nbytes for b in self.buckets)}


def _hyper(group: dict[str, Any]) -> dict[str, Any]:
    """A param group's hyperparameters (everything but ``params``)."""
    return {k: v for k, v in group.items() if k != "params"}
