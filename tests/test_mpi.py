"""Real MPI: ``mpiexec -n 4`` runs the self-test, which joins through the MPI path of init_distributed.

Skips where mpiexec or mpi4py is missing; fails instead under MOONRT_REQUIRE_CLUSTER=1 (CI).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_cluster_report import clean_env, cluster_unavailable, verify_selftest_report

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


def test_mpiexec_four_ranks_all_reduce_and_all_to_all(tmp_path):
    mpiexec = _mpiexec()
    report = tmp_path / "report.json"
    cmd = ["timeout", "120", mpiexec, "-n", "4", sys.executable, "-m", "moonrt.cluster.selftest",
           "--sizes", "64K", "--iters", "2", "--report", str(report)]
    env = {**clean_env(), "MOONRT_DIST_TIMEOUT": "60"}
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, f"exit {res.returncode}\nstdout:\n{res.stdout}\nstderr:\n{res.stderr[-4000:]}"
    assert "4 ranks via mpi" in res.stdout
    verify_selftest_report(report, 4, "mpi")
