"""The model seam: what the runtime needs from a model, as one :class:`TrainableModel` protocol.

Like torchtitan's ``ModelSpec`` hooks, but structural: a model is any ``nn.Module`` with these members, and the
runtime (``moonrt.comm``: the parallel parts, the pipeline executor; the train job's loop and optimizers) calls
only them -- never a model family's classes or its config fields. The members, by who calls them:

- **the step** -- :meth:`~TrainableModel.loss_sum` ``(tokens, targets, ctx=LOCAL, packing=None)``: the summed
  next-token loss of ``tokens [B, T]``; ``ctx`` (:class:`~moonrt.parallel.context.AttentionContext`) is how
  attention reaches tokens of other context-parallel ranks, ``packing``
  (:class:`~moonrt.parallel.packing.DocumentPacking`) the documents packed in the rows.
- **pipeline stages** (``moonrt.comm.pp.part``, ``moonrt.comm.pp.executor``): :meth:`~TrainableModel.pipeline_layout`
  (depth, stream width and block size: :class:`PipelineLayout`), :meth:`~TrainableModel.stages` (the layer ranges of
  ``C`` stages), :meth:`~TrainableModel.stage_modules` (which submodules a stage uses; the others are dropped on
  ranks without the stage), and the stage run: :meth:`~TrainableModel.embed_tokens` -> :class:`Stream`,
  :meth:`~TrainableModel.run_layers` on it, :meth:`~TrainableModel.head` -> logits. What crosses a stage boundary
  is a :class:`Stream`: its finished ``blocks`` (each ``[B, T, width]``, one per :attr:`PipelineLayout.block_size`
  decoder layers; a plain residual stream is one block that every layer adds to) and the open ``partial`` block;
  the receiving stage rebuilds it with :meth:`~TrainableModel.stream`.
- **MoE routing** (the loop, expert parallelism, routing traces): :meth:`~TrainableModel.moe_layers`,
  :meth:`~TrainableModel.update_routing_bias`, :meth:`~TrainableModel.routing_counts`,
  :meth:`~TrainableModel.set_record_routing`. A model without MoE mixes in :class:`NoMoE` (no layers, no counts).
- **optimizer groups** (``moonrt.jobs.train.optimizers``): :meth:`~TrainableModel.param_groups`
  (:class:`ParamGroups`: which parameters take no weight decay; :func:`default_param_groups` derives it from the
  ``nn.Embedding`` modules). Muon's matrix blocks are their own seam, declared per module
  (:mod:`moonrt.parallel.blocks`).

A model family's config, presets, build and memory description are not the runtime's business: they are the
job layer's :class:`moonrt.models.spec.ModelSpec`. This module imports no torch (the planners read
:class:`PipelineLayout` without it); the protocol's ``= ...`` defaults are stub notation for the defaults named
in each docstring.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, cast, runtime_checkable

if TYPE_CHECKING:
    import torch
    from torch import nn

    from moonrt.parallel.context import AttentionContext
    from moonrt.parallel.dispatch import Dispatcher, ShardableExperts
    from moonrt.parallel.packing import DocumentPacking

MAX_LAYERS = 4096
"""Most decoder layers a model may have (:attr:`PipelineLayout.num_layers`): the parameter counts, the planners and
the layer patterns walk the layers one by one, so a typo of 10**9 would stall them before any size check; K3 has 93,
the deepest published decoders a few hundred."""


@dataclasses.dataclass(frozen=True, slots=True)
class PipelineLayout:
    """The shape of a model's layer stack, as the pipeline planner and executor see it.

    ``num_layers``: decoder layers (stages cut between them, ``1 <= num_layers <=`` :data:`MAX_LAYERS`);
    ``width``: the last dimension of every stream tensor ``[B, T, width]`` (what a stage boundary sends);
    ``block_size``: decoder layers per finished stream block (Block AttnRes: ``attn_res_block_size``; a plain
    residual model: ``num_layers``, its stream is one open block); ``tied_embeddings``: the input embedding and the
    LM head share one weight (refused with more than one pipeline rank: they live on different ranks).
    """

    num_layers: int
    width: int
    block_size: int
    tied_embeddings: bool = False

    def __post_init__(self) -> None:
        for name in ("num_layers", "width", "block_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"PipelineLayout.{name} = {value!r}: expected an integer >= 1")
        if self.num_layers > MAX_LAYERS:
            raise ValueError(f"PipelineLayout.num_layers = {self.num_layers}: expected at most {MAX_LAYERS} "
                             "(MAX_LAYERS)")


@dataclasses.dataclass(frozen=True, slots=True)
class ParamGroups:
    """How a model's parameters split into optimizer groups beyond their shape.

    ``no_weight_decay``: module names (dotted prefixes) whose parameters take no weight decay whatever their shape
    (lookup tables: the token embedding). Vectors (``dim < 2``) never take weight decay; every other parameter does.
    """

    no_weight_decay: tuple[str, ...] = ()

    def decays(self, name: str, ndim: int) -> bool:
        """Whether parameter ``name`` (dotted, as ``named_parameters`` gives it) of ``ndim`` dims takes weight decay."""
        return ndim >= 2 and not any(name == m or name.startswith(m + ".") for m in self.no_weight_decay)


@runtime_checkable
class Stream(Protocol):
    """What crosses a pipeline-stage boundary: ``blocks`` (finished ``[B, T, width]`` block representations, in
    order) and ``partial`` (the open block ``[B, T, width]``, or None right after a block boundary)."""

    blocks: list[torch.Tensor]
    partial: torch.Tensor | None


class RoutingStatistics(Protocol):
    """What the runtime reads of one MoE layer's routing statistics (:meth:`TrainableModel.update_routing_bias`): the
    layer's ``maxvio`` (max load violation of its summed counts; the train job logs the largest)."""

    @property
    def maxvio(self) -> float: ...


class MoELayer(Protocol):
    """What the runtime reads and sets on a model's MoE layer (:meth:`TrainableModel.moe_layers`): ``num_experts``
    ``E`` and ``top_k``, the last forward's routing counts ``last_counts [E]`` int64, the routed ``experts`` (expert
    parallelism shards them) and the ``dispatcher`` the layer calls (the :mod:`moonrt.parallel.dispatch` seam; the
    runtime installs its EP dispatcher there)."""

    num_experts: int
    top_k: int
    last_counts: torch.Tensor
    dispatcher: Dispatcher

    @property
    def experts(self) -> ShardableExperts: ...


@runtime_checkable
class TrainableModel(Protocol):
    """What the runtime calls on a model (see the module docstring). ``B``: batch rows, ``T``: this rank's tokens
    per row (its sequence slice under context parallelism), ``V``: vocabulary size."""

    # ---- the step ---------------------------------------------------------------------------------------------
    def loss_sum(self, tokens: torch.Tensor, targets: torch.Tensor, ctx: AttentionContext = ...,
                 packing: DocumentPacking | None = None) -> torch.Tensor:
        """Summed next-token cross-entropy, an fp32 scalar, over every ``targets [B, T]`` not equal to -100 (torch's
        ``ignore_index``) of ``tokens [B, T]`` int64. A sum, not a mean: the runtime divides by the global token
        count. ``ctx`` defaults to :data:`~moonrt.parallel.context.LOCAL`; ``packing``: the documents packed in the
        rows (single-device context only), no token seeing another document."""
        ...

    # ---- pipeline stages ---------------------------------------------------------------------------------------
    def pipeline_layout(self) -> PipelineLayout:
        """Depth, stream width and block size of the layer stack (:class:`PipelineLayout`)."""
        ...

    def stages(self, num_stages: int, align_to_blocks: bool = False) -> list[range]:
        """``num_stages`` contiguous, near-equal decoder-layer ranges covering ``range(num_layers)``, in order
        (``align_to_blocks``: cuts on stream-block boundaries). ValueError for a count the stack cannot cut."""
        ...

    def stage_modules(self, layers: range, first: bool, last: bool) -> list[str]:
        """Submodule names a stage running decoder ``layers`` uses (``first``: it embeds the tokens; ``last``: it
        runs the head). Every parameter belongs to one of them; a name listed for every stage (shared parameters)
        has its gradient summed over the pipeline ranks."""
        ...

    def stream(self, blocks: list[torch.Tensor], partial: torch.Tensor | None = None) -> Stream:
        """The :class:`Stream` a stage starts from, rebuilt from received ``blocks`` and ``partial``."""
        ...

    def embed_tokens(self, tokens: torch.Tensor) -> Stream:
        """``tokens [B, T]`` int64 -> the initial stream (ValueError for a bad shape, dtype or token id)."""
        ...

    def run_layers(self, state: Stream, layers: range, ctx: AttentionContext = ...) -> Stream:
        """Run decoder ``layers`` on ``state`` (may mutate it) and return the stream after them."""
        ...

    def head(self, state: Stream) -> torch.Tensor:
        """The stream after the last layer -> ``logits [B, T, V]`` fp32."""
        ...

    # ---- MoE routing (NoMoE: a model without MoE) --------------------------------------------------------------
    def moe_layers(self) -> list[tuple[int, MoELayer]]:
        """``(layer index, MoE module)`` of every MoE layer this process holds (:class:`MoELayer`)."""
        ...

    def update_routing_bias(self, all_reduce: Callable[[torch.Tensor], torch.Tensor | None] | None = None,
                            ) -> dict[int, RoutingStatistics]:
        """Update every MoE layer's router bias from the routing statistics since the last update (``all_reduce``
        sums statistics in place over the replicas; None: one process); ``{layer: statistics}``
        (:class:`RoutingStatistics`)."""
        ...

    def routing_counts(self) -> dict[int, torch.Tensor]:
        """Per MoE layer, tokens routed to each expert ``[E]`` int64 in the last forward."""
        ...

    def set_record_routing(self, enabled: bool) -> None:
        """Whether forwards count toward routing statistics (off for eval and recomputation)."""
        ...

    # ---- optimizer groups --------------------------------------------------------------------------------------
    def param_groups(self) -> ParamGroups:
        """Weight-decay groups (:class:`ParamGroups`)."""
        ...


class NoMoE:
    """Mixin: the MoE routing members of :class:`TrainableModel` for a model without MoE layers."""

    def moe_layers(self) -> list[tuple[int, MoELayer]]:
        return []

    def update_routing_bias(self, all_reduce: Callable[[torch.Tensor], torch.Tensor | None] | None = None,
                            ) -> dict[int, RoutingStatistics]:
        return {}

    def routing_counts(self) -> dict[int, torch.Tensor]:
        return {}

    def set_record_routing(self, enabled: bool) -> None:
        return None


def default_param_groups(model: nn.Module) -> ParamGroups:
    """:class:`ParamGroups` of ``model`` by module type: every ``nn.Embedding`` takes no weight decay."""
    from torch import nn

    return ParamGroups(no_weight_decay=tuple(n for n, m in model.named_modules() if isinstance(m, nn.Embedding)))


def trainable(model: nn.Module) -> TrainableModel:
    """``model`` seen through the seam. The runtime holds a model as the ``nn.Module`` it is (parameters, state
    dicts, train/eval) and calls the :class:`TrainableModel` members through this view: Python's type system has no
    intersection of the two, so this is where a type checker learns that the module is also the protocol. No check
    at run time (:func:`missing_members` lists what a model lacks); a missing member fails at its first call."""
    return cast("TrainableModel", model)


def missing_members(model: object) -> list[str]:
    """Members of :class:`TrainableModel` that ``model`` lacks or holds as a non-callable (empty: it has them all)."""
    return [name for name in protocol_members() if not callable(getattr(model, name, None))]


def protocol_members() -> list[str]:
    """Every member :class:`TrainableModel` names, in declaration order."""
    return [n for n, v in vars(TrainableModel).items() if callable(v) and not n.startswith("_")]


__all__ = ["MAX_LAYERS", "MoELayer", "NoMoE", "ParamGroups", "PipelineLayout", "RoutingStatistics", "Stream",
           "TrainableModel", "default_param_groups", "missing_members", "protocol_members", "trainable"]
