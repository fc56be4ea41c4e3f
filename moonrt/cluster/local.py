"""Run a Python function on N local ranks (separate processes, gloo), for tests and benchmarks.

``run_ranks(fn, nprocs, *args)`` calls ``fn(rank, world_size, *args)`` in N processes after
``torch.distributed`` is initialized in each (gloo, one intra-op thread per rank), and returns the
ranks' return values in rank order.

Design (measured on 2-core machines): each rank costs one ``import torch`` if started fresh, which
dominates start-up on 2 cores. Ranks are therefore forked from a *fork server* that imported torch
once (and ``torch.distributed.checkpoint``, ~1.2 s more per rank that saves or loads a sharded
checkpoint), loaded numba's compiled KDA kernels (:mod:`moonrt.cluster.rank_preload`) and never ran a
kernel (forking a parent that already used OpenMP can hang the child). The
rendezvous store is a ``TCPStore`` that the caller opens on an OS-chosen free port of 127.0.0.1
(loopback only, never every interface), never a hard-coded one; gloo uses the loopback interface.

Failure handling: the first rank that raises ends the run; the others are terminated and
:class:`RankError` carries that rank's traceback. If the run exceeds ``timeout`` seconds, every
live rank dumps its Python stack (faulthandler) and :class:`RankTimeout` lists which ranks hung
and where.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import pickle
import signal
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from moonrt.cluster.network import GLOO_IFNAME_ENV, loopback_interface
from moonrt.cluster.store import master_store

_PRELOAD = ["torch", "torch.distributed", "torch.distributed.checkpoint", "numpy", "moonrt.cluster.rank_preload"]


class RankError(RuntimeError):
    """A rank raised or exited abnormally; ``rank`` names it and the message holds its traceback."""

    def __init__(self, rank: int, message: str) -> None:
        super().__init__(message)
        self.rank = rank


class RankTimeout(RankError):
    """The run did not finish in time; the message holds the stacks of the ranks still running."""


def _context() -> mp.context.ForkServerContext:
    ctx = mp.get_context("forkserver")
    # Effective only before the fork server starts (first use); later calls are harmless.
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _worker(
    rank: int,
    world_size: int,
    fn: Callable[..., Any],
    args: tuple,
    store_addr: tuple[str, int],
    workdir: str,
    collective_timeout_s: float,
    threads: int,
    gloo_ifname: str,
) -> None:
    import torch
    import torch.distributed as dist

    stack_file = open(Path(workdir) / f"stack{rank}.txt", "w")  # noqa: SIM115 (lives as long as the rank)
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    torch.set_num_threads(threads)
    os.environ[GLOO_IFNAME_ENV] = gloo_ifname
    try:
        store = dist.TCPStore(store_addr[0], store_addr[1], world_size, is_master=False,
                              timeout=timedelta(seconds=collective_timeout_s))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=collective_timeout_s))
        result = fn(rank, world_size, *args)
        with open(Path(workdir) / f"result{rank}.pkl", "wb") as f:
            pickle.dump(result, f)
    except BaseException:
        import traceback

        (Path(workdir) / f"error{rank}.txt").write_text(traceback.format_exc())
        raise SystemExit(1) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(
    fn: Callable[..., Any],
    nprocs: int,
    *args: Any,
    timeout: float = 120.0,
    collective_timeout_s: float | None = None,
    threads: int = 1,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``nprocs`` gloo ranks; return results in rank order.

    ``fn`` and ``args`` must be picklable (a module-level function). ``timeout`` bounds the whole
    run; ``collective_timeout_s`` (default: ``timeout``) bounds each collective inside it.
    Raises :class:`RankError` (with the failing rank's traceback) or :class:`RankTimeout`.
    """
    if nprocs < 1:
        raise ValueError(f"nprocs = {nprocs!r}: expected an integer >= 1")
    collective_timeout_s = collective_timeout_s or timeout
    ctx = _context()
    store = master_store("127.0.0.1", 0, nprocs, timedelta(seconds=collective_timeout_s))
    gloo_ifname = os.environ.get(GLOO_IFNAME_ENV) or loopback_interface()
    with tempfile.TemporaryDirectory(prefix="moonrt-ranks-") as workdir:
        procs = [
            ctx.Process(
                target=_worker,
                args=(r, nprocs, fn, args, ("127.0.0.1", store.port), workdir, collective_timeout_s, threads,
                      gloo_ifname),
                name=f"moonrt-rank{r}",
                daemon=True,
            )
            for r in range(nprocs)
        ]
        for p in procs:
            p.start()
        try:
            _wait(procs, workdir, timeout)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
            for p in procs:
                p.join(5)
        results = []
        for r in range(nprocs):
            with open(Path(workdir) / f"result{r}.pkl", "rb") as f:
                results.append(pickle.load(f))
        return results


def _root_cause(procs: list, workdir: str, first: int) -> int:
    """The rank whose failure came first: when one rank dies or raises, its peers' collectives fail
    a moment later, so wait briefly for them, then blame a rank that died without a traceback
    (killed), else the one whose traceback was written first."""
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline and any(p.exitcode is None for p in procs):
        time.sleep(0.01)
    failed = [
        r for r, p in enumerate(procs)
        if p.exitcode not in (None, 0) or (p.exitcode == 0 and not (Path(workdir) / f"result{r}.pkl").exists())
    ] or [first]
    errors = {r: Path(workdir) / f"error{r}.txt" for r in failed}
    silent = [r for r in failed if not errors[r].exists()]
    if silent:
        return min(silent)
    return min(failed, key=lambda r: (errors[r].stat().st_mtime_ns, r))


def describe_exit(code: int) -> str:
    """``"exit code 3"`` or ``"killed by signal SIGKILL"`` for a ``Popen.returncode`` / ``exitcode``."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = str(-code)
        return f"killed by signal {name}"
    return f"exit code {code}"


def _wait(procs: list, workdir: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    pending = set(range(len(procs)))
    while pending:
        for r in sorted(pending):
            code = procs[r].exitcode
            if code is None:
                continue
            pending.discard(r)
            if code != 0 or not (Path(workdir) / f"result{r}.pkl").exists():
                r = _root_cause(procs, workdir, r)
                err = Path(workdir) / f"error{r}.txt"
                code = procs[r].exitcode
                if code == 0:
                    raise RankError(r, f"rank {r} of {len(procs)} failed: exited early (exit code 0) before fn "
                                       "returned")
                detail = err.read_text() if err.exists() else f"{describe_exit(code)} without a Python traceback"
                raise RankError(r, f"rank {r} of {len(procs)} failed:\n{detail}")
        if not pending:
            return
        if time.monotonic() > deadline:
            for r in pending:
                try:
                    os.kill(procs[r].pid, signal.SIGUSR1)
                except ProcessLookupError:
                    pass
            time.sleep(0.5)
            stacks = []
            for r in sorted(pending):
                f = Path(workdir) / f"stack{r}.txt"
                stacks.append(f"--- rank {r} stack ---\n{f.read_text() if f.exists() else '(none)'}")
            first = min(pending)
            raise RankTimeout(
                first,
                f"ranks {sorted(pending)} of {len(procs)} still running after {timeout:.0f} s:\n" + "\n".join(stacks),
            )
        time.sleep(0.01)
