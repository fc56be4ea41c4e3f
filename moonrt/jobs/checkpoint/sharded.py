"""Sharded checkpoints of ``moonrt train`` with ``torch.distributed.checkpoint`` (DCP): no gather to one rank.

Layout on disk (``OUT/checkpoint/``)::

    OUT/checkpoint/step-00000020/     one committed checkpoint (after a commit the newest checkpoint.keep_latest
                                      and the milestones, multiples of checkpoint.keep_every, are kept)
        .metadata                     DCP's index: every entry's global shape, dtype and saved chunks
        __<rank>_0.distcp             what each rank wrote (DCP's files, one per rank)
        moonrt.json                   the commit marker: step, job config, layout, optimizer hyperparameters,
                                      every file's size and CRC-32 (``files``; absent in markers written before)
                                      and the CRC-32 of its own content (``marker_crc32``; likewise)
    OUT/checkpoint/step-00000030.tmp/ a save in progress or interrupted (never loaded)

Entries (:mod:`moonrt.comm.state.shards`): ``model.<name>`` for every single-process ``model.state_dict()`` entry
(single-process shapes: experts ``[E, ...]`` written as row shards by the EP ranks holding them, each
pipeline stage's tensors by its ranks, replicas once), ``optimizer.<name>.exp_avg`` / ``.exp_avg_sq`` (the
AdamW moments flattened to ``[numel]``: ZeRO-1 owners write their flat ranges) and ``optimizer.<name>.step``;
with ``--optimizer muon`` its AdamW-group parameters the same, its Muon parameters ``optimizer.<name>.momentum_buffer``
(the parameter's shape: ZeRO-Muon owners write their blocks as boxes, rows or columns) and ``.step`` (> 0: has state).

- **Host agreement over the CPU group**: the barrier, DCP's planning (its object collectives), the gathered write
  results and the commit verdict travel over ``Parallelism.cpu_group`` (the mesh's gloo group), whatever backend
  carries the tensors.
- **Every rank writes what it owns**: ``Parallelism.sharded_state_dict`` hands DCP views of this rank's
  parameters and optimizer shards; nothing is gathered (``moonrt.json`` records the bytes each rank passed).
- **Atomic**: ranks write into ``step-N.tmp``; after DCP's collective finish (``.metadata`` written), rank 0
  writes ``moonrt.json`` (temp file, fsync, rename) and renames the directory to ``step-N``. Loading requires
  the marker: a ``.tmp`` directory or one without ``moonrt.json`` is refused, and ``OUT/checkpoint`` resolves
  to its newest committed step, so an interrupted save leaves the previous checkpoint loadable. A save that
  fails (a rank's write: a full disk says "no space left on device in ROOT") removes its ``step-N.tmp``.
- **Verified**: before a load every file is checked against the marker's sizes and CRC-32s (:func:`file_sum`;
  the ranks of a load share the reading) and every entry of ``.metadata`` against its file's size, so a flipped
  bit, a truncated shard or a missing ``.metadata`` is one :class:`CheckpointError` naming the file (DCP's
  own logging of the failure is silenced); ``moonrt checkpoint info --verify`` runs the same check. The marker
  itself carries ``marker_crc32`` (:func:`marker_sum`, checked by every :func:`read_marker`), its ``step`` must be
  the one its ``step-N`` directory names, and on load its optimizer ``param_groups`` must be what the job's config
  or the marker's own config builds (the schedule's ``lr`` aside): an edited marker is refused, not resumed. A
  marker written before ``marker_crc32`` still loads, with a warning line saying it is not verified.
- **Loading reshards** to any layout, one process included (DCP without a process group): each rank asks
  for the ranges its own tensors cover, DCP reads them from whichever saved chunks overlap; a range no saved
  chunk covers is an error (:class:`moonrt.comm.state.dcp.ShardLoadPlanner`).
- **No pickled objects run**: tensor data is read with ``torch.load(weights_only=True)`` (DCP), the step and
  config live in ``moonrt.json``; DCP's ``.metadata`` is a pickle that torch 2.13 reads with plain
  ``pickle.load``, so it is read here with an allow-list unpickler (DCP metadata classes, ``torch.Size``,
  dtypes) instead; non-tensor entries are refused, and so are entries stored outside the step directory (an
  absolute path, ``..``, a symlink out: :func:`moonrt.comm.state.dcp.check_storage_paths`).

Which format a job writes (:func:`use_sharded`): multi-rank jobs with AdamW or Muon write DCP; a single process
keeps writing ``OUT/checkpoint.pt`` (it holds everything anyway, and the one file is what other tools read); other
optimizers would keep the gathered file. ``--resume`` takes the newer of the two
(:func:`moonrt.jobs.checkpoint.store.resume_state`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import logging
import math
import os
import re
import shutil
import stat
import sys
import tempfile
import warnings
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import torch
import torch.distributed as dist

from moonrt.cluster.preempt import raised_abort
from moonrt.comm.parallelism import Parallelism
from moonrt.config import to_dict, umask
from moonrt.jobs.checkpoint.job import JobBuilder, SavedJob
from moonrt.jobs.checkpoint.single import CheckpointError
from moonrt.ops.muon import Muon, step_count

# torch.distributed.checkpoint (and moonrt.comm.state.dcp, built on it) is imported by the functions that read or
# write a DCP checkpoint, not here: it costs ~0.6-0.8 s per process (it imports torch.distributed.tensor and sympy),
# and every `moonrt train` imports this module while a single process never writes DCP (use_sharded). The sharded
# state's values (moonrt.comm.state.shards) import no DCP: every rank imports them through the parallel parts.

ROOT = "checkpoint"
MARKER = "moonrt.json"
FORMAT = "moonrt-dcp/1"
STEP_DIR = re.compile(r"^step-(\d+)$")
TMP_DIR = re.compile(r"^step-(\d+)\.tmp$")
MAX_MARKER_BYTES = 64 << 20  # a marker holds a few hundred bytes per rank: refused above this before it is read
METADATA = ".metadata"
MARKER_SUM = "marker_crc32"
SCHEDULED = ("lr", "initial_lr")  # param-group keys the lr schedule sets every step: not compared on load
_NO_SPACE = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded"}


def _multi() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def use_sharded(opt: torch.optim.Optimizer) -> bool:
    """True where a job writes DCP checkpoints: more than one rank and torch's AdamW or moonrt's Muon (the state
    layouts :mod:`moonrt.comm.state.shards` names); else the gathered ``checkpoint.pt``."""
    return _multi() and isinstance(opt, torch.optim.AdamW | Muon)


class _NoDcpLogs(logging.Filter):
    """Drops the records DCP logs itself (a failed read logs its traceback to the root logger before raising):
    the error reaches the user once, as the :class:`CheckpointError` line."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "torch/distributed/checkpoint" not in record.pathname.replace(os.sep, "/")


@contextlib.contextmanager
def _quiet(multi: bool) -> Any:
    """Silence DCP's "torch.distributed is disabled ... assuming a single process" warning (that is the intent)
    and DCP's own logging of the errors it raises."""
    quiet, root = _NoDcpLogs(), logging.getLogger()
    root.addFilter(quiet)
    try:  # multi: no warning to filter, and no catch_warnings (it swaps the process's filters: not thread-safe)
        with warnings.catch_warnings() if not multi else contextlib.nullcontext():
            if not multi:
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            yield
    finally:
        root.removeFilter(quiet)


def _reason(exc: BaseException) -> str:
    """``Type: message`` of the underlying error (DCP wraps each rank's exception, with its traceback, in a
    ``CheckpointException``: the lowest failing rank's)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        inner = failures[min(failures)]
        exc = inner[0] if isinstance(inner, tuple) else inner
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def _failures(exc: BaseException) -> list[BaseException]:
    """Every rank's exception DCP wrapped in ``exc`` (a ``CheckpointException``), or ``[exc]``."""
    failures = getattr(exc, "failures", None)
    if not isinstance(failures, dict) or not failures:
        return [exc]
    return [inner[0] if isinstance(inner, tuple) else inner for _, inner in sorted(failures.items())]


def _write_reason(exc: BaseException, root: Path) -> str:
    """Why a save failed: ``no space left on device in ROOT`` for ENOSPC / EDQUOT on any rank (also where torch's
    zip writer reports it as "unexpected pos" and the file system has no space left), else :func:`_reason`."""
    for inner in _failures(exc):
        if isinstance(inner, OSError) and inner.errno in _NO_SPACE:
            return f"{_NO_SPACE[inner.errno]} in {root}"
    if any("unexpected pos" in str(inner) for inner in _failures(exc)):
        with contextlib.suppress(OSError):
            st = os.statvfs(root)
            if st.f_bavail * st.f_frsize < 1 << 20:
                return f"{_NO_SPACE[errno.ENOSPC]} in {root}"
    return f"{root}: {_reason(exc)}"


def _write_json(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` as JSON atomically (a new temp file beside it from ``mkstemp``, fsync, rename)."""
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".part", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            os.fchmod(f.fileno(), 0o666 & ~umask())  # mkstemp's 0600 -> the mode open() gives (DCP's files')
            json.dump(data, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def file_sum(path: Path | BinaryIO) -> dict[str, Any]:
    """``{"bytes", "crc32"}`` of a file, or of a file open for reading from its start (CRC-32 as 8 hex digits, read
    in 4 MiB pieces).

    CRC-32, not a cryptographic hash: it detects every single-bit flip and every error burst of up to 32 bits
    (bit rot, a torn or truncated write) and runs at ~2.7 GB/s here against ~1.3 GB/s for SHA-256 (zlib vs
    hashlib, one core); it does not stop a deliberate edit, but whoever can edit a shard can edit the marker too.
    """
    crc, n = 0, 0
    with open(path, "rb") if isinstance(path, str | os.PathLike) else contextlib.nullcontext(path) as f:
        while chunk := f.read(1 << 22):
            crc, n = zlib.crc32(chunk, crc), n + len(chunk)
    return {"bytes": n, "crc32": f"{crc:08x}"}


def marker_sum(marker: dict[str, Any]) -> str:
    """CRC-32 (8 hex digits) of a marker's content: the JSON of every key but ``marker_crc32`` itself, keys sorted,
    no spaces (the form a JSON round trip keeps: floats print as their shortest repr)."""
    body = {k: v for k, v in marker.items() if k != MARKER_SUM}
    return f"{zlib.crc32(json.dumps(body, sort_keys=True, separators=(',', ':')).encode()):08x}"


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _jsonable(value: Any) -> Any:
    if isinstance(value, tuple | list):
        return [_jsonable(v) for v in value]
    if isinstance(value, torch.Tensor):
        return value.item()
    return value


def _hyper(saved: dict[str, Any]) -> dict[str, Any]:
    """Hyperparameters of a param group as read back from JSON (lists were tuples: ``betas``)."""
    return {k: tuple(v) if isinstance(v, list) else v for k, v in saved.items()}


# ---- writing -------------------------------------------------------------------------------------------


def save_sharded(root: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, step: int, job: SavedJob,
                 rt: Parallelism | None = None) -> Path:
    """Write this job's state at ``step`` under ``root`` (``OUT/checkpoint``); collective: every rank calls it.

    Returns the committed ``root/step-N`` directory. :class:`CheckpointError` (nothing committed, the previous
    checkpoint untouched, the ``step-N.tmp`` of this save removed) when a rank's write fails: ``checkpoint write
    failed: no space left on device in ROOT`` for a full disk or quota on any rank. The marker records every
    file's size and CRC-32 (:func:`file_sum`: each rank sums the data files it wrote, rank 0 the ``.metadata``).
    After the commit rank 0 removes older steps as ``job.checkpoint`` says (:func:`retain`).
    """
    rt = rt or Parallelism()
    return _write(_Save.begin(root, model, opt, step, job, rt, stage=False), rt.cpu_group)


def start_save(root: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, step: int, job: SavedJob,
               rt: Parallelism, group: Any) -> PendingSave:
    """:func:`save_sharded` in the background (``checkpoint.async_save``); collective: every rank calls it.

    Here, in the caller's thread: this rank's state copied to host memory (:func:`_stage`; the loop may update the
    parameters and optimizer state right after this returns) and the param groups' values of now. In a thread:
    DCP's write, the gathered file sums, rank 0's commit and retention, the verdict: all over ``group``, a gloo
    group of every rank used by nothing else (the loop's collectives meanwhile run on theirs), so the marker is
    written once every rank's write finished. The caller keeps at most one save in flight
    (:meth:`PendingSave.result` before the next)."""
    save = _Save.begin(root, model, opt, step, job, rt, stage=True)
    return PendingSave(lambda: _write(save, group))


class PendingSave:
    """A :func:`start_save` in flight: a daemon thread (a process that dies or is killed leaves ``step-N.tmp``
    uncommitted, the previous step loadable)."""

    def __init__(self, run: Callable[[], Path]) -> None:
        import threading

        self._result: Path | None = None
        self._error: BaseException | None = None

        def target() -> None:
            try:
                self._result = run()
            except BaseException as exc:  # handed to the caller's thread by result()
                self._error = exc

        self._thread = threading.Thread(target=target, name="moonrt-checkpoint", daemon=True)
        self._thread.start()

    def done(self) -> bool:
        return not self._thread.is_alive()

    def result(self) -> Path:
        """Wait for the save; the committed directory, or the save's :class:`CheckpointError` (every rank raises
        it: the verdict is shared)."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result


def _stage(state: dict[str, Any]) -> dict[str, Any]:
    """A copy of a sharded state in host memory: every tensor, and the local tensor of every ``Shard`` / ``Boxes``
    entry (DCP's own async stager copies plain tensors, DTensors and ShardedTensors only: it would leave moonrt's
    shards pointing at the live parameters the loop goes on updating)."""
    from moonrt.comm.state.shards import Boxes, Shard

    def host(t: torch.Tensor) -> torch.Tensor:
        return t.detach().to("cpu", copy=True)

    def copy(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return host(v)
        if isinstance(v, Shard):
            return Shard(host(v.local), v.shape, v.offsets)
        if isinstance(v, Boxes):
            return Boxes(v.shape, [Shard(host(p.local), p.shape, p.offsets) for p in v.parts])
        raise TypeError(f"sharded state entry of type {type(v).__name__}: expected a tensor, Shard or Boxes")

    return {k: copy(v) for k, v in state.items()}


@dataclasses.dataclass
class _Save:
    """What one save writes, taken in the caller's thread (:meth:`begin`); :func:`_write` writes it."""

    root: Path
    step: int
    job: SavedJob
    state: dict[str, Any]
    mine: list[int]  # this rank's model and optimizer bytes
    groups: list[dict[str, Any]]  # the param groups' hyperparameters at the save (JSON form)
    multi: bool
    rank: int
    main: bool

    @classmethod
    def begin(cls, root: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, step: int, job: SavedJob,
              rt: Parallelism, stage: bool) -> _Save:
        from moonrt.comm.state.shards import entry_bytes

        multi = _multi()
        state = rt.sharded_state_dict(model, opt, save=True)
        mine = [sum(entry_bytes(v) for k, v in state.items() if k.startswith("model.")),
                sum(entry_bytes(v) for k, v in state.items() if k.startswith("optimizer."))]
        groups = [{k: _jsonable(v) for k, v in g.items() if k != "params"} for g in opt.param_groups]
        return cls(Path(root), step, job, _stage(state) if stage else state, mine, groups, multi,
                   dist.get_rank() if multi else 0, rt.is_main)


def _write(save: _Save, group: Any) -> Path:
    """Write and commit ``save`` (collective over ``group``: host agreement and DCP's planning, gloo)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from moonrt.comm.state.dcp import SafeWriter, ShardSavePlanner

    root, step, multi, rank = save.root, save.step, save.multi, save.rank
    name = f"step-{step:08d}"
    tmp, final = root / f"{name}.tmp", root / name
    if save.main:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.is_symlink():  # planted: DCP would write through it into the directory it names
            tmp.unlink()
        shutil.rmtree(tmp, ignore_errors=True)
    if multi:
        dist.barrier(group=group)
    planner = ShardSavePlanner()
    try:
        with _quiet(multi):
            dcp.save(save.state, storage_writer=SafeWriter(tmp, thread_count=1, sync_files=True),
                     planner=planner, process_group=group, no_dist=not multi)
    except (Exception, CheckpointException) as exc:  # DCP re-raises every rank's failure on every rank
        if save.main:  # every rank is past its writes (DCP gathered their results): remove this save's files
            shutil.rmtree(tmp, ignore_errors=True)
        abort = raised_abort()  # a second stop signal during the save: DCP wrapped the abort too
        if abort is not None:
            raise abort from None
        raise CheckpointError(f"checkpoint write failed: {_write_reason(exc, root)}") from None
    written = sum(math.prod(it.tensor_data.chunk.sizes) * it.tensor_data.properties.dtype.itemsize
                  for it in planner.plan.items if it.tensor_data is not None)  # this rank's chunks after dedup
    row = [*save.mine, int(written), {f.name: file_sum(f) for f in sorted(tmp.glob(f"__{rank}_*.distcp"))}]
    rows: list[Any] = [None] * dist.get_world_size() if multi else [row]
    if multi:  # small Python lists, over the CPU group
        dist.all_gather_object(rows, row, group=group)
    failed: list[str | None] = [None]
    if save.main:
        try:
            _commit(root, tmp, final, rows, step, save.job, save.groups)
        except Exception as exc:  # the other ranks wait for the verdict below: they must hear of any failure
            shutil.rmtree(tmp, ignore_errors=True)
            why = (f"{_NO_SPACE[exc.errno]} in {root}" if isinstance(exc, OSError) and exc.errno in _NO_SPACE
                   else f"{tmp}: {exc.strerror if isinstance(exc, OSError) and exc.strerror else _reason(exc)}")
            failed = [f"checkpoint write failed: {why}"]
    if multi:  # every rank learns whether rank 0 committed
        dist.broadcast_object_list(failed, src=0, group=group)
    if failed[0] is not None:
        raise CheckpointError(failed[0])
    return final


def _commit(root: Path, tmp: Path, final: Path, rows: list[Any], step: int, job: SavedJob,
            groups: list[dict[str, Any]]) -> None:
    """Rank 0: write the marker (with every file's size and CRC-32) into ``tmp``, rename it to ``final``, remove
    older steps and interrupted saves."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from moonrt.comm.state.dcp import SafeReader

    md = SafeReader(tmp).read_metadata()
    tensors = [m for m in md.state_dict_metadata.values() if isinstance(m, TensorStorageMetadata)]
    files = {k: v for r in rows for k, v in r[3].items()}
    for f in sorted(tmp.glob("*.distcp")):  # a data file no rank claimed (another naming): summed here
        if f.name not in files:
            files[f.name] = file_sum(f)
    files[METADATA] = file_sum(tmp / METADATA)
    p = job.parallel
    marker = {"format": FORMAT, "step": step, "config": to_dict(job),
              "layout": {"world": len(rows), "dp": p.dp, "pp": p.pp, "vpp": p.vpp, "ep": p.ep, "cp": p.cp,
                         "zero": p.zero},
              "param_groups": groups,
              "tensors": len(tensors),
              "bytes": sum(math.prod(m.size) * m.properties.dtype.itemsize for m in tensors),
              "ranks": [{"model_bytes": int(r[0]), "optimizer_bytes": int(r[1]), "written_bytes": int(r[2])}
                        for r in rows],
              "files": dict(sorted(files.items()))}
    marker[MARKER_SUM] = marker_sum(marker)
    _write_json(tmp / MARKER, marker)
    _fsync_dir(tmp)
    if final.is_symlink():
        final.unlink()
    elif final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(root)
    for old in root.iterdir():  # interrupted saves (this one is committed; at most one save is in flight)
        if TMP_DIR.match(old.name) and old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
    retain(root, job.checkpoint.keep_latest, job.checkpoint.keep_every, final)


def committed_steps(root: Path) -> list[tuple[int, Path]]:
    """``(step, directory)`` of every committed checkpoint under ``root``, oldest first: directories (not symlinks)
    named ``step-N`` whose marker :func:`read_marker` accepts (one moonrt wrote for that step). Anything else, a
    damaged marker included, is not counted (and never removed by :func:`retain`)."""
    out = []
    for d in root.iterdir():
        m = STEP_DIR.match(d.name)
        if m is None or d.is_symlink() or not d.is_dir():
            continue
        try:
            read_marker(d)
        except CheckpointError:
            continue
        out.append((int(m.group(1)), d))
    return sorted(out)


def retain(root: Path, keep_latest: int, keep_every: int, keep: Path | None = None) -> list[Path]:
    """Remove the committed checkpoints under ``root`` (:func:`committed_steps`) that are neither among the newest
    ``keep_latest`` nor milestones (a multiple of ``keep_every`` > 0) nor ``keep``; returns the removed directories.
    Rank 0 calls it after each commit (``checkpoint.keep_latest``, ``checkpoint.keep_every``). A reader of a removed
    step (``checkpoint export``) reads the files it pinned (:class:`_Files`)."""
    done = committed_steps(root)
    newest = {d for _, d in done[-keep_latest:]}
    gone = [d for s, d in done if d not in newest and d != keep and not (keep_every > 0 and s % keep_every == 0)]
    for d in gone:
        shutil.rmtree(d, ignore_errors=True)
    return gone


# ---- reading -------------------------------------------------------------------------------------------


def resolve(path: str | Path) -> Path:
    """The committed checkpoint directory ``path`` names: itself (a ``step-N`` directory with its marker) or
    the newest committed ``step-N`` in it (``OUT/checkpoint``). :class:`CheckpointError` for a torn one."""
    path = Path(path)
    if (path / MARKER).is_file():
        return path
    if path.name.endswith(".tmp") or (path / ".metadata").exists() or any(path.glob("*.distcp")):
        raise CheckpointError(f"checkpoint {str(path)!r}: incomplete (no {MARKER} commit marker: the save was "
                              "interrupted or is still running); expected a committed checkpoint directory")
    if not path.is_dir():
        gone = STEP_DIR.match(path.name) if not os.path.lexists(path) and path.parent.is_dir() else None
        newer = [int(m.group(1)) for d in path.parent.iterdir() if (m := STEP_DIR.match(d.name))
                 and (d / MARKER).is_file() and int(m.group(1)) > int(gone.group(1))] if gone else []
        if newer:  # e.g. resolved a moment ago by export of a run that is still running
            raise CheckpointError(f"checkpoint {str(path)!r}: step {int(gone.group(1))} was rotated away: the job "
                                  f"committed step {max(newer)} and removed it (it keeps the newest "
                                  f"checkpoint.keep_latest committed steps and milestones); give {str(path.parent)!r} "
                                  "to read the newest")
        raise CheckpointError(f"checkpoint {str(path)!r}: expected a directory (OUT/checkpoint or one of its "
                              "step-N directories)")
    done = sorted((int(m.group(1)), d) for d in path.iterdir()
                  if (m := STEP_DIR.match(d.name)) and (d / MARKER).is_file())
    if done:
        return done[-1][1]
    found = sorted(d.name for d in path.iterdir())
    raise CheckpointError(f"checkpoint {str(path)!r}: no committed checkpoint (holds {found or 'nothing'}; a "
                          f"step-N directory counts once it holds {MARKER}: a save was interrupted?)")


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _fields(where: str, data: Any, spec: dict[str, tuple[Any, str]]) -> None:
    """Check that the dict ``data`` has every key of ``spec`` (``key -> (check, expected)``, a check a type or a
    predicate); :class:`CheckpointError` naming the first missing or wrong key (``where.key``)."""
    for key, (check, expected) in spec.items():
        if key not in data:
            raise CheckpointError(f"{MARKER} has no {where}{key}: expected {expected} (a damaged or edited marker)")
        ok = isinstance(data[key], check) if isinstance(check, type | tuple) else check(data[key])
        if not ok:
            raise CheckpointError(f"{MARKER} {where}{key} = {data[key]!r}: expected {expected}")


_ROW = {k: (_int, "an integer >= 0") for k in ("model_bytes", "optimizer_bytes", "written_bytes")}
_FILE = {"bytes": (_int, "an integer >= 0"),
         "crc32": (lambda v: isinstance(v, str) and re.fullmatch(r"[0-9a-f]{8}", v) is not None, "8 hex digits")}


def read_marker(step_dir: Path) -> dict[str, Any]:
    """The ``moonrt.json`` of a committed checkpoint directory, checked: every key loading and ``moonrt checkpoint
    info`` use, with its type; its own CRC-32 (``marker_crc32``, :func:`marker_sum`); its ``step`` against the
    directory's name where that is ``step-N``. ``files`` (the per-file sizes and CRC-32s) and ``marker_crc32`` are
    optional: markers written before checksums lack them (:func:`verified`)."""
    try:
        with open(Path(step_dir) / MARKER, "rb") as f:
            return _parse_marker(step_dir, _read_marker_file(step_dir, f))
    except OSError as exc:
        raise CheckpointError(f"checkpoint {str(step_dir)!r}: unreadable {MARKER}: {exc}") from None


def _read_marker_file(step_dir: Path, f: BinaryIO) -> bytes:
    """The bytes of an open ``moonrt.json``, at most :data:`MAX_MARKER_BYTES` (more: :class:`CheckpointError`)."""
    raw = f.read(MAX_MARKER_BYTES + 1)
    if len(raw) > MAX_MARKER_BYTES:
        raise CheckpointError(f"checkpoint {str(step_dir)!r}: {MARKER} is larger than {MAX_MARKER_BYTES:,} bytes; "
                              "expected a commit marker written by moonrt")
    return raw


def _parse_marker(step_dir: Path, raw: bytes) -> dict[str, Any]:
    """:func:`read_marker` of the marker's bytes ``raw``."""
    try:
        marker = json.loads(raw)
    except ValueError as exc:
        raise CheckpointError(f"checkpoint {str(step_dir)!r}: unreadable {MARKER}: {exc}") from None
    if not isinstance(marker, dict) or marker.get("format") != FORMAT:
        got = marker.get("format") if isinstance(marker, dict) else type(marker).__name__
        raise CheckpointError(f"checkpoint {str(step_dir)!r}: {MARKER} format = {got!r}; expected {FORMAT!r}")
    if not isinstance(marker.get("step"), int) or marker["step"] < 0:
        raise CheckpointError(f"checkpoint {str(step_dir)!r}: step = {marker.get('step')!r}; expected an integer >= 0")
    try:
        _fields("", marker, {"config": (dict, "the job config (a mapping)"),
                             "layout": (dict, "a mapping of world, dp, pp, vpp, ep, cp, zero"),
                             "param_groups": (lambda v: isinstance(v, list) and all(isinstance(g, dict) for g in v),
                                              "a list of mappings (the optimizer's param groups)"),
                             "tensors": (_int, "an integer >= 0"), "bytes": (_int, "an integer >= 0"),
                             "ranks": (lambda v: isinstance(v, list) and bool(v)
                                       and all(isinstance(r, dict) for r in v),
                                       "a non-empty list of mappings (one per rank)")})
        _fields("config.", marker["config"], {"model": (str, "a model name"),
                                              "optim": (dict, "a mapping of optimizer settings")})
        _fields("config.optim.", marker["config"]["optim"], {"steps": (_int, "an integer >= 0")})
        if marker["config"].get("model_config") is not None and not isinstance(marker["config"]["model_config"],
                                                                                dict):
            raise CheckpointError(f"{MARKER} config.model_config = {marker['config']['model_config']!r}: expected "
                                  "null or a mapping")
        _fields("layout.", marker["layout"], {k: (_int, "an integer >= 0")
                                              for k in ("world", "dp", "pp", "vpp", "ep", "cp", "zero")})
        for r, row in enumerate(marker["ranks"]):
            _fields(f"ranks[{r}].", row, _ROW)
        if "files" in marker:
            _fields("", marker, {"files": (lambda v: isinstance(v, dict) and METADATA in v,
                                           f"a mapping of file name -> {{bytes, crc32}} naming {METADATA}")})
            for name, entry in marker["files"].items():
                if not isinstance(entry, dict) or "/" in name or name in (".", ".."):
                    raise CheckpointError(f"{MARKER} files[{name!r}] = {entry!r}: expected {{bytes, crc32}} of a "
                                          "file in the checkpoint directory")
                _fields(f"files[{name!r}].", entry, _FILE)
        if MARKER_SUM in marker:
            _fields("", marker, {MARKER_SUM: _FILE["crc32"]})
    except CheckpointError as exc:
        raise CheckpointError(f"checkpoint {str(step_dir)!r}: {exc}") from None
    if MARKER_SUM in marker and (got := marker_sum(marker)) != marker[MARKER_SUM]:
        raise CheckpointError(f"checkpoint {str(step_dir)!r}: file {MARKER} is damaged or edited: CRC-32 {got} of "
                              f"its content, it records {marker[MARKER_SUM]} ({MARKER_SUM}); expected a marker as "
                              "moonrt wrote it")
    named = STEP_DIR.match(Path(step_dir).name)
    if named and int(named.group(1)) != marker["step"]:
        raise CheckpointError(f"checkpoint {str(step_dir)!r}: {MARKER} step = {marker['step']}, but the directory "
                              f"is {Path(step_dir).name}: a renamed directory or an edited marker; expected the "
                              "step its name gives")
    return marker


def verified(marker: dict[str, Any]) -> bool:
    """Whether a marker carries its own checksum (:func:`read_marker` checked it); False: written before."""
    return MARKER_SUM in marker


def _warn_unverified(step_dir: Path, marker: dict[str, Any]) -> None:
    """One warning line on stderr for a loaded marker written before ``marker_crc32``."""
    if not verified(marker):
        print(f"moonrt: warning: checkpoint {str(step_dir)!r}: {MARKER} carries no checksum of its own (written "
              "before marker checksums): its step, config and optimizer settings are not verified",
              file=sys.stderr, flush=True)


class _Files:
    """The files of one committed step directory as a read of it sees them: by path, or after :meth:`pin` through
    descriptors opened once, so a job that rotates the step away meanwhile (removes its directory after committing
    a newer one) changes nothing read: the checks and DCP's reads see the same files. Also the file system DCP's
    reader reads through (:meth:`reader`: ``create_stream``, ``concat_path``, ``init_path``)."""

    def __init__(self, step_dir: Path) -> None:
        self.dir = Path(step_dir)
        self.fds: dict[str, int] | None = None  # name in the directory -> descriptor (pinned), None: by path

    def size(self, name: str) -> int | None:
        """The size of a regular file ``name``; None where it is missing (or not a regular file)."""
        if self.fds is None:
            path = self.dir / name
            return path.stat().st_size if path.is_file() else None
        return os.fstat(self.fds[name]).st_size if name in self.fds else None

    @contextlib.contextmanager
    def open(self, name: str) -> Iterator[BinaryIO]:
        """File ``name`` open for reading from its start."""
        if self.fds is None:
            with open(self.dir / name, "rb") as f:
                yield f
            return
        if name not in self.fds:
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(self.dir / name))
        with os.fdopen(os.dup(self.fds[name]), "rb") as f:  # one reader at a time: the shared offset is ours
            f.seek(0)
            yield f

    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Any:
        if "r" not in mode or "+" in mode:
            raise PermissionError(errno.EACCES, "a checkpoint being read is never written", str(path))
        return self.open(os.path.relpath(path, self.dir))

    def concat_path(self, path: str | os.PathLike[str], suffix: str) -> Path:
        return Path(path) / suffix

    def init_path(self, path: str | os.PathLike[str]) -> Path:
        return Path(path)

    def reader(self) -> Any:
        """A :class:`moonrt.comm.state.dcp.SafeReader` of the directory reading through these files."""
        from moonrt.comm.state.dcp import SafeReader

        reader = SafeReader(self.dir)
        reader.fs = self
        return reader

    def pin(self) -> dict[str, Any]:
        """Open the marker, the ``.metadata`` and every file they name, once; returns the marker
        (:func:`read_marker`'s checks). :class:`CheckpointError` saying the step was rotated away where it was
        removed before everything was open (a file missing for another reason is left to :func:`_problems`)."""
        self.fds = {}
        self._add(MARKER)
        if MARKER not in self.fds:
            raise self._rotated()
        with self.open(MARKER) as f:
            marker = _parse_marker(self.dir, _read_marker_file(self.dir, f))
        names = {METADATA, *marker.get("files", {})}
        self._add(METADATA)
        with contextlib.suppress(Exception):  # an unreadable or unsafe index: _problems names it
            names |= {info.relative_path for info in self.reader().read_metadata().storage_data.values()}
        _room_for(len(names))
        for name in sorted(names - set(self.fds)):
            self._add(name)
        if names - set(self.fds) and self._gone():
            raise self._rotated()
        return marker

    def _add(self, name: str) -> None:
        try:  # O_NONBLOCK: a FIFO planted under a file's name is not waited on (and not taken: not regular)
            fd = os.open(self.dir / name, os.O_RDONLY | os.O_NONBLOCK)
        except (FileNotFoundError, NotADirectoryError):
            return
        except OSError as exc:
            if exc.errno == errno.EMFILE:
                raise CheckpointError(f"checkpoint {str(self.dir)!r}: too many files to read at once for the "
                                      f"open-file limit (ulimit -n) {_nofile()[0]}; raise it") from None
            raise
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            return
        assert self.fds is not None
        self.fds[name] = fd

    def _gone(self) -> bool:
        """Whether the directory no longer holds the marker that was pinned (removed, or replaced by another save)."""
        assert self.fds is not None
        try:
            now = os.stat(self.dir / MARKER)
        except OSError:
            return True
        mine = os.fstat(self.fds[MARKER])
        return (now.st_dev, now.st_ino) != (mine.st_dev, mine.st_ino)

    def _rotated(self) -> CheckpointError:
        return _rotated(self.dir)

    def close(self) -> None:
        for fd in (self.fds or {}).values():
            os.close(fd)
        self.fds = None


def _rotated(step_dir: Path) -> CheckpointError:
    m = STEP_DIR.match(step_dir.name)
    what = f"step {int(m.group(1))}" if m else "the checkpoint"
    return CheckpointError(f"checkpoint {str(step_dir)!r}: {what} was rotated away while it was being read (the "
                           "running job removed it after committing a newer step); run the command again: it reads "
                           "the newest committed step")


def _nofile() -> tuple[int, int]:
    import resource

    return resource.getrlimit(resource.RLIMIT_NOFILE)


def _room_for(n: int) -> None:
    """Raise this process's open-file limit (soft, up to the hard one) to hold ``n`` more descriptors."""
    import resource

    soft, hard = _nofile()
    want = n + 256  # what the process holds besides
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want if hard == resource.RLIM_INFINITY else min(want, hard),
                                                    hard))


@contextlib.contextmanager
def _pinned(step_dir: Path) -> Iterator[tuple[_Files, dict[str, Any]]]:
    """The files of ``step_dir`` pinned (:meth:`_Files.pin`) and its marker, for a read by one process of a
    checkpoint a running job may rotate away (``export``, ``convert``, ``info --verify``)."""
    files = _Files(step_dir)
    try:
        yield files, files.pin()
    finally:
        files.close()


def _problems(files: _Files, marker: dict[str, Any], part: tuple[int, int] = (0, 1)) -> list[str]:
    """What makes a committed checkpoint unreadable, each naming the file: the ``.metadata`` missing, damaged
    (CRC-32) or not a safe DCP index (an entry stored outside the directory, a pickled object), a data file
    missing, shorter than the entries DCP stored in it, or (markers with ``files``) not of its recorded size
    and CRC-32. ``part = (i, n)``: this caller sums data files ``i, i + n, ...`` only (the ranks of a load
    share the reading); the cheap checks run everywhere."""
    sums = marker.get("files")
    if files.size(METADATA) is None:
        return [f"file {METADATA} is missing (DCP's index of the tensors)"]
    try:  # first: a hostile index is named as such (refused before anything of it runs)
        md = files.reader().read_metadata()
    except Exception as exc:  # a truncated or hand-made pickle: EOFError, UnpicklingError, ValueError, ...
        return [f"file {METADATA} is refused or unreadable ({_reason(exc)}): truncated, damaged or not written "
                "by moonrt"]
    if sums is not None and (bad := _mismatch(files, METADATA, sums[METADATA])):
        return [bad]
    out: list[str] = []
    sizes: dict[str, int | None] = {}
    for index, info in md.storage_data.items():
        rel = info.relative_path
        if rel not in sizes:
            sizes[rel] = files.size(rel)
            if sizes[rel] is None:
                out.append(f"file {rel} is missing (it holds entry {index.fqn!r})")
        size = sizes[rel]
        if size is not None and info.offset + info.length > size:
            out.append(f"file {rel} is truncated: {size:,} bytes, entry {index.fqn!r} ends at byte "
                       f"{info.offset + info.length:,}")
            sizes[rel] = None  # one line per file
    if sums is not None:
        data = [n for n in sorted(sums) if n != METADATA]
        for name in data[part[0]::part[1]]:
            if bad := _mismatch(files, name, sums[name]):
                out.append(bad)
    return out


def _mismatch(files: _Files, name: str, want: dict[str, Any]) -> str | None:
    if files.size(name) is None:
        return f"file {name} is missing ({MARKER} records {want['bytes']:,} bytes)"
    with files.open(name) as f:
        got = file_sum(f)
    if got["bytes"] != want["bytes"]:
        return (f"file {name} has {got['bytes']:,} bytes, {MARKER} records {want['bytes']:,}: truncated or "
                "damaged")
    if got["crc32"] != want["crc32"]:
        return (f"file {name} is damaged: CRC-32 {got['crc32']}, {MARKER} records {want['crc32']} (a changed "
                "byte: bit rot, a bad disk or an edit)")
    return None


def verify(step_dir: str | Path) -> int | None:
    """Check every file of a committed checkpoint (:func:`_problems`, one process, the files pinned); returns how
    many files were checked against their CRC-32, or None for a marker written before checksums (sizes and the
    index checked only). :class:`CheckpointError` naming the first bad file."""
    step_dir = resolve(step_dir)
    with _pinned(step_dir) as (files, marker):
        bad = _problems(files, marker)
    if bad:
        raise CheckpointError(f"checkpoint {str(step_dir)!r}: {bad[0]}")
    return len(marker["files"]) if "files" in marker else None


def _check(step_dir: Path, marker: dict[str, Any], multi: bool, group: Any = None) -> None:
    """:func:`_problems` before a load; ``multi``: the data files shared among the ranks of the job (collective:
    every rank raises the same first problem; the verdicts gathered over ``group``, the job's CPU group)."""
    part = (dist.get_rank(), dist.get_world_size()) if multi else (0, 1)
    mine = _problems(_Files(step_dir), marker, part)
    rows: list[Any] = [None] * part[1] if multi else [mine]
    if multi:
        dist.all_gather_object(rows, mine, group=group)
    bad = [p for r in rows for p in r]
    if bad:
        raise CheckpointError(f"checkpoint {str(step_dir)!r}: {bad[0]}")


def _config_groups(marker: dict[str, Any], model: torch.nn.Module, builder: JobBuilder | None
                   ) -> list[dict[str, Any]] | None:
    """The param-group hyperparameters (JSON form) the marker's own job config builds over ``model`` (``builder``:
    the job layer's), or None where this moonrt does not build that config or no builder was given."""
    if builder is None:
        return None
    try:
        opt = builder.optimizer(model, builder.read(marker["config"]))
    except (ValueError, TypeError, KeyError):  # ConfigError: a config this moonrt does not build
        return None
    return [{k: _jsonable(v) for k, v in g.items() if k != "params"} for g in opt.param_groups]


def _group_changes(marker: dict[str, Any], model: torch.nn.Module, opt: torch.optim.Optimizer,
                   builder: JobBuilder | None) -> list[str]:
    """``param_groups[i].key: checkpoint A, now B`` for every hyperparameter the marker records (the schedule's
    :data:`SCHEDULED` aside) that differs from ``opt``'s (the job's config built it), unless the marker's own
    config builds the recorded value: then the job changed the config field and ``check_resume`` accepted it."""
    saved, out = marker["param_groups"], []
    own: list[dict[str, Any]] | None | bool = False  # built once, on the first difference
    for i, (group, old) in enumerate(zip(opt.param_groups, saved)):
        for key in sorted(set(old) & set(group) - {"params", *SCHEDULED}):
            now = _jsonable(group[key])
            if old[key] == now:
                continue
            if own is False:
                own = _config_groups(marker, model, builder)
            if own is not None and len(own) == len(saved) and own[i].get(key) == old[key]:
                continue
            out.append(f"param_groups[{i}].{key}: checkpoint {old[key]!r}, now {now!r}")
    return out


def load_sharded(step_dir: Path, model: torch.nn.Module, opt: torch.optim.Optimizer,
                 rt: Parallelism | None = None, builder: JobBuilder | None = None) -> int:
    """Load a committed checkpoint into this rank's model and optimizer, whatever layout wrote it; returns its
    step. Collective in a multi-rank job. :class:`CheckpointError` when it does not fit the model, or when the
    optimizer hyperparameters the marker records differ from ``opt``'s and its own config's
    (:func:`_group_changes`; ``builder``: the job layer's, which builds the marker's own config -- without one only
    ``opt``'s values are accepted); else ``opt``'s param groups get the marker's values."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from moonrt.comm.state.dcp import SafeReader, ShardLoadPlanner

    rt = rt or Parallelism()
    step_dir = resolve(step_dir)
    marker = read_marker(step_dir)
    groups = marker["param_groups"]
    if len(groups) != len(opt.param_groups):
        raise CheckpointError(f"checkpoint {str(step_dir)!r}: {len(groups)} optimizer param groups; this optimizer "
                              f"has {len(opt.param_groups)} (another optimizer?)")
    if changes := _group_changes(marker, model, opt, builder):  # the same on every rank: refused before any collective
        raise CheckpointError(f"--resume: the job differs from the checkpoint's (step {marker['step']}) in "
                              f"{'; '.join(changes)} (the optimizer param groups of {str(step_dir / MARKER)!r}). "
                              "Resume with the same settings")
    _check(step_dir, marker, _multi(), rt.cpu_group)
    state = rt.sharded_state_dict(model, opt, save=False)
    try:
        with _quiet(_multi()):
            dcp.load(state, storage_reader=SafeReader(step_dir), planner=ShardLoadPlanner(),
                     process_group=rt.cpu_group, no_dist=not _multi())
    except (Exception, CheckpointException) as exc:
        raise CheckpointError(f"checkpoint {str(step_dir)!r}: does not fit this model and optimizer: "
                              f"{_reason(exc)}") from None
    rt.load_sharded_state_dict(model, opt, state)
    for group, saved in zip(opt.param_groups, groups):  # restored, as optimizer.load_state_dict does
        group.update(_hyper(saved))
    if rt.is_main:
        _warn_unverified(step_dir, marker)
    return int(marker["step"])


def read_full(step_dir: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Every entry of a checkpoint whole (single-process shapes, moments flat) and its marker; one process,
    no process group needed (the caller's memory holds the whole state: a tool for models that fit)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from moonrt.comm.state.dcp import ShardLoadPlanner

    step_dir = resolve(step_dir)
    with _pinned(step_dir) as (files, marker):  # a running job may rotate the step away: read what was pinned
        if bad := _problems(files, marker):
            raise CheckpointError(f"checkpoint {str(step_dir)!r}: {bad[0]}")
        try:
            md = files.reader().read_metadata()
            bad = [k for k, m in md.state_dict_metadata.items() if not isinstance(m, TensorStorageMetadata)]
            if bad:
                raise ValueError(f"entry {bad[0]!r} is a pickled object, expected a tensor")
            out = {k: torch.empty(m.size, dtype=m.properties.dtype, device="cpu")  # the file's state, on the host
                   for k, m in md.state_dict_metadata.items()}
            with _quiet(False):
                dcp.load(out, storage_reader=files.reader(), planner=ShardLoadPlanner(), no_dist=True)
        except (Exception, CheckpointException) as exc:
            raise CheckpointError(f"checkpoint {str(step_dir)!r}: unreadable: {_reason(exc)}") from None
    _warn_unverified(step_dir, marker)
    return out, marker


def to_single_file(step_dir: str | Path, builder: JobBuilder) -> dict[str, Any]:
    """The checkpoint in the gathered ``checkpoint.pt`` format: ``{"model", "optimizer", "step", "config"}``
    with torch's ``optimizer.state_dict()`` numbering (the job's model and optimizer rebuilt on the meta
    device by ``builder``, the job layer's, give the single-process parameter order and param groups): AdamW
    parameters with step > 0 get ``{step, exp_avg, exp_avg_sq}``, Muon parameters with step > 0
    ``{momentum_buffer}`` (as :class:`moonrt.ops.muon.Muon` and the gathered path hold them), the others no state."""
    from moonrt.comm.state.shards import MOMENTS, MOMENTUM

    flat, marker = read_full(step_dir)
    try:
        job = builder.read(marker["config"])
        with torch.device("meta"):
            model = builder.model(job)
        opt = builder.optimizer(model, job)
    except ValueError as exc:  # ConfigError: a config this moonrt does not build
        raise CheckpointError(f"checkpoint {str(step_dir)!r}: {MARKER} config: {exc}") from None
    name_of = {id(p): n for n, p in model.named_parameters()}
    try:
        model_sd = {k: flat[f"model.{k}"] for k in model.state_dict()}
        state, groups, i = {}, [], 0
        for group, saved in zip(opt.param_groups, marker["param_groups"], strict=True):
            ids = []
            for p in group["params"]:
                n = name_of[id(p)]
                step = float(flat[f"optimizer.{n}.step"])
                if step > 0 and group.get("use_muon", False):  # Muon: the buffer, no step count
                    state[i] = {MOMENTUM: flat[f"optimizer.{n}.{MOMENTUM}"].view(p.shape)}
                elif step > 0:
                    state[i] = {"step": step_count(step)} | {
                        k: flat[f"optimizer.{n}.{k}"].view(p.shape) for k in MOMENTS}
                ids.append(i)
                i += 1
            own = {k: _jsonable(v) for k, v in group.items() if k != "params"}
            if bad := next((k for k in sorted(set(saved) & set(own) - set(SCHEDULED)) if saved[k] != own[k]), None):
                raise CheckpointError(f"checkpoint {str(step_dir)!r}: {MARKER} param_groups[{len(groups)}].{bad} = "
                                      f"{saved[bad]!r}, but its job config builds {own[bad]!r}: an edited marker")
            groups.append({**_hyper(saved), "params": ids})
    except CheckpointError:
        raise
    except (KeyError, ValueError, RuntimeError) as exc:
        raise CheckpointError(f"checkpoint {str(step_dir)!r}: does not match its own config's model: "
                              f"{_reason(exc)}") from None
    return {"model": model_sd, "optimizer": {"state": state, "param_groups": groups}, "step": marker["step"],
            "config": marker["config"]}






__all__ = ["FORMAT", "MARKER", "MARKER_SUM", "METADATA", "ROOT", "SCHEDULED", "STEP_DIR", "TMP_DIR", "PendingSave",
           "committed_steps", "file_sum", "load_sharded", "marker_sum", "read_full", "read_marker", "resolve", "retain",
           "save_sharded", "start_save", "to_single_file", "use_sharded", "verified", "verify"]
