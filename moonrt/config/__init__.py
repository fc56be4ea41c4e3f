"""Typed configuration: nested ``@dataclass(kw_only=True, slots=True)`` trees loaded from YAML.

Every knob of moonrt is a field of a config dataclass (STYLE habit 7). This package holds the machinery shared by
all of them, one module per concept, and re-exports every name (``from moonrt.config import X``):

- :mod:`moonrt.config.schema`: :func:`from_dict` builds a dataclass tree from plain data (what ``yaml.safe_load``
  returns), checking every value against the field's type hint. Unknown keys are an error, never ignored.
  Errors are :class:`ConfigError` and name the dotted field path, the value and what was expected (:func:`check`).
  A dataclass may define ``validate(self)`` that raises :class:`ConfigError` for cross-field constraints; it runs
  after the tree is built, children first (:func:`validate`). :func:`to_dict` is the way back to plain data.
- :mod:`moonrt.config.yaml_io`: :func:`read_yaml` / :func:`parse_yaml`, the one YAML reader of moonrt, bounded in
  file size, nesting depth, aliases and nodes (aliases counted as the nodes they expand to), so a small hostile
  file (an alias bomb, thousands of nested brackets) is one :class:`ConfigError` line, never unbounded memory or a
  RecursionError; :func:`load_yaml` / :func:`save_yaml` round-trip a config through a YAML file.
- :mod:`moonrt.config.outputs`: :func:`write_new` / :func:`existing_outputs`: how every command creates its output
  files (exclusively, never through a symlink, replaced only when the user passes ``--force``); here because every
  layer may import this leaf.
- :mod:`moonrt.config.runtime`: the configs every runtime part shares: :class:`ParallelConfig` (the degrees of a
  job's parallel dimensions) and :class:`DistConfig` (how torch.distributed is initialized).

The package imports only the standard library and PyYAML (``tests/test_import_direction.py``).
"""

from __future__ import annotations

from moonrt.config.outputs import existing_outputs, umask, write_new
from moonrt.config.runtime import (
    DEFAULT_TIMEOUT_S,
    MAX_DEGREE,
    MAX_SCHEDULE_CELLS,
    MAX_TIMEOUT_S,
    PIPELINE_SCHEDULES,
    DistConfig,
    ParallelConfig,
    schedule_cells_error,
    schedule_error,
)
from moonrt.config.schema import ConfigError, check, from_dict, show, to_dict, validate
from moonrt.config.yaml_io import (
    YAML_MAX_ALIASES,
    YAML_MAX_BYTES,
    YAML_MAX_DEPTH,
    YAML_MAX_NODES,
    load_yaml,
    parse_yaml,
    read_yaml,
    save_yaml,
)

__all__ = [
    "ConfigError",
    "DEFAULT_TIMEOUT_S",
    "DistConfig",
    "MAX_DEGREE",
    "MAX_SCHEDULE_CELLS",
    "MAX_TIMEOUT_S",
    "PIPELINE_SCHEDULES",
    "ParallelConfig",
    "YAML_MAX_ALIASES",
    "YAML_MAX_BYTES",
    "YAML_MAX_DEPTH",
    "YAML_MAX_NODES",
    "check",
    "existing_outputs",
    "from_dict",
    "load_yaml",
    "parse_yaml",
    "read_yaml",
    "save_yaml",
    "schedule_cells_error",
    "schedule_error",
    "show",
    "to_dict",
    "umask",
    "validate",
    "write_new",
]
