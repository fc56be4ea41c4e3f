"""Typed configuration: nested ``@dataclass(kw_only=True, slots=True)`` trees loaded from YAML.

Every knob of moonrt is a field of a config dataclass (STYLE habit 7). This module holds the
machinery shared by all of them:

- :func:`from_dict` builds a dataclass tree from plain data (what ``yaml.safe_load`` returns),
  checking every value against the field's type hint. Unknown keys are an error, never ignored.
  Errors are :class:`ConfigError` and name the dotted field path, the value and what was expected.
- :func:`load_yaml` / :func:`save_yaml` round-trip a config through a YAML file.
- :func:`read_yaml` / :func:`parse_yaml`: the one YAML reader of moonrt, bounded in file size, nesting depth,
  aliases and nodes (aliases counted as the nodes they expand to), so a small hostile file (an alias bomb,
  thousands of nested brackets) is one :class:`ConfigError` line, never unbounded memory or a RecursionError.
- A dataclass may define ``validate(self)`` that raises :class:`ConfigError` (via :func:`check`)
  for cross-field constraints; it runs after the tree is built, children first.
- :func:`write_new` / :func:`existing_outputs`: how every command creates its output files (exclusively, never
  through a symlink, replaced only when the user passes ``--force``); here because every layer may import this leaf.

It also defines the configs every runtime part shares: :class:`ParallelConfig` (the degrees of a
job's parallel dimensions) and :class:`DistConfig` (how torch.distributed is initialized).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re
import reprlib
import tempfile
import types
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, BinaryIO, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

import yaml

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


def umask() -> int:
    """This process's umask, read without changing it (Linux ``/proc``; else the usual 022): for the mode a plain
    ``open()`` gives a file that ``mkstemp`` made 0600. (``os.umask`` can only be read by setting it, which races
    with other threads creating files.)"""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


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


# ---------------------------------------------------------------------------------------------
# Output files


def existing_outputs(paths: Iterable[str | Path]) -> list[Path]:
    """Those of ``paths`` that exist, as anything (a file, a directory, a symlink, dangling or not): what a command
    refuses before any work unless ``--force``."""
    return [Path(p) for p in paths if os.path.lexists(p)]


def write_new(path: str | Path, content: bytes | str | Callable[[BinaryIO], None], *, force: bool = False,
              mode: int = 0o666) -> None:
    """Create the file ``path`` with ``content`` (bytes, text as UTF-8, or a function writing to the open binary
    file, e.g. ``lambda f: fig.savefig(f, format="png")``), permissions ``mode`` less the umask (``0o777`` for a
    script).

    Without ``force`` the file is created exclusively (``O_CREAT | O_EXCL | O_NOFOLLOW``): anything already at
    ``path``, a symlink included, raises :class:`FileExistsError` and is left as it is. With ``force`` the content
    goes to a new temp file (``mkstemp``) beside it, renamed over ``path``: an existing file is replaced whole, a
    symlink there is replaced itself, never written through. A failed write removes only the file it created."""
    path = Path(path)
    if force:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        os.fchmod(fd, mode & ~umask())
        made = Path(tmp)
    else:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
        made = path
    try:
        with os.fdopen(fd, "wb") as f:
            if callable(content):
                content(f)
            else:
                f.write(content.encode() if isinstance(content, str) else content)
        if force:
            os.replace(made, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(made)
        raise


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


MAX_DEGREE = 1 << 20
"""Largest degree of a parallel dimension (and micro-batch count): a million ranks, far beyond any cluster; a bound
so that a typo (``--ep 1000000000``) is refused here, not in the arithmetic of the mesh."""

MAX_SCHEDULE_CELLS = 1 << 17
"""Most (stage, micro-batch) cells of a pipeline schedule, ``pp x vpp x microbatches``: the schedule holds actions per
cell and the planners simulate them one by one (2**17 cells: about half a minute and 250 MB on one core). Real
layouts have a few thousand (K3's pp 16 x vpp 2 x 32 micro-batches = 1,024)."""


def schedule_cells_error(pp: int, vpp: int, microbatches: int) -> str | None:
    """The ``expected`` text when ``pp x vpp x microbatches`` exceeds :data:`MAX_SCHEDULE_CELLS`, else None."""
    cells = pp * vpp * microbatches
    if cells <= MAX_SCHEDULE_CELLS:
        return None
    return (f"pp x vpp x microbatches ({pp} x {vpp} x {microbatches} = {cells}) <= {MAX_SCHEDULE_CELLS} "
            "(MAX_SCHEDULE_CELLS, the schedule cells a planner simulates)")


MAX_TIMEOUT_S = 7 * 24 * 3600.0
"""Longest collective / rendezvous timeout (a week): a collective that has not finished by then is a hung job;
beyond this, the deadline arithmetic of torch and threading overflows (``inf``: OverflowError)."""


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
    ep_dedup: bool = True
    """Expert parallelism (MoonEP, K3_SYSTEMS §6.3): send a token once per destination rank, however many of its
    top-k experts that rank computes (the receiver expands it, and sums the rows back before combine's return
    trip); ``false``: one row per token-expert assignment."""
    token_padding: int = 1
    """Expert parallelism: pad every expert segment of the dispatched rows with zero rows to a multiple of this
    (aligned grouped GEMMs); 1 = no padding. Padding rows never reach the output or a gradient. Both fields act
    only with ``ep > 1`` (one process has no dispatcher to configure)."""
    zero: int = 0
    """ZeRO stage of data parallelism: 0 replicates the AdamW states on every replica, 1 shards them (and the
    reduced gradients) over each parameter's replicas (:class:`moonrt.comm.zero.Zero1`); with one replica a no-op."""

    def validate(self) -> None:
        for name in ("dp", "pp", "vpp", "ep", "cp", "microbatches"):
            value = getattr(self, name)
            check(isinstance(value, int) and value >= 1, name, value, "an integer >= 1")
            check(value <= MAX_DEGREE, name, value, f"an integer <= {MAX_DEGREE} (MAX_DEGREE)")
        check(isinstance(self.ep_dedup, bool), "ep_dedup", self.ep_dedup, "true or false")
        check(isinstance(self.token_padding, int) and not isinstance(self.token_padding, bool)
              and self.token_padding >= 1, "token_padding", self.token_padding, "an integer >= 1")
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
        too_many = schedule_cells_error(self.pp, self.vpp, self.microbatches)
        check(too_many is None, "microbatches", self.microbatches, too_many or "")

    @property
    def pipeline_schedule(self) -> str:
        """The schedule that runs: ``schedule``, with ``auto`` resolved (interleaved when ``vpp > 1``)."""
        if self.schedule != "auto":
            return self.schedule
        return "interleaved" if self.vpp > 1 else "1f1b"

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.ep * self.cp


DEFAULT_TIMEOUT_S = 300.0
"""Collective / rendezvous timeout when neither the job config (``dist.timeout_s``) nor the launcher
(``MOONRT_DIST_TIMEOUT``) gives one."""

_HOST = re.compile(r"[\w.:%-]{1,255}", re.ASCII)
"""An IP address (v4, v6 with ``%zone``) or host name: also one shell word, as ``moonrt sbatch`` writes it."""


@dataclasses.dataclass(kw_only=True, slots=True)
class DistConfig:
    """How torch.distributed is initialized (:func:`moonrt.cluster.env.init_distributed`): a job's ``dist`` section.

    A field left ``None`` takes the value the launcher passes to every rank in the environment (``moonrt launch``
    and ``moonrt sbatch`` write it there), else the default; a value set here wins over the launcher's
    (:func:`moonrt.cluster.env.resolve_dist_config`)."""

    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """``auto``: the job's device decides (gloo on cpu, nccl on cuda); outside a job, nccl when CUDA is available,
    else gloo."""
    timeout_s: float | None = None
    """Timeout in seconds of every collective and of the rendezvous: a dead rank never hangs a job longer. ``None``:
    the launcher's ``MOONRT_DIST_TIMEOUT`` (``moonrt launch --timeout``, ``moonrt sbatch --timeout``), else
    :data:`DEFAULT_TIMEOUT_S`."""
    rdzv_host: str | None = None
    """Address (or name) of the interface rank 0's rendezvous store listens on (``0.0.0.0``: every interface).
    ``None``: the launcher's ``MOONRT_RDZV_HOST`` (``moonrt sbatch --rdzv-host``), else the address ``MASTER_ADDR``
    resolves to on rank 0's host (:func:`moonrt.cluster.store.rendezvous_bind_host`)."""

    def validate(self) -> None:
        check(self.backend in ("auto", "gloo", "nccl"), "backend", self.backend, "one of 'auto', 'gloo', 'nccl'")
        t = self.timeout_s
        check(t is None or (isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t)
                            and 0 < t <= MAX_TIMEOUT_S), "timeout_s", t,
              f"a positive number of seconds <= {MAX_TIMEOUT_S:g} (MAX_TIMEOUT_S, a week), or null (the launcher's)")
        check(self.rdzv_host is None or (isinstance(self.rdzv_host, str) and bool(_HOST.fullmatch(self.rdzv_host))),
              "rdzv_host", self.rdzv_host, "an IP address or host name of rank 0's interface (letters, digits, "
              "'.', ':', '%', '_', '-'; 0.0.0.0: every interface), or null (the launcher's)")


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
    "validate",
    "write_new",
]
