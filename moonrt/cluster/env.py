"""Detect how this process was launched and initialize ``torch.distributed`` from it.

One entry point for every launcher: :func:`init_distributed` reads the environment through
:func:`~moonrt.cluster.detect.detect_rendezvous` (torchrun and ``moonrt launch``, SLURM, MPI, else a single
process; the detection order and the variables: :mod:`moonrt.cluster.detect`) and joins the job's default
process group. Every collective and the rendezvous itself are bounded by a timeout, so a dead rank never hangs
a job. The parts it joins with, one module each:

- :mod:`moonrt.cluster.detect`: the launcher's variables -> :class:`~moonrt.cluster.detect.Rendezvous` (rank,
  world size, master address and port), SLURM host lists and ports;
- :mod:`moonrt.cluster.store`: rank 0's rendezvous store, the one address it listens on, the job identity every
  rank checks before joining, the MPI path's store;
- :mod:`moonrt.cluster.network`: the interface gloo's sockets use (the route to the master), address helpers;
- :mod:`moonrt.cluster.peers`: where each rank runs, to name the ranks behind a lost gloo connection.

This module re-exports their public names, so ``moonrt.cluster.env.X`` keeps working for each of them.

**Where the settings come from** (:func:`resolve_dist_config`). The job's :class:`~moonrt.config.DistConfig`
(``moonrt train``: the job config's ``dist`` section, ``--dist-timeout``) is passed to :func:`init_distributed`
and wins; a field it leaves ``None`` takes the launcher's environment variable, the channel through which
``moonrt launch --timeout`` and ``moonrt sbatch --timeout / --rdzv-host`` reach every rank
(``MOONRT_DIST_TIMEOUT``, ``MOONRT_RDZV_HOST``), else the default (300 s; ``MASTER_ADDR``'s address).

**Ranks die with their launcher.** ``moonrt launch`` makes the kernel kill each rank when the launcher dies
(Linux ``PR_SET_PDEATHSIG``); it also passes its pid in ``MOONRT_LAUNCHER_PID``, and where no parent-death
signal is set (no ``prctl``: macOS, BSD) :func:`init_distributed` starts
:func:`moonrt.cluster.lifeline.watch_launcher`, a thread that kills the rank (and its process group) once the
launcher is gone. A torchrun worker dies with torchrun's agent the same way: it sets the parent-death signal itself
(:func:`moonrt.cluster.lifeline.die_with_agent`), or the thread watches the agent.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from datetime import timedelta

from moonrt.cluster.detect import (
    AGENT_STORE_ENV,
    SLURM_PORT_BASE,
    SLURM_PORT_END,
    SLURM_STEP_SLOTS,
    Rendezvous,
    Source,
    _multi_node,
    detect_rendezvous,
    parse_hostlist,
    slurm_port,
    uses_agent_store,
)
from moonrt.cluster.lifeline import watch_launcher
from moonrt.cluster.network import (
    GLOO_IFNAME_ENV,
    free_port,
    interface_of,
    loopback_interface,
    route_interface,
    route_source,
    set_gloo_interface,
)
from moonrt.cluster.peers import MAX_PEER_TABLE, PEER_KEY, _publish_peer, _read_peers, describe_lost_peers
from moonrt.cluster.store import (
    IDENTITY_KEY,
    JOB_ID_ENV,
    RDZV_HOST_ENV,
    _mpi_store,
    check_job_identity,
    client_store,
    job_identity,
    master_store,
    rendezvous_bind_host,
)
from moonrt.config import DEFAULT_TIMEOUT_S, ConfigError, DistConfig
from moonrt.config import MAX_TIMEOUT_S as MAX_DIST_TIMEOUT_S

TIMEOUT_ENV = "MOONRT_DIST_TIMEOUT"
"""Collective timeout in seconds that a launcher passes to its ranks: used where the job's
:class:`DistConfig` leaves ``timeout_s`` unset (:func:`resolve_dist_config`)."""


MAX_TIMEOUT_S = 1e8
"""Largest duration a launcher accepts (``moonrt launch --max-time``, ``--stop-grace``; about 3 years): finite, and
far inside what ``timedelta``, ``threading`` and torch's millisecond/nanosecond clocks represent (``inf`` or
``1e300`` overflow there). A collective timeout is bounded tighter, by :data:`moonrt.config.MAX_TIMEOUT_S`
(a week), wherever it comes from."""


# ---------------------------------------------------------------------------------------------
# Initialization


def resolve_dist_config(cfg: DistConfig | None = None, environ: Mapping[str, str] = os.environ) -> DistConfig:
    """``cfg`` (default ``DistConfig()``) with ``timeout_s`` set: the config's value when it has one, else the
    launcher's ``MOONRT_DIST_TIMEOUT`` when set, else :data:`~moonrt.config.DEFAULT_TIMEOUT_S`. ``rdzv_host`` stays
    as given (``None``: :func:`rendezvous_bind_host` reads ``MOONRT_RDZV_HOST`` at rendezvous time) and ``backend``
    too (``auto`` is resolved by :func:`init_distributed`). A bad environment value is a :class:`ConfigError` naming
    the variable, checked against the same bounds as ``DistConfig.timeout_s``; it is read only when needed."""
    cfg = cfg if cfg is not None else DistConfig()
    if cfg.timeout_s is not None:
        return cfg
    raw = environ.get(TIMEOUT_ENV)
    if not raw:
        return dataclasses.replace(cfg, timeout_s=DEFAULT_TIMEOUT_S)
    expected = f"expected a positive number of seconds (finite, at most {MAX_DIST_TIMEOUT_S:g})"
    try:
        timeout = float(raw)
    except ValueError:
        raise ConfigError(f"{TIMEOUT_ENV} = {raw!r}: {expected}") from None
    if not (math.isfinite(timeout) and 0 < timeout <= MAX_DIST_TIMEOUT_S):
        raise ConfigError(f"{TIMEOUT_ENV} = {raw!r}: {expected}")
    return dataclasses.replace(cfg, timeout_s=timeout)


def default_dist_config(environ: Mapping[str, str] = os.environ) -> DistConfig:
    """The settings of a process without a job config: ``DistConfig()`` resolved from the launcher's environment
    (:func:`resolve_dist_config`)."""
    return resolve_dist_config(None, environ)


def init_distributed(cfg: DistConfig | None = None) -> Rendezvous:
    """Join this job's default process group; return where this process sits in it.

    ``cfg``: the job's settings (``moonrt train`` passes its job config's ``dist``), resolved by
    :func:`resolve_dist_config`: its own values win, a ``None`` field takes the launcher's environment variable.
    Backend: ``cfg.backend``; ``"auto"`` is nccl when CUDA is available (device = local rank), else gloo (a job
    resolves ``auto`` for its device before it calls this); on nccl the rank's GPU is made current and passed as
    ``device_id`` (eager communicators). ``cfg.timeout_s`` bounds the rendezvous and every
    collective; ``cfg.rdzv_host`` is where rank 0's store listens. Idempotent: if torch.distributed is already
    initialized with the detected world size, nothing is done.
    """
    import torch
    import torch.distributed as dist

    cfg = resolve_dist_config(cfg)
    rdzv = detect_rendezvous()
    watch_launcher()
    if dist.is_initialized():
        if dist.get_world_size() != rdzv.world_size or dist.get_rank() != rdzv.rank:
            raise RuntimeError(
                f"torch.distributed already initialized as rank {dist.get_rank()} of {dist.get_world_size()}, "
                f"but the {rdzv.source} environment says rank {rdzv.rank} of {rdzv.world_size}"
            )
        return rdzv
    backend = cfg.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    device_id = None
    if backend == "nccl":  # the rank's GPU, current and bound to the group: NCCL makes its communicators eagerly
        device_id = torch.device("cuda", rdzv.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device_id)
    timeout = timedelta(seconds=cfg.timeout_s)

    if rdzv.world_size == 1 and rdzv.master_port is None:
        store = dist.HashStore()
    elif rdzv.source == "mpi" and rdzv.master_port is None:
        store, rdzv = _mpi_store(rdzv, timeout, cfg.rdzv_host)
    else:
        assert rdzv.master_addr is not None and rdzv.master_port is not None
        if uses_agent_store(rdzv):  # torchrun's agent serves the store on MASTER_PORT: every rank is its client
            store = client_store(rdzv.master_addr, rdzv.master_port, rdzv.world_size, timeout)
        elif rdzv.rank == 0:
            bind = rendezvous_bind_host(rdzv.master_addr, multi_node=_multi_node(os.environ, rdzv),
                                        host=cfg.rdzv_host)
            store = master_store(bind, rdzv.master_port, rdzv.world_size, timeout, connect=rdzv.master_addr)
        else:
            store = client_store(rdzv.master_addr, rdzv.master_port, rdzv.world_size, timeout)
        # a port known in advance may be another job's too (the MPI path's port is private to the job)
        check_job_identity(store, rdzv)
    if backend == "gloo" and rdzv.master_addr is not None:
        set_gloo_interface(rdzv.master_addr)
    if rdzv.world_size > 1:
        _publish_peer(store, rdzv)
    # device_id (NCCL): communicators made at init, not lazily at a group's first op, which torch requires of every
    # rank of the group when that op is a batch_isend_irecv (a pipeline with pp >= 3 starts with a 0 -> 1 batch)
    dist.init_process_group(backend, store=store, rank=rdzv.rank, world_size=rdzv.world_size, timeout=timeout,
                            device_id=device_id)
    if rdzv.world_size > 1:
        _read_peers(store, rdzv)
    return rdzv


def shutdown_distributed() -> None:
    """Leave the default process group, if this process joined one (a local step for gloo: no collective).

    Garbage is collected first: while a reference cycle still holds the group (a pipeline executor hooking its
    own bound methods, a model's hooks), ``destroy_process_group`` only unregisters it, and gloo's backend and
    worker threads live on until the cycle is collected, at the latest during interpreter finalization, where
    a worker releasing a finished collective's tensors must take the GIL and aborts the process ("terminate
    called without an active exception", SIGABRT: exit 134). Collected first, the backend is destroyed here
    and joins its workers while the interpreter is alive.
    """
    import gc

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


__all__ = [
    "AGENT_STORE_ENV",
    "GLOO_IFNAME_ENV",
    "IDENTITY_KEY",
    "JOB_ID_ENV",
    "MAX_PEER_TABLE",
    "MAX_TIMEOUT_S",
    "PEER_KEY",
    "RDZV_HOST_ENV",
    "SLURM_PORT_BASE",
    "SLURM_PORT_END",
    "SLURM_STEP_SLOTS",
    "TIMEOUT_ENV",
    "Rendezvous",
    "Source",
    "check_job_identity",
    "default_dist_config",
    "describe_lost_peers",
    "detect_rendezvous",
    "free_port",
    "init_distributed",
    "interface_of",
    "job_identity",
    "loopback_interface",
    "master_store",
    "parse_hostlist",
    "rendezvous_bind_host",
    "resolve_dist_config",
    "route_interface",
    "route_source",
    "set_gloo_interface",
    "shutdown_distributed",
    "slurm_port",
    "uses_agent_store",
]
