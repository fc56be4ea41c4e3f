"""Pipeline executor parity (K3_SYSTEMS §9): on 2 and 4 gloo ranks, every schedule and both AttnRes
communication modes give the single-process model's loss, logits and parameter gradients of one
global batch; the blocks each rank sends equal the hop plan (``moonrt pp-plan``'s counts) and, in an
aligned loop-placed layout, K3_SYSTEMS §9's closed forms; each block is held once per rank.

Tolerance: the pipeline computes the same function in fp32 with a different summation order only
where micro-batches are summed (loss, parameter gradients: M partial sums instead of one) and where
a cached block's gradient is accumulated over its uses in another order; each such sum has at most a
few hundred terms of similar magnitude, so the normwise difference is a few hundred fp32 ulps
(~1e-5 relative would need ~100 ulps of cancellation-free growth; measured: below 1e-6).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import torch.distributed as dist

from moonrt.comm.pp.part import PipelineParallel
from moonrt.models.k3.model.config import full_attn_layers, k3_tiny
from moonrt.models.k3.model.model import K3Model
from moonrt.scheduler.attnres_comm import hop_plan
from moonrt.scheduler.pipeline import build_schedule
from tests.dist import dist_run

BATCH, SEQ = 4, 16
RTOL = 1e-5


def aligned_cfg() -> Any:
    """k3_tiny with 8 layers in AttnRes blocks of 2: every cut of 2 or 4 stages falls on a block boundary."""
    cfg = k3_tiny()
    lac = dataclasses.replace(cfg.linear_attn_config, full_attn_layers=full_attn_layers(8))
    return dataclasses.replace(cfg, num_hidden_layers=8, attn_res_block_size=2, linear_attn_config=lac)


CONFIGS = {"aligned": aligned_cfg, "k3_tiny": k3_tiny}


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _model(cfg_name: str) -> K3Model:
    torch.manual_seed(0)
    return K3Model(CONFIGS[cfg_name]())


def _reference(cfg_name: str) -> tuple[float, torch.Tensor, dict[str, torch.Tensor]]:
    model = _model(cfg_name)
    x, y = _batch()
    logits = model(x)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1),
                                             reduction="sum") / y.numel()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return float(loss.detach()), logits.detach(), grads


def _pp_rank(rank: int, world: int, runs: list[tuple[str, str, int, int, str]]) -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    out = []
    for cfg_name, kind, vpp, m, mode in runs:
        sched = build_schedule(kind, world, m, vpp)
        part = PipelineParallel(sched, group=dist.group.WORLD, rank=rank, mode=mode)
        model = part.parallelize(_model(cfg_name))
        part.executor.keep_outputs = True
        x, y = _batch()
        loss = part.forward_backward(model, x, y, 1.0 / y.numel())
        part.sync_grads(model)
        ex = part.executor
        out.append({"loss": float(loss), "grads": {n: p.grad.clone() for n, p in model.named_parameters()
                                                   if p.grad is not None},
                    "logits": torch.cat([ex.outputs[i] for i in range(m)]) if ex.outputs else None,
                    "blocks": ex.stats.blocks_sent, "hops": dict(ex.stats.hops), "bytes": ex.stats.bytes_sent,
                    "peak_blocks": dict(ex.peak_blocks), "peak_storages": dict(ex.peak_storages),
                    "stages": part.my_stages, "plan": part.plan})
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _check_parity(results: list[list[dict[str, Any]]], runs: list[tuple[str, str, int, int, str]]) -> None:
    refs = {name: _reference(name) for name in {r[0] for r in runs}}
    for i, run in enumerate(runs):
        ref_loss, ref_logits, ref_grads = refs[run[0]]
        per_rank = [res[i] for res in results]
        for r in per_rank:
            assert abs(r["loss"] - ref_loss) <= RTOL * abs(ref_loss), (run, r["loss"], ref_loss)
        logits = [r["logits"] for r in per_rank if r["logits"] is not None]
        assert len(logits) == 1 and _rel(logits[0], ref_logits) <= RTOL, run
        seen = set()
        grad_scale = max(float(g.norm()) for g in ref_grads.values())
        for r in per_rank:
            for n, g in r["grads"].items():
                ref = ref_grads[n]
                err = float((g.double() - ref.double()).norm())
                assert err <= RTOL * max(float(ref.norm()), 1e-3 * grad_scale), (run, n, err, float(ref.norm()))
                seen.add(n)
        assert seen == set(ref_grads), (run, set(ref_grads) - seen)


RUNS_2 = [("aligned", "gpipe", 1, 2, "cached"), ("aligned", "1f1b", 1, 4, "naive"),
          ("aligned", "1f1b", 1, 2, "cached"), ("aligned", "interleaved", 2, 2, "cached"),
          ("aligned", "interleaved", 2, 4, "naive"), ("k3_tiny", "1f1b", 1, 2, "cached"),
          ("aligned", "zb", 1, 2, "cached"), ("aligned", "zb", 2, 2, "naive"), ("k3_tiny", "zb", 2, 4, "cached"),
          ("aligned", "zbv", 2, 2, "cached"), ("k3_tiny", "zbv", 2, 4, "naive")]
RUNS_4 = [("aligned", "1f1b", 1, 4, "cached"), ("aligned", "gpipe", 1, 4, "naive"),
          ("k3_tiny", "1f1b", 1, 4, "cached"), ("k3_tiny", "1f1b", 1, 4, "naive"),
          ("aligned", "zb", 1, 4, "cached"), ("k3_tiny", "interleaved", 2, 4, "cached"),
          ("aligned", "zbv", 2, 4, "cached")]


def _expected_blocks(p: int, v: int, n_p: int, mode: str) -> tuple[int, int]:
    """(total, largest hop) per micro-batch (the closed forms of K3_SYSTEMS §9)."""
    c = p * v
    if mode == "naive":
        return n_p * c * (c - 1) // 2 + (c - 1), (c - 1) * n_p + 1
    return n_p * p * (p - 1) // 2 + (p - 1) + (v - 1) * p * (p - 1) * n_p, (p - 1) * n_p + 1


def _check_blocks(results: list[list[dict[str, Any]]], runs: list[tuple[str, str, int, int, str]], p: int) -> None:
    for i, (cfg_name, kind, v, m, mode) in enumerate(runs):
        per_rank = [res[i] for res in results]
        cfg = CONFIGS[cfg_name]()
        sched = build_schedule(kind, p, m, v)
        hops = hop_plan(_model(cfg_name).stages(p * v), cfg.attn_res_block_size, sched.rank_of, mode)
        assert sum(r["blocks"] for r in per_rank) == hops.total * m, (runs[i], [r["blocks"] for r in per_rank])
        assert all(r["hops"].get(s, 0) == len(hops.sends[s]) * m for r in per_rank for s in r["stages"]
                   if s < p * v - 1), runs[i]
        if cfg_name == "aligned" and sched.placement == "loop" and (8 // (p * v)) % 2 == 0:
            n_p = 8 // (p * v) // 2  # 8 layers, blocks of 2: each stage completes n_p blocks
            total, largest = _expected_blocks(p, v, n_p, mode)
            assert sum(r["blocks"] for r in per_rank) == total * m, (runs[i], [r["blocks"] for r in per_rank])
            assert max(h for r in per_rank for h in r["hops"].values()) == largest * m, runs[i]
        if mode == "cached":  # each rank holds every block it produced or received exactly once
            plan = per_rank[0]["plan"]
            for rank, r in enumerate(per_rank):
                held = set()
                for s in r["stages"]:
                    held |= set(plan.produced[s]) | (set(plan.sends[s - 1]) if s else set())
                assert set(r["peak_blocks"]) == set(range(m)), runs[i]
                assert all(n == len(held) for n in r["peak_blocks"].values()), (runs[i], rank, r["peak_blocks"], held)
                assert r["peak_storages"] == r["peak_blocks"], runs[i]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_rank_pipeline_equals_single_process() -> None:
    results = dist_run(_pp_rank, 2, RUNS_2, timeout=540)
    _check_parity(results, RUNS_2)
    _check_blocks(results, RUNS_2, 2)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_four_rank_pipeline_equals_single_process() -> None:
    results = dist_run(_pp_rank, 4, RUNS_4, timeout=540)
    _check_parity(results, RUNS_4)
    _check_blocks(results, RUNS_4, 4)


def _dying_rank(rank: int, world: int, port: int, dead: int, out: str) -> None:
    """One rank of a 3-stage 1F1B pipeline; rank ``dead`` exits abruptly at its first backward."""
    import datetime
    import os
    from pathlib import Path

    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    part = PipelineParallel(build_schedule("1f1b", world, 2), group=dist.group.WORLD, rank=rank)
    model = part.parallelize(_model("aligned"))
    if rank == dead:
        part.executor._b = lambda s, mb: os._exit(3)
    x, y = _batch()
    try:
        part.forward_backward(model, x, y, 1.0 / y.numel())
        msg = "finished"
    except Exception as exc:  # noqa: BLE001 (the message is the result)
        msg = f"{type(exc).__name__}: {exc}"
    Path(out, f"rank{rank}.txt").write_text(msg)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_rank_that_dies_mid_schedule_is_named_by_every_rank(tmp_path: Any) -> None:
    """The last of 3 ranks exits during its first backward: rank 1 loses it directly, rank 0 loses rank 1
    (which stopped on the error); both exit with an error naming pipeline rank 2, none hangs."""
    import multiprocessing as mp
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_dying_rank, args=(r, 3, port, 2, str(tmp_path))) for r in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(240)
    assert all(p.exitcode is not None for p in procs), "a rank hung"
    assert procs[2].exitcode == 3
    for r in (0, 1):
        msg = (tmp_path / f"rank{r}.txt").read_text()
        assert msg.startswith(f"PipelineError: pipeline rank {r}: RECV_B of stage {r}"), msg
        assert "pipeline rank 2 died or left the job" in msg, msg
