"""The prepared single-GPU check of issue 30 (``benchmarks/gpu/check.sh`` runs it): every step is its own process,
so one failing or crashing step records its error and the others still run; the exit code is 1 when any step
failed, 2 on bad input, 0 otherwise.

Steps, in order (``--dry-run`` prints each with its exact command and exits 0 without importing torch):

1. ``preflight``: the interpreter, torch's CUDA build, the device, moonrt's dependencies (:mod:`probes`).
2. ``baseline``: this run's measured bf16 GEMM rate and host <-> device copy bandwidth, pinned and pageable;
   every later figure is also given as a ratio to these.
3. ``tests``: the CPU suite's device-parametrized tests (those taking the ``device`` fixture of
   ``tests/conftest.py``, the per-layout device-discipline and NCCL-op checks, the CUDA-only train test) with
   ``MOONRT_TEST_DEVICE=cuda``, so each runs on cpu and on cuda.
4. ``fp8``, 5. ``offload``, 6. ``moonep``: the FP8 codec, the host offload tier and the torch MoonEP planner on
   CUDA (:mod:`probes`).
7. ``train_k3_tiny``, 8. ``train_k3_100m``: ``moonrt train --device cuda --dtype bf16`` for ``--steps`` steps of
   k3_tiny and of the ~100M-parameter K3 of ``k3_100m.yaml``: tokens/s, model TFLOP/s, peak memory
   (``torch.cuda.max_memory_allocated``, the metrics' ``peak_mem_bytes``), losses; k3_tiny's losses beside the
   recorded CPU fp32 run of the same job (``k3_tiny_cpu_fp32.json``).

The whole check is held to ``--budget-s`` (default 450 s): each step's timeout is the smaller of its own and what
is left; a step that finds no time left is recorded as not run. Outputs go under ``--out`` (default
``runs/gpu-check``), a new directory (``--force``: reuse one that a previous check made, replacing its outputs):
``check.json`` (every step: command, exit code, wall time, figures, ratios, error), ``table.md`` (the table
printed at the end), ``steps/<step>.log`` and ``.json``, ``train/<run>/`` and ``train/<run>.metrics.jsonl``.

The device machine has no network: nothing is installed. The interpreter (``$PYTHON``, else ``.venv/bin/python``,
else ``python3``, chosen by ``check.sh``) needs torch with CUDA and moonrt's dependencies; moonrt itself is
imported from this checkout (``PYTHONPATH``), so an interpreter of the device image with torch suffices.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
MARKER = ".moonrt-gpu-check"
"""The file that marks a directory as a GPU check's output (``--force`` reuses only such a directory)."""
REFERENCE = HERE / "k3_tiny_cpu_fp32.json"


@dataclasses.dataclass
class Step:
    name: str
    argv: list[str]
    timeout_s: float
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    what: str = ""
    outputs: list[Path] = dataclasses.field(default_factory=list)
    """Paths the step writes (removed first under ``--force``)."""


def device_test_files(root: Path = ROOT) -> list[str]:
    """Test files (relative to ``root``) that run on CUDA there: a test function taking the ``device`` fixture, a
    module reading ``MOONRT_TEST_DEVICE`` itself (the per-layout device-discipline and NCCL-op checks), or a test
    skipped here for want of a CUDA device (not this check's own tests, which expect a machine without CUDA)."""
    pat = re.compile(r"^def test_\w+\([^)]*\bdevice\b|MOONRT_TEST_DEVICE|reason=\"needs a CUDA device\"", re.M)
    return sorted(str(p.relative_to(root)) for p in (root / "tests").rglob("test_*.py")
                  if p.name != "test_gpu_check.py" and pat.search(p.read_text()))


def plan(out: Path, py: str, steps: int) -> list[Step]:
    """The steps of the check writing under ``out``, run by the interpreter ``py``."""
    s = out / "steps"
    t = out / "train"
    probe = [py, str(HERE / "probes.py")]
    tests = device_test_files()
    train = [py, "-m", "moonrt.cli", "train", "--device", "cuda", "--dtype", "bf16", "--steps", str(steps),
             "--no-progress"]
    runs = {"k3_tiny": ["--eval-every", "25"], "k3_100m": ["--config", str(HERE / "k3_100m.yaml")]}
    out_steps = [
        Step("preflight", [*probe, "preflight", "--json", str(s / "preflight.json")], 60,
             what="interpreter, torch CUDA build, device, dependencies"),
        Step("baseline", [*probe, "baseline", "--json", str(s / "baseline.json")], 90,
             what="bf16 GEMM TFLOP/s; host<->device GB/s pinned and pageable"),
        Step("tests", [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--basetemp", str(s / "pytest-tmp"),
                       "--junitxml", str(s / "tests.xml"), *tests], 240, env={"MOONRT_TEST_DEVICE": "cuda"},
             what=f"device-parametrized tests on cpu and cuda ({len(tests)} files)", outputs=[s / "pytest-tmp"]),
        Step("fp8", [*probe, "fp8", "--json", str(s / "fp8.json")], 60, what="FP8 codec on CUDA: bytes, GB/s"),
        Step("offload", [*probe, "offload", "--json", str(s / "offload.json")], 60,
             what="host offload tier on CUDA: GB/s, bit-exact"),
        Step("moonep", [*probe, "moonep", "--json", str(s / "moonep.json")], 60,
             what="torch MoonEP planner at K3's shape, GPU vs CPU"),
    ]
    for name, extra in runs.items():
        metrics = t / f"{name}.metrics.jsonl"
        out_steps.append(Step(f"train_{name}", [*train, *extra, "--out", str(t / name), "--metrics", str(metrics)],
                              120 if name == "k3_tiny" else 240, what=f"moonrt train {name} bf16 on cuda",
                              outputs=[t / name, metrics]))
    for st in out_steps:
        st.outputs += [s / f"{st.name}.log", s / f"{st.name}.json"]
    return out_steps


def command_line(step: Step) -> str:
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in step.env.items())
    return (env + " " if env else "") + shlex.join(step.argv)


# ---- reading results ---------------------------------------------------------------------------------------------


def _metrics(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def train_figures(metrics: Path, reference: Path | None) -> dict[str, Any]:
    """Tokens/s (median over steps after the first 5: warm-up), model TFLOP/s, peak memory, losses; with a
    reference, the final eval loss and the last 10 steps' mean train loss beside it."""
    recs = _metrics(metrics)
    if not recs:
        raise ValueError(f"{metrics}: no step records")
    steady = recs[5:] or recs
    fig: dict[str, Any] = {"steps": recs[-1]["step"],
                           "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steady),
                           "peak_mem_bytes": max(r.get("peak_mem_bytes", 0) for r in recs),
                           "final_loss": recs[-1]["loss"],
                           "mean_loss_last10": statistics.fmean(r["loss"] for r in recs[-10:])}
    tflops = [r["model_tflops_per_s"] for r in steady if r.get("model_tflops_per_s") is not None]
    if tflops:
        fig["model_tflops_per_s"] = statistics.median(tflops)
    evals = {r["step"]: r["eval_loss"] for r in recs if r.get("eval_loss") is not None}
    if evals:
        fig["eval_loss"] = evals[max(evals)]
        fig["eval_step"] = max(evals)
    if reference is not None:
        ref = json.loads(reference.read_text())
        ref_eval = ref["eval_loss"].get(str(fig.get("eval_step")))
        ref_mean = statistics.fmean(ref["loss"][fig["steps"] - 10:fig["steps"]])
        fig["cpu_fp32"] = {"eval_loss": ref_eval, "mean_loss_last10": ref_mean, "source": reference.name}
        if ref_eval is not None and "eval_loss" in fig:
            fig["eval_loss_vs_cpu_fp32"] = fig["eval_loss"] / ref_eval - 1
        fig["mean_loss_vs_cpu_fp32"] = fig["mean_loss_last10"] / ref_mean - 1
    return fig


def test_figures(xml: Path) -> dict[str, Any]:
    import xml.etree.ElementTree as ET

    root = ET.parse(xml).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    total = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    cases = [c for s in suites for c in s.iter("testcase")]
    total["cuda_cases"] = sum("cuda" in c.get("name", "").split("[", 1)[-1] for c in cases if "[" in c.get("name", ""))
    failed = [f"{c.get('classname')}::{c.get('name')}" for c in cases
              if c.find("failure") is not None or c.find("error") is not None]
    total["failed"] = failed[:20]
    return total


def ratios(name: str, fig: dict[str, Any], base: dict[str, Any] | None) -> dict[str, Any]:
    """The step's figures as ratios to this run's baseline (GEMM rate, copy bandwidth, device memory)."""
    if not base:
        return {}
    gemm, d2h, h2d = base.get("bf16_tflops"), base.get("d2h_pinned_GBps"), base.get("h2d_pinned_GBps")
    mem, gemm_s = base.get("device_mem_bytes"), base.get("gemm_s")
    out: dict[str, Any] = {}
    if name.startswith("train_"):
        if gemm and fig.get("model_tflops_per_s") is not None:
            out["model_tflops_over_gemm"] = fig["model_tflops_per_s"] / gemm
        if mem:
            out["peak_mem_over_device_mem"] = fig["peak_mem_bytes"] / mem
    elif name == "fp8" and d2h:
        for k in ("bf16", "fp32"):
            if k in fig:
                out[f"{k}_quantize_over_d2h"] = fig[k]["quantize_GBps"] / d2h
                out[f"{k}_dequantize_over_h2d"] = fig[k]["dequantize_GBps"] / h2d if h2d else None
    elif name == "offload" and d2h and h2d:
        out["offload_over_d2h_pinned"] = fig["offload_GBps"] / d2h
        out["restore_over_h2d_pinned"] = fig["restore_GBps"] / h2d
    elif name == "moonep" and gemm_s:
        out["plan_over_gemm_time"] = fig["device_torch_ms"] / 1e3 / gemm_s
        out["gpu_speedup_over_cpu_torch"] = fig["cpu_torch_ms"] / fig["device_torch_ms"]
        out["gpu_speedup_over_cpu_numba"] = fig["cpu_numba_ms"] / fig["device_torch_ms"]
    return out


def figures(step: Step, out: Path) -> dict[str, Any]:
    if step.name.startswith("train_"):
        run = step.name.removeprefix("train_")
        return train_figures(out / "train" / f"{run}.metrics.jsonl", REFERENCE if run == "k3_tiny" else None)
    if step.name == "tests":
        return test_figures(out / "steps" / "tests.xml")
    return json.loads((out / "steps" / f"{step.name}.json").read_text())


# ---- the run -------------------------------------------------------------------------------------------------------


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_fmt(x)}" for k, x in v.items()) + "}"
    return str(v)


def table(results: list[dict[str, Any]]) -> str:
    lines = ["| step | status | wall s | figures | vs this run's GEMM rate / copy bandwidth |", "|---|---|---|---|---|"]
    for r in results:
        status = r["status"] + (f": {r['error']}" if r.get("error") else "")
        lines.append(f"| {r['name']} | {status.replace('|', '/')} | {_fmt(r.get('wall_s', 0.0))} | "
                     f"{_fmt(r.get('figures', {})).replace('|', '/')} | {_fmt(r.get('ratios', {}))} |")
    return "\n".join(lines) + "\n"


def prepare_out(out: Path, force: bool, steps: list[Step]) -> str | None:
    """Create ``out`` (new), or with ``force`` reuse a previous check's directory, removing what the steps write
    and its ``check.json`` / ``table.md``; returns an error line or None."""
    if os.path.lexists(out):
        if not force:
            return f"--out = {str(out)!r}: exists; expected a new directory (--force reuses a previous GPU check's)"
        if not out.is_dir() or out.is_symlink() or not (out / MARKER).is_file():
            return (f"--out = {str(out)!r}: not the directory of a previous GPU check (no {MARKER}); --force only "
                    "replaces a previous check's outputs")
        for p in [out / "check.json", out / "table.md"] + [p for st in steps for p in st.outputs]:
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            elif os.path.lexists(p):
                p.unlink()
    else:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.mkdir()  # exclusive: a directory made meanwhile by another run raises
        (out / MARKER).write_text("outputs of benchmarks/gpu/check.sh\n")
    (out / "steps").mkdir(exist_ok=True)
    (out / "train").mkdir(exist_ok=True)
    return None


def run_step(step: Step, out: Path, timeout_s: float) -> dict[str, Any]:
    log = out / "steps" / f"{step.name}.log"
    env = os.environ | step.env
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    rec: dict[str, Any] = {"name": step.name, "what": step.what, "command": command_line(step),
                           "timeout_s": round(timeout_s, 1)}
    t0 = time.perf_counter()
    try:
        with open(log, "x") as f:
            proc = subprocess.run(step.argv, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                                  timeout=timeout_s, check=False)
        rec["rc"] = proc.returncode
    except subprocess.TimeoutExpired:
        rec["rc"] = None
        rec["error"] = f"timed out after {timeout_s:.0f} s"
    rec["wall_s"] = time.perf_counter() - t0
    if rec["rc"] not in (0, None):
        tail = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()][-1:]
        rec["error"] = f"exit {rec['rc']}" + (f": {tail[0][:200]}" if tail else "")
    try:
        rec["figures"] = figures(step, out)
    except Exception as exc:  # noqa: BLE001 - a step without results records why
        rec.setdefault("error", f"no results ({type(exc).__name__}: {str(exc)[:200]})")
    rec["status"] = "ok" if rec["rc"] == 0 and "error" not in rec else "FAILED"
    return rec


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/gpu/check.sh", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(ROOT / "runs" / "gpu-check"), help="output directory (new; default "
                        "runs/gpu-check)")
    parser.add_argument("--force", action="store_true", help="reuse --out when a previous check made it, replacing "
                        "its outputs")
    parser.add_argument("--dry-run", action="store_true", help="print the steps and their commands; run nothing")
    parser.add_argument("--steps", type=int, default=50, help="training steps of each train run (default 50)")
    parser.add_argument("--budget-s", type=float, default=450.0, help="wall-clock budget of the whole check (s)")
    parser.add_argument("--only", default="", help="comma-separated steps to run (default: all)")
    parser.add_argument("--python", default=sys.executable, help="interpreter of the steps (default: this one)")
    args = parser.parse_args(argv)
    if args.steps < 1:
        print(f"--steps = {args.steps}: expected an integer >= 1", file=sys.stderr)
        return 2
    out = Path(args.out).absolute()
    steps = plan(out, args.python, args.steps)
    names = [s.name for s in steps]
    only = [n for n in args.only.split(",") if n]
    bad = [n for n in only if n not in names]
    if bad:
        print(f"--only = {args.only!r}: unknown step {bad[0]!r}; expected some of {', '.join(names)}", file=sys.stderr)
        return 2
    if only:
        steps = [s for s in steps if s.name in only]
    if args.dry_run:
        print(f"GPU check (dry run): {len(steps)} steps, budget {args.budget_s:.0f} s, outputs under {out}")
        for i, st in enumerate(steps, 1):
            print(f"{i}. {st.name} ({st.what}; timeout {st.timeout_s:.0f} s)\n   {command_line(st)}")
        return 0
    err = prepare_out(out, args.force, steps)
    if err:
        print(err, file=sys.stderr)
        return 2
    deadline = time.monotonic() + args.budget_s
    results: list[dict[str, Any]] = []
    base: dict[str, Any] | None = None
    for st in steps:
        left = deadline - time.monotonic()
        if left < 5:
            results.append({"name": st.name, "what": st.what, "command": command_line(st), "status": "not run",
                            "error": f"budget of {args.budget_s:.0f} s spent"})
            continue
        print(f"[gpu-check] {st.name}: {command_line(st)}", flush=True)
        rec = run_step(st, out, min(st.timeout_s, left))
        if st.name == "baseline" and rec["status"] == "ok":
            base = rec["figures"]
        rec["ratios"] = ratios(st.name, rec.get("figures", {}), base) if rec["status"] == "ok" else {}
        print(f"[gpu-check] {st.name}: {rec['status']} in {rec['wall_s']:.1f} s"
              + (f" ({rec['error']})" if rec.get("error") else ""), flush=True)
        results.append(rec)
    ok = all(r["status"] == "ok" for r in results)
    report = {"ok": ok, "out": str(out), "python": args.python, "budget_s": args.budget_s, "train_steps": args.steps,
              "baseline": base, "steps": results}
    (out / "check.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    text = table(results)
    (out / "table.md").write_text(text)
    print(text, end="")
    failed = [r["name"] for r in results if r["status"] != "ok"]
    print(f"[gpu-check] {'FAILED steps: ' + ', '.join(failed) if failed else 'all steps ok'}; {out / 'check.json'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
