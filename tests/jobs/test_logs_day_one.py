"""What moonrt's jobs write into logs and pipes (issue 49, items 6 and 7): rank 0's CP table only (the other ranks'
tables go to files under ``--out``), no tqdm ``\\r`` bars from ``moonrt ep-sim`` when stderr is not a terminal,
``moonrt train``'s plain progress lines carry their time and the run's ETA, and its summary says what its train loss
averages."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from jobs.helpers import _corpus, _launch

from moonrt.cli import main
from moonrt.jobs.train import report

SMALL_SIM = ["ep-sim", "--experts", "32", "--ranks", "4", "--top-k", "4", "--tokens", "64", "--steps", "4",
             "--layers", "2", "--no-plot"]
STAMP = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d"


def test_ep_sim_writes_no_bar_when_stderr_is_not_a_terminal(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*SMALL_SIM, "--out", str(tmp_path / "sim")]) == 0  # no --quiet: the bar is off by itself
    out, err = capsys.readouterr()
    assert "\r" not in out + err and "ep-sim:" not in err and "step/s" not in err, err
    assert "moonep" in out, out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ep_sim_through_a_pipe_has_no_carriage_return(tmp_path: Path) -> None:
    res = subprocess.run([sys.executable, "-m", "moonrt.cli", *SMALL_SIM, "--out", str(tmp_path / "sim")],
                         cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stderr[-4000:]
    assert "\r" not in res.stdout + res.stderr and res.stderr == "", res.stderr[-4000:]


def _record(step: int, elapsed: float, when: float) -> dict:
    return {"step": step, "loss": 2.5, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_s": 1000.0,
            "peak_mem_bytes": 2**30, "elapsed_s": elapsed, "time": when}


def test_plain_progress_lines_have_a_timestamp_and_an_eta(capsys: pytest.CaptureFixture[str]) -> None:
    # a resumed run: steps 101..200 of 200, 2 s per step, a line every 10 steps
    console = report.Console(True, True, start=100, stop=200, total=200, log_every=10, tty=False)
    when = time.mktime((2025, 3, 4, 5, 6, 7, 0, 0, -1))
    console.step(_record(110, 20.0, when), None)
    console.step(_record(111, 22.0, when), None)  # not a multiple of log_every: no line
    console.step(_record(200, 200.0, when + 180), None)
    console.close()
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        "2025-03-04 05:06:07 train: step 110/200, loss 2.5000, lr 0.001, grad norm 0.5, 1,000 tok/s, "
        "peak mem 1.00 GiB, eta 3m00s",
        "2025-03-04 05:09:07 train: step 200/200, loss 2.5000, lr 0.001, grad norm 0.5, 1,000 tok/s, "
        "peak mem 1.00 GiB, eta 0s"], lines


@pytest.mark.parametrize(("seconds", "text"), [(0.4, "0s"), (59.6, "1m00s"), (185, "3m05s"), (7620, "2h07m"),
                                               (float("nan"), "?")])
def test_duration(seconds: float, text: str) -> None:
    assert report.duration(seconds) == text


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_cp_run_prints_rank_0s_table_and_files_the_others(tmp_path: Path) -> None:
    out = tmp_path / "run"
    res = subprocess.run(_launch(2, "train", "--cp", "2", "--steps", "2", "--batch-size", "2", "--seq-len", "48",
                                 "--eval-every", "100", "--set", "optim.eval_windows=2", "--threads", "1",
                                 "--out", str(out)),
                         cwd=tmp_path, capture_output=True, text=True, timeout=540)  # a pipe: plain lines
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    text = res.stdout + res.stderr
    assert text.count("CP bytes per layer") == 1, text[-4000:]
    assert "CP bytes per layer, rank 0 (cp rank 0), last step" in text, text[-4000:]
    assert "\r" not in text
    table = (out / "cp_bytes_rank1.txt").read_text()
    assert table.startswith("CP bytes per layer, rank 1 (cp rank 1), last step\nlayer "), table
    assert len(table.splitlines()) == len([ln for ln in text.splitlines() if ".attn " in ln]) + 2, (table, text)
    periodic = [ln for ln in res.stdout.splitlines() if re.search(rf"^(\[rank 0\] )?{STAMP} train: step 2/2, ", ln)]
    assert len(periodic) == 1 and periodic[0].endswith(", eta 0s"), res.stdout[-4000:]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_summary_says_its_train_loss_is_a_mean_of_the_last_10_steps(tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    metrics = tmp_path / "m.jsonl"
    assert main(["train", "--model", "dense_tiny", "--corpus", str(_corpus(tmp_path)), "--batch-size", "2",
                 "--seq-len", "16", "--steps", "12", "--eval-every", "12", "--set", "optim.eval_windows=2",
                 "--threads", "1", "--no-progress", "--out", str(tmp_path / "o"), "--metrics", str(metrics)]) == 0
    line = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("summary: ")]
    losses = [json.loads(r)["loss"] for r in metrics.read_text().splitlines()]
    assert len(line) == 1 and len(losses) == 12, line
    found = re.search(r"; train loss (\d+\.\d{3}) \(mean of the last 10 steps\); eval loss ", line[0])
    assert found, line[0]
    assert float(found[1]) == pytest.approx(sum(losses[-10:]) / 10, abs=5e-4), (found[1], losses)
