"""What the checkpoint package needs of the job that writes or rebuilds a checkpoint, without importing it.

:mod:`moonrt.jobs.checkpoint` sits below :mod:`moonrt.jobs.train` (train saves and resumes through it; the rule is
checked by ``tests/test_import_direction.py``), so the job's config type and its model and optimizer builders come in
as values: :class:`SavedJob` is the part of a job config a save reads, :class:`JobBuilder` the three functions that
turn a recorded job config back into a model and its optimizer. ``moonrt train`` hands its own
(:data:`moonrt.jobs.train.resume.BUILDER`) to the loads and reads that need one, and ``moonrt/cli.py`` hands the same
to ``moonrt checkpoint``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch


class SavedJob(Protocol):
    """The job config a checkpoint records (``moonrt train``'s ``JobConfig``): a config dataclass
    (:func:`moonrt.config.to_dict` gives the mapping stored with the weights) with these two sections."""

    parallel: Any  # the layout section (dp, pp, vpp, ep, cp, zero): the marker records it
    checkpoint: Any  # keep_latest, keep_every, async_save: retention and how saves run


@dataclasses.dataclass(frozen=True, slots=True)
class JobBuilder:
    """How the job layer that wrote a checkpoint rebuilds its objects from the recorded job config.

    ``read(config)``: the job config object of a recorded mapping (a :class:`SavedJob` that also has ``model``,
    ``qat_block``, ``model_spec()`` and ``model_cfg()``); :class:`moonrt.config.ConfigError` (a ``ValueError``)
    naming the field for a mapping this moonrt does not build. ``model(job)``: its single-process model (built on the
    current default device: a ``torch.device("meta")`` context gives one with no storage). ``optimizer(model, job)``:
    the optimizer the job trains ``model`` with (its param groups and their order)."""

    read: Callable[[Mapping[str, Any]], Any]
    model: Callable[[Any], torch.nn.Module]
    optimizer: Callable[[torch.nn.Module, Any], torch.optim.Optimizer]


__all__ = ["JobBuilder", "SavedJob"]
