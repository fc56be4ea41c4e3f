"""``moonrt train`` command line (job layer): flags, the job config they override, and the run that maps
outcomes to exit codes. The loop itself is :func:`moonrt.jobs.train.loop.train`.

The job config is layered (:func:`job_from_args`): the embedded default < ``--config`` < each ``--set KEY=VALUE``
< the short flags; a flag and a ``--set`` of one field must agree (:mod:`moonrt.jobs.train.overrides`). The flags
are generated (:mod:`moonrt.jobs.train.flags`): one short alias per common config field, from its field's type, and
a small table of the flags that are no config field; ``--help`` lists them by config section and imports no torch:
the training machinery is imported by :func:`run`.

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

from moonrt.cluster.preempt import PREEMPTED_EXIT, Aborted
from moonrt.config import ConfigError
from moonrt.jobs.train import flags
from moonrt.jobs.train.config import JobConfig
from moonrt.jobs.train.overrides import job_config
from moonrt.ops.kernels import KernelUnavailable

# This module is imported for ``moonrt train --help``: nothing above imports torch (the registries are lazy, the job
# config torch-free); the training machinery is imported in run(). tests/jobs/test_cli_overrides.py checks it.


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags: generated from the job config's fields and the two tables of :mod:`moonrt.jobs.train.flags` (a
    flag added here by hand fails tests/jobs/test_train_flags.py; a new short flag is a row of ``ALIASES``)."""
    flags.add_arguments(parser)


def job_from_args(args: argparse.Namespace) -> JobConfig:
    """The job config: ``--config`` (or the default), then every ``--set``, then the aliases given
    (:func:`moonrt.jobs.train.flags.flag_values`); :func:`moonrt.jobs.train.overrides.job_config` (the precedence,
    the messages)."""
    return job_config(args.config, getattr(args, "set", None) or (), flags.flag_values(args))


def run(args: argparse.Namespace) -> int:
    from moonrt.cluster.detect import detect_rendezvous

    allow = tuple(f.strip() for f in args.resume_allow_changes.split(",") if f.strip())
    try:  # the job and its degrees against the launcher's world before torch is imported: a bad layout is one line
        # in a second on every rank, not after each rank's imports
        if allow and not (args.resume or args.resume_if_exists):
            raise ConfigError("--resume-allow-changes: expected together with --resume")
        job = job_from_args(args)
        world = detect_rendezvous().world_size
        if job.parallel.world_size != 1 or world > 1:
            job.fit_world(world)
    except (ConfigError, ValueError) as exc:
        print(f"moonrt train: error: {exc}", file=sys.stderr, flush=True)
        return 2

    from moonrt.cluster.env import shutdown_distributed
    from moonrt.comm.parallelism import Parallelism
    from moonrt.jobs.train.assemble import parallel_runtime, routing_trace
    from moonrt.jobs.train.loop import Diverged, NothingToDo, Preempted, train
    from moonrt.jobs.train.outputs import has_checkpoint

    try:
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
        if job.parallel.world_size != 1 or world > 1:
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
