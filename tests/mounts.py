"""Real filesystems for tests: a small tmpfs that fills up, a directory root cannot write.

Both need ``mount(8)`` as root on Linux. Where that is not possible the test skips, except under
``MOONRT_REQUIRE_MOUNT=1`` (``.ci/run``, which runs as root), where it fails instead: CI never skips them silently.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

import pytest

REQUIRE_MOUNT_ENV = "MOONRT_REQUIRE_MOUNT"


def _missing(reason: str) -> NoReturn:
    """Skip with ``reason``; under ``MOONRT_REQUIRE_MOUNT=1`` (CI) fail instead."""
    if os.environ.get(REQUIRE_MOUNT_ENV) == "1":
        pytest.fail(f"{REQUIRE_MOUNT_ENV}=1 but {reason}", pytrace=False)
    pytest.skip(reason)


def _mount(*args: str) -> None:
    """``mount ARGS``, or skip (fail under ``MOONRT_REQUIRE_MOUNT=1``) where mounting is not possible here."""
    if not sys.platform.startswith("linux") or shutil.which("mount") is None:
        _missing("needs Linux mount(8)")
    if os.geteuid() != 0:
        _missing("needs root to mount")
    done = subprocess.run(["mount", *args], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        _missing(f"mount {' '.join(args)} not permitted here: {done.stderr.strip() or done.returncode}")


def _umount(path: Path) -> None:
    if subprocess.run(["umount", str(path)], capture_output=True, timeout=30).returncode != 0:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=30)


@contextlib.contextmanager
def small_tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` (``mount -o size=``, e.g. ``"256k"``) on the new directory ``path``, unmounted on exit:
    a real filesystem that runs out of space."""
    path.mkdir()
    _mount("-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path))
    try:
        yield path
    finally:
        _umount(path)


@contextlib.contextmanager
def read_only_dir(path: Path) -> Iterator[Path]:
    """The new directory ``path``, not writable by this process: ``chmod 0500`` for a normal user; for root, whom
    permissions do not stop (CI runs as root), a read-only bind mount of it onto itself (writes fail with EROFS)."""
    path.mkdir()
    if os.geteuid() != 0:
        path.chmod(0o500)
        try:
            yield path
        finally:
            path.chmod(0o700)
        return
    _mount("--bind", str(path), str(path))
    try:
        _mount("-o", "remount,bind,ro", str(path))
        yield path
    finally:
        _umount(path)
