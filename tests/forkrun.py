"""``moonrt`` commands in processes forked from one that imported the heavy third-party libraries once
(``../shared/docs/CLUSTER_NOTES.md``: a new interpreter's ``import torch`` dominates start-up on 2 cores).

A process here is a fork of a parent that imported :data:`PRELOAD` (torch, ``torch._dynamo``, which the first
optimizer imports, ~1 s; DCP; numpy; numba's compiled KDA kernels via :mod:`moonrt.cluster.rank_preload`) and ran
no kernel (forking a parent that already used OpenMP can hang the child, as in :mod:`moonrt.cluster.local`).
moonrt's own modules (but the kernels' loader) are imported by each child itself, as in a new interpreter, so a
command still runs its own import graph (a registry filled by an import elsewhere cannot mask a missing import).
Each child then runs ``moonrt.cli.main(ARGS)``, what the ``moonrt`` console script runs, and exits with its code.

Two uses:

- ``python tests/forkrun.py ranks N -- ARGS...`` (:func:`ranks`): ``moonrt ARGS`` on N local gloo ranks with the
  environment ``moonrt launch -n N`` gives its ranks (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
  ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, the gloo interface, ``MOONRT_DIST_TIMEOUT``), for the
  job tests whose property is the job's result in a layout, not the launcher (``tests/cluster/test_launch*.py``,
  the README walk and the tests that read the launcher's ``[rank N]`` prefixes keep ``moonrt launch``). Exit 0
  when every rank exits 0; else the first failing rank's code, the other ranks stopped (SIGTERM, then SIGKILL).
- ``Server`` (:class:`Server`): one such parent serving many one-process commands, each in its own forked
  process with its own working directory and output files (the README walk's ``moonrt ...`` lines).
- :class:`RankServer`: one such parent serving many ``ranks N -- ARGS`` jobs (``tests/jobs/helpers.py``'s
  ``_ranks``: one per pytest worker, so a worker pays the imports once, not once per job): ``python forkrun.py
  client SOCKET ranks N -- ARGS`` (:func:`client`, a new interpreter that imports no torch) hands the server its
  working directory, environment and standard streams (``SCM_RIGHTS``); the server forks a coordinator there that
  runs :func:`ranks` as the command above would, and the client exits with its code. A client that ends first
  (killed by a test's timeout) closes its connection: the server stops that coordinator (SIGTERM: its ranks are
  stopped as above).
"""

from __future__ import annotations

import ctypes
import importlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PRELOAD = ("torch", "torch.distributed", "torch.distributed.checkpoint", "torch.optim", "torch._dynamo", "numpy",
           "moonrt.cluster.rank_preload")
PR_SET_PDEATHSIG = 1


def _preload() -> None:
    for name in PRELOAD:
        importlib.import_module(name)


def _die_with_parent() -> None:
    """SIGKILL this (forked) process when its parent ends, so no child outlives a killed test."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def _child(args: list[str]) -> None:
    """In the forked child: ``moonrt ARGS``; never returns."""
    code = 1
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        from moonrt.cli import main

        sys.argv = ["moonrt", *args]
        code = int(main(args) or 0)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def ranks(n: int, args: list[str]) -> int:
    """``moonrt ARGS`` on ``n`` forked ranks (module docstring); returns the job's exit code."""
    from moonrt.cluster.env import GLOO_IFNAME_ENV, TIMEOUT_ENV, free_port, loopback_interface

    _preload()
    base = {"WORLD_SIZE": str(n), "LOCAL_WORLD_SIZE": str(n), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()), GLOO_IFNAME_ENV: os.environ.get(GLOO_IFNAME_ENV) or loopback_interface(),
            "PYTHONUNBUFFERED": "1"}
    base.setdefault(TIMEOUT_ENV, os.environ.get(TIMEOUT_ENV, "600"))
    pids: dict[int, int] = {}

    def stop(*_: object) -> None:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        os._exit(143)

    signal.signal(signal.SIGTERM, stop)
    for r in range(n):
        pid = os.fork()
        if pid == 0:
            _die_with_parent()
            os.environ.update(base, RANK=str(r), LOCAL_RANK=str(r))
            _child(args)
        pids[pid] = r
    first = 0
    left = dict(pids)
    while left:
        pid, status = os.wait()
        if pid not in left:
            continue
        r = left.pop(pid)
        code = os.waitstatus_to_exitcode(status)
        if code != 0 and first == 0:
            first = code if code > 0 else 128 - code
            print(f"forkrun: rank {r} exited with {code}; stopping the others", file=sys.stderr, flush=True)
            for other in left:
                os.kill(other, signal.SIGTERM)
            deadline = time.monotonic() + 30
            while left and time.monotonic() < deadline:
                done, status = os.waitpid(-1, os.WNOHANG)
                if done in left:
                    left.pop(done)
                elif done == 0:
                    time.sleep(0.1)
            for other in left:
                os.kill(other, signal.SIGKILL)
    return first


def _serve() -> None:
    """Server side of :class:`Server`: one JSON request a line on stdin (``argv``, ``cwd``, ``out``, ``err``), one
    JSON answer a line on stdout (``{"pid": ...}`` at start, ``{"code": ...}`` at the end)."""
    reply = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # anything printed here (or by an import) goes to stderr, not into the answers
    _preload()
    for line in sys.stdin:
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _die_with_parent()
            os.setsid()  # its own process group: a timeout kills the command and whatever it started
            os.chdir(req["cwd"])
            null = os.open(os.devnull, os.O_RDONLY)  # not the request pipe
            os.dup2(null, 0)
            os.close(null)
            for fd, path in ((1, req["out"]), (2, req["err"])):
                f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(f, fd)
                os.close(f)
            _child(req["argv"])
        reply.write(json.dumps({"pid": pid}) + "\n")
        reply.flush()
        _, status = os.waitpid(pid, 0)
        reply.write(json.dumps({"code": os.waitstatus_to_exitcode(status)}) + "\n")
        reply.flush()


def _close(proc: subprocess.Popen, tmp: tempfile.TemporaryDirectory) -> None:
    """End a server: close its stdin (it ends on EOF), wait (killed after 30 s), remove its directory."""
    if proc.stdin is not None:
        proc.stdin.close()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    tmp.cleanup()


class Server:
    """A :func:`_serve` process started with ``env``: ``run(args, cwd, timeout)`` runs ``moonrt ARGS`` in a fork
    of it and returns ``(exit code, stdout, stderr)`` like ``subprocess.run``; raises ``subprocess.TimeoutExpired``
    (the command's process group killed) after ``timeout`` seconds."""

    def __init__(self, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen([sys.executable, __file__, "serve"], env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self.tmp = tempfile.TemporaryDirectory(prefix="moonrt-forkrun-")

    def _answer(self, deadline: float) -> dict:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], max(deadline - time.monotonic(), 0))
        if not ready:
            raise TimeoutError
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"forkrun server ended (exit {self.proc.wait()})")
        return json.loads(line)

    def run(self, args: list[str], cwd: Path, timeout: float) -> tuple[int, str, str]:
        assert self.proc.stdin is not None
        out, err = Path(self.tmp.name) / "out", Path(self.tmp.name) / "err"
        self.proc.stdin.write(json.dumps({"argv": args, "cwd": str(cwd), "out": str(out), "err": str(err)}) + "\n")
        self.proc.stdin.flush()
        deadline = time.monotonic() + timeout
        pid = self._answer(time.monotonic() + 60)["pid"]
        try:
            code = self._answer(deadline)["code"]
        except TimeoutError:
            os.killpg(pid, signal.SIGKILL)
            self._answer(time.monotonic() + 30)
            raise subprocess.TimeoutExpired(["moonrt", *args], timeout) from None
        texts = out.read_text(errors="replace"), err.read_text(errors="replace")
        out.unlink()
        err.unlink()
        return code, *texts

    def close(self) -> None:
        _close(self.proc, self.tmp)


def _read_line(conn: socket.socket, limit: int = 64 << 20) -> bytes:
    """Bytes up to the first newline; a connection closed early gives what came."""
    data = bytearray()
    while not data.endswith(b"\n") and len(data) < limit:
        chunk = conn.recv(1 << 16)
        if not chunk:
            break
        data += chunk
    return bytes(data)


def _coordinator(conn: socket.socket, fds: list[int], req: dict) -> None:
    """In a fork of the rank server: the client's streams, directory and environment, then :func:`ranks`; never
    returns."""
    code = 1
    try:
        _die_with_parent()
        conn.close()
        for fd, target in zip(fds, (0, 1, 2)):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        code = ranks(int(req["n"]), req["args"])
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _alive(conn: socket.socket) -> bool:
    """False once a readable client connection says its client has ended (EOF or reset; a client sends nothing
    after its request)."""
    try:
        return bool(conn.recv(1))
    except OSError:
        return False


def _serve_ranks(path: str) -> None:
    """Server side of :class:`RankServer` (module docstring): one coordinator per client connection, several at
    once; single-threaded (a ``select`` loop), so every fork is of a process that runs no other thread of ours."""
    reply = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    _preload()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    reply.write("ready\n")
    reply.flush()
    jobs: dict[socket.socket, int] = {}
    gone: set[socket.socket] = set()  # clients that ended before their job: stopped, not yet reaped
    while True:
        ready, _, _ = select.select([sys.stdin, listener, *(c for c in jobs if c not in gone)], [], [], 0.1)
        for conn in ready:
            if conn is sys.stdin:
                if not sys.stdin.readline():  # the test process ended: so does this server (and, by their
                    return  # parent-death signal, its coordinators and their ranks)
            elif conn is listener:
                new, _ = listener.accept()
                fds: list[int] = []
                try:
                    _, fds, _, _ = socket.recv_fds(new, 1, 3)
                    req = json.loads(_read_line(new))
                except (OSError, ValueError):  # a client gone before its request was whole: nothing to run
                    for fd in fds:
                        os.close(fd)
                    new.close()
                    continue
                pid = os.fork()
                if pid == 0:
                    listener.close()
                    for other in jobs:
                        other.close()
                    _coordinator(new, fds, req)
                for fd in fds:
                    os.close(fd)
                jobs[new] = pid
            elif not _alive(conn):  # the client is gone: stop its job (ranks() stops its ranks on SIGTERM)
                gone.add(conn)
                try:
                    os.kill(jobs[conn], signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for conn, pid in list(jobs.items()):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                try:
                    conn.sendall(json.dumps({"code": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
                except OSError:
                    pass
                conn.close()
                del jobs[conn]
                gone.discard(conn)


class RankServer:
    """A :func:`_serve_ranks` process (environment ``env``) listening on a socket in a private directory;
    :meth:`argv` is the command that runs ``moonrt ARGS`` on ``n`` of its forked ranks."""

    def __init__(self, env: dict[str, str]) -> None:
        self.tmp = tempfile.TemporaryDirectory(prefix="moonrt-forkrun-")
        self.path = str(Path(self.tmp.name) / "ranks.sock")
        # its stdin is this process's pipe: the server ends when it reads EOF (this process closed it or ended)
        self.proc = subprocess.Popen([sys.executable, __file__, "serve-ranks", self.path], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], 300)
        line = self.proc.stdout.readline() if ready else ""
        if line != "ready\n":
            self.close()
            raise RuntimeError(f"forkrun rank server did not start (exit {self.proc.poll()})")

    def argv(self, n: int, args: list[str]) -> list[str]:
        return [sys.executable, __file__, "client", self.path, "ranks", str(n), "--", *args]

    def close(self) -> None:
        _close(self.proc, self.tmp)


def client(path: str, n: int, args: list[str]) -> int:
    """Client side of :class:`RankServer`: this process's streams, directory and environment to the server, then
    the job's exit code (128 + n for a coordinator killed by signal n)."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(path)
    socket.send_fds(conn, [b"R"], [0, 1, 2])
    req = {"n": n, "args": args, "cwd": os.getcwd(), "env": dict(os.environ)}
    conn.sendall(json.dumps(req).encode() + b"\n")
    answer = _read_line(conn)
    if not answer:
        print("forkrun: the rank server closed the connection without an exit code", file=sys.stderr)
        return 1
    code = int(json.loads(answer)["code"])
    return code if code >= 0 else 128 - code


def main(argv: list[str]) -> int:
    if argv[:1] == ["serve"]:
        _serve()
        return 0
    if len(argv) == 2 and argv[0] == "serve-ranks":
        _serve_ranks(argv[1])
        return 0
    if len(argv) >= 5 and argv[0] == "client" and argv[2] == "ranks" and argv[4] == "--":
        return client(argv[1], int(argv[3]), argv[5:])
    if len(argv) >= 3 and argv[0] == "ranks" and argv[2] == "--":
        return ranks(int(argv[1]), argv[3:])
    print("usage: forkrun.py ranks N -- ARGS... | forkrun.py serve | forkrun.py serve-ranks SOCKET | "
          "forkrun.py client SOCKET ranks N -- ARGS...", file=sys.stderr)
    return 2


if __name__ == "__main__":
    if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
        del sys.path[0]  # tests/ is no package directory of the commands run here
    sys.exit(main(sys.argv[1:]))
