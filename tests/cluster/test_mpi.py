"""Real MPI: ``mpiexec -n 4`` runs the self-test, which joins through the MPI path of init_distributed.

Skips where mpiexec or mpi4py is missing; fails instead under MOONRT_REQUIRE_CLUSTER=1 (CI).
"""

from __future__ import annotations

import ast
import inspect
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cluster.helpers import (
    HOLD,
    clean_env,
    cluster_unavailable,
    listening_sockets,
    only_loopback,
    verify_selftest_report,
)

pytestmark = pytest.mark.mpi


def _mpiexec() -> str:
    local = Path(sys.executable).parent / "mpiexec"
    exe = str(local) if local.exists() else shutil.which("mpiexec")
    if exe is None:
        cluster_unavailable("mpiexec not found (pip install 'moonrt[mpi]')")
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        cluster_unavailable("mpi4py is not installed (pip install 'moonrt[mpi]')")
    return exe


@pytest.mark.slow
def test_mpiexec_four_ranks_all_reduce_and_all_to_all(tmp_path):
    mpiexec = _mpiexec()
    report = tmp_path / "report.json"
    cmd = ["timeout", "120", mpiexec, "-n", "4", sys.executable, "-m", "moonrt.jobs.selftest",
           "--suite", "collectives", "--sizes", "64K", "--iters", "2", "--report", str(report)]
    env = {**clean_env(), "MOONRT_DIST_TIMEOUT": "60"}
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, f"exit {res.returncode}\nstdout:\n{res.stdout}\nstderr:\n{res.stderr[-4000:]}"
    assert "4 ranks via mpi" in res.stdout
    verify_selftest_report(report, 4, "mpi")


@pytest.mark.skipif(not os.path.exists("/proc/self/net/tcp"), reason="needs Linux /proc")
def test_mpi_rendezvous_on_one_host_listens_on_loopback_only(tmp_path):
    """Rank 0 used to open the store on 0.0.0.0; all ranks on one host now meet on 127.0.0.1 (gloo too).
    MPI's own listeners (MPICH's netmod on the host address, Hydra's inherited PMI socket) exist before
    moonrt runs and are MPI's to configure: each rank records them after MPI_Init, and only the sockets
    opened after that (the store, gloo) are checked."""
    mpiexec = _mpiexec()
    prog, done = tmp_path / "hold.py", tmp_path / "done"
    # each rank reports READY in a file of its own: mpiexec's forwarding of two ranks' stdout through a pipe
    # did not always deliver both lines while the ranks were still holding their sockets open
    ready_line = 'print("READY", os.getpid(), r.master_addr, r.master_port, flush=True)'
    assert ready_line in HOLD
    hold = HOLD.replace(ready_line, f"open(os.path.join({str(tmp_path)!r}, f'ready{{os.getpid()}}.tmp'), 'w').write("
                        "f'READY {os.getpid()} {r.master_addr} {r.master_port}'); "
                        f"os.rename(os.path.join({str(tmp_path)!r}, f'ready{{os.getpid()}}.tmp'), "
                        f"os.path.join({str(tmp_path)!r}, f'ready{{os.getpid()}}'))")
    prog.write_text("import os, ipaddress\nfrom mpi4py import MPI\n" + inspect.getsource(listening_sockets)
                    + f"open(os.path.join({str(tmp_path)!r}, f'base{{os.getpid()}}'), 'w').write(repr("
                    + "listening_sockets(os.getpid())))\n" + hold)
    env = {**clean_env(), "MOONRT_DIST_TIMEOUT": "60"}
    env.pop("GLOO_SOCKET_IFNAME", None)
    proc = subprocess.Popen(["timeout", "150", mpiexec, "-n", "2", sys.executable, str(prog), str(done)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 90
        while len(list(tmp_path.glob("ready[0-9]*"))) < 2 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        ready = [f.read_text().split() for f in sorted(tmp_path.glob("ready[0-9]*")) if not f.name.endswith(".tmp")]
        assert len(ready) == 2, f"{len(ready)} of 2 ranks ready; exit {proc.poll()}"
        assert {r[2] for r in ready} == {"127.0.0.1"}  # the address rank 0 broadcast
        base = {int(r[1]): ast.literal_eval((tmp_path / f"base{r[1]}").read_text()) for r in ready}
        sockets = {pid: [s for s in listening_sockets(pid) if s not in base[pid]] for pid in base}
    finally:
        done.touch()
    assert proc.wait(timeout=150) == 0, proc.stderr.read()[-4000:]
    only_loopback(sockets, int(ready[0][3]))
