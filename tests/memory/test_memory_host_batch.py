"""Batched host copies of the activation manager (moonrt/memory/host_batch.py): a layer's host saves copied in
one call into one pooled buffer, inline or on a background thread; gradients bit for bit those of the run
without a manager, backward waits for a copy still running, a failed copy raises in backward."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from memory.helpers import Stack, _policy, _run, _run_mgr

from moonrt.memory.backends import HostStore
from moonrt.memory.manager import ActivationManager


def _spy(store: HostStore, delay: float = 0.0, fail: bool = False) -> list[tuple[str, int]]:
    """Wrap ``store.put_many``: record (thread name, number of parts) per call; optionally sleep / raise."""
    calls: list[tuple[str, int]] = []
    inner = store.put_many

    def put_many(datas, sizes):
        calls.append((threading.current_thread().name, len(datas)))
        if delay:
            time.sleep(delay)
        if fail:
            raise RuntimeError("host copy failed: out of pinned memory (test)")
        return inner(datas, sizes)

    store.put_many = put_many  # type: ignore[method-assign]
    return calls


@pytest.mark.parametrize("copy_thread", [True, False])
def test_one_copy_per_layer_exact(copy_thread):
    """Every host save goes through one ``put_many`` per layer (3 layers + the loss: 4 calls), on the
    copy thread or inline; gradients and accounting equal the per-save path's (``copy_batch_bytes=1``:
    one part per call)."""
    ref, _ = _run(None)
    torch.manual_seed(0)
    model = Stack()
    x = torch.randn(4, 16, 128, requires_grad=True)
    mgr = ActivationManager(model, _policy(default="host"), copy_thread=copy_thread)
    calls = _spy(mgr._stores["host"])
    with mgr:
        loss = model(x).float().square().mean()
    loss.backward()
    got = [p.grad for p in model.parameters()] + [x.grad]
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    assert len(calls) == 4 and all(n > 1 for _, n in calls[:3])  # 3 layers, then the loss outside them
    main = threading.current_thread().name
    assert all((name != main) is copy_thread for name, _ in calls)
    _, single = _run_mgr(_policy(default="host"), copy_batch_bytes=1)
    assert mgr.accounting.to_dict()["regions"] == single.accounting.to_dict()["regions"]
    assert mgr.accounting.peak == single.accounting.peak
    assert mgr.accounting.live == {"device": 0, "host": 0, "disk": 0, "remote": 0}
    mgr.close()
    single.close()


def test_backward_waits_for_a_slow_copy():
    """Copies that take longer than the rest of the forward: backward waits for them (exact gradients), and
    the wait is counted as exposed time."""
    ref, _ = _run(None)
    torch.manual_seed(0)
    model = Stack()
    x = torch.randn(4, 16, 128, requires_grad=True)
    mgr = ActivationManager(model, _policy(default="host"), copy_thread=True)
    calls = _spy(mgr._stores["host"], delay=0.3)
    with mgr:
        loss = model(x).float().square().mean()
    loss.backward()
    assert len(calls) == 4
    assert all(torch.equal(a, b) for a, b in zip([p.grad for p in model.parameters()] + [x.grad], ref))
    assert mgr.accounting.exposed_s > 0.0
    mgr.close()


@pytest.mark.parametrize("copy_thread", [True, False])
def test_failed_copy_raises_in_backward(copy_thread):
    torch.manual_seed(0)
    model = Stack()
    x = torch.randn(4, 16, 128, requires_grad=True)
    mgr = ActivationManager(model, _policy(default="host"), copy_thread=copy_thread)
    _spy(mgr._stores["host"], fail=True)
    with mgr:
        loss = model(x).float().square().mean()
    with pytest.raises(RuntimeError, match="host copy failed: out of pinned memory"):
        loss.backward()
    del loss
    mgr.close()


def test_mixed_dtypes_odd_sizes_and_offsets():
    """Parts of odd byte sizes and dtypes (bool, int64, float64, a float32 view at a storage offset) share one
    buffer: each part starts at a multiple of 64 bytes, so every view is rebuilt exactly."""

    class Odd(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            mask = x[:3, 0] > 0                                  # 3-byte bool storage
            idx = torch.arange(5)                                # int64
            y = x.double().sin()                                 # float64 save
            z = x[1:, 1:].exp()                                  # float32, saved as output
            w = torch.where(mask[:, None], x[:3] * 2.0, x[:3])
            return (y.float()[1:, 1:] * z).sum() + w.index_select(1, idx).square().sum()

    x0 = torch.randn(7, 9)
    x1 = x0.clone().requires_grad_(True)
    Odd()(x1).backward()
    model = Odd()
    mgr = ActivationManager(model, _policy(default="host"))
    x2 = x0.clone().requires_grad_(True)
    with mgr:
        out = model(x2)
    out.backward()
    assert torch.equal(x1.grad, x2.grad)
    assert mgr.accounting.live["host"] == 0
    mgr.close()


def test_views_saved_before_and_after_the_copy_bitwise():
    """Views of one storage saved while its group is pending are rebuilt with the copy (a slot each); a view saved
    after the group was submitted is rebuilt from the buffer at unpack: gradients equal the run without a manager
    bit for bit, and both ways were taken."""

    class A(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(16, 16))

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            h = torch.tanh(x @ self.w)  # saves h
            return h, (h[:, :8] * self.w[0, :8]).sum() + (h.t() @ self.w).square().sum()  # two more views of h

    class B(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(16, 16))

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            v = torch.tanh(self.w * 1.5)  # a save of layer b first: a's group is submitted
            return (h[1:] * v[0]).sum()  # then a view of a's storage

    class AB(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = A(), B()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h, s = self.a(x)
            return s + self.b(h)

    def run(mgr_on: bool) -> tuple[list[torch.Tensor], list[int]]:
        torch.manual_seed(0)
        model = AB()
        x = torch.randn(16, 16, requires_grad=True)
        slots: list[int] = []
        if not mgr_on:
            model(x).backward()
        else:
            mgr = ActivationManager(model, _policy(default="host"), copy_thread=True)
            inner = mgr._group_part

            def spy(grp, index, view, slot):
                slots.append(slot)
                return inner(grp, index, view, slot)

            mgr._group_part = spy  # type: ignore[method-assign]
            with mgr:
                out = model(x)
            out.backward()
            assert mgr.accounting.live["host"] == 0
            mgr.close()
        return [p.grad for p in model.parameters()] + [x.grad], slots

    ref, _ = run(False)
    got, slots = run(True)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    assert -1 in slots and sum(s >= 0 for s in slots) >= 3


def test_released_before_backward_returns_the_buffer():
    """A forward whose graph is dropped without backward: every group's buffer goes back to the pool."""
    torch.manual_seed(0)
    model = Stack()
    mgr = ActivationManager(model, _policy(default="host"))
    with mgr:
        loss = model(torch.randn(4, 16, 128)).square().mean()
    del loss
    store = mgr._stores["host"]
    assert mgr.accounting.live["host"] == 0 and store.pooled_bytes > 0
    mgr.close()
    assert store.pooled_bytes == 0


def test_fp8_quantized_on_the_copy_thread_bitwise(monkeypatch):
    """FP8 (device tier) batches are quantized on the copy thread: gradients, bytes per region and peaks equal
    the inline quantization's bit for bit; a failing quantization raises in backward."""
    import moonrt.ops.fp8.codec as fp8

    threads: list[str] = []
    inner = fp8.quantize_many

    def spy(xs, block=128, **kw):
        threads.append(threading.current_thread().name)
        return inner(xs, block, **kw)

    monkeypatch.setattr(fp8, "quantize_many", spy)
    got, bg = _run_mgr(_policy(default="fp8"), copy_thread=True)
    assert threads and all(t.startswith("moonrt-host-copy") for t in threads)
    threads.clear()
    ref, inline = _run_mgr(_policy(default="fp8"), copy_thread=False)
    assert threads and all(t == threading.current_thread().name for t in threads)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    assert bg.accounting.to_dict()["regions"] == inline.accounting.to_dict()["regions"]
    assert bg.accounting.peak == inline.accounting.peak and bg.accounting.live["device"] == 0
    bg.close()
    inline.close()

    def fail(xs, block=128, **kw):
        raise RuntimeError("quantize failed (test)")

    monkeypatch.setattr(fp8, "quantize_many", fail)
    torch.manual_seed(0)
    model = Stack()
    mgr = ActivationManager(model, _policy(default="fp8"), copy_thread=True)
    with mgr:
        loss = model(torch.randn(4, 16, 128, requires_grad=True)).square().mean()
    with pytest.raises(RuntimeError, match="quantize failed"):
        loss.backward()
    del loss
    mgr.close()


def _two_in_flight(copy_thread: bool) -> tuple[list[torch.Tensor], ActivationManager]:
    """Two forwards under one manager, then their backwards in reverse order (a pipeline's microbatches)."""
    torch.manual_seed(0)
    model = Stack()
    mgr = ActivationManager(model, _policy(default="fp8"), copy_thread=copy_thread)
    xs = [torch.randn(4, 16, 128, requires_grad=True) for _ in range(2)]
    losses = []
    for x in xs:
        with mgr:
            losses.append(model(x).square().mean())
    for loss in reversed(losses):
        loss.backward()
    return [p.grad.clone() for p in model.parameters()] + [x.grad.clone() for x in xs], mgr


def test_fp8_decoded_ahead_on_the_copy_thread_bitwise(monkeypatch):
    """In backward, the first unpack of an FP8 batch queues the decode of the batches quantized before it (same
    forward) on the copy thread: gradients equal the inline run's bit for bit, also with two forwards in flight;
    nothing is left queued; a failing decode raises in backward."""
    import moonrt.ops.fp8.codec as fp8

    threads: list[str] = []
    inner = fp8.dequantize_many

    def spy(items, **kw):
        threads.append(threading.current_thread().name)
        return inner(items, **kw)

    monkeypatch.setattr(fp8, "dequantize_many", spy)
    got, bg = _run_mgr(_policy(default="fp8"), copy_thread=True)
    # the loss's one-save batch (the root's, quantized last) is decoded alone by its unpack, which queues Stack's
    # layers 2 and 1; layer 2's first unpack queues layer 0: every batched decode ran on the copy thread
    assert len(threads) == 3 and all(t.startswith("moonrt-host-copy") for t in threads)
    ref, inline = _run_mgr(_policy(default="fp8"), copy_thread=False)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    assert bg.accounting.to_dict()["regions"] == inline.accounting.to_dict()["regions"]
    assert bg.accounting.live["device"] == 0 and not bg._decodable
    bg.close()
    inline.close()

    got, bg = _two_in_flight(copy_thread=True)
    ref, inline = _two_in_flight(copy_thread=False)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    assert bg.accounting.live["device"] == 0 and not bg._decodable
    bg.close()
    inline.close()

    def fail_on_thread(items, **kw):
        if threading.current_thread().name.startswith("moonrt-host-copy"):
            raise RuntimeError("decode failed (test)")
        return inner(items, **kw)

    monkeypatch.setattr(fp8, "dequantize_many", fail_on_thread)
    torch.manual_seed(0)
    model = Stack()
    mgr = ActivationManager(model, _policy(default="fp8"), copy_thread=True)
    with mgr:
        loss = model(torch.randn(4, 16, 128, requires_grad=True)).square().mean()
    with pytest.raises(RuntimeError, match="decode failed"):
        loss.backward()
    del loss
    mgr.close()


@pytest.mark.parametrize(("cpus", "env", "threads", "on"), [
    (4, {}, 1, True),  # idle CPUs: the copy thread hides the copies
    (4, {}, 4, False),  # every CPU runs intra-op threads: a copy thread would compete with them
    (4, {"LOCAL_WORLD_SIZE": "4"}, 1, False),  # four ranks share the node's four CPUs
    (4, {"OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, 1, True),  # two ranks of one thread on four CPUs
    (4, {"SLURM_NTASKS_PER_NODE": "2"}, 2, False),
])
def test_copy_thread_default_follows_idle_cpus(monkeypatch, cpus, env, threads, on):
    """``copy_thread=None`` (the default) starts the copy thread exactly when the process's CPUs, shared among
    the node's ranks, outnumber torch's intra-op threads; an explicit setting wins."""
    from moonrt.memory import manager as manager_mod

    for k in manager_mod.LOCAL_RANKS_ENV:
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(manager_mod.os, "sched_getaffinity", lambda pid: set(range(cpus)))
    monkeypatch.setattr(manager_mod.torch, "get_num_threads", lambda: threads)
    for arg, want in ((None, on), (True, True), (False, False)):
        mgr = ActivationManager(Stack(), _policy(default="host"), copy_thread=arg)
        assert (mgr._copier is not None) is want, arg
        mgr.close()


class _Shared(torch.nn.Module):
    """tanh's output saved by tanh itself and by three matmuls (four saves of one FP8 view), twice."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.ParameterList(
            torch.nn.Parameter(torch.randn(128, 128) / 12) for _ in range(3)) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for ws in self.layers:
            h = torch.tanh(x)
            x = x + h @ ws[0] + (h @ ws[1]).sin() + h @ ws[2]
        return x.square().mean()


@pytest.mark.parametrize("copy_thread", [True, False])
def test_fp8_view_saved_four_times_decodes_once(monkeypatch, copy_thread):
    """Four saves of one FP8 view share an entry: backward decodes it once (not once per save), releases the
    decoded tensor once every save has unpacked it (none is held after a retained-graph backward), and a second
    backward of the retained graph gives the same gradients."""
    import moonrt.ops.fp8.codec as fp8
    from moonrt.memory import backends

    decoded: list[int] = []
    inner_many, inner_one = fp8.dequantize_many, backends.fp8.dequantize

    def many(items, **kw):
        decoded.extend(int(p.shape[0]) for p, _, _, _ in items)
        return inner_many(items, **kw)

    def one(payload, scales, shape, dtype, **kw):
        decoded.append(int(payload.shape[0]))
        return inner_one(payload, scales, shape, dtype, **kw)

    monkeypatch.setattr(fp8, "dequantize_many", many)
    monkeypatch.setattr(backends.fp8, "dequantize", one)
    torch.manual_seed(0)
    model = _Shared()
    mgr = ActivationManager(model, _policy(default="fp8"), copy_thread=copy_thread)
    x = torch.randn(64, 128, requires_grad=True)
    with mgr:
        loss = model(x)
    entries = list(mgr._entries.values())
    assert sorted(e.refs for e in entries) == [1, 1, 1, 4, 4]  # the two tanh outputs: four saves each
    loss.backward(retain_graph=True)
    assert sum(decoded) == sum(e.packed.meta[3][0] for e in entries if e.packed.meta[0] == "fp8")  # each once
    assert all(e.decoded is None for e in entries)
    first = [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]
    model.zero_grad(set_to_none=True)
    x.grad = None
    loss.backward()
    assert all(torch.equal(a, b) for a, b in zip(first, [p.grad for p in model.parameters()] + [x.grad]))
    del loss
    assert mgr.accounting.live["device"] == 0
    mgr.close()
