"""Typed config trees: nested ``@dataclass(kw_only=True, slots=True)`` trees built from plain data.

- :func:`from_dict` builds a dataclass tree from plain data (what ``yaml.safe_load`` returns),
  checking every value against the field's type hint. Unknown keys are an error, never ignored.
  Errors are :class:`ConfigError` and name the dotted field path, the value and what was expected
  (:func:`check`, :func:`show`).
- A dataclass may define ``validate(self)`` that raises :class:`ConfigError` (via :func:`check`)
  for cross-field constraints; it runs after the tree is built, children first (:func:`validate`).
- :func:`to_dict` is the way back to plain data (for YAML or JSON).
"""

from __future__ import annotations

import dataclasses
import math
import reprlib
import types
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

T = TypeVar("T")


class ConfigError(ValueError):
    """A config value is missing, unknown or invalid. The message names field, value and expectation."""


_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 120
_REPR.maxlong = 60
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = 12
_REPR.maxlevel = 3


def show(value: Any) -> str:
    """``repr(value)`` cut to one short line (long strings, lists and mappings elided with ``...``): a bad value in
    a message, however big the value."""
    return _REPR.repr(value)


def check(cond: bool, field: str, value: Any, expected: str) -> None:
    """Raise :class:`ConfigError` unless ``cond``: ``"<field> = <value>: expected <expected>"``."""
    if not cond:
        raise ConfigError(f"{field} = {show(value)}: expected {expected}")


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
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):  # a dataclass type (a hint is never an instance)
        return f"a mapping of {tp.__name__} fields"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(
        tp, getattr(tp, "__name__", str(tp))
    )


def _convert(tp: Any, value: Any, path: str) -> Any:
    """Check ``value`` against type hint ``tp`` and convert it (dicts to dataclasses, lists to tuples)."""
    origin = get_origin(tp)
    if tp is Any:
        return value
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{path} = {show(value)}: expected {_type_name(tp)}")
        return _build(tp, value, path)
    if origin is Literal:
        if value not in get_args(tp):
            raise ConfigError(f"{path} = {show(value)}: expected {_type_name(tp)}")
        return value
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        inner_types = [a for a in args if a is not type(None)]
        if len(inner_types) == 1:  # Optional[X]: X's own message ("expected a finite number"), "or null" added
            try:
                return _convert(inner_types[0], value, path)
            except ConfigError as exc:
                msg = str(exc)
                if msg.startswith(f"{path} = "):
                    raise ConfigError(f"{msg} or null") from None
                raise
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(arg, value, path)
            except ConfigError as exc:
                errors.append(exc)
        inner = [e for e in errors if str(e).startswith((f"{path}.", f"{path}["))]
        if len(inner) == 1:  # the value has the shape of one option, wrong inside: that error names the field
            raise inner[0]
        raise ConfigError(f"{path} = {show(value)}: expected {_type_name(tp)}")
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path} = {show(value)}: expected {_type_name(tp)}")
        args = get_args(tp)
        item = args[0] if args else Any
        items = [_convert(item, v, f"{path}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path} = {show(value)}: expected a mapping")
        kt, vt = get_args(tp) or (Any, Any)
        return {_convert(kt, k, f"{path}.<key>"): _convert(vt, v, f"{path}.{k}") for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path} = {show(value)}: expected true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path} = {show(value)}: expected an integer")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{path} = {show(value)}: expected a number")
        try:
            value = float(value)
        except OverflowError:  # an integer beyond the float range
            raise ConfigError(f"{path} = {show(value)}: expected a finite number") from None
        if not math.isfinite(value):  # no moonrt float field means anything by inf or nan
            raise ConfigError(f"{path} = {show(value)}: expected a finite number")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path} = {show(value)}: expected a string")
        return value
    if isinstance(tp, type) and isinstance(value, tp):
        return value
    raise ConfigError(f"{path} = {show(value)}: expected {_type_name(tp)}")


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
        raise ConfigError(f"<root> = {show(data)}: expected a mapping of {cls.__name__} fields")
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
