"""The GPU check for one lease (``benchmarks/gpu/check.sh``, issue 47) on a CPU-only machine: ``--dry-run`` lists
the blocks in priority order with timeouts whose sum fits the deadline, and the deadline fits the lease; the
judging fails a block whose correctness flag is false or whose rel-L2 exceeds its bound (on recorded JSON lines and
end to end through a planted block); a block over its timeout is killed with its whole process group; a real run
without CUDA records each failing block as one JSON line, tars its logs and prints the table last; the train
figures; the ~100M config's parameter count; the probes and the KDA blocks run on CPU (the KDA ones under Triton's
interpreter) and fail on a planted wrong kernel. Nothing here runs on a GPU."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
GPU = ROOT / "benchmarks" / "gpu"
sys.path.insert(0, str(GPU))

import check  # noqa: E402
import probes  # noqa: E402

BLOCKS = ("env", "kda_triton", "train_k3_100m", "kda_model", "fp8", "moonep", "memory", "train_k3_tiny")


def _sh(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = os.environ | {"PYTHON": sys.executable}
    env.pop("OUT", None)
    return subprocess.run(["bash", str(GPU / "check.sh"), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_dry_run_lists_blocks_whose_timeouts_fit_the_deadline_and_the_deadline_fits_the_lease(tmp_path):
    out = tmp_path / "gc"
    res = _sh("--dry-run", "--out", str(out))
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    listed = [(ln.split(". ", 1)[1].split(" (timeout ")[0], float(ln.split("(timeout ")[1].split(" s)")[0]))
              for ln in lines if ln[:1].isdigit()]
    assert [n for n, _ in listed] == list(BLOCKS)  # priority order
    total = sum(t for _, t in listed)
    assert total <= check.DEADLINE_S and f"summed timeouts {total:.0f} s" in lines[0]
    # the deadline, the tarring and the machine's start fit one lease; the command fits one device-tool call
    assert check.DEADLINE_S + check.TAIL_S + check.STARTUP_S <= check.LEASE_S
    assert check.DEADLINE_S + check.TAIL_S <= check.PER_CALL_S
    for name, _ in listed:  # each block's exact command follows it
        i = next(i for i, ln in enumerate(lines) if ln.split(" ", 1)[-1].startswith(name + " ("))
        assert "benchmarks/gpu/probes.py" in lines[i + 1] and f"{name}.json" in lines[i + 1]
    assert "k3_100m.yaml" in res.stdout and "--until 20" in res.stdout and "--corpus" in res.stdout
    assert f"{out}/results.jsonl" in lines[0] and not out.exists()
    # nothing on the GPU path needs the LP solvers; the dry run imports no torch (no CUDA initialisation)
    assert not {"pulp", "highspy"} & set(probes.REQUIRED)
    code = ("import runpy, sys; sys.argv = ['check.py', '--dry-run']\n"
            f"try: runpy.run_path({str(GPU / 'check.py')!r}, run_name='__main__')\n"
            "except SystemExit as e: assert e.code == 0, e.code\n"
            "assert 'torch' not in sys.modules and 'pulp' not in sys.modules")
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, timeout=60).returncode == 0


RECORDED = [  # results.jsonl lines as blocks write them (figures trimmed)
    '{"block": "memory", "rc": 0, "figures": {"bit_exact": true, "strided_bit_exact": {"float32": true, '
    '"bfloat16": false}, "offload_GBps": 50.1}}',
    '{"block": "moonep", "rc": 0, "figures": {"plans_identical": false, "plan_device_identical": true, '
    '"plan_prefix_identical": true, "device_torch_ms": 1.2}}',
    '{"block": "fp8", "rc": 0, "figures": {"bf16": {"bitwise_equal_cpu_codec": true, '
    '"dequantize_bitwise_equal_cpu_codec": true, "dequantize_finite": true}}}',
    '{"block": "kda_triton", "rc": 0, "figures": {"rel_l2_bound": 0.0625, "rel_l2": {"o": 1e-3, "dg": 0.2}, '
    '"rel_l2_torch_control": {"o": 1e-7}}}',
    '{"block": "kda_triton", "rc": 0, "figures": {"rel_l2_bound": 0.0625, "rel_l2": {"o": NaN}}}',
    '{"block": "kda_model", "rc": 0, "figures": {"triton_vs_torch": {"rel_l2": {"loss": 1e-6, "all_grads": 2e-4}, '
    '"rel_l2_bound": 0.0625, "grad_tensors_identical": true}, "k3_head_timing": {"triton": {"error": '
    '"OutOfResources: shared memory"}}}}',
    '{"block": "train_k3_100m", "rc": 0, "figures": {"tokens_per_s": 1e5, "losses_finite": true, '
    '"resume_ok": false}}',
    '{"block": "env", "rc": 0, "figures": {"ok": true, "versions": {"pulp": null, "highspy": null}}}',
]


def test_judge_fails_false_flags_and_rel_l2_over_its_bound_on_recorded_lines():
    got = {i: check.judge(json.loads(line)["figures"]) for i, line in enumerate(RECORDED)}
    assert got[0] == ["strided_bit_exact.bfloat16 is false"]
    assert got[1] == ["plans_identical is false"]
    assert got[2] == []
    assert got[3] == ["rel_l2.dg = 0.2 > bound 0.0625"]  # the control within it, o within it
    assert got[4] == ["rel_l2.o = nan is not finite"]
    assert got[5] == ["k3_head_timing.triton.error: OutOfResources: shared memory"]
    assert got[6] == ["resume_ok is false"]
    assert got[7] == []  # absent optional packages are no failure
    assert check.judge({"ok": False}) == ["ok is false"]
    assert check.judge({"rel_l2": 0.5}) == ["rel_l2: no rel_l2_bound beside it"]  # an unbounded figure is no pass
    assert check.max_rel_l2(json.loads(RECORDED[3])["figures"]) == 0.2


def _block(tmp_path: Path, name: str, code: str, timeout: float) -> dict:
    work = tmp_path / "w"
    for sub in ("logs", "blocks"):
        (work / sub).mkdir(parents=True, exist_ok=True)
    b = check.Block(name, [sys.executable, "-c", code.replace("JSON", str(work / "blocks" / f"{name}.json"))],
                    timeout)
    return check.run_block(b, work, timeout, dict(os.environ))


def test_a_block_whose_correctness_flag_is_false_fails_and_a_slow_one_is_killed_with_its_group(tmp_path):
    rec = _block(tmp_path, "planted", "import json; json.dump({'bit_exact': False, 'GBps': 9.0}, open('JSON', 'w'))",
                 30)
    assert rec["rc"] == 0 and rec["status"] == "FAIL" and rec["failures"] == ["bit_exact is false"]
    rec = _block(tmp_path, "fine", "import json; json.dump({'bit_exact': True}, open('JSON', 'w'))", 30)
    assert rec["status"] == "ok" and rec["failures"] == []
    rec = _block(tmp_path, "crash", "raise SystemExit('boom')", 30)
    assert rec["status"] == "FAIL" and rec["error"].startswith("exit 1: boom")
    # a block that outlives its timeout: it and the child it started are both gone afterwards
    pidfile = tmp_path / "child.pid"
    code = ("import subprocess, sys, time\n"
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
            f"open({str(pidfile)!r}, 'w').write(str(p.pid)); time.sleep(60)")
    t0 = time.monotonic()
    rec = _block(tmp_path, "slow", code, 3)
    assert rec["status"] == "TIMEOUT" and "timed out after 3 s" in rec["error"] and time.monotonic() - t0 < 20
    child = int(pidfile.read_text())
    time.sleep(0.5)
    try:
        os.kill(child, 0)
        state = Path(f"/proc/{child}/stat").read_text().split()[2] if Path(f"/proc/{child}/stat").exists() else "X"
        assert state == "Z", f"child {child} of the timed-out block still runs"
    except ProcessLookupError:
        pass


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the failure path of a machine without CUDA")
def test_a_run_without_cuda_records_each_block_tars_its_logs_and_prints_the_table_last(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    res = _sh("--out", str(out), "--work", str(work), "--only", "env,memory")
    assert res.returncode == 1, res.stdout + res.stderr
    recs = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [r["block"] for r in recs] == ["env", "memory"]  # both ran, in order
    assert all(r["status"] == "FAIL" for r in recs)
    assert recs[0]["figures"]["cuda_available"] is False and "ok is false" in recs[0]["failures"]
    assert recs[1]["error"].startswith("exit 1")  # no CUDA device: the probe raised
    assert sorted(p.name for p in out.iterdir()) == ["logs.tar.gz", "results.jsonl", "table.md"]  # <= 8 files back
    with tarfile.open(out / "logs.tar.gz") as tar:
        names = tar.getnames()
    assert {"logs/env.log", "logs/memory.log", "blocks/env.json"} <= set(names)
    table = (out / "table.md").read_text()
    assert "| env | FAIL" in table and "| memory | FAIL" in table and table in res.stdout
    assert res.stdout.endswith(table) and "[gpu-check] not ok: env, memory" in res.stdout  # the table last
    res = _sh("--out", str(out), "--only", "env")  # a folder holding results is refused, untouched
    assert res.returncode == 2 and "holds a results.jsonl" in res.stderr and len(recs) == 2


def test_train_figures_and_the_cpu_reference_on_the_checkout_corpus(tmp_path):
    ref = json.loads(check.REFERENCE.read_text())
    assert len(ref["loss"]) == 50 and set(ref["eval_loss"]) == {"25", "50"}
    assert ref["corpus_glob"] == check.CORPUS_GLOB and "stdlib" not in ref["what"]
    metrics = tmp_path / "m.jsonl"
    with open(metrics, "w") as f:
        for i, loss in enumerate(ref["loss"], 1):
            rec = {"step": i, "loss": loss, "tokens_per_s": 1000.0 * i, "model_tflops_per_s": 2.0,
                   "peak_mem_bytes": 10 * i}
            if str(i) in ref["eval_loss"]:
                rec["eval_loss"] = ref["eval_loss"][str(i)] * 1.01
            f.write(json.dumps(rec) + "\n")
    fig = probes.train_figures(metrics, check.REFERENCE, ref["corpus_sha256"])
    assert fig["tokens_per_s"] == 1000.0 * 28  # median of steps 6..50: warm-up steps left out
    assert fig["peak_mem_bytes"] == 500 and fig["eval_step"] == 50 and fig["losses_finite"]
    assert fig["eval_loss_vs_cpu_fp32"] == pytest.approx(0.01)  # the same losses, eval 1% above the reference
    assert fig["mean_loss_vs_cpu_fp32"] == 0.0 and check.judge(fig) == []
    other = probes.train_figures(metrics, check.REFERENCE, "0" * 64)  # another corpus: not compared
    assert "eval_loss_vs_cpu_fp32" not in other and other["cpu_fp32"].startswith("not compared")
    # the corpus is built from the checkout (the same bytes on any Python), not the standard library
    info = check.build_corpus(tmp_path / "c.txt")
    assert info["sha256"] == check.corpus_sha256() and info["files"] == len(check.corpus_files()) > 50
    assert (tmp_path / "c.txt").read_bytes().startswith((ROOT / check.corpus_files()[0]).read_bytes())


def test_k3_100m_config_has_the_parameters_it_states():
    from moonrt.jobs.train.overrides import job_config
    from moonrt.models import family

    job = job_config(GPU / "k3_100m.yaml")
    spec = family("k3")
    assert spec.param_count(job.model_config) == 104_133_594  # the figure in k3_100m.yaml's header
    with torch.device("meta"):  # built without memory: the spec's count is the model's
        model = spec.build(job.model_config, None)
    assert sum(p.numel() for p in model.parameters()) == 104_133_594


def test_probes_run_on_cpu_and_pass_the_judge():
    fp8 = probes.fp8_codec("cpu", rows=64)
    assert fp8["bf16"]["bitwise_equal_cpu_codec"] and fp8["bf16"]["bytes_out"] < fp8["bf16"]["bytes_in"]
    assert fp8["fp32"]["dequantize_bitwise_equal_cpu_codec"] and check.judge(fp8) == []
    off = probes.offload("cpu", part_bytes=4096)
    assert off["bit_exact"] and all(off["strided_bit_exact"].values()) and off["buffers_reused"] == 8
    assert check.judge(off) == []
    env = probes.env("cpu")
    assert env["ok"] and env["versions"]["torch"] == torch.__version__ and not env["missing"]


TINY = {"B": 1, "T": 40, "H": 2, "K": 16, "V": 16}  # two chunks of 32 (one partial) at a small head size


@pytest.mark.slow
def test_kda_blocks_under_the_interpreter_pass_and_fail_on_a_planted_wrong_kernel(triton_kernels):
    import kda_probes

    from moonrt.ops.kernels import REGISTRY, kernel

    fig = kda_probes.kda_vs_reference(str(triton_kernels.device), TINY)
    assert check.judge(fig) == [] and set(fig["rel_l2"]) == {"o", "final_state", *kda_probes.GRAD_NAMES}
    assert fig["rel_l2_torch_control"]["o"] < 1e-5  # the harness itself is exact to fp32
    tri = kernel("kda_chunk", "triton", triton_kernels.device)

    def half_beta(q, k, v, g, beta, **kw):  # a wrong write strength: every output and gradient moves
        return tri(q, k, v, g, 0.5 * beta, **kw)

    with REGISTRY.swapped("kda_chunk", "triton", half_beta, devices=("cuda",), requires="triton"):
        bad = kda_probes.kda_vs_reference(str(triton_kernels.device), TINY)
    fails = check.judge(bad)
    assert any(f.startswith("rel_l2.o ") for f in fails) and any(f.startswith("rel_l2.dbeta ") for f in fails)
    model = kda_probes.kda_in_model(str(triton_kernels.device), batch=1, seq_len=16, timing_shape=TINY)
    assert check.judge(model) == [] and model["backends"][:2] == ["torch", "triton"]
    assert math.isfinite(model["k3_head_timing"]["triton"]["fwd_bwd_s"])


@pytest.mark.slow
def test_the_train_block_stops_checkpoints_and_resumes_on_cpu(tmp_path):
    """The train probe's command line (moonrt train arguments after ``--``) on CPU: stopped after step 2 with a
    checkpoint, resumed to step 4 by a second process; ``resume_ok`` and the figures pass the judge."""
    fig_path = tmp_path / "f.json"
    res = subprocess.run([sys.executable, str(GPU / "probes.py"), "train", "--work", str(tmp_path), "--name", "t",
                          "--steps", "4", "--until", "2", "--device", "cpu", "--kda", "auto", "--json", str(fig_path),
                          "--", "--batch-size", "2", "--seq-len", "32", "--eval-every", "2"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env=os.environ | {"PYTHONPATH": str(ROOT)})
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    fig = json.loads(fig_path.read_text())
    assert fig["resume_ok"] and fig["resumed_from_step"] == 2 and fig["steps"] == 4 and len(fig["process_wall_s"]) == 2
    assert fig["checkpoint_bytes"] > 0 and fig["eval_step"] == 4 and check.judge(fig) == []
