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
- **Metrics**: every line is strict JSON (:func:`json_line`: non-finite numbers as ``null``). A new metrics file
  is created exclusively; on resume an existing one is trimmed to the records up to the checkpoint's step by an
  atomic replace, so after a kill and resume every step appears exactly once, but only when it is a moonrt
  metrics file (:func:`check_metrics`: every line a step record, steps increasing, only the last line possibly
  cut by a kill); any other file is refused and left untouched.
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
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from moonrt.config import ConfigError

LOCK = ".moonrt.lock"
_PID = re.compile(r"^\d{0,10}\n?$")
METRICS_KEYS = ("step", "loss", "lr", "tokens_per_s", "tokens")
"""Keys every record of a moonrt metrics file holds (:func:`check_metrics`)."""


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
        os.chmod(tmp, 0o666 & ~_umask())  # what a plain open() would have made (mkstemp makes 0600)
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


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


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


def _metrics_records(path: str) -> Iterator[dict[str, Any]]:
    """The records of the existing moonrt metrics file ``path``, read one line at a time; :class:`ConfigError`
    (raised while iterating, the file untouched) at the first line that shows it is not one (see
    :func:`check_metrics`)."""
    what = f"--metrics = {path!r}"
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
                                      f"(expected JSON with {', '.join(METRICS_KEYS)}, steps increasing); refusing to "
                                      "trim a file that is not this run's metrics: expected a new path or this run's "
                                      "metrics file")
                last = record["step"]
                yield record
    except OSError as exc:
        raise ConfigError(f"{what}: unreadable ({_reason(exc)})") from None


def check_metrics(path: str) -> bool:
    """Whether a metrics file exists at ``path``; :class:`ConfigError` (the file untouched) unless it is a moonrt
    metrics file: a regular file (not a link), every line a JSON step record (:data:`METRICS_KEYS`) with steps
    increasing, except that the last line may be cut by a kill."""
    if not os.path.lexists(path):
        return False
    for _ in _metrics_records(path):
        pass
    return True


class MetricsFile:
    """The open metrics file of a run; :meth:`write` appends one :func:`json_line` and flushes it. A failed write
    (a full disk) is a :class:`ConfigError` naming the file; its cut line is dropped on resume."""

    def __init__(self, path: str, f: IO[str]) -> None:
        self.path, self.f = path, f

    def write(self, record: dict[str, Any]) -> None:
        try:
            self.f.write(json_line(record))
            self.f.flush()
        except OSError as exc:
            raise ConfigError(f"--metrics = {self.path!r}: write failed ({_reason(exc)})") from None

    def close(self) -> None:
        with contextlib.suppress(OSError):  # a failed write was reported already
            self.f.close()


def open_metrics(path: str, resume_step: int | None) -> MetricsFile:
    """The metrics file to append to: new (exclusive), or on resume an existing one trimmed to the records of
    steps ``<= resume_step`` (atomically: a trimmed copy replaces it; only a moonrt metrics file,
    :func:`check_metrics`; a cut last line is dropped), so no step appears twice after a kill."""
    what = f"--metrics = {path!r}"
    try:
        if resume_step is None or not os.path.lexists(path):
            return MetricsFile(path, open(path, "x"))  # noqa: SIM115
        mode = stat.S_IMODE(os.stat(path).st_mode)
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", dir=os.path.dirname(os.path.abspath(path)))
        f = os.fdopen(fd, "w")
        try:
            for record in _metrics_records(path):
                if record["step"] <= resume_step:
                    f.write(json_line(record))
            f.flush()
            os.fsync(f.fileno())
            os.chmod(tmp, mode)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):  # closing flushes the buffer: fails again on a full disk
                f.close()
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return MetricsFile(path, f)  # the trimmed copy, now at path: appended to
    except FileExistsError:
        raise ConfigError(f"{what}: file exists; expected a new path (or --resume to continue the run that wrote "
                          "it)") from None
    except OSError as exc:
        raise ConfigError(f"{what}: cannot write ({_reason(exc)})") from None
