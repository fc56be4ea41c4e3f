"""Where a ``moonrt train`` job computes and how its ranks join (job layer): ``JobConfig.device`` and
``JobConfig.dist`` resolved for this process before anything is built, and the one place the job's device becomes
a ``torch.device``.

:func:`resolve_device`: ``cpu`` runs on the CPU; ``cuda`` runs on the GPU where torch sees one and is refused with one
line otherwise; ``auto`` is cuda where CUDA is available, else cpu. :func:`resolve_job`: the job with its device and
``dist`` resolved (the launcher's timeout where the config leaves it ``null``, ``backend: auto`` made the device's
backend), what the run records in ``config.yaml`` and passes to :func:`moonrt.cluster.env.init_distributed`.
:func:`bind_device`: the ``torch.device`` this rank computes on (``cuda:LOCAL_RANK``, made current before the process
group is joined so that NCCL binds that GPU); the runtime carries it as
:attr:`moonrt.comm.parallelism.Parallelism.device`, and every tensor the runtime, the model and the data path create
lives there. :func:`host_tensor` is where the data path's numpy batches become tensors on that device.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, MutableMapping

import numpy as np
import torch

from moonrt.cluster.detect import detect_rendezvous
from moonrt.cluster.env import resolve_dist_config
from moonrt.config import ConfigError, check
from moonrt.jobs.train.config import JobConfig

DEVICES = ("cpu", "cuda")
"""Devices the train path runs on."""


def cuda_available() -> bool:
    """Whether torch sees a usable CUDA device in this process."""
    return torch.cuda.is_available()


def resolve_device(requested: str, cuda: bool | None = None) -> str:
    """The device a job that asks for ``requested`` (``JobConfig.device``) runs on: ``"cpu"`` or ``"cuda"``, or a
    :class:`ConfigError` naming the field and what is accepted. ``cuda``: whether CUDA is available (default: ask
    torch). ``auto`` is cuda where CUDA is available, else cpu; ``cuda`` without CUDA is refused."""
    check(requested in ("auto", "cpu", "cuda"), "device", requested, "one of 'auto', 'cpu', 'cuda'")
    if requested == "cpu":
        return "cpu"
    if cuda is None:
        cuda = cuda_available()
    if cuda:
        return "cuda"
    if requested == "auto":
        return "cpu"
    why = "torch was built without CUDA" if torch.version.cuda is None else "torch sees no CUDA device"
    raise ConfigError(f"device (--device) = 'cuda': CUDA is not available here ({why}); expected 'cpu' or 'auto'")


def bind_device(device: str, environ: Mapping[str, str] = os.environ) -> torch.device:
    """The ``torch.device`` of this rank for the resolved ``device`` (``"cpu"`` or ``"cuda"``): the CPU, or
    ``cuda:LOCAL_RANK`` (the launcher's local rank, :func:`moonrt.cluster.detect.detect_rendezvous`; modulo the GPUs
    this process sees), which it makes torch's current device: called before the process group is joined, so that
    NCCL and the object collectives use this rank's GPU."""
    if device == "cpu":
        return torch.device("cpu")
    index = detect_rendezvous(environ).local_rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


CUBLAS_WORKSPACE = ":4096:8"
"""cuBLAS's workspace setting for reproducible GEMMs (CUDA's documentation; torch's reproducibility notes)."""


def use_deterministic(on: bool, environ: MutableMapping[str, str] = os.environ) -> None:
    """``JobConfig.deterministic``: when ``on``, ``torch.use_deterministic_algorithms(True)`` and cuBLAS's fixed
    workspace (``CUBLAS_WORKSPACE_CONFIG``, kept where the user set one; read when cuBLAS makes its first handle,
    so this runs before the job's first matmul). Off: torch's setting is left as it is (a library caller's own)."""
    if not on:
        return
    environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    torch.use_deterministic_algorithms(True)


def host_tensor(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """The numpy ``array`` (the data path's token windows, document ids) as a tensor on ``device``: the one place
    the data path makes a tensor from host memory (shared with ``array`` on the CPU, copied to the GPU on CUDA)."""
    return torch.from_numpy(array).to(device)


def resolve_job(job: JobConfig, environ: Mapping[str, str] = os.environ, cuda: bool | None = None,
                multi_rank: bool = False) -> JobConfig:
    """A copy of ``job`` with ``device`` resolved (:func:`resolve_device`) and ``dist`` resolved for it:
    ``timeout_s`` the config's, else the launcher's ``MOONRT_DIST_TIMEOUT``, else 300 s
    (:func:`moonrt.cluster.env.resolve_dist_config`); ``backend: auto`` gloo on cpu, nccl on cuda; ``nccl`` on cpu
    refused; ``gloo`` on cuda refused for a ``multi_rank`` job (every tensor of the job lives on the GPU and gloo
    reduces CPU tensors: moonrt does not stage collectives through the host), allowed for one process (it joins no
    group). ``rdzv_host`` stays as given (``null``: the launcher's, read at rendezvous time)."""
    device = resolve_device(job.device, cuda)
    dist = resolve_dist_config(job.dist, environ)
    if dist.backend == "auto":
        dist = dataclasses.replace(dist, backend="gloo" if device == "cpu" else "nccl")
    check(not (device == "cpu" and dist.backend == "nccl"), "dist.backend", dist.backend,
          f"'gloo' or 'auto' with device {job.device!r} (runs on cpu; nccl reduces CUDA tensors only)")
    check(not (multi_rank and device == "cuda" and dist.backend == "gloo"), "dist.backend", dist.backend,
          f"'nccl' or 'auto' with device {job.device!r} in a multi-rank job (runs on cuda: every collective reduces "
          "GPU tensors; gloo reduces CPU tensors)")
    return dataclasses.replace(job, device=device, dist=dist)
