"""The record a model family registers (:class:`ModelSpec`, like torchtitan's ``ModelSpec``) and its optional memory
description (:class:`ModelMemory`).

A family's record lives in its own package (``moonrt/models/<family>/spec.py``) and is listed in the registry
(:mod:`moonrt.models`). Jobs reach a family only through it: which config type a ``model_config`` mapping reads
into, the presets, the build, the parameter count, the pipeline layout a planner needs without building the
model, and optionally its model options (the job's ``moe:`` mapping), expert sizes for routing traces, and the
memory description the memory planner uses. The model object a build returns is a
:class:`moonrt.parallel.model.TrainableModel` (the runtime's side of the seam).

Imports only the standard library and :mod:`moonrt.config`: looking a family up loads neither torch nor its layers.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar, cast

from moonrt.config import ConfigError, from_dict

if TYPE_CHECKING:  # types only: looking a family up loads neither torch nor the memory planner
    from torch import nn

    from moonrt.memory.model_memory import ParamSizes, Profile
    from moonrt.memory.plan import RankPlan
    from moonrt.ops.qat import QATScheme
    from moonrt.parallel.model import PipelineLayout

C = TypeVar("C")
"""A family's config type (:attr:`ModelSpec.config_type`): each family's record is checked against its own config
class; the registry, which holds every family, sees ``ModelSpec[Any]``."""

MAX_PARAMS = 5_000_000_000
"""Largest model (parameters, from the config) that a job instantiates (``moonrt train`` builds the whole model in
one process; ``--init-from`` refuses a larger Hugging Face directory before reading a tensor)."""


class QuantizableModel(Protocol):
    """A model of a family that declares :attr:`ModelSpec.qat_weights`: ``enable_qat(scheme)`` fake-quantizes exactly
    those weights from the next forward (None: off) and returns their names (:meth:`ModelSpec.quantizable`)."""

    def enable_qat(self, scheme: QATScheme | None) -> list[str]: ...


@dataclasses.dataclass(frozen=True, slots=True)
class ModelMemory(Generic[C]):
    """What the memory planner (``moonrt mem-plan``) needs of a family, instead of importing the model. The planner
    also reads the config's structural fields ``num_hidden_layers``, ``num_experts``, ``num_experts_per_token``,
    ``hidden_size`` and ``routed_expert_hidden_size`` (:func:`moonrt.memory.plan.plan_memory`): a family with a
    memory description has them."""

    param_sizes: Callable[[C], ParamSizes]
    """``cfg`` -> :class:`~moonrt.memory.model_memory.ParamSizes` (parameters per decoder layer, embedding, head)."""
    memory_profile: Callable[..., Profile]  # `...`: (cfg, layout, sdpa=None), a keyword with a default
    """``(cfg, layout, sdpa=None)`` -> analytic :class:`~moonrt.memory.model_memory.Profile` at a
    :class:`~moonrt.memory.model_memory.JobLayout` (``sdpa``: ``"math"`` / ``"fused"``, None: by dtype)."""
    traced_memory_profile: Callable[..., Profile]  # `...`: seven arguments, passed by keyword
    """``(cfg, dtype, seq_tokens, batch, cp, probe_tokens, max_experts)`` -> a Profile measured by running each
    layer kind under the activation manager."""
    memory_policy: Callable[[RankPlan], dict[str, Any]]  # Any: the policy's YAML data (nested mappings, lists)
    """A :class:`~moonrt.memory.plan.RankPlan` -> the :class:`~moonrt.memory.policy.MemoryPolicy` YAML data of its
    class choice, as rules on the model's module paths."""


@dataclasses.dataclass(frozen=True, slots=True)
class ModelSpec(Generic[C]):
    """One model family: what a job needs to read its config, build it and plan it.

    Callables take the family's config object ``cfg`` (an instance of ``config_type``, a config dataclass of
    :mod:`moonrt.config` with at least ``vocab_size``). Registering a family: one record in
    :data:`moonrt.models.MODELS`.
    """

    name: str
    """Family name (``"k3"``); the registry key."""
    config_type: type[C]
    """The config dataclass a ``model_config`` mapping is read into (:meth:`config_from_dict`)."""
    presets: Mapping[str, Callable[[], C]]
    """Preset name -> config factory (``moonrt train --model``, ``moonrt mem-plan --model``, ``moonrt pp-plan``).
    Preset names are unique over all families."""
    build: Callable[[C, Mapping[str, Any] | None], nn.Module]
    """``build(cfg, options)`` -> a single-device :class:`~moonrt.parallel.model.TrainableModel` ``nn.Module``
    (``options``: the job's ``moe:`` mapping, read by :attr:`read_options`; None for the defaults; ``Any``: YAML
    values). The runtime reaches its seam members through :func:`moonrt.parallel.model.trainable`."""
    param_count: Callable[[C], int]
    """Total parameters of ``build(cfg)`` computed from the config alone (no instantiation)."""
    pipeline_layout: Callable[[C], PipelineLayout]
    """``cfg`` -> the :class:`~moonrt.parallel.model.PipelineLayout` its model's ``pipeline_layout()`` returns
    (``moonrt pp-plan`` plans from it without building the model)."""
    describe: Callable[[C], str] = lambda cfg: ""
    """``cfg`` -> a few words on its structure for the start line of ``moonrt train`` (K3: its layer pattern)."""
    read_options: Callable[[Mapping[str, Any] | None], object] | None = None
    """The job's ``moe:`` mapping (``Any``: YAML values) -> the family's checked options object (ConfigError naming
    the field); None: the family takes no options (a non-null ``moe:`` is refused)."""
    expert_sizes: Callable[[C, str], dict[str, int]] | None = None
    """``(cfg, dtype)`` -> the routed experts' sizes a routing trace records
    (:data:`moonrt.scheduler.workload.SIZE_FIELDS`); None: no routed experts (a trace records no sizes)."""
    flops_per_token: Callable[[C, int], int] | None = None
    """``(cfg, seq_len)`` -> training FLOPs (forward + backward) per token of a ``seq_len``-token sequence, the
    model FLOPs of MFU (PaLM / Megatron estimate: ``6 x`` active parameters plus the attention products); None:
    the family does not say (``moonrt train`` records no ``model_tflops_per_s`` / ``mfu``)."""
    memory: ModelMemory[C] | None = None
    """The memory planner's description; None: the family trains but ``moonrt mem-plan`` cannot plan it."""
    qat_weights: Callable[[C], dict[str, tuple[int, ...]]] | None = None
    """``cfg`` -> parameter name -> shape of every weight that quantization-aware training fake-quantizes
    (``moonrt train --qat``) and ``moonrt checkpoint export --mxfp4`` packs, in the unsharded model, the GEMM's
    reduction axis last; the model's ``enable_qat(scheme)`` quantizes exactly these. None: the family declares no
    quantizable layers (``--qat`` other than ``none`` is refused)."""
    train_dtype: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """Preset name -> the dtype (``"bf16"`` / ``"fp32"``) its parameters and activations are trained in, what a
    memory plan assumes unless told otherwise (``moonrt mem-plan --dtype``); a preset not listed: ``"fp32"``."""
    qat_block: Mapping[str, int] = dataclasses.field(default_factory=dict)
    """Preset name -> the elements per MX scale its quantizable weights take (``moonrt train --qat``'s default
    ``qat_block``): a block that divides every reduction axis of :attr:`qat_weights`; a preset not listed: 32, the
    OCP MX spec's block (:meth:`default_qat_block`)."""

    def config_from_dict(self, data: Mapping[str, Any]) -> C:
        """Read a ``model_config`` mapping into :attr:`config_type` (checked; ConfigError names the field). ``Any``:
        YAML values, whatever the file holds, checked here."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"<root> = {data!r}: expected a mapping of {self.config_type.__name__} fields")
        return from_dict(self.config_type, dict(data))

    def options_from_dict(self, data: Mapping[str, Any] | None) -> object:
        """The job's ``moe:`` mapping (``Any``: YAML values) read by :attr:`read_options` (None: the defaults);
        ConfigError names the field, or says that the family takes no options."""
        if self.read_options is None:
            if data:
                raise ConfigError(f"moe = {data!r}: expected null (model family {self.name!r} takes no MoE options)")
            return None
        return self.read_options(data)

    def default_qat_block(self, preset: str) -> int:
        """The block ``preset`` declares (:attr:`qat_block`), else the OCP MX spec's 32."""
        return self.qat_block.get(preset, 32)

    def qat_block_problem(self, cfg: C | None, block: object, *, flag: str = "block") -> str | None:
        """None when ``block`` (elements per MX scale) can quantize every weight of :attr:`qat_weights` for ``cfg``;
        otherwise the expected value as the clause of a one-line error (``"<field> = <block>: expected ..."``; the
        caller names its field). ``cfg`` None: only the block's own form is checked; ``flag`` names the knob in the
        hint of a block that fits. The one check of ``moonrt train --qat-block`` and ``moonrt mem-plan --qat-block``."""
        if not isinstance(block, int) or isinstance(block, bool) or block < 2 or block % 2:
            return "an even integer >= 2 (mxfp4 packs two codes a byte)"
        if cfg is None:
            return None
        if self.qat_weights is None:
            return f"none: model family {self.name!r} declares no quantizable layers"
        shapes = self.qat_weights(cfg)
        common = math.gcd(*(shape[-1] for shape in shapes.values()))
        fits = max((b for b in (32, 16, 8, 4, 2) if common % b == 0), default=None)
        hint = f" ({flag} {fits} fits this model)" if fits else ""
        for name, shape in shapes.items():
            if shape[-1] % block:
                return (f"a divisor of every quantized reduction axis; {name} {list(shape)} has {shape[-1]}{hint}")
        return None

    def quantizable(self, model: nn.Module) -> QuantizableModel:
        """``model`` (built by :attr:`build`) as a :class:`QuantizableModel`; ValueError naming the family when it
        declares no quantizable layers or its model has no ``enable_qat``."""
        if self.qat_weights is None or not callable(getattr(model, "enable_qat", None)):
            raise ValueError(f"model family {self.name!r}: declares no quantizable layers (ModelSpec.qat_weights and "
                             "the model's enable_qat): expected qat none")
        return cast("QuantizableModel", model)

    def memory_description(self) -> ModelMemory[C]:
        """:attr:`memory`, or ValueError naming the family when it has none."""
        if self.memory is None:
            raise ValueError(f"model family {self.name!r} has no memory description (ModelSpec.memory): the memory "
                             "planner cannot plan it")
        return self.memory


__all__ = ["MAX_PARAMS", "ModelMemory", "ModelSpec", "QuantizableModel"]
