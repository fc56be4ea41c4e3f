"""The GPU check for one 15-minute device lease (issue 47; ``benchmarks/gpu/check.sh`` runs it).

One command, an internal deadline (:data:`DEADLINE_S` of work), blocks in priority order, each its own process
group under its own timeout (the smaller of its own and what is left of the deadline; a block that finds under
5 s left is recorded as ``SKIPPED``). After each block one JSON line is appended to ``OUT/results.jsonl``:
``{block, what, status, rc, wall_s, timeout_s, command, figures, failures, error}``; ``status`` is ``ok``,
``FAIL`` (non-zero exit, no figures, or a correctness flag: :func:`judge`), ``TIMEOUT`` or ``SKIPPED``.
At the end every block's log and figures are tarred into ``OUT/logs.tar.gz`` and a short table is written to
``OUT/table.md`` and printed last. Three files: within the device tool's 8 files of 16 MiB, one folder deep.
Large outputs (checkpoints, the Triton cache) stay in ``--work`` (default: a new temporary folder).

Blocks (:func:`plan`; ``--dry-run`` lists them with their timeouts and commands, imports no torch, writes nothing):

1. ``env``: versions, capability, the shared-memory limit per block, bf16 GEMM and copy rates (``probes.py``);
   pulp / highspy / pytest / fla are reported, never required.
2. ``kda_triton``: the Triton KDA fwd+bwd against the fp64 recurrence at k3_tiny's shape (rel-L2 of the output,
   the state and all gradients; compile seconds; each compiled kernel's registers, spills, shared memory).
3. ``train_k3_100m``: ``moonrt train`` of ``k3_100m.yaml`` in bf16 with ``kernels.kda=triton`` for 40 steps,
   stopped at 20 (checkpointed) and resumed (tokens/s, model TFLOP/s, peak memory, ``resume_ok``).
4. ``kda_model``: k3_tiny on one teacher-forced batch with the same weights, Triton (and fla when available) vs
   torch KDA (the loss and every gradient), then each backend's KDA fwd+bwd time at K3's head size.
5. ``fp8``, 6. ``moonep``: the FP8 codec's and MoonEP planner's kernels on CUDA, bitwise against the CPU ones.
7. ``memory``: the host offload tier on CUDA (GB/s, bit-exact round trips).
8. ``train_k3_tiny``: k3_tiny for 50 steps in bf16 on the corpus this check builds from the checkout
   (:func:`build_corpus`), its losses beside the CPU fp32 reference recorded on the same corpus
   (``k3_tiny_cpu_fp32.json``; compared only when its ``corpus_sha256`` matches; regenerate it with
   ``--cpu-reference``).

All Triton compiles of the blocks share one cache (``TRITON_CACHE_DIR`` under ``--work``): a kernel compiled by
one block is loaded from disk by the next. The interpreter is ``$PYTHON``, else the checkout's ``.venv/bin/python``,
else ``python3`` (``check.sh`` picks it); it needs torch with CUDA and moonrt's GPU-path dependencies (numpy,
pyyaml, numba, safetensors, tqdm, triton), all in the device image; moonrt comes from this checkout
(``PYTHONPATH``). Exit code: 0 when every block is ok, 1 otherwise, 2 on bad input.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import hashlib
import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
REFERENCE = HERE / "k3_tiny_cpu_fp32.json"

LEASE_S = 900
"""One device lease: 15 minutes of device time, start-up and idle included (the device tool's limits)."""
STARTUP_S = 180
"""Allowance for the machine's start and the transfers of the tree and of ``$OUT`` ("a minute or more")."""
PER_CALL_S = 600
"""The device tool's limit on one command."""
DEADLINE_S = 420
"""Seconds of block work (the summed block timeouts fit it: a test checks)."""
TAIL_S = 20
"""After the deadline: tarring the logs and printing the table."""

CORPUS_GLOB = "moonrt/**/*.py"
"""The corpus of the CPU-vs-GPU loss comparison: the checkout's moonrt sources, sorted by path, concatenated
(never the standard library, whose files differ between Python 3.11 and 3.12)."""

TRAIN_STEPS_100M, UNTIL_100M = 40, 20


@dataclasses.dataclass
class Block:
    name: str
    argv: list[str]
    timeout_s: float
    what: str = ""
    headline: tuple[str, ...] = ()
    """Figure paths (dotted) the table shows."""


def corpus_files(root: Path = ROOT) -> list[Path]:
    return sorted(p for p in root.glob(CORPUS_GLOB) if p.is_file())


def build_corpus(path: Path, root: Path = ROOT) -> dict[str, Any]:
    """Write the loss-comparison corpus (:data:`CORPUS_GLOB`) to ``path``; returns its files, bytes and sha256."""
    files = corpus_files(root)
    data = b"".join(p.read_bytes() for p in files)
    path.write_bytes(data)
    return {"path": str(path), "files": len(files), "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def corpus_sha256(root: Path = ROOT) -> str:
    return hashlib.sha256(b"".join(p.read_bytes() for p in corpus_files(root))).hexdigest()


def plan(work: Path, py: str, corpus: Path, sha: str) -> list[Block]:
    """The blocks in priority order, writing their figures to ``work/blocks/<name>.json``."""
    probe = [py, str(HERE / "probes.py")]

    def js(name: str) -> list[str]:
        return ["--json", str(work / "blocks" / f"{name}.json")]

    train = [*probe, "train", "--work", str(work / "train")]
    return [
        Block("env", [*probe, "env", *js("env")], 20, "versions, capability, shared memory per block, GEMM and copy "
              "rates", ("device", "capability", "shared_mem_per_block_optin", "bf16_tflops")),
        Block("kda_triton", [*probe, "kda_triton", *js("kda_triton")], 75, "Triton KDA fwd+bwd vs the fp64 "
              "recurrence at k3_tiny's shape; compile s; cubin resources", ("max_rel_l2", "compile_s",
                                                                             "second_call_s")),
        Block("train_k3_100m", [*train, "--name", "k3_100m", "--steps", str(TRAIN_STEPS_100M), "--until",
                                str(UNTIL_100M), *js("train_k3_100m"), "--", "--config", str(HERE / "k3_100m.yaml")],
              140, f"moonrt train k3_100m bf16, Triton KDA, {TRAIN_STEPS_100M} steps, checkpoint at {UNTIL_100M} "
              "+ resume", ("tokens_per_s", "model_tflops_per_s", "peak_mem_bytes", "resume_ok")),
        Block("kda_model", [*probe, "kda_model", *js("kda_model")], 60, "k3_tiny, one batch, same weights: Triton "
              "(fla) vs torch KDA loss and gradients; KDA fwd+bwd s at K3's head size",
              ("max_rel_l2", "k3_head_timing")),
        Block("fp8", [*probe, "fp8", *js("fp8")], 25, "FP8 codec kernels on CUDA, bitwise vs the CPU codec",
              ("bf16.quantize_GBps", "bf16.bitwise_equal_cpu_codec")),
        Block("moonep", [*probe, "moonep", *js("moonep")], 25, "MoonEP planners on CUDA at K3's shape, identical "
              "plans", ("device_plan_device_ms", "plans_identical", "plan_device_identical")),
        Block("memory", [*probe, "memory", *js("memory")], 20, "host offload tier on CUDA: GB/s, bit-exact",
              ("offload_GBps", "restore_GBps", "bit_exact")),
        Block("train_k3_tiny", [*train, "--name", "k3_tiny", "--steps", "50", "--reference", str(REFERENCE),
                                "--corpus-sha256", sha, *js("train_k3_tiny"), "--", "--eval-every", "25",
                                "--corpus", str(corpus)], 55,
              "moonrt train k3_tiny bf16 on the checkout corpus vs the CPU fp32 reference",
              ("tokens_per_s", "eval_loss_vs_cpu_fp32", "mean_loss_vs_cpu_fp32")),
    ]


def command_line(block: Block) -> str:
    return shlex.join(block.argv)


# ---- judging -------------------------------------------------------------------------------------------------------

FLAG = re.compile(r"(bit_exact|bitwise_equal\w*|\w*identical|\w*_ok|\w*finite)$")
"""Correctness flags: a key matching this whose value (or any boolean under it) is False fails its block."""


def judge(figures: dict[str, Any]) -> list[str]:
    """Why a block's figures fail it (empty: they pass): a correctness flag (:data:`FLAG`) that is False; a
    ``rel_l2*`` figure (a number, or a dict of numbers) above the ``rel_l2_bound`` beside it, or not finite; an
    ``error`` string anywhere; a top-level ``ok`` that is False."""
    out: list[str] = []
    if figures.get("ok") is False:
        out.append("ok is false")

    def flags(path: str, v: Any) -> None:
        if v is False:
            out.append(f"{path} is false")
        elif isinstance(v, dict):
            for k, x in v.items():
                flags(f"{path}.{k}", x)

    def walk(path: str, d: dict[str, Any]) -> None:
        bound = d.get("rel_l2_bound")
        for k, v in d.items():
            p = f"{path}.{k}" if path else k
            if FLAG.search(k):
                flags(p, v)
            elif k.startswith("rel_l2") and k != "rel_l2_bound":
                vals = v.items() if isinstance(v, dict) else [("", v)]
                for name, x in vals:
                    where = f"{p}.{name}" if name else p
                    if not isinstance(x, (int, float)) or not math.isfinite(x):
                        out.append(f"{where} = {x} is not finite")
                    elif bound is None:
                        out.append(f"{where}: no rel_l2_bound beside it")
                    elif x > bound:
                        out.append(f"{where} = {x:.3g} > bound {bound:.3g}")
            elif k == "error" and isinstance(v, str):
                out.append(f"{p}: {v[:200]}")
            elif isinstance(v, dict):
                walk(p, v)

    walk("", figures)
    return out


def max_rel_l2(figures: dict[str, Any]) -> float | None:
    """The largest judged rel-L2 figure (the table's summary of a KDA block)."""
    vals: list[float] = []

    def walk(d: dict[str, Any]) -> None:
        for k, v in d.items():
            if k.startswith("rel_l2") and k != "rel_l2_bound":
                vals.extend(x for x in (v.values() if isinstance(v, dict) else [v]) if isinstance(x, (int, float)))
            elif isinstance(v, dict):
                walk(v)

    walk(figures)
    return max(vals) if vals else None


# ---- running -------------------------------------------------------------------------------------------------------


def run_block(block: Block, work: Path, timeout_s: float, env: dict[str, str]) -> dict[str, Any]:
    """Run ``block`` as its own process group (killed whole on timeout: SIGTERM, then SIGKILL after 5 s), its
    output in ``work/logs/<name>.log``; returns its record (module docstring)."""
    log = work / "logs" / f"{block.name}.log"
    rec: dict[str, Any] = {"block": block.name, "what": block.what, "command": command_line(block),
                           "timeout_s": round(timeout_s, 1)}
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(block.argv, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rec["rc"] = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            for sig, grace in ((signal.SIGTERM, 5), (signal.SIGKILL, None)):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=grace)
                    break
                except subprocess.TimeoutExpired:
                    continue
            proc.wait()
            rec["rc"] = None
            rec["error"] = f"timed out after {timeout_s:.0f} s"
    rec["wall_s"] = round(time.perf_counter() - t0, 2)
    if rec["rc"] not in (0, None):
        tail = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()][-1:]
        rec["error"] = f"exit {rec['rc']}" + (f": {tail[0][:300]}" if tail else "")
    try:
        rec["figures"] = json.loads((work / "blocks" / f"{block.name}.json").read_text())
    except (OSError, ValueError) as exc:
        rec.setdefault("error", f"no figures ({type(exc).__name__}: {str(exc)[:200]})")
    rec["failures"] = judge(rec.get("figures", {}))
    if rec["rc"] is None:
        rec["status"] = "TIMEOUT"
    else:
        rec["status"] = "ok" if rec["rc"] == 0 and "error" not in rec and not rec["failures"] else "FAIL"
    return rec


def _get(fig: dict[str, Any], path: str) -> Any:
    if path == "max_rel_l2":
        return max_rel_l2(fig)
    for part in path.split("."):
        if not isinstance(fig, dict) or part not in fig:
            return None
        fig = fig[part]
    return fig


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_fmt(x)}" for k, x in v.items() if not isinstance(x, list)) + "}"
    return str(v)


def table(records: list[dict[str, Any]], blocks: dict[str, Block]) -> str:
    lines = ["| block | status | wall s | figures | why it failed |", "|---|---|---|---|---|"]
    for r in records:
        fig = r.get("figures", {})
        heads = blocks[r["block"]].headline if r["block"] in blocks else ()
        shown = "; ".join(f"{h}={_fmt(_get(fig, h))}" for h in heads if _get(fig, h) is not None)
        why = "; ".join(([r["error"]] if r.get("error") else []) + r.get("failures", [])[:3])
        lines.append(f"| {r['block']} | {r['status']} | {_fmt(r.get('wall_s', 0.0))} | {shown.replace('|', '/')} | "
                     f"{why.replace('|', '/')[:300]} |")
    return "\n".join(lines) + "\n"


def tar_logs(work: Path, dest: Path, max_file_bytes: int = 4 * 2**20) -> list[str]:
    """Tar ``work/logs``, ``work/blocks`` and the train metrics into ``dest`` (gzip); files over
    ``max_file_bytes`` are left out (returned), so the tarball stays under the device tool's 16 MiB per file."""
    left_out = []
    with tarfile.open(dest, "w:gz") as tar:
        for sub in ("logs", "blocks", "train"):
            base = work / sub
            files = sorted(base.glob("*.log" if sub == "logs" else "*.json" if sub == "blocks" else "*.jsonl"))
            for p in files:
                if p.stat().st_size > max_file_bytes:
                    left_out.append(str(p))
                    continue
                tar.add(p, arcname=f"{sub}/{p.name}")
    return left_out


def cpu_reference(py: str, work: Path) -> int:
    """Regenerate :data:`REFERENCE`: k3_tiny, 50 steps, fp32 on CPU, on :func:`build_corpus`'s corpus."""
    work.mkdir(parents=True, exist_ok=True)
    corpus = build_corpus(work / "corpus.txt")
    run, metrics = work / "k3_tiny_cpu", work / "k3_tiny_cpu.metrics.jsonl"
    argv = ["-m", "moonrt.cli", "train", "--device", "cpu", "--steps", "50", "--eval-every", "25", "--corpus",
            corpus["path"], "--out", str(run), "--metrics", str(metrics), "--no-progress"]
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    if subprocess.run([py, *argv], cwd=ROOT, env=env, check=False).returncode != 0:
        print(f"{shlex.join([py, *argv])}: failed", file=sys.stderr)
        return 1
    recs = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    tps = sorted(r["tokens_per_s"] for r in recs[5:])
    ver = subprocess.run([py, "-c", "import sys, torch; print(sys.version.split()[0], torch.__version__)"],
                         capture_output=True, text=True, check=True).stdout.split()
    ref = {"what": "k3_tiny, moonrt train --steps 50 --eval-every 25 (seed 0, fp32, device cpu) on the checkout "
                   f"corpus ({CORPUS_GLOB} sorted, concatenated; the last 5% held out): the CPU fp32 reference of "
                   "the GPU check's train_k3_tiny block",
           "command": "python benchmarks/gpu/check.py --cpu-reference",
           "recorded": f"{datetime.date.today().isoformat()}, Python {ver[0]}, torch {ver[1]}",
           "corpus_glob": CORPUS_GLOB, "corpus_files": corpus["files"], "corpus_bytes": corpus["bytes"],
           "corpus_sha256": corpus["sha256"], "loss": [r["loss"] for r in recs],
           "eval_loss": {str(r["step"]): r["eval_loss"] for r in recs if r.get("eval_loss") is not None},
           "tokens_per_s_median": tps[len(tps) // 2]}
    REFERENCE.write_text(json.dumps(ref, indent=1) + "\n")
    print(f"wrote {REFERENCE} (corpus sha256 {corpus['sha256'][:12]}..., {corpus['bytes']} bytes)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/gpu/check.sh", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "runs" / "gpu-check"),
                        help="folder of results.jsonl, logs.tar.gz, table.md (default: $OUT, else runs/gpu-check); "
                        "must not hold a results.jsonl")
    parser.add_argument("--work", help="folder for checkpoints, the Triton cache, logs (default: a new temp folder)")
    parser.add_argument("--dry-run", action="store_true", help="list the blocks, timeouts and commands; run nothing")
    parser.add_argument("--deadline-s", type=float, default=DEADLINE_S, help=f"seconds of work (default {DEADLINE_S})")
    parser.add_argument("--only", default="", help="comma-separated blocks to run (default: all, in order)")
    parser.add_argument("--python", default=sys.executable, help="interpreter of the blocks (default: this one)")
    parser.add_argument("--cpu-reference", action="store_true", help=f"regenerate {REFERENCE.name} here on CPU")
    args = parser.parse_args(argv)
    out = Path(args.out).absolute()
    work = Path(args.work).absolute() if args.work else None
    if args.cpu_reference:
        return cpu_reference(args.python, work or Path(tempfile.mkdtemp(prefix="moonrt-cpu-ref-")))
    placeholder = Path("WORK")
    blocks = plan(work or placeholder, args.python, (work or placeholder) / "corpus.txt",
                  "SHA256" if args.dry_run else corpus_sha256())
    names = [b.name for b in blocks]
    only = [n for n in args.only.split(",") if n]
    bad = [n for n in only if n not in names]
    if bad:
        print(f"--only = {args.only!r}: unknown block {bad[0]!r}; expected some of {', '.join(names)}",
              file=sys.stderr)
        return 2
    if only:
        blocks = [b for b in blocks if b.name in only]
    if args.dry_run:
        total = sum(b.timeout_s for b in blocks)
        print(f"GPU check (dry run): {len(blocks)} blocks, summed timeouts {total:.0f} s, deadline "
              f"{args.deadline_s:.0f} s (+{TAIL_S} s to tar and print; lease {LEASE_S} s less {STARTUP_S} s "
              f"start-up); results: {out}/results.jsonl, logs: {out}/logs.tar.gz, table: {out}/table.md")
        for i, b in enumerate(blocks, 1):
            print(f"{i}. {b.name} (timeout {b.timeout_s:.0f} s): {b.what}\n   {command_line(b)}")
        return 0
    results = out / "results.jsonl"
    if results.exists():
        print(f"--out = {str(out)!r}: holds a results.jsonl; expected a folder without one", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    work = work or Path(tempfile.mkdtemp(prefix="moonrt-gpu-check-"))
    for sub in ("logs", "blocks", "train"):
        (work / sub).mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + args.deadline_s
    corpus = build_corpus(work / "corpus.txt")
    blocks = [b for b in plan(work, args.python, work / "corpus.txt", corpus["sha256"]) if b.name in
              [x.name for x in blocks]]
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
                        "TRITON_CACHE_DIR": str(work / "triton-cache"), "PYTHONUNBUFFERED": "1"}
    env.pop("TRITON_INTERPRET", None)
    print(f"[gpu-check] {len(blocks)} blocks, deadline {args.deadline_s:.0f} s; work {work}; corpus "
          f"{corpus['files']} files, {corpus['bytes']} bytes", flush=True)
    records = []
    for b in blocks:
        left = deadline - time.monotonic()
        if left < 5:
            rec = {"block": b.name, "what": b.what, "command": command_line(b), "status": "SKIPPED",
                   "timeout_s": b.timeout_s, "failures": [], "error": f"deadline of {args.deadline_s:.0f} s spent"}
        else:
            print(f"[gpu-check] {b.name} (timeout {min(b.timeout_s, left):.0f} s): {command_line(b)}", flush=True)
            rec = run_block(b, work, min(b.timeout_s, left), env)
        print(f"[gpu-check] {b.name}: {rec['status']}" + (f" in {rec['wall_s']:.1f} s" if "wall_s" in rec else "")
              + (f" ({'; '.join(([rec['error']] if rec.get('error') else []) + rec['failures'][:3])})"
                 if rec.get("error") or rec["failures"] else ""), flush=True)
        with open(results, "a") as f:
            f.write(json.dumps(rec, default=str) + "\n")
        records.append(rec)
    left_out = tar_logs(work, out / "logs.tar.gz")
    text = table(records, {b.name: b for b in blocks})
    (out / "table.md").write_text(text)
    failed = [r["block"] for r in records if r["status"] != "ok"]
    print(f"[gpu-check] {'not ok: ' + ', '.join(failed) if failed else 'all blocks ok'}; {results}"
          + (f"; left out of the tarball (too large): {', '.join(left_out)}" if left_out else ""))
    print(text, end="", flush=True)  # the table last: the device tool's output_tail ends with it
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
