"""The memory tiers keep every tensor on the device of the data it stores (issue 30): the host tier's copy-stream
protocol (copy on the copy stream, restore after the offload's event, pooled buffers reused only after their last
read), pinning exactly for CUDA sources, bit-exact offload and restore of fp32/bf16/fp64 and strided saves on the
source's device, FP8 codes and scales on the source's device. Tests taking ``device`` also run on CUDA under
``MOONRT_TEST_DEVICE=cuda`` (benchmarks/gpu/check.sh)."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
from torch import nn

import moonrt.ops.fp8.codec as fp8
from moonrt.config import from_dict
from moonrt.memory.backends import Backend, HostStore, KeepStore
from moonrt.memory.copy_streams import SYNC, CudaStreams, pin_host
from moonrt.memory.manager import ActivationManager
from moonrt.memory.policy import MemoryPolicy

# ---------------------------------------------------------------------------------------------
# A stand-in for a device with asynchronous streams, on CPU: work issued on a side stream is queued and runs only
# when something waits for it (an event recorded after it, or the whole stream), so a restore that skipped the
# protocol would read a buffer the offload has not filled yet. Every call is logged.


class _Event:
    def __init__(self, log: list, n: int) -> None:
        self.log, self.name, self.stream, self.mark = log, f"E{n}", None, 0

    def record(self, stream: _Stream) -> None:
        self.stream, self.mark = stream, stream.issued
        self.log.append(("record", self.name, stream.name))

    def query(self) -> bool:
        return self.stream is None or self.stream.done >= self.mark


class _Stream:
    def __init__(self, log: list, name: str, immediate: bool) -> None:
        self.log, self.name, self.immediate = log, name, immediate
        self.queue: list[Any] = []
        self.issued = self.done = 0

    def submit(self, fn: Any) -> None:
        self.issued += 1
        if self.immediate:
            fn()
            self.done += 1
        else:
            self.queue.append(fn)

    def run_to(self, mark: int) -> None:
        while self.done < mark:
            self.queue.pop(0)()
            self.done += 1

    def wait_stream(self, other: _Stream) -> None:
        self.log.append(("wait_stream", self.name, other.name))
        other.run_to(other.issued)

    def wait_event(self, event: _Event) -> None:
        self.log.append(("wait_event", self.name, event.name))
        if event.stream is not None:
            event.stream.run_to(event.mark)


class RecordingStreams:
    """The :class:`~moonrt.memory.copy_streams.Streams` protocol on CPU with a deferred copy stream, logged."""

    synchronous = False

    def __init__(self) -> None:
        self.log: list[tuple] = []
        self.compute = _Stream(self.log, "compute", immediate=True)
        self.copy = _Stream(self.log, "copy", immediate=False)
        self.current = self.compute
        self.events = 0

    def current_stream(self, device: torch.device) -> _Stream:
        return self.compute

    def copy_stream(self, device: torch.device) -> _Stream:
        return self.copy

    @contextlib.contextmanager
    def use(self, stream: _Stream):
        prev, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = prev

    def new_event(self) -> _Event:
        self.events += 1
        return _Event(self.log, self.events)

    def record_stream(self, t: torch.Tensor, stream: _Stream) -> None:
        self.log.append(("record_stream", t.data_ptr(), stream.name))

    def copy_(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.log.append(("copy", self.current.name, dst.data_ptr()))
        self.current.submit(lambda: dst.copy_(src))

    def to(self, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        out = torch.full(t.shape, 0xAB, dtype=t.dtype, device=device)  # a sentinel until the copy runs
        self.log.append(("to", self.current.name, t.data_ptr()))
        self.current.submit(lambda: out.copy_(t))
        return out


def _steps(log: list[tuple], start: int = 0) -> list[tuple]:
    return [e[:2] if e[0] in ("copy", "to") else e for e in log[start:] if e[0] != "record_stream"]


def test_host_copy_stream_protocol_on_a_recording_stand_in():
    streams = RecordingStreams()
    store = HostStore(streams=streams)
    assert store.prefetch  # an asynchronous store: backward starts restores a layer ahead
    data = torch.arange(256, dtype=torch.int32).view(torch.uint8)
    rec = store.put(data)
    # the copy stream waits for the producer, the copy is issued on the copy stream, an event after it
    assert _steps(streams.log) == [("wait_stream", "copy", "compute"), ("copy", "copy"), ("record", "E1", "copy")]
    assert ("record_stream", data.data_ptr(), "copy") in streams.log  # the source outlives the queued copy
    buf, event, dev = rec
    assert dev == data.device and not event.query()  # queued, not run: compute was not blocked by it
    n = len(streams.log)
    out = store.get(rec, data.device)
    # the restore waits on the offload's event, copies on the copy stream, then orders compute after the copy
    assert _steps(streams.log, n) == [("wait_event", "copy", "E1"), ("to", "copy"), ("wait_stream", "compute", "copy")]
    assert ("record_stream", out.data_ptr(), "compute") in streams.log
    assert torch.equal(out, data) and event.query()
    n = len(streams.log)
    del out
    store.free(rec)
    assert _steps(streams.log, n) == [("record", "E2", "copy")]  # after every copy so far: the restore's read
    n = len(streams.log)
    data2 = data.flip(0).clone()
    rec2 = store.put(data2)
    assert store.reused == 1 and rec2[0].data_ptr() == buf.data_ptr()  # the pooled buffer, same size
    # its last read (E2) is waited for before the new copy overwrites it
    assert _steps(streams.log, n) == [("wait_stream", "copy", "compute"), ("wait_event", "copy", "E2"),
                                      ("copy", "copy"), ("record", "E3", "copy")]
    assert torch.equal(store.get(rec2, data2.device), data2)


def test_restore_that_skips_the_event_reads_an_unfilled_buffer():
    """The stand-in can fail: reading the host buffer without waiting on the offload's event sees no bytes."""
    streams = RecordingStreams()
    store = HostStore(streams=streams)
    data = torch.full((64,), 7, dtype=torch.uint8)
    buf, event, _ = store.put(data)
    assert not torch.equal(buf, data)  # the copy is still queued on the copy stream
    streams.copy.wait_event(event)
    assert torch.equal(buf, data)


def test_pinned_exactly_for_cuda_sources():
    assert pin_host(torch.device("cuda", 0)) and pin_host("cuda")
    assert not pin_host("cpu") and not pin_host(torch.device("meta"))
    store = HostStore(streams=RecordingStreams())
    rec = store.put(torch.ones(32, dtype=torch.uint8))
    assert not rec[0].is_pinned()  # a CPU source: pageable, whatever streams carry the copy
    if not torch.cuda.is_available():  # why the decision matters: pinning needs an accelerator
        with pytest.raises(RuntimeError):
            torch.empty(4, pin_memory=True)


def test_stream_choice_follows_the_source_device():
    store = HostStore()
    assert store.streams_for(torch.device("cpu")) is SYNC
    assert isinstance(store.streams_for(torch.device("cuda", 0)), CudaStreams)  # made lazily, no CUDA call yet
    assert store.prefetch == torch.cuda.is_available()


def test_host_put_get_on_device_is_bit_exact(device):
    store = HostStore()
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        x = torch.randn(33, 17, generator=torch.Generator().manual_seed(0), dtype=torch.float64).to(dtype).to(device)
        raw = x.reshape(-1).view(torch.uint8)
        rec = store.put(raw)
        host = rec if rec.__class__ is not tuple else rec[0]
        assert host.device.type == "cpu" and host.is_pinned() == (device.type == "cuda")
        back = store.get(rec, device)
        assert back.device == device and torch.equal(back.view(dtype).view(33, 17), x)
        del back
        store.free(rec)


class _Strided(nn.Module):
    """Saves non-contiguous views: a transpose (``sin``), two strided column slices (``mul``) and a narrow."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        a = h.t().sin()
        b = h[:, ::2] * h[:, 1::2]
        c = h.narrow(0, 1, h.shape[0] - 2).exp()
        return a.sum() + b.sum() + c.sum()


@pytest.mark.parametrize("policy", ["host", "disk"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_offload_round_trip_bit_exact_on_the_source_device(device, dtype, policy, tmp_path):
    torch.manual_seed(0)
    model = _Strided(dtype).to(device)
    x = torch.randn(12, 16, generator=torch.Generator().manual_seed(1)).to(dtype).to(device).requires_grad_()
    ref = torch.autograd.grad(model(x), [x, *model.parameters()])
    mgr = ActivationManager(model, from_dict(MemoryPolicy, {"default": policy, "disk_path": str(tmp_path),
                                                            "disk_capacity_mib": 4}), copy_thread=False)
    with mgr:
        y = model(x)
    got = torch.autograd.grad(y, [x, *model.parameters()])
    stored = mgr.accounting.peak[policy]
    mgr.close()
    assert stored > 0 and mgr.accounting.peak["device"] == 0  # the saves went to the tier, none stayed resident
    # restored bitwise on the device they came from: the same gradients, on it, as without the manager
    assert all(g.device == device and torch.equal(g, r) for g, r in zip(got, ref))


def test_fp8_codes_and_scales_stay_on_the_source_device(device):
    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(2)).to(device)
    payload, scales = fp8.quantize(x, 128)
    keep = Backend(KeepStore(), use_fp8=True).pack(x)
    assert all(p.device == device for p in keep.parts)  # the device tier keeps codes and scales where x is
    assert keep.parts[0].view(torch.uint8).equal(payload.view(torch.uint8)) and keep.parts[1].equal(scales)
    host = Backend(HostStore(), use_fp8=True)
    packed = host.pack(x)
    assert packed.device == device
    out = host.unpack(packed)  # fetched back to the source device and decoded there
    assert out.device == device and out.equal(fp8.dequantize(payload, scales, x.shape, x.dtype))
    host.free(packed)
