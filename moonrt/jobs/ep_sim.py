"""``moonrt ep-sim``: simulate expert placement policies on a routing workload (K3_SYSTEMS §6).

For each step and MoE layer of a workload (synthetic, :func:`moonrt.scheduler.workload.synthetic`,
or a recorded trace ``.npz``, format in :mod:`moonrt.scheduler.workload`), every policy places the
layer's token-expert assignments on the R EP ranks and we measure:

* rank balance: max rank load / mean rank load (1.000 = perfect; MoonEP's contract, §6.1);
* ``maxvio`` of the routing itself: ``max_e(T_e / mean_T) - 1`` (policy independent);
* copied experts per rank (mean / max): MoonEP's occupied slots; EPLB's redundant replicas;
* expert-weight bytes to prefetch: MoonEP fetches every copied expert per layer-step; EPLB moves the
  replicas that change place at a re-plan; no redundancy fetches nothing;
* token bytes moved between ranks by dispatch (one direction; combine moves as much back); for MoonEP also
  the rows and bytes with one row per (token, destination rank) (``parallel.ep_dedup``, modelled from the counts
  by :func:`moonrt.scheduler.sim.dedup_rows`: a line under the table, ``token_*_dedup`` in ``summary.json``);
* planner time per layer.

Policies: ``none`` (contiguous home placement), ``eplb`` (DeepSeek EPLB re-planned every
``--eplb-every`` steps from an exponential moving average of past loads, ``E`` redundant replicas =
the same ``E/R`` extra slots per rank as MoonEP), ``eplb-oracle`` (EPLB planned from the current
step's loads: perfect prediction, an upper bound on what prediction can reach) and ``moonep``.
With no arguments it runs a K3-sized default: E=896, k=16, R=64, s=4096, lognormal skew, ±30%
per-step drift. The MB columns size tokens and experts with ``--hidden``, ``--expert-params`` and
``--bytes-per-elem``, else those a trace records of its model, else K3's (a trace without them: a warning line).
A workload of one EP rank (the trace of a single process) cannot show imbalance: a warning line, and
``imbalance_observable: false`` and the warnings in ``summary.json``. Output: a table on stdout, ``summary.json``
and ``ep_sim.png`` in ``--out``, each created exclusively (never through a symlink); existing ones are refused
before any work unless ``--force``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

from moonrt.config import existing_outputs, write_new
from moonrt.scheduler.hardware import HardwareProfile, builtin_profiles, load_profile, profile_from_dict
from moonrt.scheduler.sim import (
    K3_EXPERT_PARAMS,
    K3_LATENT,
    POLICIES,
    WorkloadLike,
    estimate_memory_bytes,
    format_table,
    format_time_table,
    plot,
    simulate,
    summarize,
)
from moonrt.scheduler.steptime import PASSES
from moonrt.scheduler.workload import SyntheticStream, TraceStream, open_trace


def resolve_profile(spec: str) -> HardwareProfile:
    """``--hardware`` value: a YAML path, a built-in name (``h800-ib400``) or ``cpu-local`` (measured now)."""
    if spec == "cpu-local":  # torch.distributed is imported only for this
        from moonrt.jobs.selftest.cli import measure_local_profile

        return profile_from_dict(measure_local_profile(), "cpu-local (measured)")
    builtin = builtin_profiles()
    if spec in builtin and not Path(spec).exists():
        return load_profile(builtin[spec])
    return load_profile(spec)


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload (synthetic unless --trace)")
    g.add_argument("--trace", type=Path, default=None,
                   help="routing trace .npz (counts [steps, layers, R, E]), read one step at a time; its shape "
                        "sets E, R, k, steps and layers (flags given as well must agree)")
    g.add_argument("--workload", choices=("uniform", "lognormal", "zipf"), default="lognormal")
    g.add_argument("--sigma", type=float, default=1.0, help="lognormal popularity sigma")
    g.add_argument("--zipf-s", type=float, default=1.0, help="zipf popularity exponent")
    g.add_argument("--drift", type=float, default=0.3, help="per-step relative fluctuation of expert shares")
    for flag, default, text in _SHAPE_FLAGS:
        g.add_argument(flag, type=int, default=None, help=f"{text} (default {default})")
    g.add_argument("--seed", type=int, default=0)
    q = p.add_argument_group("policies and sizes")
    q.add_argument("--policies", default=",".join(POLICIES), help=f"comma list from {','.join(POLICIES)}")
    q.add_argument("--num-slots", type=int, default=None, help="MoonEP slots per rank B (default E/R)")
    q.add_argument("--eplb-every", type=int, default=4, help="EPLB re-plans every N steps (and at step 1)")
    q.add_argument("--warmup", type=int, default=1,
                   help="steps left out of the summary (step 0: EPLB has no history to predict from)")
    q.add_argument("--eplb-alpha", type=float, default=0.2, help="EPLB moving-average weight of the newest step")
    q.add_argument("--eplb-redundant", type=int, default=None, help="EPLB redundant replicas (default E)")
    q.add_argument("--hidden", type=int, default=None, help="activation width crossing ranks (default: the "
                   f"trace's model, else K3's latent {K3_LATENT})")
    q.add_argument("--expert-params", type=int, default=None, help="parameters per routed expert (default: the "
                   f"trace's model, else K3's {K3_EXPERT_PARAMS})")
    q.add_argument("--bytes-per-elem", type=int, default=None, help="bytes per activation/weight element (default: "
                   "the trace's model, else 2: bf16)")
    h = p.add_argument_group("step-time model")
    h.add_argument("--hardware", default=None,
                   help="hardware profile: a YAML file, a built-in name (h800-ib400, h200-ib400) or 'cpu-local' "
                        "(measured now: gloo all_to_all bandwidth + GEMM micro-benchmark); prints the estimated "
                        "MoE layer time per policy and MoonEP's speed-up")
    h.add_argument("--passes", choices=PASSES, default="fwd+bwd", help="time forward only or forward + backward")
    m = p.add_argument_group("run")
    m.add_argument("--max-memory-gib", type=float, default=None,
                   help="refuse to start when the estimated peak memory exceeds this (default: the machine's "
                        "available memory)")
    m.add_argument("--out", type=Path, default=Path("runs/ep-sim"),
                   help="output directory (summary.json, ep_sim.png; existing ones are refused unless --force)")
    m.add_argument("--force", action="store_true", help="replace existing output files (default: refuse them, exit 2)")
    m.add_argument("--no-plot", action="store_true", help="skip the PNG")
    m.add_argument("--quiet", action="store_true",
                   help="no progress bar (there is none either when stderr is not a terminal: logs, pipes)")


_SHAPE_FLAGS = (("--experts", 896, "E, routed experts (K3: 896)"), ("--ranks", 64, "R, EP ranks"),
                ("--top-k", 16, "k (K3: 16)"), ("--tokens", 4096, "s, tokens per rank per layer"),
                ("--steps", 24, "steps"), ("--layers", 3, "MoE layers simulated (K3 has 92; a sample suffices)"))


def available_memory_bytes() -> int:
    """Memory this process can use without swapping: ``MemAvailable`` (Linux), else physical memory."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def _policies(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [n for n in names if n not in POLICIES]
    if bad or not names:
        raise ValueError(f"--policies: {text!r}, expected a comma list from {POLICIES}")
    return names


def _int_arg(flag: str, v: object, lo: int) -> None:
    if not isinstance(v, int) or v < lo:
        raise ValueError(f"{flag}: {v!r}, expected an integer >= {lo}")


def _workload(args: argparse.Namespace) -> WorkloadLike:
    """The workload the flags describe (synthetic stream or trace stream), flags checked."""
    given = {f: getattr(args, f[2:].replace("-", "_")) for f, _, _ in _SHAPE_FLAGS}
    for flag, v in given.items():
        if v is not None:
            _int_arg(flag, v, 0 if flag == "--tokens" else 1)
    if args.trace is not None:
        wl = open_trace(args.trace)
        T, L, R, E = wl.shape
        have = {"--steps": T, "--layers": L, "--ranks": R, "--experts": E, "--top-k": wl.top_k}
        for flag, v in have.items():
            if given[flag] is not None and given[flag] != v:
                more = ("; a trace of one process has one EP rank: for a trace of N ranks record it from an --ep N "
                        "run (moonrt launch -n N -- moonrt train --ep N --routing-trace FILE), or simulate N ranks "
                        "without --trace" if flag == "--ranks" and v == 1 else "")
                raise ValueError(f"{flag}: {given[flag]}, but trace {args.trace} has {flag[2:]} = {v} (counts "
                                 f"[steps, layers, R, E] = {list(wl.shape)}, top_k = {wl.top_k}); expected the "
                                 f"trace's value or no flag{more}")
        if given["--tokens"] is not None:
            raise ValueError(f"--tokens: {given['--tokens']}, but a trace sets tokens per rank itself (row sums / k); "
                             "expected no --tokens with --trace")
        if E % R:
            raise ValueError(f"{args.trace}: E={E} experts is not divisible by R={R} ranks; expected E % R == 0")
        return wl
    v = {f: (given[f] if given[f] is not None else d) for f, d, _ in _SHAPE_FLAGS}
    if v["--experts"] % v["--ranks"]:
        raise ValueError(f"--experts: {v['--experts']} is not divisible by --ranks {v['--ranks']}; expected "
                         "E % R == 0 (each rank is home to E/R experts)")
    if v["--top-k"] > v["--experts"]:
        raise ValueError(f"--top-k: {v['--top-k']}, expected <= --experts ({v['--experts']})")
    if args.seed < 0:
        raise ValueError(f"--seed: {args.seed}, expected an integer >= 0 (numpy's default_rng seed)")
    for flag, x in (("--sigma", args.sigma), ("--zipf-s", args.zipf_s)):
        if not (math.isfinite(x) and x >= 0):
            raise ValueError(f"{flag}: {x}, expected a finite number >= 0")
    if not 0.0 <= args.drift < 1.0:
        raise ValueError(f"--drift: {args.drift}, expected 0 <= drift < 1 (relative per-step fluctuation of shares)")
    return SyntheticStream(args.workload, v["--experts"], v["--ranks"], v["--top-k"], v["--tokens"], v["--steps"],
                           v["--layers"], args.sigma, args.zipf_s, args.drift, args.seed)


def _check_options(args: argparse.Namespace, R: int, E: int, T: int) -> None:
    if args.num_slots is not None:
        _int_arg("--num-slots", args.num_slots, 0)
    _int_arg("--eplb-every", args.eplb_every, 1)
    if not 0 <= args.warmup < T:
        raise ValueError(f"--warmup: {args.warmup}, expected 0 <= warmup < steps ({T})")
    if not 0.0 < args.eplb_alpha <= 1.0:
        raise ValueError(f"--eplb-alpha: {args.eplb_alpha}, expected 0 < alpha <= 1")
    if args.eplb_redundant is not None and (args.eplb_redundant < 0 or (E + args.eplb_redundant) % R):
        raise ValueError(f"--eplb-redundant: {args.eplb_redundant}, expected >= 0 with (E + redundant) % R == 0 "
                         f"(E={E}, R={R})")
    for flag in ("--hidden", "--expert-params", "--bytes-per-elem"):
        if getattr(args, flag[2:].replace("-", "_")) is not None:
            _int_arg(flag, getattr(args, flag[2:].replace("-", "_")), 1)
    if args.max_memory_gib is not None and not (math.isfinite(args.max_memory_gib) and args.max_memory_gib > 0):
        raise ValueError(f"--max-memory-gib: {args.max_memory_gib}, expected a finite number of GiB > 0")


K3_SIZES = {"hidden": K3_LATENT, "expert_params": K3_EXPERT_PARAMS, "bytes_per_elem": 2}


def _sizes(args: argparse.Namespace, wl: WorkloadLike) -> tuple[dict[str, int], dict[str, str], list[str]]:
    """The ``hidden``, ``expert_params`` and ``bytes_per_elem`` the MB columns use, where each came from (a flag,
    the trace's recorded model, K3's default) and the warnings to print (a trace that records no model sizes)."""
    recorded = dict(wl.sizes) if isinstance(wl, TraceStream) else {}
    sizes, source = {}, {}
    for key, k3 in K3_SIZES.items():
        flag = getattr(args, key)
        sizes[key], source[key] = ((flag, f"--{key.replace('_', '-')}") if flag is not None else
                                   (recorded[key], "trace") if key in recorded else (k3, "K3 default"))
    warnings = []
    guessed = [k for k in K3_SIZES if source[k] == "K3 default"]
    if isinstance(wl, TraceStream) and guessed:
        warnings.append(f"warning: trace {wl.name} records no model sizes ({', '.join(guessed)}): the MB columns "
                        "assume K3-sized experts (" + ", ".join(f"--{k.replace('_', '-')} {sizes[k]}" for k in guessed)
                        + "); pass those flags for the model that routed it")
    return sizes, source, warnings


def _writable_dir(path: Path) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise ValueError(f"--out: {str(path)!r} is not a writable directory ({exc.strerror or exc})") from None


def run(args: argparse.Namespace) -> int:
    """``moonrt ep-sim``: every input error is one line on stderr naming the input, exit 2."""
    try:
        return _run(args)
    except ValueError as exc:
        print(f"moonrt ep-sim: {exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    policies = _policies(args.policies)
    wl = _workload(args)
    T, L, R, E = wl.shape
    _check_options(args, R, E, T)
    need = estimate_memory_bytes(R, E, T, L, policies, args.eplb_redundant, args.hardware is not None)
    limit = available_memory_bytes() if args.max_memory_gib is None else int(args.max_memory_gib * 2**30)
    if need > limit:
        src = "--max-memory-gib" if args.max_memory_gib is not None else "available memory (--max-memory-gib)"
        raise ValueError(f"estimated peak memory {need / 2**30:.1f} GiB for R={R}, E={E}, {T} steps x {L} layers, "
                         f"policies {','.join(policies)} exceeds the {src} limit of {limit / 2**30:.1f} GiB; expected "
                         "fewer ranks/experts/steps, fewer policies or a larger --max-memory-gib")
    _writable_dir(args.out)
    outputs = [args.out / "summary.json", *([] if args.no_plot else [args.out / "ep_sim.png"])]
    found = [] if args.force else existing_outputs(outputs)
    if found:
        raise ValueError(f"--out: {found[0]} exists; expected new output files (--force replaces them)")
    hw = resolve_profile(args.hardware) if args.hardware is not None else None
    sizes, source, warnings = _sizes(args, wl)
    if R == 1:
        warnings.append(f"warning: {'trace ' + wl.name if isinstance(wl, TraceStream) else 'the workload'} has R=1 "
                        "EP rank: one rank cannot show imbalance (every policy's balance is 1.000); record the trace "
                        "from an --ep N run (moonrt launch -n N -- moonrt train --ep N --routing-trace FILE)")
    t0 = time.perf_counter()
    bar = not args.quiet and sys.stderr.isatty()  # the tqdm bar on a terminal only: no \r in logs and pipes
    res = simulate(wl, policies, num_slots=args.num_slots, eplb_every=args.eplb_every, eplb_alpha=args.eplb_alpha,
                   eplb_redundant=args.eplb_redundant, token_bytes=sizes["hidden"] * sizes["bytes_per_elem"],
                   expert_bytes=sizes["expert_params"] * sizes["bytes_per_elem"], progress=bar,
                   hardware=hw, expert_params=sizes["expert_params"], passes=args.passes)
    summary = summarize(res, policies, args.warmup)
    model = getattr(wl, "model", None)
    title = f"{wl.name}{f' ({model})' if model else ''}: E={E} R={R} k={wl.top_k} steps={T} layers={L}"
    for line in warnings:
        print(line)
    print(title)
    print(format_table(summary, float(res["maxvio"][args.warmup:].mean()), args.warmup))
    if hw is not None:
        print(format_time_table(summary, hw, args.passes))
    doc = {
        "workload": wl.name, "experts": E, "ranks": R, "top_k": wl.top_k, "steps": T, "layers": L,
        "policies": policies, "warmup": args.warmup, "summary": summary, "maxvio": res["maxvio"].tolist(),
        "per_step": {p: {k: v.tolist() for k, v in res[p].items()} for p in policies},
        "seconds": time.perf_counter() - t0, "estimated_memory_bytes": need,
        "model": model, "sizes": sizes, "sizes_from": source, "imbalance_observable": R > 1, "warnings": warnings,
    }
    if hw is not None:
        doc["hardware"] = hw.to_dict()
        doc["passes"] = args.passes
    try:
        write_new(outputs[0], json.dumps(doc, indent=1), force=args.force)
        if not args.no_plot:
            write_new(outputs[1], lambda f: plot(res, policies, f, title), force=args.force)
    except OSError as exc:
        raise ValueError(f"--out: cannot write {exc.filename or args.out} ({exc.strerror or exc})") from None
    written = [str(p) for p in outputs]
    print(f"wrote {', '.join(written)} in {doc['seconds']:.1f} s")
    return 0
