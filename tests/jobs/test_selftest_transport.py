"""``moonrt selftest --suite transport`` (issue 48 item 1): on 2 gloo ranks every check of the collectives and the
shm heap passes and each backend is measured; a heap whose all-to-all is corrupted fails its check (the suite can
fail); the CLI alone (a 1-rank job) prints the table and passes, cuda reported skipped on CPU ranks."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest
from cluster.helpers import clean_env
from dist import dist_run


def _suite(rank: int, world: int, corrupt: bool) -> tuple[dict, list, list]:
    from moonrt.comm.transport.shm import ShmHeap
    from moonrt.jobs.selftest.transport import run_suite

    if corrupt:
        right = ShmHeap.all_to_all_v
        ShmHeap.all_to_all_v = lambda self, x, counts: right(self, x, counts) + 1.0
    res = run_suite(argparse.Namespace(transport_sizes=(4096, 1 << 20), iters=1), rank, world)
    return res.checks, res.rows, res.extra["skipped"]


@pytest.mark.slow
def test_transport_suite_checks_and_measures_each_backend() -> None:
    for checks, rows, skipped in dist_run(_suite, 2, False, timeout=120):
        assert set(checks) == {f"transport/shm/{c}" for c in ("put_get", "signal_order", "barrier", "all_to_all")}
        assert all(c["ok"] for c in checks.values()), checks
        assert [(r["backend"], r["bytes"]) for r in rows] == [("collectives", 4096), ("collectives", 1 << 20),
                                                              ("shm", 4096), ("shm", 1 << 20)]
        assert all(r["GBps"] > 0 for r in rows) and skipped == ["cuda: CPU ranks"]


def test_a_corrupted_heap_fails_its_check() -> None:
    for checks, _, _ in dist_run(_suite, 2, True, timeout=120):
        assert {n for n, c in checks.items() if not c["ok"]} == {"transport/shm/all_to_all"}


@pytest.mark.slow
def test_selftest_cli_runs_the_transport_suite() -> None:
    res = subprocess.run([sys.executable, "-m", "moonrt.jobs.selftest", "--suite", "transport", "--transport-sizes",
                          "4K", "--iters", "1"], env=clean_env(), capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "moonrt selftest transport: 1 ranks, all-to-all of equal splits" in res.stdout
    assert "moonrt selftest transport: 4 checks on 1 ranks: all passed" in res.stdout, res.stdout
    assert "skipped: transport cuda (CPU ranks)" in res.stdout, res.stdout


@pytest.mark.slow
def test_transport_suite_under_moonrt_launch_on_two_ranks(tmp_path) -> None:
    """Under ``moonrt launch`` (the job identity in the store names the segments) the suite passes on 2 ranks, the
    shm heap measured beside the collectives, and nothing of this job is left in /dev/shm."""
    import json

    before = {p.name for p in Path("/dev/shm").iterdir() if p.name.startswith("moonrt-")}
    report = tmp_path / "report.json"
    res = subprocess.run([sys.executable, "-m", "moonrt.cli", "launch", "-n", "2", "--timeout", "120", "--selftest",
                          "--", "--suite", "transport", "--transport-sizes", "4K", "--iters", "1", "--report",
                          str(report)], env=clean_env(), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rep = json.loads(report.read_text())
    suite = rep["suites"]["transport"]
    assert suite["passed"] and suite["checks"] == 8
    assert [r["backend"] for r in suite["rows"]] == ["collectives", "shm"]
    after = {p.name for p in Path("/dev/shm").iterdir() if p.name.startswith("moonrt-")}
    assert after <= before
