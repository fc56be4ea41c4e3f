"""``moonrt train`` command line (job layer): flags, the job config they override, and the run that maps
outcomes to exit codes. The loop itself is :func:`moonrt.jobs.train.loop.train`.

The job config is layered (:func:`job_from_args`): the embedded default < ``--config`` < each ``--set KEY=VALUE``
< the dedicated flags; a flag and a ``--set`` of one field must agree (:mod:`moonrt.jobs.train.overrides`).
``--help`` lists the flags in sections (:data:`GROUPS`) and imports no torch: the training machinery is imported
by :func:`run`.

Exit codes: 0 done (or nothing to do); 1 diverged (a non-finite loss or gradient norm: the run stops before that
step's update and any save, one line on stderr); 2 bad input (one line on stderr: also an output that is not this
run's, an ``--out`` another run holds, a full disk);
75 (:data:`moonrt.cluster.preempt.PREEMPTED_EXIT`, ``EX_TEMPFAIL``) preempted: a stop signal (SIGTERM, SIGINT or
``--signal``) arrived, every rank finished its step and the checkpoint holds the last completed step, continue
with ``--resume`` (``--resume-if-exists`` does so whenever a checkpoint exists: the form for requeued jobs);
``128 + n`` aborted by a second signal ``n`` before the checkpoint was complete (the previous one is intact).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path
from typing import Any

from moonrt.cluster.preempt import PREEMPTED_EXIT, Aborted
from moonrt.config import ConfigError
from moonrt.jobs.train.config import JobConfig
from moonrt.jobs.train.overrides import SET_HELP, job_config
from moonrt.models import presets
from moonrt.ops.kernels import KernelUnavailable

# This module is imported for ``moonrt train --help``: nothing above imports torch (the registries are lazy, the job
# config torch-free); the training machinery is imported in run(). tests/jobs/test_cli_overrides.py checks it.

GROUPS: dict[str, tuple[str, tuple[str, ...]]] = {
    "job config": ("precedence, lowest first: the embedded default < --config < --set (in order) < the dedicated "
                   "flags below; a --set and a flag naming one field must agree", ("config", "set")),
    "model & data": ("", ("model", "corpus", "tokenizer", "token_dtype", "pack_documents", "eos_id")),
    "optimizer & schedule": ("", ("steps", "seed", "batch_size", "seq_len", "lr", "optimizer", "eval_every",
                                  "eval_windows", "grad_accum")),
    "parallel layout": ("", ("ep", "cp", "pp", "vpp", "microbatches", "schedule", "zero", "attn_res_comm")),
    "memory": ("", ("memory_policy", "gc_interval")),
    "quantization-aware training": ("", ("qat", "qat_block")),
    "outputs & checkpoints": ("", ("out", "metrics", "tensorboard", "peak_tflops", "routing_trace", "resume",
                                   "resume_if_exists", "resume_allow_changes", "init_from", "checkpoint_every",
                                   "keep_latest", "keep_every", "async_save")),
    "profiling": ("", ("profile_steps", "profile_ranks")),
    "distributed & device": ("", ("device", "deterministic", "dtype", "reduce_dtype", "dist_timeout", "threads")),
    "run control": ("", ("until", "signal", "no_progress", "log_every")),
}
"""``moonrt train --help`` sections: title -> (description, argparse dests). A flag whose dest is in no group
stays in argparse's plain options list (the test of the groups refuses that)."""


class _Grouped:
    """An argparse parser whose ``add_argument`` files each flag under its :data:`GROUPS` section (by dest); every
    other attribute is the parser's."""

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self._parser = parser
        self._group_of = {}
        for title, (desc, dests) in GROUPS.items():
            group = parser.add_argument_group(title, desc or None)
            self._group_of.update(dict.fromkeys(dests, group))

    def add_argument(self, *names: str, **kwargs: Any) -> argparse.Action:
        dest = kwargs.get("dest") or next((n for n in names if n.startswith("--")), names[0]).lstrip("-")
        target = self._group_of.get(dest.replace("-", "_"), self._parser)
        return target.add_argument(*names, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._parser, name)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser = _Grouped(parser)  # type: ignore[assignment]  # each flag into its --help section (GROUPS)
    parser.add_argument("--config", help="job config YAML (a JobConfig; all keys optional)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help=SET_HELP)
    parser.add_argument("--steps", type=int, help="optimizer steps (optim.steps)")
    parser.add_argument("--seed", type=int, help="data order and init seed (optim.seed)")
    parser.add_argument("--batch-size", type=int, help="sequences per global batch (optim.batch_size)")
    parser.add_argument("--seq-len", type=int, help="tokens per sequence (optim.seq_len)")
    parser.add_argument("--lr", type=float, help="peak learning rate (optim.lr)")
    parser.add_argument("--optimizer", choices=["adamw", "muon"], help="adamw, or muon: Per-Head Muon for the "
                        "model's matrices and AdamW for the rest, same lr (optim.optimizer; default adamw)")
    parser.add_argument("--eval-every", type=int, help="eval interval in steps (optim.eval_every)")
    parser.add_argument("--eval-windows", type=int, metavar="N", help="held-out windows of seq_len tokens per eval, "
                        "the same every time (optim.eval_windows; default 32)")
    parser.add_argument("--checkpoint-every", type=int, metavar="N", help="steps between checkpoints; the last step, "
                        "--until's and a stop signal's are saved too (optim.checkpoint_every; default 100)")
    parser.add_argument("--keep-latest", type=int, metavar="K", help="committed sharded checkpoints kept, newest "
                        "first; older ones are removed after each commit (checkpoint.keep_latest; default 2)")
    parser.add_argument("--keep-every", type=int, metavar="N", help="milestones: sharded checkpoints of steps that "
                        "are multiples of N are never removed (checkpoint.keep_every; default 0: none)")
    parser.add_argument("--async-save", action="store_true", default=None, help="write sharded checkpoints in the "
                        "background: host copy, then training goes on while every rank writes; the marker is "
                        "committed once all finished, at most one save in flight (checkpoint.async_save)")
    parser.add_argument("--profile-steps", metavar="A:B", help="torch.profiler trace of steps A to B as Chrome trace "
                        "JSON in OUT/profile/ (CUDA: a memory snapshot too) (log.profile_steps)")
    parser.add_argument("--profile-ranks", metavar="R,R", help="comma-separated ranks that profile --profile-steps "
                        "(log.profile_ranks; default 0)")
    parser.add_argument("--model", help="model preset: " + ", ".join(sorted(presets())))
    parser.add_argument("--corpus", help="text file, token file with --token-dtype, or a Megatron indexed dataset "
                        "PREFIX (PREFIX.bin/.idx) (default: stdlib sources; several by weight: data.blend)")
    parser.add_argument("--tokenizer", metavar="PATH", help="the model's tokenizer: a Hugging Face tokenizer.json or a "
                        "tiktoken BPE file, read from disk (never downloaded); its vocabulary must be the model's; a "
                        "text --corpus is tokenized once into an indexed dataset in data.cache_dir (default "
                        "OUT/data_cache) (data.tokenizer; needs moonrt[data])")
    parser.add_argument("--token-dtype", choices=["uint16", "uint32"], help="--corpus is a binary token file")
    parser.add_argument("--pack-documents", action="store_true", default=None, help="keep the documents packed in "
                        "each sequence apart: per-document KDA state and conv, block-diagonal MLA mask, no "
                        "cross-document targets (data.pack_documents; not with --cp or --pp)")
    parser.add_argument("--eos-id", type=int, help="token id (byte value for a text --corpus) that ends each "
                        "document, for --pack-documents with --corpus (data.eos_id)")
    parser.add_argument("--out", help="output dir for checkpoints and config.yaml (out_dir); one run at a time "
                        "(OUT/.moonrt.lock)")
    parser.add_argument("--init-from", metavar="HF_DIR", help="start from the weights of a Kimi K3 Hugging Face "
                        "directory in the released layout (config.json, safetensors shards and "
                        "model.safetensors.index.json; packed MXFP4 experts decoded); its config.json gives the "
                        "model config unless the job sets model_config; a resume needs no directory, one still "
                        "there must be unchanged (init_from, init_from_sha256)")
    parser.add_argument("--metrics", help="write JSON lines {step, loss, lr, tokens_per_s, ...} to this file")
    parser.add_argument("--resume", action="store_true", help="continue from OUT's newest checkpoint, "
                        "OUT/checkpoint.pt or the sharded OUT/checkpoint/ (the job config must match the "
                        "checkpoint's in every field that changes the trajectory; --steps may grow)")
    parser.add_argument("--resume-if-exists", action="store_true", help="--resume when OUT holds a checkpoint, "
                        "else start a new run (for jobs that may be requeued: moonrt sbatch --requeue); an interrupted "
                        "first sharded save of the same job counts as no checkpoint")
    parser.add_argument("--signal", help="stop signal besides SIGTERM and SIGINT, e.g. USR1: every rank finishes "
                        f"its step, checkpoints and exits with {PREEMPTED_EXIT} (stop_signal; default SIGTERM)")
    parser.add_argument("--resume-allow-changes", metavar="FIELDS", default="",
                        help="comma-separated job config fields that may differ from the checkpoint's on --resume "
                        "(e.g. lr,steps or optim.lr,data.corpus)")
    parser.add_argument("--until", type=int, help="stop after this step (checkpointed); schedule still uses --steps")
    parser.add_argument("--threads", type=int, help="torch threads per process, 0 = torch default (threads)")
    parser.add_argument("--gc-interval", type=int, help="Python garbage collection: off in the training loop, one "
                        "young-generation collection every N steps (gc_interval; default 50; 0 = automatic)")
    parser.add_argument("--qat", help="quantization-aware training: none or mxfp4 (MXFP4 weights, MXFP8 inputs of "
                        "the model's quantizable layers, K3: the experts; straight-through gradients) (qat)")
    parser.add_argument("--qat-block", type=int, help="elements per MX scale along the reduction axis, must divide "
                        "it (qat_block; default: the model preset's, k3: 32, the OCP MX block; k3_tiny: 8, as its "
                        "expert width 56 takes)")
    parser.add_argument("--memory-policy", help="activation memory policy YAML (memory_policy; moonrt.memory)")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bar or periodic step lines (the start, eval and summary lines still print)")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], help="where the job computes (device; default "
                        "auto = cuda where CUDA is available, else cpu; each rank on cuda:LOCAL_RANK)")
    parser.add_argument("--deterministic", action="store_true", default=None,
                        help="deterministic kernels (torch.use_deterministic_algorithms, cuBLAS's fixed workspace): "
                        "on a GPU, --resume is bit-identical only with it; on the CPU always (deterministic)")
    parser.add_argument("--dtype", help="forward compute dtype: fp32 or bf16 (autocast; parameters, gradients and "
                        "optimizer states stay fp32) (precision.compute; default fp32)")
    parser.add_argument("--reduce-dtype", help="dtype the gradient sums over ranks are sent and summed in: fp32 or "
                        "bf16 (bf16 arithmetic in the collective, written back into the fp32 gradients) "
                        "(precision.reduce; default fp32)")
    parser.add_argument("--dist-timeout", type=float, metavar="SECONDS", help="timeout of the rendezvous and every "
                        "collective (dist.timeout_s; wins over moonrt launch/sbatch --timeout; default: theirs, else "
                        "300)")
    parser.add_argument("--ep", type=int, help="expert-parallel degree: MoonEP over EP ranks, E/EP home experts "
                        "per rank (parallel.ep)")
    parser.add_argument("--routing-trace", help="write per-step, per-layer [R, E] routing counts to this .npz "
                        "(routing_trace; read by moonrt ep-sim --trace)")
    parser.add_argument("--cp", type=int, help="context-parallel degree: each sequence split over CP ranks, KCP for "
                        "KDA, latent all-gather for MLA (parallel.cp)")
    parser.add_argument("--pp", type=int, help="pipeline-parallel degree: the decoder layers cut into contiguous "
                        "stages over PP ranks (parallel.pp)")
    parser.add_argument("--vpp", type=int, help="virtual pipeline stages per PP rank (parallel.vpp; interleaved)")
    parser.add_argument("--microbatches", type=int, help="micro-batches per step of each pipeline "
                        "(parallel.microbatches)")
    parser.add_argument("--schedule", help="pipeline schedule: auto, gpipe, 1f1b, interleaved, zb, zbv "
                        "(parallel.schedule)")
    parser.add_argument("--zero", type=int, help="ZeRO stage: 0 (replicated AdamW states) or 1 (states and reduced "
                        "gradients sharded over each parameter's data-parallel replicas) (parallel.zero)")
    parser.add_argument("--attn-res-comm", help="AttnRes blocks between PP ranks: cached (only blocks the receiver "
                        "lacks) or naive (every completed block) (parallel.attn_res_comm)")
    # step accumulation and what a run reports (optim.grad_accum, log.*)
    parser.add_argument("--grad-accum", type=int, metavar="N", help="micro-steps per optimizer step on each rank: "
                        "gradients accumulated, one sync/clip/update per step (optim.grad_accum; default 1; not with "
                        "--pp)")
    parser.add_argument("--log-every", type=int, metavar="N", help="steps between plain progress lines when the "
                        "output is not a terminal, e.g. SLURM logs (log.log_every; default 10)")
    parser.add_argument("--tensorboard", metavar="DIR", help="write TensorBoard scalars (loss, lr, grad_norm, "
                        "eval_loss, tokens_per_s, mfu) to DIR, new or empty (log.tensorboard; needs tensorboard)")
    parser.add_argument("--peak-tflops", type=float, help="one device's peak TFLOP/s: metrics record mfu "
                        "(log.peak_tflops; without it only model_tflops_per_s)")


# Command-line flag (argparse dest) -> path of the JobConfig field it overrides.
_OVERRIDES: dict[str, tuple[str, ...]] = {
    "steps": ("optim", "steps"), "seed": ("optim", "seed"), "batch_size": ("optim", "batch_size"),
    "seq_len": ("optim", "seq_len"), "lr": ("optim", "lr"), "eval_every": ("optim", "eval_every"),
    "optimizer": ("optim", "optimizer"),
    "model": ("model",), "corpus": ("data", "corpus"), "token_dtype": ("data", "token_dtype"),
    "tokenizer": ("data", "tokenizer"),
    "pack_documents": ("data", "pack_documents"), "eos_id": ("data", "eos_id"),
    "out": ("out_dir",), "threads": ("threads",), "memory_policy": ("memory_policy",),
    "cp": ("parallel", "cp"), "ep": ("parallel", "ep"), "routing_trace": ("routing_trace",),
    "pp": ("parallel", "pp"), "vpp": ("parallel", "vpp"), "microbatches": ("parallel", "microbatches"),
    "schedule": ("parallel", "schedule"), "attn_res_comm": ("parallel", "attn_res_comm"),
    "zero": ("parallel", "zero"), "signal": ("stop_signal",),
    "gc_interval": ("gc_interval",), "device": ("device",),
    "deterministic": ("deterministic",), "dtype": ("precision", "compute"),
    "reduce_dtype": ("precision", "reduce"),
    "dist_timeout": ("dist", "timeout_s"),
    "grad_accum": ("optim", "grad_accum"), "log_every": ("log", "log_every"), "tensorboard": ("log", "tensorboard"),
    "peak_tflops": ("log", "peak_tflops"),
    "eval_windows": ("optim", "eval_windows"), "checkpoint_every": ("optim", "checkpoint_every"),
    "keep_latest": ("checkpoint", "keep_latest"), "keep_every": ("checkpoint", "keep_every"),
    "async_save": ("checkpoint", "async_save"), "profile_steps": ("log", "profile_steps"),
    "profile_ranks": ("log", "profile_ranks"),
    "qat": ("qat",), "qat_block": ("qat_block",), "init_from": ("init_from",),
}


def job_from_args(args: argparse.Namespace) -> JobConfig:
    """The job config: ``--config`` (or the default), then every ``--set``, then the dedicated flags
    (:data:`_OVERRIDES`); :func:`moonrt.jobs.train.overrides.job_config` (the precedence, the messages)."""
    flags = {path: (f"--{dest.replace('_', '-')}", getattr(args, dest)) for dest, path in _OVERRIDES.items()
             if getattr(args, dest, None) is not None}
    if ("log", "profile_ranks") in flags:
        flags["log", "profile_ranks"] = ("--profile-ranks", _rank_list(flags["log", "profile_ranks"][1]))
    return job_config(args.config, getattr(args, "set", None) or (), flags)


def _rank_list(text: str) -> list[int]:
    """``--profile-ranks 0,3`` -> ``[0, 3]``; ConfigError (one line) for anything else."""
    parts = [p.strip() for p in text.split(",")]
    if not all(p.isdigit() for p in parts):
        raise ConfigError(f"log.profile_ranks (--profile-ranks) = {text!r}: expected comma-separated ranks >= 0, "
                          "e.g. 0,3")
    return [int(p) for p in parts]


def run(args: argparse.Namespace) -> int:
    from moonrt.cluster.env import shutdown_distributed
    from moonrt.comm.parallelism import Parallelism
    from moonrt.jobs.train.assemble import launched, parallel_runtime, routing_trace
    from moonrt.jobs.train.loop import Diverged, NothingToDo, Preempted, train
    from moonrt.jobs.train.outputs import has_checkpoint

    allow = tuple(f.strip() for f in args.resume_allow_changes.split(",") if f.strip())
    try:
        if allow and not (args.resume or args.resume_if_exists):
            raise ConfigError("--resume-allow-changes: expected together with --resume")
        job = job_from_args(args)
        resume = args.resume or (args.resume_if_exists and bool(job.out_dir) and has_checkpoint(Path(job.out_dir)))
        if job.init_from is not None:  # its config.json is the model before the layout is checked and built
            from moonrt.jobs.checkpoint.hf import job_init
            from moonrt.jobs.checkpoint.store import resume_state

            gone = resume and not os.path.lexists(job.init_from)  # a resume needs no source: its checkpoint's model
            job_init(job, load=False, stored=resume_state(Path(job.out_dir))[1]["config"] if gone else None)
            job.validate()
        if job.data.tokenizer is not None:  # its vocabulary against the model's, before a job starts
            from moonrt.jobs.train.blend import job_tokenizer

            job_tokenizer(job)
        if job.parallel.world_size != 1 or launched():
            rt = parallel_runtime(job, progress=not args.no_progress)
        else:
            rt = Parallelism(parts=[routing_trace(job)] if job.routing_trace else [])
            if job.parallel.zero and not args.no_progress:
                print("moonrt train: parallel.zero = 1 with one process: nothing to shard, ZeRO-1 is a no-op",
                      flush=True)
        summary = train(job, rt=rt, metrics_path=args.metrics, resume=resume, until=args.until,
                        progress=not args.no_progress, resume_allow=allow,
                        requeued=args.resume_if_exists and not resume)
    except NothingToDo as exc:
        print(f"moonrt train: {exc}", flush=True)
        return 0
    except Preempted as exc:
        if rt.is_main:
            print(f"moonrt train: {exc}", flush=True)
        return PREEMPTED_EXIT
    except Diverged as exc:
        if rt.is_main:
            print(f"moonrt train: error: {exc}", file=sys.stderr, flush=True)
        return 1
    except Aborted as exc:
        print(f"moonrt train: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code
    except (ConfigError, ValueError, KernelUnavailable) as exc:  # KernelUnavailable: e.g. Triton not installed
        print(f"moonrt train: error: {exc}", file=sys.stderr, flush=True)
        return 2
    finally:
        shutdown_distributed()  # a multi-rank job's group: destroyed while the interpreter is alive
    if not math.isfinite(summary["train_loss"]):
        print(f"moonrt train: error: train loss is {summary['train_loss']} after step {summary['steps']} (diverged; "
              "try a lower --lr)", file=sys.stderr, flush=True)
        return 1
    return 0
