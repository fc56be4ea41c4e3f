"""Ranks die with their launcher: the parent-death signal ``moonrt launch`` sets on each rank, and the portable
watchdog a rank starts where no such signal is set.

``moonrt launch`` (:mod:`moonrt.cluster.launch`) sets Linux's ``PR_SET_PDEATHSIG`` = SIGKILL in every rank between
fork and exec, and passes its pid in ``MOONRT_LAUNCHER_PID``; :func:`moonrt.cluster.env.init_distributed` calls
:func:`watch_launcher`, which watches that pid only where no parent-death signal is set (no ``prctl``: macOS, BSD).

**Under torchrun** (``TORCHELASTIC_RUN_ID`` set: every torchrun worker has it, ``moonrt launch`` does not pass it on)
the launcher is torchrun's agent, which starts each worker as its own child and sets no parent-death signal: killed
with SIGKILL it used to leave its ranks training on, unsupervised, holding the ``--out`` lock. Such a rank binds its
life to its parent (:func:`die_with_agent`: the ``moonrt`` command line does it first thing, before torch loads, and
:func:`watch_launcher` again): ``PR_SET_PDEATHSIG`` = SIGKILL set by the rank itself, then the parent re-checked (an
agent that died before the prctl took effect left the rank reparented: it kills itself); without ``prctl`` the
watchdog thread watches the agent's pid. (A parent of pid 1 is left alone: torchrun as a container's init cannot be
told from an orphan's reaper there, and a container's init takes its processes with it.)
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
TORCHRUN_ENV = "TORCHELASTIC_RUN_ID"
"""Set in every worker of torchrun (torch.distributed.run): this rank's parent is torchrun's agent
(:func:`die_with_agent`)."""
_agent: int | None = None
"""The torchrun agent this process bound its life to (:func:`die_with_agent`), once it did."""


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


def _die() -> None:
    """SIGKILL this process, and its process group first when it leads one (a rank of ``moonrt launch`` or torchrun
    does: its own children go too)."""
    if os.getpgrp() == os.getpid():
        os.killpg(os.getpid(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def die_with_agent(environ: Mapping[str, str] = os.environ) -> int | None:
    """Under torchrun (``TORCHELASTIC_RUN_ID`` set, no ``MOONRT_LAUNCHER_PID``): make this rank die with its parent,
    torchrun's agent (module doc); return the agent's pid, or ``None`` (not under torchrun, or a parent of pid 1).

    The first call takes the parent as the agent, sets ``PR_SET_PDEATHSIG`` = SIGKILL where ``prctl`` exists, then
    checks that the parent is still that pid (the agent may have died before the prctl took effect: this process
    is killed then). A later call checks that the parent is still the agent the first call found, and kills this
    process if not (it was orphaned in between). SIGKILL, as for ``moonrt launch``'s ranks
    (:mod:`moonrt.cluster.launch`).
    """
    global _agent
    if not environ.get(TORCHRUN_ENV) or environ.get(LAUNCHER_PID_ENV):
        return None
    if _agent is not None:
        if os.getppid() != _agent:
            _die()
        return _agent
    parent = os.getppid()
    if parent == 1:
        return None
    prctl = libc_prctl()
    if prctl is not None:
        prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)  # should it fail, watch_launcher's thread acts instead
    if os.getppid() != parent:
        _die()
    _agent = parent
    return parent


def watch_launcher(environ: Mapping[str, str] = os.environ, *, poll_s: float = 1.0) -> threading.Thread | None:
    """Portable fallback for ``PR_SET_PDEATHSIG``: when ``MOONRT_LAUNCHER_PID`` is set, or this is a torchrun worker
    (then the launcher is torchrun's agent, :func:`die_with_agent`, which this calls), and no parent-death signal
    is set, start a daemon thread that SIGKILLs this process (its whole process group when it leads one, as a
    ``moonrt launch`` or torchrun rank does) once the launcher is gone: its parent changed (reparented) or the
    launcher's pid no longer exists. Checked every ``poll_s`` seconds and once at once. Returns the thread, or
    ``None``.

    SIGKILL, as for the parent-death signal (``moonrt.cluster.launch``): with the launcher gone nothing would
    bound a graceful stop; checkpoints are written atomically, so the last committed one stays valid.
    """
    raw = environ.get(LAUNCHER_PID_ENV)
    if raw:
        try:
            launcher = int(raw)
        except ValueError:
            raise ValueError(f"{LAUNCHER_PID_ENV} = {raw!r}: expected a process id") from None
    else:
        agent = die_with_agent(environ)
        if agent is None:
            return None
        launcher = agent
    if parent_death_signal():
        return None
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

    if not alive():
        _die()

    def watch() -> None:
        while alive():
            time.sleep(poll_s)
        _die()

    thread = threading.Thread(target=watch, name="moonrt-launcher-watch", daemon=True)
    thread.start()
    return thread
