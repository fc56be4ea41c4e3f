"""Remote offload: keep saved tensors in a peer rank's memory (K3_SYSTEMS §8, "remote offload").

Protocol (point-to-point over a dedicated two-rank process group, so it never interleaves with
the job's other traffic):

- The **owner** rank (the one whose activations are offloaded) holds a :class:`RemoteClient`.
- The **peer** rank runs a :class:`RemoteServer` — a service loop, in a background thread
  (:meth:`RemoteServer.start`) so the peer can keep computing, or inline (:meth:`serve`).
- Every request starts with a header ``[8]`` int64 ``(op, key, nbytes, 0...)`` sent owner -> peer:
  ``PUT`` is followed by ``nbytes`` uint8 owner -> peer; ``GET`` is answered by ``nbytes`` uint8
  peer -> owner; ``FREE`` drops a key; ``STOP`` ends the service loop. Both sides post matching
  send/recv in the same order, so the exchange cannot deadlock; every wait has a timeout, after
  which a :class:`TimeoutError` names the operation and peer (no silent hang).
- Frees requested while autograd releases saved tensors (a finalizer, possibly on another thread)
  are queued and flushed with the next request or :meth:`RemoteClient.flush`.

Creating the group (``dist.new_group``) is collective: every rank of the job must call
:func:`make_channel_group` in the same order.
"""

from __future__ import annotations

import threading
from datetime import timedelta

import torch
import torch.distributed as dist

PUT, GET, FREE, STOP = 1, 2, 3, 4
_HEADER = 8


def make_channel_group(owner: int, peer: int) -> dist.ProcessGroup:
    """A gloo group of ranks ``{owner, peer}`` for the channel (collective over the whole job)."""
    return dist.new_group(sorted({owner, peer}), backend="gloo")


def _wait(work: dist.Work, timeout_s: float, what: str) -> None:
    try:
        ok = work.wait(timeout=timedelta(seconds=timeout_s))
    except RuntimeError as exc:
        raise TimeoutError(f"remote offload: {what} did not complete within {timeout_s} s ({exc})") from None
    if ok is False:
        raise TimeoutError(f"remote offload: {what} did not complete within {timeout_s} s")


class RemoteClient:
    """Owner side: ``put(bytes) -> key``, ``get(key, n) -> bytes``, ``free(key)``. Thread-safe."""

    def __init__(self, peer: int, group: dist.ProcessGroup | None = None, timeout_s: float = 60.0) -> None:
        self.peer = peer
        self.group = group
        self.timeout_s = timeout_s
        self._lock = threading.RLock()
        self._next = 0
        self._pending_free: list[int] = []
        self._pending_lock = threading.Lock()
        self.sent_bytes = 0
        self.received_bytes = 0

    def _header(self, op: int, key: int, n: int) -> None:
        h = torch.zeros(_HEADER, dtype=torch.int64)
        h[0], h[1], h[2] = op, key, n
        _wait(dist.isend(h, self.peer, group=self.group), self.timeout_s, f"header op={op} to rank {self.peer}")

    def _flush_locked(self) -> None:
        with self._pending_lock:
            keys, self._pending_free = self._pending_free, []
        for k in keys:
            self._header(FREE, k, 0)

    def put(self, data: torch.Tensor) -> int:
        """Send ``[n]`` uint8 ``data`` to the peer; returns the key to fetch it with."""
        data = data.cpu().contiguous()
        with self._lock:
            self._flush_locked()
            key = self._next
            self._next += 1
            self._header(PUT, key, data.numel())
            _wait(dist.isend(data, self.peer, group=self.group), self.timeout_s, f"PUT {key} to rank {self.peer}")
            self.sent_bytes += data.numel()
        return key

    def get(self, key: int, n: int) -> torch.Tensor:
        """``[n]`` uint8: the bytes stored under ``key`` (they stay on the peer until :meth:`free`)."""
        out = torch.empty(n, dtype=torch.uint8)
        with self._lock:
            self._flush_locked()
            self._header(GET, key, n)
            _wait(dist.irecv(out, self.peer, group=self.group), self.timeout_s, f"GET {key} from rank {self.peer}")
            self.received_bytes += n
        return out

    def free(self, key: int) -> None:
        """Queue ``key`` for release on the peer (sent with the next request or :meth:`flush`)."""
        with self._pending_lock:
            self._pending_free.append(key)

    def flush(self) -> None:
        with self._lock:
            self._flush_locked()

    def stop(self) -> None:
        """Flush pending frees and end the peer's service loop."""
        with self._lock:
            self._flush_locked()
            self._header(STOP, 0, 0)


class RemoteServer:
    """Peer side: stores what the owner PUTs, answers GETs, until STOP.

    ``held_bytes`` / ``peak_bytes`` report what this rank holds for the owner. Each wait has a
    timeout (``idle_timeout_s`` for the next header: the owner must send a request or STOP).
    """

    def __init__(self, owner: int, group: dist.ProcessGroup | None = None, timeout_s: float = 60.0,
                 idle_timeout_s: float = 600.0) -> None:
        self.owner = owner
        self.group = group
        self.timeout_s = timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.store: dict[int, torch.Tensor] = {}
        self.held_bytes = 0
        self.peak_bytes = 0
        self.requests = 0
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def serve(self) -> None:
        """Run the service loop until STOP (raises TimeoutError when the owner goes silent)."""
        h = torch.zeros(_HEADER, dtype=torch.int64)
        while True:
            _wait(dist.irecv(h, self.owner, group=self.group), self.idle_timeout_s, f"header from rank {self.owner}")
            op, key, n = int(h[0]), int(h[1]), int(h[2])
            self.requests += 1
            if op == PUT:
                buf = torch.empty(n, dtype=torch.uint8)
                _wait(dist.irecv(buf, self.owner, group=self.group), self.timeout_s, f"PUT {key} payload")
                self.store[key] = buf
                self.held_bytes += n
                self.peak_bytes = max(self.peak_bytes, self.held_bytes)
            elif op == GET:
                if key not in self.store:
                    raise ValueError(f"remote offload: GET of unknown key {key} from rank {self.owner}")
                _wait(dist.isend(self.store[key], self.owner, group=self.group), self.timeout_s, f"GET {key} reply")
            elif op == FREE:
                buf = self.store.pop(key, None)
                if buf is not None:
                    self.held_bytes -= buf.numel()
            elif op == STOP:
                return
            else:
                raise ValueError(f"remote offload: header op = {op}: expected one of PUT, GET, FREE, STOP")

    def start(self) -> RemoteServer:
        """Serve in a daemon thread; :meth:`join` waits for STOP and re-raises a service error."""

        def run() -> None:
            try:
                self.serve()
            except BaseException as exc:  # noqa: BLE001 - surfaced by join()
                self.error = exc

        self._thread = threading.Thread(target=run, name="moonrt-remote-offload", daemon=True)
        self._thread.start()
        return self

    def join(self, timeout_s: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                raise TimeoutError(f"remote offload server for rank {self.owner} still running after {timeout_s} s")
        if self.error is not None:
            raise self.error


__all__ = ["RemoteClient", "RemoteServer", "make_channel_group"]
