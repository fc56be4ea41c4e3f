"""Where this process sits in the job, read from its launcher's environment variables (:func:`detect_rendezvous`).

Pure functions of an environment mapping: nothing is started or opened here. Detection order (the first launcher
whose variables are present wins):

1. **torchrun** (and ``moonrt launch``): ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``
   (``LOCAL_RANK`` optional, default: ``RANK``). Under the real torchrun, whose agent already serves
   the rendezvous store on ``MASTER_PORT`` and says so with ``TORCHELASTIC_USE_AGENT_STORE=True``
   (:func:`uses_agent_store`; every rendezvous backend, ``--standalone`` included), every rank connects
   to that store as a client, as torch's ``env://`` does; otherwise rank 0 opens the store.
2. **SLURM**, inside an ``srun`` step: ``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS``,
   ``SLURM_LOCALID``, ``SLURM_JOB_ID`` (``SLURM_STEP_ID`` optional, default 0), master = first
   host of ``SLURM_STEP_NODELIST`` (else ``SLURM_JOB_NODELIST``, expanded by :func:`parse_hostlist`), port derived
   from the job and step ids (:func:`slurm_port`, unless ``MASTER_PORT`` is set). ``SLURM_NTASKS`` is deliberately
   *not* used: inside a batch script (outside ``srun``) it is the job size while only one process
   runs (checked on slurm-wlm 22.05).
   When MPI variables are present too and give a different world size (``mpiexec`` inside an
   allocation starts one proxy per node through ``srun``), the MPI path is taken instead.
3. **MPI**: ``OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK`` (Open MPI) or ``PMI_RANK``, ``PMI_SIZE``,
   ``MPI_LOCALRANKID`` (MPICH/Hydra, Intel MPI). Unless ``MASTER_ADDR``/``MASTER_PORT`` are set,
   rank 0 opens the rendezvous store on an OS-chosen free port and broadcasts ``(host, port)``
   with mpi4py (no fixed ports; :func:`moonrt.cluster.store._mpi_store`).
4. Otherwise a **single** process (world size 1, in-memory store).

A partially set environment (``RANK`` without ``WORLD_SIZE``, ``SLURM_PROCID`` outside an
``srun`` step, ...) is a :class:`ValueError` naming the missing variables. :func:`_multi_node` tells from the same
variables whether the job spans several hosts. Joining the group: :func:`moonrt.cluster.env.init_distributed`.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from typing import Literal

SLURM_PORT_BASE = 1024
"""Ports derived for SLURM steps lie in [SLURM_PORT_BASE, SLURM_PORT_END): every unprivileged port below Linux's
ephemeral range (32768-60999 by default), where outgoing connections (gloo's among them) take their ports."""
SLURM_PORT_END = 32768
SLURM_STEP_SLOTS = 4
"""Ports set aside per SLURM job: concurrent steps of one job get distinct ports while their ids differ mod 4."""
AGENT_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"
"""``"True"`` in the workers of a torchrun whose agent serves the rendezvous store on ``MASTER_PORT``."""

Source = Literal["torchrun", "slurm", "mpi", "single"]


@dataclasses.dataclass(frozen=True, slots=True)
class Rendezvous:
    """Where this process sits in the job and how to reach rank 0's store.

    ``master_addr``/``master_port`` are ``None`` for ``source="single"`` (no store needed) and for
    ``source="mpi"`` when they are exchanged through mpi4py at :func:`moonrt.cluster.env.init_distributed` time.
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
    out: list[str] = []
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
    which every rank checks before joining (:mod:`moonrt.cluster.store`); the job fails with a line naming both
    jobs (or, when rank 0 cannot bind the port, naming the address in use).
    """
    span = SLURM_PORT_END - SLURM_PORT_BASE
    return SLURM_PORT_BASE + (job_id * SLURM_STEP_SLOTS + step_id % SLURM_STEP_SLOTS) % span


def uses_agent_store(rdzv: Rendezvous, environ: Mapping[str, str] = os.environ) -> bool:
    """Whether torchrun's agent already serves the rendezvous store on ``MASTER_ADDR:MASTER_PORT``: its workers
    get ``TORCHELASTIC_USE_AGENT_STORE=True`` (torch 2.13's torchrun sets it for every rendezvous backend, with
    ``--standalone`` too), and then no rank may open a store there (the port is torchrun's); all are its clients."""
    return rdzv.source == "torchrun" and environ.get(AGENT_STORE_ENV) == "True"


def launcher_name(rdzv: Rendezvous, environ: Mapping[str, str] = os.environ) -> str:
    """The program that started this job: ``moonrt launch`` (it sets torchrun's variables plus
    :data:`moonrt.cluster.lifeline.LAUNCHER_PID_ENV`) told apart from ``torchrun``; else the source (``slurm``,
    ``mpi``, ``single``)."""
    from moonrt.cluster.lifeline import LAUNCHER_PID_ENV

    if rdzv.source == "torchrun" and environ.get(LAUNCHER_PID_ENV):
        return "moonrt launch"
    return rdzv.source


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
