"""Gradient sums in the job's reduce dtype (``precision.reduce``, ``--reduce-dtype``; moonrt/comm/grad_reduce.py).

- the helpers on 2 gloo ranks: with fp32 they are the plain collective bit for bit; with bf16 the result is exactly
  what gloo's bf16 sum of two ranks gives, ``bf16(bf16(a) + bf16(b))`` (the two bf16 values added in fp32, the
  sum rounded to bf16: torch's CPU ``bfloat16 + bfloat16`` does the same), and within :data:`BOUND` of the fp32 sum;
- one bf16-compute training step's gradients on 2 ranks (plain data parallel, ``--zero 1``, ``--ep 2``, ``--pp 2``)
  synced through :meth:`Parallelism.sync_grads` with ``reduce = fp32`` and ``bf16``: within the same bound
  elementwise, not all equal (the option changes the wire dtype), every summed bf16 element bf16-representable, and
  every gradient no sum touched (a replica group of one rank: ``--ep 2``'s experts, ``--pp 2``'s stage weights)
  equal to the fp32 run's, unrounded;
- a checkpoint resumes with another reduce dtype (``precision`` is free on resume), and ``--reduce-dtype`` reaches
  the training loop's runtime.

**The bound.** Two ranks, fp32 ``a``, ``b``; bf16 keeps 8 significant bits, so round to nearest has relative error
at most ``u = 2^-8``. The bf16 path: ``x = bf16(a) = a(1 + d1)``, ``y = bf16(b) = b(1 + d2)``, ``|d1|, |d2| <= u``;
``z = fp32(x + y)``, ``|z - (x + y)| <= 2^-24 |x + y|``; ``w = bf16(z)``, ``|w - z| <= u |z|``. With ``|x + y| <=
(1 + u)(|a| + |b|)``: ``|w - (a + b)| <= (|a| + |b|) (u + (1 + u) 2^-24 + u (1 + 2^-24)(1 + u))``. The fp32 sum
``r = fp32(a + b)`` is off by at most ``2^-24 |a + b|``, so ``|w - r| <= BOUND (|a| + |b|)`` with ``BOUND`` = that
factor plus ``2^-24``, about ``2^-7``: the input casts and the rounded sum each contribute up to ``u``. (The
magnitudes ``|a| + |b|`` are themselves summed in fp32, ``m = fp32(|a| + |b|) >= (|a| + |b|)(1 - 2^-24)``; the
check is ``|w - r| <= BOUND (1 + 2^-23) m``.)
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist import dist_run

from moonrt.comm.grad_reduce import all_reduce_grad, reduce_scatter_grad
from moonrt.comm.parallelism import Precision

U = 2.0 ** -8
EPS32 = 2.0 ** -24
BOUND = U + (1 + U) * EPS32 + U * (1 + EPS32) * (1 + U) + EPS32
N = 4096


def _inputs(rank: int) -> torch.Tensor:
    """Rank ``rank``'s fp32 gradient: normal values times ``e^(4 z)`` (magnitudes over ~30 binades, cancellations)."""
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(N, generator=g) * torch.exp(4 * torch.randn(N, generator=g))


def _helpers(rank: int, world: int) -> dict[str, torch.Tensor]:
    x = _inputs(rank)
    out: dict[str, torch.Tensor] = {}
    out["plain"] = x.clone()
    dist.all_reduce(out["plain"])
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        t = x.clone()
        all_reduce_grad(t, None, dtype)
        out[name] = t
        shard = torch.empty(N // world)
        reduce_scatter_grad(shard, x.clone(), None, dtype)
        out[f"rs_{name}"] = shard
    out["rs_plain"] = torch.empty(N // world)
    dist.reduce_scatter_tensor(out["rs_plain"], x.clone())
    wide = x.double() / 3  # an fp64 gradient (a float64 reference run) under the default fp32 reduce
    out["fp64"] = wide.clone()
    all_reduce_grad(out["fp64"], None, torch.float32)
    out["rs_fp64"] = torch.empty(N // world, dtype=torch.float64)
    reduce_scatter_grad(out["rs_fp64"], wide.clone(), None, torch.float32)
    return out


def test_helpers_fp32_is_the_plain_collective_and_bf16_is_gloos_bf16_sum() -> None:
    res = dist_run(_helpers, 2, timeout=120)
    a, b = _inputs(0), _inputs(1)
    bf16_sum = (a.bfloat16() + b.bfloat16()).float()  # bf16(fp32(bf16(a) + bf16(b))): what gloo's two-rank sum does
    half = N // 2
    for rank, got in enumerate(res):
        rows = slice(rank * half, (rank + 1) * half)
        for key in ("plain", "fp32", "bf16", "rs_plain", "rs_fp32", "rs_bf16"):
            assert got[key].dtype == torch.float32, key  # the result lands in the fp32 gradient / shard
        wide = a.double() / 3 + b.double() / 3  # the default fp32 never rounds fp64 gradients: summed in fp64
        assert torch.equal(got["fp64"], wide) and torch.equal(got["rs_fp64"], wide[rows])
        assert torch.equal(got["fp32"], got["plain"]) and torch.equal(got["rs_fp32"], got["rs_plain"])
        assert torch.equal(got["plain"], a + b)
        assert torch.equal(got["bf16"], bf16_sum) and torch.equal(got["rs_bf16"], bf16_sum[rows])
        err = (got["bf16"].double() - got["plain"].double()).abs()
        assert bool((err <= BOUND * (a.double().abs() + b.double().abs())).all())
        assert not torch.equal(got["bf16"], got["plain"])


def _synced(rank: int, world: int, parallel: dict[str, int]) -> dict[str, Any]:
    """One bf16-compute forward/backward of k3_tiny on this rank's rows, then its gradients synced three ways from the
    same local gradients: ``fp32`` and ``bf16`` reduce, and the fp32 sum of their absolute values (the bound's
    ``|a| + |b|``), each as the layout leaves them (ZeRO: this rank's bucket shards)."""
    from moonrt.config import from_dict
    from moonrt.jobs.train.assemble import build_model, parallel_runtime
    from moonrt.jobs.train.config import JobConfig

    torch.set_num_threads(1)
    # the launcher's environment of this rank (the group already exists: parallel_runtime only checks it)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT="1")
    job = from_dict(JobConfig, {"model": "k3_tiny", "device": "cpu", "parallel": parallel,
                                "precision": {"compute": "bf16"}})
    rt = parallel_runtime(job)
    model = rt.parallelize(build_model(job))
    batch = torch.randint(0, 256, (4, 33), generator=torch.Generator().manual_seed(7))
    rows = batch[rt.dp_rank * 4 // rt.dp_size:(rt.dp_rank + 1) * 4 // rt.dp_size]
    rt.precision = Precision("bf16", "cpu")
    rt.forward_backward(model, rows[:, :-1], rows[:, 1:], 1.0 / (4 * 32))
    params = list(model.parameters())
    local = [None if p.grad is None else p.grad.clone() for p in params]
    kinds = {part.kind: part for part in rt.parts}
    zero, ep, pipe = kinds.get("zero"), kinds.get("expert"), kinds.get("pipeline")

    comm: dict[str, int] = {}

    def sync(grads: list[torch.Tensor | None], reduce: str) -> list[torch.Tensor]:
        for p, g in zip(params, grads):
            p.grad = None if g is None else g.clone()
        rt.precision = Precision("bf16", "cpu", reduce)
        rt.sync_grads(model)
        if zero is not None:
            comm[reduce] = zero.comm_bytes()
            return [b.grad.clone() for b in zero.buckets]
        return [p.grad.clone() for p in params if p.grad is not None]

    out = {"fp32": sync(local, "fp32"), "bf16": sync(local, "bf16"),
           "mag": sync([None if g is None else g.abs() for g in local], "fp32")}
    out["comm"] = comm
    # which synced tensors were summed over 2 ranks: --ep 2 on 2 ranks, the dense ones (the experts' replica group is
    # one rank); --pp 2, the pseudo-queries shared by the stages (the replica group is one rank)
    if zero is not None:
        out["summed"] = [b.size > 1 for b in zero.buckets]
    else:
        summed = {n for n, p in model.named_parameters()
                  if (ep is None or not ep.is_expert(p)) and (pipe is None or n in pipe.shared)}
        out["summed"] = [n in summed for n, p in model.named_parameters() if p.grad is not None]
    return out


@pytest.mark.parametrize("parallel", [{"dp": 2}, {"dp": 2, "zero": 1}, {"ep": 2}, {"pp": 2}],
                         ids=["dp", "zero1", "ep2", "pp2"])
def test_bf16_reduce_of_a_training_steps_gradients_is_within_the_bound_of_fp32(parallel: dict[str, int]) -> None:
    for rank, got in enumerate(dist_run(_synced, 2, parallel, timeout=300)):
        assert len(got["fp32"]) == len(got["bf16"]) == len(got["mag"]) == len(got["summed"]) > 0
        assert any(got["summed"]), parallel
        for g32, g16, mag, summed in zip(got["fp32"], got["bf16"], got["mag"], got["summed"]):
            assert g16.dtype == g32.dtype == torch.float32
            err = (g16.double() - g32.double()).abs()
            assert bool((err <= BOUND * (1 + 2 * EPS32) * mag.double()).all()), (rank, parallel)
            if summed:  # the bf16 sum written back: every element a bf16 value
                assert torch.equal(g16.bfloat16().float(), g16), (rank, parallel)
            else:  # not summed (one replica): untouched by the reduce dtype
                assert torch.equal(g16, g32), (rank, parallel)
        assert not all(torch.equal(a, b) for a, b in zip(got["fp32"], got["bf16"])), (rank, parallel)
        if "zero" in parallel:  # ZeRO's comm bytes: the reduce-scatter at 2 bytes, the all-gather at 4 (was 4 + 4)
            assert got["comm"]["fp32"] > 0 and got["comm"]["bf16"] * 8 == got["comm"]["fp32"] * 6, got["comm"]


def test_resume_may_change_the_reduce_dtype() -> None:
    from moonrt.config import to_dict
    from moonrt.jobs.train.config import JobConfig, PrecisionConfig
    from moonrt.jobs.train.resume import check_resume

    fp32, bf16 = to_dict(JobConfig()), to_dict(JobConfig(precision=PrecisionConfig(compute="bf16", reduce="bf16")))
    check_resume(fp32, bf16, step=1)
    check_resume(bf16, fp32, step=1)
    older = to_dict(JobConfig())
    del older["precision"]["reduce"]  # a checkpoint written before precision.reduce existed
    check_resume(older, bf16, step=1)


def test_reduce_dtype_flag_reaches_the_runtime(tmp_path: Path) -> None:
    """``--reduce-dtype bf16`` is the training loop's :attr:`Parallelism.precision` (one single-process step)."""
    from moonrt.comm.parallelism import Parallelism
    from moonrt.jobs.train import cli as train_cli
    from moonrt.jobs.train.loop import train

    parser = argparse.ArgumentParser()
    train_cli.add_arguments(parser)
    args = parser.parse_args(["--reduce-dtype", "bf16", "--steps", "1", "--batch-size", "2", "--seq-len", "16",
                              "--eval-every", "100", "--out", str(tmp_path / "run"), "--device", "cpu"])
    rt = Parallelism()
    train(train_cli.job_from_args(args), rt=rt, progress=False)
    assert rt.precision == Precision("fp32", "cpu", "bf16")
