"""Activation-manager overhead on k3_tiny training steps, every policy side by side in one run.

One model + AdamW per (policy, manager version) (same init, same batches); the steps are interleaved
round-robin (step s of every runner, then step s + 1, with the order rotated each round), so machine
load drifts hit every runner alike. With ``--baseline DIR`` (a checkout of an older commit, e.g.
``git archive COMMIT moonrt | tar -x -C DIR``) the manager modules of that checkout (:data:`MANAGER_MODULES`
that exist there: ``ops/fp8/codec.py`` and ``memory/{backends,accounting,entries,fp8_batch,host_batch,regions,recompute,
saved_hooks,manager}.py``) are loaded next to the current ones and every policy runs under both, in the
same process and the same rounds.

Reported per runner: median tokens/s, and two paired ratios against the no-manager runner of the same
round (median over rounds): wall-clock step time and process CPU time (``time.process_time``: CPU
seconds of this process, all threads; robust to other jobs on a shared machine, which stretch wall
time but not the CPU work of a step). After the timed rounds, one more (untimed) step per runner counts
the calls of the manager's pack hook: Python hook calls per step in steady state.

    .venv/bin/python benchmarks/bench_manager_overhead.py --steps 10 --baseline /tmp/base --out /tmp/overhead.json

Python's garbage collector runs as in ``moonrt train``: automatic collection off, one young-generation collection every
``--gc-interval`` rounds (default: ``JobConfig.gc_interval``, 50; ``--gc-interval 0``: Python's automatic collection,
whose full collections over the process's ~370k objects the managers' per-save records trigger every few steps).

The current manager runs with its default ``copy_thread=None``: host copies and FP8 quantization on a background
thread when the process has an idle CPU (``idle_cpu()``, printed in the header), else in the forward's thread.
``--inline`` adds host and FP8 under the current manager with the other setting (row names say which).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from machine import cpu_model

from moonrt.config import from_dict
from moonrt.jobs.train.config import JobConfig
from moonrt.jobs.train.loop import ManualGC
from moonrt.memory.manager import ActivationManager, idle_cpu
from moonrt.memory.policy import MemoryPolicy
from moonrt.models.k3.model.config import k3_tiny
from moonrt.models.k3.model.model import K3Model

FP8_CLASSES = ["layers.*.moe", "layers.*.ffn", "layers.*.attn.*proj", "layers.*.attn_norm", "layers.*.ffn_norm",
               "attn_res.sublayer_input"]
MANAGER_MODULES = ["moonrt.ops.fp8.codec", "moonrt.memory.backends", "moonrt.memory.accounting", "moonrt.memory.entries",
                   "moonrt.memory.fp8_batch", "moonrt.memory.host_batch", "moonrt.memory.regions",
                   "moonrt.memory.recompute",
                   "moonrt.memory.saved_hooks", "moonrt.memory.manager"]
"""The manager's modules in import order; a baseline checkout's are loaded when they exist there (an older
layout without some of them imports the current ones)."""


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


def load_manager(root: Path) -> type:
    """``ActivationManager`` of the checkout at ``root``: its manager modules are executed under their own
    names while ``sys.modules`` (and the parent packages' attributes) point at them, then restored, so the
    old classes bind to each other and the current modules stay in place."""
    names = [n for n in MANAGER_MODULES if (root / (n.replace(".", "/") + ".py")).exists()]
    if "moonrt.memory.manager" not in names:
        raise SystemExit(f"--baseline {str(root)!r}: no moonrt/memory/manager.py there; expected a moonrt checkout")
    for name in names:
        importlib.import_module(name)  # the current module first, so it can be restored
    saved = {n: sys.modules.get(n) for n in names}
    parents = {n: sys.modules[n.rpartition(".")[0]] for n in names}
    try:
        for name in names:
            path = root / (name.replace(".", "/") + ".py")
            spec = importlib.util.spec_from_file_location(name, path)
            assert spec is not None and spec.loader is not None
            mod = importlib.util.module_from_spec(spec)
            sys.modules[name] = mod
            setattr(parents[name], name.rpartition(".")[2], mod)
            spec.loader.exec_module(mod)
        return sys.modules["moonrt.memory.manager"].ActivationManager
    finally:
        for name, mod in saved.items():
            if mod is not None:
                sys.modules[name] = mod
                setattr(parents[name], name.rpartition(".")[2], mod)


class Runner:
    """One policy's model, optimizer and manager; :meth:`step` runs one training step."""

    def __init__(self, policy: MemoryPolicy | None, manager: type = ActivationManager) -> None:
        torch.manual_seed(0)
        self.model = K3Model(k3_tiny())
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.mgr: Any = manager(self.model, policy) if policy is not None else None
        self.times: list[float] = []
        self.cpu: list[float] = []
        self.losses: list[float] = []

    def step(self, tok: torch.Tensor, record: bool) -> tuple[float, float]:
        """One step; returns ``(wall s, process CPU s)``."""
        c0, t0 = time.process_time(), time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        with self.mgr if self.mgr is not None else contextlib.nullcontext():
            loss = self.model.loss_sum(tok, tok) / tok.numel()
        loss.backward()
        self.opt.step()
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        if record:
            self.times.append(dt)
            self.cpu.append(dc)
            self.losses.append(float(loss.detach()))
        return dt, dc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8, help="sequences per step (moonrt train default 8)")
    ap.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (moonrt train default 128)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per runner (after one warm-up step)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (moonrt train default 1)")
    ap.add_argument("--baseline", default="", help="a moonrt checkout (e.g. git worktree of an older commit) "
                    "whose manager runs next to the current one")
    ap.add_argument("--inline", action="store_true", help="also run host and FP8 under the current manager "
                    "with the other copy_thread setting (see the row names)")
    ap.add_argument("--only", default="", help="comma-separated policies to run (besides 'no manager'), e.g. "
                    "keep,host,fp8: fewer runners, more rounds in the same time")
    ap.add_argument("--gc-interval", type=int, default=JobConfig().gc_interval, help="garbage collection as moonrt "
                    "train does it: automatic collection off, gc.collect(1) every N rounds; 0 = Python's automatic "
                    "collection (default: moonrt train's, %(default)s)")
    ap.add_argument("--out", default="/tmp/moonrt-bench-manager-overhead.json", help="JSON results file")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load_start = os.getloadavg()[0]
    disk_dir = tempfile.mkdtemp(prefix="moonrt-bench-overhead-")
    idle = idle_cpu()  # what the current manager's copy_thread=None resolves to
    versions: dict[str, type] = {"": ActivationManager}
    if args.baseline:
        versions = {"base: ": load_manager(Path(args.baseline)), "": ActivationManager}
    runners: dict[str, Runner] = {}
    chosen = [w.strip() for w in args.only.split(",") if w.strip()]
    known = policies(disk_dir)
    unknown = [w for w in chosen if not any(n.startswith(w) for n in known)]
    if unknown:
        raise SystemExit(f"--only: unknown policy {', '.join(unknown)}; expected names from {', '.join(known)}")
    for name, p in known.items():
        if chosen and p is not None and not any(name.startswith(w) for w in chosen):
            continue
        for tag, cls in versions.items():
            if p is None and tag:
                continue
            runners[tag + name] = Runner(copy.deepcopy(p), cls)
        if p is not None and args.inline and ("host" in name or "fp8" in name):
            # the current manager with the copy thread setting its default did not pick
            runners[name + f" [copy_thread={not idle}]"] = Runner(
                copy.deepcopy(p), functools.partial(ActivationManager, copy_thread=not idle))
    names = list(runners)
    gen = torch.Generator().manual_seed(0)
    toks = [torch.randint(0, 256, (args.batch, args.seq_len), generator=gen) for _ in range(args.steps + 1)]
    paired: dict[str, list[float]] = {n: [] for n in names}
    paired_cpu: dict[str, list[float]] = {n: [] for n in names}
    gc_control = ManualGC(args.gc_interval)
    try:
        for s, tok in enumerate(toks):
            order = names[s % len(names):] + names[:s % len(names)]
            dts = {n: runners[n].step(tok, record=s > 0) for n in order}
            if s > 0:
                for n in names:
                    paired[n].append(dts[n][0] / dts["no manager"][0])
                    paired_cpu[n].append(dts[n][1] / dts["no manager"][1])
            gc_control.tick(s + 1)
    finally:
        gc_control.close()
    hook_calls: dict[str, float] = {}
    for n in names:  # one more step, untimed, counting the pack hook's calls
        r = runners[n]
        if r.mgr is None:
            continue
        calls = [0]

        def counted(t: torch.Tensor, pack: Any = r.mgr._pack, calls: list[int] = calls) -> Any:
            calls[0] += 1
            return pack(t)

        r.mgr._pack = r.mgr._pack_fn = counted  # the baseline pushes _pack at __enter__, the current _pack_fn
        r.step(toks[-1], record=False)
        hook_calls[n] = calls[0]
    tokens = args.batch * args.seq_len
    info = {"threads": torch.get_num_threads(), "cpu": cpu_model(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__,
            "cpu_count": os.cpu_count(), "load_avg_1m_start": load_start, "load_avg_1m": os.getloadavg()[0],
            "copy_thread_default": idle, "gc_interval": args.gc_interval}
    machine = f"threads={info['threads']}, {info['cpu']}, {info['cpu_capability']}"
    print(f"k3_tiny training step (fwd + bwd + AdamW), batch {args.batch} x {args.seq_len} tokens, "
          f"{args.steps} timed steps per runner, interleaved round-robin in one run"
          + (f"; 'base:' = manager of {args.baseline}" if args.baseline else ""))
    print(f"threads {info['threads']}, CPU {info['cpu']} ({info['cpu_count']} logical), torch CPU capability "
          f"{info['cpu_capability']}, torch {info['torch']}, load avg (1 min) at start {load_start:.1f}, "
          f"at end {info['load_avg_1m']:.1f}; current manager: copy thread {'on' if idle else 'off'}; garbage "
          "collection: " + (f"gc.collect(1) every {args.gc_interval} rounds (as moonrt train)" if args.gc_interval
                            else "automatic"))
    head = (f"{'policy':<42}{'tokens/s':>10}{'paired x':>10}{'CPU x':>8}{'hook calls/step':>16}{'loss==none':>11}"
            "  machine")
    print(head)
    rows = []
    for n in names:
        r = runners[n]
        calls = hook_calls.get(n)
        if r.mgr is not None:
            r.mgr.close()
        row = {"policy": n, "tokens_per_s": tokens / statistics.median(r.times),
               "paired_ratio_median": statistics.median(paired[n]),
               "paired_cpu_ratio_median": statistics.median(paired_cpu[n]), "step_s": r.times, "cpu_s": r.cpu,
               "hook_calls_per_step": calls, "losses": r.losses,
               "losses_equal_no_manager": r.losses == runners["no manager"].losses}
        rows.append(row)
        print(f"{n:<42}{row['tokens_per_s']:>10.0f}{row['paired_ratio_median']:>10.3f}"
              f"{row['paired_cpu_ratio_median']:>8.3f}{'-' if calls is None else f'{calls:.0f}':>16}"
              f"{str(row['losses_equal_no_manager']):>11}  {machine}")
    with open(args.out, "w") as f:
        json.dump({"batch": args.batch, "seq_len": args.seq_len, "steps": args.steps, "baseline": args.baseline,
                   **info, "rows": rows}, f, indent=1)
    os.rmdir(disk_dir)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
