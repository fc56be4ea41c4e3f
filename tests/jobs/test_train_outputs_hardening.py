"""``moonrt train`` never writes through what is not its own (issue 28): a user's ``config.yaml``, a planted
symlink, an unrelated ``--metrics`` or ``--routing-trace`` file, the current directory; one run per ``--out``
(an exclusive lock); a torn first sharded save does not block a requeued job; a full disk is one line; a
diverged run stops before the optimizer step and any save, exit 1, and its metrics stay valid JSON.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from jobs.helpers import _corpus, _one_error_line, _train_argv, _tree

from moonrt.cli import main
from moonrt.comm.parallelism import Parallelism, Part
from moonrt.config import ConfigError, from_dict
from moonrt.jobs.checkpoint import sharded as checkpoint_dcp
from moonrt.jobs.checkpoint import single as checkpoint
from moonrt.jobs.train import outputs
from moonrt.jobs.train.config import JobConfig
from moonrt.jobs.train.loop import CHECKPOINT, train
from moonrt.scheduler.workload import load_trace

LOCK = ".moonrt.lock"
MOONRT = [sys.executable, "-m", "moonrt.cli"]


def _strict_records(path: Path) -> list[dict]:
    """Every line parsed as strict JSON (a bare NaN / Infinity raises)."""
    def refuse(name: str) -> None:
        raise ValueError(f"non-JSON constant {name} in {path}")

    return [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]


def _env() -> dict[str, str]:
    """This environment without launcher variables (the test may itself run under a launcher)."""
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    return {k: v for k, v in os.environ.items() if k not in drop and not k.startswith(("SLURM_", "OMPI_", "PMI"))}


class _FileSizeLimit:
    """A "full disk": writes past ``limit`` bytes of any one file fail (EFBIG) while in the block."""

    def __init__(self, limit: int) -> None:
        self.limit = limit

    def __enter__(self) -> _FileSizeLimit:
        self.handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        self.soft, self.hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (self.limit, self.hard))
        return self

    def __exit__(self, *exc: object) -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (self.soft, self.hard))
        signal.signal(signal.SIGXFSZ, self.handler)


# ---- 1. config.yaml ----------------------------------------------------------------------------------------


@pytest.mark.slow  # training runs into one --out: CI runs it, the fast lane need not
def test_fresh_run_refuses_a_config_yaml_that_is_not_its_own(tmp_path: Path, capsys) -> None:
    out = tmp_path / "run"
    out.mkdir()
    mine = out / "config.yaml"
    mine.write_text("# my notes, not a moonrt job\nexperiment: 7\n")
    assert main(_train_argv(tmp_path, "run", "--steps", "2")) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "out_dir (--out)" in line and "config.yaml" in line
    assert mine.read_text() == "# my notes, not a moonrt job\nexperiment: 7\n"
    assert not (out / CHECKPOINT).exists()
    # the config.yaml of another job: refused, naming the field that differs
    assert main(_train_argv(tmp_path, "other", "--steps", "2", "--until", "1", "--lr", "0.001")) == 0
    other = (tmp_path / "other" / "config.yaml").read_bytes()
    (tmp_path / "other" / CHECKPOINT).unlink()  # killed before its first checkpoint: only config.yaml is left
    assert main(_train_argv(tmp_path, "other", "--steps", "2")) == 2
    assert "optim.lr" in _one_error_line(capsys.readouterr().err)
    assert (tmp_path / "other" / "config.yaml").read_bytes() == other
    # this job's own config.yaml (a run killed before its first checkpoint) starts again
    assert main(_train_argv(tmp_path, "other", "--steps", "2", "--lr", "0.001")) == 0
    assert checkpoint.load(tmp_path / "other" / CHECKPOINT)["step"] == 2


@pytest.mark.slow  # training runs and a resume: CI runs it, the fast lane need not
def test_a_planted_symlink_beside_config_yaml_is_not_written_through(tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.yaml.tmp").symlink_to(victim)
    assert main(_train_argv(tmp_path, "run", "--steps", "3", "--until", "1")) == 0
    assert main(_train_argv(tmp_path, "run", "--steps", "3", "--resume")) == 0
    assert victim.read_text() == "precious\n"
    assert (out / "config.yaml.tmp").is_symlink()  # not ours: left alone
    assert "optim:" in (out / "config.yaml").read_text() and not (out / "config.yaml").is_symlink()
    assert sorted(p.name for p in out.iterdir()) == [CHECKPOINT, "config.yaml", "config.yaml.tmp", "run_id"]  # no temp


@pytest.mark.slow  # a training run on a full filesystem: CI runs it, the fast lane need not
def test_full_disk_at_the_config_write_is_one_line_and_leaves_no_temp(tmp_path: Path, capsys) -> None:
    assert main(_train_argv(tmp_path, "run", "--steps", "3", "--until", "1")) == 0
    out = tmp_path / "run"
    before = _tree(out)
    with _FileSizeLimit(64):  # config.yaml is larger
        assert main(_train_argv(tmp_path, "run", "--steps", "3", "--resume")) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert str(out / "config.yaml") in line and "File too large" in line
    assert _tree(out) == before  # no temp file; config.yaml and the checkpoint untouched
    assert main(_train_argv(tmp_path, "run", "--steps", "3", "--resume")) == 0  # the next resume works


def test_full_disk_at_a_metrics_write_is_one_error_naming_the_file(tmp_path: Path) -> None:
    metrics = tmp_path / "m.jsonl"
    job = from_dict(JobConfig, {"data": {"corpus": str(_corpus(tmp_path))}, "out_dir": str(tmp_path / "run"),
                                "optim": {"steps": 4, "batch_size": 2, "seq_len": 16, "eval_every": 100,
                                          "eval_windows": 2, "checkpoint_every": 1}})

    class DiskFullAtStep3(Part):
        def step_metrics(self, step: int, model: torch.nn.Module, record: dict) -> None:
            if step == 2:  # 0-based: the metrics file cannot grow from here on
                resource.setrlimit(resource.RLIMIT_FSIZE, (metrics.stat().st_size + 10, limit.hard))

    with _FileSizeLimit(resource.RLIM_INFINITY) as limit, pytest.raises(ConfigError) as info:
        train(job, rt=Parallelism(parts=[DiskFullAtStep3()]), metrics_path=str(metrics), progress=False)
    message = str(info.value)
    assert str(metrics) in message and "File too large" in message and "\n" not in message
    assert checkpoint.load(tmp_path / "run" / CHECKPOINT)["step"] == 2  # step 3 was not checkpointed
    train(job, metrics_path=str(metrics), resume=True, progress=False)  # the cut line is trimmed on resume
    assert [r["step"] for r in _strict_records(metrics)] == [1, 2, 3, 4]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.txt", "m.jsonl", "run"]


def test_metrics_trim_on_a_full_disk_keeps_the_file(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    run_id = "0123456789abcdef" * 2
    records = [{"step": s, "loss": 1.0, "lr": 0.1, "grad_norm": 1.0, "tokens_per_s": 5.0, "tokens": 32 * s,
                "run_id": run_id} for s in range(1, 6)]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    before = path.read_bytes()
    with _FileSizeLimit(100), pytest.raises(ConfigError, match=re.escape(str(path))):
        outputs.open_metrics(str(path), 3, run_id)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.jsonl"]


# ---- 2. a torn first sharded save ----------------------------------------------------------------------------


def _torn_first_save(tmp_path: Path, out: str, *job_flags: str) -> Path:
    """OUT as a requeued job finds it after a kill during its first sharded save: config.yaml of the job,
    OUT/checkpoint/step-00000002.tmp with partial shard files, no committed step, no checkpoint.pt."""
    assert main(_train_argv(tmp_path, out, "--steps", "4", "--until", "1", *job_flags)) == 0
    run = tmp_path / out
    (run / CHECKPOINT).unlink()
    torn = run / "checkpoint" / "step-00000002.tmp"
    torn.mkdir(parents=True)
    (torn / "__0_0.distcp").write_bytes(os.urandom(3000))
    (torn / "__1_0.distcp").write_bytes(os.urandom(1000))
    return torn


@pytest.mark.slow
def test_a_torn_first_sharded_save_of_this_run_starts_fresh_on_requeue(tmp_path: Path, capsys) -> None:
    torn = _torn_first_save(tmp_path, "run")
    capsys.readouterr()
    assert main(_train_argv(tmp_path, "run", "--steps", "4", "--resume-if-exists", "--metrics",
                     str(tmp_path / "m.jsonl"))) == 0
    assert checkpoint.load(tmp_path / "run" / CHECKPOINT)["step"] == 4
    assert [r["step"] for r in _strict_records(tmp_path / "m.jsonl")] == [1, 2, 3, 4]  # started at step 1
    assert torn.is_dir()  # a single process writes checkpoint.pt; the next sharded commit clears the stale .tmp
    assert main(_train_argv(tmp_path, "run", "--steps", "5", "--resume-if-exists")) == 0  # and resumes from it now
    assert checkpoint.load(tmp_path / "run" / CHECKPOINT)["step"] == 5


@pytest.mark.slow
def test_two_ranks_requeued_after_a_torn_first_save_commit_and_clear_it(tmp_path: Path) -> None:
    """The SLURM case end to end: ``moonrt launch -n 2 ... --resume-if-exists`` on a torn first sharded save of
    the same job trains from step 1, and its first commit removes the stale ``.tmp``."""
    _torn_first_save(tmp_path, "run")
    argv = [*MOONRT, "launch", "-n", "2", "--timeout", "120", "--", *MOONRT,
            *_train_argv(tmp_path, "run", "--steps", "4", "--resume-if-exists", "--threads", "1", "--metrics",
                  str(tmp_path / "m.jsonl"))]
    done = subprocess.run(argv, env=_env(), capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    root = tmp_path / "run" / "checkpoint"
    assert sorted(p.name for p in root.iterdir()) == ["step-00000004"]
    assert checkpoint_dcp.read_marker(root / "step-00000004")["step"] == 4
    assert [r["step"] for r in _strict_records(tmp_path / "m.jsonl")] == [1, 2, 3, 4]


def test_a_torn_first_sharded_save_of_another_run_is_refused(tmp_path: Path, capsys) -> None:
    torn = _torn_first_save(tmp_path, "run", "--seed", "5")
    before = _tree(tmp_path / "run")
    capsys.readouterr()
    for flag in ("--resume-if-exists", None):
        assert main(_train_argv(tmp_path, "run", "--steps", "4", *([flag] if flag else []))) == 2
        line = _one_error_line(capsys.readouterr().err)
        assert "out_dir (--out)" in line and str(torn.parent) in line, line
        assert _tree(tmp_path / "run") == before


# ---- 4. divergence -------------------------------------------------------------------------------------------


def _diverged(err: str) -> tuple[int, str]:
    line = _one_error_line(err)
    match = re.search(r"diverged at step (\d+): loss = (\S+), grad norm = (\S+);", line)
    assert match, line
    assert "try a lower --lr" in line
    return int(match.group(1)), line


def test_divergence_stops_before_the_update_and_any_save(tmp_path: Path, capsys) -> None:
    metrics = tmp_path / "m.jsonl"
    assert main(_train_argv(tmp_path, "run", "--steps", "6", "--lr", "1e5", "--metrics", str(metrics))) == 1
    step, line = _diverged(capsys.readouterr().err)
    assert "no checkpoint" in line
    assert not (tmp_path / "run" / CHECKPOINT).exists() and not (tmp_path / "run" / "checkpoint").exists()
    records = _strict_records(metrics)
    assert [r["step"] for r in records] == list(range(1, step + 1))
    assert records[-1]["loss"] is None or records[-1]["grad_norm"] is None  # the non-finite values as null
    assert all(r["loss"] is not None and r["grad_norm"] is not None for r in records[:-1])


def test_divergence_after_a_checkpoint_keeps_it_unchanged(tmp_path: Path, capsys) -> None:
    assert main(_train_argv(tmp_path, "run", "--steps", "6", "--lr", "1e5", "--until", "1")) == 0
    ckpt = tmp_path / "run" / CHECKPOINT
    saved = ckpt.read_bytes()
    assert main(_train_argv(tmp_path, "run", "--steps", "6", "--lr", "1e5", "--resume")) == 1
    step, line = _diverged(capsys.readouterr().err)
    assert step >= 2 and f"{str(ckpt)!r} holds step 1" in line
    assert ckpt.read_bytes() == saved
    state = checkpoint.load(ckpt)
    assert all(torch.isfinite(t).all() for t in state["model"].values() if t.is_floating_point())


@pytest.mark.slow
def test_two_ranks_agree_on_divergence_and_save_nothing(tmp_path: Path) -> None:
    """2 ranks (dp 2, sharded checkpoints): the loss summed and the norm global, both ranks stop at the same step
    before the update; no checkpoint directory, exit 1 through ``moonrt launch``, one diverged line (rank 0)."""
    metrics = tmp_path / "m.jsonl"
    argv = [*MOONRT, "launch", "-n", "2", "--timeout", "120", "--", *MOONRT,
            *_train_argv(tmp_path, "run", "--steps", "6", "--lr", "1e5", "--threads", "1", "--metrics", str(metrics))]
    done = subprocess.run(argv, env=_env(), capture_output=True, text=True, timeout=400)
    output = done.stdout + done.stderr
    assert done.returncode == 1, output[-4000:]
    assert len(re.findall(r"\] moonrt train: error: diverged at step \d+: ", output)) == 1, output[-4000:]
    assert not (tmp_path / "run" / "checkpoint").exists() and not (tmp_path / "run" / CHECKPOINT).exists()
    records = _strict_records(metrics)
    assert records[-1].get("diverged") is True and all("diverged" not in r for r in records[:-1])


def test_metrics_lines_are_strict_json() -> None:
    line = outputs.json_line({"step": 3, "loss": float("nan"), "grad_norm": float("inf"), "lr": 0.1,
                              "eval_loss": float("-inf")})
    assert json.loads(line) == {"step": 3, "loss": None, "grad_norm": None, "lr": 0.1, "eval_loss": None}
    assert line.endswith("\n") and line.count("\n") == 1


# ---- 5. one run per --out ------------------------------------------------------------------------------------


def test_a_second_run_into_a_locked_out_dir_is_refused_and_writes_nothing(tmp_path: Path, capsys) -> None:
    out = tmp_path / "run"
    out.mkdir()
    fd = os.open(out / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(fd, b"4242\n")  # the holder's pid, as moonrt writes it
        before = _tree(out)
        assert main(_train_argv(tmp_path, "run", "--steps", "2", "--metrics", str(tmp_path / "m.jsonl"))) == 2
        line = _one_error_line(capsys.readouterr().err)
        assert "out_dir (--out)" in line and str(out) in line and "pid 4242" in line, line
        assert _tree(out) == before and not (tmp_path / "m.jsonl").exists()
        assert main(_train_argv(tmp_path, "run", "--steps", "2", "--resume-if-exists")) == 2
        capsys.readouterr()
        assert _tree(out) == before
    finally:
        os.close(fd)  # released: as when the holder dies
    assert main(_train_argv(tmp_path, "run", "--steps", "2")) == 0
    assert checkpoint.load(out / CHECKPOINT)["step"] == 2


@pytest.mark.slow
def test_a_killed_runs_lock_is_released_and_the_requeued_job_starts_again(tmp_path: Path, capsys) -> None:
    """Two processes: while a run holds ``--out`` (stopped, not dead) a second one is refused naming its pid;
    after ``kill -9`` (no checkpoint yet) ``--resume-if-exists`` takes the directory and its metrics over."""
    metrics, run = tmp_path / "m.jsonl", tmp_path / "run"
    flags = ("--steps", "400", "--metrics", str(metrics))
    first = subprocess.Popen([*MOONRT, *_train_argv(tmp_path, "run", *flags, "--threads", "1")], env=_env(),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not (metrics.exists() and metrics.read_text().count("\n") >= 1):
            assert first.poll() is None, first.communicate()[0][-4000:]
            assert time.monotonic() < deadline, "no metrics line of the first run"
            time.sleep(0.05)
        os.kill(first.pid, signal.SIGSTOP)  # holds the lock, writes nothing more
        before = _tree(tmp_path)
        assert main(_train_argv(tmp_path, "run", *flags, "--until", "2", "--resume-if-exists")) == 2
        line = _one_error_line(capsys.readouterr().err)
        assert f"pid {first.pid}" in line and str(run) in line, line
        assert _tree(tmp_path) == before
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.communicate()
    assert (run / LOCK).exists() and not (run / CHECKPOINT).exists()  # left by the kill, unlocked
    assert main(_train_argv(tmp_path, "run", *flags, "--until", "2", "--resume-if-exists")) == 0
    assert [r["step"] for r in _strict_records(metrics)] == [1, 2]
    assert checkpoint.load(run / CHECKPOINT)["step"] == 2 and not (run / LOCK).exists()


def test_the_lock_is_held_for_the_whole_run(tmp_path: Path) -> None:
    out = tmp_path / "run"
    job = from_dict(JobConfig, {"data": {"corpus": str(_corpus(tmp_path))}, "out_dir": str(out),
                                "optim": {"steps": 2, "batch_size": 2, "seq_len": 16, "eval_windows": 2}})
    seen: list[int] = []

    class TryTheLock(Part):
        def step_metrics(self, step: int, model: torch.nn.Module, record: dict) -> None:
            fd = os.open(out / LOCK, os.O_RDWR)
            try:
                with pytest.raises(BlockingIOError):
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                seen.append(int((out / LOCK).read_text()))
            finally:
                os.close(fd)

    train(job, rt=Parallelism(parts=[TryTheLock()]), progress=False)
    assert seen == [os.getpid()] * 2
    with pytest.raises(ConfigError, match="already holds checkpoint.pt"):  # released: the next run gets that far
        train(job, progress=False)


# ---- 6. --metrics, --routing-trace, --out '' -----------------------------------------------------------------


@pytest.mark.slow  # training runs and a resume: CI runs it, the fast lane need not
def test_resume_never_trims_a_file_that_is_not_this_runs_metrics(tmp_path: Path, capsys) -> None:
    assert main(_train_argv(tmp_path, "run", "--steps", "4", "--until", "2", "--metrics",
                            str(tmp_path / "m.jsonl"))) == 0
    notes = tmp_path / "notes.txt"
    notes.write_text('my notes\n{"step": 1, "loss": 2.0}\nmore notes\n')
    cut = tmp_path / "cut.jsonl"  # a moonrt metrics file with a damaged line that is not the last one
    lines = (tmp_path / "m.jsonl").read_text().splitlines(keepends=True)
    cut.write_text(lines[0][:20] + "\n" + lines[1])
    for path in (notes, cut):
        before = path.read_bytes()
        assert main(_train_argv(tmp_path, "run", "--steps", "4", "--resume", "--metrics", str(path))) == 2
        line = _one_error_line(capsys.readouterr().err)
        assert f"--metrics = {str(path)!r}" in line, line
        assert path.read_bytes() == before
    assert checkpoint.load(tmp_path / "run" / CHECKPOINT)["step"] == 2  # nothing trained
    assert main(_train_argv(tmp_path, "run", "--steps", "4", "--resume", "--metrics", str(tmp_path / "m.jsonl"))) == 0
    assert [r["step"] for r in _strict_records(tmp_path / "m.jsonl")] == [1, 2, 3, 4]


@pytest.mark.slow  # two-rank training runs: CI runs it, the fast lane need not
def test_routing_trace_never_overwrites_a_file_that_is_not_this_runs(tmp_path: Path, capsys) -> None:
    user = tmp_path / "user.npz"
    np.savez(user, counts=np.ones((1, 1, 1, 4), dtype=np.int64))
    before = user.read_bytes()
    assert main(_train_argv(tmp_path, "run", "--steps", "3", "--routing-trace", str(user))) == 2
    assert "routing_trace (--routing-trace)" in _one_error_line(capsys.readouterr().err)
    assert user.read_bytes() == before and not (tmp_path / "run" / CHECKPOINT).exists()
    own = tmp_path / "own.npz"
    assert main(_train_argv(tmp_path, "run", "--steps", "3", "--until", "1", "--routing-trace", str(own))) == 0
    assert load_trace(own).counts.shape[0] == 1
    assert main(_train_argv(tmp_path, "run", "--steps", "3", "--resume", "--routing-trace",
                            str(user))) == 2  # not its own
    assert "routing_trace (--routing-trace)" in _one_error_line(capsys.readouterr().err)
    assert user.read_bytes() == before
    assert main(_train_argv(tmp_path, "run", "--steps", "3", "--resume", "--routing-trace", str(own))) == 0  # its own
    assert load_trace(own).counts.shape[0] == 2  # the steps of this invocation
    assert not [p for p in tmp_path.iterdir() if p.name.startswith((".own", "own.npz."))]  # no temp file


def test_save_trace_replaces_a_symlink_instead_of_writing_through_it(tmp_path: Path) -> None:
    from moonrt.scheduler.workload import save_trace

    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    link = tmp_path / "t.npz"
    link.symlink_to(victim)
    save_trace(link, np.ones((1, 1, 1, 4), dtype=np.int64), top_k=1)
    assert victim.read_text() == "precious\n" and not link.is_symlink()
    assert load_trace(link).counts.sum() == 4


def test_an_empty_out_is_refused_naming_the_flag(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    _corpus(tmp_path)
    before = _tree(tmp_path)
    args = _train_argv(tmp_path, "x", "--steps", "2")
    args[args.index("--out") + 1] = ""
    assert main(args) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "out_dir (--out) = ''" in line
    assert _tree(tmp_path) == before


def test_lock_file_that_is_not_ours_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "run"
    out.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (out / LOCK).symlink_to(victim)
    with pytest.raises(ConfigError, match=re.escape(str(out))), outputs.lock_out_dir(out):
        pass
    (out / LOCK).unlink()
    os.link(victim, out / LOCK)  # a hard link to a user's file
    with pytest.raises(ConfigError, match=re.escape(str(out))), outputs.lock_out_dir(out):
        pass
    assert victim.read_text() == "precious\n"
