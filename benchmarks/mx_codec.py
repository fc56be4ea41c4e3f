"""MX codec throughput and round-trip SQNR (issue 33 item 1): :mod:`moonrt.ops.mx` per format and scale mode.

For each format (``mxfp4``, ``mxfp8_e4m3``, ``mxfp8_e5m2``) and scale mode (``floor``, ``rceil``, ``ceil``,
``even``), on a Gaussian ``[rows, cols]`` fp32 tensor quantized along its last axis in blocks of 32:

- quantize and dequantize (to fp32) wall time, fastest of ``--repeats`` after one warm-up, as MB/s of the fp32
  tensor (``rows * cols * 4`` bytes, both directions, so the two rates compare);
- with ``--torchao`` (when importable), torchao's ``to_mx`` on the same tensor for reference;
- storage bytes per element (codes plus one scale byte per block) and SQNR ``20 log10(|x| / |x - y|)`` in dB.

Prints a table and writes JSON (``--out``), each with the CPU model, core count, torch threads and load average.

    .venv/bin/python benchmarks/mx_codec.py [--rows 4096] [--cols 4096] [--repeats 7] [--device cpu] [--torchao]
        [--out /tmp/moonrt-bench/mx_codec.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import torch
from machine import cpu_model, wall_times

from moonrt.ops import mx


def _time(fn, repeats: int, device: str) -> float:
    """Fastest wall seconds of ``fn()`` over ``repeats`` runs after one warm-up (on a shared, loaded CPU the
    fastest run is the least disturbed one; the median moves with the other jobs' load)."""
    return min(wall_times(fn, repeats, device))


def _machine() -> dict:
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "threads": torch.get_num_threads(),
            "loadavg": [round(v, 2) for v in os.getloadavg()], "time": time.strftime("%Y-%m-%d %H:%M UTC",
                                                                                      time.gmtime())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--torchao", action="store_true", help="also time torchao's to_mx (if importable)")
    ap.add_argument("--out", default="/tmp/moonrt-bench/mx_codec.json")
    args = ap.parse_args()
    ao = None
    if args.torchao:
        try:
            from torchao.prototype.mx_formats.config import ScaleCalculationMode
            from torchao.prototype.mx_formats.mx_tensor import to_mx
            ao = (to_mx, ScaleCalculationMode)
        except ImportError:
            print("torchao not importable: its column is left out")
    dev = torch.device(args.device)
    torch.manual_seed(0)
    x = torch.randn(args.rows, args.cols, device=dev)
    mb = x.numel() * 4 / 1e6
    ao_dtype = {"mxfp4": torch.float4_e2m1fn_x2, "mxfp8_e4m3": torch.float8_e4m3fn, "mxfp8_e5m2": torch.float8_e5m2}
    before = _machine()
    rows = []
    for fmt in mx.FORMATS:
        for mode in mx.SCALE_MODES:
            q = mx.quantize(x, fmt, scale_mode=mode)
            y = q.dequantize()
            row = {"format": fmt, "scale_mode": mode, "bytes_per_element": q.nbytes / x.numel(),
                   "sqnr_db": 20 * math.log10(x.norm().item() / (x - y).norm().item()),
                   "quantize_mb_s": mb / _time(lambda f=fmt, m=mode: mx.quantize(x, f, scale_mode=m), args.repeats,
                                               dev.type),
                   "dequantize_mb_s": mb / _time(q.dequantize, args.repeats, dev.type)}
            if ao is not None:
                row["torchao_to_mx_mb_s"] = mb / _time(lambda f=fmt, m=mode: ao[0](x, ao_dtype[f], 32, ao[1](m)),
                                                       args.repeats, dev.type)
            rows.append(row)
    after = _machine()
    m = before
    print(f"MX codecs on [{args.rows}, {args.cols}] fp32 ({mb:.0f} MB), block 32, {args.device}; [{m['time']}: "
          f"{m['cpu']}, {m['cores']} cores, torch threads {m['threads']}, load average "
          f"{'/'.join(map(str, m['loadavg']))} before, {'/'.join(map(str, after['loadavg']))} after]")
    head = f"{'format':<11} {'mode':<6} {'B/elem':>7} {'SQNR dB':>8} {'quant MB/s':>11} {'dequant MB/s':>13}"
    print(head + (f" {'torchao to_mx MB/s':>19}" if ao else ""))
    for r in rows:
        line = (f"{r['format']:<11} {r['scale_mode']:<6} {r['bytes_per_element']:>7.4f} {r['sqnr_db']:>8.2f} "
                f"{r['quantize_mb_s']:>11.0f} {r['dequantize_mb_s']:>13.0f}")
        print(line + (f" {r['torchao_to_mx_mb_s']:>19.0f}" if ao else ""))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"shape": [args.rows, args.cols], "block": 32, "device": args.device,
                               "repeats": args.repeats, "machine_before": before, "machine_after": after,
                               "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
