"""Layout-independent checkpoints of ``moonrt train --ep N`` (K3_SYSTEMS §6).

A checkpoint holds the single-process state: every ``[E, ...]`` expert tensor whole (each EP rank writes its
home experts' rows of it to the sharded ``OUT/checkpoint/``) and the AdamW moments of the experts in the same
layout; loading slices it back to each rank's home experts. So an ``--ep 2`` run resumes bit-identically in
``--ep 2``, and continues in a single process or ``--ep 4`` within 1e-4 relative of the straight
single-process run (the layouts differ only in fp32 summation order; a short run, flags as in
tests/jobs/test_ep_train.py). ``gather_full_state(ep.state_description(...))`` gathers the same state in memory.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from dist import dist_run
from jobs.helpers import _here, _ranks, _run

from moonrt.comm.state.describe import gather_full_state, scatter_full_state
from moonrt.models.k3.model.config import k3_tiny

STEPS, SPLIT = 4, 2
FLAGS = ["--steps", str(STEPS), "--seed", "0", "--batch-size", "4", "--seq-len", "32", "--eval-every", "100",
         "--threads", "1", "--no-progress", "--lr", "1e-3"]
EXPERT_KEYS = ("experts.w_gate", "experts.w_up", "experts.w_down")


def _train(out: str, metrics: str, ep: int, *extra: str) -> list[str]:
    cmd = [sys.executable, "-m", "moonrt.cli", "train", *FLAGS, "--out", out, "--metrics", metrics, *extra]
    if ep == 1:
        return cmd
    return _ranks(ep, *cmd[3:4], "--ep", str(ep), *cmd[4:])


def _run_all(cwd: Path, cmds: list[list[str] | tuple[str, ...]]) -> None:
    """Every run at once (:func:`test_pp_train._run`: tuples are ``moonrt`` runs in this process)."""
    _run(cwd, {" ".join(c): c for c in cmds}, timeout=400)


def _losses(path: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, path.read_text().splitlines())}


def _ckpt(path: Path) -> dict[str, Any]:
    """The run's newest checkpoint (multi-rank jobs write the sharded OUT/checkpoint/, one process checkpoint.pt)
    in the single-process ``checkpoint.pt`` format."""
    from moonrt.jobs.checkpoint.store import read_state
    from moonrt.jobs.train.resume import BUILDER

    return read_state(path, BUILDER)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ep_checkpoint_resumes_in_ep_and_in_a_single_process(tmp_path: Path) -> None:
    # one process runs in this one (test_pp_train._here: no new interpreter)
    _run_all(tmp_path, [_train("straight", "straight.jsonl", 2),
                        _train("split", "split.jsonl", 2, "--until", str(SPLIT)),
                        _here(*_train("single", "single.jsonl", 1)[3:])])
    for copy in ("to1", "to4"):
        shutil.copytree(tmp_path / "split", tmp_path / copy)
        shutil.copy(tmp_path / "split.jsonl", tmp_path / f"{copy}.jsonl")
    mid = _ckpt(tmp_path / "split")
    assert mid["step"] == SPLIT
    cfg = k3_tiny()
    moe_layers = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
    for i in moe_layers:  # the full [E, ...] expert tensors, not rank 0's home slice
        for key in EXPERT_KEYS:
            assert mid["model"][f"layers.{i}.moe.{key}"].shape[0] == cfg.num_experts, key
    _run_all(tmp_path, [_train("split", "split.jsonl", 2, "--resume"),
                        _here(*_train("to1", "to1.jsonl", 1, "--resume")[3:]),
                        _train("to4", "to4.jsonl", 4, "--resume")])

    straight, split = _losses(tmp_path / "straight.jsonl"), _losses(tmp_path / "split.jsonl")
    assert sorted(split) == list(range(1, STEPS + 1))
    assert split == straight  # --ep 2 -> --ep 2 resume: bit-identical losses
    a, b = _ckpt(tmp_path / "straight"), _ckpt(tmp_path / "split")
    assert a["step"] == b["step"] == STEPS and a["model"].keys() == b["model"].keys()
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
    assert sa.keys() == sb.keys()
    for i in sa:
        for k in sa[i]:
            assert torch.equal(sa[i][k], sb[i][k]), (i, k)

    single = _losses(tmp_path / "single.jsonl")
    for name in ("to1", "to4"):  # steps 1-2 ran under --ep 2, 3-4 in one process / --ep 4 from its checkpoint
        got = _losses(tmp_path / f"{name}.jsonl")
        assert sorted(got) == list(range(1, STEPS + 1))
        for s in range(1, STEPS + 1):
            assert abs(got[s] - single[s]) <= 1e-4 * abs(single[s]), (name, s, got[s], single[s])
    end = _ckpt(tmp_path / "to1")
    assert end["model"].keys() == _ckpt(tmp_path / "single")["model"].keys()


def _gather_and_reload(rank: int, world_size: int) -> dict[str, Any]:
    from moonrt.comm.ep.parallel import ExpertParallel
    from moonrt.config import ParallelConfig
    from moonrt.jobs.train.assemble import build_model
    from moonrt.jobs.train.config import JobConfig, OptimConfig
    from moonrt.jobs.train.optimizers import build_optimizer

    job = JobConfig(model="k3_tiny")
    reference = {k: v.clone() for k, v in build_model(job).state_dict().items()}  # unsharded, same seed

    def sharded() -> tuple[ExpertParallel, torch.nn.Module, torch.optim.Optimizer]:
        ep = ExpertParallel(ParallelConfig(ep=world_size), capacity=64)
        model = ep.parallelize(build_model(job))
        return ep, model, build_optimizer(model, OptimConfig())

    ep, model, opt = sharded()
    fresh = gather_full_state(ep.state_description(model, opt))  # before any step: exactly the unsharded init
    assert fresh["model"].keys() == reference.keys()
    for k, v in reference.items():
        assert torch.equal(fresh["model"][k], v), k
    torch.manual_seed(100 + rank)  # rank-distinct expert updates and moments
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    full = gather_full_state(ep.state_description(model, opt))
    names = [n for n in full["model"] if n.endswith(EXPERT_KEYS)]
    name_of = {id(p): n for n, p in model.named_parameters()}  # state_dict numbers params in param-group order
    index = {name_of[id(p)]: i for i, p in enumerate(p for g in opt.param_groups for p in g["params"])}
    local = {n: p.detach().clone() for n, p in model.named_parameters() if n in names}
    moments = {n: {k: v.clone() for k, v in opt.state[p].items()} for n, p in model.named_parameters() if n in names}

    ep2, model2, opt2 = sharded()
    bad = {"model": {**full["model"], names[0]: local[names[0]]}, "optimizer": full["optimizer"]}
    with pytest.raises(ValueError, match=f"checkpoint {names[0]}: shape"):
        scatter_full_state(ep2.state_description(model2, opt2), bad)
    assert not opt2.state, "a refused checkpoint loads nothing"
    scatter_full_state(ep2.state_description(model2, opt2), full)
    for (n, p), (_, q) in zip(model.named_parameters(), model2.named_parameters()):
        assert torch.equal(p, q), n
        for k, v in opt.state[p].items():
            assert torch.equal(v, opt2.state[q][k]), (n, k)
    return {"full": full if rank == 0 else None, "local": local, "moments": moments, "index": index}


@pytest.mark.timeout(300)
@pytest.mark.slow  # a two-rank --ep 2 training run: CI runs it, the fast lane need not
def test_full_state_dict_is_the_concatenation_of_the_shards() -> None:
    got = dist_run(_gather_and_reload, 2, timeout=240)
    full, E = got[0]["full"], k3_tiny().num_experts
    names = list(got[0]["local"])
    assert names and all(n.endswith(EXPERT_KEYS) for n in names)
    for n in names:
        whole = full["model"][n]
        assert whole.shape[0] == E
        assert torch.equal(whole, torch.cat([g["local"][n] for g in got])), n
        st = full["optimizer"]["state"][got[0]["index"][n]]
        for k in ("exp_avg", "exp_avg_sq"):
            assert st[k].shape == whole.shape
            assert torch.equal(st[k], torch.cat([g["moments"][n][k] for g in got])), (n, k)
        assert float(st["step"]) == 1.0
