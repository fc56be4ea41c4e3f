"""``moonrt launch -n N [--nnodes M --node-rank R --master-addr A [--master-port P] --rdzv-id ID] [--timeout S]
[--max-time S] (--selftest | -- command ...)``: N local ranks (of N x M).

Like ``torchrun --standalone``: each rank is a fresh process with ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR=127.0.0.1`` and ``MASTER_PORT`` (a port the OS
reports free), ``GLOO_SOCKET_IFNAME`` = the loopback interface (unless set), plus
``MOONRT_DIST_TIMEOUT`` = ``--timeout``, which
:func:`moonrt.cluster.env.init_distributed` uses as the timeout of the rendezvous and every
collective unless the job's config sets one (``dist.timeout_s`` wins), ``MOONRT_JOB_ID`` (a random
nonce per launch: the job identity every rank checks at the rendezvous, so a rank never joins another
job that got the same port) and ``MOONRT_LAUNCHER_PID``;
torchrun's ``TORCHELASTIC_*`` variables (when the launcher itself runs in a torchrun worker) are not passed on.
Numeric flags are range-checked before anything starts (one line naming the flag, exit 2).

Ranks die with the launcher, even when it is killed with SIGKILL: on Linux each rank gets
``PR_SET_PDEATHSIG`` = SIGKILL (set between fork and exec, then ``getppid()`` re-checked in case the
launcher died in between); elsewhere a rank that joins through ``init_distributed`` runs
:func:`moonrt.cluster.lifeline.watch_launcher`. SIGKILL, not SIGTERM: with the launcher gone, nothing would
bound a graceful stop (a rank ignoring SIGTERM, or waiting on a peer, would live on) or see its result;
checkpoints are written atomically, so the last committed one stays valid for a resume. (Children a
rank starts itself are not covered on Linux unless they watch their own parent.)

Everything the job listens on is on loopback: rank 0's rendezvous store binds
127.0.0.1 only (see :mod:`moonrt.cluster.store`), gloo's sockets the loopback interface. Each line a
rank prints is echoed with a ``[rank r]`` prefix (stdout to stdout, stderr to stderr); a one-line error
(``PROG: error: ...``, :data:`ERROR_LINE`) that another rank of this node already printed word for word (a config
error every rank finds) is not echoed again.

**Several nodes** (torchrun's flags and meaning, static rendezvous): run one ``moonrt launch`` per node with the same
``-n`` (ranks per node), ``--nnodes M``, ``--master-addr A`` (an address or name of node 0's host, where rank 0's
store listens: :func:`moonrt.cluster.store.rendezvous_bind_host` binds exactly that address, never a wildcard),
``--master-port P`` (default 29500, torchrun's) and ``--rdzv-id ID`` (the same job id on every node: the job identity
each rank checks at the rendezvous, so a launcher of another job that reaches this port is refused with a line naming
both), and ``--node-rank R`` in [0, M). Node R's local rank r is global rank R x N + r (``RANK``, ``WORLD_SIZE`` =
N x M, ``LOCAL_RANK`` = r, ``LOCAL_WORLD_SIZE`` = N, ``GROUP_RANK`` = R, ``NODE_RANK`` = R). ``GLOO_SOCKET_IFNAME``
is passed on only when set; otherwise each rank puts gloo on the interface it reaches the master address through
(:func:`moonrt.cluster.network.set_gloo_interface`). Each launcher supervises its own node's ranks as above; when
another node dies, its peers' collectives fail and the ranks name the lost ranks and their host
(:func:`moonrt.cluster.peers.describe_lost_peers`). Prefixes and messages use global ranks.

Failure: as soon as one rank exits non-zero or is killed, the others are stopped (SIGTERM, then
SIGKILL after a grace period; each rank runs in its own process group so its children go too) and
the launcher exits non-zero with a message that names the first failing rank and shows the tail
of its stderr (its traceback; not when that stderr is one line, already echoed above).
A rank that hangs without dying (stopped with SIGSTOP, deadlocked,
looping) makes its peers' collectives time out after ``--timeout`` seconds, which ends the job the
same way; the message then names the rank(s) still running when the peers timed out as the ones
that stopped making progress (a rank frozen by a signal first), not the peer that noticed.
``--max-time`` bounds the whole run regardless.

Signals: SIGTERM and SIGINT (and SIGHUP, forwarded as SIGTERM; SIGUSR1/SIGUSR2 as themselves) sent to the
launcher are forwarded to every rank's process group, so a job that stops on them (``moonrt train``: finish the
step, checkpoint, exit :data:`moonrt.cluster.preempt.PREEMPTED_EXIT` = 75) can save; a second one is forwarded
too (``moonrt train`` then aborts at once). After a SIGTERM/SIGINT/SIGHUP the launcher waits up to
``--stop-grace`` seconds for the ranks, then stops them as above; ranks exiting with code 75 are not failures.
A rank that fails otherwise meanwhile (a traceback: any other exit code) is reported as above. The
launcher's exit code is the ranks': their common code (75 when all checkpointed, 143 when all were killed
by SIGTERM), else the first rank's code that is neither 0 nor 75.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import math
import os
import queue
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

from moonrt.cluster.env import MAX_TIMEOUT_S, TIMEOUT_ENV
from moonrt.cluster.lifeline import LAUNCHER_PID_ENV, PR_SET_PDEATHSIG, libc_prctl
from moonrt.cluster.local import describe_exit
from moonrt.cluster.network import GLOO_IFNAME_ENV, free_port, loopback_interface
from moonrt.cluster.preempt import PREEMPTED_EXIT
from moonrt.cluster.store import JOB_ID_ENV
from moonrt.config import MAX_TIMEOUT_S as MAX_DIST_TIMEOUT_S

STDERR_TAIL = 40
"""Lines of the failing rank's stderr repeated in the failure message."""
TIMEOUT_MARK = re.compile(r"(?i)\btimed? ?out\b")
ERROR_LINE = re.compile(r"^[\w][\w .-]*: error: ")
"""A rank's one-line error (``moonrt train: error: ...``): echoed once per node however many ranks print it."""
"""How gloo/torch say that a collective or the rendezvous ran past its timeout."""
PEER_FAILURE_MARKS = ("Connection closed by peer", "Connection reset by peer", "remote worker crashing")
"""gloo's words for "a peer went away": a rank showing them failed because of another rank."""
GRACE_S = 5.0
"""Seconds between SIGTERM and SIGKILL when stopping the surviving ranks."""
STOP_GRACE_S = 300.0
"""Default ``--stop-grace``: seconds the ranks get to finish their step and checkpoint after a forwarded stop signal."""
FORWARD = {signal.SIGTERM: signal.SIGTERM, signal.SIGINT: signal.SIGINT, signal.SIGHUP: signal.SIGTERM,
           signal.SIGUSR1: signal.SIGUSR1, signal.SIGUSR2: signal.SIGUSR2}
"""Signal received by the launcher -> signal sent to each rank's process group."""
STOPS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
"""Received signals that start the ``--stop-grace`` wait (the others are only forwarded)."""
MAX_NPROCS = 1024
"""Most local ranks one launch starts."""
MAX_NNODES = 65536
"""Most nodes of one multi-node launch."""
MASTER_PORT = 29500
"""Default ``--master-port`` of a multi-node launch (torchrun's)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-n", "--nprocs", "--nproc-per-node", type=int, required=True,
                        help="number of local ranks (per node)")
    parser.add_argument("--nnodes", type=int, default=1, help="number of nodes, one launcher each (default 1)")
    parser.add_argument("--node-rank", type=int, default=0, help="this node's rank in [0, --nnodes) (default 0)")
    parser.add_argument("--master-addr", default=None,
                        help="with --nnodes > 1: address or name of node 0's host; rank 0's store listens on exactly "
                        "that address")
    parser.add_argument("--master-port", type=int, default=None,
                        help=f"with --nnodes > 1: rank 0's store port (default {MASTER_PORT})")
    parser.add_argument("--rdzv-id", default=None,
                        help="with --nnodes > 1: a job id, the same on every node (the identity ranks check at the "
                        "rendezvous)")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="rendezvous/collective timeout in seconds passed to every rank (default 300)")
    parser.add_argument("--max-time", type=float, default=None,
                        help="wall-clock limit of the whole run in seconds (default: none)")
    parser.add_argument("--stop-grace", type=float, default=STOP_GRACE_S,
                        help="seconds the ranks get to checkpoint and exit after a forwarded SIGTERM/SIGINT before "
                        f"they are killed (default {STOP_GRACE_S:g})")
    parser.add_argument("--selftest", action="store_true",
                        help="run the communication self-test (python -m moonrt.jobs.selftest) on the ranks")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="-- command and arguments to run on every rank (with --selftest: -- self-test options)")


def run(args: argparse.Namespace) -> int:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if args.selftest:
        command = [sys.executable, "-u", "-m", "moonrt.jobs.selftest", *command]
    if not command:
        print("moonrt launch: nothing to run: give --selftest or -- command ...", file=sys.stderr)
        return 2
    try:
        check_launch_values(args.nprocs, args.timeout, args.max_time, args.stop_grace, flags=True)
        nodes = check_nodes(args.nnodes, args.node_rank, args.master_addr, args.master_port, args.rdzv_id,
                            flags=True)
    except ValueError as exc:
        print(f"moonrt launch: {exc}", file=sys.stderr)
        return 2
    try:  # launch() forwards SIGTERM/SIGINT/SIGHUP (scancel, Ctrl-C, a closed terminal) to the ranks
        return launch(command, args.nprocs, timeout_s=args.timeout, max_time_s=args.max_time,
                      stop_grace_s=args.stop_grace, nodes=nodes)
    except ValueError as exc:
        print(f"moonrt launch: {exc}", file=sys.stderr)
        return 2


def check_launch_values(nprocs: object, timeout_s: object, max_time_s: object, stop_grace_s: object, *,
                        flags: bool = False) -> None:
    """Raise ``ValueError`` naming the first bad value (its CLI flag when ``flags``): the number of ranks an integer
    in [1, :data:`MAX_NPROCS`], each duration finite, > 0 and at most :data:`~moonrt.cluster.env.MAX_TIMEOUT_S`
    seconds (``inf`` would overflow ``timedelta`` and torch's clocks on every rank); the collective timeout at most
    :data:`moonrt.config.MAX_TIMEOUT_S` (a week), which every rank checks it against."""
    if not (isinstance(nprocs, int) and not isinstance(nprocs, bool) and 1 <= nprocs <= MAX_NPROCS):
        raise ValueError(f"{'--nprocs' if flags else 'nprocs'} = {nprocs!r}: expected an integer >= 1"
                         f" and <= {MAX_NPROCS}")
    for value, flag, name, bound in ((timeout_s, "--timeout", "timeout", MAX_DIST_TIMEOUT_S),
                                     (max_time_s, "--max-time", "max_time", MAX_TIMEOUT_S),
                                     (stop_grace_s, "--stop-grace", "stop_grace", MAX_TIMEOUT_S)):
        if value is None and name == "max_time":
            continue
        if not (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
                and 0 < value <= bound):
            raise ValueError(f"{flag if flags else name} = {value!r}: expected a positive number of seconds "
                             f"(finite, at most {bound:g})")


@dataclasses.dataclass(frozen=True, slots=True)
class Nodes:
    """Where one launcher of a multi-node launch sits (module doc, *Several nodes*)."""

    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int
    rdzv_id: str


def check_nodes(nnodes: object, node_rank: object, master_addr: object, master_port: object, rdzv_id: object, *,
                flags: bool = False) -> Nodes | None:
    """The multi-node settings (``None`` for a single-node launch, where the others must be unset); ``ValueError``
    naming the first bad value (its CLI flag when ``flags``)."""
    def name(flag: str) -> str:
        return flag if flags else flag.removeprefix("--").replace("-", "_")

    def is_int(v: object) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    if not (is_int(nnodes) and 1 <= nnodes <= MAX_NNODES):
        raise ValueError(f"{name('--nnodes')} = {nnodes!r}: expected an integer >= 1 and <= {MAX_NNODES}")
    if not (is_int(node_rank) and 0 <= node_rank < nnodes):
        raise ValueError(f"{name('--node-rank')} = {node_rank!r}: expected an integer in [0, {nnodes}) "
                         f"({name('--nnodes')} = {nnodes})")
    if master_port is not None and not (is_int(master_port) and 1 <= master_port <= 65535):
        raise ValueError(f"{name('--master-port')} = {master_port!r}: expected a TCP port in 1..65535")
    if nnodes == 1:
        for value, flag in ((master_addr, "--master-addr"), (master_port, "--master-port"), (rdzv_id, "--rdzv-id")):
            if value is not None:
                raise ValueError(f"{name(flag)} = {value!r}: expected only with {name('--nnodes')} > 1 (a single "
                                 "node's launch rendezvouses on 127.0.0.1 and a port the OS reports free)")
        return None
    if not (isinstance(master_addr, str) and re.fullmatch(r"[\w.:%-]+", master_addr, re.ASCII)):
        raise ValueError(f"{name('--master-addr')} = {master_addr!r}: expected the address or host name of node 0's "
                         f"host (with {name('--nnodes')} = {nnodes})")
    if not (isinstance(rdzv_id, str) and re.fullmatch(r"[\w.:@+-]{1,128}", rdzv_id, re.ASCII)):
        raise ValueError(f"{name('--rdzv-id')} = {rdzv_id!r}: expected a job id shared by every node's launcher (1 to "
                         f"128 letters, digits, '_ . : @ + -'; with {name('--nnodes')} = {nnodes})")
    return Nodes(nnodes, node_rank, master_addr, MASTER_PORT if master_port is None else master_port, rdzv_id)


def _die_with_launcher(prctl: Callable[..., int], launcher: int) -> Callable[[], None]:
    """``preexec_fn`` of every rank (runs in the child between fork and exec): the kernel sends the rank SIGKILL
    when the thread that forked it ends. That thread is the one running :func:`launch`, which returns only after
    every rank has ended (the CLI's main thread), so the signal means the launcher died. If it died before the
    prctl took effect, the rank has been reparented already: it kills itself instead of running unsupervised.
    (SIGKILL rather than SIGTERM: module doc.)"""

    kill = int(signal.SIGKILL)

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, kill, 0, 0, 0)  # should it fail, the portable watchdog (lifeline.py) acts instead
        if os.getppid() != launcher:
            os.kill(os.getpid(), kill)

    return preexec


class _Received:
    """While active (main thread only: elsewhere it installs nothing), the signals of :data:`FORWARD` are
    recorded in arrival order instead of acting; the previous handlers are restored on exit."""

    def __init__(self) -> None:
        self.pending: list[int] = []
        self._previous: dict[int, object] = {}

    def _handle(self, signum: int, _frame: object) -> None:
        self.pending.append(signum)

    def take(self) -> list[int]:
        out = self.pending[:]
        del self.pending[:len(out)]  # a signal recorded meanwhile stays pending
        return out

    def __enter__(self) -> _Received:
        if threading.current_thread() is threading.main_thread():
            for sig in FORWARD:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


def launch(
    command: list[str],
    nprocs: int,
    *,
    timeout_s: float = 300.0,
    max_time_s: float | None = None,
    stdout: IO[str] | None = None,
    stderr: IO[str] | None = None,
    stop_grace_s: float = STOP_GRACE_S,
    nodes: Nodes | None = None,
) -> int:
    """Run ``command`` on ``nprocs`` local ranks; return 0, or non-zero after reporting the failing rank.

    ``stdout``/``stderr`` (default: this process's) receive the prefixed rank output and the
    launcher's own messages. Called in the main thread, it forwards signals to the ranks (module docstring).
    ``nodes``: this launcher's place in a multi-node launch (:func:`check_nodes`); ``None``: a single node.
    """
    with _Received() as received:
        return _launch(command, nprocs, timeout_s, max_time_s, stdout, stderr, stop_grace_s, received, nodes)


def _launch(command: list[str], nprocs: int, timeout_s: float, max_time_s: float | None, stdout: IO[str] | None,
            stderr: IO[str] | None, stop_grace_s: float, received: _Received, nodes: Nodes | None = None) -> int:
    check_launch_values(nprocs, timeout_s, max_time_s, stop_grace_s)
    out = stdout or sys.stdout
    err = stderr or sys.stderr
    prctl = libc_prctl()
    preexec = None if prctl is None else _die_with_launcher(prctl, os.getpid())
    if nodes is None:
        base, world, addr, port, job_id = 0, nprocs, "127.0.0.1", free_port(), secrets.token_hex(16)
        node_env = {GLOO_IFNAME_ENV: os.environ.get(GLOO_IFNAME_ENV) or loopback_interface()}
    else:  # GLOO_SOCKET_IFNAME passes through when set; else each rank takes the route to the master's interface
        base, world = nodes.node_rank * nprocs, nodes.nnodes * nprocs
        addr, port, job_id = nodes.master_addr, nodes.master_port, nodes.rdzv_id
        node_env = {"GROUP_RANK": str(nodes.node_rank), "NODE_RANK": str(nodes.node_rank)}
    g = _Global(base)
    lock = threading.Lock()
    tails = [collections.deque(maxlen=STDERR_TAIL) for _ in range(nprocs)]
    lines = [0] * nprocs  # stderr lines per rank (the tail holds the last STDERR_TAIL)
    errors: set[str] = set()  # the error lines echoed (ERROR_LINE): another rank's identical one is not
    exits: queue.Queue[tuple[int, int]] = queue.Queue()
    procs: list[subprocess.Popen] = []
    readers: list[threading.Thread] = []
    start = time.monotonic()
    try:
        for r in range(nprocs):
            env = {
                # torchrun's worker variables, when moonrt launch itself runs in one: this job is not torchrun's
                # (TORCHELASTIC_USE_AGENT_STORE would make rank 0 wait for a store torchrun serves elsewhere)
                **{k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC_")},
                "RANK": str(base + r), "WORLD_SIZE": str(world), "LOCAL_RANK": str(r),
                "LOCAL_WORLD_SIZE": str(nprocs), "MASTER_ADDR": addr, "MASTER_PORT": str(port),
                TIMEOUT_ENV: repr(float(timeout_s)), "PYTHONUNBUFFERED": "1", JOB_ID_ENV: job_id,
                LAUNCHER_PID_ENV: str(os.getpid()), **node_env,
            }
            try:
                p = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     stdin=subprocess.DEVNULL, text=True, errors="replace", start_new_session=True,
                                     preexec_fn=preexec)
            except OSError as exc:
                raise ValueError(f"cannot start {command[0]!r}: {exc.strerror}") from None
            procs.append(p)
            for stream, sink, tail in ((p.stdout, out, None), (p.stderr, err, tails[r])):
                t = threading.Thread(target=_pump, args=(stream, sink, f"[rank {base + r}] ", lock, tail,
                                                         errors if tail is not None else None, lines, r),
                                     daemon=True)
                t.start()
                readers.append(t)
            threading.Thread(target=lambda r=r, p=p: exits.put((r, p.wait())), daemon=True).start()

        done: dict[int, int] = {}
        failed: int | None = None
        stop_sig: int | None = None  # the first stop signal forwarded
        expected = {0, PREEMPTED_EXIT}  # exit codes that are no failure: + death by / abort on a forwarded signal
        stop_deadline = math.inf
        max_deadline = math.inf if max_time_s is None else start + max_time_s
        while len(done) < nprocs:
            for sig in received.take():
                _signal_all(procs, FORWARD[sig])
                expected |= {-FORWARD[sig], 128 + FORWARD[sig]}
                if sig in STOPS and stop_sig is None:
                    stop_sig, stop_deadline = sig, time.monotonic() + stop_grace_s
            now = time.monotonic()
            if now >= min(max_deadline, stop_deadline):
                running = [r for r in range(nprocs) if r not in done]
                _stop(procs)
                _join(readers)
                with lock:
                    if now >= max_deadline:
                        err.write(f"moonrt launch: ranks {g(running)} of {world} still running after --max-time "
                                  f"{max_time_s:g} s; stopped them\n")
                    else:
                        err.write(f"moonrt launch: ranks {g(running)} of {world} still running --stop-grace "
                                  f"{stop_grace_s:g} s after {signal.Signals(stop_sig).name}; stopped them\n")
                    err.flush()
                if now >= max_deadline:
                    return 124
                return _job_code([done.get(r, procs[r].returncode) for r in range(nprocs)])
            try:  # wake up now and then to forward signals
                r, code = exits.get(timeout=min(0.1, max_deadline - now, stop_deadline - now))
            except queue.Empty:
                continue
            done[r] = code
            if code not in expected:
                failed = _first_failure(r, code, exits, done, tails, readers)
                break
        if failed is None:
            _join(readers)
            code = _job_code([done[r] for r in range(nprocs)])
            if stop_sig is not None or code != 0:
                with lock:
                    how = f"after {signal.Signals(stop_sig).name} " if stop_sig is not None else ""
                    codes = sorted(set(done.values()))
                    err.write(f"moonrt launch: {g.these(nprocs)} exited {how}with "
                              + ", ".join(describe_exit(c) for c in codes)
                              + (f" ({PREEMPTED_EXIT}: stopped at a step boundary and checkpointed)"
                                 if PREEMPTED_EXIT in codes else "") + "\n")
                    err.flush()
            return code
        stopped = [r for r in range(nprocs) if procs[r].poll() is None]
        frozen = [r for r in stopped if _process_state(procs[r].pid) in ("T", "t")]
        # a rank that returned 0 while its peers still needed it is the likely cause of their failure
        early = [r for r, c in done.items() if c == 0]
        _stop(procs)
        _join(readers)
        code = done[failed]
        hung = (frozen or stopped) if code > 0 and TIMEOUT_MARK.search("".join(tails[failed])) else []
        with lock:
            if hung:
                how = "stopped by a signal, e.g. SIGSTOP" if frozen else "still running, silent"
                err.write(
                    f"moonrt launch: {_ranks(g(hung))} of {world} stopped making progress ({how}): rank "
                    f"{g(failed)} timed out waiting after --timeout {timeout_s:g} s ({describe_exit(code)}, pid "
                    f"{procs[failed].pid}); stopped ranks {g(stopped)}\n"
                    + "".join(f"--- rank {g(r)} stderr (last {STDERR_TAIL} lines) ---\n" + "".join(tails[r])
                              for r in (*hung, failed) if tails[r] or r == failed)
                    + "--- end ---\n"
                )
                err.flush()
                return code
            err.write(
                f"moonrt launch: rank {g(failed)} of {world} failed: {describe_exit(code)} (pid {procs[failed].pid})"
                + (f"; stopped ranks {g(stopped)}" if stopped else "")
                + (f"; ranks {g(early)} had already exited with code 0 (early exit?)" if early else "")
                + (": its one stderr line is above\n" if lines[failed] == 1 else (
                    f"\n--- rank {g(failed)} stderr (last {STDERR_TAIL} lines) ---\n"
                    + "".join(tails[failed])
                    + "--- end ---\n"))
            )
            err.flush()
        return code if code > 0 else 128 - code
    except BaseException:
        _stop(procs)
        raise




class _Global:
    """Local rank index (or list of them) -> global rank(s) of this node (``base`` = node rank x ranks per node)."""

    def __init__(self, base: int) -> None:
        self.base = base

    def __call__(self, ranks):
        return [self.base + r for r in ranks] if isinstance(ranks, list) else self.base + ranks

    def these(self, n: int) -> str:
        return f"{n} ranks" if self.base == 0 else f"{n} ranks ({self.base}..{self.base + n - 1})"


def _job_code(codes: list[int | None]) -> int:
    """The launcher's exit code from the ranks' ``Popen`` codes (negative: killed by that signal -> 128 + n):
    their common code, else the first that is neither 0 nor :data:`PREEMPTED_EXIT`, else 75 if any, else 0."""
    shell = [128 - c if c is not None and c < 0 else (c if c is not None else 128 + signal.SIGKILL) for c in codes]
    if len(set(shell)) == 1:
        return shell[0]
    bad = [c for c in shell if c not in (0, PREEMPTED_EXIT)]
    return bad[0] if bad else (PREEMPTED_EXIT if PREEMPTED_EXIT in shell else 0)


def _signal_all(procs: list[subprocess.Popen], sig: int) -> None:
    """Send ``sig`` to the process group of every live rank."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


def _process_state(pid: int) -> str:
    """One-letter state of ``pid`` from /proc (``"T"``: stopped by a signal); ``"?"`` where unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "?"
    return stat[stat.rindex(")") + 2]


def _first_failure(rank: int, code: int, exits: queue.Queue, done: dict[int, int],
                   tails: list[collections.deque], readers: list[threading.Thread]) -> int:
    """The rank to blame among the failures seen within a short window.

    When a rank dies or gives up, its peers' collectives fail a moment later, sometimes exiting
    first. Blame, in order: a rank killed by a signal; a rank whose stderr does not show a peer's
    dropped connection (:data:`PEER_FAILURE_MARKS`); else the first to exit.
    """
    failures = {rank: code}
    deadline = time.monotonic() + 1.0
    while (left := deadline - time.monotonic()) > 0:
        try:
            r, c = exits.get(timeout=left)
        except queue.Empty:
            break
        done[r] = c
        if c != 0:
            failures[r] = c
    if code < 0:
        return rank
    killed = [r for r, c in failures.items() if c < 0]
    if killed:
        return killed[0]
    for r in failures:  # a finished rank's pipes are at EOF: let its stderr be read in full
        readers[2 * r + 1].join(2)
    primary = [r for r in failures if not any(m in "".join(tails[r]) for m in PEER_FAILURE_MARKS)]
    return primary[0] if primary else rank


def _pump(stream: IO[str], sink: IO[str], prefix: str, lock: threading.Lock, tail: collections.deque | None,
          errors: set[str] | None = None, counts: list[int] | None = None, rank: int = 0) -> None:
    """Echo ``stream``'s lines to ``sink`` with ``prefix``; keep the last ones in ``tail`` and count them in
    ``counts[rank]``; with ``errors``, an :data:`ERROR_LINE` already in it (another rank's) is not echoed again."""
    for line in stream:
        if not line.endswith("\n"):
            line += "\n"
        if tail is not None:
            tail.append(line)
        with lock:
            if counts is not None:
                counts[rank] += 1
            if errors is not None and ERROR_LINE.match(line):
                if line in errors:
                    continue
                errors.add(line)
            sink.write(prefix + line)
            sink.flush()
    stream.close()


def _stop(procs: list[subprocess.Popen]) -> None:
    """SIGTERM (and SIGCONT, for stopped ranks) to each live rank's process group, SIGKILL after the grace."""
    live = [p for p in procs if p.poll() is None]
    for p in live:
        for sig in (signal.SIGTERM, signal.SIGCONT):
            try:
                os.killpg(p.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
    deadline = time.monotonic() + GRACE_S
    for p in live:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)  # also reaps children left in a finished rank's group
        except (ProcessLookupError, PermissionError):
            pass
        p.wait()


def _join(threads: list[threading.Thread]) -> None:
    for t in threads:
        t.join(5)
