"""``moonrt selftest --suite kcp``: KCP context-parallel KDA (K3_SYSTEMS §7) checked, then timed per layer.

For every ``T`` tokens per rank (``--kcp-tokens``) and the head shape ``--kcp-shape B x H x K x V``:

1. **check** (float64): every rank draws its own slice of a sequence of ``R T`` tokens (seeded by
   rank), the slices are all-gathered into the whole sequence, and
   :func:`moonrt.comm.cp.kcp.kcp_kda` forward + backward on the slices (initial state on rank 0, final
   state on the last rank) is compared with single-rank :func:`moonrt.ops.kda.kda_chunk` on the
   gathered input: this rank's outputs and its gradients of q, k, v, g, beta (plus the final state
   on the last rank, ``dh0`` on rank 0). Both are float64 evaluations of the same function, so the
   normwise difference must be <= 1e-12 (rounding stays orders below; a wrong state hand-off is
   O(1)). The decay is long-memory (``|g| ~ 1 / (R T)`` per token) so the state crossing ranks matters;
2. **time** (fp32, K3's gate range): ``kcp_kda`` forward + backward of one layer (slowest rank, mean
   of ``--iters``) beside the same rank-local ``kda_chunk`` without communication, and the bytes per
   layer each rank sends and receives (one ``B H K (K + V)`` summary per direction, independent of T).
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from moonrt.jobs.selftest.common import SuiteResult, close, device, positive_ints, timed

F64_RTOL = 1e-12
NAMES = ("q", "k", "v", "g", "beta")


def kcp_shape(text: str) -> tuple[int, int, int, int]:
    """``"1x4x64x64"`` -> ``(B, H, K, V)`` (argparse type)."""
    parts = text.strip().lower().split("x")
    if len(parts) != 4 or not all(p.isdigit() and int(p) >= 1 for p in parts):
        raise argparse.ArgumentTypeError(f"KCP shape {text!r}: expected BxHxKxV with integers >= 1, e.g. 1x4x64x64")
    b, h, k, v = map(int, parts)
    return b, h, k, v


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kcp-tokens", type=positive_ints, default=(128, 512),
                        help="kcp suite: tokens per rank T, comma-separated (default 128,512)")
    parser.add_argument("--kcp-shape", type=kcp_shape, default=(1, 4, 64, 64),
                        help="kcp suite: batch x heads x key dim x value dim (default 1x4x64x64)")


def _slice_inputs(rank: int, T: int, total: int, shape: tuple[int, int, int, int], dtype: torch.dtype,
                  long_memory: bool) -> dict[str, torch.Tensor]:
    """This rank's seeded slice ``[B, T, ...]`` of q, k, v, g, beta and the output gradient ``do``."""
    B, H, K, V = shape
    gen = torch.Generator().manual_seed(1000 + rank)
    rn = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)
    x = {"q": torch.nn.functional.normalize(rn(B, T, H, K), dim=-1),
         "k": torch.nn.functional.normalize(rn(B, T, H, K), dim=-1), "v": rn(B, T, H, V)}
    if long_memory:
        x["g"] = -torch.rand(B, T, H, K, generator=gen, dtype=torch.float64) / total
        x["beta"] = torch.rand(B, T, H, generator=gen, dtype=torch.float64) * min(1.0, K / total)
    else:  # K3's lower-bounded decay, (-5, 0)
        x["g"] = -5.0 * torch.sigmoid(rn(B, T, H, K) - 1.0)
        x["beta"] = torch.sigmoid(rn(B, T, H))
    x["do"] = rn(B, T, H, V)
    return {n: t.to(dtype) for n, t in x.items()}


def check_T(res: SuiteResult, T: int, shape: tuple[int, int, int, int], rank: int, world: int) -> None:
    """The float64 check at ``T`` tokens per rank (see the module docstring); checks ``kcp/T=<T>/<what>``."""
    from moonrt.comm.cp.kcp import kcp_kda
    from moonrt.ops.kda import kda_chunk

    dev = device()
    B, H, K, V = shape
    total = T * world
    mine = {n: t.to(dev) for n, t in _slice_inputs(rank, T, total, shape, torch.float64, True).items()}
    gathered = {}
    for n, t in mine.items():  # the whole sequence, rank slices in order along T
        parts = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(parts, t.contiguous())
        gathered[n] = torch.cat(parts, dim=1)
    gen = torch.Generator().manual_seed(7)
    h0 = (0.5 * torch.randn(B, H, K, V, generator=gen, dtype=torch.float64)).to(dev)
    ds = torch.randn(B, H, K, V, generator=gen, dtype=torch.float64).to(dev)

    leaves = {n: mine[n].clone().requires_grad_() for n in NAMES}
    h0_leaf = h0.clone().requires_grad_() if rank == 0 else None
    o, s = kcp_kda(**leaves, group=None, initial_state=h0_leaf, output_final_state=True)
    loss = (o * mine["do"]).sum()
    if s is not None:
        loss = loss + (s * ds).sum()
    loss.backward()

    ref_leaves = {n: gathered[n].clone().requires_grad_() for n in NAMES}
    ref_h0 = h0.clone().requires_grad_()
    o_ref, s_ref = kda_chunk(**ref_leaves, initial_state=ref_h0, output_final_state=True)
    ((o_ref * gathered["do"]).sum() + (s_ref * ds).sum()).backward()
    a, b = rank * T, (rank + 1) * T
    name = f"kcp/T={T}"
    close(res, f"{name}/output", o, o_ref[:, a:b], F64_RTOL)
    for n in NAMES:
        close(res, f"{name}/grad_{n}", leaves[n].grad, ref_leaves[n].grad[:, a:b], F64_RTOL)
    if rank == world - 1:
        close(res, f"{name}/final_state", s, s_ref, F64_RTOL)
    if rank == 0:
        close(res, f"{name}/grad_h0", h0_leaf.grad, ref_h0.grad, F64_RTOL)


def time_T(T: int, shape: tuple[int, int, int, int], rank: int, world: int, iters: int) -> dict:
    """fp32 ``kcp_kda`` forward + backward of one layer vs the local ``kda_chunk``; bytes per layer."""
    from moonrt.comm.cp.ops import CommRecord
    from moonrt.comm.cp.kcp import kcp_kda
    from moonrt.ops.kda import kda_chunk

    dev = device()
    x = {n: t.to(dev) for n, t in _slice_inputs(rank, T, T * world, shape, torch.float32, False).items()}
    records: list[CommRecord] = []

    def layer(distributed: bool) -> None:
        leaves = {n: x[n].clone().requires_grad_() for n in NAMES}
        if distributed:
            records.append(CommRecord(op="kcp", layer="selftest"))
            o, _ = kcp_kda(**leaves, group=None, record=records[-1])
        else:
            o, _ = kda_chunk(**leaves)
        (o * x["do"]).sum().backward()

    kcp_s = timed(lambda: layer(True), iters)
    local_s = timed(lambda: layer(False), iters)
    rec = records[-1]
    B, H, K, V = shape
    return {"tokens_per_rank": T, "tokens_total": T * world, "B": B, "H": H, "K": K, "V": V,
            "kcp_ms": 1e3 * kcp_s, "local_ms": 1e3 * local_s, "fwd_sent": rec.fwd_sent, "fwd_recv": rec.fwd_recv,
            "bwd_sent": rec.bwd_sent, "bwd_recv": rec.bwd_recv}


def run_suite(args: argparse.Namespace, rank: int, world: int) -> SuiteResult:
    res = SuiteResult()
    for T in args.kcp_tokens:
        check_T(res, T, args.kcp_shape, rank, world)
        res.rows.append(time_T(T, args.kcp_shape, rank, world, args.iters))
    res.table = format_table(res.rows, world)
    return res


def format_table(rows: list[dict], world: int) -> str:
    B, H, K, V = (rows[0][n] for n in "BHKV") if rows else (0, 0, 0, 0)
    head = (f"{'T/rank':>7} {'T total':>8} | {'kcp fwd+bwd ms':>14} {'local ms':>9} | "
            f"{'KB sent fwd':>11} {'bwd':>7} {'KB recv fwd':>11} {'bwd':>7}")
    lines = [f"moonrt selftest kcp: {world} ranks, one KDA layer B={B} H={H} K={K} V={V} fp32, slowest rank "
             "(local = the same slice without communication)", head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['tokens_per_rank']:>7d} {r['tokens_total']:>8d} | "
                     f"{r['kcp_ms']:>14.2f} {r['local_ms']:>9.2f} | "
                     f"{r['fwd_sent'] / 1e3:>11.1f} {r['bwd_sent'] / 1e3:>7.1f} {r['fwd_recv'] / 1e3:>11.1f} "
                     f"{r['bwd_recv'] / 1e3:>7.1f}")
    return "\n".join(lines)
