"""Files a training run writes besides checkpoints: the run lock, ``config.yaml``, the metrics JSON-lines file,
and output-directory probes.

Safe by default (nothing a user owns is overwritten, nothing is written through a planted link):

- **One run per output directory**: rank 0 holds an exclusive ``flock`` on ``OUT/.moonrt.lock`` for the whole
  run (:func:`lock_out_dir`; opened without following links and never truncated before the lock is held; the
  holder's pid is written into it). The kernel releases it when the process dies, so a requeued job takes it
  again; a second run into the same directory fails at once, naming the directory and the holder.
- **Whole files or none**: a file is written to a new temp file (``mkstemp``: unpredictable name, created
  exclusively) in its directory, fsynced, then renamed over the target (:func:`write_file`), or, where the
  target must not exist yet, hard-linked to it (exclusive creation of a complete file). A failure (a full disk,
  a read-only directory) removes the temp file and is one :class:`moonrt.config.ConfigError` naming the file.
- **Run identity** (:func:`run_identity`): a random id created at a run's first start in ``OUT/run_id`` and kept
  across resumes and restarts; every metrics record carries it (``run_id``), and the TensorBoard directory a run
  writes holds it in its marker (``DIR/.moonrt-run``). What a resume continues is only what carries this id.
- **Metrics**: every line is strict JSON (:func:`json_line`: non-finite numbers as ``null``). A new metrics file
  is created exclusively; on resume an existing one is trimmed to the records up to the checkpoint's step by an
  atomic replace, so after a kill and resume every step appears exactly once, but only when it is this run's
  metrics file (:func:`check_metrics`: every line a step record of this run's ``run_id``, steps increasing, only
  the last line possibly cut by a kill); any other file, another run's moonrt metrics included, is refused and
  left untouched.
- **TensorBoard** (``--tensorboard DIR``, :func:`check_tensorboard_dir`): a fresh run takes a new or empty
  directory (it creates it) and marks it with its run id (:func:`mark_tensorboard_dir`); a resume (or a restart of
  this job) an empty one or one marked with this run's id holding only TensorBoard event files; anything else is
  refused, nothing in it touched. Event files are new files per process (time, host, pid).
- **config.yaml** (:func:`config_bytes`): the job config a run records, first line :data:`CONFIG_HEADER`. A
  ``config.yaml`` moonrt wrote is replaced whole on resume; one it did not write (the user's own, e.g. ``moonrt
  train --config D/config.yaml --out D``, comments and all) is never replaced, only compared
  (:func:`check_user_config`): it must be this job's config, else the run is refused before step 1.
- **Whose directory** (:func:`check_outputs`, before step 1): a fresh run refuses a checkpoint, a ``config.yaml``
  that is not its job's, an existing metrics file or routing trace; an interrupted first sharded save
  (``checkpoint/`` without a committed step) counts as no checkpoint when ``config.yaml`` is this job's
  (:func:`has_checkpoint`), so a requeued job starts again instead of being stuck.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import math
import os
import re
import stat
import tempfile
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import IO, Any

import yaml

from moonrt.config import YAML_MAX_BYTES, ConfigError, from_dict, load_yaml, parse_yaml, to_dict, umask
from moonrt.jobs.checkpoint import sharded as checkpoint_dcp
from moonrt.jobs.checkpoint.single import CheckpointError
from moonrt.jobs.train.config import JobConfig
from moonrt.jobs.train.resume import FREE_ON_RESUME
from moonrt.scheduler.workload import open_trace

CHECKPOINT = "checkpoint.pt"
"""A run's single-file checkpoint in its output directory (the sharded one: ``checkpoint_dcp.ROOT``)."""
CONFIG = "config.yaml"
"""The job config a run writes into its output directory."""
CONFIG_HEADER = ("# moonrt train: the job config of the run in this directory, written by moonrt (replaced on resume; "
                 "a config.yaml without this line is never replaced)\n")
"""First line of every ``config.yaml`` moonrt writes: what tells moonrt's record from a user's file."""
LOCK = ".moonrt.lock"
_PID = re.compile(r"^\d{0,10}\n?$")
RUN_ID = "run_id"
"""The file in ``OUT`` holding the run's identity (:func:`run_identity`), and the metrics records' key for it."""
_RUN_ID = re.compile(r"^[0-9a-f]{32}\n?$")
METRICS_KEYS = ("step", "loss", "lr", "tokens_per_s", "tokens")
"""Keys every record of a moonrt metrics file holds (:func:`check_metrics`), besides :data:`RUN_ID`."""
TB_EVENTS = "events.out.tfevents."
"""Name prefix of TensorBoard event files (with :data:`TB_MARKER`, the only entries a resumed run's
``--tensorboard`` directory may hold)."""
TB_MARKER = ".moonrt-run"
"""The marker of a run's TensorBoard directory: the run's id (:func:`mark_tensorboard_dir`)."""


def _reason(exc: OSError) -> str:
    return exc.strerror or str(exc)


def probe_dir(directory: Path, what: str) -> None:
    """Create ``directory`` if needed and check that a new file can be created in it (before step 1)."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".moonrt-probe", dir=directory)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise ConfigError(f"{what} = {str(directory)!r}: expected a writable directory ({_reason(exc)})") from None


# ---- the run lock --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def lock_out_dir(out: Path, create: bool = True) -> Iterator[None]:
    """Hold an exclusive lock on output directory ``out`` (``out/.moonrt.lock``) while in the block.

    ``create``: make ``out`` if it is missing (else a missing ``out`` is left missing and nothing is locked: a
    resume of it fails on its own). :class:`ConfigError` naming ``out`` when another process holds the lock
    (with its pid), or the lock file is not a moonrt lock file (a symlink, a hard link, other content). The
    lock file is removed on leaving the block (while still locked: a process that opened the old file sees that
    it no longer is ``out/.moonrt.lock`` and opens the new one); after a kill it stays, unlocked.
    """
    what = f"out_dir (--out) = {str(out)!r}"
    if not create and not out.is_dir():
        yield
        return
    path = out / LOCK
    fd = -1
    try:
        out.mkdir(parents=True, exist_ok=True)
        for _ in range(100):  # retried only when a finishing run removed the file between our open and flock
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1 or st.st_size > 64:
                raise ConfigError(f"{what}: {str(path)!r} is not a moonrt lock file (a link or another file); "
                                  "expected it absent or written by moonrt train")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 64, 0).decode(errors="replace").strip()
                by = f" (pid {holder})" if holder.isdigit() else ""
                raise ConfigError(f"{what}: another run is writing into this directory{by}; expected one run per "
                                  "--out (wait for it to finish, or use another --out)") from None
            try:
                same = os.stat(path, follow_symlinks=False).st_ino == st.st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
            fd = -1
        else:
            raise ConfigError(f"{what}: could not take the lock {str(path)!r} (it keeps being replaced)")
        if not _PID.match(os.pread(fd, 64, 0).decode(errors="replace")):
            raise ConfigError(f"{what}: {str(path)!r} is not a moonrt lock file (unexpected content); expected it "
                              "absent or written by moonrt train")
        os.ftruncate(fd, 0)  # ours now: the holder's pid for the message of a second run
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except OSError as exc:
        if fd >= 0:
            os.close(fd)
        if exc.errno == errno.ELOOP:
            raise ConfigError(f"{what}: {str(path)!r} is a symbolic link; expected it absent or a moonrt lock "
                              "file") from None
        raise ConfigError(f"{what}: expected a writable directory ({_reason(exc)})") from None
    except BaseException:
        if fd >= 0:
            os.close(fd)
        raise
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            if os.stat(path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino:
                os.unlink(path)
        os.close(fd)


# ---- the run's identity ---------------------------------------------------------------------------------------


def _read_id(path: Path, what: str) -> str | None:
    """The run id in ``path`` (None: no such file); :class:`ConfigError` naming ``what`` when it is not a run id
    file moonrt wrote (a link, not a regular file, other content). Reads at most 64 bytes, never follows a link."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        why = "a symbolic link" if exc.errno == errno.ELOOP else f"unreadable ({_reason(exc)})"
        raise ConfigError(f"{what}: {str(path)!r} is {why}; expected a run id written by moonrt train") from None
    try:
        regular = stat.S_ISREG(os.fstat(fd).st_mode)
        text = os.read(fd, 64).decode(errors="replace") if regular else ""
    finally:
        os.close(fd)
    if not _RUN_ID.match(text):
        raise ConfigError(f"{what}: {str(path)!r} is not a run id written by moonrt train (expected 32 hex digits)")
    return text.strip()


def read_run_id(out: Path) -> str | None:
    """The identity of the run in ``out`` (``OUT/run_id``), or None when no run started there yet (or one started by
    a moonrt that kept none)."""
    return _read_id(Path(out) / RUN_ID, f"out_dir (--out) = {str(out)!r}")


def run_identity(out: Path) -> str:
    """The identity of the run in ``out``: the id in ``OUT/run_id``, created (a random 128-bit hex id, exclusively)
    at the run's first start and kept by every resume and restart of it."""
    found = read_run_id(out)
    if found is not None:
        return found
    new = uuid.uuid4().hex
    write_file(Path(out) / RUN_ID, f"{new}\n".encode(), "out_dir (--out)", exclusive=True)
    return new


# ---- whole files ---------------------------------------------------------------------------------------------


def write_file(path: Path, data: bytes, what: str, exclusive: bool = False) -> None:
    """Write ``data`` to ``path`` as a whole: a ``mkstemp`` temp file beside it, fsync, then rename over ``path``
    (``exclusive``: hard-link to ``path``, which fails if anything is there, a dangling symlink included).
    Never writes through a link; on failure no temp file is left and :class:`ConfigError` names ``what``
    (e.g. ``"out_dir (--out)"``) and the file."""
    path = Path(path)
    tmp: str | None = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~umask())  # what a plain open() would have made (mkstemp makes 0600)
        if exclusive:
            try:
                os.link(tmp, path)
            except FileExistsError:
                raise ConfigError(f"{what}: {str(path)!r} exists; expected a new file") from None
        else:
            os.replace(tmp, path)
            tmp = None
    except OSError as exc:
        raise ConfigError(f"{what}: cannot write {str(path)!r} ({_reason(exc)})") from None
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


# ---- metrics -------------------------------------------------------------------------------------------------


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def json_line(record: dict[str, Any]) -> str:
    """One metrics line: strict JSON (non-finite numbers as ``null``; never a bare ``NaN``), newline-terminated."""
    return json.dumps(_finite(record), allow_nan=False) + "\n"


_MAX_LINE = 1 << 20  # bytes: a longer line is not a metrics record


def _metrics_records(path: str, run_id: str | None) -> Iterator[dict[str, Any]]:
    """The records of the existing metrics file ``path`` of run ``run_id``, read one line at a time;
    :class:`ConfigError` (raised while iterating, the file untouched) at the first line that shows it is not one
    (see :func:`check_metrics`)."""
    what = f"--metrics = {path!r}"
    keep = "refusing to trim a file that is not this run's metrics: expected a new path or this run's metrics file"
    try:
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode) or not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{what}: not a regular file (a link?); expected the metrics file of this run or a "
                              "new path")
        with open(path, "rb") as f:
            last, cut = 0, 0  # the last record's step; the number of an unparseable line (allowed last only)
            for i, line in enumerate(iter(lambda: f.readline(_MAX_LINE), b""), 1):
                record = None
                if not cut and (len(line) < _MAX_LINE or line.endswith(b"\n")):
                    try:
                        record = json.loads(line)
                    except ValueError:  # also UnicodeDecodeError
                        cut = i  # a line cut by a kill, if no other follows
                        continue
                if not (isinstance(record, dict) and all(k in record for k in METRICS_KEYS)
                        and type(record["step"]) is int and record["step"] > last):
                    raise ConfigError(f"{what}: line {cut or i} is not a metrics record of a moonrt train run "
                                      f"(expected JSON with {', '.join(METRICS_KEYS)}, steps increasing); {keep}")
                if record.get(RUN_ID) != run_id or run_id is None:
                    theirs = record.get(RUN_ID)
                    whose = (f"a record of another run ({RUN_ID} {theirs!r})" if isinstance(theirs, str) else
                             f"a record without a {RUN_ID}, not one of this run")
                    mine = f"this run's is {run_id!r}" if run_id else f"this run has none: no {RUN_ID} in --out"
                    raise ConfigError(f"{what}: line {i} is {whose}; {mine}; {keep}")
                last = record["step"]
                yield record
    except OSError as exc:
        raise ConfigError(f"{what}: unreadable ({_reason(exc)})") from None


def check_metrics(path: str, run_id: str | None) -> bool:
    """Whether a metrics file exists at ``path``; :class:`ConfigError` (the file untouched) unless it is the metrics
    file of run ``run_id`` (:func:`read_run_id`; None: the run has no identity, so no file is its): a regular file
    (not a link), every line a JSON step record (:data:`METRICS_KEYS`) carrying ``run_id`` with steps increasing,
    except that the last line may be cut by a kill."""
    if not os.path.lexists(path):
        return False
    for _ in _metrics_records(path, run_id):
        pass
    return True


class MetricsFile:
    """The open metrics file of run ``run_id``; :meth:`write` appends one :func:`json_line` of the record and the run
    id (:data:`RUN_ID`) and flushes it. A failed write (a full disk) is a :class:`ConfigError` naming the file; its
    cut line is dropped on resume."""

    def __init__(self, path: str, f: IO[str], run_id: str) -> None:
        self.path, self.f, self.run_id = path, f, run_id

    def write(self, record: dict[str, Any]) -> None:
        try:
            self.f.write(json_line(record | {RUN_ID: self.run_id}))
            self.f.flush()
        except OSError as exc:
            raise ConfigError(f"--metrics = {self.path!r}: write failed ({_reason(exc)})") from None

    def close(self) -> None:
        with contextlib.suppress(OSError):  # a failed write was reported already
            self.f.close()


def open_metrics(path: str, resume_step: int | None, run_id: str) -> MetricsFile:
    """The metrics file of run ``run_id`` to append to: new (exclusive), or on resume an existing one trimmed to the
    records of steps ``<= resume_step`` (atomically: a trimmed copy with the same mode replaces it; only this run's
    metrics file, :func:`check_metrics`; a cut last line is dropped), so no step appears twice after a kill."""
    what = f"--metrics = {path!r}"
    try:
        if resume_step is None or not os.path.lexists(path):
            return MetricsFile(path, open(path, "x"), run_id)  # noqa: SIM115
        mode = stat.S_IMODE(os.stat(path).st_mode)
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", dir=os.path.dirname(os.path.abspath(path)))
        f = os.fdopen(fd, "w")
        try:
            for record in _metrics_records(path, run_id):
                if record["step"] <= resume_step:
                    f.write(json_line(record))
            f.flush()
            os.fsync(f.fileno())
            os.fchmod(f.fileno(), mode)  # the file's own mode (mkstemp makes 0600), set on the descriptor
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):  # closing flushes the buffer: fails again on a full disk
                f.close()
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return MetricsFile(path, f, run_id)  # the trimmed copy, now at path: appended to
    except FileExistsError:
        raise ConfigError(f"{what}: file exists; expected a new path (or --resume to continue the run that wrote "
                          "it)") from None
    except OSError as exc:
        raise ConfigError(f"{what}: cannot write ({_reason(exc)})") from None


# ---- which outputs a run may write -----------------------------------------------------------------------------


def has_checkpoint(out: Path) -> bool:
    """Whether ``out`` holds a checkpoint ``--resume-if-exists`` continues: ``checkpoint.pt``, or a committed step
    of the sharded ``checkpoint/``. An interrupted first sharded save (``checkpoint/step-N.tmp`` only) is none:
    the job starts fresh if ``out`` is its own (:func:`check_outputs`), and its first commit removes the stale
    ``.tmp``."""
    if (out / CHECKPOINT).exists():
        return True
    return _committed(out / checkpoint_dcp.ROOT)


def _committed(root: Path) -> bool:
    if not root.exists():
        return False
    try:
        checkpoint_dcp.resolve(root)
    except CheckpointError:
        return False
    return True


def _flat(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping) and value:
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _foreign_config(path: Path, job: JobConfig) -> str | None:
    """Why the existing ``path`` (``OUT/config.yaml``) is not this job's, or None when it is: a job config equal to
    ``job`` in every field but :data:`moonrt.jobs.train.resume.FREE_ON_RESUME`
    (where outputs go, layout, intervals)."""
    if path.is_symlink() or not path.is_file():
        return "a link or not a regular file"
    try:
        stored = _flat(to_dict(load_yaml(JobConfig, path)))
    except Exception:  # noqa: BLE001  (any file that does not read as a job config is not this job's)
        return "not a moonrt job config"
    new = _flat(to_dict(job))
    diffs = [f"{k}: {stored.get(k, '<absent>')!r} there, {new.get(k, '<absent>')!r} now"
             for k in sorted(set(stored) | set(new))
             if stored.get(k, "<absent>") != new.get(k, "<absent>")
             and not any(k == f or k.startswith(f + ".") for f in FREE_ON_RESUME)]
    return f"differs in {'; '.join(diffs)}" if diffs else None


# ---- config.yaml ---------------------------------------------------------------------------------------------
#
# A torchtitan user keeps the config file as the source of truth, and the trainer never writes to it. So a
# config.yaml in --out that moonrt did not write (``moonrt train --config D/config.yaml --out D``, comments and all)
# is never replaced: it is compared with the job instead, like a resume compares the checkpoint's config (every field
# but FREE_ON_RESUME). The same job: the file is left as it is (it is this run's record). Another job (a --set or a
# flag changed a field, e.g. --steps): refused before step 1 rather than writing a second, differing record beside it
# that a later resume or restart would have to choose between; the user changes the file, or passes --config from
# outside --out.


def config_bytes(job: JobConfig) -> bytes:
    """``OUT/config.yaml`` as a run writes it: :data:`CONFIG_HEADER`, then the job config as YAML."""
    return (CONFIG_HEADER + yaml.safe_dump(to_dict(job), sort_keys=False)).encode()


def written_by_moonrt(path: Path) -> bool:
    """Whether the existing file ``path`` is a ``config.yaml`` moonrt wrote: its first line is
    :data:`CONFIG_HEADER`, or (written before the header existed) it is exactly the YAML moonrt writes of the job
    config it holds. Anything else (comments, another order of keys, no job config at all) is a user's file. Reads
    at most :data:`YAML_MAX_BYTES` bytes."""
    try:
        with open(path, "rb") as f:
            raw = f.read(YAML_MAX_BYTES + 1)
    except OSError:
        return False
    if raw.startswith(CONFIG_HEADER.encode()):
        return True
    try:
        job = from_dict(JobConfig, parse_yaml(raw.decode(), str(path)))
    except Exception:  # noqa: BLE001  (a file that does not read as a job config is not moonrt's)
        return False
    return raw == yaml.safe_dump(to_dict(job), sort_keys=False).encode()


def check_user_config(out: Path, job: JobConfig) -> bool:
    """Whether ``OUT/config.yaml`` is a user's file (a regular file moonrt did not write, :func:`written_by_moonrt`)
    that this run leaves as it is; :class:`ConfigError` (before step 1, the file untouched) when it is not this job's
    config. False when there is none or moonrt wrote it (the run writes its own: :func:`write_config`)."""
    path = Path(out) / CONFIG
    if path.is_symlink() or not path.is_file() or written_by_moonrt(path):
        return False
    foreign = _foreign_config(path, job)
    if foreign is not None:
        raise ConfigError(f"out_dir (--out) = {str(out)!r}: holds a {CONFIG} that moonrt did not write (a user's file: "
                          f"never replaced) and that is not this job's ({foreign}); expected the same job config in it "
                          "(change the file, not a flag), or --config from outside --out, or another --out")
    return True


def write_config(out: Path, job: JobConfig, resume: bool) -> None:
    """Record ``job`` in ``OUT/config.yaml`` (:func:`config_bytes`): created exclusively by a fresh run, replaced
    whole when moonrt wrote the one there (a resume, a restart); a user's file is left as it is
    (:func:`check_user_config`)."""
    config = Path(out) / CONFIG
    if check_user_config(out, job):
        return
    write_file(config, config_bytes(job), "out_dir (--out)", exclusive=not (resume or config.exists()))


# ---- TensorBoard ---------------------------------------------------------------------------------------------


def mark_tensorboard_dir(directory: str, run_id: str) -> None:
    """Write the marker :data:`TB_MARKER` (the run id) into the TensorBoard directory ``directory`` of run
    ``run_id`` unless it holds one (checked: :func:`check_tensorboard_dir`)."""
    what = f"log.tensorboard (--tensorboard) = {directory!r}"
    if _read_id(Path(directory) / TB_MARKER, what) is None:
        write_file(Path(directory) / TB_MARKER, f"{run_id}\n".encode(), "log.tensorboard (--tensorboard)",
                   exclusive=True)


def check_tensorboard_dir(directory: str, continuing: bool, run_id: str | None = None) -> None:
    """Create (if missing) the TensorBoard directory ``directory`` of a run and check that it is the run's to
    write: an empty directory for a fresh run; when ``continuing`` (a resume, or a restart of this job) an empty
    one, or one marked with ``run_id`` (:data:`TB_MARKER`) holding only event files (:data:`TB_EVENTS`); never a
    link. :class:`ConfigError` naming the flag."""
    what = f"log.tensorboard (--tensorboard) = {directory!r}"
    path = Path(directory)
    try:
        if path.is_symlink() or (path.exists() and not path.is_dir()):
            raise ConfigError(f"{what}: not a directory (a link or a file); expected a new directory")
        path.mkdir(parents=True, exist_ok=True)
        entries = sorted(os.listdir(path))
    except OSError as exc:
        raise ConfigError(f"{what}: expected a writable directory ({_reason(exc)})") from None
    if continuing:
        other = [e for e in entries if e != TB_MARKER and not (e.startswith(TB_EVENTS) and (path / e).is_file()
                                                               and not (path / e).is_symlink())]
        if other:
            raise ConfigError(f"{what}: holds {other[0]!r}, not a TensorBoard event file; expected this run's "
                              "TensorBoard directory or a new one")
        marker = _read_id(path / TB_MARKER, what) if entries else run_id
        if marker is None or marker != run_id:
            whose = (f"holds no {TB_MARKER} marker" if marker is None else
                     f"is another run's ({RUN_ID} {marker!r} in its {TB_MARKER})")
            mine = f"this run's {RUN_ID} is {run_id!r}" if run_id else f"this run has no {RUN_ID} in --out"
            raise ConfigError(f"{what}: {whose}, so it is not this run's TensorBoard directory ({mine}); expected "
                              "this run's TensorBoard directory or a new one")
    elif entries:
        raise ConfigError(f"{what}: not empty (holds {entries[0]!r}); expected a new or empty directory (or --resume "
                          "to continue the run that wrote it)")
    probe_dir(path, "log.tensorboard (--tensorboard)")


def _same_file(a: str, b: str) -> bool:
    return os.path.abspath(a) == os.path.abspath(b)


def check_outputs(job: JobConfig, metrics_path: str | None, resume: bool, stored: Mapping[str, Any] | None,
                  requeued: bool) -> bool:
    """Fail before step 1 on outputs that cannot be written or would overwrite what is not this run's
    (``stored``: the job config of the checkpoint a resume continues); the main rank calls it. Returns whether
    this fresh start restarts this job in its own ``out_dir`` (``requeued`` and ``OUT/config.yaml`` is this job's:
    the run before was killed before its first checkpoint, and its metrics file is taken over from step 0)."""
    out = Path(job.out_dir)
    restart = False
    what = f"out_dir (--out) = {str(out)!r}"
    probe_dir(out, "out_dir (--out)")
    if not resume:
        root = out / checkpoint_dcp.ROOT
        for name in (CHECKPOINT, checkpoint_dcp.ROOT):
            if (out / name).exists() and (name == CHECKPOINT or _committed(root)):
                raise ConfigError(f"{what}: already holds {name} of another run; expected --resume to continue "
                                  "it, or a new --out")
        config = out / CONFIG
        foreign = _foreign_config(config, job) if config.exists() or config.is_symlink() else None
        if (root.exists() or root.is_symlink()) and (foreign is not None or not config.exists()):
            raise ConfigError(f"{what}: {str(root)!r} holds no committed checkpoint (an interrupted first save) of "
                              f"another run ({CONFIG}: {foreign or 'none'}); expected a new --out")
        if foreign is not None:
            raise ConfigError(f"{what}: holds a {CONFIG} that is not this job's ({foreign}); expected a new --out "
                              "(or the same job config to start that run again)")
        restart = requeued and config.exists()
    check_user_config(out, job)  # a user's config.yaml in --out: never replaced, so it must be this job's
    run_id = read_run_id(out)
    if metrics_path is not None:
        m = Path(metrics_path)
        if not metrics_path:
            raise ConfigError("--metrics = '': expected a file path")
        if m.is_dir():
            raise ConfigError(f"--metrics = {metrics_path!r}: is a directory; expected a file path")
        if not (resume or restart) and (m.exists() or m.is_symlink()):
            raise ConfigError(f"--metrics = {metrics_path!r}: file exists; expected a new path (or --resume to "
                              "continue the run that wrote it)")
        if resume or restart:
            check_metrics(metrics_path, run_id)  # only this run's metrics file is trimmed
        probe_dir(m.parent, "--metrics directory")
    if job.routing_trace is not None:
        t = Path(job.routing_trace)
        field = f"routing_trace (--routing-trace) = {job.routing_trace!r}"
        if not job.routing_trace:
            raise ConfigError(f"{field}: expected a .npz file path")
        if t.is_dir():
            raise ConfigError(f"{field}: is a directory; expected a .npz file path")
        if t.exists() or t.is_symlink():
            own = (resume and stored is not None and isinstance(stored.get("routing_trace"), str)
                   and _same_file(stored["routing_trace"], job.routing_trace) and not t.is_symlink())
            if own:
                try:
                    open_trace(t)
                except ValueError:
                    own = False
            if not own:
                raise ConfigError(f"{field}: file exists and is not this run's trace; expected a new path (or, with "
                                  "--resume, the trace this run wrote)")
        probe_dir(t.parent, "routing_trace (--routing-trace) directory")
    if job.log.tensorboard is not None:
        check_tensorboard_dir(job.log.tensorboard, resume or restart, run_id)
    return restart
