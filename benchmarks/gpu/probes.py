"""The blocks of the GPU check (``benchmarks/gpu/check.py`` runs each as its own process group): one JSON object
per probe, written exclusively to ``--json PATH``; the driver judges its correctness flags.

- ``env``: the interpreter, the versions of moonrt's GPU-path packages (torch, numpy, pyyaml, numba, safetensors,
  tqdm, triton; ``pulp`` / ``highspy`` / ``pytest`` / ``fla`` only reported, never imported), the device
  (capability, memory, SMs, the shared-memory limit per block from torch and from Triton's driver), and this
  run's bf16 GEMM TFLOP/s (``8192^3``) and host <-> device copy GB/s, pinned and pageable (256 MiB).
- ``kda_triton`` / ``kda_model``: the Triton KDA against the fp64 recurrence and inside the model
  (:mod:`kda_probes`).
- ``train``: ``moonrt train`` on CUDA in bf16 with the Triton KDA, stopped and resumed from its checkpoint
  (tokens/s, model TFLOP/s, peak memory, ``resume_ok``; k3_tiny's losses beside the CPU fp32 reference recorded
  on the same corpus).
- ``fp8``: the FP8 block codec (:mod:`moonrt.ops.fp8.codec`, its Triton kernels on CUDA): bytes in and out,
  quantize / dequantize GB/s, codes, scales and decoded values bitwise equal to the CPU (numba) codec's.
- ``memory``: the host tier (:class:`moonrt.memory.backends.HostStore`) on CUDA: offload (device -> pinned host
  on the copy stream) and restore GB/s, whether ``put`` returned before its copy completed (the compute stream
  not blocked), bit-exact round trips for fp32 / bf16 / fp64 and strided tensors.
- ``moonep``: the torch MoonEP planner (:func:`moonrt.scheduler.moonep_torch.plan_torch`) at K3's shape (E=896,
  R=64, k=16, 4096 tokens per rank) on CUDA vs the numba planner and the torch planner on CPU: median ms per
  layer, plans identical; the device planner ``plan_device`` on CUDA (the greedy's Triton backend: median ms,
  identical to ``plan()``, planned under ``torch.cuda.set_sync_debug_mode("error")``: no host sync) and the closed
  form ``plan_prefix`` likewise (identical to ``plan(method="prefix")``).

Run one: ``python benchmarks/gpu/probes.py env --json OUT.json`` (``--device cpu``: a small smoke run of the same
code).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
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


REQUIRED = ("torch", "numpy", "yaml", "numba", "safetensors", "tqdm", "triton")
"""What moonrt's GPU path imports (``moonrt train --device cuda``, the Triton kernels)."""

OPTIONAL = ("pulp", "highspy", "pytest", "fla", "tensorboard")
"""Reported, never required (nor imported): the LP planners' solvers are not on the GPU path, and the device image
has no pytest or fla-core."""


def env(device: str = "cuda", gemm_n: int = 8192, copy_bytes: int = 256 * 2**20) -> dict[str, Any]:
    """The environment block: interpreter, package versions, the device (capability, memory, SMs, the per-block
    shared-memory limit as torch and Triton's driver report it), and this run's bf16 GEMM rate and host <-> device
    copy bandwidth (pinned and pageable; every later figure can be read against them). ``ok`` is False when a
    required package is missing or CUDA is not available."""
    import importlib.metadata as md
    import importlib.util

    out: dict[str, Any] = {"python": sys.version.split()[0], "executable": sys.executable,
                           "machine": platform.machine()}
    versions: dict[str, str | None] = {}
    missing = []
    for mod in REQUIRED:
        try:
            versions[mod] = getattr(importlib.import_module(mod), "__version__", None)
        except Exception as exc:  # noqa: BLE001 - reported, not raised
            missing.append(f"{mod} ({type(exc).__name__}: {exc})")
    for mod in OPTIONAL:  # find_spec: present or not, nothing imported
        dist = {"yaml": "pyyaml", "fla": "flash-linear-attention"}.get(mod, mod)
        try:
            versions[mod] = md.version(dist) if importlib.util.find_spec(mod) else None
        except md.PackageNotFoundError:
            versions[mod] = "present"
    out |= {"versions": versions, "missing": missing}
    import torch

    import moonrt

    out |= {"torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
            "moonrt": str(Path(moonrt.__file__).parent)}
    dev = torch.device(device)
    if dev.type == "cuda" and torch.cuda.is_available():
        p = torch.cuda.get_device_properties(dev)
        out |= {"device": p.name, "device_mem_bytes": p.total_memory, "capability": f"{p.major}.{p.minor}",
                "sm_count": p.multi_processor_count, "devices": torch.cuda.device_count(),
                "shared_mem_per_block_optin": getattr(p, "shared_memory_per_block_optin", None)}
        try:
            import triton

            props = triton.runtime.driver.active.utils.get_device_properties(dev.index or 0)
            out["triton_device"] = {k: props[k] for k in ("max_shared_mem", "max_num_regs", "multiprocessor_count",
                                                          "warpSize") if k in props}
        except Exception as exc:  # noqa: BLE001 - reported
            out["triton_device"] = f"{type(exc).__name__}: {exc}"
        out |= baseline(dev, gemm_n, copy_bytes)
    out["ok"] = not missing and (dev.type != "cuda" or out["cuda_available"])
    return out


def baseline(dev: Any, n: int, nbytes: int) -> dict[str, Any]:
    """This run's bf16 GEMM TFLOP/s (``n^3``, median of 10) and copy GB/s (``nbytes``, median of 5)."""
    import torch

    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    t = _timed(lambda: a @ b, repeat=10)
    out: dict[str, Any] = {"gemm_shape": [n, n, n], "gemm_s": t, "bf16_tflops": 2 * n**3 / t / 1e12}
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
        bits = torch.int16 if dtype == torch.bfloat16 else torch.int32  # decoded values compared bit for bit
        back = fp8.dequantize(payload[:512], scales[:512], xs.shape, xs.dtype).to("cpu")
        back_cpu = fp8.dequantize(pc, sc, xs.shape, xs.dtype)
        same_back = bool(torch.equal(back.view(bits), back_cpu.view(bits)))
        out[name] = {"bytes_in": nin, "bytes_out": nout, "ratio_out_in": nout / nin, "quantize_s": tq,
                     "quantize_GBps": nin / tq / 1e9, "dequantize_s": td, "dequantize_GBps": nin / td / 1e9,
                     "bitwise_equal_cpu_codec": same, "dequantize_bitwise_equal_cpu_codec": same_back,
                     "dequantize_finite": bool(torch.isfinite(back).all())}
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


def _metrics(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def train_figures(metrics: Path, reference: Path | None = None, corpus_sha256: str | None = None) -> dict[str, Any]:
    """Tokens/s (median over steps after the first 5: warm-up and Triton compiles), model TFLOP/s, peak memory,
    losses. With a CPU ``reference`` (``k3_tiny_cpu_fp32.json``) recorded on the same corpus (its
    ``corpus_sha256`` equal to ``corpus_sha256``): the final eval loss and the last 10 steps' mean train loss
    beside it; on another corpus the comparison is left out and ``cpu_fp32`` says why."""
    recs = _metrics(metrics)
    if not recs:
        raise ValueError(f"{metrics}: no step records")
    steady = recs[5:] or recs
    fig: dict[str, Any] = {"steps": recs[-1]["step"],
                           "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steady),
                           "peak_mem_bytes": max(r.get("peak_mem_bytes", 0) for r in recs),
                           "final_loss": recs[-1]["loss"],
                           "mean_loss_last10": statistics.fmean(r["loss"] for r in recs[-10:]),
                           "losses_finite": all(math.isfinite(r["loss"]) for r in recs)}
    tflops = [r["model_tflops_per_s"] for r in steady if r.get("model_tflops_per_s") is not None]
    if tflops:
        fig["model_tflops_per_s"] = statistics.median(tflops)
    evals = {r["step"]: r["eval_loss"] for r in recs if r.get("eval_loss") is not None}
    if evals:
        fig["eval_loss"] = evals[max(evals)]
        fig["eval_step"] = max(evals)
    if reference is not None:
        ref = json.loads(reference.read_text())
        if ref.get("corpus_sha256") != corpus_sha256:
            fig["cpu_fp32"] = (f"not compared: {reference.name} was recorded on corpus {ref.get('corpus_sha256')}, "
                               f"this run's is {corpus_sha256} (regenerate: python benchmarks/gpu/check.py "
                               "--cpu-reference)")
            return fig
        ref_eval = ref["eval_loss"].get(str(fig.get("eval_step")))
        ref_mean = statistics.fmean(ref["loss"][fig["steps"] - 10:fig["steps"]])
        fig["cpu_fp32"] = {"eval_loss": ref_eval, "mean_loss_last10": ref_mean, "source": reference.name}
        if ref_eval is not None and "eval_loss" in fig:
            fig["eval_loss_vs_cpu_fp32"] = fig["eval_loss"] / ref_eval - 1
        fig["mean_loss_vs_cpu_fp32"] = fig["mean_loss_last10"] / ref_mean - 1
    return fig


def train(work: str, name: str, args: list[str], steps: int, until: int | None, device: str = "cuda",
          kda: str = "triton", reference: str | None = None, corpus_sha256: str | None = None) -> dict[str, Any]:
    """``moonrt train`` on ``device`` (bf16 on CUDA) with ``kernels.kda = kda`` for ``steps`` steps; with
    ``until``, as two processes: the first stops (checkpointed) after step ``until``, the second resumes from that
    checkpoint to ``steps``. Figures: :func:`train_figures`, each process's wall seconds, the checkpoint
    directory's bytes, and ``resume_ok`` (the resumed process ran steps ``until + 1 .. steps`` and every loss is
    finite). Run and metrics go under ``work`` (not the returned folder: a checkpoint is large)."""
    import subprocess

    run, metrics = Path(work) / name, Path(work) / f"{name}.metrics.jsonl"
    base = [sys.executable, "-m", "moonrt.cli", "train", "--device", device, "--steps", str(steps), "--no-progress",
            "--out", str(run), "--metrics", str(metrics), "--set", f"kernels.kda={kda}", *args]
    if device == "cuda":
        base += ["--dtype", "bf16"]
    walls = []
    for extra in ([["--until", str(until)], ["--resume"]] if until else [[]]):
        t0 = time.perf_counter()
        proc = subprocess.run(base + extra, check=False)
        walls.append(time.perf_counter() - t0)
        if proc.returncode != 0:
            raise RuntimeError(f"{shlex.join(base + extra)}: exit {proc.returncode}")
    fig = train_figures(metrics, Path(reference) if reference else None, corpus_sha256)
    fig |= {"kda_kernel": kda, "process_wall_s": walls,
            "checkpoint_bytes": sum(p.stat().st_size for p in run.rglob("*") if p.is_file())}
    if until:
        steps_seen = [r["step"] for r in _metrics(metrics)]
        fig["resumed_from_step"] = until
        fig["resume_ok"] = steps_seen == list(range(1, steps + 1)) and fig["losses_finite"]
    return fig


def _kda(name: str) -> Callable[..., dict[str, Any]]:
    def run(**kwargs: Any) -> dict[str, Any]:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import kda_probes

        return getattr(kda_probes, name)(**kwargs)
    return run


PROBES: dict[str, Callable[..., dict[str, Any]]] = {
    "env": env, "kda_triton": _kda("kda_vs_reference"), "kda_model": _kda("kda_in_model"), "fp8": fp8_codec,
    "moonep": moonep, "memory": offload}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("probe", choices=[*PROBES, "train"])
    parser.add_argument("--json", required=True, help="write the result here (a new file)")
    parser.add_argument("--device", default="cuda", help="the device (cpu: a small smoke run of the same code, what "
                        "tests/jobs/test_gpu_check.py does)")
    parser.add_argument("--work", help="train: folder for the run and its metrics")
    parser.add_argument("--name", default="run", help="train: the run's name under --work")
    parser.add_argument("--steps", type=int, default=30, help="train: steps")
    parser.add_argument("--until", type=int, help="train: stop (checkpointed) after this step, then resume")
    parser.add_argument("--kda", default="triton", help="train: kernels.kda")
    parser.add_argument("--reference", help="train: the CPU fp32 reference JSON to compare the losses with")
    parser.add_argument("--corpus-sha256", help="train: the sha256 of the --corpus given in the train args")
    argv = sys.argv[1:] if argv is None else argv
    train_args = argv[argv.index("--") + 1:] if "--" in argv else []  # train: passed to moonrt train
    args = parser.parse_args(argv[:len(argv) - len(train_args) - (1 if "--" in argv else 0)])
    if os.path.lexists(args.json):
        print(f"--json = {args.json!r}: exists; expected a new path", file=sys.stderr)
        return 2
    if args.probe == "train":
        if not args.work:
            print("--work: required by the train probe", file=sys.stderr)
            return 2
        record = train(args.work, args.name, train_args, args.steps, args.until, args.device, args.kda,
                       args.reference, args.corpus_sha256)
    else:
        kwargs: dict[str, Any] = {"device": args.device}
        if args.device == "cpu":
            kwargs |= {"fp8": {"rows": 64}, "memory": {"part_bytes": 2**16}, "moonep": {"steps": 1},
                       "env": {"gemm_n": 256, "copy_bytes": 2**20}}.get(args.probe, {})
        record = PROBES[args.probe](**kwargs)
    _write(args.json, record)
    print(json.dumps(record, sort_keys=True, default=str))
    if record.get("ok") is False:  # env: written, then failed
        print(f"{args.probe}: missing {record.get('missing')}; cuda available: {record.get('cuda_available')}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
