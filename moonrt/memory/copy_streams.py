"""The copy-stream protocol of the host tier (:class:`moonrt.memory.backends.HostStore`).

A device -> host offload must not block the compute stream, and its restore must not read the host buffer
before the offload's bytes are in it. The protocol, per source device:

1. ``put``: the copy stream waits for the compute stream (the source's producer has been issued), the copy into
   the host buffer is issued **on the copy stream**, the source is marked as used by the copy stream
   (``record_stream``: the caching allocator does not reuse it before the copy ran) and an **event** is recorded
   on the copy stream after the copy.
2. ``get``: the copy stream **waits on that event**, the host -> device copy is issued on the copy stream, the
   compute stream waits for the copy stream and the result is marked as used by the compute stream.
3. ``free``: an event recorded on the copy stream after every copy issued so far (the restore's included) goes
   with the buffer into the pool; the next ``put`` that reuses the buffer makes the copy stream wait on it
   before writing, so a pooled buffer is never overwritten before its last read completed.

:class:`CudaStreams` runs it on ``torch.cuda`` streams and events; :class:`SyncStreams` runs the same calls on a
CPU source, where every copy is synchronous: its streams and its event are no-ops that are complete at once.
Anything with these methods can stand in (the tests inject a recording one on CPU).

Host buffers are pinned exactly when the source is a CUDA tensor (:func:`pin_host`): pinning needs a CUDA
context (on a CPU-only torch it raises) and only makes device <-> host copies asynchronous.
"""

from __future__ import annotations

import contextlib
from typing import Any, Protocol

import torch


def pin_host(device: torch.device | str) -> bool:
    """Whether a host buffer holding bytes of a tensor on ``device`` is pinned: exactly when ``device`` is CUDA."""
    return torch.device(device).type == "cuda"


class Streams(Protocol):
    """What :class:`~moonrt.memory.backends.HostStore` needs of a device's streams (see the module docstring)."""

    synchronous: bool
    """Copies complete when issued: records need no event and a restore to the host needs no copy."""

    def current_stream(self, device: torch.device) -> Any:
        """The compute stream of ``device`` (has ``wait_stream(stream)`` and ``wait_event(event)``)."""

    def copy_stream(self, device: torch.device) -> Any:
        """The dedicated copy stream of ``device`` (one per device, made on first use)."""

    def use(self, stream: Any) -> contextlib.AbstractContextManager:
        """Issue the work in the ``with`` block on ``stream``."""

    def new_event(self) -> Any:
        """An event (``record(stream)``, ``query()``)."""

    def record_stream(self, t: torch.Tensor, stream: Any) -> None:
        """Mark ``t``'s memory as used by ``stream`` (the allocator keeps it until the stream's work so far ran)."""

    def copy_(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src)`` issued on the current stream (asynchronous to the host where the devices allow)."""

    def to(self, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        """``t`` copied to ``device`` on the current stream."""


class _Done:
    """The stream and event of :class:`SyncStreams`: everything issued on it has completed."""

    __slots__ = ()

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


DONE = _Done()


class SyncStreams:
    """The protocol on a CPU source: the same calls, each copy complete when it returns."""

    synchronous = True

    def current_stream(self, device: torch.device) -> Any:
        return DONE

    def copy_stream(self, device: torch.device) -> Any:
        return DONE

    def use(self, stream: Any) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def new_event(self) -> Any:
        return DONE

    def record_stream(self, t: torch.Tensor, stream: Any) -> None:
        pass

    def copy_(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def to(self, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        return t.to(device)


SYNC = SyncStreams()


class CudaStreams:
    """The protocol on ``torch.cuda`` streams and events: one copy stream per device."""

    synchronous = False

    def __init__(self) -> None:
        self._copy: dict[torch.device, Any] = {}

    def current_stream(self, device: torch.device) -> Any:
        return torch.cuda.current_stream(device)

    def copy_stream(self, device: torch.device) -> Any:
        s = self._copy.get(device)
        if s is None:
            s = self._copy[device] = torch.cuda.Stream(device=device)
        return s

    def use(self, stream: Any) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(stream)

    def new_event(self) -> Any:
        return torch.cuda.Event()

    def record_stream(self, t: torch.Tensor, stream: Any) -> None:
        t.record_stream(stream)

    def copy_(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)

    def to(self, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        return t.to(device, non_blocking=True)


__all__ = ["CudaStreams", "DONE", "SYNC", "Streams", "SyncStreams", "pin_host"]
