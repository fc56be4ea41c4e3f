"""``moonrt sbatch`` (:mod:`moonrt.cluster.sbatch`) with the job's schema: ``--config`` is read as a
:class:`~moonrt.jobs.train.config.JobConfig`, exactly as ``moonrt train --config`` reads it (same keys, same checks,
same messages), so one YAML serves both; the cluster layer cannot import the job layer, so the loader is passed.

``--set KEY=VALUE`` (repeatable; :mod:`moonrt.jobs.train.overrides`) overrides the job config as ``moonrt train
--set`` does: sbatch checks the overridden config (parallel degrees against the allocation, ``dist`` settings) and
passes the same ``--set`` words to the command after ``--config <path>``, so the job runs, and its ``config.yaml``
records, the overridden values. It needs ``--config``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from moonrt.cluster import sbatch
from moonrt.config import ConfigError
from moonrt.jobs.train.config import JobConfig
from moonrt.jobs.train.overrides import SET_HELP, job_config, parse_set


def load_job(path: Path, sets: Sequence[str] = ()) -> JobConfig:
    """The job config at ``path`` with the ``--set`` overrides ``sets``, as ``moonrt train --config PATH --set ...``
    loads it (:func:`moonrt.jobs.train.overrides.job_config`)."""
    return job_config(path, sets)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sbatch.add_arguments(parser)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="with --config: " + SET_HELP + "; checked here and passed to the command")


def run(args: argparse.Namespace) -> int:
    sets = list(args.set)
    if sets and args.config is None:
        print(f"moonrt sbatch: --set {sets[0]}: expected together with --config (the overrides apply to the job "
              "config sbatch checks and passes on)", file=sys.stderr)
        return 2
    try:
        for o in map(parse_set, sets):  # --requeue appends --signal USR1 to a train command: a --set must agree
            if args.requeue and o.path == ("stop_signal",) and str(o.value).upper().removeprefix("SIG") != "USR1":
                raise ConfigError(f"--set {o.text}: expected stop_signal USR1 with --requeue (the script forwards "
                                  "SIGUSR1 to the tasks), or no stop_signal --set")
    except ConfigError as exc:
        print(f"moonrt sbatch: {exc}", file=sys.stderr)
        return 2
    return sbatch.run(args, lambda path: load_job(path, sets), [w for s in sets for w in ("--set", s)])
