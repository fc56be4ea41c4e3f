"""The one YAML reader and writer of moonrt: bounded reading (:func:`read_yaml` / :func:`parse_yaml`), a config
loaded from a file (:func:`load_yaml`) and saved atomically (:func:`save_yaml`).

The reader is bounded in file size, nesting depth, aliases and nodes (aliases counted as the nodes they expand to),
so a small hostile file (an alias bomb, thousands of nested brackets) is one :class:`ConfigError` line, never
unbounded memory or a RecursionError.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Any, TypeVar

import yaml

from moonrt.config.outputs import umask
from moonrt.config.schema import ConfigError, from_dict, to_dict

T = TypeVar("T")

YAML_MAX_BYTES = 1 << 20
"""Largest YAML file moonrt reads (1 MiB): a job config, memory policy or hardware profile is a few KiB (the
largest, a K3 policy with one rule per tensor kind, under 10 KiB)."""
YAML_MAX_DEPTH = 64
"""Deepest nesting of mappings and sequences (a JobConfig is 4 deep); well below Python's recursion limit, which
the YAML composer and :func:`from_dict` recurse against."""
YAML_MAX_ALIASES = 256
"""Most alias references (``*name``) in one file; a config needs a handful."""
YAML_MAX_NODES = 100_000
"""Most nodes (scalars, mappings, sequences) of the document, every alias counted as the nodes of the subtree it
stands for: what the loaded Python data would hold if written out. A "billion laughs" bomb of nine 9-fold aliases
(under 500 bytes) expands to 9**9 nodes and stops here, before anything is built."""


def _yaml_error(where: str, exc: yaml.YAMLError) -> ConfigError:
    mark = getattr(exc, "problem_mark", None)
    at = f" line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    problem = getattr(exc, "problem", None) or str(exc).strip().splitlines()[0]
    return ConfigError(f"{where}{at}: malformed YAML ({problem})")


def _check_yaml_bounds(text: str, where: str) -> None:
    """Walk the YAML event stream (the parser is iterative: no recursion, nothing built) and refuse a document
    deeper than :data:`YAML_MAX_DEPTH`, with more than :data:`YAML_MAX_ALIASES` aliases, an alias inside its
    own anchor (a cycle), or more than :data:`YAML_MAX_NODES` nodes once aliases are expanded."""
    sizes: dict[str, int] = {}  # anchor -> nodes of its subtree (aliases expanded)
    stack: list[list] = []  # open collections: [nodes so far, anchor]
    open_anchors: set[str] = set()
    total = aliases = 0

    def add(n: int, mark: Any) -> None:
        nonlocal total
        total += n
        if stack:
            stack[-1][0] += n
        if total > YAML_MAX_NODES:
            line = f" line {mark.line + 1}" if mark is not None else ""
            raise ConfigError(f"{where}{line}: more than YAML_MAX_NODES = {YAML_MAX_NODES} YAML nodes with aliases "
                              "expanded; expected a smaller document (an alias bomb?)")

    try:
        for ev in yaml.parse(text, Loader=yaml.SafeLoader):
            if isinstance(ev, yaml.AliasEvent):
                aliases += 1
                line = f" line {ev.start_mark.line + 1}"
                if aliases > YAML_MAX_ALIASES:
                    raise ConfigError(f"{where}{line}: more than YAML_MAX_ALIASES = {YAML_MAX_ALIASES} YAML aliases; "
                                      "expected fewer")
                if ev.anchor in open_anchors:
                    raise ConfigError(f"{where}{line}: alias *{ev.anchor} inside its own anchor &{ev.anchor} "
                                      "(a cycle); expected an acyclic document")
                add(sizes.get(ev.anchor, 1), ev.start_mark)  # an undefined alias: the composer names it below
            elif isinstance(ev, yaml.ScalarEvent):
                if ev.anchor is not None:
                    sizes[ev.anchor] = 1
                add(1, ev.start_mark)
            elif isinstance(ev, yaml.CollectionStartEvent):
                if len(stack) >= YAML_MAX_DEPTH:
                    raise ConfigError(f"{where} line {ev.start_mark.line + 1}: YAML nested deeper than "
                                      f"YAML_MAX_DEPTH = {YAML_MAX_DEPTH}; expected a flatter document")
                stack.append([0, ev.anchor])
                if ev.anchor is not None:
                    open_anchors.add(ev.anchor)
                add(1, ev.start_mark)
            elif isinstance(ev, yaml.CollectionEndEvent):
                n, anchor = stack.pop()
                if anchor is not None:
                    open_anchors.discard(anchor)
                    sizes[anchor] = n
                if stack:
                    stack[-1][0] += n
    except yaml.YAMLError as exc:
        raise _yaml_error(where, exc) from None


def parse_yaml(text: str, where: str) -> Any:
    """The data of YAML ``text`` (``yaml.safe_load``), after :func:`_check_yaml_bounds`; ``where`` (e.g.
    ``"config file 'job.yaml'"``) starts every :class:`ConfigError` message."""
    if len(text) > YAML_MAX_BYTES:
        raise ConfigError(f"{where}: {len(text)} characters, more than YAML_MAX_BYTES = {YAML_MAX_BYTES}; "
                          "expected a smaller YAML document")
    _check_yaml_bounds(text, where)
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise _yaml_error(where, exc) from None
    except (ValueError, OverflowError) as exc:  # a scalar Python refuses, e.g. an integer of > 4300 digits
        raise ConfigError(f"{where}: unreadable YAML value ({str(exc).splitlines()[0]})") from None


def read_yaml(path: str | Path, what: str = "config file") -> Any:
    """The data of the YAML file ``path``, read through :func:`parse_yaml`'s bounds; at most
    :data:`YAML_MAX_BYTES` bytes are read. Every failure (unreadable, too big, not UTF-8, malformed, past a bound)
    is one :class:`ConfigError` line starting ``<what> '<path>'``."""
    where = f"{what} {str(path)!r}"
    try:
        with open(path, "rb") as f:
            raw = f.read(YAML_MAX_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read ({exc.strerror or exc})") from None
    if len(raw) > YAML_MAX_BYTES:
        raise ConfigError(f"{where}: larger than YAML_MAX_BYTES = {YAML_MAX_BYTES} bytes; expected a smaller "
                          "YAML file")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{where}: not UTF-8 text (byte {exc.start}); expected a YAML file") from None
    return parse_yaml(text, where)


def load_yaml(cls: type[T], path: str | Path) -> T:
    """Load ``cls`` from a YAML file (:func:`read_yaml`). Malformed YAML is a :class:`ConfigError` naming file and
    line, a bad value one naming the file and the field."""
    data = read_yaml(path)
    try:
        return from_dict(cls, data)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None


def save_yaml(obj: Any, path: str | Path) -> None:
    """Write a config tree to YAML atomically: a new temp file (``mkstemp``: an unpredictable name, created
    exclusively, so a planted symlink is never written through) in the target's directory, then renamed over
    ``path``."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~umask())  # mkstemp's 0600 -> what open() would have made
        with os.fdopen(fd, "w") as f:
            f.write(yaml.safe_dump(to_dict(obj), sort_keys=False))
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
