"""``moonrt selftest`` suites collectives, ep, kcp, pp, remote on 2 and 4 gloo ranks, and corrupted transports.

The multi-rank runs go through the real CLI (``moonrt launch -n N --selftest``); the report is then
checked independently: every suite ran on every rank, every check passed, and the measurements
have the properties each suite exists to show (MoonEP's rows are balanced while the all-to-all's
are not under skew; KCP moves one fixed-size summary per layer whatever T; the pipeline's blocks per
step are the hop plan's, fewer cached than naive).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch
from cluster.helpers import clean_env, expected_outputs
from dist import dist_run

from moonrt.jobs.selftest import cli as selftest
from moonrt.jobs.selftest import ep as selftest_ep

LAUNCH = [sys.executable, "-m", "moonrt.cli", "launch"]
SMALL = ["--sizes", "4K", "--iters", "1", "--ep-shapes", "32x16x2x64,16x8x3x96", "--ep-maxvio", "0,16",
         "--ep-ffn", "8", "--kcp-tokens", "40,64", "--kcp-shape", "1x2x8x12", "--remote-sizes", "4K",
         "--pp-sizes", "4K"]


def _launch(world: int, args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    cmd = [*LAUNCH, "-n", str(world), "--timeout", "240", "--selftest", "--", *args]
    return subprocess.run(cmd, env={**clean_env(), **(env or {})}, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_every_suite_passes_and_reports(world: int, tmp_path) -> None:
    report = tmp_path / "report.json"
    res = _launch(world, ["--suite", "collectives,ep,kcp,pp,remote", *SMALL, "--report", str(report)])
    assert res.returncode == 0, f"exit {res.returncode}\n{res.stdout[-4000:]}\n{res.stderr[-4000:]}"
    assert re.search(rf"^\[rank 0\] moonrt selftest: PASS: {world} ranks", res.stdout, re.M)
    rep = json.loads(report.read_text())
    assert rep["passed"] is True and rep["failures"] == []
    env = rep["env"]
    assert (env["backend"], env["device"], env["world_size"], env["ranks_per_node"], env["nodes"]) == (
        "gloo", "cpu", world, world, 1)
    assert env["torch_version"] == torch.__version__ and env["launcher"] == "torchrun"
    assert "skipped" not in res.stdout
    for suite in ("collectives", "ep", "kcp", "pp", "remote"):
        assert rep["suites"][suite]["status"] == "ran" and rep["suites"][suite]["passed"], suite
    for rank, rr in enumerate(rep["ranks"]):
        assert rr["outputs"] == expected_outputs(rank, world)
        names = set(rr["checks"])
        assert all(c["ok"] for c in rr["checks"].values())
        for impl in ("moonep", "alltoall"):
            for level in ("0", "16"):
                for shape in ("32x16x2x64", "16x8x3x96"):
                    for check in ("rows", "output", "grad_x", "grad_weights", "grad_experts"):
                        assert f"ep/{impl}/{shape}/F8/maxvio={level}/{check}" in names
        assert "ep/moonep/32x16x2x64/F8/maxvio=16/balance" in names
        for T in (40, 64):
            assert {f"kcp/T={T}/output", f"kcp/T={T}/grad_g", f"kcp/T={T}/grad_beta"} <= names
        assert ("kcp/T=64/final_state" in names) == (rank == world - 1)
        assert ("kcp/T=64/grad_h0" in names) == (rank == 0)
        assert {"remote/activations_exact", "remote/bytes_back_equal_bytes_in", "remote/roundtrip_4096",
                "remote/peer_freed", "remote/peer_held_all"} <= names
        assert "pp/hop/4096/payload" in names
        for case in ("1f1b/v1/m{w}/cached", "interleaved/v2/m{w}/cached", "interleaved/v2/m{w}/naive"):
            for check in ("hop_counts", "blocks_exact", "loss", "grads"):
                assert f"pp/{case.format(w=world)}/{check}" in names

    ep = rep["suites"]["ep"]["rows"]
    assert len(ep) == 2 * 2 * 2  # shapes x skews x dispatchers
    for row in ep:
        assert len(row["rows"]) == world and row["dispatch_ms"] > 0 and row["combine_ms"] > 0
        s, k = row["tokens"], row["top_k"]
        if row["impl"] == "moonep":  # exactly s*k rows on every rank, whatever the skew
            assert row["rows"] == [s * k] * world and row["rows_max_over_mean"] == 1.0
        else:
            assert row["prefetch_bytes_max"] == 0
            assert sum(row["rows"]) == s * k * world
            if row["maxvio"] == 16:  # expert 0's home rank computes far more than the mean
                assert row["rows_max_over_mean"] > 1.05 and max(row["rows"]) == row["rows"][0]
    hot = [r for r in ep if r["impl"] == "moonep" and r["maxvio"] == 16]
    assert all(r["prefetch_bytes_max"] > 0 for r in hot)  # copies of expert 0 were fetched
    kcp = rep["suites"]["kcp"]["rows"]
    summary = 1 * 2 * 8 * (8 + 12) * 4  # B H K (K + V) fp32, per direction, independent of T
    assert [r["tokens_per_rank"] for r in kcp] == [40, 64]
    for r in kcp:
        assert (r["fwd_sent"], r["bwd_sent"]) == (summary, summary)
        assert (r["fwd_recv"], r["bwd_recv"]) == ((world - 1) * summary, (world - 1) * summary)
    assert [r["bytes"] for r in rep["suites"]["remote"]["rows"]] == [4096]
    pp = rep["suites"]["pp"]["rows"]
    assert [(r["bytes"], r["GBps"] > 0) for r in pp if r["kind"] == "hop"] == [(4096, True)]
    sched = {(r["schedule"], r["mode"]): r for r in pp if r["kind"] == "schedule"}
    assert set(sched) == {("1f1b", "cached"), ("interleaved", "cached"), ("interleaved", "naive")}
    for r in sched.values():  # every rank's sent blocks summed = the hop plan's, independently of the executor
        assert r["blocks_per_step"] == r["hop_plan_blocks"] > 0 and r["fwd_bytes"] == r["bwd_bytes"] > 0
    assert sched["interleaved", "cached"]["blocks_per_step"] < sched["interleaved", "naive"]["blocks_per_step"]


@pytest.mark.slow
def test_corrupted_dispatch_fails_naming_the_rank_and_check(tmp_path) -> None:
    """Rank 2's received expert rows are perturbed: its rows checks fail (both dispatchers), nobody else's."""
    report = tmp_path / "report.json"
    res = _launch(4, ["--suite", "ep", "--iters", "1", "--ep-shapes", "32x16x2x64", "--ep-maxvio", "4",
                      "--ep-ffn", "8", "--report", str(report)], env={selftest_ep.CORRUPT_ENV: "2:dispatch"})
    assert res.returncode != 0
    out = res.stdout + res.stderr
    assert "ep/moonep/32x16x2x64/F8/maxvio=4/rows on rank 2" in out, out[-4000:]
    assert "ep/alltoall/32x16x2x64/F8/maxvio=4/rows on rank 2" in out
    rep = json.loads(report.read_text())
    assert rep["passed"] is False
    rows_failures = [f for f in rep["failures"] if "/rows on rank" in f]
    assert len(rows_failures) == 2 and all("/rows on rank 2" in f for f in rows_failures), rep["failures"]
    assert not rep["ranks"][2]["checks"]["ep/moonep/32x16x2x64/F8/maxvio=4/rows"]["ok"]
    assert rep["ranks"][2]["checks"]["ep/moonep/32x16x2x64/F8/maxvio=4/rows"]["first_bad_rows"] == [0]


@pytest.mark.slow
@pytest.mark.parametrize("world,bad", [(2, 1), (4, 2)])
def test_corrupted_pipeline_hops_fail_naming_the_rank(world: int, bad: int, tmp_path) -> None:
    """Rank ``bad``'s executor receives are perturbed: its hop payload and received-block checks fail
    (every schedule and mode), nobody else's; the corrupted block then spoils the loss downstream."""
    report = tmp_path / "report.json"
    res = _launch(world, ["--suite", "pp", "--iters", "1", "--pp-sizes", "4K", "--report", str(report)],
                  env={selftest_ep.CORRUPT_ENV: f"{bad}:pp"})
    assert res.returncode == 1, f"exit {res.returncode}\n{res.stdout[-4000:]}\n{res.stderr[-4000:]}"
    out = res.stdout + res.stderr
    assert f"FAILED pp/1f1b/v1/m{world}/cached/blocks_exact on rank {bad}" in out, out[-4000:]
    rep = json.loads(report.read_text())
    assert rep["passed"] is False
    moved = sorted(f.split(" (")[0] for f in rep["failures"] if "/payload on" in f or "/blocks_exact on" in f)
    assert moved == sorted([f"pp/hop/4096/payload on rank {bad}"] + [
        f"pp/{c}/m{world}/{m}/blocks_exact on rank {bad}" for c, m in
        (("1f1b/v1", "cached"), ("interleaved/v2", "cached"), ("interleaved/v2", "naive"))]), rep["failures"]
    assert rep["failures"][0].startswith(f"pp/1f1b/v1/m{world}/cached/blocks_exact on rank {bad}")
    assert any(f"/loss on rank {bad}" in f for f in rep["failures"])
    assert all(c["ok"] for name, c in rep["ranks"][bad]["checks"].items() if name.endswith("/hop_counts"))



def _pp_selftest_threads(rank: int, world: int) -> tuple[int, int, int]:
    """``moonrt selftest --suite pp`` with rank 1's receives corrupted, run in this rank on the group it already
    joined (the launcher variables only name it: ``init_distributed`` finds it initialized); returns the exit
    code and the thread count while the group lived and right after ``run`` returned."""
    import argparse
    import os

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="1")  # never connected to: the group exists
    os.environ[selftest_ep.CORRUPT_ENV] = "1:pp"
    parser = argparse.ArgumentParser()
    selftest.add_arguments(parser)
    args = parser.parse_args(["--suite", "pp", "--iters", "1", "--pp-sizes", "4K"])
    during = len(os.listdir("/proc/self/task"))
    code = selftest.run(args)
    return code, during, len(os.listdir("/proc/self/task"))


def test_selftest_destroys_the_gloo_group_before_it_returns() -> None:
    """The failing pp self-test's exit code was once 134, not 1: its executors (in reference cycles) kept the
    process group alive after ``destroy_process_group``, so gloo's worker threads outlived ``run`` and one aborted
    the process at interpreter exit (SIGABRT). When ``run`` returns, the group's threads are gone (here: only
    the main thread is left), on the failing rank and the others."""
    for code, during, after in dist_run(_pp_selftest_threads, 2, timeout=300):
        assert code == 1 and during > 1 and after == 1, (code, during, after)

def _ep_suite(rank: int, world: int, corrupt: str) -> dict:
    import argparse
    import os

    os.environ[selftest_ep.CORRUPT_ENV] = corrupt
    args = argparse.Namespace(ep_shapes=selftest_ep.ep_shapes("24x8x2x64"), ep_maxvio=(1.0,), ep_ffn=(8,), iters=1)
    return selftest_ep.run_suite(args, rank, world).checks


def test_corrupted_combine_fails_on_that_rank_output() -> None:
    """Rank 0's combined rows are perturbed: its output check fails; every rows check still passes."""
    got = dist_run(_ep_suite, 2, "0:combine", timeout=300)
    failed = {(r, name) for r, checks in enumerate(got) for name, c in checks.items() if not c["ok"]}
    assert failed == {(0, "ep/moonep/24x8x2x64/F8/maxvio=1/output"), (0, "ep/alltoall/24x8x2x64/F8/maxvio=1/output")}
    assert got[0]["ep/moonep/24x8x2x64/F8/maxvio=1/output"]["error"] > 1e-3


# ---------------------------------------------------------------------------------------------
# Arguments, suite choice and the routing generator (no ranks)


def test_suite_choice_and_skip_reasons() -> None:
    assert selftest.plan_suites(None, 1) == (["collectives", "ep", "kcp", "transport"], {
        "pp": "needs >= 2 ranks, the job has 1", "remote": "needs >= 2 ranks, the job has 1"})
    assert selftest.plan_suites(None, 2)[0] == ["collectives", "ep", "kcp", "pp", "remote", "transport"]
    assert selftest.plan_suites(("ep", "remote"), 4) == (["ep", "remote"], {})
    assert selftest.suite_list("kcp,ep,kcp") == ("kcp", "ep")
    assert selftest.suite_list("all") == selftest.SUITES


@pytest.mark.parametrize("argv,message", [
    (["--suite", "ep,nccl"], "suite 'nccl': expected a comma-separated subset of collectives, ep, kcp, pp, remote"),
    (["--ep-shapes", "32x16x2"], "EP shape '32x16x2': expected TOKENSxHIDDENxTOPKxEXPERTS"),
    (["--ep-maxvio", "0,-1"], "'-1' in '0,-1': expected numbers >= 0"),
    (["--kcp-tokens", "0"], "'0': expected comma-separated integers >= 1"),
    (["--kcp-shape", "1x2x8"], "KCP shape '1x2x8': expected BxHxKxV"),
])
def test_bad_arguments_exit_2_with_one_line(argv: list[str], message: str, capsys) -> None:
    """``moonrt selftest ARGV`` in this process (``moonrt.cli.main``, whose result or ``SystemExit`` code is the
    exit code of ``python -m moonrt.cli``): refused while parsing, before anything runs (a new interpreter cost
    ~3.5 s of imports per case)."""
    from moonrt.cli import main

    try:
        code = main(["selftest", *argv])
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2 and message in err, err


@pytest.mark.parametrize("argv,env,message", [
    (["--ep-shapes", "32x16x4x64", "--ep-maxvio", "16"], {},
     "--ep-maxvio 16 with --ep-shapes 32x16x4x64: expert 0 would need 34 > s = 32 assignments per rank; "
     "expected maxvio <= E/k - 1 = 15"),
    ([], {selftest_ep.CORRUPT_ENV: "one:dispatch"}, "MOONRT_SELFTEST_CORRUPT = 'one:dispatch': expected RANK:CHECK"),
    ([], {selftest_ep.CORRUPT_ENV: "1:grads"}, "with CHECK one of dispatch, combine"),
    (["--suite", "ep", "--profile-out", "p.yaml"], {}, "--profile-out p.yaml: expected the collectives suite"),
])
def test_bad_combinations_exit_2_before_joining(monkeypatch, capsys, argv, env, message) -> None:
    monkeypatch.delenv(selftest_ep.CORRUPT_ENV, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert selftest.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


@pytest.mark.parametrize("maxvio", [0.0, 1.0, 4.0, 16.0])
def test_skewed_routing_has_the_requested_maxvio(maxvio: float) -> None:
    shape = selftest_ep.EPShape(256, 8, 2, 64)
    ids = selftest_ep.skewed_routing(4, shape, maxvio, seed=3)
    for t in ids:
        assert t.shape == (256, 2) and bool((t[:, 0] != t[:, 1]).all())  # k distinct experts per token
    load = torch.bincount(torch.cat(ids).flatten(), minlength=64).double()
    assert abs(float(load.max() / load.mean() - 1) - maxvio) <= 0.5  # exact up to rounding to whole rows
    assert int(load.argmax()) == 0
