"""``moonrt sbatch`` (:mod:`moonrt.cluster.sbatch`) with the job's schema: ``--config`` is read as a
:class:`~moonrt.jobs.train.config.JobConfig`, exactly as ``moonrt train --config`` reads it (same keys, same checks,
same messages), so one YAML serves both; the cluster layer cannot import the job layer, so the loader is passed."""

from __future__ import annotations

import argparse
from pathlib import Path

from moonrt.cluster import sbatch
from moonrt.config import load_yaml
from moonrt.jobs.train.config import JobConfig


def load_job(path: Path) -> JobConfig:
    """The job config at ``path``, as ``moonrt train --config`` loads it (:func:`moonrt.config.load_yaml`)."""
    return load_yaml(JobConfig, path)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sbatch.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    return sbatch.run(args, load_job)
