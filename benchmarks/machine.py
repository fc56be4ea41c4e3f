"""What machine a benchmark ran on: printed next to every figure and stored in its JSON."""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``; ``platform.processor()`` elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def wall_times(fn: Callable[[], object], repeats: int, device: str = "cpu") -> list[float]:
    """Wall seconds of ``repeats`` calls of ``fn()`` after one warm-up call; on ``cuda`` each is bracketed by
    ``torch.cuda.synchronize()`` so the kernels it queued are counted. Callers pick the statistic (the fastest run
    is the least disturbed on a shared machine; the median moves with the other jobs' load)."""
    sync = None
    if device == "cuda":
        import torch

        sync = torch.cuda.synchronize
    fn()
    out = []
    for _ in range(repeats):
        if sync is not None:
            sync()
        t0 = time.perf_counter()
        fn()
        if sync is not None:
            sync()
        out.append(time.perf_counter() - t0)
    return out


def rank_bench_args(parser: argparse.ArgumentParser, prog: str, iters: int) -> tuple[argparse.Namespace, list[int]]:
    """The options every multi-rank benchmark shares (``--worlds``, ``--iters``, ``--out``, ``--force``) added to
    ``parser`` and parsed: ``(args, world sizes)``. Bad values, or an ``--out`` that exists without ``--force``:
    one line naming the option, exit 2."""
    parser.add_argument("--worlds", default="2,4", help="comma-separated world sizes")
    parser.add_argument("--iters", type=int, default=iters)
    parser.add_argument("--out", type=Path, default=Path(f"/tmp/moonrt-bench/{prog}.json"))
    parser.add_argument("--force", action="store_true", help="replace an existing --out file")
    args = parser.parse_args()
    try:
        worlds = [int(w) for w in args.worlds.split(",")]
        if any(w < 2 for w in worlds) or args.iters < 1:
            raise ValueError
    except ValueError:
        print(f"{prog}: --worlds {args.worlds!r} --iters {args.iters}: expected world sizes >= 2 and iters >= 1",
              file=sys.stderr)
        raise SystemExit(2) from None
    if (args.out.exists() or args.out.is_symlink()) and not args.force:
        print(f"{prog}: --out {str(args.out)!r}: already exists (give --force to replace it)", file=sys.stderr)
        raise SystemExit(2)
    return args, worlds


def write_rows(args: argparse.Namespace, rows: list[dict]) -> None:
    """``{"rows", "torch"}`` to ``args.out`` (created exclusively unless ``--force``), then say where."""
    import torch

    from moonrt.config import write_new

    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_new(args.out, json.dumps({"rows": rows, "torch": torch.__version__}, indent=1), force=args.force)
    print(f"wrote {args.out}")
