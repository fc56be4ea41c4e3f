"""How every command creates its output files: :func:`write_new` (exclusively, never through a symlink, replaced
only when the user passes ``--force``) and :func:`existing_outputs` (what a command refuses before any work); here
because every layer may import this leaf. :func:`umask` reads the process's umask without changing it.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import BinaryIO


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
