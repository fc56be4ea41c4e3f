"""The NCCL-op check (issue 30 item 4; the recorder and checker are ``tests/collective_check.py``): every
torch.distributed call of a training step in the layouts whose communication is the pipeline's, MoonEP's and
context parallelism's is one NCCL has, on the right group and device, in an order NCCL completes; the check catches
a planted gloo-only call and a planted order that deadlocks on NCCL; and docs/ARCHITECTURE.md's table of
collectives names every (call, group) the runs record.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from collective_check import P2P, Call, TensorInfo, check, collective_check
from dist import dist_run
from jobs.helpers import missing_doc_rows

FLAGS = ["--steps", "1", "--seed", "0", "--batch-size", "4", "--seq-len", "16", "--eval-every", "1",
         "--set", "optim.eval_windows=4", "--threads", "1", "--no-progress"]
"""One step, its eval and its checkpoint: the smallest job that runs every layout below (``--pp 2 --vpp 2`` takes
4 micro-batches, ``--cp 2`` halves 16 tokens)."""

COMPOSITE: dict[str, list[str]] = {"--pp 2 --ep 2": ["--pp", "2", "--ep", "2", "--microbatches", "2"]}
"""Four-rank layouts: the pipeline's batches interleaved with MoonEP's all-to-alls inside the stages (two
communicators on one rank's timeline)."""


def _corpus(tmp: Path) -> Path:
    path = tmp / "docs.txt"
    if not path.exists():
        path.write_text("".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\x0c" for i in range(300)))
    return path


def _train(rank: int, world: int, tmp: Path, layouts: dict[str, list[str]]) -> dict[str, Any]:
    """Every layout of ``layouts`` on this rank, one after another on the group ``dist_run`` made (the launcher's
    variables point ``moonrt train`` at it; leaving it is skipped until the last one ran)."""
    import moonrt.cluster.env as env
    from moonrt.cli import main

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT="1")
    leave, env.shutdown_distributed = env.shutdown_distributed, lambda: None
    out: dict[str, Any] = {}
    try:
        for name, extra in layouts.items():
            run = tmp / re.sub(r"\W+", "_", name)
            flags = [*FLAGS, "--corpus", str(_corpus(tmp)), "--out", str(run), *extra]
            with collective_check("cpu") as found:
                codes = [main(["train", *flags])]
            out[name] = {"codes": codes, "violations": [str(v) for v in found], "calls": found.calls}
    finally:
        env.shutdown_distributed = leave
    return out


@pytest.fixture(scope="module")
def layouts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("nccl")
    return dist_run(_train, 4, tmp, COMPOSITE, timeout=600)[0]


@pytest.mark.slow
@pytest.mark.parametrize("name", [*COMPOSITE])
def test_layout_issues_only_nccl_correct_calls(layouts: dict[str, Any], name: str) -> None:
    """The layout's step, eval and checkpoint (and resume) pass rules (a) and (b), and its point-to-point went out in
    batches (the pipeline's hops, the conv halo)."""
    got = layouts[name]
    assert all(c == 0 for c in got["codes"]), got["codes"]
    assert got["violations"] == []
    calls = [c for cs in got["calls"] for c in cs]
    assert calls, "nothing recorded"
    fns = {c.fn for c in calls}
    assert not fns & {"isend", "irecv", "send", "recv"}
    if name.startswith("--pp") or name == "--cp 2":
        assert "batch_isend_irecv" in fns
    objects = [c for c in calls if c.fn.endswith("_object") or c.fn == "broadcast_object_list"]
    assert objects and all(c.cpu for c in objects)  # the checkpoint's and DCP's (and pp's) object collectives


@pytest.mark.slow
def test_doc_table_names_every_composite_call(layouts: dict[str, Any]) -> None:
    """The 4-rank composite's calls each have a row in the table (the 2-rank layouts' calls are checked by
    ``test_layout_checks.py::test_doc_table_names_every_recorded_call``)."""
    assert not missing_doc_rows(got["calls"] for got in layouts.values())


# ---- the check catches what it exists for ------------------------------------------------------------------------


def _planted(rank: int, world: int, what: str) -> list[str]:
    peer = 1 - rank
    x = torch.full((4,), float(rank))
    with collective_check("cpu") as found:
        dist.all_reduce(x)
        if what == "monitored_barrier":
            dist.monitored_barrier()
        elif what == "send_then_recv":  # each rank: its send alone, then its receive: gloo delivers, NCCL waits
            y = torch.empty(4)
            works = dist.batch_isend_irecv([dist.P2POp(dist.isend, x, peer)])
            works += dist.batch_isend_irecv([dist.P2POp(dist.irecv, y, peer)])
            for w in works:
                w.wait()
        elif what == "one_group":  # the same transfer as one batch: fine
            y = torch.empty(4)
            for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, x, peer), dist.P2POp(dist.irecv, y, peer)]):
                w.wait()
        elif what == "bare_isend":
            y = torch.empty(4)
            works = [dist.irecv(y, peer)] if rank else [dist.isend(x, peer)]
            for w in works:
                w.wait()
    return [str(v) for v in found]


def test_planted_gloo_only_call_is_caught() -> None:
    """``dist.monitored_barrier()`` (gloo's; NCCL has none) in a run: one violation per rank naming it and this
    file, the same list on both ranks."""
    found = dist_run(_planted, 2, "monitored_barrier")
    assert found[0] == found[1] and len(found[0]) == 2
    assert [v.split(" tests/")[0] for v in found[0]] == ["[nccl-op] rank 0", "[nccl-op] rank 1"]
    assert all("tests/jobs/test_nccl_ops.py" in v and "monitored_barrier" in v for v in found[0])


def test_planted_order_that_deadlocks_on_nccl_is_caught() -> None:
    """Each rank's send in a batch of its own before its receive: gloo completes it, the check reports the deadlock
    NCCL would have; the same transfer as one batch passes; a bare isend / irecv is flagged."""
    bad = dist_run(_planted, 2, "send_then_recv")[0]
    assert len(bad) == 1 and bad[0].startswith("[deadlock] ranks 0, 1"), bad
    assert dist_run(_planted, 2, "one_group")[0] == []
    bare = dist_run(_planted, 2, "bare_isend")[0]
    assert {v.split("]")[0] for v in bare} == {"[bare-p2p"} and len(bare) == 2, bare


def _pipeline(rank: int, world: int, grouped: bool) -> list[str]:
    """The interleaved executor (pp 2, vpp 2, 4 micro-batches) on a tiny stack: as built (grouped), or with the
    lowered per-action list (each SEND / RECV its own call, the order before the groups)."""
    from moonrt.comm.pp.part import PipelineParallel
    from moonrt.jobs.selftest.pp import TinyConfig, TinyStack, _batch
    from moonrt.scheduler.pipeline import build_schedule

    torch.manual_seed(0)
    part = PipelineParallel(build_schedule("interleaved", 2, 4, 2), group=dist.group.WORLD, rank=rank)
    model = part.parallelize(TinyStack(TinyConfig(4)))
    if not grouped:
        part.executor.actions = list(part.schedule.actions[rank])
    x, y = _batch(4, torch.device("cpu"))
    with collective_check("cpu") as found:
        part.forward_backward(model, x, y, 1.0 / y.numel())
    return [str(v) for v in found]


def test_pipeline_groups_pass_and_the_per_action_order_deadlocks() -> None:
    """The pipeline's batches pass the NCCL dry run; its lowered order, one call per SEND / RECV, which gloo runs to
    the same loss, would deadlock on NCCL, and the check says so (the order the groups replaced)."""
    assert dist_run(_pipeline, 2, True)[0] == []
    bad = dist_run(_pipeline, 2, False)[0]
    assert any(v.startswith("[deadlock]") for v in bad), bad


def _call(fn: str, *, cpu: bool = False, device: str = "cpu", dtype: str = "float32", op: str | None = None,
          labels: tuple[str, ...] = ("world",)) -> Call:
    t = TensorInfo(device, dtype, (4,))
    return Call(0, fn, "0", (0,), "gloo", cpu, labels, () if fn.endswith("object") else (t,), (), op, "x.py:1", None)


def test_rules_on_single_calls() -> None:
    """Rule (a) call by call: object collectives off the CPU group, a host tensor in a CUDA job, a dtype and a reduce
    op NCCL lacks, a device tensor on a CPU group are each one violation; their correct forms none."""
    def rules(call: Call, device: str = "cpu") -> list[str]:
        return [v.rule for v in check([[call]], device)]

    assert rules(_call("all_gather_object")) == ["objects"]
    assert rules(_call("all_gather_object", cpu=True)) == []
    assert rules(_call("all_reduce"), "cuda:0") == ["device"]
    assert rules(_call("all_reduce", device="cuda:0"), "cuda:0") == []
    assert rules(_call("all_reduce", device="cuda:0", cpu=True), "cuda:0") == ["device"]
    assert rules(_call("all_reduce", dtype="int16")) == ["dtype"]
    assert rules(_call("all_reduce", op="BAND")) == ["reduce-op"]
    assert rules(_call("all_reduce", op="MAX")) == []


def test_in_order_pairing_with_other_tags_is_caught() -> None:
    """Two sends in one batch whose receives were posted in the other order: gloo matches them by tag, NCCL in order
    (wrong tensors): an ``order`` violation."""
    t = TensorInfo("cpu", "float32", (4,))
    send = Call(0, "batch_isend_irecv", "0", (0, 1), "gloo", False, (), (t, t),
                (P2P(True, 1, 1, t), P2P(True, 1, 2, t)), None, "a.py:1", None)
    recv = Call(1, "batch_isend_irecv", "0", (0, 1), "gloo", False, (), (t, t),
                (P2P(False, 0, 2, t), P2P(False, 0, 1, t)), None, "b.py:1", None)
    assert [v.rule for v in check([[send], [recv]])] == ["order", "order"]
