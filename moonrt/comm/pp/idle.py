"""How long a pipeline rank waits for received tensors in one step (``pp_idle_frac``, K3_SYSTEMS §4), per backend.

On gloo (CPU tensors) ``work.wait()`` blocks the host until the bytes are in: the host clock around it is the wait.
On NCCL it does not block the host: it makes the current CUDA stream wait for the communication, and returns at once,
so the host clock reads ~0 (the metric read ~0 on GPUs). :class:`IdleClock` times the waits where they happen: on
CUDA with events recorded on the current stream before and after each wait (the stream's stall: the bubble plus the
transfer) and around the step, resolved once at its end (one host synchronization per step, where the step's metrics
are read anyway); on the CPU with ``time.perf_counter``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch


class IdleClock:
    """One step's receive-wait and wall seconds on ``device``: :meth:`start`, :meth:`wait` per receive,
    :meth:`stop` -> ``(recv_wait_s, wall_s)``. ``event``: the CUDA event factory (``torch.cuda.Event``; tests pass a
    stand-in)."""

    def __init__(self, device: torch.device, event: Callable[..., Any] | None = None) -> None:
        self.cuda = device.type == "cuda"
        self._event = event if event is not None else (torch.cuda.Event if self.cuda else None)
        self._waits: list[tuple[Any, Any]] = []
        self._wait_s = 0.0
        self._t0: Any = None

    def _mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        e = self._event(enable_timing=True)  # type: ignore[misc]
        e.record()  # on the current stream
        return e

    def start(self) -> None:
        self._waits, self._wait_s = [], 0.0
        self._t0 = self._mark()

    def wait(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` (the receive's ``wait``) and count the time the rank (host or stream) was held by it."""
        t0 = self._mark()
        fn()
        t1 = self._mark()
        if self.cuda:
            self._waits.append((t0, t1))
        else:
            self._wait_s += t1 - t0

    def stop(self) -> tuple[float, float]:
        """``(recv_wait_s, wall_s)`` of the step (CUDA: waits for the stream to reach the end mark)."""
        t1 = self._mark()
        if not self.cuda:
            return self._wait_s, t1 - self._t0
        t1.synchronize()
        waits = sum(a.elapsed_time(b) for a, b in self._waits) / 1e3  # elapsed_time: milliseconds
        return waits, self._t0.elapsed_time(t1) / 1e3


__all__ = ["IdleClock"]
