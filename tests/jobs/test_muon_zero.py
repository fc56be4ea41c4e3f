"""ZeRO-1 for Per-Head Muon (``moonrt.comm.zero.muon``) and its planner (``moonrt.scheduler.muon_plan``).

- the planner puts every unit on exactly one rank, balanced by FLOPs, the same plan on every call;
- 2 gloo ranks, each holding half of every gradient, take the same two steps as one process's
  :class:`moonrt.ops.muon.Muon` on the summed gradients (every parameter and every state tensor of the
  single-process checkpoint layout), including a matrix that a flat ZeRO-1 partition cuts in two;
- ``moonrt train --zero 1 --optimizer muon`` on dp 2, resumed from a single-process checkpoint, takes the
  single process's step, and its sharded DCP checkpoint (every multi-rank layout below writes one: ranks write the
  blocks they own, nothing is gathered) read back with ``to_single_file`` holds it
  (loss, grad norm, every parameter and optimizer tensor within 1e-5 relative: the
  dp 2 gradient is a sum of two half-batch backwards and the clip norm is fp64, ~1e-7 off; Newton-Schulz of
  one block vs the batched blocks differs by fp32 rounding, well inside the bound);
- in the same run (one base checkpoint, all layouts at once), the same with expert parallelism
  (``--ep 2 --zero 1``, dp 2 x ep 2: experts owned within their ``dp_cp``
  group, dense units within ``dp_ep_cp``) and pipeline parallelism (``--pp 2 --zero 1``, pp 2 x dp 2: each stage's
  units over that stage's dp group) on 4 ranks: the single process's step, every unit's state held by exactly one
  rank of its group (ep: the ranks' state bytes add up to the single process's exactly, each ~1/4 of it; pp:
  each stage's two dp ranks hold about half of that stage's state each).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from dist import dist_run
from jobs.helpers import EVAL_SMALL, FLAGS, _assert_same_step, _ckpt, _close, _here, _metrics, _ranks, _run

from moonrt.comm.state.describe import gather_full_state
from moonrt.jobs.checkpoint.sharded import read_marker, resolve
from moonrt.scheduler.muon_plan import Unit, plan_units


def _tiny_job():
    from moonrt.jobs.train.config import JobConfig, OptimConfig

    return JobConfig(model="k3_tiny", optim=OptimConfig(optimizer="muon"))


def _flat_straddlers(model: torch.nn.Module, names: set[str], ranks: int) -> list[str]:
    """Muon parameters that a flat ZeRO-1 partition (``moonrt.comm.zero.adamw``: all trainable parameters
    concatenated, ``ceil(L / ranks)`` elements per rank) cuts between two ranks."""
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    total = sum(p.numel() for _, p in params)
    shard = -(-total // ranks)
    out, off = [], 0
    for n, p in params:
        if n in names and off // shard != (off + p.numel() - 1) // shard:
            out.append(n)
        off += p.numel()
    return out


def test_plan_is_balanced_and_deterministic() -> None:
    units = [Unit(48, 128)] * 36 + [Unit(56, 64)] * 384 + [Unit(608, 128)] * 3 + [Unit(32768, 1, muon=False)] * 2
    for ranks in (1, 2, 3, 8):
        plan = plan_units(units, ranks)
        assert plan == plan_units(units, ranks)
        assert sorted(u for r in plan.units for u in r) == list(range(len(units)))
        assert all(plan.owner[u] == r for r in range(ranks) for u in plan.units[r])
        largest = max(u.flops() for u in units)
        assert max(plan.load) - min(plan.load) <= largest  # LPT: within one unit of each other
        assert sum(plan.sizes) == sum(u.numel for u in units)
    assert plan_units(units, 2).imbalance < 1.01
    with pytest.raises(ValueError, match="ranks = 0"):
        plan_units(units, 0)


def _zero_vs_single(rank: int, world: int, steps: int) -> dict[str, object]:
    from moonrt.comm.zero.muon import ZeroMuon
    from moonrt.jobs.train.assemble import build_model
    from moonrt.jobs.train.optimizers import build_optimizer, muon_blocks

    job = _tiny_job()
    model = build_model(job)
    opt = build_optimizer(model, job.optim)
    part = ZeroMuon(None, assign=lambda m: muon_blocks(m, job.optim))
    gen = torch.Generator().manual_seed(7)
    for step in range(steps):
        for p in model.parameters():
            g = torch.randn(p.shape, generator=gen) * 1e-2
            p.grad = g / world + (rank - (world - 1) / 2) * 1e-3  # the ranks' pieces sum to g
        part.sync_grads(model)
        part.clip_grad_norm(list(model.parameters()), 1.0)
        for g in opt.param_groups:
            g["lr"] = 1e-2 * (step + 1)
        part.step(opt)
    state = gather_full_state(part.state_description(model, opt))
    return {"state": state, "bytes": part.state_bytes(), "units": len(part.mine)}


def _single(steps: int) -> dict[str, object]:
    from moonrt.jobs.train.assemble import build_model
    from moonrt.jobs.train.optimizers import build_optimizer

    job = _tiny_job()
    model = build_model(job)
    opt = build_optimizer(model, job.optim)
    gen = torch.Generator().manual_seed(7)
    for step in range(steps):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen) * 1e-2
        torch.nn.utils.clip_grad_norm_(list(model.parameters()), 1.0)
        for g in opt.param_groups:
            g["lr"] = 1e-2 * (step + 1)
        opt.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "_model": model}


@pytest.mark.timeout(900)
@pytest.mark.slow  # two-rank and one-process muon training runs: CI runs it, the fast lane need not
def test_two_ranks_equal_one_process_incl_matrices_a_flat_partition_splits() -> None:
    from moonrt.jobs.train.optimizers import muon_blocks

    ref = _single(2)
    names = set(muon_blocks(ref.pop("_model"), _tiny_job().optim))
    from moonrt.jobs.train.assemble import build_model

    straddlers = _flat_straddlers(build_model(_tiny_job()), names, 2)
    assert straddlers, "k3_tiny's flat 2-way partition cuts no Muon matrix: build one"
    out = dist_run(_zero_vs_single, 2, 2, timeout=600)
    for r in out:
        _close(r["state"]["model"], ref["model"], "model")
        _close(r["state"]["optimizer"], ref["optimizer"], "optimizer")
    full = _zero_vs_single(0, 1, 0)["bytes"]  # one rank owns every unit: no sharding
    assert out[0]["units"] + out[1]["units"] > 0 and max(r["bytes"] for r in out) < 0.6 * full, \
        ([r["bytes"] for r in out], full)


def _state_bytes(optimizer: dict[str, Any]) -> tuple[int, int]:
    """``(bytes of every momentum / moment tensor, number of parameters)`` of a single-process optimizer state."""
    full = sum(t.nbytes for st in optimizer["state"].values() for k, t in st.items() if k != "step")
    return full, sum(len(g["params"]) for g in optimizer["param_groups"])


@pytest.mark.slow
@pytest.mark.timeout(3000)
def test_train_zero1_muon_resumes_a_single_process_checkpoint_and_matches_it(tmp_path: Path) -> None:
    flags = [*FLAGS, *EVAL_SMALL, "--optimizer", "muon"]
    _run(tmp_path, {"base": _here("train", *flags, "--until", "1", "--out", "base")})
    common = ("train", *flags, "--resume", "--until", "2")
    layouts = {"zero_dp2": (2, ["--zero", "1"]),
               # without ZeRO, Muon runs replicated under the other parts: experts per expert on their EP rank
               "ep2": (2, ["--ep", "2"]), "pp2": (2, ["--pp", "2", "--microbatches", "2"]),
               "zero_ep2": (4, ["--zero", "1", "--ep", "2"]),  # dp 2 x ep 2
               "zero_pp2": (4, ["--zero", "1", "--pp", "2", "--microbatches", "2"])}  # pp 2 x dp 2
    runs = {"single": _here(*common, "--out", "single", "--metrics", "single.jsonl")}
    for name, (n, extra) in layouts.items():
        runs[name] = _ranks(n, *common, "--out", name, "--metrics", f"{name}.jsonl", *extra)
    for name in runs:
        shutil.copytree(tmp_path / "base", tmp_path / name)
    _run(tmp_path, runs, timeout=2800)
    ref, ref_ckpt = _metrics(tmp_path / "single.jsonl")[2], _ckpt(tmp_path / "single")
    for name in layouts:  # each wrote a sharded checkpoint (no gather), read back through to_single_file
        assert read_marker(resolve(tmp_path / name / "checkpoint"))["step"] == 2, name
        _assert_same_step(tmp_path, name, ref, ref_ckpt)
    got = _metrics(tmp_path / "zero_dp2.jsonl")[2]
    assert len(got["optimizer_state_bytes"]) == 2 and got["optimizer_comm_bytes"] > 0
    full, params = _state_bytes(ref_ckpt["optimizer"])
    # ep: every dense unit on one of the 4 ranks, every expert on one rank of its dp_cp pair: the state once,
    # plus each rank's [P] fp64 step counts (every rank holds all P parameter tensors, its experts sliced);
    # ideal 1/4 each, FLOP-balanced ownership keeps bytes within a few units (the largest: ~2% of the state)
    ep = _metrics(tmp_path / "zero_ep2.jsonl")[2]["optimizer_state_bytes"]
    assert len(ep) == 4 and sum(ep) == full + 4 * 8 * params and max(ep) < 0.3 * full, (ep, full, params)
    # pp: ranks 0, 1 hold stage 0 (pp is the outermost mesh dim), 2, 3 stage 1; the stages' shares differ (the
    # layer cut), each stage's two dp ranks halve it; every unit once but the pseudo-queries (on both stages)
    pp = _metrics(tmp_path / "zero_pp2.jsonl")[2]["optimizer_state_bytes"]
    assert len(pp) == 4 and sum(pp) < 1.02 * full, (pp, full)
    assert all(max(pair) < 0.55 * sum(pair) for pair in (pp[:2], pp[2:])), pp
