"""A rank's CUDA work runs on its own GPU (issue 47 item 5), checked on CPU with recorders standing in for CUDA.

- Triton host wrappers (KDA, FP8 codec, MoonEP planner) make the input's GPU current before they allocate or
  launch: a tensor on ``cuda:1`` called from a thread whose current device is 0 launches on 1;
- the activation manager's worker threads (FP8 quantize/decode on the copy thread, prefetch) start on the rank's
  device, not on device 0 where every new thread starts;
- ``init_distributed`` on NCCL passes ``device_id`` (the rank's GPU) to ``init_process_group``: communicators are
  made eagerly, so a group's first op may be a ``batch_isend_irecv`` between some of its ranks.

CUDA is stood in for by a per-thread "current device" that ``torch.cuda.set_device`` / ``torch.cuda.device`` move
and ``torch.cuda.current_device`` reads (a new thread starts on device 0, as CUDA's runtime does), and by a CPU tensor
that reports ``cuda:1``.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from moonrt.cluster.detect import Rendezvous


class _OnCuda1(torch.Tensor):
    """A CPU tensor that reports ``device == cuda:1`` (everything else is the CPU tensor's)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if getattr(func, "__self__", None) is torch.Tensor.device:  # the property's __get__
            return torch.device("cuda", 1)
        return super().__torch_function__(func, types, args, kwargs or {})


def _on_cuda1(t: torch.Tensor) -> torch.Tensor:
    return t.as_subclass(_OnCuda1)


class _Entered(Exception):
    """Raised by the recorder's device context on entry: the wrapper asked for the device before doing anything."""


class FakeCuda:
    """Per-thread current CUDA device (new threads: 0) behind ``set_device`` / ``device`` / ``current_device``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, stop_on_enter: bool = False) -> None:
        self._local = threading.local()
        self.entered: list[torch.device] = []
        self.set_calls: list[tuple[str, int]] = []
        fake = self

        class device:  # noqa: N801 - stands in for torch.cuda.device
            def __init__(self, d: Any) -> None:
                self.d = torch.device(d)

            def __enter__(self) -> None:
                fake.entered.append(self.d)
                if stop_on_enter:
                    raise _Entered(self.d)
                self.prev = fake.current_device()
                fake._local.dev = self.d.index

            def __exit__(self, *exc: object) -> None:
                fake._local.dev = self.prev

        monkeypatch.setattr(torch.cuda, "device", device)
        monkeypatch.setattr(torch.cuda, "set_device", self.set_device)
        monkeypatch.setattr(torch.cuda, "current_device", self.current_device)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)

    def current_device(self) -> int:
        return getattr(self._local, "dev", 0)

    def set_device(self, d: Any) -> None:
        index = d if isinstance(d, int) else torch.device(d).index
        self.set_calls.append((threading.current_thread().name, index))
        self._local.dev = index


# ---- 1. Triton host wrappers -----------------------------------------------------------------------------------


def _kda_inputs(cuda1: str) -> dict[str, torch.Tensor]:
    B, T, H, K, V = 1, 16, 1, 16, 16
    g = torch.Generator().manual_seed(0)
    x = {"q": torch.randn(B, T, H, K, generator=g), "k": torch.randn(B, T, H, K, generator=g),
         "v": torch.randn(B, T, H, V, generator=g), "g": -torch.rand(B, T, H, K, generator=g),
         "beta": torch.rand(B, T, H, generator=g)}
    x[cuda1] = _on_cuda1(x[cuda1])
    return x


def _calls(triton_kernels) -> dict[str, Any]:
    kda = triton_kernels.load("moonrt.ops.kda.backends.triton")
    fp8 = triton_kernels.load("moonrt.ops.fp8.triton")
    moonep = triton_kernels.load("moonrt.ops.moonep.triton")

    def chunk():
        x = _kda_inputs("q")
        kda.kda_chunk(x["q"], x["k"], x["v"], x["g"], x["beta"])

    def transition():
        x = _kda_inputs("k")
        with torch.no_grad():
            kda.kda_transition(x["k"], x["v"], x["g"], x["beta"], chunk_size=16)

    def state_grad():
        x = _kda_inputs("q")
        kda.kda_state_grad(x["q"], x["k"], x["v"], x["g"], x["beta"], torch.randn(1, 16, 1, 16), chunk_size=16)

    return {
        "kda_chunk": chunk,
        "kda_transition": transition,
        "kda_state_grad": state_grad,
        "fp8_quantize": lambda: fp8.quantize_rows(_on_cuda1(torch.randn(4, 256)), 128),
        "fp8_dequantize": lambda: fp8.dequantize_rows(_on_cuda1(torch.zeros(4, 256, dtype=torch.uint8)),
                                                      torch.ones(4, 2), 256),
        "moonep_greedy": lambda: moonep.greedy(_on_cuda1(torch.ones(2, 4, dtype=torch.int64)),
                                               torch.full((2,), 4, dtype=torch.int64)),
    }


@pytest.mark.parametrize("op", ["kda_chunk", "kda_transition", "kda_state_grad", "fp8_quantize", "fp8_dequantize",
                                "moonep_greedy"])
def test_triton_wrapper_makes_the_inputs_gpu_current_first(op, triton_kernels, monkeypatch):
    """Called from a thread whose current device is 0 with an input on ``cuda:1``, each Triton host wrapper enters
    ``cuda:1``'s device context before it allocates or launches anything (the recorder stops the call there: the
    stand-in tensor cannot be allocated next to on a CPU build)."""
    call = _calls(triton_kernels)[op]
    fake = FakeCuda(monkeypatch, stop_on_enter=True)
    assert fake.current_device() == 0
    with pytest.raises(_Entered):
        call()
    assert fake.entered == [torch.device("cuda", 1)]


def test_triton_wrapper_on_cpu_tensors_enters_no_cuda_context(triton_kernels, monkeypatch):
    """Under the interpreter (CPU tensors) the wrappers run as before: no CUDA device context is touched."""
    fp8 = triton_kernels.load("moonrt.ops.fp8.triton")
    fake = FakeCuda(monkeypatch, stop_on_enter=True)
    x = torch.randn(3, 200)
    payload, scales = fp8.quantize_rows(x, 128)
    assert fake.entered == [] and payload.shape == (3, 256) and scales.shape == (3, 2)


# ---- 1. the activation manager's worker threads ---------------------------------------------------------------


def test_manager_worker_threads_start_on_the_ranks_device(monkeypatch):
    """The rank made ``cuda:1`` current (``moonrt train``'s bind_device); the manager's copy thread (FP8
    quantize/decode, host copies) and prefetch thread then run with device 1 current, not device 0."""
    from moonrt.memory.manager import ActivationManager
    from moonrt.memory.policy import MemoryPolicy

    fake = FakeCuda(monkeypatch)
    torch.cuda.set_device(1)
    mgr = ActivationManager(torch.nn.Linear(4, 4), MemoryPolicy(prefetch=True), copy_thread=True)
    try:
        pools = {"copy": mgr._copier, "prefetch": mgr._pool}
        on = {name: pool.submit(torch.cuda.current_device).result(timeout=30) for name, pool in pools.items()}
    finally:
        mgr.close()
    assert on == {"copy": 1, "prefetch": 1}
    assert {name.split("_")[0] for name, d in fake.set_calls if d == 1} >= {"moonrt-host-copy", "moonrt-prefetch"}


def test_manager_on_a_cpu_process_binds_no_device(monkeypatch):
    """Without CUDA in use the worker threads set no device (a CPU-only torch would raise; a CPU job on a GPU node
    makes no CUDA context)."""
    from moonrt.memory.manager import ActivationManager
    from moonrt.memory.policy import MemoryPolicy

    calls: list[object] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU node, CUDA not used by this job
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    mgr = ActivationManager(torch.nn.Linear(4, 4), MemoryPolicy(prefetch=True), copy_thread=True)
    try:
        assert mgr._copier.submit(lambda: 7).result(timeout=30) == 7
        assert mgr._pool.submit(lambda: 8).result(timeout=30) == 8
    finally:
        mgr.close()
    assert calls == []


# ---- 2. device_id at process-group init -----------------------------------------------------------------------


def _init_recorded(monkeypatch, backend: str, local_rank: int) -> tuple[FakeCuda, dict[str, Any]]:
    import torch.distributed as dist

    import moonrt.cluster.env as env
    from moonrt.config import DistConfig

    fake = FakeCuda(monkeypatch)
    seen: dict[str, Any] = {}

    def init_process_group(backend: str, **kwargs: Any) -> None:
        seen.update(kwargs, backend=backend, current=fake.current_device())

    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    monkeypatch.setattr(env, "detect_rendezvous", lambda: Rendezvous(0, 1, local_rank, None, None, "single"))
    env.init_distributed(DistConfig(backend=backend, timeout_s=30.0))
    return fake, seen


def test_nccl_init_passes_the_ranks_gpu_as_device_id(monkeypatch):
    """NCCL: ``device_id`` is the rank's GPU (``LOCAL_RANK`` modulo the GPUs seen), also made current first."""
    fake, seen = _init_recorded(monkeypatch, "nccl", local_rank=3)
    assert seen["backend"] == "nccl"
    assert seen["device_id"] == torch.device("cuda", 1)  # 3 % 2
    assert seen["current"] == 1


def test_gloo_init_passes_no_device_id(monkeypatch):
    """gloo (CPU): no ``device_id`` (it would bind a CUDA device to a CPU group)."""
    _, seen = _init_recorded(monkeypatch, "gloo", local_rank=1)
    assert seen["backend"] == "gloo" and seen.get("device_id") is None
