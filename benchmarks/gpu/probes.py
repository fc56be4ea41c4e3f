"""The measurements of the GPU check (:mod:`benchmarks.gpu.check` runs each as its own process): one JSON object
per probe, written exclusively to ``--json PATH``.

- ``preflight``: the interpreter, torch and its CUDA build, the device, and whether moonrt's dependencies import.
- ``baseline``: the device's measured bf16 GEMM rate (TFLOP/s, ``8192^3``, median of timed repeats) and host <->
  device copy bandwidth, pinned and pageable (GB/s, 256 MiB): every later figure is also given as a ratio to these.
- ``fp8``: the FP8 block codec (:mod:`moonrt.ops.fp8.codec`) on CUDA: bytes in and out, quantize and dequantize GB/s
  of input bytes, and whether its codes and scales equal the CPU codec's bitwise on the same tensor.
- ``offload``: the host tier (:class:`moonrt.memory.backends.HostStore`) on CUDA: offload (device -> pinned host
  on the copy stream) and restore GB/s, whether ``put`` returned before its copy completed (the compute stream
  not blocked), bit-exact round trips for fp32 / bf16 / fp64 and strided tensors.
- ``moonep``: the torch MoonEP planner (:func:`moonrt.scheduler.moonep_torch.plan_torch`) at K3's shape (E=896,
  R=64, k=16, 4096 tokens per rank) on CUDA vs the numba planner and the torch planner on CPU: median ms per
  layer, plans identical; the device planner ``plan_device`` on CUDA (the greedy's Triton backend: median ms,
  identical to ``plan()``, planned under ``torch.cuda.set_sync_debug_mode("error")``: no host sync) and the closed
  form ``plan_prefix`` likewise (identical to ``plan(method="prefix")``).

Run one: ``python benchmarks/gpu/probes.py baseline --json OUT.json`` (needs CUDA except ``preflight``).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

GIB = 2**30


def _write(path: str, record: dict[str, Any]) -> None:
    with open(path, "x") as f:  # exclusive: the driver gives every probe a new path
        json.dump(record, f, indent=1, sort_keys=True)
        f.write("\n")


def _timed(fn: Callable[[], Any], repeat: int, warmup: int = 2, cuda: bool = True) -> float:
    """Median seconds of ``fn``: on the current CUDA stream (events around each call), else on the host clock."""
    import torch

    for _ in range(warmup):
        fn()
    if not cuda:
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def _sync(dev: Any) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def preflight() -> dict[str, Any]:
    out: dict[str, Any] = {"python": sys.version.split()[0], "executable": sys.executable,
                           "machine": platform.machine()}
    missing = []
    for mod in ("torch", "numpy", "yaml", "numba", "tqdm", "pulp", "highspy", "safetensors", "pytest"):
        try:
            importlib.import_module(mod)
        except Exception as exc:  # noqa: BLE001 - reported, not raised
            missing.append(f"{mod} ({type(exc).__name__}: {exc})")
    out["missing"] = missing
    import torch

    import moonrt

    out |= {"torch": torch.__version__, "torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
            "moonrt": str(Path(moonrt.__file__).parent)}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        out |= {"device": p.name, "device_mem_bytes": p.total_memory, "capability": f"{p.major}.{p.minor}",
                "devices": torch.cuda.device_count()}
    out["ok"] = not missing and out["cuda_available"]
    return out


def baseline() -> dict[str, Any]:
    import torch

    dev = torch.device("cuda")
    n = 8192
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    t = _timed(lambda: a @ b, repeat=10)
    out: dict[str, Any] = {"gemm_shape": [n, n, n], "gemm_s": t, "bf16_tflops": 2 * n**3 / t / 1e12,
                           "device": torch.cuda.get_device_name(0),
                           "device_mem_bytes": torch.cuda.get_device_properties(0).total_memory}
    nbytes = 256 * 2**20
    d = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    for kind, pinned in (("pinned", True), ("pageable", False)):
        h = torch.empty(nbytes, dtype=torch.uint8, device="cpu", pin_memory=pinned)
        out[f"h2d_{kind}_GBps"] = nbytes / _timed(lambda h=h, nb=pinned: d.copy_(h, non_blocking=nb), 5) / 1e9
        out[f"d2h_{kind}_GBps"] = nbytes / _timed(lambda h=h, nb=pinned: h.copy_(d, non_blocking=nb), 5) / 1e9
    out["copy_bytes"] = nbytes
    return out


def fp8_codec(device: str = "cuda", rows: int = 16384) -> dict[str, Any]:
    import torch

    import moonrt.ops.fp8.codec as fp8

    dev = torch.device(device)
    cuda = dev.type == "cuda"
    g = torch.Generator(device="cpu").manual_seed(0)
    out: dict[str, Any] = {"device": str(dev)}
    for dtype, name in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
        x = torch.randn(rows, 4096, generator=g).to(dtype).to(dev)  # 16384 rows: 128 MiB bf16, 256 MiB fp32
        nin = x.numel() * x.element_size()
        tq = _timed(lambda x=x: fp8.quantize(x, 128), repeat=5, cuda=cuda)
        payload, scales = fp8.quantize(x, 128)
        nout = payload.numel() + scales.numel() * 4
        td = _timed(lambda p=payload, s=scales, x=x: fp8.dequantize(p, s, x.shape, x.dtype), repeat=5, cuda=cuda)
        assert payload.device == dev and scales.device == dev, "fp8 codes / scales left the source device"
        xs = x[:512].to("cpu")  # the CPU codec (numba) on the same rows: bitwise the same codes and scales
        pc, sc = fp8.quantize(xs, 128)
        same = bool(torch.equal(pc.view(torch.uint8), payload[:512].to("cpu").view(torch.uint8))
                    and torch.equal(sc, scales[:512].to("cpu")))
        out[name] = {"bytes_in": nin, "bytes_out": nout, "ratio_out_in": nout / nin, "quantize_s": tq,
                     "quantize_GBps": nin / tq / 1e9, "dequantize_s": td, "dequantize_GBps": nin / td / 1e9,
                     "bitwise_equal_cpu_codec": same}
        del x, payload, scales
    return out


def offload(device: str = "cuda", part_bytes: int = 64 * 2**20) -> dict[str, Any]:
    import torch

    from moonrt.memory.backends import HostStore

    dev = torch.device(device)
    store = HostStore()
    parts = [torch.randint(0, 256, (part_bytes,), dtype=torch.uint8, device=dev) for _ in range(8)]  # 512 MiB
    nbytes = sum(p.numel() for p in parts)
    _sync(dev)
    t0 = time.perf_counter()
    recs = [store.put(p) for p in parts]
    issued = time.perf_counter() - t0
    events = [r[1] for r in recs if r.__class__ is tuple]  # a CPU source's records are synchronous: no event
    pending = sum(not e.query() for e in events)  # copies not complete when every put had returned
    for e in events:
        e.synchronize()
    put_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    backs = [store.get(r, dev) for r in recs]
    _sync(dev)
    get_s = time.perf_counter() - t0
    exact = all(torch.equal(a, b) for a, b in zip(parts, backs))
    del backs
    for r in recs:
        store.free(r)
    t0 = time.perf_counter()  # the second round reuses the pooled pinned buffers
    recs = [store.put(p) for p in parts]
    backs = [store.get(r, dev) for r in recs]
    _sync(dev)
    steady_s = time.perf_counter() - t0
    exact = exact and all(torch.equal(a, b) for a, b in zip(parts, backs))
    reused = store.reused
    del backs
    for r in recs:
        store.free(r)
    dtypes_exact = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        x = torch.randn(1024, 1536, device=dev, dtype=torch.float64).to(dtype)
        view = x.t()[::2]  # strided: the whole storage travels, the view is rebuilt on the device
        st = view.untyped_storage()
        rec = store.put(torch.empty(0, dtype=torch.uint8, device=dev).set_(st))
        flat = store.get(rec, dev)
        back = torch.empty(0, dtype=dtype, device=dev).set_(flat.untyped_storage(), view.storage_offset(),
                                                             view.shape, view.stride())
        dtypes_exact[str(dtype).removeprefix("torch.")] = bool(torch.equal(back, view) and back.device == dev)
        del flat, back
        store.free(rec)
    return {"device": str(dev), "bytes": nbytes, "put_issue_s": issued, "puts_pending_at_return": pending,
            "parts": len(parts),
            "offload_s": put_s, "offload_GBps": nbytes / put_s / 1e9, "restore_s": get_s,
            "restore_GBps": nbytes / get_s / 1e9, "round_trip_reused_s": steady_s,
            "round_trip_reused_GBps": 2 * nbytes / steady_s / 1e9, "buffers_reused": reused,
            "bit_exact": exact, "strided_bit_exact": dtypes_exact}


def moonep(device: str = "cuda", steps: int = 2) -> dict[str, Any]:
    import numpy as np
    import torch

    from moonrt.scheduler.moonep import plan
    from moonrt.scheduler.moonep_torch import plan_device, plan_prefix, plan_torch
    from moonrt.scheduler.workload import synthetic

    wl = synthetic("lognormal", steps=steps, layers=2, seed=0)  # K3: E=896, R=64, k=16, 4096 tokens per rank
    counts = [wl.counts[t, l] for t in range(steps) for l in range(2)]
    dev = torch.device(device)
    gpu, gpu_fixed, gpu_prefix, cpu_torch, cpu_numba = [], [], [], [], []
    same, same_fixed, same_prefix = True, True, True
    plan(counts[0])  # numba compile outside the timing
    for c in counts:
        ct = torch.from_numpy(np.ascontiguousarray(c))
        cg = ct.to(dev)
        gpu.append(_timed(lambda cg=cg: plan_torch(cg, validate=False), repeat=20, warmup=3, cuda=dev.type == "cuda"))
        gpu_fixed.append(_timed(lambda cg=cg: plan_device(cg, validate=False), repeat=20, warmup=3,
                                cuda=dev.type == "cuda"))
        gpu_prefix.append(_timed(lambda cg=cg: plan_prefix(cg, validate=False), repeat=20, warmup=3,
                                 cuda=dev.type == "cuda"))
        if dev.type == "cuda":  # any host synchronization inside the device planners raises here
            torch.cuda.set_sync_debug_mode("error")
            try:
                fixed = plan_device(cg, validate=False)
                closed = plan_prefix(cg, validate=False)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        else:
            fixed = plan_device(cg, validate=False)
            closed = plan_prefix(cg, validate=False)
        fields = ("alloc", "copies", "capacity", "cuts", "donor")
        ref_closed = plan(c, method="prefix")
        same_prefix = same_prefix and all(np.array_equal(getattr(ref_closed, f), getattr(closed.to_numpy(), f))
                                          for f in fields)
        t0 = time.perf_counter()
        ref = plan(c)
        same_fixed = same_fixed and all(np.array_equal(getattr(ref, f), getattr(fixed.to_numpy(), f)) for f in fields)
        cpu_numba.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        plan_torch(ct, validate=False)
        cpu_torch.append(time.perf_counter() - t0)
        got = plan_torch(cg, validate=False).to_numpy()
        same = same and all(np.array_equal(getattr(ref, f), getattr(got, f))
                            for f in ("alloc", "copies", "capacity", "cuts", "donor"))
    R, E = counts[0].shape
    return {"device": str(dev), "E": E, "R": R, "layers_timed": len(counts), "torch_threads": torch.get_num_threads(),
            "device_torch_ms": statistics.median(gpu) * 1e3, "cpu_torch_ms": statistics.median(cpu_torch) * 1e3,
            "cpu_numba_ms": statistics.median(cpu_numba) * 1e3, "plans_identical": same,
            "device_plan_device_ms": statistics.median(gpu_fixed) * 1e3, "plan_device_identical": same_fixed,
            "device_plan_prefix_ms": statistics.median(gpu_prefix) * 1e3, "plan_prefix_identical": same_prefix}


PROBES: dict[str, Callable[[], dict[str, Any]]] = {
    "preflight": preflight, "baseline": baseline, "fp8": fp8_codec, "offload": offload, "moonep": moonep}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("probe", choices=sorted(PROBES))
    parser.add_argument("--json", required=True, help="write the result here (a new file)")
    parser.add_argument("--device", default="cuda", help="fp8, offload, moonep: the device (cpu: a small smoke run "
                        "of the same code, what tests/jobs/test_gpu_check.py does)")
    args = parser.parse_args(argv)
    if os.path.lexists(args.json):
        print(f"--json = {args.json!r}: exists; expected a new path", file=sys.stderr)
        return 2
    small = args.device == "cpu"
    kwargs: dict[str, Any] = {}
    if args.probe in ("fp8", "offload", "moonep"):
        kwargs["device"] = args.device
    if small:
        kwargs |= {"fp8": {"rows": 64}, "offload": {"part_bytes": 2**16}, "moonep": {"steps": 1}}.get(args.probe, {})
    record = PROBES[args.probe](**kwargs)
    _write(args.json, record)
    print(json.dumps(record, sort_keys=True))
    if record.get("ok") is False:  # preflight: written, then failed
        print(f"{args.probe}: missing {record.get('missing')}; cuda available: {record.get('cuda_available')}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
