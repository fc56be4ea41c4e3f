"""ZeRO-1 at dp 2 on k3_tiny: per-rank optimizer-state and gradient bytes and step time, with and without ZeRO-1.

Runs ``moonrt launch -n 2 -- moonrt train`` with ``--zero 0`` and ``--zero 1`` in alternating rounds (the machine is
shared and noisy: ratios come from the same rounds) and reads each run's metrics file:

- optimizer-state bytes per rank: ZeRO-1 reports ``optimizer_state_bytes`` (every rank's owned AdamW moments and
  step counts); replicated AdamW holds ``2 x 4 x N`` bytes of moments plus ``8`` per parameter tensor on every rank
  (``N`` parameters, fp32);
- gradient bytes per rank that stay allocated after the gradient sum: replicated ``4 x N`` (every ``p.grad``);
  ZeRO-1 ``4 x ceil(N / 2)`` (its reduced shard; the full flat gradient it reduce-scatters from exists only during
  the sum, so the *peak* gradient bytes are the same in both);
- step time: the median of ``global tokens / tokens_per_s`` over the steps after the first two, per run, then the
  median over rounds.

Usage: ``python benchmarks/bench_zero.py --rounds 3 --steps 8 --out zero.json``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from machine import cpu_model  # noqa: E402


def _run(zero: int, steps: int, batch: int, seq: int, work: Path) -> list[dict]:
    out = work / f"z{zero}"
    metrics = work / f"z{zero}.jsonl"
    moonrt = str(Path(sys.executable).with_name("moonrt"))
    cmd = [moonrt, "launch", "-n", "2", "--", moonrt, "train", "--steps", str(steps), "--batch-size", str(batch),
           "--seq-len", str(seq), "--eval-every", str(10 * steps), "--threads", "1", "--no-progress",
           "--zero", str(zero), "--out", str(out), "--metrics", str(metrics)]
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=1800, env=dict(os.environ))
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--out", default="zero.json")
    args = ap.parse_args()
    from moonrt.jobs.train.assemble import build_model
    from moonrt.jobs.train.config import JobConfig

    params = [p for p in build_model(JobConfig(model="k3_tiny")).parameters() if p.requires_grad]
    n, tensors = sum(p.numel() for p in params), len(params)
    tokens = args.batch_size * args.seq_len
    times: dict[int, list[float]] = {0: [], 1: []}
    state1: list[int] = []
    for r in range(args.rounds):
        for zero in (0, 1) if r % 2 == 0 else (1, 0):
            with tempfile.TemporaryDirectory() as tmp:
                rows = _run(zero, args.steps, args.batch_size, args.seq_len, Path(tmp))
            times[zero].append(statistics.median(tokens / row["tokens_per_s"] for row in rows[2:]))
            if zero:
                state1 = rows[-1]["optimizer_state_bytes"]
    machine = f"threads=1, {cpu_model()}, torch {torch.__version__} {torch.backends.cpu.get_cpu_capability()}"
    result = {
        "parameters": n,
        "zero0": {"optimizer_state_bytes_per_rank": 2 * 4 * n + 8 * tensors, "grad_bytes_per_rank": 4 * n,
                  "step_s": statistics.median(times[0]), "step_s_rounds": times[0]},
        "zero1": {"optimizer_state_bytes_per_rank": max(state1), "optimizer_state_bytes": state1,
                  "grad_bytes_per_rank": 4 * -(-n // 2), "step_s": statistics.median(times[1]),
                  "step_s_rounds": times[1]},
        "machine": machine, "load_average": os.getloadavg(), "args": vars(args),
    }
    print(f"k3_tiny, {n:,} parameters, dp 2 (2 gloo ranks), {args.steps} steps x {tokens} tokens, {args.rounds} rounds")
    print(f"{'zero':>4} | {'optimizer MB/rank':>17} | {'grad MB/rank (after sum)':>24} | {'step s (median)':>15} "
          "| machine")
    for z in (0, 1):
        row = result[f"zero{z}"]
        print(f"{z:>4} | {row['optimizer_state_bytes_per_rank'] / 1e6:>17.2f} "
              f"| {row['grad_bytes_per_rank'] / 1e6:>24.2f} | {row['step_s']:>15.3f} | {machine}")
    z0, z1 = result["zero0"], result["zero1"]
    print(f"ratios zero1/zero0: optimizer "
          f"{z1['optimizer_state_bytes_per_rank'] / z0['optimizer_state_bytes_per_rank']:.3f}, "
          f"grad {z1['grad_bytes_per_rank'] / z0['grad_bytes_per_rank']:.3f}, "
          f"step time {z1['step_s'] / z0['step_s']:.3f}; load average {os.getloadavg()}")
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
