"""One composable parallelism object for a training job: where this rank sits, and the parts that act on it.

The training loop (``moonrt train``) is the same code whatever is parallel: it calls
:meth:`Parallelism.parallelize` once, then per step :meth:`forward_backward` (the pipeline part runs its
schedule there), :meth:`sync_grads`, :meth:`clip_grad_norm`, :meth:`step` (instead of ``optimizer.step()``),
:meth:`sum_stats` / :meth:`sum_scalar` and :meth:`step_metrics`, and :meth:`full_state_dict` /
:meth:`load_full_state_dict` for checkpoints in the single-process layout (gathered), :meth:`sharded_state_dict` /
:meth:`load_sharded_state_dict` for sharded DCP checkpoints (each rank its own pieces), :meth:`close` at the end.
The four checkpoint calls are the generic functions of :mod:`moonrt.comm.state.describe` over this rank's one
description of its state, :meth:`describe`, which every part refines (:meth:`Part.describe`: experts by rows, ZeRO by
optimizer-state shard, the pipeline by stage); no part has checkpoint verbs of its own.
A single-process job is this object with no parts and no replica group.

Order of the parts: the table :data:`moonrt.comm.compose.COMPOSITION` (pipeline, ZeRO, experts, routing trace),
applied by :func:`moonrt.comm.compose.compose`, which also links each wrapping part to the part it wraps; the
assembly (``moonrt.jobs.train.assemble.parallel_runtime``) only builds the parts. Parts whose
:meth:`Part.sync_grads` returns False (the pipeline's sum of the pseudo-queries over its stages) run before the
part that handles the sum. After :meth:`sync_grads` a part that handles it may have moved the gradients out of
``p.grad`` (ZeRO-1 keeps only its shard), so the loop reads gradients only through :meth:`clip_grad_norm` and
:meth:`step`.

A :class:`Part` is one parallel dimension's contribution (expert parallelism, the pipeline:
:class:`moonrt.comm.pp.part.PipelineParallel`). Every method has a do-nothing default; for the verbs that one
part must own (summing gradients, clipping) the first part that handles the call
wins (it returns True / a value instead of the default; likewise for running the step,
:meth:`forward_backward` / :meth:`loss_sum`, and the optimizer update, :meth:`step`), otherwise the
object's own replicated-data default runs: per-tensor all-reduce over the replica group, torch's
global-norm clip.

Gradient clipping is one function, :func:`clip_to_global_norm`: a part declares its :class:`GradNorm`
(:meth:`Part.grad_norm`: fp64 squared sums of the gradient elements this rank counts, each with the groups to sum
it over, and the tensors a clip scales), and the first part that declares one decides the norm; a wrapping part
(the pipeline) builds its contribution from its inner part's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from moonrt.comm.grad_reduce import REDUCE_DTYPES, all_reduce_grad
from moonrt.comm.state.describe import StateDescription, gather_full_state, local_description, scatter_full_state
from moonrt.parallel.context import LOCAL, AttentionContext
from moonrt.parallel.model import trainable
from moonrt.parallel.packing import DocumentPacking

Saved = contextlib.AbstractContextManager[object] | None
"""A reusable context manager entered around each forward (the activation manager), or None."""

StateDict = dict[str, Any]
"""A state dict (``{"model", "optimizer"}`` or a DCP state): Any, because torch's state-dict values are tensors,
numbers and nested optimizer state of no single type."""

Record = dict[str, Any]
"""One step's metrics record: Any, because its values are JSON numbers, lists and strings of no single type."""


@dataclasses.dataclass
class GradNorm:
    """A part's contribution to the global gradient norm (see :func:`clip_to_global_norm`).

    ``terms``: ``(sq, groups)`` pairs, ``sq`` an fp64 scalar (the summed squares of the gradient elements this rank
    counts: every element of the single-process gradient counted by exactly one rank after the sums), summed over
    the ranks of each group of ``groups`` in turn (``()``: not summed; None in it: the default group).
    ``grads``: the gradient tensors a clip scales in place.
    """

    terms: list[tuple[torch.Tensor, tuple[dist.ProcessGroup | None, ...]]]
    grads: list[torch.Tensor]


def clip_to_global_norm(norm: GradNorm, max_norm: float) -> float:
    """The global gradient norm of ``norm``'s terms, and the clip of its gradients to ``max_norm`` (torch's rule:
    scale by ``max_norm / (norm + 1e-6)`` when that is below 1); returns the norm.

    Terms with the same ``groups`` are added first (in order), then each such sum is all-reduced over its groups in
    turn (groups of one rank skipped) and the sums are added (in first-appearance order) to the squared norm.
    """
    sums: dict[tuple[dist.ProcessGroup | None, ...], torch.Tensor] = {}
    for sq, groups in norm.terms:
        sums[groups] = sums[groups] + sq if groups in sums else sq.clone()
    total = 0.0
    for groups, sq in sums.items():
        for group in groups:
            if dist.is_initialized() and dist.get_world_size(group) > 1:
                dist.all_reduce(sq, group=group)
        total += float(sq)  # fp64 on the host: the same additions in the same order as fp64 tensors
    value = math.sqrt(max(total, 0.0))
    coef = max_norm / (value + 1e-6)
    if coef < 1.0:
        for g in norm.grads:
            g.mul_(coef)
    return value


class Part:
    """One parallel dimension's hooks into the training loop (all defaults do nothing).

    ``kind`` names its row of the composition table (:data:`moonrt.comm.compose.COMPOSITION`);
    ``counts_every_rank`` declares that its :meth:`grad_norm` is already summed over every rank of the job (ZeRO:
    disjoint shards): a wrapping part then names, through the part's :meth:`accept_duplicates`, the parameters whose
    gradient another rank counts, instead of adding a sum of its own.
    """

    kind: str = ""
    counts_every_rank: bool = False
    inner: Part | None = None
    """The part this one wraps and delegates to (:meth:`wrap`); None: it wraps none."""

    def wrap(self, inner: Part) -> None:
        """Take ``inner`` as the part this one delegates to (set by :func:`moonrt.comm.compose.compose`)."""
        self.inner = inner

    def parallelize(self, model: nn.Module) -> nn.Module:
        """Shard or wrap ``model`` for this dimension (once, before the optimizer is built)."""
        return model

    def accept_duplicates(self, names: set[str]) -> None:
        """Leave the parameters ``names`` out of :meth:`grad_norm`: their (synced) gradient on this rank is a copy of
        one another rank counts. Only a part that declares :attr:`counts_every_rank` takes them (it overrides this);
        any other part refuses (TypeError), so a wrapping part never sets state on a part that would ignore it."""
        raise TypeError(f"{type(self).__name__}: takes no duplicates (counts_every_rank is False: a wrapping part "
                        "adds its own norm sum)")

    def forward_backward(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, scale: float,
                         ctx: AttentionContext = LOCAL, saved: Saved = None) -> torch.Tensor | None:
        """Forward and backward of this rank's ``x``/``y`` ``[B, T]`` (the loss is the summed token loss
        times ``scale``); returns the detached loss, or None to leave it to the default (one forward, one
        backward of the whole model)."""
        return None

    def loss_sum(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor,
                 ctx: AttentionContext = LOCAL) -> torch.Tensor | None:
        """Summed token loss of ``x``/``y`` without gradients (eval), or None for the default."""
        return None

    def sync_grads(self, model: nn.Module, reduce_dtype: torch.dtype = torch.float32) -> bool:
        """Sum every gradient over its replicas, sent and summed in ``reduce_dtype`` (the job's
        :attr:`Precision.reduce_dtype`: through :mod:`moonrt.comm.grad_reduce`); True if this part did it (then no
        other sum runs)."""
        return False

    def grad_norm(self, params: list[torch.Tensor]) -> GradNorm | None:
        """This part's contribution to the global gradient norm (after :meth:`sync_grads`), or None."""
        return None

    def clip_grad_norm(self, params: list[torch.Tensor], max_norm: float) -> float | None:
        """Clip to the global gradient norm and return it, or None to leave it to the default: by default the one
        clip, :func:`clip_to_global_norm`, of this part's :meth:`grad_norm`."""
        norm = self.grad_norm(params)
        return None if norm is None else clip_to_global_norm(norm, max_norm)

    def step(self, optim: torch.optim.Optimizer) -> bool:
        """Update the parameters from the synced, clipped gradients; True if this part did it (else
        ``optim.step()`` runs)."""
        return False

    def describe(self, model: nn.Module, optim: torch.optim.Optimizer, desc: StateDescription) -> StateDescription:
        """Refine ``desc``, the checkpoint state description of the parts this one wraps (or of one process:
        :func:`moonrt.comm.state.describe.local_description`), by this part's dimension, and return it (the default:
        unchanged). A part only says what this rank holds; gathering, scattering and DCP's entries are the generic
        functions of :mod:`moonrt.comm.state.describe`."""
        return desc

    def wrapped(self) -> Part | None:
        """The part this one wraps (:meth:`wrap`), or None."""
        return getattr(self, "inner", None)

    def state_description(self, model: nn.Module, optim: torch.optim.Optimizer) -> StateDescription:
        """The description of this part and the parts it wraps, innermost first (what :meth:`Parallelism.describe`
        gives for a job of these parts alone)."""
        chain: list[Part] = []
        part: Part | None = self
        while part is not None:
            chain.append(part)
            part = part.wrapped()
        desc = local_description(model, optim)
        for part in reversed(chain):
            desc = part.describe(model, optim, desc)
        return desc

    def step_metrics(self, step: int, model: nn.Module, record: Record) -> None:
        """Add this part's per-step metrics to ``record`` (after the optimizer step, before eval)."""

    def close(self) -> None:
        """Release buffers and write final outputs (once, after the last step)."""


@runtime_checkable
class ExpertSharding(Protocol):
    """What a part that owns every parameter's state (ZeRO, :mod:`moonrt.comm.zero.core`) asks of the part that
    shards the routed experts (:class:`moonrt.comm.ep.parallel.ExpertParallel`): which parameters are expert shards
    and where each shard sits in its single-process tensor (the checkpoint state of the rows is the expert part's
    :meth:`Part.describe`)."""

    def is_expert(self, p: torch.Tensor) -> bool:
        """True for a routed-expert parameter (summed over the expert replicas, not the dense ones)."""
        ...

    def shard_map(self, model: nn.Module) -> dict[int, tuple[tuple[int, ...], int]]:
        """``id(param) -> (single-process shape (E, ...), first home expert)`` of every sharded expert parameter."""
        ...


COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
"""The compute dtypes a job may name (``precision.compute``, ``--dtype``) and their torch dtypes."""


@dataclasses.dataclass(frozen=True)
class Precision:
    """The job's mixed precision: torch's native AMP (``torch.autocast``), as torchtitan's FSDP2
    ``MixedPrecisionPolicy`` without the sharding.

    ``compute``: a key of :data:`COMPUTE_DTYPES`; ``device_type``: the job's device type (``cpu``, ``cuda``).
    Parameters are fp32 whatever ``compute`` is: they are the master weights the optimizer (and each ZeRO-1 shard)
    updates and the checkpoints store, so a bf16 checkpoint and an fp32 one are the same kind of file. With
    ``bf16`` every forward runs under ``torch.autocast(device_type, dtype=torch.bfloat16)``: matmuls, linears and
    einsums compute in bf16 on bf16 copies of the fp32 weights (made once per autocast region, autocast's weight
    cache), everything else in its inputs' dtype; the numerics rule's fp32 islands turn autocast off
    (:mod:`moonrt.ops.precision`). Gradients reach the fp32 parameters in fp32 (autograd casts a gradient back to
    its input's dtype), so accumulation over micro-steps, the clip and the update are fp32, as in an fp32 job.

    ``reduce``: a key of :data:`moonrt.comm.grad_reduce.REDUCE_DTYPES`, the dtype every gradient sum over ranks is
    sent and summed in (:mod:`moonrt.comm.grad_reduce`): ``fp32`` (the default: fp32 gradients summed as they are)
    or ``bf16`` (cast to bf16, summed in bf16 arithmetic by the collective, written back into the fp32 gradient or
    shard), independent of ``compute``.

    Backward: the default step runs only the forward under autocast and calls ``backward()`` outside it (the usage
    torch recommends). A part that runs its own schedule (the pipeline: forward and backward of each micro-batch
    interleaved) runs it whole inside the region; that is equivalent, because autograd runs every backward op in
    the dtypes its forward op saw and autocast casts only at the forward op's entry (a bf16 matmul's gradient
    is a bf16 matmul either way; the cast nodes' backward casts back to fp32), and the custom autograd functions
    whose backward does math decorate it with :func:`moonrt.ops.precision.fp32_island` (or disable autocast).
    """

    compute: str = "fp32"
    device_type: str = "cpu"
    reduce: str = "fp32"

    def __post_init__(self) -> None:
        if self.compute not in COMPUTE_DTYPES:
            raise ValueError(f"precision.compute = {self.compute!r}: expected one of {', '.join(COMPUTE_DTYPES)}")
        if self.reduce not in REDUCE_DTYPES:
            raise ValueError(f"precision.reduce = {self.reduce!r}: expected one of {', '.join(REDUCE_DTYPES)}")

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype (:data:`COMPUTE_DTYPES`)."""
        return COMPUTE_DTYPES[self.compute]

    @property
    def reduce_dtype(self) -> torch.dtype:
        """The dtype gradients are summed over ranks in (:data:`moonrt.comm.grad_reduce.REDUCE_DTYPES`)."""
        return REDUCE_DTYPES[self.reduce]

    def autocast(self) -> contextlib.AbstractContextManager[object]:
        """``torch.autocast(device_type, dtype=bfloat16)`` for ``bf16``; a null context for ``fp32`` (no autocast:
        an fp32 job is the same code as before mixed precision existed)."""
        if self.compute == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.dtype)


@dataclasses.dataclass
class Parallelism:
    """This rank's place in the job and the parts acting on it (see the module docstring).

    ``dp_rank``/``dp_size`` index the ranks that see different batch rows, ``cp_rank``/``cp_size`` the
    slices of one sequence; ``ctx`` is the attention context the model's attention layers use;
    ``replicas`` is the group over which gradients, router statistics and scalars are summed (None: one
    process). ``device`` is where this rank computes (``moonrt.jobs.train.device.bind_device``): the model, the
    batches and every tensor the runtime makes (the scalars it sums, its buffers) live there.
    """

    dp_rank: int = 0
    dp_size: int = 1
    cp_rank: int = 0
    cp_size: int = 1
    is_main: bool = True
    ctx: AttentionContext = LOCAL
    replicas: dist.ProcessGroup | None = None
    cpu_group: dist.ProcessGroup | None = None
    """The gloo group host metadata and objects travel over (:meth:`moonrt.comm.mesh.ProcessMesh.cpu_group`: object
    collectives, DCP's planning); None: the default group."""
    parts: list[Part] = dataclasses.field(default_factory=list)
    device: torch.device = dataclasses.field(default_factory=lambda: torch.device("cpu"))
    precision: Precision = dataclasses.field(default_factory=lambda: Precision())

    def autocast(self) -> contextlib.AbstractContextManager[object]:
        """The region every forward of the job runs in (:meth:`Precision.autocast`)."""
        return self.precision.autocast()

    def parallelize(self, model: nn.Module) -> nn.Module:
        for part in self.parts:
            model = part.parallelize(model)
        return model

    def forward_backward(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, scale: float,
                         saved: Saved = None, packing: DocumentPacking | None = None) -> torch.Tensor:
        """Forward and backward of this rank's batch ``x``/``y`` ``[B, T]``: the summed token loss times
        ``scale`` (1 / global token count) back-propagated into the gradients; returns it detached.

        ``saved``: a reusable context manager entered around the forward (the activation manager) or None.
        The first part that runs the step wins (the pipeline); the default is one forward, one backward.
        ``packing`` (packed documents, ``moonrt.parallel.packing``) reaches the model on the default path only (the
        job config refuses packing with the parts that run the step); None calls ``loss_sum`` without it.
        """
        for part in self.parts:
            with self.autocast():  # a part's own backward runs inside it too (see Precision)
                loss = part.forward_backward(model, x, y, scale, self.ctx, saved)
            if loss is not None:
                return loss
        with saved if saved is not None else contextlib.nullcontext(), self.autocast():
            kwargs = {} if packing is None else {"packing": packing}
            loss = trainable(model).loss_sum(x, y, ctx=self.ctx, **kwargs) * scale
        loss.backward()
        return loss.detach()

    def loss_sum(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor,
                 packing: DocumentPacking | None = None) -> torch.Tensor:
        """Summed token loss of ``x``/``y`` ``[B, T]`` without gradients (call under ``torch.no_grad``)."""
        with self.autocast():
            for part in self.parts:
                loss = part.loss_sum(model, x, y, self.ctx)
                if loss is not None:
                    return loss
            return trainable(model).loss_sum(x, y, ctx=self.ctx, **({} if packing is None else {"packing": packing}))

    def sync_grads(self, model: nn.Module) -> None:
        """Sum every gradient over its replicas in :attr:`Precision.reduce_dtype`: the first part that handles it,
        else one all-reduce per gradient over ``replicas`` (:func:`moonrt.comm.grad_reduce.all_reduce_grad`)."""
        dtype = self.precision.reduce_dtype
        if any(part.sync_grads(model, dtype) for part in self.parts) or self.replicas is None:
            return
        for p in model.parameters():
            if p.grad is not None:
                all_reduce_grad(p.grad, self.replicas, dtype)

    def clip_grad_norm(self, params: Iterable[torch.Tensor], max_norm: float) -> float:
        params = list(params)
        for part in self.parts:
            norm = part.clip_grad_norm(params, max_norm)
            if norm is not None:
                return float(norm)
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))

    def step(self, optim: torch.optim.Optimizer) -> None:
        """The optimizer update: the first part that handles it (ZeRO-1: AdamW on its shards), else ``optim.step()``."""
        if not any(part.step(optim) for part in self.parts):
            optim.step()

    def sum_stats(self, t: torch.Tensor) -> torch.Tensor:
        """Sum a tensor in place over the ranks that routed different tokens (Quantile Balancing histograms)."""
        if self.replicas is not None:
            dist.all_reduce(t, group=self.replicas)
        return t

    def sum_scalar(self, x: float) -> float:
        """Sum a float over the ranks that saw different tokens (fp64)."""
        if self.replicas is None:
            return x
        return float(self.sum_stats(torch.tensor([x], dtype=torch.float64, device=self.device)))

    def any_flag(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is True on any rank of the job: one int all-reduce MAX over the
        default group (collective: every rank calls it at the same point, e.g. a step boundary, so all agree
        on the step a stop signal takes effect). One process: ``flag``."""
        return bool(self.max_ints([int(flag)])[0])

    def max_ints(self, values: list[int]) -> list[int]:
        """Each of ``values`` maximized over every rank of the job in one int64 all-reduce MAX over the default
        group (collective, like :meth:`any_flag`). One process: ``values``."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return list(values)
        t = torch.tensor(values, dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return [int(v) for v in t.tolist()]

    # ---- checkpoint state: one description, composed by the parts; generic functions over it --------------------
    def describe(self, model: nn.Module, optim: torch.optim.Optimizer) -> StateDescription:
        """What of the single-process checkpoint state this rank holds: one process's description
        (:func:`moonrt.comm.state.describe.local_description`) refined by every part, innermost first
        (:meth:`Part.describe`: experts by rows, ZeRO by optimizer-state shard, the pipeline by stage)."""
        desc = local_description(model, optim)
        for part in reversed(self.parts):
            desc = part.describe(model, optim, desc)
        return desc

    def full_state_dict(self, model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
        """``{"model", "optimizer"}`` in the single-process layout on every rank (collective:
        :func:`moonrt.comm.state.describe.gather_full_state` over :attr:`cpu_group`)."""
        return gather_full_state(self.describe(model, optim), self.cpu_group)

    def load_full_state_dict(self, model: nn.Module, optim: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        """Load a single-process-layout state into this rank's pieces
        (:func:`moonrt.comm.state.describe.scatter_full_state`)."""
        scatter_full_state(self.describe(model, optim), state)

    def sharded_state_dict(self, model: nn.Module, optim: torch.optim.Optimizer, save: bool = True) -> dict[str, Any]:
        """This rank's DCP state (:meth:`moonrt.comm.state.describe.StateDescription.entries`): ``save=True`` what
        it writes (a copy another rank writes left out), False the load targets of everything it holds."""
        return self.describe(model, optim).entries(save)

    def load_sharded_state_dict(self, model: nn.Module, optim: torch.optim.Optimizer, state: StateDict) -> None:
        """Finish a load into the targets of ``sharded_state_dict(model, optim, save=False)`` that DCP filled."""
        self.describe(model, optim).finish(state)

    def step_metrics(self, step: int, model: nn.Module, record: Record) -> None:
        for part in self.parts:
            part.step_metrics(step, model, record)

    def close(self) -> None:
        for part in self.parts:
            part.close()
        close_ctx = getattr(self.ctx, "close", None)  # ContextParallel: its summary gather's heap
        if close_ctx is not None:
            close_ctx()


class RoutingTrace(Part):
    """Records every step's per-MoE-layer ``[R, E]`` routing counts and writes them as a trace ``.npz``.

    The format is :mod:`moonrt.scheduler.workload`'s (what ``moonrt ep-sim --trace`` reads). ``counts(model)``
    returns the last forward's counts per MoE layer: ``[R, E]`` from the EP dispatchers under expert
    parallelism, ``[1, E]`` from the layers themselves in one process (:func:`local_counts`). The
    model is found by duck typing (``model.moe_layers()`` yields ``(index, layer)`` with ``top_k``). ``model`` /
    ``sizes``: the routing model's name and expert sizes (:func:`moonrt.scheduler.workload.expert_sizes`), stored in
    the trace so that ``ep-sim`` sizes its MB columns for this model.
    """

    kind = "trace"

    def __init__(self, path: str | Path, *, is_main: bool = True,
                 counts: Callable[[nn.Module], list[torch.Tensor]] | None = None, model: str | None = None,
                 sizes: dict[str, int] | None = None) -> None:
        self.path, self.is_main = Path(path), is_main
        self.model, self.sizes = model, sizes
        self.counts = counts if counts is not None else local_counts
        self.steps: list[np.ndarray] = []
        self.layer_ids: list[int] = []
        self.top_k = 1

    def parallelize(self, model: nn.Module) -> nn.Module:
        moe_layers = trainable(model).moe_layers()
        self.layer_ids = [i for i, _ in moe_layers]
        self.top_k = max([int(moe.top_k) for _, moe in moe_layers], default=1)
        return model

    def step_metrics(self, step: int, model: nn.Module, record: Record) -> None:
        counts = self.counts(model)
        if counts:
            self.steps.append(torch.stack(counts).cpu().numpy())  # the trace is written with numpy

    def close(self) -> None:
        if not (self.is_main and self.steps):
            return
        from moonrt.scheduler.workload import save_trace

        save_trace(self.path, np.stack(self.steps).astype(np.int64), self.top_k,
                   layer_ids=np.asarray(self.layer_ids), model=self.model, sizes=self.sizes)


def local_counts(model: nn.Module) -> list[torch.Tensor]:
    """``[1, E]`` int64 routing counts of the last forward of every MoE layer of a one-process model."""
    return [moe.last_counts.reshape(1, -1).clone() for _, moe in trainable(model).moe_layers()]
