"""Where a ``moonrt train`` job computes and how its ranks join (job layer): ``JobConfig.device`` and
``JobConfig.dist`` resolved for this process before anything is built.

:func:`resolve_device`: ``cpu`` runs; ``cuda`` is refused with one line (no CUDA here, or the CUDA train path, which
a later issue adds, is not implemented yet); ``auto`` is cpu until that path exists. :func:`resolve_job`: the job
with its device and ``dist`` resolved (the launcher's timeout where the config leaves it ``null``, ``backend: auto``
made the device's backend), what the run records in ``config.yaml`` and passes to
:func:`moonrt.cluster.env.init_distributed`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

from moonrt.cluster.env import resolve_dist_config
from moonrt.config import ConfigError, check
from moonrt.jobs.train.config import JobConfig

DEVICES = ("cpu",)
"""Devices the train path runs on today."""


def cuda_available() -> bool:
    """Whether torch sees a usable CUDA device in this process."""
    import torch

    return torch.cuda.is_available()


def resolve_device(requested: str, cuda: bool | None = None) -> str:
    """The device a job that asks for ``requested`` (``JobConfig.device``) runs on: ``"cpu"``, or a
    :class:`ConfigError` naming the field and what is accepted. ``cuda``: whether CUDA is available (default: ask
    torch). ``auto`` is cpu, also where CUDA is available, until the CUDA train path exists."""
    check(requested in ("auto", "cpu", "cuda"), "device", requested, "one of 'auto', 'cpu', 'cuda'")
    if requested != "cuda":
        return "cpu"
    if cuda is None:
        cuda = cuda_available()
    if not cuda:
        import torch

        why = "torch was built without CUDA" if torch.version.cuda is None else "torch sees no CUDA device"
        raise ConfigError(f"device (--device) = 'cuda': CUDA is not available here ({why}); expected 'cpu' or "
                          "'auto'")
    raise ConfigError("device (--device) = 'cuda': the CUDA train path is not implemented yet (moonrt train runs "
                      "on the CPU today); expected 'cpu' or 'auto'")


def device_note(requested: str, device: str, cuda: bool | None = None) -> str:
    """How the start line names the device: ``cpu``, with why when ``auto`` chose it although CUDA is here."""
    if requested == "auto" and device == "cpu" and (cuda_available() if cuda is None else cuda):
        return "cpu (auto: CUDA is available, but the CUDA train path is not implemented yet)"
    return device


def resolve_job(job: JobConfig, environ: Mapping[str, str] = os.environ, cuda: bool | None = None) -> JobConfig:
    """A copy of ``job`` with ``device`` resolved (:func:`resolve_device`) and ``dist`` resolved for it:
    ``timeout_s`` the config's, else the launcher's ``MOONRT_DIST_TIMEOUT``, else 300 s
    (:func:`moonrt.cluster.env.resolve_dist_config`); ``backend: auto`` gloo on cpu (nccl would be CUDA's);
    ``nccl`` on cpu refused. ``rdzv_host`` stays as given (``null``: the launcher's, read at rendezvous time)."""
    device = resolve_device(job.device, cuda)
    dist = resolve_dist_config(job.dist, environ)
    if dist.backend == "auto":
        dist = dataclasses.replace(dist, backend="gloo" if device == "cpu" else "nccl")
    check(not (device == "cpu" and dist.backend == "nccl"), "dist.backend", dist.backend,
          f"'gloo' or 'auto' with device {job.device!r} (runs on cpu; nccl reduces CUDA tensors only)")
    return dataclasses.replace(job, device=device, dist=dist)
