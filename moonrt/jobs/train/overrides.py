"""``--set section.key=value``: command-line overrides of a :class:`~moonrt.jobs.train.config.JobConfig`
(``moonrt train``, ``moonrt sbatch``, ``moonrt mem-plan --config``), in the style of torchtitan's and Hydra's
dotted overrides.

Precedence, lowest first: the embedded default (``JobConfig()``) < the ``--config`` YAML (valid on its own) <
every ``--set`` in command-line order (a later one of the same key wins) < the dedicated flags (``--lr``,
``--ep``, ...). A ``--set`` and a dedicated flag that name the same field with different values are refused
(one line naming both): two spellings on one command line that disagree are a mistake, not an order.

``KEY`` is a dotted path into the schema: ``optim.lr``, ``parallel.ep``, ``data.corpus``, ``dist.timeout_s``,
``model``; ``model_config.<field>`` edits the family's config (starting from the preset's when the job has no
``model_config``); ``moe.<option>`` the family's MoE options. ``VALUE`` is read as one YAML value
(:func:`moonrt.config.parse_yaml`): ``true``, ``3``, ``0.5``, ``null`` (or nothing after ``=``), ``[a, b]``,
``{k: v}``, else a string; an exponent number without a dot (``1e-3``, a string in YAML 1.1) is read as a number
where the field takes numbers and no strings. The result is validated through :func:`moonrt.config.from_dict`
like the YAML: an unknown key names the field and lists the section's keys, a bad value names the field, the
value and the expectation, each message tagged ``(--set)``. Torch-free (``moonrt train --help`` imports this).
"""

from __future__ import annotations

import dataclasses
import re
import types
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Union, get_args, get_origin, get_type_hints

from moonrt.config import ConfigError, from_dict, load_yaml, parse_yaml, show, to_dict
from moonrt.jobs.train.config import JobConfig

_KEY = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", re.ASCII)
_EXP_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+", re.ASCII)
"""A number in exponent notation that YAML 1.1 (PyYAML) reads as a string: ``1e-3``, ``5E4``."""

SET_HELP = ("override one job config field, e.g. --set optim.lr=1e-3 --set parallel.ep=2 (repeatable; VALUE is "
            "YAML: true, 3, 0.5, null, [a, b]; KEY is section.field, model_config.<field> edits the model's config; "
            "precedence: default < --config < --set < the dedicated flags, which must agree with a --set of the "
            "same field)")


@dataclasses.dataclass(frozen=True, slots=True)
class Override:
    """One parsed ``--set``: the field path, the value (YAML-typed) and the text as given (for messages)."""

    path: tuple[str, ...]
    value: Any
    text: str

    @property
    def field(self) -> str:
        return ".".join(self.path)


def parse_set(text: str) -> Override:
    """``KEY=VALUE`` -> :class:`Override` (ConfigError naming ``--set`` when malformed)."""
    key, eq, value = text.partition("=")
    key = key.strip()
    if not eq or not _KEY.fullmatch(key):
        raise ConfigError(f"--set {show(text)}: expected KEY=VALUE with KEY a dotted field path such as optim.lr or "
                          "parallel.ep")
    return Override(tuple(key.split(".")), parse_yaml(value, f"--set {key} value"), text)


def _accepts(tp: Any, kind: type) -> bool:
    """Whether type hint ``tp`` admits a value of ``kind`` directly (``float | None`` admits float)."""
    if get_origin(tp) in (Union, types.UnionType):
        return any(_accepts(a, kind) for a in get_args(tp))
    return tp is kind


def _unknown(where: str, key: str, cls: type) -> ConfigError:
    names = ", ".join(sorted(f.name for f in dataclasses.fields(cls)))
    return ConfigError(f"{where}{key} (--set): unknown key in {cls.__name__}; expected one of {names}")


def _apply(raw: dict, o: Override, model: str) -> Any:
    """Write ``o`` into the plain-data job ``raw`` (from :func:`moonrt.config.to_dict`), checking each key of its
    path against the schema while the schema is known (dataclass sections; ``model_config``: the family's config
    type of preset ``model``); below a free-form mapping (``moe``) the family's reader checks the keys. Returns the
    value written."""
    from moonrt.models import presets  # the lazy registry: no torch

    node: dict = raw
    cls: Any = JobConfig
    hint: Any = None
    for depth, key in enumerate(o.path):
        where = ".".join(o.path[:depth]) + "." if depth else ""
        last = depth == len(o.path) - 1
        if cls is not None:
            if key not in {f.name for f in dataclasses.fields(cls)}:
                raise _unknown(where, key, cls)
            hint = get_type_hints(cls)[key]
        else:
            hint = None
        if last:
            break
        child = node.get(key)
        if cls is JobConfig and key == "model_config":
            spec = presets().get(model)
            if spec is None:
                raise ConfigError(f"model = {model!r} (--set {o.field}): expected a registered model preset: one of "
                                  + ", ".join(presets()))
            if child is None:
                child = to_dict(spec.presets[model]())
            cls = spec.config_type
        elif cls is not None and dataclasses.is_dataclass(hint):
            cls = hint
        elif cls is not None and not (hint is Any or _accepts(hint, dict) or get_origin(hint) is dict
                                      or any(get_origin(a) is dict for a in get_args(hint))):
            raise ConfigError(f"{o.field} (--set): {where}{key} is a field, not a section of fields; expected "
                              f"--set {where}{key}=VALUE")
        else:
            cls = None
        if child is None:
            child = {}
        if not isinstance(child, dict):
            raise ConfigError(f"{where}{key} (--set {o.field}) = {show(child)}: expected a mapping to set "
                              f"{o.path[depth + 1]!r} in")
        node[key] = child
        node = child
    value = o.value
    if (isinstance(value, str) and hint is not None and _EXP_NUMBER.fullmatch(value.strip())
            and _accepts(hint, float) and not _accepts(hint, str)):
        value = float(value)
    node[o.path[-1]] = value
    return value


def _tag(exc: ConfigError, fields: Mapping[str, str]) -> ConfigError:
    """``exc`` with the option that set its field named: ``"optim.lr (--lr) = inf: expected ..."``."""
    msg = str(exc)
    for field, option in fields.items():
        if msg.startswith(f"{field} = "):
            return ConfigError(f"{field} ({option}){msg[len(field):]}")
    return exc


def job_config(config: str | Path | None, sets: Sequence[str] = (),
               flags: Mapping[tuple[str, ...], tuple[str, Any]] | None = None) -> JobConfig:
    """The job: ``config`` (a YAML file, checked alone first; None: the embedded default), then ``sets`` (``--set``
    texts, in order), then ``flags`` (field path -> (flag name, value) of each dedicated flag given). ConfigError
    names the field and the option (``--set`` or the flag) that set it; see the module doc for the precedence."""
    raw = to_dict(load_yaml(JobConfig, config) if config else JobConfig())
    flags = dict(flags or {})
    overrides = [parse_set(s) for s in sets]
    model = raw["model"]
    for o in overrides:
        if o.path == ("model",) and isinstance(o.value, str):
            model = o.value
    if ("model",) in flags:
        model = flags[("model",)][1]
    last = {o.path: (o, _apply(raw, o, model)) for o in overrides}  # a later --set of one key wins
    for path, (flag, value) in flags.items():
        o, written = last.get(path, (None, None))
        if o is not None and (written != value or isinstance(written, bool) != isinstance(value, bool)):
            raise ConfigError(f"{'.'.join(path)}: {flag} {show(value)} and --set {o.text} disagree; expected one "
                              "value (name the field once, or give both the same value)")
        node: Any = raw
        for key in path[:-1]:
            node = node.get(key) if isinstance(node, dict) else None
        if isinstance(node, dict):  # else a --set made the section a non-mapping: from_dict names it below
            node[path[-1]] = value
    tags = {o.field: "--set" for o in overrides}
    tags.update({".".join(p): flag for p, (flag, _v) in flags.items()})
    try:
        return from_dict(JobConfig, raw)
    except ConfigError as exc:
        raise _tag(exc, tags) from None


__all__ = ["Override", "SET_HELP", "job_config", "parse_set"]
