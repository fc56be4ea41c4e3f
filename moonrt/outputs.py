"""Files a training run writes besides checkpoints: output-directory probes and the metrics JSON-lines file.

Safe by default: a new metrics file is created exclusively (an existing file is never truncated); on
resume it is trimmed to the records up to the checkpoint's step by an atomic replace, so after a kill
and resume every step appears exactly once.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import IO

from moonrt.config import ConfigError


def probe_dir(directory: Path, what: str) -> None:
    """Create ``directory`` if needed and check that a new file can be created in it (before step 1)."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".moonrt-probe", dir=directory)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise ConfigError(f"{what} = {str(directory)!r}: expected a writable directory ({reason})") from None


def open_metrics(path: str, resume_step: int | None) -> IO[str]:
    """The metrics file to append to: new (exclusive), or on resume trimmed to the records of steps
    ``<= resume_step`` (atomically: a trimmed copy replaces it), so no step appears twice after a kill."""
    if resume_step is None or not os.path.exists(path):
        return open(path, "x" if resume_step is None else "a")  # noqa: SIM115
    kept = []
    with open(path) as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # a line cut by a kill
                continue
            if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= resume_step:
                kept.append(json.dumps(record) + "\n")
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".tmp", dir=os.path.dirname(os.path.abspath(path)))
    try:
        with os.fdopen(fd, "w") as f:
            f.writelines(kept)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return open(path, "a")  # noqa: SIM115
