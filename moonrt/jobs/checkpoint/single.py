"""Checkpoint files of ``moonrt train``: safe loading, atomic writing, resume compatibility.

A checkpoint is one ``torch.save`` archive holding only tensors, dicts, lists and numbers::

    {"model": state_dict, "optimizer": state_dict, "step": int, "config": the job config as a dict}

- **Loading** always uses ``torch.load(..., weights_only=True)``: an archive that holds any other
  object (a pickled class whose ``__reduce__`` would run code) is refused before anything of it runs.
  An empty, truncated or foreign file is a :class:`CheckpointError` that names the file.
- **Writing** goes to a new temp file created exclusively in the same directory, then
  ``os.replace``: the previous checkpoint stays intact until the new one is complete, and the temp
  file is removed on any failure (a full disk, a signal).
- **Resume compatibility** (the job config stored in the checkpoint against the new one) is the train job's
  check: :func:`moonrt.jobs.train.resume.check_resume`.
"""

from __future__ import annotations

import contextlib
import errno
import os
import pickle
import re
import shutil
import tempfile
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, BinaryIO

import torch

from moonrt.cluster.preempt import raised_abort
from moonrt.config import umask

KEYS = ("model", "optimizer", "step", "config")

class CheckpointError(ValueError):
    """A checkpoint cannot be read, written or resumed; the message names the file and the reason."""


def load(path: str | Path) -> dict[str, Any]:
    """Read a checkpoint written by :func:`save` (``weights_only=True``), checked for its four keys."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {str(path)!r}: expected an existing file")
    size = path.stat().st_size
    if size == 0:
        raise CheckpointError(f"checkpoint {str(path)!r}: the file is empty (expected a torch.save archive)")
    if not zipfile.is_zipfile(path):
        raise CheckpointError(f"checkpoint {str(path)!r}: not a complete torch.save archive ({size:,} bytes, no zip "
                              "central directory: truncated, or another format)")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:  # torch's message would advise allow-listing the global: never that
        found = re.search(r"GLOBAL ([\w.]+)", str(exc))
        what = f" (it names {found.group(1)})" if found else ""
        raise CheckpointError(f"checkpoint {str(path)!r}: refused to load (weights_only=True): the file holds "
                              f"objects other than tensors and plain containers{what}; moonrt loads no such "
                              "file") from None
    except (RuntimeError, EOFError, OSError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise CheckpointError(f"checkpoint {str(path)!r}: unreadable: {first}") from None
    if not isinstance(state, dict) or not set(KEYS) <= set(state):
        found = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise CheckpointError(f"checkpoint {str(path)!r}: holds {found}; expected a dict with keys {list(KEYS)} "
                              "(a file written by moonrt train)")
    if not isinstance(state["step"], int) or state["step"] < 0:
        raise CheckpointError(f"checkpoint {str(path)!r}: step = {state['step']!r}; expected an integer >= 0")
    for key in ("model", "optimizer", "config"):
        if not isinstance(state[key], dict):
            raise CheckpointError(f"checkpoint {str(path)!r}: {key} is a {type(state[key]).__name__}; expected a "
                                  "dict (a file written by moonrt train)")
    bad = next((k for k, v in state["model"].items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)),
               None)
    if bad is not None:
        raise CheckpointError(f"checkpoint {str(path)!r}: model entry {bad!r} is a "
                              f"{type(state['model'][bad]).__name__}; expected a tensor")
    return state


class _Sink:
    """A write-only file wrapper for ``torch.save`` that keeps what interrupted a write: the OSError of a failed
    write (disk full, quota) or a ``BaseException`` raised in it (a signal handler's abort), which torch's zip
    writer would otherwise turn into a RuntimeError ("unexpected pos ...")."""

    def __init__(self, f: BinaryIO) -> None:
        self.f = f
        self.error: BaseException | None = None

    def write(self, data: bytes) -> int:
        try:
            return self.f.write(data)
        except BaseException as exc:
            self.error = exc
            raise

    def flush(self) -> None:
        self.f.flush()


def publish(tmp: str | Path, path: Path, exclusive: bool) -> None:
    """Move the complete file ``tmp`` to ``path``: ``os.replace`` (an existing ``path`` replaced atomically), or
    with ``exclusive`` a hard link that fails on an existing ``path`` (``FileExistsError``: nothing of ``path``
    touched), then ``tmp`` unlinked. A file system without hard links gets an ``open(path, "xb")`` copy."""
    if not exclusive:
        os.replace(tmp, path)
        return
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
            raise
        with open(tmp, "rb") as src, open(path, "xb") as dst:
            try:
                shutil.copyfileobj(src, dst, 1 << 22)
                dst.flush()
                os.fsync(dst.fileno())
            except BaseException:
                os.unlink(path)  # created by this open: ours
                raise
    os.unlink(tmp)


def save(path: str | Path, state: Mapping[str, Any], exclusive: bool = False) -> None:
    """Atomically write ``state`` to ``path``: exclusive temp file beside it, fsync, rename (:func:`publish`;
    ``exclusive``: an existing ``path`` is refused and left as it is).

    On any failure the temp file is removed, the previous ``path`` is untouched and a
    :class:`CheckpointError` ``"checkpoint write failed: <path>: <reason>"`` is raised.
    """
    path = Path(path)
    tmp: str | None = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=path.name + ".tmp", dir=path.parent)
        os.fchmod(fd, 0o666 & ~umask())  # the mode open() gives (a colleague's eval job reads it), not mkstemp's 0600
        with os.fdopen(fd, "wb") as f:
            sink = _Sink(f)
            try:
                torch.save(dict(state), sink)
            except RuntimeError as exc:  # torch's zip writer hides the OSError or abort ("unexpected pos ...")
                raise (sink.error or raised_abort() or exc) from None
            f.flush()
            os.fsync(f.fileno())
        publish(tmp, path, exclusive)
        tmp = None
    except FileExistsError:
        raise CheckpointError(f"checkpoint write refused: {path}: the file exists (not overwritten)") from None
    except (OSError, RuntimeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc).splitlines()[0]
        raise CheckpointError(f"checkpoint write failed: {path}: {reason}") from None
    finally:
        if tmp is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
