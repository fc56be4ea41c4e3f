"""The transport seam's shm symmetric heap (issue 48 item 1), on real gloo ranks (tests/dist.py):

- puts and gets through peer views equal the data sent, bitwise; the segments are gone from /dev/shm while the
  job still runs (unlinked once every rank mapped them);
- a signal orders the writes before it (ping-pong of 40 rounds), the barrier orders every rank's writes;
- the heap's all-to-all of variable rows equals gloo's ``all_to_all_single`` bitwise (growing staging, both
  parities, fp32 and bf16);
- a rank killed (SIGKILL or SIGTERM) while a peer waits for it is named within the timeout, and a rank dying
  while a segment is being created leaves nothing in /dev/shm;
- a group spanning hosts is one line; ``resolve_backend``'s choices and errors.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch
from dist import dist_run

from moonrt.cluster.local import RankError, run_ranks
from moonrt.comm.transport.collectives import CollectivesTransport
from moonrt.comm.transport.select import resolve_backend
from moonrt.comm.transport.shm import SHM_DIR, PeerDied, ShmHeap


def _left(prefix: str) -> list[str]:
    return sorted(p.name for p in SHM_DIR.iterdir() if p.name.startswith(prefix))


def _put_get(rank: int, world: int) -> dict:
    heap = ShmHeap()
    buf = heap.alloc((3, 17), torch.float32)
    ints = heap.alloc((5,), torch.int64)
    left_while_running = _left(heap._prefix)
    zeroed = bool(buf.local.abs().sum() == 0 and ints.local.abs().sum() == 0)
    heap.barrier()  # no peer writes before every rank has looked
    data = [torch.randn(3, 17, generator=torch.Generator().manual_seed(100 + r)) for r in range(world)]
    dst = (rank + 1) % world
    buf.peer(dst).copy_(data[rank])  # put: my data into the next rank's buffer
    ints.peer(dst).copy_(torch.arange(5) * (rank + 1))
    heap.signal(dst)
    src = (rank - 1) % world
    heap.wait(src)
    put_ok = torch.equal(buf.local, data[src]) and torch.equal(ints.local, torch.arange(5) * (src + 1))
    heap.barrier()
    got = [buf.peer(r).clone() for r in range(world)]  # get: read every rank's buffer
    get_ok = all(torch.equal(got[r], data[(r - 1) % world]) for r in range(world))
    heap.barrier()
    heap.close()
    return {"zeroed": zeroed, "put": put_ok, "get": get_ok, "left": left_while_running, "prefix": heap._prefix}


@pytest.mark.parametrize("world", [2, 4])
def test_put_get_through_peer_views_bitwise_and_nothing_in_dev_shm(world: int) -> None:
    out = dist_run(_put_get, world, timeout=60)
    assert all(o["zeroed"] and o["put"] and o["get"] for o in out), out
    assert all(o["left"] == [] for o in out), out  # unlinked while the job still runs
    assert len({o["prefix"] for o in out}) == 1 and out[0]["prefix"].startswith("moonrt-")
    assert _left(out[0]["prefix"]) == []


def _ordering(rank: int, world: int, rounds: int) -> bool:
    heap = ShmHeap()
    cell = heap.alloc((64,), torch.int64)
    ok = True
    if rank < 2:  # ping-pong between ranks 0 and 1: each round's value is seen whole, never the last round's
        other = 1 - rank
        for i in range(rounds):
            if (i % 2) == rank:
                cell.peer(other).fill_(i)
                heap.signal(other)
            else:
                heap.wait(other)
                ok &= bool((cell.local == i).all())
    for gen in range(1, 6):  # barrier: every rank's write before it is seen by every rank after it
        cell.local.fill_(1000 * gen + rank)
        heap.barrier()
        ok &= all(bool((cell.peer(r) == 1000 * gen + r).all()) for r in range(world))
        heap.barrier()
    return ok


@pytest.mark.parametrize("world", [2, 4])
def test_signal_wait_and_barrier_order_the_writes(world: int) -> None:
    assert all(dist_run(_ordering, world, 40, timeout=60))


def _a2a(rank: int, world: int) -> bool:
    heap, ref = ShmHeap(), CollectivesTransport()
    g = torch.Generator().manual_seed(7)
    ok = True
    for call, (hi, dtype) in enumerate([(3, torch.float32), (9, torch.float32), (2, torch.float32),
                                        (30, torch.float32), (5, torch.bfloat16), (0, torch.float32)]):
        counts = torch.randint(0, hi + 1, (world, world), generator=g).tolist()
        x = (torch.randn(sum(counts[rank]), 3, 5, generator=torch.Generator().manual_seed(call * 10 + rank))
             .to(dtype))
        got, want = heap.all_to_all_v(x, counts), ref.all_to_all_v(x, counts)
        ok &= got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
    heap.close()
    return ok


@pytest.mark.parametrize("world", [2, 4])
def test_heap_all_to_all_of_variable_rows_equals_gloo_bitwise(world: int) -> None:
    assert all(dist_run(_a2a, world, timeout=90))


def _victim(rank: int, world: int, sig: int, report: str) -> str:
    heap = ShmHeap()
    buf = heap.alloc((4,), torch.float32)
    Path(report, "prefix").write_text(heap._prefix)
    if rank == 1:
        heap.wait(0)  # rank 0 is about to wait for this rank
        os.kill(os.getpid(), sig)
        time.sleep(30)
    heap.signal(1)
    t0 = time.monotonic()
    try:
        heap.wait(1)
    except PeerDied as exc:
        Path(report, "rank0").write_text(f"{time.monotonic() - t0:.3f}\n{exc}")
        return "named"
    return f"not named: {buf.local}"


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_rank_killed_while_a_peer_waits_is_named_and_nothing_is_left(tmp_path: Path, sig: int) -> None:
    with pytest.raises(RankError) as info:
        run_ranks(_victim, 2, int(sig), str(tmp_path), timeout=60, collective_timeout_s=30)
    assert info.value.rank == 1, info.value
    seconds, line = (tmp_path / "rank0").read_text().split("\n", 1)
    assert float(seconds) < 5.0
    assert line.startswith("shm heap: rank 1 (pid ") and line.endswith("died while rank 0 waited for its signal"), line
    assert _left((tmp_path / "prefix").read_text()) == []


def _dies_mid_alloc(rank: int, world: int, report: str) -> str:
    heap = ShmHeap()
    Path(report, "prefix").write_text(heap._prefix)
    if rank == 1:
        os._exit(3)  # never maps the next segment: rank 0 has created it and waits at the rendezvous
    try:
        heap.alloc((1024,), torch.float32)
    except Exception as exc:  # gloo's error for the lost peer
        return f"raised {type(exc).__name__}"
    return "allocated without its peer"


def test_a_rank_dying_while_a_segment_is_created_leaves_nothing(tmp_path: Path) -> None:
    with pytest.raises(RankError):
        run_ranks(_dies_mid_alloc, 2, str(tmp_path), timeout=60, collective_timeout_s=20)
    prefix = (tmp_path / "prefix").read_text()
    deadline = time.monotonic() + 10  # rank 0's rendezvous fails a moment after the run reports rank 1
    while _left(prefix) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _left(prefix) == []


def _two_hosts(rank: int, world: int) -> str:
    try:
        ShmHeap(host=f"node{rank}")
    except ValueError as exc:
        return str(exc)
    return "built"


def test_a_group_spanning_hosts_is_one_line() -> None:
    out = dist_run(_two_hosts, 2, timeout=60)
    assert out[0] == out[1] == ("shm heap: the group's 2 ranks are on 2 hosts (node0, node1): expected one host "
                                "(shared memory); the collectives transport serves groups spanning hosts")


def test_resolve_backend_choices_and_errors() -> None:
    assert resolve_backend("auto", ["a", "a"], "cpu") == "shm"
    assert resolve_backend("auto", ["a", "b"], "cpu") == "collectives"
    assert resolve_backend("auto", ["a"], "cuda") == "cuda"
    assert resolve_backend("auto", ["a"], "cuda", cuda_heap=False) == "collectives"
    assert resolve_backend("collectives", ["a", "b"], "cpu") == "collectives"
    assert resolve_backend("shm", ["a", "a"], "cpu") == "shm"
    with pytest.raises(ValueError, match=r"^parallel.ep_transport = 'shm': the group's ranks are on 2 hosts \(a, b\); "
                                         r"expected auto or collectives for a group spanning hosts"):
        resolve_backend("shm", ["b", "a", "a"], "cpu")
    with pytest.raises(ValueError, match=r"^parallel.ep_transport = 'nvlink': expected one of auto, shm, cuda, "
                                         r"collectives$"):
        resolve_backend("nvlink", ["a"], "cpu")
    with pytest.raises(ValueError, match=r"^parallel.ep_transport = 'cuda': the tensors are on cpu; expected GPUs"):
        resolve_backend("cuda", ["a"], "cpu")
    with pytest.raises(ValueError, match=r"^parallel.ep_transport = 'shm': the tensors are on cuda; expected CPU"):
        resolve_backend("shm", ["a"], "cuda")


def test_ep_transport_bad_value_is_one_line_and_writes_nothing(tmp_path: Path,
                                                                capfd: pytest.CaptureFixture[str]) -> None:
    from jobs.helpers import _cli

    code, out, err = _cli(["train", "--steps", "1", "--no-progress", "--out", str(tmp_path / "run"),
                           "--set", "parallel.ep_transport=nvlink"], capfd)
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and ("parallel.ep_transport (--set) = 'nvlink': expected one of 'auto', 'shm', 'cuda', "
                                "'collectives'") in lines[0], err
    assert not (tmp_path / "run").exists()


def test_ep_transport_is_recorded_and_free_on_resume() -> None:
    from moonrt.config import to_dict
    from moonrt.jobs.train.config import JobConfig
    from moonrt.jobs.train.resume import check_resume

    assert to_dict(JobConfig())["parallel"]["ep_transport"] == "auto"  # what config.yaml records
    old = to_dict(JobConfig())
    del old["parallel"]["ep_transport"]  # a config written before the field existed
    new = to_dict(JobConfig())
    new["parallel"]["ep_transport"] = "collectives"
    check_resume(old, new, step=1)
    check_resume(new, to_dict(JobConfig()), step=1)


def _named(rank: int, world: int, identity: str) -> str:
    import torch.distributed as dist

    from moonrt.cluster.store import IDENTITY_KEY

    if rank == 0:  # what check_job_identity publishes in the job's store before the group is made
        dist.distributed_c10d._get_default_store().underlying_store.set(IDENTITY_KEY, identity)
    dist.barrier()
    return ShmHeap()._prefix


def test_segments_are_named_by_the_job_identity_in_the_store() -> None:
    import hashlib

    identity = "moonrt launch job 0123abcd"
    names = dist_run(_named, 2, identity, timeout=60)
    digest = hashlib.sha256(identity.encode()).hexdigest()[:12]
    assert names[0] == names[1] and names[0].startswith(f"moonrt-{digest}-"), names
