"""What a new user meets on day one (issue 36): the written-out default config, the README's "Other runs" lines
after the quick start, honest summaries of stopped and resumed runs, and a stop signal that arrives while
``moonrt train`` is still importing torch."""

from __future__ import annotations

import math
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from jobs.helpers import _corpus, _records

from moonrt.cli import main
from moonrt.cluster.preempt import PREEMPTED_EXIT
from moonrt.config import load_yaml, read_yaml, to_dict
from moonrt.jobs.checkpoint import store
from moonrt.jobs.train.config import JobConfig
from moonrt.jobs.train.outputs import CHECKPOINT, has_checkpoint
from moonrt.jobs.train.resume import BUILDER

ROOT = Path(__file__).resolve().parents[2]


def test_k3_tiny_yaml_is_the_embedded_default() -> None:
    path = ROOT / "configs" / "k3_tiny.yaml"
    validated = JobConfig()
    validated.validate()  # fills in what the job resolves (qat_block: the preset's)
    assert to_dict(load_yaml(JobConfig, path)) == to_dict(validated)
    assert "refused until" not in path.read_text()  # the device comment said cuda was refused (issue 49 item 9)
    assert read_yaml(path) == to_dict(JobConfig()), "configs/k3_tiny.yaml must write out every key of JobConfig()"


def _train(tmp_path: Path, out: str, *extra: str) -> list[str]:
    """A tiny ``moonrt train`` command line with the progress bar and summary on (test_train_hardening's sizes)."""
    return ["train", "--corpus", str(_corpus(tmp_path)), "--batch-size", "2", "--seq-len", "16",
            "--out", str(tmp_path / out), *extra]


def _summary(out: str) -> str:
    lines = [line for line in out.splitlines() if line.startswith("summary: ")]
    assert len(lines) == 1, out
    return lines[0]


def test_until_before_the_first_eval_evaluates_at_the_stop_step(tmp_path: Path, capsys, monkeypatch) -> None:
    for stream in (sys.stdout, sys.stderr):  # a terminal: the tqdm bar (else plain lines, test_train_metrics)
        monkeypatch.setattr(stream, "isatty", lambda: True)
    metrics = tmp_path / "m.jsonl"
    assert main(_train(tmp_path, "run", "--steps", "4", "--until", "2", "--eval-every", "3",
                       "--metrics", str(metrics))) == 0
    captured = capsys.readouterr()
    summary = _summary(captured.out)
    assert "nan" not in summary, summary
    assert "eval loss " in summary and " (step " not in summary, summary  # the eval is of the stop step
    assert "eval=nan" not in captured.err and "loss=" in captured.err, captured.err  # the bar was drawn
    records = _records(metrics)
    assert [r["step"] for r in records] == [1, 2]
    assert "eval_loss" not in records[0] and math.isfinite(records[1]["eval_loss"])
    assert f"eval loss {records[1]['eval_loss']:.3f} nats/token" in summary


@pytest.mark.slow  # training runs and a resume: CI runs it, the fast lane need not
def test_resumed_run_says_so_and_its_summary_counts_its_own_steps(tmp_path: Path, capsys) -> None:
    assert main(_train(tmp_path, "run", "--steps", "4", "--until", "2")) == 0
    first = capsys.readouterr().out
    assert "resumed from" not in first and "summary: 2 steps in " in _summary(first)
    assert main(_train(tmp_path, "run", "--steps", "4", "--resume")) == 0
    out = capsys.readouterr().out
    resumed = [line for line in out.splitlines() if "resumed from" in line]
    assert resumed == [f"moonrt train: resumed from step 2 (checkpoint {str(tmp_path / 'run' / CHECKPOINT)!r})"], out
    assert _summary(out).startswith("summary: steps 3-4: 2 steps in "), out


def test_resume_keeps_the_metrics_file_mode(tmp_path: Path) -> None:
    metrics = tmp_path / "m.jsonl"
    assert main(_train(tmp_path, "run", "--steps", "3", "--until", "1", "--metrics", str(metrics),
                       "--no-progress")) == 0
    metrics.chmod(0o640)  # not the umask's default: the mode must come from the file
    assert main(_train(tmp_path, "run", "--steps", "3", "--until", "2", "--resume", "--metrics", str(metrics),
                       "--no-progress")) == 0
    assert stat.S_IMODE(metrics.stat().st_mode) == 0o640
    assert [r["step"] for r in _records(metrics)] == [1, 2]


# A `moonrt train` process that stops just before it imports torch (the first import of `torch` writes a line on
# stdout and waits for one on stdin): the test signals it there, which is before any handler of the training loop
# could exist, with no race and no sleep.
_PAUSE_AT_TORCH = """
import importlib.abc, sys
class Pause(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            sys.meta_path.remove(self)
            print("importing torch", flush=True)
            sys.stdin.readline()
        return None
sys.meta_path.insert(0, Pause())
from moonrt.cli import main
sys.exit(main(sys.argv[1:]))
"""

_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                  "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID")


@pytest.mark.slow
@pytest.mark.parametrize(("sig", "flags"), [(signal.SIGUSR1, ("--signal", "USR1")), (signal.SIGTERM, ())])
def test_stop_signal_while_torch_is_imported_stops_at_step_0(tmp_path: Path, sig: signal.Signals,
                                                             flags: tuple[str, ...]) -> None:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS and not k.startswith("SLURM_")}
    proc = subprocess.Popen([sys.executable, "-c", _PAUSE_AT_TORCH, *_train(tmp_path, "run", "--steps", "3",
                                                                          "--no-progress", *flags)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, cwd=tmp_path)
    try:
        assert proc.stdout.readline() == "importing torch\n"
        proc.send_signal(sig)
        out, _ = proc.communicate("\n", timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == PREEMPTED_EXIT, out
    assert f"stopped by {sig.name} after step 0 of 3" in out, out
    assert has_checkpoint(tmp_path / "run")
    assert store.read_state(tmp_path / "run", BUILDER)["step"] == 0
    assert main(_train(tmp_path, "run", "--steps", "3", "--until", "1", "--resume", "--no-progress")) == 0


def test_the_stop_signal_is_found_before_torch_is_imported(tmp_path: Path) -> None:
    """What ``moonrt train`` arms before its imports: ``--signal`` (either form, the last wins), else the
    ``stop_signal`` of ``--config``; nothing for a missing or broken config (the real parse reports those)."""
    from moonrt.cli import _stop_signal_arg

    cfg = tmp_path / "job.yaml"
    cfg.write_text("stop_signal: USR2\n")
    assert _stop_signal_arg(["--steps", "3"]) is None
    assert _stop_signal_arg(["--signal", "USR1"]) == "USR1"
    assert _stop_signal_arg(["--signal=HUP", "--signal", "USR1"]) == "USR1"
    assert _stop_signal_arg(["--config", str(cfg)]) == "USR2"
    assert _stop_signal_arg([f"--config={cfg}", "--signal", "QUIT"]) == "QUIT"
    cfg.write_text("stop_signal: [\n")
    assert _stop_signal_arg(["--config", str(cfg)]) is None
    assert _stop_signal_arg(["--config", str(tmp_path / "missing.yaml")]) is None
