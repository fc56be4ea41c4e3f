"""``moonrt selftest --suite remote``: the activation manager's remote store (K3_SYSTEMS §8), round trip.

Ranks form a ring of remote-offload channels (:mod:`moonrt.memory.remote`): rank r offloads to rank
``r + 1`` (a :class:`RemoteClient`) while serving rank ``r - 1`` (a :class:`RemoteServer` thread), so
every rank exercises both roles at once, each pair over its own two-rank gloo group. Needs 2 ranks.

Checks (``remote/<what>``, on every rank):

- ``activations_exact``: a small MLP's forward under an :class:`ActivationManager` with policy
  ``remote`` (every saved activation stored on the peer) gives gradients bit-identical to policy
  ``keep``; ``bytes_back_equal_bytes_in``: the bytes fetched back equal the bytes sent;
  ``nothing_resident``: no saved bytes stayed on this rank;
- ``roundtrip_<size>``: raw bytes ``get(put(x)) == x`` exactly, per ``--remote-sizes``;
- ``peer_held_all`` / ``peer_freed``: this rank, as the server, held at least the bytes its owner's
  manager sent and holds nothing after the owner stopped.

Measured: put + get round-trip time per size (slowest rank, all ranks at once) and its bandwidth
``2 x size / time``.
"""

from __future__ import annotations

import argparse
import time
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from moonrt.jobs.selftest.common import SuiteResult, byte_sizes, max_over_ranks

if TYPE_CHECKING:
    from moonrt.memory.remote import RemoteClient

TIMEOUT_S = 120.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--remote-sizes", type=byte_sizes, default=(64 << 10, 4 << 20),
                        help="remote suite: bytes per put/get round trip, comma-separated, K/M suffixes "
                             "(default 64K,4M)")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 128), nn.SiLU(), nn.Linear(128, 128))


def _manager_round_trip(res: SuiteResult, client: RemoteClient, rank: int) -> int:
    """Gradients under policy ``remote`` vs ``keep`` on this rank; returns the bytes the manager sent."""
    from moonrt.config import from_dict
    from moonrt.memory.manager import ActivationManager
    from moonrt.memory.policy import MemoryPolicy

    model = _model()
    x = torch.randn(32, 128, generator=torch.Generator().manual_seed(rank + 1), requires_grad=True)
    keep = ActivationManager(model, from_dict(MemoryPolicy, {"default": "keep"}))
    with keep:
        y = model(x).square().sum()
    want = torch.autograd.grad(y, [x, *model.parameters()])
    keep_peak = keep.accounting.peak["device"]
    keep.close()
    sent0, recv0 = client.sent_bytes, client.received_bytes
    mgr = ActivationManager(model, from_dict(MemoryPolicy, {"default": "remote"}), remote=client)
    with mgr:
        y = model(x).square().sum()
    got = torch.autograd.grad(y, [x, *model.parameters()])
    peak = dict(mgr.accounting.peak)
    mgr.close()
    client.flush()
    sent, back = client.sent_bytes - sent0, client.received_bytes - recv0
    res.check("remote/activations_exact", all(torch.equal(a, b) for a, b in zip(got, want)))
    res.check("remote/bytes_back_equal_bytes_in", sent == back and sent == keep_peak > 0, bytes_in=sent,
              bytes_back=back, saved_bytes_keep=keep_peak)
    res.check("remote/nothing_resident", peak.get("device", 0) == 0 and peak.get("remote", 0) == keep_peak,
              peak=peak)
    return sent


def run_suite(args: argparse.Namespace, rank: int, world: int) -> SuiteResult:
    from moonrt.memory.remote import RemoteClient, RemoteServer, make_channel_group

    if world < 2:
        raise ValueError(f"remote suite: world size {world}: expected >= 2 ranks (a rank and its peer)")
    res = SuiteResult()
    groups = [make_channel_group(r, (r + 1) % world) for r in range(world)]  # collective: same order everywhere
    owner = (rank - 1) % world
    server = RemoteServer(owner=owner, group=groups[owner], timeout_s=TIMEOUT_S, idle_timeout_s=10 * TIMEOUT_S)
    server.start()
    client = RemoteClient(peer=(rank + 1) % world, group=groups[rank], timeout_s=TIMEOUT_S)
    try:
        mgr_sent = _manager_round_trip(res, client, rank)
        gen = torch.Generator().manual_seed(rank)
        for n in args.remote_sizes:
            data = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
            key = client.put(data)
            back = client.get(key, n)
            client.free(key)
            res.check(f"remote/roundtrip_{n}", torch.equal(back, data), bytes=n)
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(args.iters):
                key = client.put(data)
                client.get(key, n)
                client.free(key)
            dt = max_over_ranks((time.perf_counter() - t0) / args.iters)
            res.rows.append({"bytes": n, "roundtrip_s": dt, "GBps": 2 * n / dt / 1e9})
    finally:
        client.stop()
        server.join(TIMEOUT_S)
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mgr_sent)
    res.check("remote/peer_held_all", server.peak_bytes >= everyone[owner] > 0, peak=server.peak_bytes,
              owner_sent=everyone[owner], owner=owner)
    res.check("remote/peer_freed", server.held_bytes == 0, held=server.held_bytes)
    res.table = format_table(res.rows, world)
    return res


def format_table(rows: list[dict], world: int) -> str:
    head = f"{'bytes':>10} | {'put+get ms':>10} {'GB/s':>8}"
    lines = [f"moonrt selftest remote: {world} ranks in a ring, each offloading to the next, slowest rank",
             head, "-" * len(head)]
    lines += [f"{r['bytes']:>10d} | {r['roundtrip_s'] * 1e3:>10.3f} {r['GBps']:>8.3f}" for r in rows]
    return "\n".join(lines)
