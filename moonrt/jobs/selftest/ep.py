"""``moonrt selftest --suite ep``: MoonEP dispatch -> expert -> combine beside the plain all-to-all.

For every shape ``(s tokens per rank, hidden H, top-k, experts E)`` and routing skew ``maxvio``
(expert 0, homed on rank 0, gets ``(1 + maxvio)`` x the mean load; the others share the rest), the
:class:`~moonrt.comm.ep.dispatch.EPDispatcher` with either placement policy
(:class:`~moonrt.comm.ep.placement.MoonEPPlacement`, :class:`~moonrt.comm.ep.placement.HomePlacement`):

1. **check** one fp32 forward + backward through SiTU-GLU experts (E/R homed per rank, MoonEP's
   slot copies prefetched) on every rank against :func:`moonrt.ops.grouped.moe_reference` run in
   float64 on the seeded problem (every rank holds the routing and expert weights of all ranks,
   rebuilds any rank's tokens from that rank's seed, and runs the reference on its own tokens; the
   expert-weight gradients are the float64 partials summed over ranks). ``--ep-ffn`` (F) only sizes
   these experts and the prefetched copies: keep it small at large H and E, every rank holds
   ``3 E F H`` fp32 weights:

   - ``rows``: the received rows, their router weights and segment bounds equal
     :func:`~moonrt.comm.ep.ref.rows_reference` exactly (a transport moves bits, it must not round);
   - ``balance`` (MoonEP): this rank computes exactly ``floor``/``ceil`` of ``R s k / R`` rows;
   - ``output``, ``grad_x``, ``grad_weights``, ``grad_experts``: normwise error
     ``max|got - ref| / max|ref| <= 2 c eps32`` with ``c`` the reduction lengths of the chain
     (``H + F + k`` forward, twice that backward, plus the ``R s`` token rows an expert-weight
     gradient sums): two roundings of the same function, each within ``c eps32``;

2. **time** ``--iters`` forward calls (identity expert): dispatch, slot prefetch and combine, each
   phase started together on every rank (barrier) and the slowest rank's mean reported; off-rank
   bytes per rank (tokens + router weights in dispatch, rows back in combine, expert weights in
   prefetch), achieved bandwidth ``max-rank (dispatch + combine) bytes / (dispatch + combine) time``,
   and rows per rank max/mean.

Test hook: ``MOONRT_SELFTEST_CORRUPT=RANK:CHECK`` (read only here) makes rank ``RANK`` perturb the
rows it receives (``dispatch``: the expert input rows; ``combine``: the rows combined into its
output) by adding 1 to the first row, as a broken transport would; the suite must then fail naming
that rank and check. ``RANK:pp`` perturbs the pp suite's executor receives instead (:mod:`.selftest_pp`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from moonrt.jobs.selftest.common import EPS32, SuiteResult, close, device, max_over_ranks, normwise_err, sync

CORRUPT_ENV = "MOONRT_SELFTEST_CORRUPT"
CORRUPTIBLE = ("dispatch", "combine", "pp")
"""``pp``: read by :mod:`.selftest_pp` (every tensor its pipeline executor receives)."""
IMPLS = ("alltoall", "moonep")
ACT = "situ"
"""The experts' GLU activation (K3's SiTU-GLU, :mod:`moonrt.ops.grouped`)."""


@dataclasses.dataclass(frozen=True, slots=True)
class EPShape:
    """One EP configuration: ``tokens`` per rank (s), ``hidden`` (H), ``top_k`` (k), ``experts`` (E)."""

    tokens: int
    hidden: int
    top_k: int
    experts: int

    @property
    def label(self) -> str:
        return f"{self.tokens}x{self.hidden}x{self.top_k}x{self.experts}"


def ep_shapes(text: str) -> tuple[EPShape, ...]:
    """``"256x128x2x64,512x128x4x128"`` (s x H x k x E per item) -> shapes (argparse type)."""
    out = []
    for item in text.split(","):
        parts = item.strip().lower().split("x")
        if len(parts) != 4 or not all(p.isdigit() and int(p) >= 1 for p in parts):
            raise argparse.ArgumentTypeError(f"EP shape {item.strip()!r}: expected TOKENSxHIDDENxTOPKxEXPERTS "
                                             "with integers >= 1, e.g. 256x128x2x64")
        s, h, k, e = map(int, parts)
        if k > e:
            raise argparse.ArgumentTypeError(f"EP shape {item.strip()!r}: top-k {k} > experts {e}")
        out.append(EPShape(s, h, k, e))
    return tuple(out)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from moonrt.jobs.selftest.common import nonneg_floats, positive_ints

    parser.add_argument("--ep-shapes", type=ep_shapes, default=ep_shapes("256x128x2x64,128x256x4x128"),
                        help="ep suite: TOKENSxHIDDENxTOPKxEXPERTS per rank, comma-separated "
                             "(default 256x128x2x64,128x256x4x128)")
    parser.add_argument("--ep-maxvio", type=nonneg_floats, default=(0.0, 1.0, 4.0, 16.0),
                        help="ep suite: routing skews, max expert load / mean - 1 (default 0,1,4,16)")
    parser.add_argument("--ep-ffn", type=positive_ints, default=(64,),
                        help="ep suite: expert FFN width F of the checked GLU experts (default 64)")


def validate(args: argparse.Namespace) -> None:
    """Raise ValueError naming the first (shape, maxvio) no routing can realise."""
    for shape in args.ep_shapes:
        for level in args.ep_maxvio:
            hot_load(shape, level)


def corruption(environ: Mapping[str, str] = os.environ) -> tuple[int, str] | None:
    """The test hook ``MOONRT_SELFTEST_CORRUPT=RANK:CHECK`` as ``(rank, check)``; None when unset."""
    spec = environ.get(CORRUPT_ENV, "").strip()
    if not spec:
        return None
    rank, _, check = spec.partition(":")
    if not rank.isdigit() or check not in CORRUPTIBLE:
        raise ValueError(f"{CORRUPT_ENV} = {spec!r}: expected RANK:CHECK with CHECK one of "
                         f"{', '.join(CORRUPTIBLE)} (e.g. 1:dispatch)")
    return int(rank), check


# ---------------------------------------------------------------------------------------------
# The problem


def hot_load(shape: EPShape, maxvio: float) -> int:
    """Assignments per rank of the hot expert 0 for ``maxvio`` (raises when more than s)."""
    s, k, E = shape.tokens, shape.top_k, shape.experts
    hot = round((1 + maxvio) * s * k / E)
    if hot > s:
        raise ValueError(f"--ep-maxvio {maxvio:g} with --ep-shapes {shape.label}: expert 0 would need {hot} > "
                         f"s = {s} assignments per rank; expected maxvio <= E/k - 1 = {E / k - 1:g}")
    return hot


def skewed_routing(world: int, shape: EPShape, maxvio: float, seed: int) -> list[torch.Tensor]:
    """Per-rank ``topk_ids [s, k]`` int64 whose global loads have the given maxvio (up to rounding).

    Each rank routes the same counts (expert 0: :func:`hot_load`, the others the rest evenly),
    written column-major into ``[s, k]`` (keeps each token's k experts distinct, as no expert has
    more than s assignments), then its tokens are shuffled with a rank-dependent permutation.
    """
    s, k, E = shape.tokens, shape.top_k, shape.experts
    hot = hot_load(shape, maxvio)
    rest = s * k - hot
    counts = [hot] + [rest // (E - 1) + (i < rest % (E - 1)) for i in range(E - 1)] if E > 1 else [hot]
    order = sorted(range(E), key=lambda e: -counts[e])
    seq = torch.cat([torch.full((counts[e],), e, dtype=torch.int64) for e in order])
    ids = seq.view(k, s).t().contiguous()
    g = torch.Generator().manual_seed(seed)
    return [ids[torch.randperm(s, generator=g)] for _ in range(world)]


def source_tokens(shape: EPShape, src: int, seed: int = 0) -> torch.Tensor:
    """``[s, H]`` fp32 tokens of rank ``src`` (seeded by rank: any rank can rebuild any other's)."""
    return torch.randn(shape.tokens, shape.hidden, generator=torch.Generator().manual_seed(7919 * seed + 2 * src + 1))


def make_problem(world: int, rank: int, shape: EPShape, ffn: int, maxvio: float, seed: int = 0) -> dict:
    """This rank's view of the seeded problem: its tokens ``x [s, H]`` and output gradient
    ``gout [s, H]``; every rank's ``ids [s, k]`` and router weights ``ws [s, k]`` (rows sum to 1;
    small); all ``experts``: ``[E, F, H]`` x2 and ``[E, H, F]`` scaled to unit gain. fp32 on CPU. Other
    ranks' tokens are rebuilt one at a time by :func:`source_tokens` (memory O(s H), not O(R s H))."""
    s, H, k, E = shape.tokens, shape.hidden, shape.top_k, shape.experts
    g = torch.Generator().manual_seed(seed)
    ws = [torch.rand(s, k, generator=g) + 0.1 for _ in range(world)]
    experts = [torch.randn(E, ffn, H, generator=g) * H ** -0.5, torch.randn(E, ffn, H, generator=g) * H ** -0.5,
               torch.randn(E, H, ffn, generator=g) * ffn ** -0.5]
    gout = torch.randn(s, H, generator=torch.Generator().manual_seed(7919 * seed + 2 * rank + 2))
    return {"x": source_tokens(shape, rank, seed), "gout": gout, "ids": skewed_routing(world, shape, maxvio, seed + 1),
            "ws": [w / w.sum(1, keepdim=True) for w in ws], "experts": experts, "seed": seed}


def reference(p: dict, rank: int, world: int) -> dict:
    """This rank's float64 :func:`~moonrt.ops.grouped.moe_reference`: output ``out``, gradients ``gx``,
    ``gw`` of its tokens, and ``gexperts``: the gradients of its home experts ``[E/R, ...]`` from every
    rank's tokens (each rank's float64 partial over its own tokens, summed over ranks by one
    all-to-all; the sum is in float64, so it adds no error the tolerance must cover)."""
    from moonrt.ops.grouped import moe_reference

    dev = device()
    x = p["x"].double().requires_grad_()
    w = p["ws"][rank].double().requires_grad_()
    experts = [t.double().requires_grad_() for t in p["experts"]]
    per_expert = [t.unbind(0) for t in experts]  # w[e] of a tuple: one gradient node per stack, not E full-size ones
    w_gate, w_up, w_down = per_expert
    out = moe_reference(x, p["ids"][rank], w, w_gate, w_up, w_down, act=ACT)
    (out * p["gout"].double()).sum().backward()
    partial = torch.cat([t.grad.reshape(world, -1) for t in experts], dim=1).to(dev)  # row d: rank d's experts
    summed = torch.empty_like(partial)
    if world > 1:
        dist.all_to_all_single(summed, partial)
    else:
        summed.copy_(partial)
    flat = summed.sum(0).cpu()
    per = p["experts"][0].shape[0] // world
    sizes = [t[:per].numel() for t in experts]
    home = [piece.view(per, *t.shape[1:]) for piece, t in zip(flat.split(sizes), experts)]
    return {"out": out.detach(), "gx": x.grad, "gw": w.grad, "gexperts": home}


def _dispatcher(impl: str, shape: EPShape):
    from moonrt.comm.ep.dispatch import EPDispatcher
    from moonrt.comm.ep.placement import placement_policy

    return EPDispatcher(None, capacity=shape.tokens, hidden=shape.hidden, top_k=shape.top_k,
                        num_experts=shape.experts, placement=placement_policy(impl))


def _bump(t: torch.Tensor) -> torch.Tensor:
    """``t`` with 1 added to its first row (differentiable; unchanged when it has no rows)."""
    if not t.shape[0]:
        return t
    bump = torch.zeros_like(t)
    bump[0] = 1.0
    return t + bump


# ---------------------------------------------------------------------------------------------
# Check and timing of one case


def check_case(res: SuiteResult, name: str, impl: str, p: dict, ref: dict, shape: EPShape, rank: int,
               world: int, corrupt: tuple[int, str] | None) -> None:
    """Forward + backward of ``impl`` on this rank's slice of ``p``; record the checks under ``name``."""
    from moonrt.comm.ep.ref import rows_reference
    from moonrt.ops.grouped import grouped_glu_experts

    dev = device()
    per = shape.experts // world
    disp = _dispatcher(impl, shape)
    x = p["x"].to(dev, copy=True).requires_grad_()
    w = p["ws"][rank].to(dev, copy=True).requires_grad_()
    home = [t[rank * per:(rank + 1) * per].to(dev, copy=True).requires_grad_() for t in p["experts"]]
    recv_x, recv_w, cu, h = disp.dispatch(x, p["ids"][rank].to(dev), w)
    if corrupt == (rank, "dispatch"):
        recv_x = _bump(recv_x)
    rows, cu_ref = rows_reference(p["ids"], torch.as_tensor(h.plan.alloc), torch.as_tensor(h.plan.copies), rank)
    want_x = torch.zeros(len(rows), shape.hidden)
    for src in range(world):  # rebuild each sender's tokens in turn and pick the rows it sent here
        mine = [(i, t) for i, (r, t, _) in enumerate(rows) if r == src]
        if mine:
            pos, tok = torch.tensor(mine).t()
            want_x[pos] = (p["x"] if src == rank else source_tokens(shape, src, p["seed"]))[tok]
    want_w = torch.tensor([float(p["ws"][src][t, j]) for src, t, j in rows], dtype=torch.float32)
    got_x, got_w = recv_x.detach().cpu(), recv_w.detach().cpu().float()
    same_x = got_x.shape == want_x.shape and torch.equal(got_x, want_x)
    bad_rows = [] if same_x or got_x.shape != want_x.shape else \
        (got_x != want_x).any(1).nonzero().flatten()[:5].tolist()
    res.check(f"{name}/rows", same_x and torch.equal(got_w, want_w) and cu.tolist() == cu_ref,
              rows=int(got_x.shape[0]), expected_rows=len(rows), first_bad_rows=bad_rows,
              weights_equal=bool(torch.equal(got_w, want_w)), segments_equal=cu.tolist() == cu_ref)
    if impl == "moonep":
        total = shape.tokens * shape.top_k * world
        want = total // world + (rank < total % world)
        res.check(f"{name}/balance", h.rows == want, rows=h.rows, expected=want)
    slots = disp.prefetch_weights(h, home)
    y = torch.cat([grouped_glu_experts(recv_x[:h.home_rows], h.home_cu_seqlens(), home[0], home[1], home[2], act=ACT),
                   grouped_glu_experts(recv_x[h.home_rows:], h.slot_cu_seqlens(), slots[0], slots[1], slots[2],
                                       act=ACT)])
    out = disp.combine(y, h)
    if corrupt == (rank, "combine"):
        out = _bump(out)
    (out * p["gout"].to(dev)).sum().backward()
    H, F, k = shape.hidden, p["experts"][0].shape[1], shape.top_k
    c = H + F + k
    close(res, f"{name}/output", out, ref["out"], 2 * c * EPS32)
    close(res, f"{name}/grad_x", x.grad, ref["gx"], 2 * 2 * c * EPS32)
    close(res, f"{name}/grad_weights", w.grad, ref["gw"], 2 * 2 * c * EPS32)
    ce = 2 * c + shape.tokens * world
    errs = [normwise_err(torch.zeros_like(t) if t.grad is None else t.grad, r)
            for t, r in zip(home, ref["gexperts"])]
    res.check(f"{name}/grad_experts", max(errs) <= 2 * ce * EPS32, error=max(errs), tol=2 * ce * EPS32)


def time_case(impl: str, p: dict, shape: EPShape, rank: int, world: int, iters: int) -> dict:
    """Forward dispatch / prefetch / combine (identity expert) timed over ``iters`` calls after one warm-up."""
    dev = device()
    per = shape.experts // world
    disp = _dispatcher(impl, shape)
    x, ids, w = p["x"].to(dev), p["ids"][rank].to(dev), p["ws"][rank].to(dev)
    home = [t[rank * per:(rank + 1) * per].to(dev) for t in p["experts"]]
    spent = torch.zeros(3, dtype=torch.float64)
    sent = torch.zeros(3, dtype=torch.float64)  # off-rank bytes: dispatch, combine, prefetch

    def off_rank(counter: list[int]) -> int:
        return sum(n for d, n in enumerate(counter) if d != rank)

    with torch.no_grad():
        for it in range(1 + iters):
            tok0 = off_rank(disp.counters.token_bytes_sent)
            wgt0 = off_rank(disp.counters.weight_bytes_sent)
            phase = []
            dist.barrier()
            t0 = time.perf_counter()
            recv_x, _, _, h = disp.dispatch(x, ids, w)
            sync(dev)
            phase.append(time.perf_counter() - t0)
            tok1 = off_rank(disp.counters.token_bytes_sent)
            dist.barrier()
            t0 = time.perf_counter()
            disp.prefetch_weights(h, home)
            sync(dev)
            phase.append(time.perf_counter() - t0)
            dist.barrier()
            t0 = time.perf_counter()
            disp.combine(recv_x, h)
            sync(dev)
            phase.append(time.perf_counter() - t0)
            if it:  # after the warm-up
                d, pf, cb = phase
                spent += torch.tensor([d, cb, pf], dtype=torch.float64)
                sent += torch.tensor([tok1 - tok0, off_rank(disp.counters.token_bytes_sent) - tok1,
                                      off_rank(disp.counters.weight_bytes_sent) - wgt0], dtype=torch.float64)
    spent /= iters
    sent /= iters
    times = [max_over_ranks(float(t)) for t in spent]
    every = [None] * world
    dist.all_gather_object(every, sent.tolist())
    rows = [int(r) for r in disp.last_rows.tolist()]
    nbytes = torch.tensor(every, dtype=torch.float64).view(world, 3)
    busiest = float((nbytes[:, 0] + nbytes[:, 1]).max())
    return {"impl": impl, "rows": rows, "rows_max_over_mean": max(rows) / (sum(rows) / world) if sum(rows) else 1.0,
            "dispatch_ms": 1e3 * times[0], "combine_ms": 1e3 * times[1], "prefetch_ms": 1e3 * times[2],
            "dispatch_bytes_max": float(nbytes[:, 0].max()), "dispatch_bytes_mean": float(nbytes[:, 0].mean()),
            "combine_bytes_max": float(nbytes[:, 1].max()), "combine_bytes_mean": float(nbytes[:, 1].mean()),
            "prefetch_bytes_max": float(nbytes[:, 2].max()), "prefetch_bytes_mean": float(nbytes[:, 2].mean()),
            "algbw_GBps": busiest / max(times[0] + times[1], 1e-12) / 1e9}


# ---------------------------------------------------------------------------------------------
# The suite


def run_suite(args: argparse.Namespace, rank: int, world: int) -> SuiteResult:
    res = SuiteResult()
    corrupt = corruption()
    skipped = []
    for shape in args.ep_shapes:
        if shape.experts % world:
            skipped.append(f"{shape.label}: E = {shape.experts} is not a multiple of the world size {world}")
            continue
        for ffn in args.ep_ffn:
            for level in args.ep_maxvio:
                p = make_problem(world, rank, shape, ffn, level)
                ref = reference(p, rank, world)
                load = torch.bincount(torch.cat(p["ids"]).flatten(), minlength=shape.experts).double()
                case = {"shape": shape.label, "tokens": shape.tokens, "hidden": shape.hidden, "top_k": shape.top_k,
                        "experts": shape.experts, "ffn": ffn, "maxvio": level,
                        "measured_maxvio": float(load.max() / load.mean() - 1)}
                for impl in IMPLS:
                    name = f"ep/{impl}/{shape.label}/F{ffn}/maxvio={level:g}"
                    check_case(res, name, impl, p, ref, shape, rank, world, corrupt)
                    res.rows.append({**case, **time_case(impl, p, shape, rank, world, args.iters)})
    res.extra["skipped"] = skipped
    if skipped and not res.checks:  # nothing ran: the suite says why (moonrt selftest reports it SKIPPED, not passed)
        res.extra["skip_reason"] = f"no --ep-shapes shape fits {world} ranks (" + "; ".join(skipped) + ")"
    res.table = format_table(res.rows, world, skipped)
    return res


def format_table(rows: Sequence[dict], world: int, skipped: Sequence[str] = ()) -> str:
    """MoonEP beside all-to-all, one line per (shape, F, maxvio): rows max/mean, ms, MB/rank, GB/s, prefetch."""
    lines = [f"moonrt selftest ep: {world} ranks, forward per call, slowest rank (a2a = plain all-to-all)",
             f"{'s x H x k x E':>16} {'maxvio':>6} | {'rows max/mean':>15} | {'dispatch ms':>15} | "
             f"{'combine ms':>15} | {'MB/rank max':>15} | {'GB/s':>13} | {'prefetch':>15}",
             f"{'':>16} {'':>6} | {'a2a':>7} {'moonep':>7} | {'a2a':>7} {'moonep':>7} | {'a2a':>7} {'moonep':>7} | "
             f"{'a2a':>7} {'moonep':>7} | {'a2a':>6} {'moonep':>6} | {'MB':>7} {'ms':>7}"]
    lines.append("-" * len(lines[1]))
    pairs: dict[tuple, dict[str, dict]] = {}
    for row in rows:
        pairs.setdefault((row["shape"], row["ffn"], row["maxvio"]), {})[row["impl"]] = row
    for (shape, _ffn, level), both in pairs.items():
        a, m = both.get("alltoall"), both.get("moonep")
        if a is None or m is None:
            continue
        mb = lambda r: (r["dispatch_bytes_max"] + r["combine_bytes_max"]) / 1e6
        lines.append(f"{shape:>16} {level:>6g} | {a['rows_max_over_mean']:>7.3f} {m['rows_max_over_mean']:>7.3f} | "
                     f"{a['dispatch_ms']:>7.2f} {m['dispatch_ms']:>7.2f} | {a['combine_ms']:>7.2f} "
                     f"{m['combine_ms']:>7.2f} | {mb(a):>7.3f} {mb(m):>7.3f} | {a['algbw_GBps']:>6.3f} "
                     f"{m['algbw_GBps']:>6.3f} | {m['prefetch_bytes_max'] / 1e6:>7.3f} {m['prefetch_ms']:>7.2f}")
    lines += [f"skipped {s}" for s in skipped]
    return "\n".join(lines)
