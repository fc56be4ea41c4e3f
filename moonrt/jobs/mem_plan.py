"""``moonrt mem-plan``: the memory-budget planner's command line (K3_SYSTEMS §8, §10; docs/MEMORY_MODEL.md).

A job: it looks the model up in the registry (:mod:`moonrt.models`: preset config, parameter sizes,
activation profile) and hands that description to the model-agnostic planner (:mod:`moonrt.memory.plan`).

Every flag is checked before any work: a bad value is one line on stderr naming the flag, the value
and what was expected, exit 2 (an unwritable ``--out`` included, and output files that exist already: each is
created exclusively, never through a symlink, replaced only with ``--force``). Exit 1 when a budget does not fit;
``--out`` then holds that budget's ``plan.json`` and ``plan.png`` (the plan at the minimum budget) but no policy
YAML, and the output says so with the minimum budget.

``--config JOB.yaml`` (and ``--set KEY=VALUE``, as ``moonrt train`` reads them: :mod:`moonrt.jobs.train.overrides`)
plans a ``moonrt train`` job: its model (preset, or ``model_config`` over it), its parallel layout (dp, pp, vpp,
ep, cp, microbatches, schedule: ``auto`` resolved as the job resolves it), ``optim.seq_len``, the sequences per
micro-batch (``optim.batch_size / (dp x ep x microbatches)``: the rows each data-parallel rank's micro-batch
holds, :class:`~moonrt.comm.parallelism.Parallelism`'s ``dp_size`` spans dp x ep) and ``optim.optimizer``. Every
flag given explicitly wins over the job (``--model`` then plans that preset's config); without ``--config`` the
flags' defaults are K3's production layout.

A plan uses only the storage tiers of ``--tiers``: by default those ``moonrt train --memory-policy`` runs
(:data:`moonrt.jobs.train.config.TRAIN_TIERS`: no ``remote``), so every policy YAML it writes is one train accepts.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

from moonrt.config import ConfigError, ParallelConfig, existing_outputs, schedule_cells_error, write_new
from moonrt.jobs.train.config import OPTIM_MOMENT_BYTES, TRAIN_TIERS, train_state_bytes
from moonrt.memory.model_memory import JobLayout
from moonrt.memory.plan import TIERS, Hardware, plan_memory
from moonrt.memory.plan_report import plan_json, plot, table
from moonrt.models import presets
from moonrt.models.spec import ModelSpec

DEFAULTS: dict[str, Any] = {"model": "k3", "dp": 1, "pp": 16, "vpp": 2, "ep": 64, "cp": 64, "micro_batch_size": 1,
                            "seq_len": 1048576, "microbatches": 32, "schedule": "interleaved", "optimizer": "muon"}
"""The layout flags' values when neither the command line nor a ``--config`` job gives them (K3's production
layout); the flags default to None so that an explicit one is told apart from the job's value."""


def dtype_bytes(dtype: str) -> int:
    """Element bytes of ``"bf16"`` / ``"fp32"``."""
    try:
        return {"bf16": 2, "fp32": 4}[dtype]
    except KeyError:
        raise ValueError(f"dtype = {dtype!r}: expected 'bf16' or 'fp32'") from None


def default_dtype(spec: ModelSpec, preset: str) -> str:
    """The dtype preset ``preset`` of ``spec`` is trained in (:attr:`ModelSpec.train_dtype`): what a plan assumes
    without ``--dtype``, whatever machine plans it (the planning machine's own dtype, fp32 on a CPU laptop, planned K3
    at twice its real parameter and activation bytes)."""
    return spec.train_dtype.get(preset, "fp32")


OPTIM_STATE_BYTES = dict(OPTIM_MOMENT_BYTES)
"""Persistent optimizer bytes per parameter (:data:`moonrt.jobs.train.config.OPTIM_MOMENT_BYTES`): Muon's one fp32
momentum or AdamW's two fp32 moments; no master copy, the fp32 parameters are the master weights
(:func:`moonrt.jobs.train.config.train_state_bytes`, torch AMP's layout, which ``moonrt train --dtype bf16`` holds).
Under ``muon`` the few non-matrix parameters that AdamW updates (embedding, LM head, norms, router: ~0.1% of K3's
parameters) are counted at Muon's 4 bytes."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument
    g("--config", default=None, help="plan a moonrt train job config YAML: its model, parallel layout, seq_len, "
      "micro-batch rows and optimizer (the flags below win when given)")
    g("--set", action="append", default=[], metavar="KEY=VALUE", help="with --config: override one job config "
      "field, as moonrt train --set (repeatable)")
    g("--model", default=None, help="model preset: k3 (the released 2.8T config) or k3_tiny (default: k3)")
    g("--dp", type=int, default=None, help="data-parallel replicas (ZeRO-1 shards optimizer states over dp*ep*cp; "
      "default 1)")
    g("--pp", type=int, default=None, help="pipeline-parallel ranks (default 16)")
    g("--vpp", type=int, default=None, help="virtual stages (model chunks) per pipeline rank; >= 2 for "
      "--schedule interleaved, 1 otherwise (default 2)")
    g("--ep", type=int, default=None, help="expert-parallel ranks, a divisor of num_experts (default 64)")
    g("--cp", type=int, default=None, help="context-parallel ranks splitting each sequence; divides --seq-len "
      "(default 64)")
    g("--micro-batch-size", type=int, default=None, help="sequences per micro-batch (default 1)")
    g("--seq-len", type=int, default=None, help="tokens per sequence before the CP split (default 1048576)")
    g("--microbatches", type=int, default=None, help="micro-batches per step (interleaved: a multiple of --pp; "
      "default 32)")
    g("--schedule", default=None, choices=["1f1b", "interleaved", "gpipe"],
      help="pipeline schedule whose in-flight micro-batches set the activation peak (default interleaved)")
    g("--optimizer", choices=sorted(OPTIM_STATE_BYTES), default=None,
      help="optimizer whose state ZeRO-1 shards: muon (fp32 momentum, 4 bytes per parameter; K3's) or "
      "adamw (two fp32 moments, 8); default muon (the fp32 parameters are the master weights)")
    g("--optim-bytes", type=int, default=None, help="optimizer-state bytes per parameter, sharded ZeRO-1 "
      "(default: --optimizer's)")
    g("--shard-grads", action="store_true",
      help="fp32 gradients sharded like the optimizer states (K3_SYSTEMS §10), else full per rank")
    g("--qat", choices=["none", "mxfp4"], default=None,
      help="quantization-aware training (moonrt train --qat): mxfp4 counts the fake-quantized weight copies per rank "
      "(qat_fake_quant) and prints the MXFP4 export size of the model's quantizable weights (default: the job's, "
      "else none)")
    g("--qat-block", type=int, default=None, help="elements per MX scale of the export size (default: the job's "
      "qat_block, else the model preset's: k3 32, k3_tiny 8)")
    g("--dtype", choices=["bf16", "fp32"], default=None,
      help="compute dtype of the activations (default: the model's training dtype, printed in the plan header: bf16 "
      "for k3, fp32 for k3_tiny); parameters, gradients and optimizer states are fp32 in both (moonrt train's AMP "
      "layout)")
    g("--profile", choices=["analytic", "traced"], default="analytic",
      help="activation profile: analytic (per-term formulas of moonrt's K3 layers, docs/MEMORY_MODEL.md) or "
      "traced (build each layer kind at the model's widths, measure a few tokens under the activation manager, "
      "scale; needs the memory for one layer of each kind)")
    g("--attention", choices=["math", "fused"], default=None,
      help="what MLA attention saves: math (CPU SDPA path: the [H, T, S] probabilities) or fused (GPU flash / "
      "memory-efficient kernels: output and log-sum-exp); default math in fp32, fused in bf16 (analytic only)")
    g("--probe-tokens", type=int, default=256, help="tokens per sequence of the traced probe forwards (default 256)")
    g("--probe-experts", type=int, default=32,
      help="experts of the traced MoE probe (at least top-k + 1; router scores rescaled to the real E; default 32)")
    g("--budget-gib", type=float, nargs="+", default=[80.0, 141.0],
      help="device memory per rank in GiB; several values plan each (default 80 141)")
    g("--reserve-gib", type=float, default=None,
      help="device GiB kept free for allocator fragmentation, workspaces and transient reloads, subtracted from "
      "each budget (default 5%% of the budget, at most 4)")
    g("--host-gib", type=float, default=200.0, help="host memory per rank for offloaded activations, GiB (default 200)")
    g("--host-gbs", type=float, default=50.0, help="device-host copy bandwidth per rank, GB/s (default 50)")
    g("--remote-gbs", type=float, default=150.0,
      help="bandwidth to the peer rank for remote offload, GB/s (default 150)")
    g("--disk-gib", type=float, default=0.0, help="NVMe per rank for offload, GiB; 0 disables the disk tier "
      "(default 0)")
    g("--tflops", type=float, default=400.0,
      help="effective dense throughput per rank, TFLOP/s: sets compute time, the copy overlap window and the "
      "recompute cost (default 400)")
    g("--tiers", default=",".join(TRAIN_TIERS), metavar="T1,T2,...",
      help=f"storage tiers the plan may use, comma-separated, of {', '.join(TIERS)} (keep always); default "
      f"{','.join(TRAIN_TIERS)}: the tiers moonrt train --memory-policy runs (remote offload needs a peer rank serving "
      "each owner, the ActivationManager API)")
    g("--solver", default="highs", choices=["highs", "greedy"], help="ILP with PuLP + HiGHS, or the greedy "
      "fallback (local tiers only; default highs)")
    g("--out", default="", help="directory for per-budget policy YAMLs, plan JSON and PNG (created if missing; "
      "existing files in it are refused unless --force)")
    g("--force", action="store_true", help="replace existing output files under --out (default: refuse them, exit 2)")


def _fail(msg: str) -> int:
    print(f"mem-plan: {msg}", file=sys.stderr)
    return 2


def _tiers(args: argparse.Namespace) -> list[str]:
    """``--tiers`` as a list (keep added: every plan may keep a class)."""
    return ["keep", *(t.strip() for t in args.tiers.split(",") if t.strip() != "keep")]


def _check_args(args: argparse.Namespace) -> str | None:
    """First bad flag as a one-line message, or None."""
    for name in ("dp", "pp", "vpp", "ep", "cp", "micro_batch_size", "seq_len", "microbatches", "optim_bytes",
                 "probe_tokens", "probe_experts"):
        v = getattr(args, name)
        if v is None:
            continue
        if v < (0 if name == "optim_bytes" else 1):
            return f"--{name.replace('_', '-')} = {v}: expected an integer >= {0 if name == 'optim_bytes' else 1}"
    too_many = schedule_cells_error(args.pp, args.vpp, args.microbatches)
    if too_many:
        return f"--microbatches = {args.microbatches}: expected {too_many}"
    for b in args.budget_gib:
        if not (math.isfinite(b) and b > 0):
            return f"--budget-gib = {b}: expected a positive, finite number of GiB"
    for name, positive in (("reserve_gib", False), ("host_gib", False), ("disk_gib", False), ("host_gbs", True),
                           ("remote_gbs", True), ("tflops", True)):
        v = getattr(args, name)
        if v is None:
            continue
        if not (math.isfinite(v) and (v > 0 if positive else v >= 0)):
            return f"--{name.replace('_', '-')} = {v}: expected a finite number {'> 0' if positive else '>= 0'}"
    for t in _tiers(args):
        if t not in TIERS:
            return (f"--tiers = {args.tiers!r}: {t!r} is not a tier; expected a comma-separated subset of "
                    f"{','.join(TIERS)}")
    if args.reserve_gib is not None:
        for b in args.budget_gib:
            if args.reserve_gib >= b:
                return (f"--reserve-gib = {args.reserve_gib:g}: expected less than --budget-gib {b:g} (the reserve is "
                        "device memory kept free for allocator fragmentation and workspaces)")
    if args.out:
        out = Path(args.out)
        try:
            out.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=out):
                pass
        except OSError as exc:
            return f"--out = {args.out!r}: expected a writable directory ({exc.strerror or exc})"
        if not args.force:
            names = ["plan.json", "plan.png", *(f"policy_rank{r}.yaml" for r in range(args.pp))]
            found = existing_outputs(out / f"budget{b:g}" / n for b in args.budget_gib for n in names)
            if found:
                return (f"--out = {args.out!r}: {found[0]} exists; expected new output files (--force replaces "
                        "them)")
    return None


def _from_job(args: argparse.Namespace) -> tuple[Any, str]:
    """Fill the layout flags left None from the ``--config`` job (then :data:`DEFAULTS`); return the model config
    to plan (the job's ``model_config`` unless ``--model`` is given; None: the preset's) and where the model came
    from, for messages. ConfigError naming the job field or the flag."""
    if args.config is None:
        if args.set:
            raise ConfigError(f"--set {args.set[0]}: expected together with --config (a moonrt train job config)")
        args.qat = args.qat or "none"  # qat_block None: the model preset's (run)
        for name, value in DEFAULTS.items():
            if getattr(args, name) is None:
                setattr(args, name, value)
        return None, "--model"
    from moonrt.jobs.train.overrides import job_config

    job = job_config(args.config, args.set)
    par = job.parallel
    schedule = par.pipeline_schedule
    if args.schedule is None and schedule not in ("1f1b", "interleaved", "gpipe"):
        raise ConfigError(f"parallel.schedule = {par.schedule!r} ({args.config}): expected 1f1b, interleaved or gpipe "
                          "(the schedules mem-plan models), or give --schedule")
    rows = job.optim.batch_size
    replicas = (args.dp or par.dp) * (args.ep or par.ep) * (args.microbatches or par.microbatches)
    if args.micro_batch_size is None and rows % replicas:
        raise ConfigError(f"optim.batch_size = {rows} ({args.config}): expected a multiple of dp x ep x microbatches "
                          f"= {replicas} (the rows of one micro-batch per rank), or give --micro-batch-size")
    job_values = {"model": job.model, "dp": par.dp, "pp": par.pp, "vpp": par.vpp, "ep": par.ep, "cp": par.cp,
                  "micro_batch_size": max(1, rows // replicas), "seq_len": job.optim.seq_len,
                  "microbatches": par.microbatches, "schedule": schedule, "optimizer": job.optim.optimizer}
    args.qat = args.qat or job.qat
    args.qat_block = job.qat_block if args.qat_block is None else args.qat_block
    model_given = args.model is not None
    for name, value in job_values.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if model_given:
        return None, "--model"
    return (job.model_cfg() if job.model_config is not None else None), f"model ({args.config})"


QAT_COPY_BYTES = 4
"""Bytes per element of a fake-quantized weight copy under QAT: the fp32 values of the MXFP4 weights (the fp32
parameters are the master weights, counted as ``params``)."""


def qat_summary(spec: ModelSpec, cfg: Any, block: int) -> dict[str, Any]:
    """What ``--qat mxfp4`` adds to a model, from its family's declared quantizable weights
    (:attr:`ModelSpec.qat_weights`): per group of weights (layer indices as ``*``) the parameters, MXFP4 code bytes
    (half a byte each) and E8M0 scale bytes (one per ``block``), and the export size: packed weights plus every other
    parameter in bf16 (the release) and in fp32 (``moonrt checkpoint export --mxfp4`` as written). ValueError: the
    family declares none, or ``block`` is not even or does not divide a reduction axis."""
    if spec.qat_weights is None:
        raise ValueError(f"model family {spec.name!r} declares no quantizable layers")
    problem = spec.qat_block_problem(cfg, block, flag="--qat-block")
    if problem:
        raise ValueError(f"qat block = {block}: expected {problem}")
    groups: dict[str, dict[str, int]] = {}
    for name, shape in spec.qat_weights(cfg).items():
        n = math.prod(shape)
        key = ".".join(re.sub(r"\.\d+(?=\.|$)", ".*", name).split(".")[:4])
        g = groups.setdefault(key, {"params": 0, "codes": 0, "scales": 0})
        g["params"] += n
        g["codes"] += n // 2
        g["scales"] += n // block
    quantized = sum(g["params"] for g in groups.values())
    packed = sum(g["codes"] + g["scales"] for g in groups.values())
    total = spec.param_count(cfg)
    return {"block": block, "groups": groups, "params": total, "quantized": quantized, "packed_bytes": packed,
            "export_bytes_bf16_rest": packed + 2 * (total - quantized),
            "export_bytes_fp32_rest": packed + 4 * (total - quantized)}


def qat_table(q: dict[str, Any], model: str) -> str:
    """:func:`qat_summary` as the lines ``mem-plan --qat mxfp4`` prints (GB = 1e9 bytes)."""
    lines = [f"== QAT mxfp4 (block {q['block']}): {model}, {q['quantized']:,} of {q['params']:,} parameters quantized",
             f"  {'weights':<40} {'params':>20} {'codes GB':>10} {'scales GB':>10}"]
    for key, g in q["groups"].items():
        lines.append(f"  {key:<40} {g['params']:>20,} {g['codes'] / 1e9:>10.3f} {g['scales'] / 1e9:>10.3f}")
    lines.append(f"  export: packed {q['packed_bytes'] / 1e9:.3f} GB + other parameters in bf16 = "
                 f"{q['export_bytes_bf16_rest'] / 1e9:.3f} GB (fp32, as moonrt checkpoint export writes them: "
                 f"{q['export_bytes_fp32_rest'] / 1e9:.3f} GB)")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    import yaml

    try:
        job_cfg, model_source = _from_job(args)
    except ConfigError as exc:
        return _fail(str(exc))
    models = presets()
    if args.model not in models:
        return _fail(f"{model_source} = {args.model!r}: expected one of {', '.join(models)}")
    bad = _check_args(args)
    if bad:
        return _fail(bad)
    spec = models[args.model]
    cfg = job_cfg if job_cfg is not None else spec.presets[args.model]()
    if args.qat_block is None:
        args.qat_block = spec.default_qat_block(args.model)
    qat = None
    if args.qat != "none":
        try:
            qat = qat_summary(spec, cfg, args.qat_block)
        except ValueError as exc:
            return _fail(f"--qat = {args.qat!r}: {exc}")
    try:
        memory = spec.memory_description()
    except ValueError as exc:
        return _fail(f"{model_source} = {args.model!r}: {exc}")
    if qat is not None:
        print(qat_table(qat, args.model))
    dtype = args.dtype or default_dtype(spec, args.model)
    source = "--dtype" if args.dtype else "training dtype"
    ab = dtype_bytes(dtype)
    par = ParallelConfig(dp=args.dp, pp=args.pp, vpp=args.vpp, ep=args.ep, cp=args.cp, schedule=args.schedule,
                         microbatches=args.microbatches)
    state = train_state_bytes(dtype, args.optimizer)  # what moonrt train holds per parameter (one definition)
    layout = JobLayout(parallel=par, micro_batch_size=args.micro_batch_size, seq_len=args.seq_len,
                       optim_bytes=state.optim if args.optim_bytes is None else args.optim_bytes,
                       shard_grads=args.shard_grads, act_bytes=ab, param_bytes=state.param, grad_bytes=state.grad,
                       qat_bytes=QAT_COPY_BYTES if qat else 0)
    try:
        layout.check(cfg.num_hidden_layers, cfg.num_experts)
        if args.profile == "traced":
            import torch

            if args.probe_experts < cfg.num_experts_per_token + 1:
                return _fail(f"--probe-experts = {args.probe_experts}: expected >= top-k + 1 "
                             f"({cfg.num_experts_per_token + 1})")
            profile = memory.traced_memory_profile(cfg, torch.float32 if dtype == "fp32" else torch.bfloat16,
                                                   layout.seq_len // par.cp, layout.micro_batch_size, par.cp,
                                                   args.probe_tokens, args.probe_experts)
        else:
            profile = memory.memory_profile(cfg, layout, args.attention)
    except ValueError as exc:
        return _fail(str(exc))
    sizes = memory.param_sizes(cfg)
    tiers = _tiers(args)
    rc = 0
    out = Path(args.out) if args.out else None
    attention = "" if args.profile == "traced" else f", attention {args.attention or ('math' if ab == 4 else 'fused')}"
    for b in args.budget_gib:
        hw = Hardware(budget_gib=b, reserve_gib=args.reserve_gib, host_gib=args.host_gib, host_gbs=args.host_gbs,
                      remote_gbs=args.remote_gbs, disk_gib=args.disk_gib, tflops=args.tflops)
        try:
            p = plan_memory(cfg, layout, sizes, hw, profile=profile, solver=args.solver, tiers=tiers)
        except ValueError as exc:
            return _fail(str(exc))
        header = (f"{args.model} {dtype} ({source}): dp={par.dp} pp={par.pp} vpp={par.vpp} ep={par.ep} cp={par.cp} "
                  f"seq={layout.seq_len} mbs={layout.micro_batch_size} m={par.microbatches} {par.pipeline_schedule}; "
                  f"{layout.tokens()} tokens/rank/micro-batch; {args.profile} profile{attention}; tiers "
                  f"{','.join(t for t in TIERS if t in tiers)}; budget {b:g} GiB "
                  f"(reserve {hw.reserve_gib:g} GiB)")
        print(f"== {header}")
        print(table(p))
        if p.feasible:
            print("policy (rank 0):")
            print(yaml.safe_dump(memory.memory_policy(p.ranks[0]), sort_keys=False).rstrip())
        else:
            rc = 1
        if out is not None:
            d = out / f"budget{b:g}"
            try:
                d.mkdir(parents=True, exist_ok=True)
                write_new(d / "plan.json", json.dumps(plan_json(p), indent=1, default=str), force=args.force)
                write_new(d / "plan.png", lambda f, p=p, h=header: plot(p, f, h), force=args.force)
                if p.feasible:
                    for r in p.ranks:
                        write_new(d / f"policy_rank{r.rank}.yaml", yaml.safe_dump(memory.memory_policy(r),
                                                                                    sort_keys=False), force=args.force)
            except OSError as exc:
                return _fail(f"--out = {args.out!r}: cannot write {d}: {exc.strerror or exc}")
            print(f"wrote {d}/ (plan.json, plan.png{', policy_rank*.yaml' if p.feasible else ''})")
            if not p.feasible:
                least = p.min_budget_gib  # rounded up to 0.1 GiB by the planner, as its message prints it
                print(f"{b:g} GiB does not fit: no policy written; " + (
                    f"the minimum budget is {least:g} GiB (--budget-gib {least:g} writes its policies)" if least
                    else "not even with every class offloaded or recomputed"))
    return rc


__all__ = ["add_arguments", "default_dtype", "dtype_bytes", "qat_summary", "qat_table", "run"]
