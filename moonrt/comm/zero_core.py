"""The ZeRO-1 sharding core (K3_SYSTEMS §10) that both optimizers' parts stand on: :class:`moonrt.comm.zero.Zero1`
(AdamW, flat element partition) and :class:`moonrt.comm.zero_muon.ZeroMuon` (Muon, whole blocks per owner, planned
by :mod:`moonrt.scheduler.muon_plan`).

What is the same for both lives here (:class:`ZeroCore`): the replica groups and buckets (the trainable parameters
with the same replica group and dtype: dense over mesh ``dp_ep_cp``, routed experts under expert parallelism over
``dp_cp``), the bucketed collectives (one ``reduce_scatter_single`` of the gradient ``[n * S] -> [S]`` and one
``all_gather_single`` ``[S] -> [n * S]`` per bucket and step, plus the ``[P]`` "had a gradient" flags), the norm
contribution (every rank's shards are disjoint over the whole job: :attr:`Part.counts_every_rank`, the pipeline's
:attr:`ZeroCore.duplicates` left out), the Part plumbing (kind ``zero`` of :data:`moonrt.comm.compose.COMPOSITION`,
wrapping the expert part), and the frame of the single-process-layout checkpoints (the optimizer state is put into
``optim.state`` for the call, the EP part gathers or slices the experts, ``optim.state`` is emptied again). A
strategy (the subclass) says how a bucket's elements are owned and laid out in the ``[S]`` shards, how the update
runs, and how its state maps to the single-process layout: :meth:`ZeroCore._layout`, :meth:`ZeroCore._prepare`,
:meth:`ZeroCore._grad_shards`, :meth:`ZeroCore._owned_grads`, :meth:`ZeroCore._put_state`,
:meth:`ZeroCore._take_state`, :meth:`ZeroCore.state_bytes`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from moonrt.comm.mesh import Group
from moonrt.comm.parallelism import GradNorm, Part
from moonrt.config import ConfigError

if TYPE_CHECKING:
    from moonrt.comm.ep_parallel import ExpertParallel
    from moonrt.comm.mesh import ProcessMesh


def size_rank(group: Any) -> tuple[int, int]:
    """``(size, rank)`` of ``group`` (None: the default group); ``(1, 0)`` without torch.distributed."""
    if not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def reduce_scatter(out: torch.Tensor, flat: torch.Tensor, group: Any) -> None:
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, flat, group=group)


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


def scatter_grads(flat: torch.Tensor, out: torch.Tensor, flags: torch.Tensor, group: Any, size: int) -> torch.Tensor:
    """The gradient tail of a sharded step: reduce-scatter (sum) ``flat [size * S]``, laid out in the owners'
    order, into this rank's ``out [S]`` (a copy with one replica) and sum the ``[P]`` "had a gradient" flags over
    ``group``; returns ``[P]`` bool, True where any replica produced that parameter's gradient."""
    if size > 1:
        reduce_scatter(out, flat, group)
        dist.all_reduce(flags, group=group)
    else:
        out.copy_(flat)
    return flags > 0


def every_rank(value: int, device: torch.device | None = None) -> list[int]:
    """``value`` of every rank of the default group, in global rank order (one all-gather; ``[value]`` alone)."""
    mine = torch.tensor([value], dtype=torch.int64, device=device)
    world = size_rank(None)[0]
    if world == 1:
        return [value]
    rows = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(rows, mine)
    return [int(r) for r in rows]


class ZeroCore(Part):
    """A ZeRO-1 part's shared frame (see the module docstring); a strategy subclasses it.

    Args:
        dense: group of the dense parameters' replicas (mesh ``dp_ep_cp``; None: the default group).
        experts: group of the routed experts' replicas (mesh ``dp_cp``); needed when ``ep`` is given.
        ep: the job's expert-parallel part (which parameters are experts; EP gather of checkpoints); also set by
            :func:`moonrt.comm.compose.compose` (:meth:`wrap`).
        norm_group: the ranks whose shards together hold the whole model once (None: the default group).
    """

    kind = "zero"
    counts_every_rank = True

    def __init__(self, dense: Any = None, experts: Any = None, *, ep: ExpertParallel | None = None,
                 norm_group: Any = None) -> None:
        if ep is not None and experts is None and size_rank(None)[0] > 1:
            raise ConfigError(f"{type(self).__name__}: ep given without the experts' replica group "
                              f"(mesh group {Group.DP_CP.value!r})")
        self.dense, self.experts, self.ep, self.norm_group = dense, experts, ep, norm_group
        self.duplicates: set[str] = set()
        """Names of parameters whose (synced) gradient on this rank is a copy of another rank's that the norm
        already counts (set by the pipeline part: the pseudo-queries on all pp ranks but one)."""

    @classmethod
    def from_mesh(cls, mesh: ProcessMesh, ep: ExpertParallel | None = None, **kwargs: Any) -> ZeroCore:
        """Dense parameters over ``dp_ep_cp``, experts over ``dp_cp``, norm over the default group."""
        return cls(mesh.group(Group.DP_EP_CP), mesh.group(Group.DP_CP), ep=ep, **kwargs)

    def wrap(self, inner: Part) -> None:
        """The expert part (:func:`moonrt.comm.compose.compose`): which parameters are experts, their EP gather."""
        self.ep = inner

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

    # ---- the strategy's hooks ---------------------------------------------------------------------
    def _layout(self, model: nn.Module) -> Any:
        """Plan the buckets once (after every part's ``parallelize``, which may replace parameters)."""
        raise NotImplementedError

    def _prepare(self, model: nn.Module | None, optim: torch.optim.Optimizer) -> None:
        """Layout (when ``model`` is given) and check that ``optim`` is the optimizer this strategy shards."""
        raise NotImplementedError

    def _grad_shards(self) -> list[torch.Tensor]:
        """This rank's ``[S]`` summed-gradient shard of every bucket (what the clip scales)."""
        raise NotImplementedError

    def _owned_grads(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(parameter name, piece)`` of every piece of :meth:`_grad_shards` this rank owns."""
        raise NotImplementedError

    def _trainable(self) -> list[tuple[str, nn.Parameter]]:
        """The sharded parameters by name (after :meth:`_layout`)."""
        raise NotImplementedError

    def _put_state(self) -> dict[nn.Parameter, dict[str, torch.Tensor]]:
        """The optimizer state in the single-process layout, whole tensors (collective over every bucket's group)."""
        raise NotImplementedError

    def _take_state(self, state: dict[Any, dict[str, torch.Tensor]]) -> None:
        """Slice a single-process-layout ``optim.state`` (shapes checked) into this rank's own state."""
        raise NotImplementedError

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds."""
        raise NotImplementedError

    # ---- per-step verbs ----------------------------------------------------------------------------
    def grad_norm(self, params: list[torch.Tensor]) -> GradNorm:
        """The shard gradients' squares (fp64) summed over ``norm_group`` (every rank: disjoint shards), the
        pieces of :attr:`duplicates` left out; the clip scales the shards."""
        shards = self._grad_shards()
        sq = torch.zeros((), dtype=torch.float64, device=shards[0].device if shards else None)
        for g in shards:
            sq += g.double().pow(2).sum()
        for name, piece in self._owned_grads():  # copies counted on another rank (pipeline: pseudo-queries)
            if name in self.duplicates:
                sq -= piece.double().pow(2).sum()
        return GradNorm([(sq, (self.norm_group,))], shards)

    def step_metrics(self, step: int, model: nn.Module, record: dict[str, Any]) -> None:
        """``optimizer_state_bytes``: every rank's optimizer state bytes (:meth:`state_bytes`), global rank order."""
        shards = self._grad_shards()
        record["optimizer_state_bytes"] = every_rank(self.state_bytes(), shards[0].device if shards else None)

    # ---- checkpoints in the single-process layout ----------------------------------------------------
    def full_state_dict(self, model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
        """``{"model", "optimizer"}`` as the single-process optimizer would hold them (collective over every
        bucket's group): the state is gathered into ``optim.state`` for the call, then the EP part, if any,
        gathers the experts over the EP group (or ``optim.state_dict()`` is taken), then ``optim.state`` is
        emptied again."""
        self._prepare(model, optim)
        try:
            optim.state.update(self._put_state())
            if self.ep is not None:
                return self.ep.full_state_dict(model, optim)
            return {"model": model.state_dict(), "optimizer": optim.state_dict()}
        finally:
            optim.state.clear()

    def load_full_state_dict(self, model: nn.Module, optim: torch.optim.Optimizer, state: dict[str, Any]) -> bool:
        """Load a single-process-layout state: parameters whole (the EP part, if any, keeps the home experts),
        this rank's pieces of the optimizer state sliced out.

        ValueError (own state unchanged) when a saved state tensor has the wrong shape.
        """
        if self.ep is not None:
            self.ep.load_full_state_dict(model, optim, state)
        else:
            model.load_state_dict(state["model"])
            optim.load_state_dict(state["optimizer"])
        self._prepare(model, optim)
        try:
            for name, p in self._trainable():
                for key, t in optim.state.get(p, {}).items():
                    if key != "step" and t.shape != p.shape:
                        raise ValueError(f"checkpoint optimizer state of {name}: {key} shape "
                                         f"{tuple(t.shape)}, expected {tuple(p.shape)}")
            self._take_state(optim.state)
        finally:
            optim.state.clear()
        return True
