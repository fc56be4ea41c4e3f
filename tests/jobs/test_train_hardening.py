"""``moonrt train`` against hostile-but-fair input: unsafe or broken checkpoints, resume mixing runs,
failed checkpoint writes, jobs with nothing to do, metrics after a kill, unwritable outputs.

Every CLI error is one line on stderr with exit 2; nothing is trained, overwritten or executed.
"""

from __future__ import annotations

import os
import resource
import signal
from pathlib import Path

import pytest
import torch
from jobs.helpers import _corpus, _one_error_line, _records, _train_argv

from moonrt.cli import main
from moonrt.comm.parallelism import Parallelism, Part
from moonrt.config import from_dict
from moonrt.jobs.checkpoint import single as checkpoint
from moonrt.jobs.checkpoint.store import save_checkpoint
from moonrt.jobs.train.assemble import build_model
from moonrt.jobs.train.config import JobConfig
from moonrt.jobs.train.loop import CHECKPOINT, train
from moonrt.jobs.train.optimizers import build_optimizer
from moonrt.jobs.train.resume import check_resume

MARKER_ENV = "MOONRT_TEST_MARKER"


class Evil:
    """Unpickling this runs a shell command that creates the file named in its argument."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_malicious_checkpoint_is_refused_and_runs_nothing(tmp_path: Path, capsys) -> None:
    marker = tmp_path / "pwned"
    out = tmp_path / "run"
    out.mkdir()
    torch.save({"model": {}, "optimizer": Evil(marker), "step": 1, "config": {}}, out / CHECKPOINT)
    assert main(_train_argv(tmp_path, "run", "--steps", "3", "--resume")) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "refused to load (weights_only=True)" in line and str(out / CHECKPOINT) in line
    assert not marker.exists()
    torch.load(out / CHECKPOINT, weights_only=False)  # the file really is hostile: plain unpickling runs it
    assert marker.exists()


@pytest.mark.parametrize("kind", ["empty", "truncated", "garbage", "not_a_dict"])
def test_broken_checkpoints_name_the_file(tmp_path: Path, capsys, kind: str) -> None:
    out = tmp_path / "run"
    out.mkdir()
    path = out / CHECKPOINT
    if kind == "empty":
        path.write_bytes(b"")
    elif kind == "garbage":
        path.write_bytes(os.urandom(4096))
    else:
        torch.save({"x": torch.ones(10_000)} if kind == "truncated" else [1, 2, 3], path)
        if kind == "truncated":
            path.write_bytes(path.read_bytes()[:20_000])
    assert main(_train_argv(tmp_path, "run", "--steps", "3", "--resume")) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert f"checkpoint {str(path)!r}" in line


@pytest.mark.slow  # a training run, then a resume per changed field: CI runs it, the fast lane need not
def test_resume_refuses_a_different_job_and_names_each_field(tmp_path: Path, capsys) -> None:
    assert main(_train_argv(tmp_path, "run", "--steps", "4", "--until", "2")) == 0
    capsys.readouterr()
    ckpt = (tmp_path / "run" / CHECKPOINT).read_bytes()
    assert main(_train_argv(tmp_path, "run", "--steps", "4", "--resume", "--lr", "0.001", "--seed", "3")) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "optim.lr: checkpoint 0.004, now 0.001" in line and "optim.seed: checkpoint 0, now 3" in line
    for flag, value, field in (("--seq-len", "8", "optim.seq_len"), ("--batch-size", "4", "optim.batch_size"),
                               ("--model", "k3", "model"), ("--steps", "3", "optim.steps")):
        args = _train_argv(tmp_path, "run", "--steps", "4", "--resume", flag, value)  # argparse: the last value wins
        assert main(args) == 2, flag
        assert field in _one_error_line(capsys.readouterr().err), flag
    assert (tmp_path / "run" / CHECKPOINT).read_bytes() == ckpt  # nothing was written
    # named fields may change; steps may grow without being named
    assert main(_train_argv(tmp_path, "run", "--steps", "5", "--resume", "--lr", "0.001",
                     "--resume-allow-changes", "lr")) == 0
    assert checkpoint.load(tmp_path / "run" / CHECKPOINT)["step"] == 5
    assert main(_train_argv(tmp_path, "run", "--steps", "6", "--resume", "--resume-allow-changes", "nonsense")) == 2
    assert "unknown field 'nonsense'" in _one_error_line(capsys.readouterr().err)


def test_failed_checkpoint_write_keeps_the_previous_one_and_no_temp_file(tmp_path: Path) -> None:
    job = from_dict(JobConfig, {"out_dir": str(tmp_path)})
    model = build_model(job)
    opt = build_optimizer(model, job.optim)
    path = tmp_path / CHECKPOINT
    save_checkpoint(path, model, opt, 7, job)
    good = path.read_bytes()
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (len(good) // 2, hard))  # a "full disk" for files past half the size
    try:
        with pytest.raises(checkpoint.CheckpointError, match=f"checkpoint write failed: {path}: File too large"):
            save_checkpoint(path, model, opt, 8, job)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old_handler)
    assert sorted(p.name for p in tmp_path.iterdir()) == [CHECKPOINT]
    assert path.read_bytes() == good and checkpoint.load(path)["step"] == 7


def test_nothing_to_do_and_bad_until_are_one_line(tmp_path: Path, capsys) -> None:
    for until in ("0", "-3"):
        assert main(_train_argv(tmp_path, "a", "--steps", "2", "--until", until)) == 2
        assert f"--until = {until}: expected an integer >= 1" in _one_error_line(capsys.readouterr().err)
    assert main(_train_argv(tmp_path, "a", "--steps", "2")) == 0
    capsys.readouterr()
    assert main(_train_argv(tmp_path, "a", "--steps", "2", "--resume")) == 0  # a finished run is not an error
    captured = capsys.readouterr()
    assert "already finished: checkpoint at step 2 of 2; nothing to do" in captured.out and not captured.err
    assert main(_train_argv(tmp_path, "a", "--steps", "4", "--until", "2", "--resume")) == 0
    assert "already at or past --until 2" in capsys.readouterr().out
    assert main(_train_argv(tmp_path, "a", "--steps", "1", "--resume", "--resume-allow-changes", "steps")) == 2
    assert "expected at least the checkpoint's step 2" in _one_error_line(capsys.readouterr().err)
    # a fresh run into the same directory would overwrite the finished run's checkpoint
    assert main(_train_argv(tmp_path, "a", "--steps", "2")) == 2
    assert "already holds checkpoint.pt" in _one_error_line(capsys.readouterr().err)


def test_a_field_the_checkpoint_predates_counts_as_its_default() -> None:
    """A checkpoint written before a job-config field existed resumes when the job keeps the field's default,
    and is refused (naming the field) when the job sets another value."""
    from moonrt.config import to_dict

    stored = to_dict(JobConfig())
    del stored["optim"]["optimizer"]
    check_resume(stored, to_dict(JobConfig()), 2)
    new = to_dict(JobConfig())
    new["optim"]["optimizer"] = "muon"
    with pytest.raises(checkpoint.CheckpointError, match="optim.optimizer: checkpoint 'adamw', now 'muon'"):
        check_resume(stored, new, 2)


def test_metrics_after_kill_and_resume_hold_each_step_once(tmp_path: Path) -> None:
    job = from_dict(JobConfig, {"data": {"corpus": str(_corpus(tmp_path))}, "out_dir": str(tmp_path / "run"),
                                "optim": {"steps": 6, "batch_size": 2, "seq_len": 16, "eval_every": 3,
                                          "eval_windows": 2, "checkpoint_every": 2}})
    metrics = tmp_path / "m.jsonl"

    class KillAtStep4(Part):
        def step_metrics(self, step: int, model: torch.nn.Module, record: dict) -> None:
            if step == 3:  # 0-based: steps 1-3 logged, checkpoint at step 2
                raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(job, rt=Parallelism(parts=[KillAtStep4()]), metrics_path=str(metrics), progress=False)
    assert [r["step"] for r in _records(metrics)] == [1, 2, 3]
    with metrics.open("a") as f:
        f.write('{"step": 4, "loss": 1.')  # a line cut by the kill
    train(job, metrics_path=str(metrics), resume=True, progress=False)
    assert [r["step"] for r in _records(metrics)] == [1, 2, 3, 4, 5, 6]
    assert not list(tmp_path.glob("m.jsonl.tmp*"))


def test_unwritable_outputs_fail_before_step_one(tmp_path: Path, capsys) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    cases = [
        (["--out", str(blocker / "out")], "out_dir (--out)"),
        (["--metrics", str(blocker / "m.jsonl")], "--metrics directory"),
        (["--metrics", str(tmp_path)], "is a directory"),
        (["--routing-trace", str(blocker / "t.npz")], "routing_trace (--routing-trace) directory"),
    ]
    for extra, field in cases:
        args = _train_argv(tmp_path, "o", "--steps", "2") + extra
        assert main(args) == 2, extra
        assert field in _one_error_line(capsys.readouterr().err), extra
        assert not (tmp_path / "o" / CHECKPOINT).exists()  # nothing trained
    existing = tmp_path / "old.jsonl"
    existing.write_text('{"step": 1}\n')
    assert main(_train_argv(tmp_path, "o2", "--steps", "2", "--metrics", str(existing))) == 2
    assert "file exists" in _one_error_line(capsys.readouterr().err)
    assert existing.read_text() == '{"step": 1}\n'  # never truncated


def test_missing_or_directory_token_corpus(tmp_path: Path, capsys) -> None:
    for corpus, what in ((tmp_path / "missing.bin", "missing"), (tmp_path, "a directory")):
        assert main(["train", "--corpus", str(corpus), "--token-dtype", "uint16", "--out", str(tmp_path / "o")]) == 2
        line = _one_error_line(capsys.readouterr().err)
        assert f"corpus (--corpus) = {str(corpus)!r}: {what}; expected an existing file (a uint16 token file)" in line


def test_remote_memory_policy_is_refused_in_one_line(tmp_path: Path, capsys) -> None:
    policy = tmp_path / "remote.yaml"
    policy.write_text("default: remote\n")
    assert main(_train_argv(tmp_path, "o", "--steps", "2", "--memory-policy", str(policy))) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "uses remote, which moonrt train does not support" in line and str(policy) in line
    assert not (tmp_path / "o" / CHECKPOINT).exists()


def test_an_abort_raised_inside_a_checkpoint_write_propagates_and_keeps_the_previous_file(tmp_path: Path,
                                                                                          monkeypatch) -> None:
    """A second stop signal's :class:`Aborted` raised while ``torch.save`` writes (the handler runs inside the
    write) reaches the caller as itself, not as torch's "unexpected pos" write error (exit 128 + n, not 2); the
    temp file is removed and the previous checkpoint still loads."""
    from moonrt.cluster.preempt import Aborted

    path = tmp_path / "c.pt"
    checkpoint.save(path, {"step": 1, "x": torch.zeros(10)})
    calls, write = [0], checkpoint._Sink.write

    class _Abort:
        def write(self, data: bytes) -> int:
            raise Aborted(signal.SIGINT)

    def interrupted(self, data: bytes) -> int:  # the third write of the zip stream is interrupted
        calls[0] += 1
        if calls[0] == 3:
            self.f = _Abort()
        return write(self, data)

    monkeypatch.setattr(checkpoint._Sink, "write", interrupted)
    with pytest.raises(Aborted, match="second SIGINT"):
        checkpoint.save(path, {"step": 2, "x": torch.ones(100_000)})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.pt"]
    assert torch.load(path, weights_only=True)["step"] == 1
