"""``moonrt train --optimizer muon``: parameter groups from the model's block declarations, bit-identical resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moonrt.config import from_dict
from moonrt.jobs.train.assemble import build_model
from moonrt.jobs.train.config import JobConfig
from moonrt.jobs.train.loop import CHECKPOINT, train
from moonrt.jobs.train.optimizers import build_optimizer
from moonrt.ops.muon import Muon
from moonrt.parallel.blocks import MatrixBlocks


def _job(tmp_path: Path, out: str, **optim) -> JobConfig:
    corpus = tmp_path / "corpus.txt"
    if not corpus.exists():
        corpus.write_text("".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(400)))
    opt = {"steps": 6, "batch_size": 2, "seq_len": 16, "warmup_steps": 2, "eval_every": 3, "eval_windows": 2,
           "checkpoint_every": 100, "optimizer": "muon", **optim}
    return from_dict(JobConfig, {"data": {"corpus": str(corpus)}, "optim": opt, "out_dir": str(tmp_path / out)})


def test_groups_follow_the_model_declarations(tmp_path: Path) -> None:
    job = _job(tmp_path, "g")
    model = build_model(job)
    opt = build_optimizer(model, job.optim)
    assert isinstance(opt, Muon)
    names = {id(p): n for n, p in model.named_parameters()}
    muon = {names[id(p)] for g in opt.param_groups if g["use_muon"] for p in g["params"]}
    adamw = {names[id(p)] for g in opt.param_groups if not g["use_muon"] for p in g["params"]}
    assert muon | adamw == set(names.values()) and not muon & adamw
    assert {"embed.weight", "lm_head.weight", "layers.0.attn.conv_weight", "layers.1.moe.router.weight",
            "layers.0.attn.A_log", "attn_res.queries"} <= adamw
    p = dict(model.named_parameters())
    cfg = job.model_cfg()
    assert opt.blocking(p["layers.0.attn.qkv_proj.weight"]) == MatrixBlocks(head_dim=cfg.linear_attn_config.head_dim)
    mla = next(i for i, c in enumerate(cfg.pattern) if c == "M")
    assert opt.blocking(p[f"layers.{mla}.attn.q_b_proj.weight"]).head_dim == cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    assert opt.blocking(p["layers.1.moe.experts.w_gate"]) == MatrixBlocks(stack_dims=1)
    assert opt.blocking(p["layers.0.attn.o_proj.weight"]) == MatrixBlocks()
    whole = build_optimizer(model, _job(tmp_path, "w", muon_per_head=False).optim)
    assert whole.blocking(p["layers.0.attn.qkv_proj.weight"]) == MatrixBlocks()


@pytest.mark.slow  # muon training runs with a save and a resume: CI runs it, the fast lane need not
def test_muon_resume_is_bit_identical(tmp_path: Path) -> None:
    straight = _job(tmp_path, "a")
    train(straight, metrics_path=str(tmp_path / "a.jsonl"), progress=False)
    split = _job(tmp_path, "b")
    train(split, metrics_path=str(tmp_path / "b.jsonl"), until=3, progress=False)
    state = torch.load(tmp_path / "b" / CHECKPOINT, weights_only=True)
    assert any("momentum_buffer" in s for s in state["optimizer"]["state"].values())
    train(split, metrics_path=str(tmp_path / "b.jsonl"), resume=True, progress=False)
    rec = [[json.loads(line) for line in (tmp_path / f).read_text().splitlines()] for f in ("a.jsonl", "b.jsonl")]
    key = lambda r: (r["loss"], r["lr"], r["grad_norm"], r.get("eval_loss"))  # noqa: E731
    assert [key(r) for r in rec[0]] == [key(r) for r in rec[1]]
    sa = torch.load(tmp_path / "a" / CHECKPOINT, weights_only=True)
    sb = torch.load(tmp_path / "b" / CHECKPOINT, weights_only=True)
    for k in sa["model"]:
        assert torch.equal(sa["model"][k], sb["model"][k]), k
    assert rec[0][-1]["loss"] < rec[0][0]["loss"]


def test_cli_optimizer_flag(tmp_path: Path) -> None:
    import argparse

    from moonrt.jobs.train.cli import add_arguments, job_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert job_from_args(parser.parse_args(["--optimizer", "muon"])).optim.optimizer == "muon"
    assert job_from_args(parser.parse_args([])).optim.optimizer == "adamw"
