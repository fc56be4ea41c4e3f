"""Launchers and job bootstrap: ``init_distributed`` (torchrun / SLURM / MPI / single process),
``moonrt launch``, ``moonrt selftest``, ``moonrt sbatch`` and the local multi-rank runner."""

from __future__ import annotations

from moonrt.cluster.detect import Rendezvous, detect_rendezvous, parse_hostlist
from moonrt.cluster.env import init_distributed

__all__ = ["Rendezvous", "detect_rendezvous", "init_distributed", "parse_hostlist"]
