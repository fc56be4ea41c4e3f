"""Detect how this process was launched and initialize ``torch.distributed`` from it.

One entry point for every launcher: :func:`init_distributed` reads the environment through
:func:`detect_rendezvous` and joins the job's default process group. Detection order (the first
launcher whose variables are present wins):

1. **torchrun** (and ``moonrt launch``): ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``
   (``LOCAL_RANK`` optional, default: ``RANK``). Under the real torchrun, whose agent already serves
   the rendezvous store on ``MASTER_PORT`` and says so with ``TORCHELASTIC_USE_AGENT_STORE=True``
   (:func:`uses_agent_store`; every rendezvous backend, ``--standalone`` included), every rank connects
   to that store as a client, as torch's ``env://`` does; otherwise rank 0 opens the store.
2. **SLURM**, inside an ``srun`` step: ``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS``,
   ``SLURM_LOCALID``, ``SLURM_JOB_ID`` (``SLURM_STEP_ID`` optional, default 0), master = first
   host of ``SLURM_STEP_NODELIST`` (else ``SLURM_JOB_NODELIST``), port derived from the job and
   step ids (:func:`slurm_port`, unless ``MASTER_PORT`` is set). ``SLURM_NTASKS`` is deliberately
   *not* used: inside a batch script (outside ``srun``) it is the job size while only one process
   runs (checked on slurm-wlm 22.05).
   When MPI variables are present too and give a different world size (``mpiexec`` inside an
   allocation starts one proxy per node through ``srun``), the MPI path is taken instead.
3. **MPI**: ``OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK`` (Open MPI) or ``PMI_RANK``, ``PMI_SIZE``,
   ``MPI_LOCALRANKID`` (MPICH/Hydra, Intel MPI). Unless ``MASTER_ADDR``/``MASTER_PORT`` are set,
   rank 0 opens the rendezvous store on an OS-chosen free port and broadcasts ``(host, port)``
   with mpi4py (no fixed ports).
4. Otherwise a **single** process (world size 1, in-memory store).

A partially set environment (``RANK`` without ``WORLD_SIZE``, ``SLURM_PROCID`` outside an
``srun`` step, ...) is a :class:`ValueError` naming the missing variables. Every collective and
the rendezvous itself are bounded by a timeout, so a dead rank never hangs a job.

**Where the settings come from** (:func:`resolve_dist_config`). The job's :class:`~moonrt.config.DistConfig`
(``moonrt train``: the job config's ``dist`` section, ``--dist-timeout``) is passed to :func:`init_distributed`
and wins; a field it leaves ``None`` takes the launcher's environment variable, the channel through which
``moonrt launch --timeout`` and ``moonrt sbatch --timeout / --rdzv-host`` reach every rank
(``MOONRT_DIST_TIMEOUT``, ``MOONRT_RDZV_HOST``), else the default (300 s; ``MASTER_ADDR``'s address).

**Job identity.** A port can still be shared by two jobs (two SLURM jobs whose derived ports collide,
a ``MASTER_PORT`` set twice): the store then holds ranks of both, which would form mixed process groups
that run to the end. Rank 0 therefore publishes its job's identity (:func:`job_identity`: ``moonrt launch``'s
per-job random ``MOONRT_JOB_ID``, else the SLURM job and step ids, else torchrun's run id) in its store, and
every other rank compares it with its own before joining the group: a rank that reached another job's store
fails with a ``ValueError`` naming both jobs instead of joining. (The MPI path's store port is chosen by the OS
and sent through MPI: private to the job, not checked.)

**Ranks die with their launcher.** ``moonrt launch`` makes the kernel kill each rank when the launcher dies
(Linux ``PR_SET_PDEATHSIG``); it also passes its pid in ``MOONRT_LAUNCHER_PID``, and where no parent-death
signal is set (no ``prctl``: macOS, BSD) :func:`init_distributed` starts
:func:`moonrt.cluster.lifeline.watch_launcher`, a thread that kills the rank (and its process group) once the
launcher is gone.

**What the rendezvous listens on.** torch's ``TCPStore`` (unauthenticated: anyone who reaches it
can read and write the job's keys) binds every interface when it creates its own socket, so rank
0 binds the socket itself (:func:`master_store`) on one address (:func:`rendezvous_bind_host`).
(Under torchrun the store is torchrun's agent's, which torch 2.13 listens with on every interface,
``--standalone`` included: moonrt opens none there; ``moonrt launch`` is the loopback-only launcher.)

- ``MOONRT_RDZV_HOST`` when set (``moonrt sbatch --rdzv-host``): an address or name of one of
  rank 0's interfaces; ``0.0.0.0`` or ``::`` (every interface) only when asked for like this;
- else the address ``MASTER_ADDR`` (SLURM: the step's first node) resolves to on rank 0's host:
  loopback for ``moonrt launch`` (``MASTER_ADDR=127.0.0.1``), the named interface otherwise. A
  name that resolves only to loopback there (Debian's ``127.0.1.1`` hostname entry) while the job
  spans several nodes is an error asking for ``MOONRT_RDZV_HOST``, not a silent hang;
- MPI: loopback when every rank runs on one host, else the address rank 0's host name resolves to.

gloo's own listening sockets (``GLOO_SOCKET_IFNAME``, unless set: :func:`set_gloo_interface`) are on the
interface this host reaches the master address through: the loopback interface when the rendezvous is on
loopback (a single-host job), else the interface the kernel routes ``MASTER_ADDR`` through (on rank 0's host,
the one carrying that address). By default gloo binds whatever the host name resolves to, which may be a LAN
address on a single-host job, or loopback on every node of a multi-node one.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
import os
import re
import socket
from collections.abc import Mapping, MutableMapping
from datetime import timedelta
from pathlib import Path
from typing import Literal

from moonrt.cluster.lifeline import watch_launcher
from moonrt.config import DEFAULT_TIMEOUT_S, ConfigError, DistConfig
from moonrt.config import MAX_TIMEOUT_S as MAX_DIST_TIMEOUT_S

TIMEOUT_ENV = "MOONRT_DIST_TIMEOUT"
"""Collective timeout in seconds that a launcher passes to its ranks: used where the job's
:class:`DistConfig` leaves ``timeout_s`` unset (:func:`resolve_dist_config`)."""

RDZV_HOST_ENV = "MOONRT_RDZV_HOST"
"""Address (or name) of the interface rank 0's rendezvous store listens on, as a launcher passes it (see module doc);
``DistConfig.rdzv_host`` wins over it."""

GLOO_IFNAME_ENV = "GLOO_SOCKET_IFNAME"
"""gloo's choice of network interface; set to loopback for single-host jobs unless already set."""

SLURM_PORT_BASE = 1024
"""Ports derived for SLURM steps lie in [SLURM_PORT_BASE, SLURM_PORT_END): every unprivileged port below Linux's
ephemeral range (32768-60999 by default), where outgoing connections (gloo's among them) take their ports."""
SLURM_PORT_END = 32768
SLURM_STEP_SLOTS = 4
"""Ports set aside per SLURM job: concurrent steps of one job get distinct ports while their ids differ mod 4."""

JOB_ID_ENV = "MOONRT_JOB_ID"
"""Per-job random nonce that ``moonrt launch`` gives its ranks: their job identity (:func:`job_identity`)."""
AGENT_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"
"""``"True"`` in the workers of a torchrun whose agent serves the rendezvous store on ``MASTER_PORT``."""
IDENTITY_KEY = "moonrt/job_identity"
"""Key under which rank 0 publishes its job identity in its rendezvous store."""

MAX_TIMEOUT_S = 1e8
"""Largest duration a launcher accepts (``moonrt launch --max-time``, ``--stop-grace``; about 3 years): finite, and
far inside what ``timedelta``, ``threading`` and torch's millisecond/nanosecond clocks represent (``inf`` or
``1e300`` overflow there). A collective timeout is bounded tighter, by :data:`moonrt.config.MAX_TIMEOUT_S`
(a week), wherever it comes from."""

Source = Literal["torchrun", "slurm", "mpi", "single"]


@dataclasses.dataclass(frozen=True, slots=True)
class Rendezvous:
    """Where this process sits in the job and how to reach rank 0's store.

    ``master_addr``/``master_port`` are ``None`` for ``source="single"`` (no store needed) and for
    ``source="mpi"`` when they are exchanged through mpi4py at :func:`init_distributed` time.
    """

    rank: int
    world_size: int
    local_rank: int
    master_addr: str | None
    master_port: int | None
    source: Source


# ---------------------------------------------------------------------------------------------
# SLURM host lists


def parse_hostlist(spec: str) -> list[str]:
    """Expand a SLURM compressed host list: ``"node[01-03,7],gpu5"`` -> node01 node02 node03 node7 gpu5.

    Several bracket groups in one name expand as a product (``"r[1-2]n[1-2]"`` -> r1n1 r1n2 r2n1
    r2n2); zero padding follows the width of each range's first bound. Raises ``ValueError`` on
    unbalanced brackets or malformed ranges.
    """
    hosts: list[str] = []
    for item in _split_top_level(spec.strip(), spec):
        hosts.extend(_expand_host(item, spec))
    return hosts


def _split_top_level(s: str, spec: str) -> list[str]:
    items, depth, start = [], 0, 0
    for i, ch in enumerate(s):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"host list {spec!r}: nested '[' at position {i}")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"host list {spec!r}: unmatched ']' at position {i}")
        elif ch == "," and depth == 0:
            items.append(s[start:i])
            start = i + 1
    if depth != 0:
        raise ValueError(f"host list {spec!r}: unmatched '['")
    items.append(s[start:])
    for item in items:
        if not item:
            raise ValueError(f"host list {spec!r}: empty host name")
    return items


def _expand_host(item: str, spec: str) -> list[str]:
    m = re.search(r"\[([^\]]*)\]", item)
    if m is None:
        return [item]
    prefix, rest = item[: m.start()], item[m.end() :]
    suffixes = _expand_host(rest, spec) if rest else [""]
    out = []
    for part in m.group(1).split(","):
        rng = re.fullmatch(r"(\d+)(?:-(\d+))?", part.strip())
        if rng is None:
            raise ValueError(f"host list {spec!r}: bad range {part!r}: expected N or N-M with digits")
        lo_s, hi_s = rng.group(1), rng.group(2) or rng.group(1)
        lo, hi = int(lo_s), int(hi_s)
        if hi < lo:
            raise ValueError(f"host list {spec!r}: range {part!r} runs backwards")
        width = len(lo_s)
        for n in range(lo, hi + 1):
            out.extend(f"{prefix}{n:0{width}d}{s}" for s in suffixes)
    return out


def slurm_port(job_id: int, step_id: int) -> int:
    """Rendezvous port of a SLURM step, in [:data:`SLURM_PORT_BASE`, :data:`SLURM_PORT_END`).

    Distinct for any two steps of jobs whose ids differ by less than 7936 (31744 ports / 4 slots per job), and
    for up to 4 concurrent steps of one job. What can still collide on one node: jobs whose ids differ by a
    multiple of 7936 running there at the same time with step ids equal mod 4, and any other program that
    listens on the port. Such a collision never forms a mixed group: rank 0's store carries the job identity,
    which every rank checks before joining (module doc); the job fails with a line naming both jobs (or, when
    rank 0 cannot bind the port, naming the address in use).
    """
    span = SLURM_PORT_END - SLURM_PORT_BASE
    return SLURM_PORT_BASE + (job_id * SLURM_STEP_SLOTS + step_id % SLURM_STEP_SLOTS) % span


def job_identity(environ: Mapping[str, str] = os.environ) -> str | None:
    """Which job this process belongs to, as its launcher says (``None``: no launcher says).

    ``moonrt launch``'s ``MOONRT_JOB_ID`` (a random nonce per launch) first, then SLURM's job and step ids, then
    torchrun's ``TORCHELASTIC_RUN_ID``.
    """
    if environ.get(JOB_ID_ENV):
        return f"moonrt launch job {environ[JOB_ID_ENV]}"
    if environ.get("SLURM_JOB_ID"):
        return f"SLURM job {environ['SLURM_JOB_ID']} step {environ.get('SLURM_STEP_ID') or 0}"
    if environ.get("TORCHELASTIC_RUN_ID"):
        return f"torchrun run {environ['TORCHELASTIC_RUN_ID']}"
    return None


def check_job_identity(store, rdzv: Rendezvous, environ: Mapping[str, str] = os.environ) -> None:
    """Rank 0 publishes this job's identity in its ``store``; any other rank compares it with its own and raises
    ``ValueError`` naming both jobs when they differ (it reached another job's store: it must not join)."""
    mine = job_identity(environ) or "a job without an identity (no MOONRT_JOB_ID, SLURM_JOB_ID or torchrun run id)"
    if rdzv.rank == 0:
        store.set(IDENTITY_KEY, mine)
        return
    theirs = store.get(IDENTITY_KEY).decode(errors="replace")
    if theirs != mine:
        raise ValueError(
            f"the rendezvous store at {rdzv.master_addr}:{rdzv.master_port} belongs to {theirs}, but this process "
            f"(rank {rdzv.rank}) belongs to {mine}: two jobs met on one port; not joining the other job's group"
        )


def uses_agent_store(rdzv: Rendezvous, environ: Mapping[str, str] = os.environ) -> bool:
    """Whether torchrun's agent already serves the rendezvous store on ``MASTER_ADDR:MASTER_PORT``: its workers
    get ``TORCHELASTIC_USE_AGENT_STORE=True`` (torch 2.13's torchrun sets it for every rendezvous backend, with
    ``--standalone`` too), and then no rank may open a store there (the port is torchrun's); all are its clients."""
    return rdzv.source == "torchrun" and environ.get(AGENT_STORE_ENV) == "True"


# ---------------------------------------------------------------------------------------------
# Detection


def detect_rendezvous(environ: Mapping[str, str] = os.environ) -> Rendezvous:
    """Read this process's place in the job from launcher environment variables (see module doc).

    Pure: reads ``environ`` only, starts nothing. Raises ``ValueError`` naming missing or
    malformed variables.
    """
    env = environ
    if "RANK" in env or "WORLD_SIZE" in env:
        _require(env, "torchrun", ["RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"])
        world = _int(env, "WORLD_SIZE", minimum=1)
        rank = _rank(env, "RANK", world)
        local = _int(env, "LOCAL_RANK", minimum=0) if "LOCAL_RANK" in env else rank
        return Rendezvous(rank, world, local, env["MASTER_ADDR"], _port(env, "MASTER_PORT"), "torchrun")

    mpi = _detect_mpi(env)
    if "SLURM_PROCID" in env:
        if "SLURM_STEP_NUM_TASKS" not in env and mpi is None:
            raise ValueError(
                "SLURM environment without an srun step: SLURM_PROCID is set but SLURM_STEP_NUM_TASKS is "
                "missing (a batch script outside srun?); start each rank with srun "
                "(SLURM_NTASKS is the job size, not the number of running processes)"
            )
        if "SLURM_STEP_NUM_TASKS" in env:
            world = _int(env, "SLURM_STEP_NUM_TASKS", minimum=1)
            if mpi is None or mpi.world_size == world:
                return _detect_slurm(env, world)
    if mpi is not None:
        return mpi
    return Rendezvous(0, 1, 0, None, None, "single")


def _detect_slurm(env: Mapping[str, str], world: int) -> Rendezvous:
    _require(env, "SLURM", ["SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID", "SLURM_JOB_ID"])
    nodelist_var = next((v for v in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST") if env.get(v)), None)
    if nodelist_var is None:
        raise ValueError("incomplete SLURM environment: missing SLURM_STEP_NODELIST and SLURM_JOB_NODELIST")
    rank = _rank(env, "SLURM_PROCID", world)
    local = _int(env, "SLURM_LOCALID", minimum=0)
    if env.get("MASTER_ADDR"):
        addr = env["MASTER_ADDR"]
    else:
        try:
            addr = parse_hostlist(env[nodelist_var])[0]
        except ValueError as exc:
            raise ValueError(f"{nodelist_var} = {env[nodelist_var]!r}: {exc}") from None
    if env.get("MASTER_PORT"):
        port = _port(env, "MASTER_PORT")
    else:
        job = _int(env, "SLURM_JOB_ID", minimum=0)
        step = _int(env, "SLURM_STEP_ID", minimum=0) if env.get("SLURM_STEP_ID") else 0
        port = slurm_port(job, step)
    return Rendezvous(rank, world, local, addr, port, "slurm")


_MPI_FLAVOURS = (
    ("Open MPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
    ("MPICH/PMI", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
)


def _detect_mpi(env: Mapping[str, str]) -> Rendezvous | None:
    for flavour, rank_var, size_var, local_var in _MPI_FLAVOURS:
        if rank_var in env or size_var in env:
            _require(env, flavour, [rank_var, size_var, local_var])
            world = _int(env, size_var, minimum=1)
            rank = _rank(env, rank_var, world)
            local = _int(env, local_var, minimum=0)
            addr = port = None
            if env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
                addr, port = env["MASTER_ADDR"], _port(env, "MASTER_PORT")
            return Rendezvous(rank, world, local, addr, port, "mpi")
    return None


def _require(env: Mapping[str, str], launcher: str, names: list[str]) -> None:
    missing = [n for n in names if not env.get(n)]
    if missing:
        present = [n for n in names if env.get(n)]
        raise ValueError(
            f"incomplete {launcher} environment: {', '.join(present)} set but missing {', '.join(missing)}"
        )


def _int(env: Mapping[str, str], name: str, *, minimum: int) -> int:
    value = env[name]
    try:
        n = int(value)
    except ValueError:
        raise ValueError(f"{name} = {value!r}: expected an integer >= {minimum}") from None
    if n < minimum:
        raise ValueError(f"{name} = {value!r}: expected an integer >= {minimum}")
    return n


def _rank(env: Mapping[str, str], name: str, world: int) -> int:
    rank = _int(env, name, minimum=0)
    if rank >= world:
        raise ValueError(f"{name} = {rank}: expected a rank below the world size {world}")
    return rank


def _port(env: Mapping[str, str], name: str) -> int:
    port = _int(env, name, minimum=1)
    if port > 65535:
        raise ValueError(f"{name} = {port}: expected a TCP port in 1..65535")
    return port


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
    resolves ``auto`` for its device before it calls this). ``cfg.timeout_s`` bounds the rendezvous and every
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
    if backend == "nccl":
        torch.cuda.set_device(rdzv.local_rank % torch.cuda.device_count())
    timeout = timedelta(seconds=cfg.timeout_s)

    if rdzv.world_size == 1 and rdzv.master_port is None:
        store = dist.HashStore()
    elif rdzv.source == "mpi" and rdzv.master_port is None:
        store, rdzv = _mpi_store(rdzv, timeout, cfg.rdzv_host)
    else:
        assert rdzv.master_addr is not None and rdzv.master_port is not None
        if uses_agent_store(rdzv):  # torchrun's agent serves the store on MASTER_PORT: every rank is its client
            store = dist.TCPStore(rdzv.master_addr, rdzv.master_port, rdzv.world_size, is_master=False,
                                  timeout=timeout)
        elif rdzv.rank == 0:
            bind = rendezvous_bind_host(rdzv.master_addr, multi_node=_multi_node(os.environ, rdzv),
                                        host=cfg.rdzv_host)
            store = master_store(bind, rdzv.master_port, rdzv.world_size, timeout, connect=rdzv.master_addr)
        else:
            store = dist.TCPStore(rdzv.master_addr, rdzv.master_port, rdzv.world_size, is_master=False,
                                  timeout=timeout)
        # a port known in advance may be another job's too (the MPI path's port is private to the job)
        check_job_identity(store, rdzv)
    if backend == "gloo" and rdzv.master_addr is not None:
        set_gloo_interface(rdzv.master_addr)
    if rdzv.world_size > 1:
        _publish_peer(store, rdzv)
    dist.init_process_group(backend, store=store, rank=rdzv.rank, world_size=rdzv.world_size, timeout=timeout)
    if rdzv.world_size > 1:
        _read_peers(store, rdzv)
    return rdzv


# ---------------------------------------------------------------------------------------------
# Where the rendezvous store listens


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


def rendezvous_bind_host(master_addr: str, *, multi_node: bool | None,
                         environ: Mapping[str, str] = os.environ, host: str | None = None) -> str:
    """The one address rank 0's store binds (see module doc): ``host`` (the job's ``dist.rdzv_host``) if given,
    else ``MOONRT_RDZV_HOST`` if set, else the address ``master_addr`` resolves to here (a non-loopback one if it
    has any).

    ``multi_node``: whether the job spans several hosts (``None``: unknown). Raises ``ValueError``
    when a name cannot be resolved, or resolves only to loopback while ``multi_node`` is true.
    """
    if host:
        _resolve(host, "dist.rdzv_host")
        return host
    explicit = environ.get(RDZV_HOST_ENV)
    if explicit:
        _resolve(explicit, RDZV_HOST_ENV)
        return explicit
    ips = _resolve(master_addr, "MASTER_ADDR")
    outside = [ip for ip in ips if not ipaddress.ip_address(ip).is_loopback]
    if outside:
        return outside[0]
    if multi_node:
        raise ValueError(
            f"MASTER_ADDR = {master_addr!r} resolves to the loopback address {ips[0]} on rank 0's host, which the "
            f"other nodes of this multi-node job cannot reach: set dist.rdzv_host in the job config (or "
            f"{RDZV_HOST_ENV}: moonrt sbatch --rdzv-host) to the address of the interface they reach this host through"
        )
    return ips[0]


def master_store(bind: str, port: int, world_size: int, timeout: timedelta, *, connect: str | None = None):
    """Rank 0's ``TCPStore`` listening on ``bind``:``port`` only (``port`` 0: OS-chosen; ``.port`` tells).

    torch's own server socket would bind every interface; here the socket is bound first and handed
    over (``master_listen_fd``, libuv backend). ``connect`` is the address the store's own client uses
    (default: ``bind``, or loopback when ``bind`` is a wildcard). Raises ``ValueError`` when the address
    cannot be bound (not an address of this host, port in use).
    """
    import torch.distributed as dist

    try:
        infos = socket.getaddrinfo(bind, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise ValueError(f"rendezvous address {bind!r}: cannot resolve ({exc.strerror})") from None
    family, _, _, _, sockaddr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
    except OSError as exc:
        sock.close()
        raise ValueError(
            f"cannot open the rendezvous store on {bind}:{port}: {exc.strerror} (rank 0 must run on the host that "
            f"address belongs to; {RDZV_HOST_ENV} chooses the interface)"
        ) from None
    ip = sockaddr[0]
    if connect is None:
        connect = ("::1" if family == socket.AF_INET6 else "127.0.0.1") if ipaddress.ip_address(ip).is_unspecified \
            else ip
    try:
        store = dist.TCPStore(connect, sock.getsockname()[1], world_size, is_master=True, timeout=timeout,
                              wait_for_workers=False, master_listen_fd=sock.fileno(), use_libuv=True)
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store's server owns the descriptor now
    return store


def loopback_interface() -> str:
    """Name of the loopback network interface (``lo`` on Linux, ``lo0`` on macOS/BSD)."""
    names = [name for _, name in socket.if_nameindex()]
    for name in names:
        try:
            flags = int(Path(f"/sys/class/net/{name}/flags").read_text(), 16)
        except (OSError, ValueError):
            continue
        if flags & 0x8:  # IFF_LOOPBACK
            return name
    return "lo0" if "lo0" in names else "lo"


def set_gloo_interface(master_addr: str, environ: MutableMapping[str, str] = os.environ) -> str | None:
    """Set ``GLOO_SOCKET_IFNAME`` (unless set already) to the interface this host reaches ``master_addr`` through:
    the loopback interface for a single-host job, else the one the kernel routes the master's address through (on
    rank 0's own host: the interface that carries that address), so that gloo's listening sockets are on the network
    the job's nodes share and on nothing else. By default gloo binds whatever the host name resolves to, which may
    be another network's address, or loopback on every node (Debian's ``127.0.1.1`` entry). Returns the value in
    effect (``None``: unset, the route unknown)."""
    if environ.get(GLOO_IFNAME_ENV):
        return environ[GLOO_IFNAME_ENV]
    name = loopback_interface() if _is_loopback(master_addr) else route_interface(master_addr)
    if name is not None:
        environ[GLOO_IFNAME_ENV] = name
    return name


def route_interface(host: str) -> str | None:
    """Name of the network interface whose address this host uses to reach ``host`` (``None``: unresolvable, no
    route, or the source address is on no interface)."""
    source = route_source(host)
    return None if source is None else interface_of(source)


def route_source(host: str) -> str | None:
    """The address this host's packets to ``host`` leave from (the kernel's route choice; ``None``: unresolvable or
    no route). A UDP ``connect`` only asks the kernel for the route and source address; no packet is sent."""
    try:
        ip = _resolve(host, "host")[0]
    except ValueError:
        return None
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((ip, 9))
            return s.getsockname()[0].split("%")[0]
    except OSError:
        return None


PEER_KEY = "moonrt/peer/"
"""Store key prefix under which each rank publishes ``"<host name> <address>"`` at the rendezvous."""
MAX_PEER_TABLE = 1024
"""Largest world whose ranks read every rank's host at the rendezvous (one store read of ``world`` keys per rank)."""
_PEERS: dict[int, tuple[str, str]] = {}
_GLOO_PEER = re.compile(r"(?:closed|reset) by peer \[([0-9A-Fa-f.:]+)\]:\d+")


def _publish_peer(store, rdzv: Rendezvous) -> None:
    """Before the group forms: this rank's host name and the address it reaches the master from (its gloo address)."""
    if rdzv.world_size <= MAX_PEER_TABLE and rdzv.master_addr is not None:
        store.set(f"{PEER_KEY}{rdzv.rank}", f"{socket.gethostname()} {route_source(rdzv.master_addr) or '?'}")


def _read_peers(store, rdzv: Rendezvous) -> None:
    """After the group formed (every rank had published): keep the table of where each rank runs, and make an
    uncaught exception that reports a lost peer name that peer's ranks (:func:`describe_lost_peers`)."""
    if rdzv.world_size > MAX_PEER_TABLE or rdzv.master_addr is None:
        return
    import sys

    keys = [f"{PEER_KEY}{r}" for r in range(rdzv.world_size)]
    values = store.multi_get(keys) if hasattr(store, "multi_get") else [store.get(k) for k in keys]
    _PEERS.clear()
    for r, v in enumerate(values):
        host, _, addr = v.decode(errors="replace").partition(" ")
        _PEERS[r] = (host, addr)
    hook = sys.excepthook
    if getattr(hook, "_moonrt_lost_peers", False):
        return

    def excepthook(exc_type, exc, tb) -> None:
        hook(exc_type, exc, tb)
        texts, seen = [], exc
        while seen is not None and len(texts) < 10:
            texts.append(str(seen))
            seen = seen.__cause__ or seen.__context__
        note = describe_lost_peers("\n".join(texts), me=rdzv.rank)
        if note:
            print(note, file=sys.stderr, flush=True)

    excepthook._moonrt_lost_peers = True  # type: ignore[attr-defined]
    sys.excepthook = excepthook


def describe_lost_peers(text: str, peers: Mapping[int, tuple[str, str]] | None = None, *, me: int | None = None
                        ) -> str | None:
    """A line naming the ranks and host of each peer address that gloo reports gone in ``text`` ("Connection closed
    by peer [10.0.0.12]:40587": a dead node, killed ranks), from ``peers`` (rank -> (host name, address); default:
    the table read at the rendezvous); ``None`` when ``text`` names no such peer, or only this rank's (``me``) own
    host (a single-host job: the launcher names the failed rank itself)."""
    peers = _PEERS if peers is None else peers
    mine = peers.get(me, ("", ""))[1] if me is not None else None
    lost = []
    for raw in dict.fromkeys(_GLOO_PEER.findall(text)):
        try:
            ip = ipaddress.ip_address(raw)
        except ValueError:
            continue
        ip = getattr(ip, "ipv4_mapped", None) or ip
        ranks = [r for r, (_, addr) in sorted(peers.items()) if addr == str(ip)]
        if ranks and str(ip) != mine:
            host = peers[ranks[0]][0]
            lost.append(f"ranks {ranks} on {host} ({ip})" if len(ranks) > 1 else f"rank {ranks[0]} on {host} ({ip})")
    if not lost:
        return None
    return (f"moonrt: lost the connection to {'; '.join(lost)}: that host's ranks died or were killed (a dead node?); "
            "their own logs tell why")


def interface_of(ip: str) -> str | None:
    """The interface (of this network namespace) that carries address ``ip``, ``None`` if none does (Linux:
    ``SIOCGIFADDR`` for IPv4, ``/proc/net/if_inet6`` for IPv6)."""
    addr = ipaddress.ip_address(ip)
    if addr.version == 6:
        try:
            lines = Path("/proc/net/if_inet6").read_text().splitlines()
        except OSError:
            return None
        for line in lines:
            fields = line.split()
            if len(fields) >= 6 and ipaddress.ip_address(bytes.fromhex(fields[0])) == addr:
                return fields[5]
        return None
    import fcntl
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                res = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
            except OSError:
                continue  # no IPv4 address on it
            if socket.inet_ntoa(res[20:24]) == ip:
                return name
    return None


def _resolve(host: str, what: str) -> list[str]:
    """Distinct IP addresses of ``host`` in resolver order; ``ValueError`` naming ``what`` if none."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise ValueError(f"{what} = {host!r}: cannot resolve ({exc.strerror}): expected an address or host name "
                         "of this host") from None
    return list(dict.fromkeys(info[4][0].split("%")[0] for info in infos))


def _is_loopback(host: str) -> bool:
    """True when ``host`` resolves to loopback addresses only (False when it does not resolve)."""
    try:
        ips = _resolve(host, "host")
    except ValueError:
        return False
    return all(ipaddress.ip_address(ip).is_loopback for ip in ips)


def _multi_node(env: Mapping[str, str], rdzv: Rendezvous) -> bool | None:
    """Whether the job spans several hosts, from the launcher's variables (``None``: cannot tell)."""
    if rdzv.source == "torchrun" and env.get("LOCAL_WORLD_SIZE", "").isdigit():
        return int(env["LOCAL_WORLD_SIZE"]) < rdzv.world_size
    if rdzv.source == "slurm":
        if env.get("SLURM_STEP_NUM_NODES", "").isdigit():
            return int(env["SLURM_STEP_NUM_NODES"]) > 1
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
        if nodelist:
            try:
                return len(parse_hostlist(nodelist)) > 1
            except ValueError:
                return None
    return None


def _mpi_store(rdzv: Rendezvous, timeout: timedelta, host: str | None = None):
    """Rank 0 opens a TCPStore on a free port (on ``host``, the job's ``dist.rdzv_host``, when given); (host, port)
    reaches the others via ``MPI_Bcast``."""
    import torch.distributed as dist

    try:
        from mpi4py import MPI
    except ImportError:
        raise ValueError(
            "MPI environment detected but mpi4py is not installed: install moonrt[mpi] or set MASTER_ADDR and "
            "MASTER_PORT for every rank"
        ) from None
    comm = MPI.COMM_WORLD
    if comm.Get_size() != rdzv.world_size or comm.Get_rank() != rdzv.rank:
        raise ValueError(
            f"MPI_COMM_WORLD is rank {comm.Get_rank()} of {comm.Get_size()} but the environment says rank "
            f"{rdzv.rank} of {rdzv.world_size} (mpi4py built against a different MPI than mpiexec?)"
        )
    hosts = comm.allgather(socket.gethostname())
    one_host = len(set(hosts)) == 1
    store = None
    answer: tuple[str, int] | str | None = None
    if rdzv.rank == 0:
        try:  # any error must reach every rank (through the broadcast), or they would wait forever
            if host or os.environ.get(RDZV_HOST_ENV):
                bind = rendezvous_bind_host("", multi_node=not one_host, host=host)
            elif one_host:
                bind = "127.0.0.1"
            else:
                bind = rendezvous_bind_host(hosts[0], multi_node=True)
            store = master_store(bind, 0, rdzv.world_size, timeout)
            ip = ipaddress.ip_address(_resolve(bind, "dist.rdzv_host" if host else RDZV_HOST_ENV)[0])
            answer = (_routable_host() if ip.is_unspecified else str(ip), store.port)
        except ValueError as exc:
            answer = str(exc)
    answer = comm.bcast(answer, root=0)
    if isinstance(answer, str):
        raise ValueError(answer if rdzv.rank == 0 else f"rank 0 could not open the rendezvous store: {answer}")
    addr, port = answer
    set_gloo_interface(addr)
    if store is None:
        store = dist.TCPStore(addr, port, rdzv.world_size, is_master=False, timeout=timeout)
    return store, dataclasses.replace(rdzv, master_addr=addr, master_port=port)


def _routable_host() -> str:
    """This host's name if it resolves, else its loopback address (single-node runs)."""
    name = socket.gethostname()
    try:
        socket.getaddrinfo(name, None)
        return name
    except OSError:
        return "127.0.0.1"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port the OS reports free right now (for launchers that must pass a port to children)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
