"""Asynchronous sharded saves (``--async-save``, issue 50 item 3), on 2 gloo ranks.

One job's save of step 4 is held forever inside DCP's writer (``SafeWriter.write_data`` patched in the process the
ranks fork from): the loop trains step 5 meanwhile (its metrics record is written while step 4 is uncommitted), then
the job is killed (SIGKILL, mid-write). Step 4 was never committed, step 2 is what remains, and ``--resume`` from it
ends bit-identical to an uninterrupted synchronous run of the same job.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from jobs.helpers import _ckpt, _corpus, _equal, _metrics, _ranks

from moonrt.jobs.checkpoint import sharded

TESTS = Path(__file__).resolve().parents[1]
HOLD = """
import sys, time
sys.path.insert(0, {tests!r})
import forkrun
from moonrt.comm.state import dcp

write = dcp.SafeWriter.write_data

def held(self, plan, planner):
    if "step-00000004" in str(self.path):  # this save never finishes its write
        while True:
            time.sleep(1)
    return write(self, plan, planner)

dcp.SafeWriter.write_data = held
sys.exit(forkrun.ranks(2, sys.argv[1:]))
"""


def _job(tmp_path: Path, out: str, *extra: str) -> list[str]:
    return ["train", "--corpus", str(_corpus(tmp_path)), "--batch-size", "4", "--seq-len", "16", "--steps", "6",
            "--checkpoint-every", "2", "--eval-every", "100", "--eval-windows", "2", "--threads", "1", "--no-progress",
            "--out", str(tmp_path / out), "--metrics", str(tmp_path / f"{out}.jsonl"), *extra]


def _wait_for(cond: object, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        assert proc.poll() is None, f"the job exited with {proc.returncode}"
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_kill_during_an_async_write_resumes_bit_identically_from_the_previous_step(tmp_path: Path) -> None:
    subprocess.run(_ranks(2, *_job(tmp_path, "ref")), cwd=tmp_path, check=True, timeout=400,
                   stdout=subprocess.DEVNULL)
    log = open(tmp_path / "held.log", "w+")  # noqa: SIM115
    held = subprocess.Popen([sys.executable, "-c", HOLD.format(tests=str(TESTS)),
                             *_job(tmp_path, "run", "--async-save")], cwd=tmp_path, stdout=log,
                            stderr=subprocess.STDOUT,
                            start_new_session=True)
    root = tmp_path / "run" / "checkpoint"
    try:
        metrics = tmp_path / "run.jsonl"
        _wait_for(lambda: metrics.exists() and 5 in _metrics(metrics), held, 400)
        # the loop ran step 5 while the save of step 4 was in flight (it never finishes)
        assert (root / "step-00000004.tmp").is_dir() and not (root / "step-00000004").exists()
        assert [s for s, _ in sharded.committed_steps(root)] == [2]
        assert "ckpt_wait_s" in _metrics(metrics)[5]
    finally:
        os.killpg(held.pid, signal.SIGKILL)
        held.wait(timeout=60)
        log.seek(0)
        out = log.read()
        log.close()
    assert [s for s, _ in sharded.committed_steps(root)] == [2], out[-3000:]
    subprocess.run(_ranks(2, *_job(tmp_path, "run", "--async-save", "--resume")), cwd=tmp_path, check=True,
                   timeout=400, stdout=subprocess.DEVNULL)
    ref, got = _ckpt(tmp_path / "ref"), _ckpt(tmp_path / "run")
    assert got["step"] == ref["step"] == 6
    _equal(got["model"], ref["model"], "model")
    _equal(got["optimizer"], ref["optimizer"], "optimizer")
    ref_m, run_m = _metrics(tmp_path / "ref.jsonl"), _metrics(tmp_path / "run.jsonl")
    assert [run_m[s]["loss"] for s in range(1, 7)] == [ref_m[s]["loss"] for s in range(1, 7)]
    assert [s for s, _ in sharded.committed_steps(root)] == [4, 6]  # keep_latest 2
    marker = json.loads((root / "step-00000006" / "moonrt.json").read_text())
    assert marker["config"]["checkpoint"]["async_save"] is True
