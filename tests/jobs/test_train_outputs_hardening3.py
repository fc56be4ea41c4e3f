"""``moonrt train`` hardening 3 (issue 45): another run's metrics file or TensorBoard directory is never taken
over on resume (every metrics record and the event directory carry this run's identity), a user's ``config.yaml``
in ``--out`` is never replaced, one step's memory is estimated before step 1, and a corpus that is not a regular
file is named as what it is. Every refusal is one line on stderr, exit 2, the other file unchanged.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from jobs.helpers import _corpus, _one_error_line, _records, _train_argv, _tree

from moonrt.cli import main
from moonrt.config import ConfigError, from_dict
from moonrt.jobs.checkpoint import single as checkpoint
from moonrt.jobs.train import step_memory
from moonrt.jobs.train.config import JobConfig
from moonrt.jobs.train.loop import CHECKPOINT

# ---- 4. corpora that are not regular files ---------------------------------------------------------------------


@pytest.mark.parametrize("token_dtype", [None, "uint16"])
def test_a_corpus_that_is_not_a_regular_file_is_named_as_such(tmp_path: Path, capsys, monkeypatch,
                                                               token_dtype) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    monkeypatch.chdir(tmp_path)  # a relative socket name: AF_UNIX paths are short
    sock = socket.socket(socket.AF_UNIX)
    sock.bind("sock")
    cases = [("/dev/null", "not a regular file (character device)"), (str(fifo), "not a regular file (FIFO)"),
             (str(tmp_path / "sock"), "not a regular file (socket)"), (str(tmp_path), "a directory"),
             (str(empty), "an empty file (0 bytes)"), (str(tmp_path / "missing.txt"), "missing")]
    kind = "a UTF-8 text file" if token_dtype is None else f"a {token_dtype} token file"
    extra = [] if token_dtype is None else ["--token-dtype", token_dtype]
    try:
        for corpus, what in cases:
            assert main(["train", "--corpus", corpus, *extra, "--out", str(tmp_path / "o"), "--no-progress"]) == 2
            line = _one_error_line(capsys.readouterr().err)
            assert f"corpus (--corpus) = {corpus!r}: {what}; expected an existing file ({kind})" in line, line
            assert not (tmp_path / "o" / CHECKPOINT).exists()
    finally:
        sock.close()
    assert fifo.exists() and empty.read_bytes() == b""  # nothing opened or written


# ---- 1. run identity: another run's metrics file or TensorBoard directory ----------------------------------------


def _run_id(out: Path) -> str:
    return (out / "run_id").read_text().strip()


@pytest.mark.slow
@pytest.mark.parametrize("flag", ["--resume", "--resume-if-exists"])
def test_resume_refuses_another_runs_metrics_and_leaves_it_unchanged(tmp_path: Path, capsys, flag) -> None:
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    assert main(_train_argv(tmp_path, "run_a", "--steps", "8", "--until", "6", "--metrics", str(a))) == 0
    assert main(_train_argv(tmp_path, "run_b", "--steps", "3", "--until", "1", "--metrics", str(b))) == 0
    ida, idb = _run_id(tmp_path / "run_a"), _run_id(tmp_path / "run_b")
    assert ida != idb and len(ida) == 32
    assert [r["run_id"] for r in _records(a)] == [ida] * 6 and [r["run_id"] for r in _records(b)] == [idb]
    legacy = tmp_path / "legacy.jsonl"  # a moonrt metrics file without identity (an older moonrt's)
    legacy.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "run_id"}) + "\n" for r in _records(a)))
    for path, why in ((a, f"is a record of another run (run_id {ida!r}); this run's is {idb!r}"),
                      (legacy, f"is a record without a run_id, not one of this run; this run's is {idb!r}")):
        before = path.read_bytes()
        assert main(_train_argv(tmp_path, "run_b", "--steps", "3", flag, "--metrics", str(path))) == 2
        line = _one_error_line(capsys.readouterr().err)
        assert f"--metrics = {str(path)!r}: line 1 {why}; refusing to trim" in line, line
        assert path.read_bytes() == before  # byte for byte: no record lost
    assert checkpoint.load(tmp_path / "run_b" / CHECKPOINT)["step"] == 1  # nothing trained
    # each run continues its own file: every step once, every record carrying its run's id
    assert main(_train_argv(tmp_path, "run_b", "--steps", "3", flag, "--metrics", str(b))) == 0
    assert [(r["step"], r["run_id"]) for r in _records(b)] == [(1, idb), (2, idb), (3, idb)]
    assert main(_train_argv(tmp_path, "run_a", "--steps", "8", flag, "--metrics", str(a))) == 0
    assert [(r["step"], r["run_id"]) for r in _records(a)] == [(s, ida) for s in range(1, 9)]


def test_a_fresh_run_keeps_refusing_an_existing_metrics_file(tmp_path: Path, capsys) -> None:
    assert main(_train_argv(tmp_path, "run_a", "--steps", "1", "--metrics", str(tmp_path / "a.jsonl"))) == 0
    before = (tmp_path / "a.jsonl").read_bytes()
    assert main(_train_argv(tmp_path, "run_c", "--steps", "1", "--metrics", str(tmp_path / "a.jsonl"))) == 2
    assert "file exists; expected a new path" in _one_error_line(capsys.readouterr().err)
    assert (tmp_path / "a.jsonl").read_bytes() == before and not (tmp_path / "run_c" / CHECKPOINT).exists()


@pytest.mark.slow
def test_resume_refuses_another_runs_tensorboard_directory(tmp_path: Path, capsys) -> None:
    pytest.importorskip("tensorboard", reason="the optional tensorboard package (moonrt[tensorboard]) is missing")
    tba, tbb = tmp_path / "tb_a", tmp_path / "tb_b"
    assert main(_train_argv(tmp_path, "run_a", "--steps", "3", "--until", "2", "--tensorboard", str(tba))) == 0
    assert main(_train_argv(tmp_path, "run_b", "--steps", "3", "--until", "1", "--tensorboard", str(tbb))) == 0
    assert (tba / ".moonrt-run").read_text() == _run_id(tmp_path / "run_a") + "\n"
    unmarked = tmp_path / "tb_unmarked"  # event files only (an older moonrt's, or another trainer's)
    unmarked.mkdir()
    for event in tba.glob("events.out.tfevents.*"):
        (unmarked / event.name).write_bytes(event.read_bytes())
    for directory, why in ((tba, f"is another run's (run_id {_run_id(tmp_path / 'run_a')!r} in its .moonrt-run)"),
                           (unmarked, "holds no .moonrt-run marker")):
        before = _tree(directory)
        assert main(_train_argv(tmp_path, "run_b", "--steps", "3", "--resume", "--tensorboard", str(directory))) == 2
        line = _one_error_line(capsys.readouterr().err)
        assert f"log.tensorboard (--tensorboard) = {str(directory)!r}: {why}, so it is not this run's" in line, line
        assert _tree(directory) == before
    assert checkpoint.load(tmp_path / "run_b" / CHECKPOINT)["step"] == 1
    assert main(_train_argv(tmp_path, "run_b", "--steps", "3", "--resume", "--tensorboard", str(tbb))) == 0
    assert main(_train_argv(tmp_path, "run_a", "--steps", "3", "--resume", "--tensorboard", str(tba))) == 0
    capsys.readouterr()


# ---- 2. a user's config.yaml in --out -------------------------------------------------------------------------


USER_CONFIG = """\
# my experiment: a tiny run on the test corpus
data:
  corpus: {corpus}   # the generated test corpus
optim:
  steps: 3
  batch_size: 2
  seq_len: 16
  eval_every: 2    # eval twice
"""


@pytest.mark.slow
def test_a_users_config_yaml_in_out_is_never_replaced(tmp_path: Path, capsys) -> None:
    out = tmp_path / "exp"
    out.mkdir()
    mine = out / "config.yaml"
    mine.write_text(USER_CONFIG.format(corpus=_corpus(tmp_path)))
    before = mine.read_bytes()
    base = ["train", "--config", str(mine), "--out", str(out), "--no-progress"]
    assert main([*base, "--until", "1"]) == 0
    assert mine.read_bytes() == before  # the same job: left as it is (it is the run's record)
    assert main([*base, "--resume", "--until", "2", "--eval-every", "1"]) == 0  # a field free on resume: the same job
    assert mine.read_bytes() == before
    # a flag that makes another job than the file says: refused, nothing replaced or trained
    ckpt = (out / CHECKPOINT).read_bytes()
    assert main([*base, "--resume", "--steps", "4"]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert f"out_dir (--out) = {str(out)!r}: holds a config.yaml that moonrt did not write" in line, line
    assert "optim.steps: 3 there, 4 now" in line, line
    assert mine.read_bytes() == before and (out / CHECKPOINT).read_bytes() == ckpt
    assert main([*base, "--resume"]) == 0
    assert mine.read_bytes() == before and checkpoint.load(out / CHECKPOINT)["step"] == 3


@pytest.mark.slow  # training runs and a resume: CI runs it, the fast lane need not
def test_moonrts_own_config_yaml_is_marked_and_replaced_on_resume(tmp_path: Path) -> None:
    assert main(_train_argv(tmp_path, "run", "--steps", "3", "--until", "1")) == 0
    config = tmp_path / "run" / "config.yaml"
    assert config.read_text().startswith("# moonrt train: the job config of the run in this directory")
    assert yaml.safe_load(config.read_text())["optim"]["steps"] == 3
    # steps may grow on resume
    assert main(_train_argv(tmp_path, "run", "--steps", "4", "--until", "2", "--resume")) == 0
    assert yaml.safe_load(config.read_text())["optim"]["steps"] == 4
    legacy = config.read_text().split("\n", 1)[1]  # as an older moonrt wrote it: no header, its exact YAML
    config.write_text(legacy)
    assert main(_train_argv(tmp_path, "run", "--steps", "5", "--until", "3", "--resume")) == 0
    assert yaml.safe_load(config.read_text())["optim"]["steps"] == 5


# ---- 3. one step's memory, estimated before step 1 -------------------------------------------------------------


def test_a_batch_that_cannot_fit_is_refused_before_step_one(tmp_path: Path, capsys) -> None:
    assert main(_train_argv(tmp_path, "run", "--steps", "1", "--batch-size", "2000000", "--metrics",
                     str(tmp_path / "m.jsonl"))) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "optim.batch_size (--batch-size) = 2000000, optim.seq_len (--seq-len) = 16: one step needs an " \
           "estimated " in line, line
    limit = re.search(r"activations ([\d.]+) of 2000000 x 16 tokens per micro-step.* more than the ([\d.]+) GiB it "
                      r"can use \((MemAvailable of this host|cgroup limit .*)\); expected a smaller", line)
    assert limit and float(limit[1]) > float(limit[2]), line
    assert not (tmp_path / "run" / CHECKPOINT).exists() and not (tmp_path / "m.jsonl").exists()


def test_the_step_estimate_checks_the_devices_memory(monkeypatch) -> None:
    job = from_dict(JobConfig, {"optim": {"batch_size": 8}})
    est = step_memory.step_memory(job, 1)
    assert est.rows == 8 and est.tokens_per_row == 128 and 0 < est.state < est.activations
    monkeypatch.setattr(step_memory, "usable_memory", lambda device: (int(est.total) - 1, f"free memory of {device}"))
    with pytest.raises(ConfigError, match=r"optim.batch_size \(--batch-size\) = 8, .* more than the .* GiB it can use "
                                          r"\(free memory of cuda:0\)"):
        step_memory.check_step_memory(job, 1, torch.device("cuda:0"))
    monkeypatch.setattr(step_memory, "usable_memory", lambda device: (int(est.total), "MemAvailable"))
    assert step_memory.check_step_memory(job, 1, torch.device("cpu")) == est
    # grad_accum micro-steps and data-parallel ranks divide the rows a rank holds at once
    accum = from_dict(JobConfig, {"optim": {"batch_size": 8, "grad_accum": 4}})
    assert step_memory.step_memory(accum, 1).rows == 2 and step_memory.step_memory(job, 2).rows == 4
    assert step_memory.step_memory(accum, 1).activations < est.activations / 3


@pytest.mark.slow
def test_the_step_estimate_is_within_a_factor_2_of_the_measured_peak(tmp_path: Path) -> None:
    """The estimate's growth with the batch (activations) against the measured growth of the peak RSS of two real
    one-step runs (what the interpreter and libraries hold cancels), within a factor 2; and the whole estimate stays
    below the measured peak (a job that fits is never refused)."""
    peaks, estimates = {}, {}
    # the first run warms the on-disk caches (numba's compiled KDA kernels, fresh on a new checkout): compiling them
    # raises that process's peak RSS, so its figure is not used; the two measured batches are large enough (~0.3 and
    # ~1.2 GB of step memory) that the step, not start-up or the eval, sets each run's peak
    small, large = 8, 40
    for run, rows in enumerate((2, small, large)):
        metrics = tmp_path / f"m{run}.jsonl"
        args = ["train", "--steps", "1", "--batch-size", str(rows), "--set", "optim.eval_windows=2", "--threads", "1",
                "--out", str(tmp_path / f"o{run}"), "--metrics", str(metrics), "--no-progress"]
        done = subprocess.run([sys.executable, "-m", "moonrt.cli", *args], capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        peaks[rows] = _records(metrics)[0]["peak_mem_bytes"]
        estimates[rows] = step_memory.step_memory(from_dict(JobConfig, {"optim": {"batch_size": rows}}), 1).total
    measured, estimated = peaks[large] - peaks[small], estimates[large] - estimates[small]
    assert measured / 2 <= estimated <= 2 * measured, (measured, estimated, peaks, estimates)
    assert estimates[small] < peaks[small], (estimates, peaks)


@pytest.mark.slow
def test_peak_memory_is_the_runs_own_not_its_parents(tmp_path: Path) -> None:
    """A run started by a large parent reports its own peak: Linux folds the parent's resident size at fork into the
    child's ``ru_maxrss`` at exec, so a ``moonrt train`` started from a 2 GiB process (a test process late in the
    suite, a notebook) reported >= 2 GiB whatever it used; ``peak_mem_bytes`` is the address space's ``VmHWM``."""
    ballast = b"\x01" * (2 << 30)  # resident in this process when the run is forked
    metrics = tmp_path / "m.jsonl"
    args = ["train", "--steps", "1", "--batch-size", "2", "--set", "optim.eval_windows=2", "--threads", "1",
            "--out", str(tmp_path / "o"), "--metrics", str(metrics), "--no-progress"]
    done = subprocess.run([sys.executable, "-m", "moonrt.cli", *args], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert len(ballast) == 2 << 30
    peak = _records(metrics)[0]["peak_mem_bytes"]
    assert 0 < peak < 2 << 30, peak  # a one-step k3_tiny run holds well under 2 GiB
