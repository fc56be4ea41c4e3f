"""Remote offload on 2 gloo ranks (K3_SYSTEMS §8): rank 0's saved tensors live in rank 1's memory."""

from __future__ import annotations

import torch
import torch.distributed as dist
from dist import dist_run
from torch import nn

from moonrt.config import from_dict
from moonrt.memory.manager import ActivationManager
from moonrt.memory.policy import MemoryPolicy
from moonrt.memory.remote import RemoteClient, RemoteServer, make_channel_group


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 128), nn.SiLU(), nn.Linear(128, 128))


def _recording_p2p() -> list[list[tuple[str, int]]]:
    """Wrap ``dist.batch_isend_irecv`` in this rank's process: each call logged as its ops' (direction, bytes)."""
    log: list[list[tuple[str, int]]] = []
    real = dist.batch_isend_irecv

    def batch(ops: list) -> list:
        log.append([("send" if op.op is dist.isend else "recv", op.tensor.numel() * op.tensor.element_size())
                    for op in ops])
        return real(ops)

    dist.batch_isend_irecv = batch
    return log


def _remote_worker(rank: int, world_size: int, policy_name: str) -> dict:
    group = make_channel_group(0, 1)
    p2p = _recording_p2p()
    if rank == 1:
        server = RemoteServer(owner=0, group=group, timeout_s=30, idle_timeout_s=60).start()
        server.join(90)
        return {"peak": server.peak_bytes, "held_after": server.held_bytes, "requests": server.requests, "p2p": p2p}
    model = _model()
    x = torch.randn(32, 128, generator=torch.Generator().manual_seed(1), requires_grad=True)
    ref = torch.autograd.grad(model(x).square().sum(), [x, *model.parameters()])
    keep = ActivationManager(model, from_dict(MemoryPolicy, {"default": "keep"}))
    with keep:
        y = model(x).square().sum()
    y.backward()
    keep_peak = keep.accounting.peak["device"]
    keep.close()
    client = RemoteClient(peer=1, group=group, timeout_s=30)
    mgr = ActivationManager(model, from_dict(MemoryPolicy, {"default": policy_name}), remote=client)
    for p in model.parameters():
        p.grad = None
    with mgr:
        y = model(x).square().sum()
    got = torch.autograd.grad(y, [x, *model.parameters()])
    acc = mgr.accounting
    mgr.close()
    client.stop()
    exact = all(torch.equal(a, b) for a, b in zip(got, ref))
    err = max(float((a - b).norm() / b.norm()) for a, b in zip(got, ref))
    return {"exact": exact, "err": err, "keep_peak": keep_peak, "peak": dict(acc.peak),
            "sent": client.sent_bytes, "received": client.received_bytes, "p2p": p2p}


def _check_p2p_order(owner: dict, peer: dict) -> None:
    """Every message a one-op ``batch_isend_irecv`` group (what NCCL needs), the two sides' groups matching one to one
    in order: a send of n bytes on one side is the receive of n bytes on the other."""
    flip = {"send": "recv", "recv": "send"}
    assert owner["p2p"] and all(len(ops) == 1 for ops in owner["p2p"] + peer["p2p"])
    assert [[(flip[d], n) for d, n in ops] for ops in owner["p2p"]] == peer["p2p"]


def test_remote_offload_two_ranks_exact():
    owner, peer = dist_run(_remote_worker, 2, "remote", timeout=120)
    assert owner["exact"]
    assert owner["keep_peak"] > 0 and owner["peak"]["device"] == 0  # rank 0's resident saved bytes drop
    assert owner["peak"]["remote"] == owner["keep_peak"]
    assert peer["peak"] == owner["keep_peak"] == owner["sent"]  # rank 1 held them all
    assert peer["held_after"] == 0  # freed after backward
    assert owner["received"] == owner["sent"]
    _check_p2p_order(owner, peer)


def test_remote_fp8_composition_two_ranks():
    owner, peer = dist_run(_remote_worker, 2, "fp8+remote", timeout=120)
    assert owner["err"] < 0.05 and owner["peak"]["device"] == 0
    assert 3.5 < owner["keep_peak"] / peer["peak"] < 4.0  # fp32 -> FP8 on the peer
    _check_p2p_order(owner, peer)
