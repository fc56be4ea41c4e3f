"""KCP over the symmetric heap (issue 48 item 3), on real gloo ranks (tests/dist.py):

- the summaries gathered by one-sided writes into every peer's slot (``HeapGather`` over ``ShmHeap``) give KCP
  outputs, final state and every gradient bitwise equal to the collectives' all-gather (fp32, 2 and 4 ranks), both
  within 1e-5 of the single process in fp64 (``tests/comm/test_kcp.py``'s bound); the heap buffer is allocated once
  (both passes' summaries are ``[B, H, K, V + K]``) and reused, and nothing is in /dev/shm while the job runs;
- the summary path makes no host synchronization (``tests/host_syncs.py``'s counter): the heap path's counts equal
  the collectives path's but for the heap's own signal-cell polls in ``transport/shm.py``;
- a rank killed inside KCP's forward is named in one line by the rank waiting for its summary, and nothing is left
  in /dev/shm;
- ``parallel.cp_transport``'s choices and one-line refusals.
"""

from __future__ import annotations

import collections
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from dist import dist_run
from host_syncs import HostSyncCounter
from numerics import rel_l2

from moonrt.cluster.local import RankError, run_ranks
from moonrt.comm.cp.gather import CollectiveGather, HeapGather, build_summary_gather, resolve_cp_transport
from moonrt.comm.cp.kcp import kcp_kda
from moonrt.comm.cp.ops import slice_bounds
from moonrt.comm.transport.shm import SHM_DIR, PeerDied, ShmHeap
from moonrt.ops.kda import kda_chunk

B, H, K, V = 2, 2, 16, 24  # K != V catches transposed state maps
NAMES = ("q", "k", "v", "g", "beta")


def _left(prefix: str) -> list[str]:
    return sorted(p.name for p in SHM_DIR.iterdir() if p.name.startswith(prefix))


def _inputs(T: int, seed: int, init: bool) -> dict[str, torch.Tensor | None]:
    """Seeded global inputs with long memory (a state survives a whole slice: the cross-rank chain matters)."""
    gen = torch.Generator().manual_seed(seed)
    rn = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    return {"q": torch.nn.functional.normalize(rn(B, T, H, K), dim=-1),
            "k": torch.nn.functional.normalize(rn(B, T, H, K), dim=-1),
            "v": rn(B, T, H, V), "g": -torch.rand(B, T, H, K, generator=gen) / T,
            "beta": torch.rand(B, T, H, generator=gen) * (K / T),
            "h0": 0.5 * rn(B, H, K, V) if init else None, "do": rn(B, T, H, V), "ds": rn(B, H, K, V)}


def _reference(x: dict) -> dict[str, torch.Tensor]:
    """Single-process ``kda_chunk`` in fp64 on the whole sequence: outputs, final state, every gradient."""
    leaves = {n: x[n].double().requires_grad_(True) for n in NAMES}
    h0 = x["h0"].double().requires_grad_(True) if x["h0"] is not None else None
    o, s = kda_chunk(**leaves, initial_state=h0, output_final_state=True)
    ((o * x["do"].double()).sum() + (s * x["ds"].double()).sum()).backward()
    out = {"o": o.detach(), "s": s.detach(), **{f"d{n}": t.grad for n, t in leaves.items()}}
    if h0 is not None:
        out["dh0"] = h0.grad
    return out


def _kcp(rank: int, world: int, x: dict, T: int, gather: object) -> dict[str, torch.Tensor]:
    """KCP forward and backward of this rank's slice, its summaries moved by ``gather``."""
    a, b = slice_bounds(T, world, rank)
    leaves = {n: x[n][:, a:b].clone().requires_grad_(True) for n in NAMES}
    h0 = x["h0"].clone().requires_grad_(True) if x["h0"] is not None and rank == 0 else None
    o, s = kcp_kda(**leaves, group=None, initial_state=h0, output_final_state=True, gather=gather)
    loss = (o * x["do"][:, a:b]).sum()
    if rank == world - 1:
        loss = loss + (s * x["ds"]).sum()
    loss.backward()
    out = {"o": o.detach(), **{f"d{n}": t.grad for n, t in leaves.items()}}
    if s is not None:
        out["s"] = s.detach()
    if h0 is not None:
        out["dh0"] = h0.grad
    return out


def _both(rank: int, world: int, cases: list[tuple[int, dict]]) -> dict:
    heap = HeapGather(ShmHeap())
    coll = CollectiveGather(None)
    got, want, first = [], [], None
    for T, x in cases:
        got.append(_kcp(rank, world, x, T, heap))
        want.append(_kcp(rank, world, x, T, coll))
        if first is None:
            first = {key: id(buf) for key, buf in heap.buffers.items()}
    reused = first == {key: id(buf) for key, buf in heap.buffers.items()}
    calls = dict(heap.calls)
    left = _left(heap.heap._prefix)
    heap.close()
    return {"heap": got, "coll": want, "reused": reused, "calls": calls, "left": left, "name": heap.name}


@pytest.mark.parametrize("world", [2, 4])
def test_kcp_over_the_heap_equals_the_collectives_bitwise(world: int) -> None:
    cases = [(T, _inputs(T, seed=T + world, init=init)) for T, init in ((128, True), (200, False), (64, True))]
    out = dist_run(_both, world, cases, timeout=240)
    for r, o in enumerate(out):
        assert o["name"] == "shm" and o["left"] == [], o["left"]  # segments unlinked while the job runs
        # one buffer for both passes' summaries, allocated at the first call and reused: one gather per pass and case
        assert o["reused"] and list(o["calls"].values()) == [2 * len(cases)], o["calls"]
        for i, (got, want) in enumerate(zip(o["heap"], o["coll"])):
            assert got.keys() == want.keys(), (r, i)
            for n in got:  # bitwise: the heap moves the same bytes, the merges are the same fp32 ops
                assert got[n].dtype == torch.float32 and torch.equal(got[n], want[n]), (world, r, i, n)
    for i, (T, x) in enumerate(cases):  # and both are KCP: within 1e-5 of the fp64 single process
        ref = _reference(x)
        ranks = [o["heap"][i] for o in out]
        for n in ("o", *(f"d{m}" for m in NAMES)):
            assert rel_l2(torch.cat([r[n] for r in ranks], 1).double(), ref[n]) <= 1e-5, (T, n)
        assert rel_l2(ranks[-1]["s"].double(), ref["s"]) <= 1e-5
        if x["h0"] is not None:
            assert rel_l2(ranks[0]["dh0"].double(), ref["dh0"]) <= 1e-5


def _syncs(rank: int, world: int, T: int, x: dict) -> dict[str, dict[str, int]]:
    heap, coll = HeapGather(ShmHeap()), CollectiveGather(None)
    _kcp(rank, world, x, T, heap)  # the buffers' allocation is set-up, not the summary path
    out = {}
    for name, gather in (("heap", heap), ("coll", coll)):
        with HostSyncCounter() as c:
            _kcp(rank, world, x, T, gather)
        out[name] = {f"{kind} {where}": n for (kind, where), n in c.counts.items()}
    with HostSyncCounter() as c:  # the seam alone, both halves of its buffer
        heap.all_gather(torch.randn(B, H, K, V + K))
        heap.all_gather(torch.randn(B, H, K, V + K))
    out["seam"] = {f"{kind} {where}": n for (kind, where), n in c.counts.items()}
    heap.close()
    return out


def test_the_summary_path_makes_no_host_synchronization() -> None:
    """The heap gather adds no ``.item()`` / ``int(t)`` / ``.tolist()`` / ``.cpu()`` to a KCP step: what the heap
    path counts beyond the collectives path (the same metadata check) is only the shm heap's wait reading its
    signal cell (``transport/shm.py``; CPU ranks poll shared memory by design, a CUDA heap waits on the device), and
    nothing in ``comm/cp``."""
    out = dist_run(_syncs, 2, 96, _inputs(96, seed=3, init=False), timeout=120)
    for r, o in enumerate(out):
        heap, coll = collections.Counter(o["heap"]), collections.Counter(o["coll"])
        extra = heap - coll
        assert not coll - heap, (r, o)
        assert all(k.startswith("scalar moonrt/comm/transport/shm.py:") for k in extra), (r, extra)
        assert all(k.startswith("scalar moonrt/comm/transport/shm.py:") for k in o["seam"]), (r, o["seam"])
        assert not [k for k in heap if "moonrt/comm/cp/gather.py" in k], (r, heap)


class _DiesInForward:
    """A ``transition_fn`` (the ops' one) after which CP rank 1 kills itself with ``sig``: after the metadata
    exchange, before it writes its summary, once rank 0 has its own transition (a file in ``report``), so rank 0
    is at or in the heap gather, waiting for rank 1's summary."""

    def __init__(self, sig: int, report: str) -> None:
        self.sig, self.report = sig, report

    def __call__(self, *args: object, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        from moonrt.ops.kda import kda_transition

        out = kda_transition(*args, **kwargs)
        ready = Path(self.report, "rank0_ready")
        if torch.distributed.get_rank() == 0:
            ready.write_text("")
        else:
            deadline = time.monotonic() + 30
            while not ready.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            os.kill(os.getpid(), self.sig)
            time.sleep(30)
        return out


def _victim(rank: int, world: int, sig: int, report: str) -> str:
    gather = build_summary_gather("shm", None)
    Path(report, "prefix").write_text(gather.heap._prefix)
    x = _inputs(64, seed=1, init=False)
    a, b = slice_bounds(64, world, rank)
    slices = [x[n][:, a:b] for n in NAMES]
    kcp_kda(*slices, group=None, gather=gather)  # a whole step first: kernels compiled, the heap buffer allocated
    t0 = time.monotonic()
    try:
        kcp_kda(*slices, group=None, gather=gather, transition_fn=_DiesInForward(sig, report))
    except PeerDied as exc:
        Path(report, f"rank{rank}").write_text(f"{time.monotonic() - t0:.3f}\n{exc}")
        return "named"
    return "not named"


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_rank_killed_in_kcp_is_named_and_nothing_is_left(tmp_path: Path, sig: int) -> None:
    with pytest.raises(RankError) as info:
        run_ranks(_victim, 2, int(sig), str(tmp_path), timeout=60, collective_timeout_s=30)
    assert info.value.rank == 1, info.value
    seconds, line = (tmp_path / "rank0").read_text().split("\n", 1)
    assert float(seconds) < 5.0  # named by the heap's liveness probe, not after the 30 s timeout
    assert line.startswith("shm heap: rank 1 (pid ") and line.endswith("died while rank 0 waited for its signal"), line
    assert _left((tmp_path / "prefix").read_text()) == []


def test_cp_transport_choices_and_one_line_refusals() -> None:
    assert resolve_cp_transport("auto", ["a", "a"], "cpu") == "shm"
    assert resolve_cp_transport("auto", ["a", "b"], "cpu") == "collectives"
    assert resolve_cp_transport("auto", ["a", "a"], "cuda") == "collectives"  # no CUDA heap for KCP
    assert resolve_cp_transport("collectives", ["a"], "cpu") == "collectives"
    assert resolve_cp_transport("shm", ["a", "a"], "cpu") == "shm"
    with pytest.raises(ValueError, match=r"^parallel.cp_transport = 'cuda': KCP's summary gather over torch "
                                         r"symmetric memory is not wired \(unproven without GPUs\); expected auto, "
                                         r"shm or collectives$"):
        resolve_cp_transport("cuda", ["a"], "cuda")
    with pytest.raises(ValueError, match=r"^parallel.cp_transport = 'shm': the group's ranks are on 2 hosts \(a, b\)"):
        resolve_cp_transport("shm", ["a", "b"], "cpu")
    with pytest.raises(ValueError, match=r"^parallel.cp_transport = 'shm': the tensors are on cuda; expected CPU"):
        resolve_cp_transport("shm", ["a"], "cuda")
    assert resolve_cp_transport("auto", ["a", "a"], "cpu", "nccl") == "collectives"  # the heap meets on gloo
    with pytest.raises(ValueError, match=r"^parallel.cp_transport = 'shm': the CP group runs on nccl; expected CPU "
                                         r"ranks on gloo \(the heap's rendezvous runs there\)$"):
        resolve_cp_transport("shm", ["a", "a"], "cpu", "nccl")
    with pytest.raises(ValueError, match=r"^parallel.cp_transport = 'nvlink': expected one of auto, shm, "
                                         r"collectives$"):
        resolve_cp_transport("nvlink", ["a"], "cpu")
