"""``moonrt selftest`` suites that cannot run on the job are SKIPPED, never passed (issue 36 item 8).

``--suite pp`` on one rank used to print ``PASS ... 0 checks`` and exit 0; ``moonrt launch -n 3 --selftest --
--suite kcp,ep`` skipped every EP shape and still said "all passed". Now a suite that cannot run (too few ranks,
no shape fits the world size) prints ``moonrt selftest <suite>: SKIPPED: <reason>``; when nothing at all could
be checked the job exits 2 with one line saying so, and a partial run's summary lists what was skipped.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import subprocess
import sys

import pytest
from cluster.helpers import LAUNCHER_VARS, clean_env
from dist import dist_run

from moonrt.jobs.selftest import cli as selftest


def test_pp_on_one_rank_checks_nothing_and_says_so(monkeypatch, capsys, tmp_path) -> None:
    for var in LAUNCHER_VARS:
        monkeypatch.delenv(var, raising=False)
    report = tmp_path / "report.json"
    code = selftest.main(["--suite", "pp", "--iters", "1", "--pp-sizes", "4K", "--report", str(report)])
    out, err = capsys.readouterr()
    assert code == 2, (code, out, err)
    assert "PASS" not in out and "passed" not in out, out
    assert "moonrt selftest pp: SKIPPED: needs >= 2 ranks, the job has 1" in out, out
    assert err == ("moonrt selftest: nothing could be checked on 1 ranks: every requested suite was skipped: "
                   "pp (needs >= 2 ranks, the job has 1)\n"), err
    rep = json.loads(report.read_text())
    assert rep["passed"] is False and rep["checks"] == 0 and rep["failures"] == []
    assert rep["suites"] == {"pp": {"status": "skipped", "reason": "needs >= 2 ranks, the job has 1"}}


def _ep_selftest(rank: int, world: int, argv: list[str]) -> tuple[int, str, str]:
    """``moonrt selftest ARGV`` on this rank of a group it already joined (the launcher variables only name it)."""
    import os

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="1")  # never connected to: the group exists
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = selftest.main(argv)
    return code, out.getvalue(), err.getvalue()


def test_ep_with_no_shape_that_fits_is_skipped_not_passed() -> None:
    """E = 5 experts cannot be spread over 2 ranks: the ep suite runs no case, so the job checked nothing."""
    got = dist_run(_ep_selftest, 2, ["--suite", "ep", "--iters", "1", "--ep-shapes", "16x8x2x5", "--ep-ffn", "8",
                                    "--ep-maxvio", "0"], timeout=300)
    assert [code for code, _, _ in got] == [2, 2]
    _, out, err = got[0]
    why = "no --ep-shapes shape fits 2 ranks (16x8x2x5: E = 5 is not a multiple of the world size 2)"
    assert f"moonrt selftest ep: SKIPPED: {why}" in out, out
    assert "all passed" not in out and "PASS" not in out, out
    line = f"moonrt selftest: nothing could be checked on 2 ranks: every requested suite was skipped: ep ({why})\n"
    assert err == line, err


@pytest.mark.slow
def test_launch_three_ranks_kcp_ep_reports_ep_skipped() -> None:
    """The issue's command: kcp runs and passes on 3 ranks, no default EP shape fits 3 ranks; the job passes on
    kcp's checks alone, and its summary says ep was skipped and why."""
    cmd = [sys.executable, "-m", "moonrt.cli", "launch", "-n", "3", "--timeout", "240", "--selftest", "--",
           "--suite", "kcp,ep", "--iters", "1", "--kcp-tokens", "40", "--kcp-shape", "1x2x8x12"]
    res = subprocess.run(cmd, env=clean_env(), capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, f"exit {res.returncode}\n{res.stdout[-4000:]}\n{res.stderr[-4000:]}"
    cases = "; ".join(f"{s.label}: E = {s.experts} is not a multiple of the world size 3" for s in _default_shapes())
    why = f"no --ep-shapes shape fits 3 ranks ({cases})"
    assert f"[rank 0] moonrt selftest ep: SKIPPED: {why}" in res.stdout, res.stdout
    assert "moonrt selftest ep:" not in res.stdout.replace("moonrt selftest ep: SKIPPED", ""), res.stdout
    assert re.search(r"^\[rank 0\] moonrt selftest kcp: \d+ checks on 3 ranks: all passed", res.stdout, re.M)
    summary = re.search(r"^\[rank 0\] moonrt selftest: PASS: 3 ranks, (\d+) checks, .*$", res.stdout, re.M)
    assert summary and int(summary.group(1)) > 0, res.stdout
    assert summary.group(0).endswith(f"; skipped: ep ({why})"), summary.group(0)


def _default_shapes():
    """The default ``--ep-shapes`` (none of whose expert counts is a multiple of 3)."""
    import argparse

    parser = argparse.ArgumentParser()
    selftest.add_arguments(parser)
    shapes = parser.parse_args([]).ep_shapes
    assert shapes and all(s.experts % 3 for s in shapes)
    return shapes
