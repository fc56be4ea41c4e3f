"""Expert parallelism applied to a K3 model from outside (torchtitan's ``parallelize`` habit, K3_SYSTEMS §6, §10).

:class:`ExpertParallel` owns what a training job needs for EP over a :class:`ProcessMesh`:

- :meth:`ExpertParallel.parallelize` cuts every LatentMoE's routed experts to the EP rank's home
  slice (E/R experts) and installs an :class:`EPDispatcher` on the latent width, through the model's dispatcher
  seam, with the placement policy ``parallel.ep_dispatcher`` names (:mod:`moonrt.comm.ep.placement`: MoonEP's, or
  the plain all-to-all baseline's); with MoonEP all layers share one :class:`SlotPool` (copies are re-prefetched
  in backward). The rows move over ``parallel.ep_transport`` resolved for the EP group when the part is built:
  the symmetric heap (:class:`moonrt.comm.ep.heap.HeapTransport`, one for all layers; ``shm``, and ``auto`` for
  CPU ranks of one host) or the collectives. Found by duck typing
  (``model.moe_layers()``, ``moe.experts.shard``, ``moe.dispatcher``): this module never imports
  ``moonrt.models.k3.model``.
- :meth:`sync_grads`: routed-expert gradients are summed over the expert replicas (mesh group
  ``dp_cp``; slot copies already returned theirs to the home rank inside backward), every other
  gradient over the dense replicas (``dp_ep_cp``): one flat all-reduce per group, in the job's reduce dtype
  (:mod:`moonrt.comm.grad_reduce`).
- :meth:`grad_norm`: the global gradient norm counts replicated gradients once and adds the
  expert shards of every EP rank, so clipping matches the single-process run.
- :meth:`describe`: layout-independent checkpoints. The part says which rows of every ``[E, ...]`` expert
  tensor this rank holds (its home experts, and the same rows of their optimizer state); the generic functions of
  :mod:`moonrt.comm.state.describe` gather them into the single-process layout, slice it back, or hand DCP the rows,
  so a checkpoint of ``--ep 2`` resumes in one process or ``--ep 4``.
- :meth:`step_metrics`: per-step metrics (rows each EP rank computed, rows the hottest rank would
  compute without balancing, token rows and bytes this rank sent to other EP ranks); :meth:`layer_counts`
  gives the group-wide ``[R, E]`` routing counts a :class:`moonrt.comm.parallelism.RoutingTrace` records.

It is a :class:`moonrt.comm.parallelism.Part` of the job's :class:`~moonrt.comm.parallelism.Parallelism`.
With a world size of 1 nothing is sharded.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from moonrt.comm.ep.dispatch import EPDispatcher
from moonrt.comm.ep.heap import HeapTransport
from moonrt.comm.ep.placement import placement_policy
from moonrt.comm.ep.slots import SlotPool
from moonrt.comm.grad_reduce import all_reduce_grad
from moonrt.comm.mesh import Group, ProcessMesh
from moonrt.comm.parallelism import GradNorm, Part
from moonrt.comm.state.describe import StateDescription
from moonrt.comm.transport.base import SymmetricHeap
from moonrt.comm.transport.select import build_transport
from moonrt.config import ConfigError, ParallelConfig
from moonrt.config.runtime import EP_DISPATCHERS
from moonrt.parallel.model import trainable


class ExpertParallel(Part):
    """Expert parallelism as a part of the job's parallelism object (see the module docstring).

    Args:
        parallel: the job's degrees (``cp`` > 1 composes: pass the CP runtime's mesh; with ``pp`` > 1 it
            acts on this pipeline rank's stages, inside :class:`moonrt.comm.pp.part.PipelineParallel`).
        capacity: S, the most tokens one rank passes to one MoE layer per call (training and eval).
        mesh: the job's :class:`ProcessMesh` (built here from the default group, which must exist, if None
            and the world has more than one rank).
        num_slots: B per rank (default E/R; MoonEP only).
        kernels: backend of MoonEP's planner (a job's ``kernels.moonep``;
            :class:`~moonrt.comm.ep.placement.MoonEPPlacement`).
        device_type: where the job's tensors live (``cpu`` / ``cuda``): what ``parallel.ep_transport`` resolves
            for (``auto``: the ``shm`` heap for CPU ranks of one host, :mod:`moonrt.comm.ep.heap`; the collectives
            for a group spanning hosts). Building the part with an EP group is collective over that group.

    The placement policy is ``parallel.ep_dispatcher``: ``moonep`` or ``alltoall`` (the unbalanced baseline).
    """

    kind = "expert"

    def __init__(self, parallel: ParallelConfig, *, capacity: int, mesh: ProcessMesh | None = None,
                 num_slots: int | None = None, kernels: str = "auto", device_type: str = "cpu") -> None:
        if parallel.ep_dispatcher not in EP_DISPATCHERS:
            raise ConfigError(f"parallel.ep_dispatcher = {parallel.ep_dispatcher!r}: expected one of "
                              + ", ".join(EP_DISPATCHERS))
        self.parallel, self.capacity, self.num_slots = parallel, capacity, num_slots
        self.kernels = kernels
        if mesh is None and parallel.world_size > 1:
            if not dist.is_initialized():  # joining a job is the caller's (moonrt.cluster.env.init_distributed)
                raise RuntimeError(f"ExpertParallel: parallel.ep = {parallel.ep} needs the default process group; "
                                   "expected torch.distributed initialized first (moonrt.cluster.env.init_distributed) "
                                   "or a mesh")
            mesh = ProcessMesh(parallel)
        self.mesh = mesh
        if mesh is not None:
            self.ep_group = mesh.group(Group.EP)
            self.ep_rank, self.ep_size = mesh.rank(Group.EP), mesh.size(Group.EP)
            self.is_main = mesh.global_rank == 0
        else:
            self.ep_group, self.ep_rank, self.ep_size, self.is_main = None, 0, 1, True
        self.dispatchers: dict[int, EPDispatcher] = {}
        self._expert_params: set[int] = set()
        self._expert_slices: dict[int, tuple[int, int, int]] = {}  # id(param) -> (first, num_local, E)
        self._sent = (0, 0, 0)  # (token rows, assignments, token bytes) sent to other EP ranks, at the last step
        self.device: torch.device | None = None
        """Where the model's parameters live (set by :meth:`parallelize`): the norm's scalars are made there."""
        self.heap: SymmetricHeap | None = None
        self._heap_transport: HeapTransport | None = None
        self.ep_transport = parallel.ep_transport
        """The backend the dispatchers move rows with: ``parallel.ep_transport`` resolved for the EP group
        (:func:`moonrt.comm.transport.select.resolve_backend`: ``auto`` is ``shm`` for CPU ranks of one host); as
        given when there is no EP group."""
        if self.ep_size > 1:  # collective over the EP group: every rank resolves the same backend
            # CPU ranks: the shm heap's rendezvous (host metadata) runs over the mesh's gloo group of the EP ranks;
            # GPUs: torch symmetric memory rendezvouses over the EP group itself
            group = mesh.cpu_group(Group.EP) if device_type == "cpu" else self.ep_group
            transport = build_transport(parallel.ep_transport, group, device_type)
            self.ep_transport = transport.name
            if transport.one_sided:
                self.heap = cast(SymmetricHeap, transport)  # one_sided: a SymmetricHeap by the seam's contract

    # ---- model -------------------------------------------------------------------------------------
    def parallelize(self, model: nn.Module) -> nn.Module:
        """Shard every MoE layer's experts to this EP rank's home slice and install the dispatcher."""
        self.device = next(iter(model.parameters())).device
        if self.ep_size == 1:
            return model
        kind = self.parallel.ep_dispatcher
        layers = list(trainable(model).moe_layers())
        heap = None  # one heap transport for every layer: its receive slots are shared by the layers
        if self.heap is not None:
            heap = HeapTransport(self.heap, self.capacity, max(moe.top_k for _, moe in layers) if layers else 1)
            self._heap_transport = heap
        pools: dict[tuple, SlotPool] = {}  # one slot pool shared by every layer of the same expert shape
        for index, moe in layers:
            E = moe.num_experts
            if E % self.ep_size:
                raise ConfigError(f"num_experts = {E}: expected a multiple of ep = {self.ep_size}")
            per = E // self.ep_size
            moe.experts.shard(self.ep_rank * per, per)
            ws = moe.experts.weights()
            placement = placement_policy(kind, num_slots=self.num_slots, kernels=self.kernels)
            slots = placement.slots(per)
            pool = None
            if slots:
                key = (slots, sum(w[0].numel() for w in ws), ws[0].dtype, ws[0].device)
                if key not in pools:
                    pools[key] = SlotPool(*key)
                pool = pools[key]
            moe.dispatcher = self.dispatchers[index] = EPDispatcher(
                self.ep_group, self.capacity, moe.experts.latent, moe.top_k, E, placement=placement, pool=pool,
                dedup=self.parallel.ep_dedup, token_padding=self.parallel.token_padding, transport=heap)
            for p in moe.experts.parameters():
                self._expert_params.add(id(p))
                self._expert_slices[id(p)] = (moe.experts.first_expert, moe.experts.num_local, E)
        return model

    # ---- gradients ---------------------------------------------------------------------------------
    def is_expert(self, p: torch.Tensor) -> bool:
        return id(p) in self._expert_params

    def sync_grads(self, model: nn.Module, reduce_dtype: torch.dtype = torch.float32) -> bool:
        """Sum gradients over replicas in ``reduce_dtype``: experts over ``dp_cp``, everything else over
        ``dp_ep_cp``."""
        if self.mesh is None:
            return True
        params = [p for p in model.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:  # every rank must join the same all-reduce
                p.grad = torch.zeros_like(p)
        experts = [p for p in params if self.is_expert(p)]
        dense = [p for p in params if not self.is_expert(p)]
        for group, members in ((Group.DP_EP_CP, dense), (Group.DP_CP, experts)):
            if members and self.mesh.size(group) > 1:
                flat = torch.cat([p.grad.reshape(-1) for p in members])
                all_reduce_grad(flat, self.mesh.group(group), reduce_dtype)
                for p, g in zip(members, flat.split([p.numel() for p in members])):
                    p.grad.copy_(g.view_as(p.grad))
        return True

    def grad_norm(self, params: Iterable[torch.Tensor]) -> GradNorm:
        """The global norm's terms: replicated (dense) gradients once, as they are on every rank; the expert shards
        summed over the EP group (each rank holds its home experts')."""
        grads = [(p, p.grad) for p in params if p.grad is not None]
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        dense = sum((g.double().pow(2).sum() for p, g in grads if not self.is_expert(p)), zero)
        expert = sum((g.double().pow(2).sum() for p, g in grads if self.is_expert(p)), zero.clone())
        return GradNorm([(dense, ()), (expert, (self.ep_group,) if self.ep_size > 1 else ())], [g for _, g in grads])

    # ---- checkpoints -------------------------------------------------------------------------------
    def _sharded(self, model: nn.Module) -> list[tuple[str, nn.Parameter]]:
        """``(name, param)`` of every sharded expert parameter, in ``named_parameters`` order."""
        return [(n, p) for n, p in model.named_parameters() if id(p) in self._expert_slices]

    def shard_map(self, model: nn.Module) -> dict[int, tuple[tuple[int, ...], int]]:
        """``id(param) -> (single-process shape (E, ...), first home expert)`` of every sharded expert parameter."""
        if self.ep_size == 1:
            return {}
        return {id(p): ((self._expert_slices[id(p)][2], *p.shape[1:]), self._expert_slices[id(p)][0])
                for _, p in self._sharded(model)}

    def describe(self, model: nn.Module, optim: torch.optim.Optimizer, desc: StateDescription) -> StateDescription:
        """The checkpoint state of the expert shards: rows ``[first, first + E/R)`` of the single-process ``[E, ...]``
        tensor (:meth:`shard_map`; their AdamW moments the same range of the flattened tensor, a Muon momentum the
        box of rows at ``(first, 0, ...)``); everything else as ``desc`` has it (replicas: whole)."""
        desc.shards.update(self.shard_map(model))
        return desc

    # ---- per-step metrics and routing counts --------------------------------------------------------
    def layer_counts(self, model: nn.Module) -> list[torch.Tensor]:
        """``[R, E]`` int64 routing counts of the last forward of every MoE layer (R = EP ranks)."""
        out = []
        for index, moe in trainable(model).moe_layers():
            disp = self.dispatchers.get(index)
            if disp is not None and disp.last_counts is not None:
                out.append(disp.last_counts.clone())
            else:
                out.append(moe.last_counts.reshape(1, -1).clone())
        return out

    def close(self) -> None:
        """Drop the heap's mappings (its segments were unlinked when they were mapped: nothing stays in /dev/shm)."""
        if self._heap_transport is not None:
            self._heap_transport.close()
        if self.heap is not None:
            self.heap.close()

    def step_metrics(self, step: int, model: nn.Module, record: dict[str, Any]) -> None:
        """After a training step (before eval): rows each EP rank computed and the unbalanced maximum."""
        if not self.dispatchers:
            return
        counts = self.layer_counts(model)
        first = min(self.dispatchers)
        record["ep_rows"] = [int(r) for r in self.dispatchers[first].last_rows]
        home = [int(c.sum(0).view(self.ep_size, -1).sum(1).max()) for c in counts]
        rows = [int(d.last_rows.max()) for d in self.dispatchers.values()]
        record["ep_rows_max"] = max(rows)
        record["ep_rows_unbalanced_max"] = max(home)
        # this rank's dispatch traffic to the other EP ranks since the last step (forward dispatches and combines,
        # replays included; backward mirrors it): token rows (one per (token, rank) with ep_dedup), assignments, bytes
        peers = [d for d in range(self.ep_size) if d != self.ep_rank]
        sent = tuple(sum(sum(getattr(disp.counters, key)[d] for d in peers) for disp in self.dispatchers.values())
                     for key in ("rows_sent", "assignments_sent", "token_bytes_sent"))
        delta = [now - before for now, before in zip(sent, self._sent)]
        self._sent = sent
        record["ep_token_rows_sent"], record["ep_assignments_sent"], record["ep_token_bytes_sent"] = delta
