"""Typed configuration: nested ``@dataclass(kw_only=True, slots=True)`` trees loaded from YAML.

Every knob of moonrt is a field of a config dataclass (STYLE habit 7). This module holds the
machinery shared by all of them:

- :func:`from_dict` builds a dataclass tree from plain data (what ``yaml.safe_load`` returns),
  checking every value against the field's type hint. Unknown keys are an error, never ignored.
  Errors are :class:`ConfigError` and name the dotted field path, the value and what was expected.
- :func:`load_yaml` / :func:`save_yaml` round-trip a config through a YAML file.
- A dataclass may define ``validate(self)`` that raises :class:`ConfigError` (via :func:`check`)
  for cross-field constraints; it runs after the tree is built, children first.

It also defines the configs every runtime part shares: :class:`ParallelConfig` (the degrees of a
job's parallel dimensions) and :class:`DistConfig` (how torch.distributed is initialized).
"""

from __future__ import annotations

import dataclasses
import types
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A config value is missing, unknown or invalid. The message names field, value and expectation."""


def check(cond: bool, field: str, value: Any, expected: str) -> None:
    """Raise :class:`ConfigError` unless ``cond``: ``"<field> = <value>: expected <expected>"``."""
    if not cond:
        raise ConfigError(f"{field} = {value!r}: expected {expected}")


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in get_args(tp))
    if origin in (list, tuple):
        args = get_args(tp)
        return f"a list of {_type_name(args[0])}" if args else "a list"
    if origin is dict:
        return "a mapping"
    if tp is type(None):
        return "null"
    if dataclasses.is_dataclass(tp):
        return f"a mapping of {tp.__name__} fields"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(
        tp, getattr(tp, "__name__", str(tp))
    )


def _convert(tp: Any, value: Any, path: str) -> Any:
    """Check ``value`` against type hint ``tp`` and convert it (dicts to dataclasses, lists to tuples)."""
    origin = get_origin(tp)
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{path} = {value!r}: expected {_type_name(tp)}")
        return _build(tp, value, path)
    if origin is Literal:
        if value not in get_args(tp):
            raise ConfigError(f"{path} = {value!r}: expected {_type_name(tp)}")
        return value
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(arg, value, path)
            except ConfigError as exc:
                errors.append(exc)
        raise ConfigError(f"{path} = {value!r}: expected {_type_name(tp)}")
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path} = {value!r}: expected {_type_name(tp)}")
        args = get_args(tp)
        item = args[0] if args else Any
        items = [_convert(item, v, f"{path}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path} = {value!r}: expected a mapping")
        kt, vt = get_args(tp) or (Any, Any)
        return {_convert(kt, k, f"{path}.<key>"): _convert(vt, v, f"{path}.{k}") for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path} = {value!r}: expected true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path} = {value!r}: expected an integer")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{path} = {value!r}: expected a number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path} = {value!r}: expected a string")
        return value
    if isinstance(tp, type) and isinstance(value, tp):
        return value
    raise ConfigError(f"{path} = {value!r}: expected {_type_name(tp)}")


def _build(cls: type[T], data: dict, path: str) -> T:
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        where = f"{path}." if path else ""
        raise ConfigError(
            f"{where}{unknown[0]}: unknown key in {cls.__name__}; expected one of {', '.join(sorted(fields))}"
        )
    kwargs = {}
    for name, f in fields.items():
        fpath = f"{path}.{name}" if path else name
        if name in data:
            kwargs[name] = _convert(hints[name], data[name], fpath)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{fpath}: missing required field of {cls.__name__}")
    obj = cls(**kwargs)
    validate(obj, path)
    return obj


def validate(obj: Any, path: str = "") -> None:
    """Run ``validate()`` of ``obj`` and of every nested dataclass (children first).

    A :class:`ConfigError` raised by a nested ``validate`` gets the parent path prefixed, so the
    message always carries the full dotted field name.
    """
    if not dataclasses.is_dataclass(obj):
        return
    for f in dataclasses.fields(obj):
        child = getattr(obj, f.name)
        if dataclasses.is_dataclass(child):
            validate(child, f"{path}.{f.name}" if path else f.name)
    hook = getattr(obj, "validate", None)
    if hook is not None:
        try:
            hook()
        except ConfigError as exc:
            if path and not str(exc).startswith(path + "."):
                raise ConfigError(f"{path}.{exc}") from None
            raise


def from_dict(cls: type[T], data: dict | None) -> T:
    """Build and validate a ``cls`` tree from plain data; raises :class:`ConfigError`."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"<root> = {data!r}: expected a mapping of {cls.__name__} fields")
    return _build(cls, data, "")


def to_dict(obj: Any) -> Any:
    """Plain-data form of a config tree (tuples become lists), suitable for YAML or JSON."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def load_yaml(cls: type[T], path: str | Path) -> T:
    """Load ``cls`` from a YAML file. Malformed YAML is a :class:`ConfigError` naming file and line."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"config file {str(path)!r}: cannot read ({exc.strerror})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"config file {str(path)!r}{where}: malformed YAML ({problem})") from None
    try:
        return from_dict(cls, data)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None


def save_yaml(obj: Any, path: str | Path) -> None:
    """Write a config tree to YAML atomically (temp file, then rename)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(yaml.safe_dump(to_dict(obj), sort_keys=False))
    tmp.replace(path)


# ---------------------------------------------------------------------------------------------
# Shared runtime configs


PIPELINE_SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved", "zb", "zbv")
"""Pipeline schedules (:mod:`moonrt.scheduler.pipeline` builds them)."""


def schedule_error(kind: str, pp: int, microbatches: int, vpp: int) -> tuple[str, Any, str] | None:
    """The first rule of pipeline schedule ``kind`` that the degrees break, as ``(field, value, expected)``
    (for :func:`check`), or None: the one statement of these rules, used by :class:`ParallelConfig` and by
    :func:`moonrt.scheduler.pipeline.build_schedule`.

    ``vpp`` is 1 for gpipe / 1f1b, >= 2 for interleaved, 2 for zbv; interleaved (and zb with ``vpp > 1``) need
    ``microbatches`` a multiple of ``pp``, so at least ``pp`` (as in Megatron)."""
    if kind not in PIPELINE_SCHEDULES:
        return "schedule", kind, "one of " + ", ".join(PIPELINE_SCHEDULES) + " (zb1p = zb)"
    for name, v in (("pp", pp), ("microbatches", microbatches), ("vpp", vpp)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            return name, v, "an integer >= 1"
    if kind in ("gpipe", "1f1b") and vpp != 1:
        return "vpp", vpp, f"1 for schedule {kind!r} (use 'interleaved' or 'zb' for vpp > 1)"
    if kind == "interleaved" and vpp < 2:
        return "vpp", vpp, ">= 2 for schedule 'interleaved' (use '1f1b' for vpp = 1)"
    if kind == "zbv" and vpp != 2:
        return "vpp", vpp, "2 for schedule 'zbv' (two chunks per rank, V placement)"
    if kind == "interleaved" or (kind == "zb" and vpp > 1):
        if microbatches < pp:
            return "microbatches", microbatches, f">= pp ({pp}) for schedule {kind!r} with vpp > 1"
        if microbatches % pp:
            return "microbatches", microbatches, f"a multiple of pp ({pp}) for schedule {kind!r} with vpp > 1"
    return None


@dataclasses.dataclass(kw_only=True, slots=True)
class ParallelConfig:
    """Degrees of the parallel dimensions of one job (K3_SYSTEMS §10).

    ``dp * pp * ep * cp`` must equal the world size (checked by the mesh, which knows it).
    ``vpp`` is the number of virtual pipeline stages per pipeline rank (interleaved 1F1B);
    it does not change the number of ranks.
    """

    dp: int = 1
    pp: int = 1
    vpp: int = 1
    ep: int = 1
    cp: int = 1
    schedule: Literal["auto", "gpipe", "1f1b", "interleaved", "zb", "zbv"] = "auto"
    """Pipeline schedule (``moonrt.scheduler.pipeline``: zb = zero-bubble ZB1P, zbv = ZB-V with two chunks per
    rank in V placement); ``auto``: 1f1b, or interleaved when ``vpp > 1``."""
    microbatches: int = 1
    """Micro-batches per step of each pipeline (they split the data-parallel replica's batch rows)."""
    attn_res_comm: Literal["cached", "naive"] = "cached"
    """Block AttnRes traffic between pipeline ranks (K3_SYSTEMS §9): ``cached`` sends each rank only the
    blocks it does not hold yet, ``naive`` every completed block on every hop."""
    zero: int = 0
    """ZeRO stage of data parallelism: 0 replicates the AdamW states on every replica, 1 shards them (and the
    reduced gradients) over each parameter's replicas (:class:`moonrt.comm.zero.Zero1`); with one replica a no-op."""

    def validate(self) -> None:
        for name in ("dp", "pp", "vpp", "ep", "cp", "microbatches"):
            value = getattr(self, name)
            check(isinstance(value, int) and value >= 1, name, value, "an integer >= 1")
        check(self.zero in (0, 1) and not isinstance(self.zero, bool), "zero", self.zero,
              "0 (replicated optimizer states) or 1 (ZeRO-1: sharded over the data-parallel replicas)")
        check(self.attn_res_comm in ("cached", "naive"), "attn_res_comm", self.attn_res_comm, "cached or naive")
        kinds = ("auto", *PIPELINE_SCHEDULES)
        check(self.schedule in kinds, "schedule", self.schedule, "one of " + ", ".join(kinds))
        check(self.pp > 1 or self.microbatches == 1, "microbatches", self.microbatches,
              "1 without pipeline parallelism (pp = 1)")
        check(self.pp > 1 or self.vpp == 1, "vpp", self.vpp, "1 without pipeline parallelism (pp = 1)")
        bad = schedule_error(self.pipeline_schedule, self.pp, self.microbatches, self.vpp)
        if bad is not None:
            check(False, *bad)

    @property
    def pipeline_schedule(self) -> str:
        """The schedule that runs: ``schedule``, with ``auto`` resolved (interleaved when ``vpp > 1``)."""
        if self.schedule != "auto":
            return self.schedule
        return "interleaved" if self.vpp > 1 else "1f1b"

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.ep * self.cp


@dataclasses.dataclass(kw_only=True, slots=True)
class DistConfig:
    """How torch.distributed is initialized (see :mod:`moonrt.cluster.env`)."""

    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """``auto``: nccl when CUDA is available, else gloo."""
    timeout_s: float = 300.0
    """Timeout of every collective and of rendezvous; a dead rank never hangs a job longer."""

    def validate(self) -> None:
        check(self.timeout_s > 0, "timeout_s", self.timeout_s, "a positive number of seconds")


__all__ = [
    "ConfigError",
    "DistConfig",
    "PIPELINE_SCHEDULES",
    "ParallelConfig",
    "check",
    "from_dict",
    "load_yaml",
    "save_yaml",
    "schedule_error",
    "to_dict",
    "validate",
]
