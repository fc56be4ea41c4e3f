"""What a new user meets on day one (issue 36): the written-out default config, the README's "Other runs" lines
after the quick start, honest summaries of stopped and resumed runs, and a stop signal that arrives while
``moonrt train`` is still importing torch."""

from __future__ import annotations

import math
import stat
from pathlib import Path

from test_train_hardening import _corpus, _records

from moonrt.cli import main
from moonrt.config import load_yaml, read_yaml, to_dict
from moonrt.job import JobConfig
from moonrt.outputs import CHECKPOINT

ROOT = Path(__file__).resolve().parents[2]


def test_k3_tiny_yaml_is_the_embedded_default() -> None:
    path = ROOT / "configs" / "k3_tiny.yaml"
    assert to_dict(load_yaml(JobConfig, path)) == to_dict(JobConfig())
    assert read_yaml(path) == to_dict(JobConfig()), "configs/k3_tiny.yaml must write out every key of JobConfig()"


def _train(tmp_path: Path, out: str, *extra: str) -> list[str]:
    """A tiny ``moonrt train`` command line with the progress bar and summary on (test_train_hardening's sizes)."""
    return ["train", "--corpus", str(_corpus(tmp_path)), "--batch-size", "2", "--seq-len", "16",
            "--out", str(tmp_path / out), *extra]


def _summary(out: str) -> str:
    lines = [line for line in out.splitlines() if line.startswith("summary: ")]
    assert len(lines) == 1, out
    return lines[0]


def test_until_before_the_first_eval_evaluates_at_the_stop_step(tmp_path: Path, capsys) -> None:
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
