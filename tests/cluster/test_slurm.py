"""Real SLURM: ``srun -n 4`` and an ``sbatch --wait`` of the script ``moonrt sbatch`` wrote.

Each task joins through the SLURM path of init_distributed and runs the verified self-test.
Skips where SLURM is not running; fails instead under MOONRT_REQUIRE_CLUSTER=1 (CI, where
``.ci/run`` starts a single-node SLURM with 8 declared CPUs).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from cluster.helpers import clean_env, require_slurm, verify_selftest_report

pytestmark = pytest.mark.slurm

SELFTEST = [sys.executable, "-m", "moonrt.jobs.selftest", "--suite", "collectives", "--sizes", "64K",
            "--iters", "2"]


@pytest.fixture(scope="module")
def slurm() -> None:
    require_slurm("srun", "sbatch", "sinfo")


@pytest.mark.slow
def test_srun_four_tasks(slurm, tmp_path):
    report = tmp_path / "report.json"
    cmd = ["timeout", "180", "srun", "-n", "4", "-I60", "--kill-on-bad-exit=1", *SELFTEST, "--report", str(report)]
    env = {**clean_env(), "MOONRT_DIST_TIMEOUT": "60"}
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert res.returncode == 0, f"exit {res.returncode}\nstdout:\n{res.stdout}\nstderr:\n{res.stderr[-4000:]}"
    assert "4 ranks via slurm" in res.stdout
    verify_selftest_report(report, 4, "slurm")


@pytest.mark.slow
def test_srun_selftest_ep_and_kcp(slurm, tmp_path):
    """``srun -n 4 moonrt selftest --suite ep,kcp``: MoonEP / all-to-all and KCP checked on every task."""
    report = tmp_path / "report.json"
    cmd = ["timeout", "400", "srun", "-n", "4", "-I60", "--kill-on-bad-exit=1", sys.executable, "-m", "moonrt.cli",
           "selftest", "--suite", "ep,kcp", "--iters", "1", "--ep-shapes", "32x16x2x64", "--ep-maxvio", "0,16",
           "--ep-ffn", "8", "--kcp-tokens", "64", "--kcp-shape", "1x2x8x12", "--report", str(report)]
    env = {**clean_env(), "MOONRT_DIST_TIMEOUT": "120"}
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=460, cwd=tmp_path)
    assert res.returncode == 0, f"exit {res.returncode}\nstdout:\n{res.stdout}\nstderr:\n{res.stderr[-4000:]}"
    assert "4 ranks via slurm" in res.stdout
    rep = json.loads(report.read_text())
    assert rep["passed"] is True and rep["env"]["launcher"] == "slurm" and rep["env"]["world_size"] == 4
    assert [rep["suites"][s]["status"] for s in ("ep", "kcp")] == ["ran", "ran"]
    for rank in rep["ranks"]:
        assert rank["source"] == "slurm"
        assert "ep/moonep/32x16x2x64/F8/maxvio=16/grad_experts" in rank["checks"]
        assert "kcp/T=64/grad_g" in rank["checks"]
        assert all(c["ok"] for c in rank["checks"].values())


@pytest.mark.slow
def test_sbatch_script_from_moonrt_sbatch(slurm, tmp_path):
    report, script, log = tmp_path / "report.json", tmp_path / "job.sbatch", tmp_path / "job.log"
    write = [sys.executable, "-m", "moonrt.cli", "sbatch", "--nodes", "1", "--ntasks-per-node", "4",
             "--job-name", "moonrt-ci", "--timeout", "60", "--output", str(script), "--log", str(log),
             "--", *SELFTEST, "--report", str(report)]
    res = subprocess.run(write, env=clean_env(), capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "srun --kill-on-bad-exit=1 --ntasks=4" in script.read_text()
    res = subprocess.run(["timeout", "240", "sbatch", "--wait", str(script)], env=clean_env(),
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    out = log.read_text() if log.exists() else "(no job log)"
    assert res.returncode == 0, f"sbatch exit {res.returncode}: {res.stderr}\njob log:\n{out[-4000:]}"
    assert "4 ranks via slurm" in out
    verify_selftest_report(report, 4, "slurm")


def test_moonrt_sbatch_submit_prints_the_job_id(slurm, tmp_path):
    cmd = [sys.executable, "-m", "moonrt.cli", "sbatch", "--nodes", "1", "--ntasks-per-node", "2",
           "--job-name", "moonrt-submit", "--log", str(tmp_path / "submit-%j.log"), "--submit", "--",
           "printenv", "SLURM_PROCID"]
    res = subprocess.run(cmd, env=clean_env(), capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    job_id = res.stdout.strip()
    assert job_id.isdigit(), res.stdout
    assert (tmp_path / f"moonrt-submit-{job_id}.sbatch").exists()  # the script kept under its job's id
    log = tmp_path / f"submit-{job_id}.log"  # the job with that id ran its 2 tasks under srun
    for _ in range(240):
        if log.exists() and sorted(log.read_text().split()) == ["0", "1"]:
            break
        time.sleep(0.5)
    assert log.exists() and sorted(log.read_text().split()) == ["0", "1"], log.read_text() if log.exists() else "no log"
