"""``moonrt train``: job config, schedule, metrics, atomic checkpoints and bit-identical resume."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from moonrt.cli import main
from moonrt.config import ConfigError, from_dict, load_yaml
from moonrt.jobs.train.config import JobConfig, OptimConfig, lr_at
from moonrt.jobs.train.loop import CHECKPOINT, train

ROOT = Path(__file__).resolve().parents[2]


def _job(tmp_path: Path, out: str, memory_policy: str | None = None, **optim) -> JobConfig:
    corpus = tmp_path / "corpus.txt"
    if not corpus.exists():
        corpus.write_text("".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(400)))
    opt = {"steps": 6, "batch_size": 2, "seq_len": 16, "warmup_steps": 2, "eval_every": 3, "eval_windows": 2,
           "checkpoint_every": 100, **optim}
    return from_dict(JobConfig, {"data": {"corpus": str(corpus)}, "optim": opt, "out_dir": str(tmp_path / out),
                                 "memory_policy": memory_policy})


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_resume_is_bit_identical(tmp_path: Path) -> None:
    straight = _job(tmp_path, "a")
    train(straight, metrics_path=str(tmp_path / "a.jsonl"), progress=False)
    split = _job(tmp_path, "b")
    train(split, metrics_path=str(tmp_path / "b.jsonl"), until=3, progress=False)
    assert torch.load(tmp_path / "b" / CHECKPOINT, weights_only=True)["step"] == 3
    train(split, metrics_path=str(tmp_path / "b.jsonl"), resume=True, progress=False)
    a, b = _records(tmp_path / "a.jsonl"), _records(tmp_path / "b.jsonl")
    assert [r["step"] for r in b] == list(range(1, 7))
    key = lambda r: (r["loss"], r["lr"], r["grad_norm"], r.get("eval_loss"))
    assert [key(r) for r in a] == [key(r) for r in b]
    sa = torch.load(tmp_path / "a" / CHECKPOINT, weights_only=True)
    sb = torch.load(tmp_path / "b" / CHECKPOINT, weights_only=True)
    assert sa["model"].keys() == sb["model"].keys()
    for k in sa["model"]:
        assert torch.equal(sa["model"][k], sb["model"][k]), k
    assert not list((tmp_path / "b").glob("*.tmp*"))  # atomic write left no temp file


def test_metrics_lines_and_loss_falls(tmp_path: Path) -> None:
    summary = train(_job(tmp_path, "c", steps=12, lr=3e-3), metrics_path=str(tmp_path / "m.jsonl"), progress=False)
    recs = _records(tmp_path / "m.jsonl")
    assert [r["step"] for r in recs] == list(range(1, 13))
    assert {"step", "loss", "lr", "tokens_per_s", "grad_norm"} <= set(recs[0])
    assert all(math.isfinite(r["loss"]) for r in recs)
    assert sum(r["loss"] for r in recs[-3:]) < sum(r["loss"] for r in recs[:3])
    assert summary["final_eval_loss"] == recs[-1]["eval_loss"]
    assert (tmp_path / "c" / "config.yaml").is_file()


def test_lr_schedule() -> None:
    cfg = OptimConfig(steps=100, lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_at(0, cfg) == pytest.approx(0.1) and lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(99, cfg) == pytest.approx(0.1)
    lrs = [lr_at(s, cfg) for s in range(10, 100)]
    assert all(x >= y for x, y in zip(lrs, lrs[1:]))


def test_example_configs_load() -> None:
    files = sorted((ROOT / "configs").glob("*.yaml"))
    assert files
    for f in files:
        job = load_yaml(JobConfig, f)
        assert job.model_cfg().vocab_size >= 256


def test_bad_config_and_flags(tmp_path: Path, capsys) -> None:
    with pytest.raises(ConfigError, match="optim.lr = -1.0"):
        from_dict(JobConfig, {"optim": {"lr": -1.0}})
    with pytest.raises(ConfigError, match="model = 'k4'"):
        from_dict(JobConfig, {"model": "k4"})
    with pytest.raises(ConfigError, match="moe.qb_bins = 0"):
        from_dict(JobConfig, {"moe": {"qb_bins": 0}})
    bad = tmp_path / "bad.yaml"
    bad.write_text("optim:\n  stepz: 3\n")
    assert main(["train", "--config", str(bad)]) == 2
    assert "stepz: unknown key" in capsys.readouterr().err
    assert main(["train", "--corpus", str(tmp_path / "missing.txt"), "--out", str(tmp_path / "o")]) == 2
    assert "expected an existing file" in capsys.readouterr().err
    assert main(["train", "--model", "k3", "--out", str(tmp_path / "k3")]) == 2  # never instantiated
    assert "2,779,483,053,152 parameters" in capsys.readouterr().err
    job = _job(tmp_path, "d")
    with pytest.raises(ValueError, match="no checkpoint"):
        train(job, resume=True, progress=False)


def test_cli_runs_a_short_job(tmp_path: Path, capsys) -> None:
    corpus = tmp_path / "c.txt"
    corpus.write_text("abcdefgh" * 500)
    rc = main(["train", "--steps", "2", "--batch-size", "2", "--seq-len", "16", "--corpus", str(corpus),
               "--out", str(tmp_path / "o"), "--metrics", str(tmp_path / "m.jsonl")])
    assert rc == 0
    out = capsys.readouterr().out
    assert "summary:" in out and "unigram entropy" in out
    assert len(_records(tmp_path / "m.jsonl")) == 2


def test_memory_policy_is_applied(tmp_path: Path, capsys) -> None:
    keep = tmp_path / "keep.yaml"
    keep.write_text("default: keep\n")
    recompute = tmp_path / "recompute.yaml"
    recompute.write_text("default: keep\nrules:\n  - {match: 'layers.*.moe', policy: recompute}\n")
    ref = train(_job(tmp_path, "p0", steps=2), metrics_path=str(tmp_path / "p0.jsonl"), progress=False)
    for name, policy in (("p1", keep), ("p2", recompute)):
        job = _job(tmp_path, name, memory_policy=str(policy), steps=2)
        out = train(job, metrics_path=str(tmp_path / f"{name}.jsonl"), progress=True)
        # keep and recompute store or rebuild exactly the same tensors: identical training
        assert [r["loss"] for r in _records(tmp_path / f"{name}.jsonl")] == \
            [r["loss"] for r in _records(tmp_path / "p0.jsonl")]
        assert out["final_eval_loss"] == ref["final_eval_loss"]
    assert "layers.1.moe" in capsys.readouterr().out  # the accounting table names the recomputed region
