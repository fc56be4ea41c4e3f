"""Block AttnRes pipeline traffic at K3's depth: blocks and bytes per forward hop, naive vs cached.

K3: 93 decoder layers, AttnRes blocks of 12 (8 blocks + the embedding), hidden 7168. For each (P, V) the
layers are split evenly into C = P V contiguous stages in loop placement (the K3 layout, interleaved 1F1B)
and :func:`moonrt.scheduler.attnres_comm.hop_plan` counts, per micro-batch, the completed blocks each hop
carries (naive: all so far; cached: what the receiving rank lacks). Bytes add the open partial block where a
cut falls inside a block; one block is ``mbs x seq x hidden`` bf16. Also the interleaved schedule's bubble
and rank 0's peak live chunks at M = 2P from the simulator, and the aligned closed forms for comparison
(N_p = blocks per chunk; at K3's depth a chunk holds half a block or less, so no split is aligned).

    .venv/bin/python benchmarks/bench_pp_blocks.py [--seq-len 4096] [--mbs 1]
        [--out /tmp/moonrt-bench/bench_pp_blocks.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from moonrt.models.k3.model.config import k3
from moonrt.scheduler.attnres_comm import even_layer_ranges, hop_plan
from moonrt.scheduler.pipeline import build_schedule, simulate

LAYOUTS = ((8, 2), (4, 4), (16, 2))


def row(p: int, v: int, layers: int, block: int, block_bytes: float) -> dict:
    c = p * v
    rng = even_layer_ranges(layers, c)
    plans = {m: hop_plan(rng, block, lambda s: s % p, m) for m in ("naive", "cached")}  # type: ignore[arg-type]
    sim = simulate(build_schedule("interleaved", p, 2 * p, v))
    out: dict = {"pp": p, "vpp": v, "stages": c, "layers_per_stage": [len(r) for r in rng],
                 "partial_hops": sum(plans["cached"].partial), "bubble_interleaved_m2p": sim.bubble_fraction,
                 "peak_live_rank0_m2p": sim.peak_live[0]}
    for m, h in plans.items():
        b = h.bytes_per_hop(block_bytes)
        out[m] = {"blocks_total": h.total, "blocks_max_hop": h.max_hop, "bytes_total": sum(b), "bytes_max_hop": max(b),
                  "blocks_per_hop": [len(s) for s in h.sends]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--mbs", type=int, default=1)
    ap.add_argument("--out", default="/tmp/moonrt-bench/bench_pp_blocks.json")
    args = ap.parse_args()
    cfg = k3()
    layers, block = cfg.num_hidden_layers, cfg.attn_res_block_size
    block_bytes = float(args.mbs * args.seq_len * cfg.hidden_size * 2)
    rows = [row(p, v, layers, block, block_bytes) for p, v in LAYOUTS]
    mib = 2.0**20
    print(f"K3: {layers} layers, AttnRes block {block} ({cfg.num_attn_res_blocks} blocks + embedding), hidden "
          f"{cfg.hidden_size}; one block = {block_bytes / mib:.0f} MiB (mbs {args.mbs} x seq {args.seq_len}, bf16); "
          "per micro-batch, forward hops")
    print(f"{'P':>3} {'V':>2} {'C':>3} | {'naive blk':>9} {'max':>4} {'MiB':>7} {'max MiB':>7} | {'cached blk':>10} "
          f"{'max':>4} {'MiB':>7} {'max MiB':>7} | {'blk ratio':>9} {'partial':>7} | {'bubble(M=2P)':>12} "
          f"{'peak r0':>7}")
    for r in rows:
        n, c = r["naive"], r["cached"]
        print(f"{r['pp']:>3} {r['vpp']:>2} {r['stages']:>3} | {n['blocks_total']:>9} {n['blocks_max_hop']:>4} "
              f"{n['bytes_total'] / mib:>7.0f} {n['bytes_max_hop'] / mib:>7.0f} | {c['blocks_total']:>10} "
              f"{c['blocks_max_hop']:>4} {c['bytes_total'] / mib:>7.0f} {c['bytes_max_hop'] / mib:>7.0f} | "
              f"{c['blocks_total'] / n['blocks_total']:>9.3f} {r['partial_hops']:>7} | "
              f"{r['bubble_interleaved_m2p']:>12.4f} {r['peak_live_rank0_m2p']:>7}")
    for r in rows:
        print(f"  P={r['pp']} V={r['vpp']} cached blocks per hop: {r['cached']['blocks_per_hop']}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"layers": layers, "block": block, "block_bytes": block_bytes, "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
