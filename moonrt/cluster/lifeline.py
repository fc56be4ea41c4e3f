"""Ranks die with their launcher: the parent-death signal ``moonrt launch`` sets on each rank, and the portable
watchdog a rank starts where no such signal is set.

``moonrt launch`` (:mod:`moonrt.cluster.launch`) sets Linux's ``PR_SET_PDEATHSIG`` = SIGKILL in every rank between
fork and exec, and passes its pid in ``MOONRT_LAUNCHER_PID``; :func:`moonrt.cluster.env.init_distributed` calls
:func:`watch_launcher`, which watches that pid only where no parent-death signal is set (no ``prctl``: macOS, BSD).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping

LAUNCHER_PID_ENV = "MOONRT_LAUNCHER_PID"
"""Pid of the ``moonrt launch`` process that started this rank (:func:`watch_launcher`)."""


PR_SET_PDEATHSIG = 1
PR_GET_PDEATHSIG = 2


def libc_prctl() -> Callable[..., int] | None:
    """Linux's ``prctl(2)`` through ctypes, or ``None`` where it does not exist (macOS, BSD, no libc found)."""
    if not os.uname().sysname == "Linux":
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    return prctl


def parent_death_signal() -> int:
    """The signal this process gets when its parent dies (``PR_GET_PDEATHSIG``); 0 when none, or no prctl."""
    prctl = libc_prctl()
    if prctl is None:
        return 0
    sig = ctypes.c_int(0)
    if prctl(PR_GET_PDEATHSIG, ctypes.addressof(sig), 0, 0, 0) != 0:
        return 0
    return sig.value


def watch_launcher(environ: Mapping[str, str] = os.environ, *, poll_s: float = 1.0) -> threading.Thread | None:
    """Portable fallback for ``PR_SET_PDEATHSIG``: when ``MOONRT_LAUNCHER_PID`` is set and no parent-death signal
    is, start a daemon thread that SIGKILLs this process (its whole process group when it leads one, as a
    ``moonrt launch`` rank does) once the launcher is gone: its parent changed (reparented) or the launcher's pid
    no longer exists. Checked every ``poll_s`` seconds and once at once. Returns the thread, or ``None``.

    SIGKILL, as for the parent-death signal (``moonrt.cluster.launch``): with the launcher gone nothing would
    bound a graceful stop; checkpoints are written atomically, so the last committed one stays valid.
    """
    raw = environ.get(LAUNCHER_PID_ENV)
    if not raw or parent_death_signal():
        return None
    try:
        launcher = int(raw)
    except ValueError:
        raise ValueError(f"{LAUNCHER_PID_ENV} = {raw!r}: expected a process id") from None
    parent = os.getppid()

    def alive() -> bool:
        if os.getppid() != parent or (parent == 1 and launcher != 1):  # reparented to init: orphaned
            return False
        try:
            os.kill(launcher, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass  # exists, owned by another user
        return True

    def die() -> None:
        if os.getpgrp() == os.getpid():
            os.killpg(os.getpid(), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)

    if not alive():
        die()

    def watch() -> None:
        while alive():
            time.sleep(poll_s)
        die()

    thread = threading.Thread(target=watch, name="moonrt-launcher-watch", daemon=True)
    thread.start()
    return thread
