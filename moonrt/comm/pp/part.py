"""Pipeline parallelism as a :class:`moonrt.comm.parallelism.Part` (K3_SYSTEMS §9, §10).

:class:`PipelineParallel` cuts the model into ``pp * vpp`` stages (``model.stages``), keeps on this rank
only the modules its stages use (``model.stage_modules``; the others are replaced by None), and runs
every step's micro-batches through :class:`moonrt.comm.pp.executor.PipelineExecutor` with the rank's
lowered action list. Gradients of parameters held by several pipeline ranks (the AttnRes
pseudo-queries) are summed over the pp group; the gradient norm is the global one; checkpoints stay in
the single-process layout or sharded for DCP, through the generic functions of :mod:`moonrt.comm.state.describe`
over this rank's description (:meth:`describe`: its stages' state, the full model's names, the pseudo-queries
written by one pp rank).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from moonrt.comm.grad_reduce import all_reduce_grad
from moonrt.comm.parallelism import GradNorm, Part
from moonrt.comm.pp.cache import block_plan
from moonrt.comm.pp.executor import PipelineExecutor
from moonrt.comm.state.describe import StateDescription
from moonrt.config import ConfigError
from moonrt.parallel.context import LOCAL, AttentionContext
from moonrt.parallel.model import trainable
from moonrt.scheduler.pipeline import Action, Schedule, lower, validate
from moonrt.scheduler.pipeline_p2p import check_nccl_order, p2p_groups


class PipelineParallel(Part):
    """This rank's pipeline: ``group`` (the pp group), ``rank``/``size`` in it, the schedule and AttnRes mode.

    ``schedule`` is a :class:`moonrt.scheduler.pipeline.Schedule` of ``size`` ranks (compute-only or
    lowered; it is lowered and validated here, and its sends and receives grouped into ``batch_isend_irecv`` calls
    by :func:`moonrt.scheduler.pipeline_p2p.p2p_groups`, an order proven deadlock-free under NCCL's rules by
    :func:`~moonrt.scheduler.pipeline_p2p.check_nccl_order`), ``mode`` "cached" or "naive" (K3_SYSTEMS §9). ``inner``: a
    part that shards this rank's stages further (expert parallelism, ZeRO-1; set by
    :func:`moonrt.comm.compose.compose`): its gradient-norm terms and its single-process-layout state of the
    stages are what the pipeline combines over the pp group. An inner part that declares
    :attr:`Part.counts_every_rank` (ZeRO) has a norm already global: the pipeline names the pseudo-queries it
    does not own to ``inner.accept_duplicates`` and takes that norm as it is. ``objects``: the gloo group over the same
    ranks that the object collectives use (:meth:`moonrt.comm.mesh.ProcessMesh.cpu_group`; default ``group``).
    """

    kind = "pipeline"

    def __init__(self, schedule: Schedule, *, group: Any, rank: int, mode: str = "cached",
                 inner: Part | None = None, objects: Any = None) -> None:
        self.schedule = validate(lower(schedule))
        self.objects = group if objects is None else objects
        self.items = p2p_groups(self.schedule)
        check_nccl_order(self.schedule, self.items)
        self.group, self.rank, self.mode = group, rank, mode
        self.inner = inner
        self.size = schedule.pp
        self.num_stages = schedule.num_stages
        self.my_stages = sorted(schedule.stage(rank, c) for c in range(schedule.vpp))

    def stage_of(self, chunk: int) -> int:
        return self.schedule.stage(self.rank, chunk)

    def rank_of(self, stage: int) -> int:
        return self.schedule.rank_of(stage)

    # ---- assembly ------------------------------------------------------------------------------
    def parallelize(self, model: nn.Module) -> nn.Module:
        stages_api = trainable(model)
        layout = stages_api.pipeline_layout()
        if layout.tied_embeddings and self.size > 1:
            raise ValueError("tie_word_embeddings = True: expected untied embeddings with pipeline parallelism "
                             "(the embedding and the LM head live on different ranks)")
        if self.num_stages > layout.num_layers:
            raise ConfigError(f"parallel.pp x vpp = {self.size} x {self.schedule.vpp} = {self.num_stages} stages: "
                              f"expected at most the model's decoder layers, {layout.num_layers} (a stage runs at "
                              "least one decoder layer)")
        self.full_names = [n for n, _ in model.named_parameters()]
        self.full_keys = list(model.state_dict().keys())
        ranges = stages_api.stages(self.num_stages)
        last = self.num_stages - 1
        self.plan = block_plan(ranges, layout.block_size, self.rank_of, self.mode)
        stage_mods = {s: stages_api.stage_modules(ranges[s], s == 0, s == last) for s in range(self.num_stages)}
        keep = {n for s in self.my_stages for n in stage_mods[s]}
        for name in stages_api.stage_modules(range(layout.num_layers), True, True):
            if name not in keep:
                parent, _, child = name.rpartition(".")
                (model.get_submodule(parent) if parent else model)._modules[child] = None
        self.stage_params = {s: [p for n in stage_mods[s] for p in model.get_submodule(n).parameters()]
                             for s in self.my_stages}
        mine = [n for n, _ in model.named_parameters()]
        every: list[list[str]] = [[]] * self.size  # each entry replaced by a rank's names
        dist.all_gather_object(every, mine, group=self.objects)
        self.shared = [n for n in mine if sum(n in names for names in every) > 1]
        partial = [n for n in self.shared if not all(n in names for names in every)]
        if partial:  # its gradient sum would need a group of its own
            raise ValueError(f"parameter {partial[0]!r}: held by some pipeline ranks but not all; expected a "
                             "parameter of one stage, or of every rank (the AttnRes pseudo-queries)")
        self.owned = {n for n in mine if n not in self.shared or self.rank == min(
            r for r, names in enumerate(every) if n in names)}
        if self.inner is not None and self.inner.counts_every_rank:  # its global norm counts each pseudo-query once
            self.inner.accept_duplicates(set(mine) - self.owned)
        self.executor = PipelineExecutor(model, self.plan, self.items[self.rank], rank=self.rank,
                                         rank_of=self.rank_of, stage_of=self.stage_of, group=self.group,
                                         params_of=lambda s: self.stage_params[s])
        # eval: one forward of the whole batch through every stage in order
        forward = tuple(tuple(Action("F", 0, self.schedule.chunk_of(st)) for st in range(self.num_stages)
                              if self.rank_of(st) == r) for r in range(self.size))
        self.eval_actions = p2p_groups(lower(dataclasses.replace(self.schedule, actions=forward)))[self.rank]
        self.width = layout.width
        self._named = dict(model.named_parameters())
        self.device = next(iter(self._named.values())).device  # collectives' tensors live here (NCCL: the GPU)
        return model

    # ---- the step ------------------------------------------------------------------------------
    def forward_backward(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, scale: float,
                         ctx: AttentionContext = LOCAL, saved: Any = None) -> torch.Tensor:
        """Run the schedule on ``x``/``y`` ``[B, T]`` split into the schedule's micro-batches; returns the
        pipeline's loss (summed over micro-batches, times ``scale``) on every pp rank."""
        m = self.schedule.microbatches
        if x.shape[0] % m:
            raise ValueError(f"microbatches = {m}: expected a divisor of the per-replica batch {x.shape[0]}")
        loss = self.executor.run(list(x.chunk(m)), list(y.chunk(m)), scale, self.width, self._dtype(model), ctx,
                                 saved)
        dist.all_reduce(loss, group=self.group)
        return loss

    def loss_sum(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor,
                 ctx: AttentionContext = LOCAL) -> torch.Tensor:
        """Forward only (no grad): the summed token loss of ``x``/``y`` on every pp rank."""
        ex = PipelineExecutor(model, self.plan, self.eval_actions, rank=self.rank, rank_of=self.rank_of,
                              stage_of=self.stage_of, group=self.group, params_of=lambda s: [])
        with torch.no_grad():
            loss = ex.run([x], [y], 1.0, self.width, self._dtype(model), ctx, forward_only=True)
        dist.all_reduce(loss, group=self.group)
        return loss

    @staticmethod
    def _dtype(model: nn.Module) -> torch.dtype:
        return next(p for p in model.parameters() if p.is_floating_point()).dtype

    # ---- gradients -----------------------------------------------------------------------------
    def sync_grads(self, model: nn.Module, reduce_dtype: torch.dtype = torch.float32) -> bool:
        """Sum the pseudo-query gradients over the pp group in ``reduce_dtype``; the data-parallel sum is the next
        part's (or the default's)."""
        params = dict(model.named_parameters())
        for n in self.shared:
            p = params[n]
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            all_reduce_grad(p.grad, self.group, reduce_dtype)
        return False  # the data-parallel sum over the replicas still runs

    def grad_norm(self, params: list[torch.Tensor]) -> GradNorm | None:
        """The global norm's terms: an inner part's that :attr:`Part.counts_every_rank` as they are; otherwise this
        rank's stages' terms (the inner part's, or the owned gradients' squares) each summed over the pp group too,
        a shared parameter (pseudo-query) counted on its lowest pp rank only."""
        named = self._named
        if self.inner is not None and self.inner.counts_every_rank:  # over every rank already; it clips its shards
            return self.inner.grad_norm(params)
        sq = torch.zeros((), dtype=torch.float64, device=self.device)
        if self.inner is not None:  # this rank's stages' terms from the inner part, shared params once
            inner = self.inner.grad_norm(params)
            if inner is None:  # compose() wraps only parts that declare one (zero, expert)
                raise TypeError(f"{type(self.inner).__name__}: declares no gradient norm; expected a part the "
                                "pipeline can wrap (zero, expert)")
            for n in set(named) - self.owned:
                g = named[n].grad
                if g is not None:
                    sq -= g.double().pow(2).sum()
            terms = [(t, (*groups, self.group)) for t, groups in inner.terms] + [(sq, (self.group,))]
        else:
            for n in self.owned:
                g = named[n].grad
                if g is not None:
                    sq += g.double().pow(2).sum()
            terms = [(sq, (self.group,))]
        return GradNorm(terms, [p.grad.detach() for p in params if p.grad is not None])

    # ---- metrics -------------------------------------------------------------------------------
    def step_metrics(self, step: int, model: nn.Module, record: dict[str, Any]) -> None:
        """Per pp rank, this step: forward blocks sent, forward bytes (blocks + partial), backward bytes, and the
        idle fraction (time blocked in receives / time of the action list)."""
        st = self.executor.stats
        mine = torch.tensor([st.blocks_sent, st.bytes_sent, st.bytes_sent_bwd], dtype=torch.int64, device=self.device)
        rows = [torch.zeros_like(mine) for _ in range(self.size)]
        dist.all_gather(rows, mine, group=self.group)
        record["pp_blocks_sent"] = [int(r[0]) for r in rows]
        record["pp_bytes_sent"] = [int(r[1]) for r in rows]
        record["pp_bytes_sent_bwd"] = [int(r[2]) for r in rows]
        times = torch.tensor([st.recv_wait_s, st.wall_s], dtype=torch.float64, device=self.device)
        trows = [torch.zeros_like(times) for _ in range(self.size)]
        dist.all_gather(trows, times, group=self.group)
        record["pp_idle_frac"] = [float(t[0] / t[1]) if t[1] > 0 else 0.0 for t in trows]
        vio = torch.tensor([float(record.get("maxvio", float("-inf")))], dtype=torch.float64, device=self.device)
        dist.all_reduce(vio, op=dist.ReduceOp.MAX, group=self.group)  # every stage's MoE layers, not only ours
        if float(vio) > float("-inf"):
            record["maxvio"] = float(vio)

    # ---- checkpoints in the single-process layout ----------------------------------------------
    def _groups(self, model: nn.Module, optim: torch.optim.Optimizer) -> list[list[str]]:
        """The full layout's parameter names of every optimizer group (every pp rank's, in model order)."""
        name_of = {id(p): n for n, p in model.named_parameters()}
        mine = [[name_of[id(p)] for p in g["params"]] for g in optim.param_groups]
        every: list[Any] = [None] * self.size
        dist.all_gather_object(every, mine, group=self.objects)
        order = {n: i for i, n in enumerate(self.full_names)}
        return [sorted({n for names in every for n in names[g]}, key=order.__getitem__) for g in range(len(mine))]

    def describe(self, model: nn.Module, optim: torch.optim.Optimizer, desc: StateDescription) -> StateDescription:
        """This rank's stages' state (as ``desc``, the wrapped part's, has it: this rank's model holds only its
        stages) in the full model's layout: the model keys and every optimizer group's parameters of every pp rank
        (:meth:`_groups`, collective over the pp group when a gather or scatter asks); a parameter every pp rank
        holds (a pseudo-query) is written by its lowest pp rank only (the others' copies are equal, and their ZeRO
        pieces of it are cut at other offsets)."""
        desc.layout = lambda: (list(self.full_keys), self._groups(model, optim))
        desc.not_saved |= set(self._named) - self.owned
        return desc


__all__ = ["PipelineParallel"]
