"""The prepared GPU check (``benchmarks/gpu/check.sh``, issue 30) on a CPU-only machine: ``--dry-run`` lists every
step with its command and touches neither CUDA nor the output folder; a real run without CUDA records each failing
step's error and exits 1; the output folder is never overwritten unless a previous check made it; the figures read
from a run's metrics; the ~100M K3 config has the parameter count it states; the probes run on CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
GPU = ROOT / "benchmarks" / "gpu"
sys.path.insert(0, str(GPU))

import check  # noqa: E402
import probes  # noqa: E402

STEPS = ("preflight", "baseline", "tests", "fp8", "offload", "moonep", "train_k3_tiny", "train_k3_100m")


def _sh(*args: str) -> subprocess.CompletedProcess:
    env = os.environ | {"PYTHON": sys.executable}
    return subprocess.run(["bash", str(GPU / "check.sh"), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)


def test_dry_run_lists_every_step_and_touches_nothing(tmp_path):
    out = tmp_path / "gc"
    res = _sh("--dry-run", "--out", str(out))
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    for name in STEPS:
        i = next(i for i, ln in enumerate(lines) if ln.split(" ", 1)[-1].startswith(name + " ("))
        assert str(out) in lines[i + 1]  # its exact command, writing under --out
    text = res.stdout
    for run in ("k3_tiny", "k3_100m"):
        cmd = next(ln for ln in lines if f"--out {out}/train/{run}" in ln)
        assert "-m moonrt.cli train --device cuda --dtype bf16 --steps 50" in cmd
    assert "k3_100m.yaml" in text and "MOONRT_TEST_DEVICE=cuda" in text
    assert "tests/memory/test_memory_device.py" in text  # a test file taking the device fixture
    assert not out.exists()
    # the driver imports no torch (no CUDA initialisation) for a dry run
    code = ("import runpy, sys; sys.argv = ['check.py', '--dry-run']\n"
            f"try: runpy.run_path({str(GPU / 'check.py')!r}, run_name='__main__')\n"
            "except SystemExit as e: assert e.code == 0, e.code\n"
            "assert 'torch' not in sys.modules")
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, timeout=60).returncode == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the failure path of a machine without CUDA")
def test_failed_steps_are_recorded_the_rest_run_and_the_exit_is_nonzero(tmp_path):
    out = tmp_path / "gc"
    res = _sh("--out", str(out), "--only", "preflight,train_k3_tiny", "--budget-s", "100")
    assert res.returncode == 1, res.stdout + res.stderr
    rep = json.loads((out / "check.json").read_text())
    assert not rep["ok"] and [s["name"] for s in rep["steps"]] == ["preflight", "train_k3_tiny"]  # both ran
    assert all(s["status"] == "FAILED" and s["error"] for s in rep["steps"])
    pre = json.loads((out / "steps" / "preflight.json").read_text())
    assert pre["cuda_available"] is False and pre["ok"] is False  # written, then failed
    table = (out / "table.md").read_text()
    assert "| preflight | FAILED" in table and "| train_k3_tiny | FAILED" in table and table in res.stdout
    # an existing --out is refused (exit 2, untouched) unless --force, which reuses only a previous check's folder
    before = (out / "check.json").read_text()
    res = _sh("--out", str(out), "--only", "train_k3_tiny")
    assert res.returncode == 2 and "exists" in res.stderr and (out / "check.json").read_text() == before
    res = _sh("--out", str(out), "--only", "train_k3_tiny", "--force")
    assert res.returncode == 1 and [s["name"] for s in json.loads((out / "check.json").read_text())["steps"]] == [
        "train_k3_tiny"]
    other = tmp_path / "mine"
    other.mkdir()
    (other / "keep.txt").write_text("x")
    res = _sh("--out", str(other), "--force", "--only", "train_k3_tiny")
    assert res.returncode == 2 and "not the directory of a previous GPU check" in res.stderr
    assert sorted(p.name for p in other.iterdir()) == ["keep.txt"]


def test_train_figures_and_ratios_from_a_metrics_file(tmp_path):
    ref = json.loads(check.REFERENCE.read_text())
    assert len(ref["loss"]) == 50 and set(ref["eval_loss"]) == {"25", "50"}
    metrics = tmp_path / "m.jsonl"
    with open(metrics, "w") as f:
        for i, loss in enumerate(ref["loss"], 1):
            rec = {"step": i, "loss": loss, "tokens_per_s": 1000.0 * i, "model_tflops_per_s": 2.0,
                   "peak_mem_bytes": 10 * i}
            if str(i) in ref["eval_loss"]:
                rec["eval_loss"] = ref["eval_loss"][str(i)] * 1.01
            f.write(json.dumps(rec) + "\n")
    fig = check.train_figures(metrics, check.REFERENCE)
    assert fig["tokens_per_s"] == 1000.0 * 28  # median of steps 6..50: warm-up steps left out
    assert fig["peak_mem_bytes"] == 500 and fig["eval_step"] == 50
    assert fig["eval_loss_vs_cpu_fp32"] == pytest.approx(0.01)  # the same losses, eval 1% above the reference
    assert fig["mean_loss_vs_cpu_fp32"] == 0.0
    r = check.ratios("train_k3_tiny", fig, {"bf16_tflops": 800.0, "device_mem_bytes": 1000})
    assert r == {"model_tflops_over_gemm": 2.0 / 800.0, "peak_mem_over_device_mem": 0.5}


def test_k3_100m_config_has_the_parameters_it_states():
    from moonrt.jobs.train.overrides import job_config
    from moonrt.models import family

    job = job_config(GPU / "k3_100m.yaml")
    spec = family("k3")
    assert spec.param_count(job.model_config) == 104_133_594  # the figure in k3_100m.yaml's header
    with torch.device("meta"):  # built without memory: the spec's count is the model's
        model = spec.build(job.model_config, None)
    assert sum(p.numel() for p in model.parameters()) == 104_133_594


def test_probes_run_on_cpu():
    fp8 = probes.fp8_codec("cpu", rows=64)
    assert fp8["bf16"]["bitwise_equal_cpu_codec"] and fp8["bf16"]["bytes_out"] < fp8["bf16"]["bytes_in"]
    off = probes.offload("cpu", part_bytes=4096)
    assert off["bit_exact"] and all(off["strided_bit_exact"].values()) and off["buffers_reused"] == 8
