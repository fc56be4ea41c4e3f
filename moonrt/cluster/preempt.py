"""Preemption: stop a job at a step boundary when it is told to (SIGTERM, SIGINT or a configured signal).

A batch scheduler that reclaims an allocation first sends a signal: SLURM sends SIGTERM (and SIGKILL
``KillWait`` seconds later) on ``scancel``, preemption or the time limit, and, with
``#SBATCH --signal=B:USR1@<seconds>``, SIGUSR1 that many seconds ahead of the limit. ``moonrt train``
installs a :class:`StopSignal` for SIGTERM, SIGINT and its ``stop_signal`` (``--signal``): the first such
signal only sets a flag; every rank finishes its current step, the ranks agree on the stop step (one
all-reduce of the flag at each step boundary: :meth:`moonrt.comm.parallelism.Parallelism.any_flag`), all
save a checkpoint of that step and exit with :data:`PREEMPTED_EXIT`. A second signal aborts at once
(:class:`Aborted`, exit code ``128 + signal``); a third one, should the process be blocked in a C call that
the second could not interrupt, gets the default action (termination). Checkpoints are written atomically,
so an abort never corrupts the previous one.

A signal can arrive before the job gets that far (importing torch and building the model take seconds): the
command line arms :func:`arm_early` for the same signals first thing, whose handler only records the signal, and
the :class:`StopSignal` entered later takes it over, so such a job stops at its starting step (checkpointed,
exit :data:`PREEMPTED_EXIT`) instead of dying of the signal's default action.

Launchers use the same exit code: ``moonrt launch`` forwards the signal to its ranks and reports their code,
and the script of ``moonrt sbatch --requeue`` requeues the job when its step exits with it.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterable
from types import FrameType
from typing import Any

PREEMPTED_EXIT = 75
"""Exit code of a job that stopped on a signal after checkpointing its last completed step: resume it with
``--resume`` (or ``--resume-if-exists``). 75 is ``EX_TEMPFAIL`` of ``sysexits.h`` ("temporary failure, try
again"): distinct from a crash (1), bad input (2) and a kill by a signal (``128 + n``)."""

STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGXCPU")
"""Signals that ``--signal`` may name (those a scheduler sends to ask for a stop; SIGKILL/SIGSTOP cannot be
caught)."""


def signal_from_name(name: str, field: str = "stop_signal (--signal)") -> signal.Signals:
    """``"USR1"``, ``"SIGUSR1"`` or ``"usr1"`` -> ``signal.SIGUSR1``; anything not in :data:`STOP_SIGNALS` is a
    ``ValueError`` naming ``field``."""
    key = name.upper() if isinstance(name, str) else ""
    key = key if key.startswith("SIG") else "SIG" + key
    if key not in STOP_SIGNALS:
        raise ValueError(f"{field} = {name!r}: expected one of {', '.join(s[3:] for s in STOP_SIGNALS)} "
                         "(with or without the SIG prefix)")
    return signal.Signals[key]


class Aborted(BaseException):
    """A second stop signal arrived before the job could stop cleanly: abort now (exit code ``128 + signum``).

    A ``BaseException`` (like ``KeyboardInterrupt``) so that no ``except Exception`` swallows it; ``finally``
    blocks still run (a half-written checkpoint's temp file is removed)."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"second {signal.Signals(signum).name}: aborting without a checkpoint")
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


_early: dict[signal.Signals, Any] = {}
"""Signals :func:`arm_early` handles until a :class:`StopSignal` is entered -> the handler each had before."""

_early_signum: int | None = None
"""The stop signal the :func:`arm_early` handler recorded (the first one that arrived), if any."""


def arm_early(signals: Iterable[int]) -> None:
    """Handle ``signals`` from now until a :class:`StopSignal` is entered (which takes over a recorded signal and
    restores the handlers from before this call on exit): the first one that arrives is only recorded, a second
    one raises :class:`Aborted` (as under :class:`StopSignal`). For the start of a job, before the heavy imports;
    in the main thread only (elsewhere a no-op). Imports nothing heavy: this module must stay free of torch."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in dict.fromkeys(signal.Signals(s) for s in signals):
        if sig not in _early:
            _early[sig] = signal.signal(sig, _record_early)


def _record_early(signum: int, _frame: FrameType | None) -> None:
    global _early_signum
    if _early_signum is None:
        _early_signum = signum
        return
    disarm_early()
    raise Aborted(signum)


def disarm_early() -> int | None:
    """Restore the handlers :func:`arm_early` replaced; returns the signal it recorded (and forgets it)."""
    global _early_signum
    for sig, handler in _early.items():
        signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
    _early.clear()
    signum, _early_signum = _early_signum, None
    return signum


_raised: Aborted | None = None
"""The :class:`Aborted` a :class:`StopSignal` handler raised since one was last entered (:func:`raised_abort`)."""


def raised_abort() -> Aborted | None:
    """The abort a second stop signal raised in this process, if any: for code that catches the error of a library
    whose callbacks the handler may have interrupted (torch.save's zip writer turns an exception raised in its
    Python ``write`` into "unexpected pos ..."; DCP wraps every exception of a save): re-raise this instead, so
    the job still aborts with ``128 + signum``."""
    return _raised


class StopSignal:
    """Context manager: while active, the first of ``signals`` sets :attr:`signum`, the second raises
    :class:`Aborted` (and restores the default action, so a third terminates even a process stuck in C code).

    Handlers are installed only in the main thread (Python delivers signals there; elsewhere the manager does
    nothing and :attr:`signum` stays None) and the previous ones are restored on exit (those from before
    :func:`arm_early`, if it was armed). A stop signal that :func:`arm_early`'s handler recorded counts as the first:
    :attr:`signum` is set on entry; one of another signal (not a stop signal of this job after all) gets the action
    it had before :func:`arm_early`.
    """

    def __init__(self, signals: Iterable[int]) -> None:
        self.signals = tuple(dict.fromkeys(signal.Signals(s) for s in signals))
        self.signum: int | None = None
        self._previous: dict[signal.Signals, Any] = {}

    @property
    def requested(self) -> bool:
        """A stop signal arrived (in this process)."""
        return self.signum is not None

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        global _raised
        if self.signum is None:
            self.signum = signum
            return
        for sig in self.signals:
            signal.signal(sig, signal.SIG_DFL)
        _raised = Aborted(signum)
        raise _raised

    def __enter__(self) -> StopSignal:
        global _raised
        _raised = None
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handle)
                self._previous[sig] = _early.pop(sig, self._previous[sig])
            early = disarm_early()  # the signals armed early that this job does not stop on get their old handlers
            if early in self.signals:
                self.signum = early
            elif early is not None:
                signal.raise_signal(early)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        self._previous.clear()


def stop_signals(configured: str) -> tuple[signal.Signals, ...]:
    """The signals a training job stops on: SIGTERM, SIGINT and the configured one (``stop_signal``)."""
    return tuple(dict.fromkeys((signal.SIGTERM, signal.SIGINT, signal_from_name(configured))))
