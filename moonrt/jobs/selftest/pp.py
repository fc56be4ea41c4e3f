"""``moonrt selftest --suite pp``: the pipeline executor (K3_SYSTEMS §9) checked on real ranks, then timed.

The runtime may not import the model (layering), so the suite builds its own stand-in: a tiny Block
AttnRes stack (:class:`TinyStack`, float64) exposing exactly the stage API
:class:`moonrt.comm.pp.part.PipelineParallel` and :class:`moonrt.comm.pp.executor.PipelineExecutor` use
(``config``, ``stages``, ``stage_modules``, ``stream``, ``embed_tokens``, ``run_layers``, ``head``). Its
layers mix every finished block and the open partial block (softmax over the sources with per-layer
pseudo-queries shared by every stage), so a wrong or missing block changes the loss and every gradient.
The ranks form one pipeline (``pp`` = world size).

1. **hops** (``pp/hop/<bytes>/payload``): the executor's own point-to-point primitives between
   pipeline neighbours (forward hop ``r -> r+1`` then backward hop ``r+1 -> r``, executor tags), each
   received payload equal bit for bit to the sender's (regenerated from its seed); then the time of
   one forward + backward round over every link at once (slowest rank) and ``2 x bytes / time``.
2. **schedules** (``pp/<schedule>/<mode>/...``): 1F1B (``vpp`` 1) in cached mode and interleaved
   (``vpp`` 2) in cached and naive mode over ``3 pp vpp`` layers in AttnRes blocks of 2 (cuts fall
   inside blocks, so hops carry a partial block too). Checks on every rank:
   ``hop_counts``: the blocks this rank sent on each hop equal
   :func:`moonrt.scheduler.attnres_comm.hop_plan`'s ``sends`` times the micro-batches;
   ``blocks_exact``: every stage starts from exactly the blocks (and partial block) its upstream stage
   ended with, compared bit for bit after the hop (on a cross-rank hop: the blocks the hop carried);
   ``loss`` and ``grads``: the pipeline's loss and this rank's parameter gradients (shared
   pseudo-queries summed over the pipeline) vs the single-rank
   float64 computation of the whole batch. Then the step time (slowest rank) and the bytes moved.

Tolerances: the gradients are float64 on both sides and differ only in summation order (micro-batch
partial sums, per-block accumulation), normwise error <= n eps64 kappa with n <= B T terms per sum and
a conditioning kappa well below 1e3 for this well-scaled stack: ``GRAD_TOL = 1e3 * B T * eps64``. The
executor returns the loss in fp32 (each micro-batch's rounded, summed, then all-reduced over the pp
ranks): relative error <= (M + pp + 1) eps32.

Test hook: ``MOONRT_SELFTEST_CORRUPT=RANK:pp`` makes rank ``RANK`` add 1 to the first element of every
tensor its executor receives (a broken transport): its ``payload`` and ``blocks_exact`` checks fail.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from moonrt.comm.pp.cache import block_plan
from moonrt.comm.pp.executor import PipelineExecutor, StepStats
from moonrt.comm.pp.idle import IdleClock
from moonrt.comm.pp.part import PipelineParallel
from moonrt.jobs.selftest.common import EPS32, SuiteResult, byte_sizes, device, normwise_err, timed
from moonrt.parallel.model import PipelineLayout, trainable
from moonrt.scheduler.attnres_comm import hop_plan
from moonrt.scheduler.pipeline import build_schedule

EPS64 = float(torch.finfo(torch.float64).eps)
BLOCK, VOCAB, WIDTH, MB_BATCH, SEQ = 2, 32, 16, 2, 8
GRAD_TOL = 1e3 * MB_BATCH * SEQ * EPS64
CASES = (("1f1b", 1, "cached"), ("interleaved", 2, "cached"), ("interleaved", 2, "naive"))
"""(schedule, vpp, AttnRes mode) run end to end."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pp-sizes", type=byte_sizes, default=(64 << 10, 1 << 20, 4 << 20),
                        help="pp suite: bytes per pipeline hop, comma-separated, K/M suffixes (default 64K,1M,4M)")


# ---------------------------------------------------------------------------------------------
# The stand-in model (stage API of the pipeline executor; pure torch)


@dataclasses.dataclass(frozen=True, slots=True)
class TinyConfig:
    """The stand-in's shape (:meth:`TinyStack.pipeline_layout` gives it to :class:`PipelineParallel`)."""

    num_hidden_layers: int
    attn_res_block_size: int = BLOCK
    hidden_size: int = WIDTH
    vocab_size: int = VOCAB
    tie_word_embeddings: bool = False


@dataclasses.dataclass
class TinyStream:
    """The stream between stages: finished ``blocks`` ``[B, T, D]`` and the open ``partial`` block (or None)."""

    blocks: list[torch.Tensor]
    partial: torch.Tensor | None = None


class _Queries(nn.Module):
    """The AttnRes pseudo-queries ``[L + 1, D]`` (one per layer, one for the head), used by every stage."""

    def __init__(self, n: int, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n, d) / d ** 0.5)


class TinyStack(nn.Module):
    """``L`` residual layers in AttnRes blocks of ``BLOCK``: layer i reads a softmax mix of the sources."""

    def __init__(self, cfg: TinyConfig, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.config = cfg
        d, n = cfg.hidden_size, cfg.num_hidden_layers
        self.embed = nn.Embedding(cfg.vocab_size, d)
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(n))
        self.attn_res = _Queries(n + 1, d)
        self.norm = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, cfg.vocab_size, bias=False)
        self.trace: dict[tuple[int, int], dict[str, Any]] | None = None
        self.where: tuple[int, int] = (-1, -1)

    def pipeline_layout(self) -> PipelineLayout:
        c = self.config
        return PipelineLayout(num_layers=c.num_hidden_layers, width=c.hidden_size, block_size=c.attn_res_block_size,
                              tied_embeddings=c.tie_word_embeddings)

    def stages(self, num_stages: int) -> list[range]:
        n = self.config.num_hidden_layers
        cuts = [i * n // num_stages for i in range(num_stages + 1)]
        return [range(cuts[i], cuts[i + 1]) for i in range(num_stages)]

    def stage_modules(self, layers: range, first: bool, last: bool) -> list[str]:
        return ["attn_res"] + [f"layers.{i}" for i in layers] + (["embed"] if first else []) + (
            ["norm", "lm_head"] if last else [])

    @staticmethod
    def stream(blocks: list[torch.Tensor], partial: torch.Tensor | None = None) -> TinyStream:
        return TinyStream(list(blocks), partial)

    def embed_tokens(self, tokens: torch.Tensor) -> TinyStream:
        return TinyStream([self.embed(tokens)])

    def _mix(self, i: int, state: TinyStream) -> torch.Tensor:
        src = torch.stack(state.blocks + ([state.partial] if state.partial is not None else []))  # [S, B, T, D]
        w = torch.einsum("sbtd,d->sbt", F.rms_norm(src, (src.shape[-1],)), self.attn_res.weight[i]).softmax(0)
        return torch.einsum("sbt,sbtd->btd", w, src)

    def run_layers(self, state: TinyStream, layers: range, ctx: Any = None) -> TinyStream:
        if self.trace is not None:
            self.trace[self.where] = {"in": [b.detach().clone() for b in state.blocks],
                                      "in_partial": None if state.partial is None else state.partial.detach().clone()}
        n = self.config.num_hidden_layers
        for i in layers:
            out = torch.tanh(self.layers[i](self._mix(i, state)))
            state.partial = out if state.partial is None else state.partial + out
            if (i + 1) % self.config.attn_res_block_size == 0 or i == n - 1:
                state.blocks.append(state.partial)
                state.partial = None
        if self.trace is not None:
            self.trace[self.where].update(out=[b.detach().clone() for b in state.blocks],
                                          out_partial=None if state.partial is None else state.partial.detach().clone())
        return state

    def head(self, state: TinyStream) -> torch.Tensor:
        return self.lm_head(self.norm(self._mix(self.config.num_hidden_layers, state)))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.run_layers(self.embed_tokens(tokens), range(self.config.num_hidden_layers)))


# ---------------------------------------------------------------------------------------------
# Hooks on an executor (tracing the stage being run; the corruption test hook)


def _traced(ex: PipelineExecutor, model: TinyStack) -> None:
    forward = ex._f

    def f(s: int, mb: int) -> None:
        model.where = (s, mb)
        forward(s, mb)

    ex._f = f


def _corrupt(ex: PipelineExecutor) -> None:
    """Every received tensor gets +1 on its first element, as a broken transport would."""
    recv: Callable[..., list[torch.Tensor]] = ex._recv_wait

    def corrupted(*args: Any) -> list[torch.Tensor]:
        bufs = recv(*args)
        with torch.no_grad():
            for b in bufs:
                b.view(-1)[0] += 1
        return bufs

    ex._recv_wait = corrupted


# ---------------------------------------------------------------------------------------------
# 1. hops between pipeline neighbours


def _payload(src: int, n: int, backward: bool, dev: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(1_000_003 * src + 2 * n + int(backward))
    return torch.randn(n, generator=g, dtype=torch.float32).to(dev)


def _round_trip(ex: PipelineExecutor, rank: int, world: int, fwd: torch.Tensor,
                bwd: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Forward hop ``r -> r+1`` then backward hop ``r+1 -> r`` on every link; returns what arrived (or None).

    Two ``batch_isend_irecv`` groups per rank, as the executor issues them: (send forward, receive forward), then
    (send backward, receive backward); each link's two ranks meet in the same group, in the same order (NCCL)."""
    got_f = got_b = None
    _, recv = ex._exchange([([fwd], rank, 0, False, rank + 1)] if rank + 1 < world else [],
                           [(1, rank - 1, 0, False, rank - 1, "RECV_F of the hop check")] if rank > 0 else [])
    if rank > 0:
        got_f = ex._recv_wait(recv[0])[0]
    _, recv = ex._exchange([([bwd], rank - 1, 0, True, rank - 1)] if rank > 0 else [],
                           [(1, rank, 0, True, rank + 1, "RECV_B of the hop check")] if rank + 1 < world else [])
    if rank + 1 < world:
        got_b = ex._recv_wait(recv[0])[0]
    for w, _, peer in ex.pending:
        ex._wait(w, "a send of the hop check", peer)
    ex.pending = []
    return got_f, got_b


def _hops(res: SuiteResult, sizes: tuple[int, ...], iters: int, rank: int, world: int, corrupt: bool) -> None:
    dev = device()
    plan = block_plan([range(s, s + 1) for s in range(world)], 1, lambda s: s, "cached")
    ex = PipelineExecutor(nn.Module(), plan, [], rank=rank, rank_of=lambda s: s, stage_of=lambda c: rank,
                          group=dist.group.WORLD, params_of=lambda s: [])
    if corrupt:
        _corrupt(ex)
    for nbytes in sizes:
        n = max(1, nbytes // 4)
        ex.xs, ex.shape, ex.dtype, ex.device = [None], (1, 1, n), torch.float32, dev
        ex.pending, ex.stats, ex.clock = [], StepStats(), IdleClock(dev)  # the step state run() would set up
        ex.clock.start()

        fwd, bwd = _payload(rank, n, False, dev), _payload(rank, n, True, dev)
        round_trip = functools.partial(_round_trip, ex, rank, world, fwd, bwd)
        got_f, got_b = round_trip()
        bad = []
        if got_f is not None and not torch.equal(got_f.view(-1), _payload(rank - 1, n, False, dev)):
            bad.append(f"forward from rank {rank - 1}")
        if got_b is not None and not torch.equal(got_b.view(-1), _payload(rank + 1, n, True, dev)):
            bad.append(f"backward from rank {rank + 1}")
        res.check(f"pp/hop/{4 * n}/payload", not bad, bytes=4 * n, **({"differs": "; ".join(bad)} if bad else {}))
        dt = timed(round_trip, iters)
        res.rows.append({"kind": "hop", "bytes": 4 * n, "round_s": dt, "GBps": 2 * 4 * n / dt / 1e9})


# ---------------------------------------------------------------------------------------------
# 2. schedules end to end


def _batch(m: int, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (m * MB_BATCH, SEQ + 1), generator=g).to(dev)
    return tokens[:, :-1], tokens[:, 1:]


def _reference(layers: int, m: int, dev: torch.device) -> tuple[float, dict[str, torch.Tensor]]:
    """Single-rank float64: loss (mean over every token of the batch) and every parameter's gradient."""
    model = TinyStack(TinyConfig(layers)).to(dev, torch.float64)
    x, y = _batch(m, dev)
    logits = model(x)
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1), reduction="sum") / y.numel()
    loss.backward()
    return float(loss.detach()), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _blocks_exact(res: SuiteResult, name: str, part: PipelineParallel, trace: dict, rank: int, world: int,
                  m: int) -> None:
    """Every stage on this rank starts from exactly the blocks its upstream stage ended with."""
    ends = {k: (v["out"], v["out_partial"]) for k, v in trace.items()}
    every: list = [None] * world
    dist.all_gather_object(every, {k: (torch.stack(b).cpu(), None if p is None else p.cpu()) for k, (b, p) in
                                   ends.items()})
    upstream = {k: v for d in every for k, v in d.items()}
    bad, n = [], 0
    for (s, mb), v in sorted(trace.items()):
        if s == 0:
            continue
        blocks, partial = upstream[(s - 1, mb)]
        n_in = part.plan.n_in[s]
        got = torch.stack(v["in"]).cpu()
        # a cross-rank hop: the blocks it carried (the others are this rank's cached copies, checked where
        # they arrived); a same-rank hop: every block
        ids = list(part.plan.sends[s - 1]) if part.rank_of(s - 1) != rank else list(range(n_in))
        ok = got.shape[0] == n_in and torch.equal(got[ids], blocks[ids])
        ok = ok and (partial is None) == (v["in_partial"] is None)
        ok = ok and (partial is None or torch.equal(v["in_partial"].cpu(), partial))
        n += 1
        if not ok:
            bad.append(f"stage {s} (from rank {part.rank_of(s - 1)}) mb {mb}")
    res.check(f"{name}/blocks_exact", not bad and n == len(part.my_stages) * m - m * (0 in part.my_stages),
              hops=n, **({"first_bad": bad[0], "bad": len(bad)} if bad else {}))


def _schedule(res: SuiteResult, kind: str, vpp: int, mode: str, iters: int, rank: int, world: int,
              corrupt: bool) -> None:
    dev = device()
    m = world
    layers = 3 * world * vpp
    name = f"pp/{kind}/v{vpp}/m{m}/{mode}"
    ref_loss, ref_grads = _reference(layers, m, dev)
    part = PipelineParallel(build_schedule(kind, world, m, vpp), group=dist.group.WORLD, rank=rank, mode=mode)
    model = part.parallelize(TinyStack(TinyConfig(layers)).to(dev, torch.float64))
    ex = part.executor
    _traced(ex, model)
    if corrupt:
        _corrupt(ex)
    x, y = _batch(m, dev)
    model.trace = {}
    loss = float(part.forward_backward(model, x, y, 1.0 / y.numel()))
    part.sync_grads(model)
    trace, model.trace = model.trace, None
    stats = ex.stats

    hops = hop_plan(trainable(model).stages(part.num_stages), BLOCK, part.rank_of, mode)
    mine = [s for s in part.my_stages if s < part.num_stages - 1]
    want = {s: len(hops.sends[s]) * m for s in mine}
    got = {s: stats.hops.get(s, 0) for s in mine}
    res.check(f"{name}/hop_counts", got == want and stats.blocks_sent == sum(want.values()),
              sent=str(got), hop_plan=str(want))
    _blocks_exact(res, name, part, trace, rank, world, m)
    tol = (m + world + 1) * EPS32
    res.check(f"{name}/loss", abs(loss - ref_loss) <= tol * abs(ref_loss), loss=loss, ref=ref_loss,
              error=abs(loss - ref_loss) / abs(ref_loss), tol=tol)
    errs = {n: normwise_err(p.grad, ref_grads[n]) if p.grad is not None else float("inf")
            for n, p in model.named_parameters()}
    worst = max(errs, key=errs.__getitem__)
    held: list = [None] * world
    dist.all_gather_object(held, sorted(errs))
    missing = set(ref_grads) - {n for h in held for n in h}
    res.check(f"{name}/grads", errs[worst] <= GRAD_TOL and not missing, error=errs[worst], worst=worst,
              tol=GRAD_TOL, **({"never_held": sorted(missing)[0]} if missing else {}))

    def step() -> None:
        model.zero_grad(set_to_none=True)
        part.forward_backward(model, x, y, 1.0 / y.numel())
        part.sync_grads(model)

    dt = timed(step, iters)
    totals = torch.tensor([stats.blocks_sent, stats.bytes_sent, stats.bytes_sent_bwd], dtype=torch.int64, device=dev)
    dist.all_reduce(totals)
    res.rows.append({"kind": "schedule", "schedule": kind, "vpp": vpp, "mode": mode, "microbatches": m,
                     "stages": part.num_stages, "layers": layers, "blocks_per_step": int(totals[0]),
                     "hop_plan_blocks": hops.total * m, "max_hop_blocks": hops.max_hop,
                     "fwd_bytes": int(totals[1]), "bwd_bytes": int(totals[2]), "step_s": dt})


def run_suite(args: argparse.Namespace, rank: int, world: int) -> SuiteResult:
    from moonrt.jobs.selftest.ep import corruption

    if world < 2:
        raise ValueError(f"pp suite: world size {world}: expected >= 2 ranks (a pipeline)")
    res = SuiteResult()
    corrupt = corruption() == (rank, "pp")
    _hops(res, args.pp_sizes, args.iters, rank, world, corrupt)
    for kind, vpp, mode in CASES:
        _schedule(res, kind, vpp, mode, args.iters, rank, world, corrupt)
    res.table = format_table(res.rows, world)
    return res


def format_table(rows: list[dict], world: int) -> str:
    head = f"{'bytes':>10} | {'fwd+bwd ms':>10} {'GB/s':>8}"
    lines = [f"moonrt selftest pp: {world} ranks as one pipeline; executor hops r -> r+1 -> r, every link at once, "
             "slowest rank", head, "-" * len(head)]
    lines += [f"{r['bytes']:>10d} | {r['round_s'] * 1e3:>10.3f} {r['GBps']:>8.3f}" for r in rows if r["kind"] == "hop"]
    head = (f"{'schedule':>12} {'vpp':>3} {'mode':>6} {'M':>3} | {'blocks/step':>11} {'hop plan':>8} "
            f"{'max hop':>7} | {'fwd KB':>8} {'bwd KB':>8} {'step ms':>8}")
    lines += ["", "schedules (float64 stand-in stack, all ranks one pipeline; blocks/step summed over ranks)",
              head, "-" * len(head)]
    lines += [f"{r['schedule']:>12} {r['vpp']:>3} {r['mode']:>6} {r['microbatches']:>3} | {r['blocks_per_step']:>11d} "
              f"{r['hop_plan_blocks']:>8d} {r['max_hop_blocks']:>7d} | {r['fwd_bytes'] / 1024:>8.1f} "
              f"{r['bwd_bytes'] / 1024:>8.1f} {r['step_s'] * 1e3:>8.2f}" for r in rows if r["kind"] == "schedule"]
    return "\n".join(lines)
