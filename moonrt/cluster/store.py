"""Rank 0's rendezvous store: the one address it listens on, and which job's ranks may join it.

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
- MPI: loopback when every rank runs on one host, else the address rank 0's host name resolves to
  (:func:`_mpi_store`, which sends the store's address to the other ranks through mpi4py).

**Job identity.** A port can still be shared by two jobs (two SLURM jobs whose derived ports collide,
a ``MASTER_PORT`` set twice): the store then holds ranks of both, which would form mixed process groups
that run to the end. Rank 0 therefore publishes its job's identity (:func:`job_identity`: ``moonrt launch``'s
per-job random ``MOONRT_JOB_ID``, else the SLURM job and step ids, else torchrun's run id) in its store, and
every other rank compares it with its own before joining the group (:func:`check_job_identity`): a rank that
reached another job's store fails with a ``ValueError`` naming both jobs instead of joining. (The MPI path's store
port is chosen by the OS and sent through MPI: private to the job, not checked.)

**Jobs without a launcher identity** (only ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, as a
hand-written script sets them) share nothing that tells two of them apart, so what they share at the rendezvous is
made unique instead: rank 0 publishes a fresh random nonce as its job's identity (into a store it has just opened:
a port where another job's store listens is refused at the bind), and every other rank reads it and then claims
its rank's slot in that store (``compare_set``, one process per slot). A second rank 0 on a port in use, or a rank
whose slot another process holds (the rank of the job that got there first), fails with one line saying "another
job is using MASTER_ADDR:MASTER_PORT = host:port" and writes nothing else into that store: a job started on the
port of a running one fails whole, and the running one is untouched. (Ranks of two such jobs started at the same
moment are told apart only by who claims a slot first: each rank that loses fails naming the clash.)
"""

from __future__ import annotations

import dataclasses
import errno
import ipaddress
import os
import secrets
import socket
import time
from collections.abc import Mapping
from datetime import timedelta

from moonrt.cluster.detect import Rendezvous
from moonrt.cluster.network import _resolve, _routable_host, set_gloo_interface

RDZV_HOST_ENV = "MOONRT_RDZV_HOST"
"""Address (or name) of the interface rank 0's rendezvous store listens on, as a launcher passes it (see module doc);
``DistConfig.rdzv_host`` wins over it."""

JOB_ID_ENV = "MOONRT_JOB_ID"
"""Per-job random nonce that ``moonrt launch`` gives its ranks: their job identity (:func:`job_identity`)."""
IDENTITY_KEY = "moonrt/job_identity"
"""Key under which rank 0 publishes its job identity in its rendezvous store."""
SLOT_KEY = "moonrt/rank_slot/"
"""Key prefix under which each rank > 0 of a job without a launcher identity claims its rank (``compare_set``)."""
NO_IDENTITY = "a job without a launcher identity (no MOONRT_JOB_ID, SLURM_JOB_ID or torchrun run id)"
"""How the identity rank 0 publishes for such a job starts; its nonce follows."""


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
    ``ValueError`` naming both jobs when they differ (it reached another job's store: it must not join). Without a
    launcher identity (:func:`job_identity` ``None``) rank 0 publishes a fresh nonce and every other rank claims its
    rank's slot; a ``ValueError`` names the clash when the identity or the slot is another process's (module doc)."""
    mine = job_identity(environ)
    where = f"MASTER_ADDR:MASTER_PORT = {rdzv.master_addr}:{rdzv.master_port}"
    if mine is None:
        if rdzv.rank == 0:
            nonce = f"{NO_IDENTITY}, nonce {secrets.token_hex(8)}"
            found = store.compare_set(IDENTITY_KEY, "", nonce).decode(errors="replace")
            if found != nonce:
                raise ValueError(f"another job is using {where}: its rank 0 ({found}) published its identity there "
                                 "first; not starting a second rank 0 (give each job a MASTER_PORT of its own)")
            return
        theirs = store.get(IDENTITY_KEY).decode(errors="replace")
        if theirs.startswith(NO_IDENTITY):
            token = f"pid {os.getpid()} on {socket.gethostname()}, {secrets.token_hex(8)}"
            found = store.compare_set(f"{SLOT_KEY}{rdzv.rank}", "", token).decode(errors="replace")
            if found != token:
                raise ValueError(f"another job is using {where}: rank {rdzv.rank} of the job there ({theirs}) has "
                                 f"joined already ({found.rpartition(',')[0]}); not joining that job's group (give "
                                 "each job a MASTER_PORT of its own)")
            return
        mine = NO_IDENTITY
    if rdzv.rank == 0:
        store.set(IDENTITY_KEY, mine)
        return
    theirs = store.get(IDENTITY_KEY).decode(errors="replace")
    if theirs != mine:
        raise ValueError(
            f"the rendezvous store at {rdzv.master_addr}:{rdzv.master_port} belongs to {theirs}, but this process "
            f"(rank {rdzv.rank}) belongs to {mine}: two jobs met on one port; not joining the other job's group"
        )


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
        if exc.errno == errno.EADDRINUSE and port:
            raise ValueError(
                f"another job is using MASTER_ADDR:MASTER_PORT = {connect or bind}:{port}: its port is in use on this "
                f"host ({bind}:{port}: {exc.strerror}); give each job a MASTER_PORT of its own"
            ) from None
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


def client_store(addr: str, port: int, world_size: int, timeout: timedelta):
    """A client of rank 0's ``TCPStore`` at ``addr``:``port``, reached within ``timeout`` or a ``ValueError`` in one
    line naming the address.

    torch's client retries its connection past its own timeout and then fails with a C++ trace; a rank whose rank 0
    never came up (node 0 died at start-up) waited more than 400 s at the default timeout and then blamed a peer. So
    the address is first polled with plain TCP connects (each closed at once; the store takes a closed connection
    as a client that left) until ``timeout`` runs out, and only a store that answered is joined, with what is left
    of ``timeout``."""
    import torch.distributed as dist

    total = timeout.total_seconds()
    deadline = time.monotonic() + total
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((addr, port), timeout=max(min(left, 2.0), 0.05)):
                break
        except OSError as exc:
            if time.monotonic() + 0.25 >= deadline:
                raise ValueError(
                    f"cannot reach rank 0's store at MASTER_ADDR:MASTER_PORT = {addr}:{port} within {total:g} s "
                    f"({exc.strerror or exc}): is rank 0 (node 0) running, and is that its address? (the job's "
                    "timeout, --timeout / dist.timeout_s, bounds this wait)") from None
            time.sleep(0.25)
    return dist.TCPStore(addr, port, world_size, is_master=False,
                         timeout=timedelta(seconds=max(deadline - time.monotonic(), 1.0)))


def _mpi_store(rdzv: Rendezvous, timeout: timedelta, host: str | None = None):
    """Rank 0 opens a TCPStore on a free port (on ``host``, the job's ``dist.rdzv_host``, when given); (host, port)
    reaches the others via ``MPI_Bcast``."""

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
        store = client_store(addr, port, rdzv.world_size, timeout)
    return store, dataclasses.replace(rdzv, master_addr=addr, master_port=port)
