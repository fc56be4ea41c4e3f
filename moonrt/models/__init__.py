"""Model registry of the job layer: every model family's :class:`~moonrt.models.spec.ModelSpec`, by name.

A family registers one record in :data:`MODELS`: its name and a loader returning its spec (kept in the family's
own package, ``moonrt/models/<family>/spec.py``). The loaders import lazily, so that importing one family's
network code (``moonrt.models.<family>.model``, which loads this package on the way) loads no other family, and
looking a family up loads neither torch nor its layers. Jobs look models up here (``moonrt train`` through
:func:`moonrt.jobs.train.assemble.build_model` and its :class:`~moonrt.jobs.train.config.JobConfig`,
``moonrt mem-plan``, ``moonrt pp-plan``); the runtime never imports a model (docs/ARCHITECTURE.md §1): the
parallel parts reach it through the seams of :mod:`moonrt.parallel` (:class:`moonrt.parallel.model.TrainableModel`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from moonrt.models.spec import ModelSpec


def _k3() -> ModelSpec:
    from moonrt.models.k3.spec import K3

    return K3


def _dense() -> ModelSpec:
    from moonrt.models.dense.spec import DENSE

    return DENSE


MODELS: dict[str, Callable[[], ModelSpec]] = {"k3": _k3, "dense": _dense}
"""Family name -> the loader of its :class:`~moonrt.models.spec.ModelSpec` (registry order). Registering a family
is one entry here and a three-line loader above."""


DEFAULT_PRESET = "k3_tiny"
"""The preset ``moonrt train`` trains when the job names none (:attr:`moonrt.jobs.train.config.JobConfig.model`)."""


def families() -> dict[str, ModelSpec]:
    """Every registered family's spec by name (registry order); ValueError if a loader's spec names another family."""
    out = {}
    for name, load in MODELS.items():
        spec = load()
        if spec.name != name:
            raise ValueError(f"MODELS[{name!r}]: its spec is named {spec.name!r}; expected {name!r}")
        out[name] = spec
    return out


def family(name: str) -> ModelSpec:
    """The spec of family ``name``; ValueError naming the registered families."""
    if name not in MODELS:
        raise ValueError(f"model family {name!r}: expected one of {', '.join(MODELS)}")
    return families()[name]


def presets() -> dict[str, ModelSpec]:
    """Every preset name of every registered family -> its :class:`~moonrt.models.spec.ModelSpec` (registry order)."""
    out: dict[str, ModelSpec] = {}
    for spec in families().values():
        for name in spec.presets:
            if name in out:
                raise ValueError(f"preset {name!r}: defined by both {out[name].name!r} and {spec.name!r}")
            out[name] = spec
    return out


def from_preset(name: str) -> tuple[ModelSpec, Any]:
    """The :class:`~moonrt.models.spec.ModelSpec` defining preset ``name`` and the preset's config; ValueError
    naming the presets."""
    table = presets()
    if name not in table:
        raise ValueError(f"model = {name!r}: expected one of {', '.join(table)}")
    spec = table[name]
    return spec, spec.presets[name]()


__all__ = ["DEFAULT_PRESET", "MODELS", "families", "family", "from_preset", "presets"]
