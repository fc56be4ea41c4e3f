"""Sharded DCP checkpoints of Muon jobs (``moonrt.jobs.checkpoint.sharded`` with ``--optimizer muon``): each rank
writes what it
owns, ``to_single_file`` gives the gathered ``optimizer.state_dict()``, and a checkpoint resumes in another layout.

- one process: k3_tiny and its Muon after one step (one Muon parameter without a gradient, so without state)
  round-trip bit for bit through ``save_sharded`` / ``load_sharded`` (model, momenta, AdamW moments and steps, the
  group hyperparameters restored from the marker), ``to_single_file`` and ``moonrt checkpoint convert`` both ways;
- 2 gloo ranks (``tests/dist.py``; gradients handed in, teacher-forced: each step's gradient a seeded function of the
  step, split between the ranks as in ``tests/jobs/test_muon_zero.py``), with one parameter cut into column blocks
  (so that a rank owns several column boxes of one tensor): ``--zero 1`` (ZeroMuon over dp 2) saves sharded at step
  2 and ``to_single_file`` equals its gathered ``full_state_dict`` bit for bit; one process resumes that checkpoint
  and its step 3 equals the single process's (1e-5 relative); ``--ep 2 --zero 1`` (experts as rows of ``[E, ...]``,
  momenta as boxes) resumes the single process's sharded step-2 checkpoint, its step 3 equals the single process's,
  and its own sharded step-3 checkpoint converts to its gathered state bit for bit.

The whole ``moonrt train`` path (``use_sharded`` for Muon, EP/PP/ZeRO-Muon compositions writing sharded checkpoints
read back through ``to_single_file``) is checked by ``tests/jobs/test_muon_zero.py``'s train test, whose layouts now
write sharded checkpoints.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from dist import dist_run
from jobs.helpers import _close, _equal

from moonrt.cli import main as cli
from moonrt.jobs.checkpoint import sharded as checkpoint_dcp
from moonrt.jobs.train.resume import BUILDER
from moonrt.parallel.blocks import MatrixBlocks

COLUMNS = "layers.0.attn.o_proj.weight"
"""A whole-matrix Muon parameter re-cut into 4 column blocks (``MatrixBlocks(axis=1)``) in the multi-rank tests."""


def _job() -> Any:
    from moonrt.jobs.train.config import JobConfig, OptimConfig

    return JobConfig(model="k3_tiny", optim=OptimConfig(optimizer="muon"))


def _model_opt(job: Any, columns: bool = True, rt: Any = None) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """k3_tiny (parallelized by ``rt``) and its Muon; ``columns``: :data:`COLUMNS` in column blocks."""
    from moonrt.jobs.train.assemble import build_model
    from moonrt.jobs.train.optimizers import build_optimizer

    model = build_model(job)
    if rt is not None:
        model = rt.parallelize(model)
    opt = build_optimizer(model, job.optim)
    if columns:
        p = dict(model.named_parameters())[COLUMNS]
        opt.blocks[id(p)] = MatrixBlocks(head_dim=p.shape[1] // 4, axis=1)
    return model, opt


def _blocks(job: Any) -> Any:
    from moonrt.jobs.train.optimizers import muon_blocks

    def assign(model: torch.nn.Module) -> dict[str, Any]:
        blocks = muon_blocks(model, job.optim)
        p = dict(model.named_parameters())[COLUMNS]
        return {**blocks, COLUMNS: MatrixBlocks(head_dim=p.shape[1] // 4, axis=1)}
    return assign


# ---- one process ----------------------------------------------------------------------------------------------


@pytest.fixture
def one_thread() -> Any:
    """Torch at one thread for the test, as the ranks run (on the shared 2-core machine two threads competing with
    other jobs are slow: 6 s at load ~2, 30 s at load ~8 were measured with two)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow  # muon training runs with a save and a resume: CI runs it, the fast lane need not
def test_one_process_muon_round_trips_bit_for_bit(tmp_path: Path, one_thread: Any) -> None:
    from moonrt.jobs.checkpoint.single import load

    job = _job()
    model, opt = _model_opt(job, columns=False)
    x = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    model.loss_sum(x[:, :-1], x[:, 1:]).backward()
    skipped = dict(model.named_parameters())["layers.0.attn.qkv_proj.weight"]
    skipped.grad = None  # a Muon parameter without state after the step
    opt.step()
    ref = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    kinds = {tuple(sorted(st)) for st in ref["optimizer"]["state"].values()}
    assert kinds == {("momentum_buffer",), ("exp_avg", "exp_avg_sq", "step")}, kinds
    assert len(ref["optimizer"]["state"]) == sum(len(g["params"]) for g in opt.param_groups) - 1

    root = tmp_path / "checkpoint"
    checkpoint_dcp.save_sharded(root, model, opt, 1, job)
    flat, marker = checkpoint_dcp.read_full(root)
    name = "layers.0.attn.qkv_proj.weight"
    assert flat[f"optimizer.{name}.momentum_buffer"].shape == skipped.shape  # the parameter's shape, zeros
    assert not flat[f"optimizer.{name}.momentum_buffer"].any() and float(flat[f"optimizer.{name}.step"]) == 0
    assert marker["param_groups"][0]["ns_coefficients"] == list(opt.param_groups[0]["ns_coefficients"])

    fresh, fresh_opt = _model_opt(job, columns=False)
    with torch.no_grad():
        for p in fresh.parameters():
            p.add_(1.0)
    for g in fresh_opt.param_groups:  # restored from the marker, as optim.load_state_dict does
        g.update(lr=0.5, momentum=0.5, betas=(0.5, 0.5), ns_steps=3)
    assert checkpoint_dcp.load_sharded(root, fresh, fresh_opt, builder=BUILDER) == 1
    _equal({"model": fresh.state_dict(), "optimizer": fresh_opt.state_dict()}, ref, "loaded")
    _equal({k: v for k, v in checkpoint_dcp.to_single_file(root, BUILDER).items() if k in ref}, ref, "to_single_file")

    assert cli(["checkpoint", "convert", str(root), str(tmp_path / "checkpoint.pt")]) == 0
    _equal({k: v for k, v in load(tmp_path / "checkpoint.pt").items() if k in ref}, ref, "to .pt")
    assert cli(["checkpoint", "convert", str(tmp_path / "checkpoint.pt"), str(tmp_path / "back")]) == 0
    back = checkpoint_dcp.to_single_file(tmp_path / "back", BUILDER)
    _equal({k: v for k, v in back.items() if k in ref}, ref, "back")


# ---- 2 ranks, teacher-forced gradients ------------------------------------------------------------------------


def _grads(model: torch.nn.Module, step: int, rank: int, world: int, shards: dict[int, Any], replicas: int) -> None:
    """Step ``step``'s gradient (seeded by step and parameter name, single-process shapes) as this rank's piece:
    dense parameters split over ``replicas`` ranks (pieces sum to it), EP experts their home rows whole."""
    for name, p in model.named_parameters():
        shape, first = shards.get(id(p), (tuple(p.shape), 0))
        gen = torch.Generator().manual_seed(1000 * step + sum(map(ord, name)))
        g = torch.randn(shape, generator=gen) * 1e-2
        if id(p) in shards:
            p.grad = g[first:first + p.shape[0]].clone()
        else:
            p.grad = g / replicas + (rank - (replicas - 1) / 2) * 1e-3 if replicas > 1 else g


def _step(rt: Any, model: torch.nn.Module, opt: torch.optim.Optimizer, step: int, rank: int, world: int,
          shards: dict[int, Any], replicas: int) -> None:
    _grads(model, step, rank, world, shards, replicas)
    for g in opt.param_groups:
        g["lr"] = 1e-2 * (step + 1)
    rt.sync_grads(model)
    rt.clip_grad_norm(model.parameters(), 1.0)
    rt.step(opt)


def _single(rank: int, world: int, tmp: Path) -> dict[int, Any]:
    """One process: steps 0, 1, a sharded checkpoint of step 2 at ``tmp/single``, then step 2; states at 2 and 3."""
    from moonrt.comm.parallelism import Parallelism

    job, rt = _job(), Parallelism()
    model, opt = _model_opt(job)
    out = {}
    for step in range(3):
        if step == 2:
            checkpoint_dcp.save_sharded(tmp / "single", model, opt, 2, job)
            out[2] = copy.deepcopy({"model": model.state_dict(), "optimizer": opt.state_dict()})
        _step(rt, model, opt, step, 0, 1, {}, 1)
    out[3] = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    return out


def _resume_one(rank: int, world: int, step_dir: Path) -> dict[str, Any]:
    """One process resumes the sharded checkpoint ``step_dir`` (step 2) and takes step 2; its state at 3."""
    from moonrt.comm.parallelism import Parallelism

    model, opt = _model_opt(_job())
    assert checkpoint_dcp.load_sharded(step_dir, model, opt) == 2
    _step(Parallelism(), model, opt, 2, 0, 1, {}, 1)
    return {"model": model.state_dict(), "optimizer": opt.state_dict()}


def _ranks(rank: int, world: int, tmp: Path) -> dict[str, Any] | None:
    from moonrt.comm.ep.parallel import ExpertParallel
    from moonrt.comm.mesh import ProcessMesh
    from moonrt.comm.parallelism import Parallelism
    from moonrt.comm.zero.muon import ZeroMuon
    from moonrt.config import ParallelConfig

    job, got = _job(), {}
    # --zero 1 on dp 2: ZeroMuon over the default group; a sharded checkpoint at step 2, then step 2
    job.parallel = ParallelConfig(dp=2, zero=1)
    part = ZeroMuon(None, assign=_blocks(job))
    rt = Parallelism(dp_rank=rank, dp_size=world, is_main=rank == 0, parts=[part])
    model, opt = _model_opt(job, rt=rt)
    for step in range(2):
        _step(rt, model, opt, step, rank, world, {}, world)
    checkpoint_dcp.save_sharded(tmp / "zero" / "checkpoint", model, opt, 2, job, rt)
    state = rt.sharded_state_dict(model, opt)
    columns = state[f"optimizer.{COLUMNS}.momentum_buffer"] if f"optimizer.{COLUMNS}.momentum_buffer" in state else None
    got["columns"] = [p.offsets for p in getattr(columns, "parts", [columns] if columns is not None else [])]
    got["boxes"] = sum(len(getattr(v, "parts", ())) > 1 for v in state.values())
    got["zero2"] = rt.full_state_dict(model, opt)

    # --ep 2 --zero 1 (dp 1): the single process's step-2 checkpoint, step 2, a sharded checkpoint of step 3
    job.parallel = ParallelConfig(ep=2, zero=1)
    mesh = ProcessMesh(job.parallel)
    ep = ExpertParallel(job.parallel, mesh=mesh, capacity=64)
    zero = ZeroMuon.from_mesh(mesh, assign=_blocks(job), ep=ep)
    rt = Parallelism(dp_rank=mesh.rank("dp_ep"), dp_size=mesh.size("dp_ep"), is_main=rank == 0, parts=[zero, ep],
                     replicas=mesh.group("dp_ep_cp"))
    model, opt = _model_opt(job, rt=rt)
    assert checkpoint_dcp.load_sharded(tmp / "single", model, opt, rt) == 2
    shards = ep.shard_map(model)
    assert shards, "k3_tiny under --ep 2: no expert sharded"
    _step(rt, model, opt, 2, rank, world, shards, world)
    checkpoint_dcp.save_sharded(tmp / "ep" / "checkpoint", model, opt, 3, job, rt)
    got["ep3"] = rt.full_state_dict(model, opt)
    return got if rank == 0 else {"columns": got["columns"], "boxes": got["boxes"]}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_ranks_save_sharded_muon_and_resume_across_layouts(tmp_path: Path) -> None:
    # every layout in forked gloo processes at one thread (the single process too: world 1 is one process)
    ref = dist_run(_single, 1, tmp_path, timeout=300)[0]
    out = dist_run(_ranks, 2, tmp_path, timeout=500)
    # a rank owns several boxes of one tensor, column blocks of COLUMNS among them (4 blocks over 2 ranks)
    assert all(r["boxes"] > 0 for r in out), [r["boxes"] for r in out]
    cols = sorted(o for r in out for o in r["columns"])
    assert len(cols) == 4 and len({c[1] for c in cols}) == 4 and all(c[0] == 0 for c in cols), cols
    got = out[0]
    keys = ("model", "optimizer")
    # sharded -> gathered format: bit for bit what the gathered path (full_state_dict) gives
    zero, ep = (checkpoint_dcp.to_single_file(tmp_path / name / "checkpoint", BUILDER) for name in ("zero", "ep"))
    _equal({k: zero[k] for k in keys}, got["zero2"], "zero")
    _equal({k: ep[k] for k in keys}, got["ep3"], "ep")
    _close(got["zero2"], ref[2], "zero2 vs single")
    # one process -> ep 2 zero 1: the single process's step
    _close(got["ep3"], ref[3], "ep3 vs single")
    # zero 1 dp 2 -> one process: the single process's step
    one = dist_run(_resume_one, 1, tmp_path / "zero" / "checkpoint", timeout=300)[0]
    _close(one, ref[3], "zero -> one")
