"""Activation-manager overhead on k3_tiny training steps, every policy side by side in one run.

One model + AdamW per policy (same init, same batches); the steps are interleaved round-robin
(step s of every policy, then step s + 1, with the order rotated each round), so machine load
drifts hit every policy alike. Reported per policy: median tokens/s over the timed steps, the ratio
of the no-manager median to it, and the median of the per-round paired ratios (step time of the
policy / step time without manager in the same round), which is the figure robust to load drift.

    .venv/bin/python benchmarks/bench_manager_overhead.py --steps 10 --out /tmp/bench_manager_overhead.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import tempfile
import time

import torch
from machine import cpu_model

from moonrt.config import from_dict
from moonrt.memory.manager import ActivationManager
from moonrt.memory.policy import MemoryPolicy
from moonrt.model.config import k3_tiny
from moonrt.model.model import K3Model

FP8_CLASSES = ["layers.*.moe", "layers.*.ffn", "layers.*.attn.*proj", "layers.*.attn_norm", "layers.*.ffn_norm",
               "attn_res.sublayer_input"]


def policies(disk_dir: str) -> dict[str, MemoryPolicy | None]:
    """The compared policies: no manager, keep, host, FP8 (the K3 classes of bench_memory), disk, recompute."""
    return {
        "no manager": None,
        "keep": MemoryPolicy(),
        "host": from_dict(MemoryPolicy, {"default": "host"}),
        "fp8 (matmul inputs)": from_dict(MemoryPolicy, {"rules": [{"match": m, "policy": "fp8"} for m in FP8_CLASSES]}),
        "disk": from_dict(MemoryPolicy, {"default": "disk", "disk_path": disk_dir, "disk_capacity_mib": 2048}),
        "recompute (layers)": from_dict(MemoryPolicy, {"rules": [{"match": "layers.*", "policy": "recompute"}]}),
    }


class Runner:
    """One policy's model, optimizer and manager; :meth:`step` runs one timed training step."""

    def __init__(self, policy: MemoryPolicy | None) -> None:
        torch.manual_seed(0)
        self.model = K3Model(k3_tiny())
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.mgr = ActivationManager(self.model, policy) if policy is not None else None
        self.times: list[float] = []
        self.losses: list[float] = []

    def step(self, tok: torch.Tensor, record: bool) -> float:
        t0 = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        with self.mgr if self.mgr is not None else contextlib.nullcontext():
            loss = self.model.loss_sum(tok, tok) / tok.numel()
        loss.backward()
        self.opt.step()
        dt = time.perf_counter() - t0
        if record:
            self.times.append(dt)
            self.losses.append(float(loss.detach()))
        return dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8, help="sequences per step (moonrt train default 8)")
    ap.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (moonrt train default 128)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per policy (after one warm-up step)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (moonrt train default 1)")
    ap.add_argument("--out", default="/tmp/moonrt-bench-manager-overhead.json", help="JSON results file")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    disk_dir = tempfile.mkdtemp(prefix="moonrt-bench-overhead-")
    runners = {name: Runner(p) for name, p in policies(disk_dir).items()}
    names = list(runners)
    gen = torch.Generator().manual_seed(0)
    toks = [torch.randint(0, 256, (args.batch, args.seq_len), generator=gen) for _ in range(args.steps + 1)]
    paired: dict[str, list[float]] = {n: [] for n in names}
    for s, tok in enumerate(toks):
        order = names[s % len(names):] + names[:s % len(names)]
        dts = {n: runners[n].step(tok, record=s > 0) for n in order}
        if s > 0:
            for n in names:
                paired[n].append(dts[n] / dts["no manager"])
    tokens = args.batch * args.seq_len
    base = statistics.median(runners["no manager"].times)
    info = {"threads": torch.get_num_threads(), "cpu": cpu_model(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__,
            "cpu_count": os.cpu_count(), "load_avg_1m": os.getloadavg()[0]}
    print(f"k3_tiny training step (fwd + bwd + AdamW), batch {args.batch} x {args.seq_len} tokens, "
          f"{args.steps} timed steps per policy, interleaved round-robin in one run")
    print(f"threads {info['threads']}, CPU {info['cpu']} ({info['cpu_count']} logical), torch CPU capability "
          f"{info['cpu_capability']}, torch {info['torch']}, load avg at end {info['load_avg_1m']:.1f}")
    head = f"{'policy':<22}{'tokens/s':>10}{'x slower':>10}{'paired x':>10}{'saves/step':>12}"
    print(head)
    rows = []
    for n in names:
        r = runners[n]
        med = statistics.median(r.times)
        saves = None
        if r.mgr is not None:
            saves = sum(st.count for st in r.mgr.accounting.regions.values()) / (args.steps + 1)
            r.mgr.close()
        row = {"policy": n, "tokens_per_s": tokens / med, "ratio_of_medians": med / base,
               "paired_ratio_median": statistics.median(paired[n]), "step_s": r.times, "saves_per_step": saves,
               "losses": r.losses}
        rows.append(row)
        print(f"{n:<22}{row['tokens_per_s']:>10.0f}{row['ratio_of_medians']:>10.3f}{row['paired_ratio_median']:>10.3f}"
              f"{'-' if saves is None else f'{saves:.0f}':>12}")
    with open(args.out, "w") as f:
        json.dump({"batch": args.batch, "seq_len": args.seq_len, "steps": args.steps, **info, "rows": rows}, f,
                  indent=1)
    os.rmdir(disk_dir)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
