"""Checkpoint save/load: sharded DCP (``moonrt.jobs.checkpoint.sharded``) vs the old gathered ``checkpoint.pt``.

k3_tiny after one AdamW step at ``--ep 2 --zero 1`` on 4 gloo ranks (dp 2), each format in fresh processes so
the memory high-water marks do not mix. Per rank: wall time of save and load (median of ``--repeats``; an
oversubscribed machine makes them noisy), the bytes of tensors the format *materialises* for the save beyond
the live parameters and optimizer buffers (exact: tensors of the state handed to ``torch.save`` / DCP whose
storage is not a live one), and the growth of the process's peak RSS (``ru_maxrss``) across save + load.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from moonrt.cluster.local import run_ranks

RANKS = 4


def _runtime(rank: int) -> tuple[Any, Any, Any, Any]:
    """k3_tiny at --ep 2 --zero 1 on this rank, after one step (every parameter has AdamW state)."""
    from moonrt.comm.ep.parallel import ExpertParallel
    from moonrt.comm.mesh import ProcessMesh
    from moonrt.comm.parallelism import Parallelism
    from moonrt.comm.zero.adamw import Zero1
    from moonrt.config import ParallelConfig
    from moonrt.jobs.train.assemble import build_model
    from moonrt.jobs.train.config import JobConfig
    from moonrt.jobs.train.optimizers import build_optimizer

    job = JobConfig(model="k3_tiny", parallel=ParallelConfig(dp=2, ep=2, zero=1))
    mesh = ProcessMesh(job.parallel)
    ep = ExpertParallel(job.parallel, mesh=mesh, capacity=64)
    rt = Parallelism(dp_rank=mesh.rank("dp_ep"), dp_size=mesh.size("dp_ep"), is_main=rank == 0,
                     replicas=mesh.group("dp_ep_cp"), parts=[Zero1.from_mesh(mesh, ep=ep), ep])
    model = rt.parallelize(build_model(job))
    opt = build_optimizer(model, job.optim)
    x = torch.randint(0, 256, (1, 33), generator=torch.Generator().manual_seed(rank))
    rt.forward_backward(model, x[:, :-1], x[:, 1:], 1.0 / 32)
    rt.sync_grads(model)
    rt.clip_grad_norm(model.parameters(), 1.0)
    rt.step(opt)
    return job, rt, model, opt


def _live(model: Any, rt: Any) -> set[int]:
    ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    ptrs |= {b.untyped_storage().data_ptr() for b in model.buffers()}
    for part in rt.parts:
        for b in getattr(part, "buckets", []):
            ptrs |= {getattr(b, k).untyped_storage().data_ptr() for k in ("exp_avg", "exp_avg_sq", "steps")}
    return ptrs


def _new_bytes(tree: Any, live: set[int]) -> int:
    if isinstance(tree, dict):
        return sum(_new_bytes(v, live) for v in tree.values())
    if isinstance(tree, list | tuple):
        return sum(_new_bytes(v, live) for v in tree)
    t = getattr(tree, "local", tree)
    if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in live:
        return t.numel() * t.element_size()
    return 0


def _rank(rank: int, world: int, fmt: str, out: str, repeats: int) -> dict[str, Any]:
    from moonrt.jobs.checkpoint import sharded as checkpoint_dcp
    from moonrt.jobs.checkpoint import single as checkpoint

    job, rt, model, opt = _runtime(rank)
    live = _live(model, rt)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    saves, loads, extra = [], [], 0
    for i in range(repeats):
        d = Path(out) / f"r{i}"
        dist.barrier()
        t0 = time.perf_counter()
        if fmt == "gathered":
            state = rt.full_state_dict(model, opt)
            extra = max(extra, _new_bytes(state, live))
            if rt.is_main:
                d.mkdir(parents=True, exist_ok=True)
                checkpoint.save(d / "checkpoint.pt", {**state, "step": 1, "config": {}})
            del state
        else:
            extra = max(extra, _new_bytes(rt.sharded_state_dict(model, opt, save=True), live))
            checkpoint_dcp.save_sharded(d / "checkpoint", model, opt, 1, job, rt)
        dist.barrier()
        saves.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        if fmt == "gathered":
            rt.load_full_state_dict(model, opt, checkpoint.load(d / "checkpoint.pt"))
        else:
            checkpoint_dcp.load_sharded(d / "checkpoint", model, opt, rt)
        dist.barrier()
        loads.append(time.perf_counter() - t0)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"save_s": statistics.median(saves), "load_s": statistics.median(loads), "extra_bytes": extra,
            "peak_rss_growth_kib": rss - rss0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="/tmp/moonrt-bench/bench_checkpoint.json")
    args = ap.parse_args()
    rows = {}
    print(f"k3_tiny --ep 2 --zero 1 on {RANKS} gloo ranks (dp 2); per rank: save s / load s / extra MB / peak RSS +MB")
    for fmt in ("gathered", "sharded"):
        tmp = tempfile.mkdtemp(prefix=f"moonrt-bench-ckpt-{fmt}-")
        try:
            res = run_ranks(_rank, RANKS, fmt, tmp, args.repeats, timeout=1800)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        rows[fmt] = res
        cells = "  ".join(f"{r['save_s']:.2f}/{r['load_s']:.2f}/{r['extra_bytes'] / 1e6:.1f}/"
                          f"{r['peak_rss_growth_kib'] / 1e3:.1f}" for r in res)
        print(f"{fmt:<9} {cells}", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
