"""Quantization-aware training benchmarks (issue 33 item 5): codec throughput, step overhead, QAT vs plain eval loss.

1. **Codec throughput** (``--device``, CPU by default): :mod:`moonrt.ops.mx` quantize and dequantize (``floor``,
   blocks of 32 along the last axis) of a Gaussian ``[rows, cols]`` fp32 tensor, MXFP4 and MXFP8 E4M3, GB/s of the
   fp32 tensor (fastest of ``--repeats`` after a warm-up), and the fake-quantizer (both) QAT runs per weight.
2. **QAT step overhead** on ``k3_tiny``: one forward + backward of the same batch (``--batch-size`` x ``--seq-len``,
   seed 0) through the plain model and the same model with ``enable_qat`` (MXFP4 weights / MXFP8 inputs of the
   experts, ``--qat-block``), timed alternately in one process (``--step-repeats`` each, median; the alternation
   shares the machine's load between the two), and their ratio.
3. **Eval loss, QAT vs plain** (``--train-steps N``, 0 skips it): ``moonrt train`` with the embedded default job
   (k3_tiny, N steps) twice, ``--qat mxfp4 --qat-block 8`` and plain, run one after the other; the eval losses of
   their metrics, and ``qat / plain - 1`` at the last step (acceptance: within 5%).

Prints a table per part and writes JSON (``--out``) with the CPU model, core count, threads and load average.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_qat.py [--train-steps 200] [--out /tmp/moonrt-bench/qat.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from machine import cpu_model, wall_times

from moonrt.ops import mx
from moonrt.ops.qat import fake_quantize_values


def _machine() -> dict:
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "threads": torch.get_num_threads(),
            "loadavg": [round(v, 2) for v in os.getloadavg()],
            "time": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def codec(rows: int, cols: int, repeats: int, device: str) -> list[dict]:
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(0)).to(device)
    gb = x.numel() * 4 / 1e9
    out = []
    for fmt in ("mxfp4", "mxfp8_e4m3"):
        q = mx.quantize(x, fmt)
        tq = min(wall_times(lambda f=fmt: mx.quantize(x, f), repeats, device))
        td = min(wall_times(lambda q=q: q.dequantize(), repeats, device))
        tf = min(wall_times(lambda f=fmt: fake_quantize_values(x, f, 32), repeats, device))
        out.append({"format": fmt, "quantize_gbs": gb / tq, "dequantize_gbs": gb / td, "fake_quant_gbs": gb / tf,
                    "bytes_per_element": q.nbytes / x.numel()})
    return out


def step_overhead(batch: int, seq: int, block: int, repeats: int) -> dict:
    from moonrt.models.k3.model.config import k3_tiny
    from moonrt.models.k3.model.model import K3Model
    from moonrt.ops.qat import QATScheme

    torch.manual_seed(0)
    model = K3Model(k3_tiny())
    tokens = torch.randint(0, 256, (batch, seq + 1), generator=torch.Generator().manual_seed(1))
    x, y = tokens[:, :-1], tokens[:, 1:]
    scheme = QATScheme(block=block)

    def step(qat: bool) -> float:
        model.enable_qat(scheme if qat else None)
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        model.loss_sum(x, y).backward()
        return time.perf_counter() - t0

    step(False), step(True)  # warm-up
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(repeats):
        for qat in (False, True):
            times[qat].append(step(qat))
    plain, qat = statistics.median(times[False]), statistics.median(times[True])
    return {"batch": batch, "seq_len": seq, "block": block, "repeats": repeats, "plain_s": plain, "qat_s": qat,
            "ratio": qat / plain}


def train_pair(steps: int, out: Path) -> dict:
    runs = {"qat": ["--qat", "mxfp4", "--qat-block", "8"], "plain": []}
    res = {}
    for name, flags in runs.items():
        d = out / f"train_{name}"
        cmd = [sys.executable, "-m", "moonrt.cli", "train", "--steps", str(steps), "--no-progress", "--out", str(d),
               "--metrics", f"{d}.jsonl", *flags]
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True)
        wall = time.perf_counter() - t0
        recs = [json.loads(line) for line in Path(f"{d}.jsonl").read_text().splitlines()]
        res[name] = {"command": " ".join(cmd[2:]), "wall_s": wall,
                     "eval": {r["step"]: r["eval_loss"] for r in recs if "eval_loss" in r}}
    last = max(res["plain"]["eval"])
    res["last_step"], res["rel_diff"] = last, res["qat"]["eval"][last] / res["plain"]["eval"][last] - 1
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--qat-block", type=int, default=8, help="k3_tiny's expert FFN width 56 takes 8, not 32")
    ap.add_argument("--step-repeats", type=int, default=5)
    ap.add_argument("--train-steps", type=int, default=0, help="QAT vs plain moonrt train runs of this many steps "
                    "(0: skip; the acceptance run is 200)")
    ap.add_argument("--out", default="/tmp/moonrt-bench/qat.json")
    args = ap.parse_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result: dict = {"machine": _machine()}
    result["codec"] = codec(args.rows, args.cols, args.repeats, args.device)
    print(f"codec, [{args.rows}, {args.cols}] fp32 on {args.device}, floor scales, block 32 (GB/s of the fp32 tensor)")
    print(f"{'format':<12} {'quantize':>10} {'dequantize':>11} {'fake-quant':>11} {'B/elem':>7}")
    for r in result["codec"]:
        print(f"{r['format']:<12} {r['quantize_gbs']:>10.3f} {r['dequantize_gbs']:>11.3f} {r['fake_quant_gbs']:>11.3f} "
              f"{r['bytes_per_element']:>7.3f}")
    s = result["step"] = step_overhead(args.batch_size, args.seq_len, args.qat_block, args.step_repeats)
    print(f"\nk3_tiny forward+backward, {s['batch']} x {s['seq_len']} tokens, median of {s['repeats']} alternating: "
          f"plain {s['plain_s']:.3f} s, QAT mxfp4 (block {s['block']}) {s['qat_s']:.3f} s, ratio {s['ratio']:.2f}")
    if args.train_steps:
        t = result["train"] = train_pair(args.train_steps, out.parent)
        print(f"\n{'step':>5} {'plain eval':>11} {'QAT eval':>9} {'QAT/plain-1':>12}")
        for step in sorted(t["plain"]["eval"]):
            p, q = t["plain"]["eval"][step], t["qat"]["eval"].get(step)
            print(f"{step:>5} {p:>11.3f} {q:>9.3f} {q / p - 1:>+12.1%}")
    result["machine_end"] = _machine()
    out.write_text(json.dumps(result, indent=1))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
