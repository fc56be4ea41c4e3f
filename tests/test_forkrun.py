"""``tests/forkrun.py``'s rank server (what ``tests/jobs/helpers.py``'s ``_ranks`` runs jobs on): a client gets its
job's exit code and output, and a client that ends first (a test's timeout killing it) leaves no rank running."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest
from forkrun import RankServer


@pytest.fixture
def server():
    s = RankServer(dict(os.environ))
    yield s
    s.close()


def _descendants(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(c) for c in out] + [g for c in out for g in _descendants(int(c))]


@pytest.mark.timeout(120)
def test_a_client_gets_its_jobs_exit_code_and_output(server: RankServer, tmp_path: Path) -> None:
    r = subprocess.run(server.argv(2, ["train", "--no-such-flag"]), cwd=tmp_path, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2, r.stderr
    # a rank's own stderr reaches the client's (the other rank may be stopped before it prints)
    assert "moonrt train: error: unrecognized argument --no-such-flag" in r.stderr, r.stderr


@pytest.mark.timeout(180)
def test_a_killed_client_leaves_no_rank_running(server: RankServer, tmp_path: Path) -> None:
    p = subprocess.Popen(server.argv(2, ["train", "--steps", "1000", "--no-progress", "--threads", "1", "--out", "o"]),
                         cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while len(_descendants(server.proc.pid)) < 3:  # the coordinator and its two ranks
        assert time.monotonic() < deadline and p.poll() is None, "the job did not start"
        time.sleep(0.1)
    p.kill()
    p.wait()
    deadline = time.monotonic() + 60
    while _descendants(server.proc.pid):
        assert time.monotonic() < deadline, _descendants(server.proc.pid)
        time.sleep(0.1)
    assert server.proc.poll() is None  # the server itself serves on
