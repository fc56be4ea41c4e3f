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
- Every message is one ``dist.batch_isend_irecv`` group of one op, posted in the same per-pair order on both
  sides (NCCL runs point-to-point only as such groups; gloo accepts them too). The bytes travel on the
  channel's device (:func:`channel_device`: the current CUDA device for an NCCL group, else the host), so an
  NCCL channel moves device memory without a host copy; :class:`~moonrt.memory.backends.RemoteStore` brings
  them back to the device they came from.
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


def make_channel_group(owner: int, peer: int, backend: str = "gloo") -> dist.ProcessGroup:
    """A group of ranks ``{owner, peer}`` for the channel (collective over the whole job); ``backend``
    ``"gloo"`` (host memory) or ``"nccl"`` (device memory)."""
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"remote offload channel backend = {backend!r}: expected 'gloo' or 'nccl'")
    return dist.new_group(sorted({owner, peer}), backend=backend)


def channel_device(group: dist.ProcessGroup | None) -> torch.device:
    """The device the channel's tensors live on: the current CUDA device for an NCCL group, else the host."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _p2p(op: object, tensor: torch.Tensor, peer: int, group: dist.ProcessGroup | None, timeout_s: float,
         what: str) -> None:
    """One message as a ``batch_isend_irecv`` group of one op (``op``: ``dist.isend`` / ``dist.irecv``), waited
    for with a timeout."""
    for work in dist.batch_isend_irecv([dist.P2POp(op, tensor, peer, group=group)]):
        _wait(work, timeout_s, what)


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
        self.device = channel_device(group)
        self.timeout_s = timeout_s
        self._lock = threading.RLock()
        self._next = 0
        self._pending_free: list[int] = []
        self._pending_lock = threading.Lock()
        self.sent_bytes = 0
        self.received_bytes = 0

    def _header(self, op: int, key: int, n: int) -> None:
        h = torch.tensor([op, key, n] + [0] * (_HEADER - 3), dtype=torch.int64, device=self.device)
        _p2p(dist.isend, h, self.peer, self.group, self.timeout_s, f"header op={op} to rank {self.peer}")

    def _flush_locked(self) -> None:
        with self._pending_lock:
            keys, self._pending_free = self._pending_free, []
        for k in keys:
            self._header(FREE, k, 0)

    def put(self, data: torch.Tensor) -> int:
        """Send ``[n]`` uint8 ``data`` to the peer; returns the key to fetch it with."""
        data = data.to(self.device).contiguous()  # a host copy only when a device tensor goes over gloo
        with self._lock:
            self._flush_locked()
            key = self._next
            self._next += 1
            self._header(PUT, key, data.numel())
            _p2p(dist.isend, data, self.peer, self.group, self.timeout_s, f"PUT {key} to rank {self.peer}")
            self.sent_bytes += data.numel()
        return key

    def get(self, key: int, n: int) -> torch.Tensor:
        """``[n]`` uint8 on the channel's device: the bytes stored under ``key`` (they stay on the peer until
        :meth:`free`)."""
        out = torch.empty(n, dtype=torch.uint8, device=self.device)
        with self._lock:
            self._flush_locked()
            self._header(GET, key, n)
            _p2p(dist.irecv, out, self.peer, self.group, self.timeout_s, f"GET {key} from rank {self.peer}")
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
        self.device = channel_device(group)
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
        h = torch.zeros(_HEADER, dtype=torch.int64, device=self.device)
        while True:
            _p2p(dist.irecv, h, self.owner, self.group, self.idle_timeout_s, f"header from rank {self.owner}")
            op, key, n = h[:3].tolist()
            self.requests += 1
            if op == PUT:
                buf = torch.empty(n, dtype=torch.uint8, device=self.device)
                _p2p(dist.irecv, buf, self.owner, self.group, self.timeout_s, f"PUT {key} payload")
                self.store[key] = buf
                self.held_bytes += n
                self.peak_bytes = max(self.peak_bytes, self.held_bytes)
            elif op == GET:
                if key not in self.store:
                    raise ValueError(f"remote offload: GET of unknown key {key} from rank {self.owner}")
                _p2p(dist.isend, self.store[key], self.owner, self.group, self.timeout_s, f"GET {key} reply")
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


__all__ = ["RemoteClient", "RemoteServer", "channel_device", "make_channel_group"]
