"""Issue 28, cluster part: ranks die with their launcher, jobs never join each other's rendezvous, numeric launch
flags are range-checked, selftest/sbatch outputs are created exclusively, SLURM time limits are validated."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from cluster.helpers import _gone, _wait_for, clean_env

from moonrt.cli import main as cli_main
from moonrt.cluster.detect import slurm_port
from moonrt.cluster.env import default_dist_config
from moonrt.cluster.launch import launch
from moonrt.config import ConfigError

LAUNCH = [sys.executable, "-m", "moonrt.cli", "launch"]
JOB_ID_ENV = "MOONRT_JOB_ID"


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in clean_env().items() if k != JOB_ID_ENV}
    return {**env, **extra}


# ---------------------------------------------------------------------------------------------
# 1. Orphans: kill -9 of `moonrt launch` leaves no rank behind

SLEEPER = textwrap.dedent("""
    import os, sys, time
    path = os.path.join(sys.argv[1], "pid" + os.environ["RANK"])
    with open(path + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(path + ".tmp", path)
    while True:
        time.sleep(0.2)
""")


def test_killed_launcher_takes_its_ranks_with_it(tmp_path):
    prog = tmp_path / "sleeper.py"
    prog.write_text(SLEEPER)
    proc = subprocess.Popen([*LAUNCH, "-n", "2", "--timeout", "60", "--",
                             sys.executable, str(prog), str(tmp_path)],
                            env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    pids: list[int] = []
    try:
        files = [tmp_path / f"pid{r}" for r in range(2)]
        _wait_for(lambda: all(f.exists() for f in files) or proc.poll() is not None, what="both ranks started")
        assert proc.poll() is None, "the launcher exited before its ranks started"
        pids = [int(f.read_text()) for f in files]
        proc.kill()  # kill -9: the launcher gets no chance to stop its ranks itself
        proc.wait(timeout=60)
        _wait_for(lambda: all(_gone(p) for p in pids), 60, "every rank gone after the launcher's kill -9")
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


WATCHED = textwrap.dedent("""
    import os, sys, time
    from moonrt.cluster.lifeline import watch_launcher
    watch_launcher(poll_s=0.1)
    print(os.getpid(), flush=True)
    while True:
        time.sleep(0.2)
""")
MIDDLE = textwrap.dedent("""
    import os, subprocess, sys
    env = {**os.environ, "MOONRT_LAUNCHER_PID": str(os.getpid())}
    child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], env=env, stdout=subprocess.PIPE, text=True)
    print(child.stdout.readline().strip(), flush=True)
    import time
    time.sleep(3600)
""")


def test_portable_watchdog_ends_a_rank_whose_launcher_died():
    """Where prctl(PR_SET_PDEATHSIG) does not exist, a rank that joins through init_distributed watches its
    launcher itself (``watch_launcher``): exercised here directly, on any platform."""
    proc = subprocess.Popen([sys.executable, "-c", MIDDLE, WATCHED], env=_env(), stdout=subprocess.PIPE, text=True)
    pid = None
    try:
        pid = int(proc.stdout.readline())
        assert not _gone(pid)
        proc.kill()
        proc.wait(timeout=60)
        _wait_for(lambda: _gone(pid), 60, "the watched rank gone after its launcher's kill -9")
    finally:
        if proc.poll() is None:
            proc.kill()
        if pid is not None:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


# ---------------------------------------------------------------------------------------------
# 2. Jobs joining each other

JOIN = textwrap.dedent("""
    import os, sys, json
    here = sys.argv[1]
    import torch, torch.distributed as dist
    from moonrt.cluster.env import init_distributed
    tag = os.environ["SLURM_JOB_ID"] + "-" + os.environ["SLURM_PROCID"]
    open(os.path.join(here, "started-" + tag), "w").close()
    try:
        init_distributed()
    except ValueError as exc:
        print(f"moonrt test: {exc}", file=sys.stderr)
        sys.exit(2)
    ids = [None] * dist.get_world_size()
    dist.all_gather_object(ids, os.environ["SLURM_JOB_ID"])
    print("GROUP " + json.dumps(ids), flush=True)
    dist.barrier()
    dist.destroy_process_group()
""")


def _slurm_rank(prog: Path, here: Path, job: int, rank: int, **extra: str) -> subprocess.Popen:
    env = _env(SLURM_PROCID=str(rank), SLURM_STEP_NUM_TASKS="2", SLURM_LOCALID=str(rank), SLURM_JOB_ID=str(job),
               SLURM_STEP_ID="0", SLURM_STEP_NODELIST="127.0.0.1", MOONRT_DIST_TIMEOUT="60", **extra)
    return subprocess.Popen([sys.executable, str(prog), str(here)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _two_jobs(tmp_path: Path, **extra: str) -> dict[str, tuple[int | None, str, str]]:
    """Jobs 5 and 1255 (2 ranks each) on one node, started crosswise: job 5's rank 0 and job 1255's rank 1
    first, the other two once those are up. Returns ``{"5-0": (code, stdout, stderr), ...}``; a process still
    running once the others ended (waiting for a peer that left) is killed and reported with code None."""
    prog = tmp_path / "join.py"
    prog.write_text(JOIN)
    procs = {"5-0": _slurm_rank(prog, tmp_path, 5, 0, **extra), "1255-1": _slurm_rank(prog, tmp_path, 1255, 1, **extra)}
    try:
        _wait_for(lambda: all((tmp_path / f"started-{t}").exists() or p.poll() is not None
                              for t, p in procs.items()), what="the first two ranks started")
        time.sleep(1.0)  # let them reach the rendezvous first (no timing is asserted)
        procs["1255-0"] = _slurm_rank(prog, tmp_path, 1255, 0, **extra)
        procs["5-1"] = _slurm_rank(prog, tmp_path, 5, 1, **extra)
        out: dict[str, tuple[int | None, str, str]] = {}
        deadline = time.monotonic() + 240
        while len(out) < len(procs) and time.monotonic() < deadline:
            for tag, p in procs.items():
                if tag not in out and p.poll() is not None:
                    o, e = p.communicate()
                    out[tag] = (p.returncode, o, e)
            # one rank may wait for a peer that refused to join its store: once the other three ended, stop it
            if len(out) == len(procs) - 1:
                time.sleep(2.0)
                for tag, p in procs.items():
                    if tag not in out and p.poll() is None:
                        p.kill()
                        o, e = p.communicate()
                        out[tag] = (None, o, e)
            time.sleep(0.1)
        assert len(out) == len(procs), f"ranks still running: {sorted(set(procs) - set(out))}"
        return out
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()


def _assert_no_mixed_group(out: dict[str, tuple[int | None, str, str]]) -> None:
    for tag, (code, stdout, stderr) in out.items():
        job = tag.split("-")[0]
        groups = [json.loads(line[6:]) for line in stdout.splitlines() if line.startswith("GROUP ")]
        for group in groups:
            assert group == [job, job], f"{tag} joined a mixed process group {group}:\n{stderr[-2000:]}"
        if code == 0:
            assert groups, f"{tag} exited 0 without a group"


@pytest.mark.slow
def test_jobs_whose_ids_collided_form_their_own_groups(tmp_path):
    """SLURM job ids 5 and 1250 + 5 used to derive the same port: job 5's rank 0 and job 1255's rank 1 formed a
    group (and the other two another), all four exiting 0."""
    out = _two_jobs(tmp_path)
    _assert_no_mixed_group(out)
    for tag, (code, _, stderr) in out.items():  # distinct ports now: both jobs run normally
        assert code == 0, f"{tag}: exit {code}\n{stderr[-3000:]}"


@pytest.mark.slow
def test_jobs_on_one_port_are_refused_by_the_identity_check(tmp_path):
    """Two jobs that still meet on one port (here forced by MASTER_PORT): a rank that reaches the other job's
    store refuses to join it, in one line naming both jobs."""
    from moonrt.cluster.network import free_port

    out = _two_jobs(tmp_path, MASTER_PORT=str(free_port()))
    _assert_no_mixed_group(out)
    code, _, stderr = out["1255-1"]
    assert code == 2, stderr[-3000:]
    lines = [ln for ln in stderr.splitlines() if "SLURM job 5 step 0" in ln and "SLURM job 1255 step 0" in ln]
    assert len(lines) == 1, stderr[-3000:]
    assert "Traceback" not in stderr


def test_job_identity_and_ports():
    from moonrt.cluster.store import JOB_ID_ENV, job_identity

    slurm = {"SLURM_JOB_ID": "5", "SLURM_STEP_ID": "0"}
    assert job_identity(slurm) == "SLURM job 5 step 0"
    assert job_identity({**slurm, "SLURM_JOB_ID": "1255"}) != job_identity(slurm)
    assert job_identity({JOB_ID_ENV: "ab12", **slurm}) == "moonrt launch job ab12"
    assert job_identity({}) is None
    assert slurm_port(5, 0) != slurm_port(1255, 0)
    ports = {slurm_port(job, step) for job in range(100_000, 100_000 + 7936) for step in range(4)}
    assert len(ports) == 7936 * 4 and all(1024 <= p < 32768 for p in ports)


def test_launch_gives_each_job_its_own_identity():
    import io

    code = f"import os; print('id', os.environ[{JOB_ID_ENV!r}])"
    ids = []
    for _ in range(2):
        out = io.StringIO()
        assert launch([sys.executable, "-c", code], 2, timeout_s=30, stdout=out, stderr=io.StringIO()) == 0
        seen = {line.split()[-1] for line in out.getvalue().splitlines()}
        assert len(seen) == 1 and len(next(iter(seen))) >= 16
        ids.append(seen.pop())
    assert ids[0] != ids[1]


# ---------------------------------------------------------------------------------------------
# 3. Numeric launch flags; selftest report/profile files


@pytest.mark.parametrize(
    ("argv", "flag", "value"),
    [(["--timeout", "inf"], "--timeout", "inf"), (["--timeout", "1e300"], "--timeout", "1e+300"),
     (["--timeout", "nan"], "--timeout", "nan"), (["--max-time", "inf"], "--max-time", "inf"),
     (["--max-time", "-1"], "--max-time", "-1.0"), (["--stop-grace", "inf"], "--stop-grace", "inf"),
     (["--stop-grace", "0"], "--stop-grace", "0.0"), (["-n", "100000"], "--nprocs", "100000")],
)
def test_launch_numeric_flags_are_range_checked(argv, flag, value, capsys):
    n = [] if argv[0] == "-n" else ["-n", "2"]
    assert cli_main(["launch", *n, *argv, "--", sys.executable, "-c", "pass"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"moonrt launch: {flag} = {value}: expected "), err


def test_rank_timeout_from_the_environment_is_range_checked():
    for bad in ("inf", "1e300", "nan"):
        with pytest.raises(ConfigError, match=rf"MOONRT_DIST_TIMEOUT = '{bad}': expected a positive number"):
            default_dist_config({"MOONRT_DIST_TIMEOUT": bad})


SELFTEST = ["selftest", "--suite", "collectives", "--sizes", "4K", "--iters", "1"]


@pytest.mark.parametrize("flag", ["--report", "--profile-out"])
def test_selftest_output_files_are_created_exclusively(flag, tmp_path, capsys, monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_RANK",
                "OMPI_COMM_WORLD_SIZE", "SLURM_PROCID"):
        monkeypatch.delenv(var, raising=False)
    # a directory: one line, not a traceback after the whole run
    assert cli_main([*SELFTEST, flag, str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"moonrt selftest: {flag} = {str(tmp_path)!r}: ") and \
        "is a directory" in err[0], err
    # an existing file: refused and untouched unless --force
    existing = tmp_path / "mine.txt"
    existing.write_text("keep me\n")
    assert cli_main([*SELFTEST, flag, str(existing)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "already exists" in err[0] and "--force" in err[0], err
    assert existing.read_text() == "keep me\n"
    assert cli_main([*SELFTEST, flag, str(existing), "--force"]) == 0
    capsys.readouterr()
    assert existing.read_text() != "keep me\n"
    fresh = tmp_path / "fresh.out"
    assert cli_main([*SELFTEST, flag, str(fresh)]) == 0
    assert fresh.stat().st_size > 0


# ---------------------------------------------------------------------------------------------
# 4. sbatch: time limits, signal lead, exclusive script


def _sbatch(tmp_path: Path, *argv: str) -> list[str]:
    return ["sbatch", "--nodes", "1", "--ntasks-per-node", "2", "--output", str(tmp_path / "job.sbatch"), *argv,
            "--", "true"]


@pytest.mark.parametrize("value", ["99:99:99", "1:60", "0:00:60", "1-24", "1-12:60", "1-12:00:60", "1:2:3:4",
                                   "-5", "1-"])
def test_sbatch_refuses_impossible_time_limits(value, tmp_path, capsys):
    assert cli_main(_sbatch(tmp_path, f"--time={value}")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"moonrt sbatch: --time = {value!r}: expected a SLURM time"), err
    assert not (tmp_path / "job.sbatch").exists()


@pytest.mark.parametrize(("value", "seconds"),
                         [("90", 5400), ("90:30", 5430), ("100:00:00", 360000), ("2-00", 172800),
                          ("1-23:59", 172740), ("1-23:59:59", 172799), ("UNLIMITED", None), ("0", None)])
def test_sbatch_accepts_slurm_time_formats(value, seconds, tmp_path, capsys):
    from moonrt.cluster.sbatch import slurm_seconds

    assert slurm_seconds(value) == seconds
    assert cli_main(_sbatch(tmp_path, "--time", value)) == 0, capsys.readouterr().err
    assert f"#SBATCH --time={value}" in (tmp_path / "job.sbatch").read_text().splitlines()


def test_sbatch_refuses_a_signal_lead_longer_than_the_job(tmp_path, capsys):
    assert cli_main(_sbatch(tmp_path, "--time", "00:05:00", "--requeue", "--signal-lead", "600")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--signal-lead = 600" in err[0] and "--time = '00:05:00' (300 s)" in err[0], err
    assert cli_main(_sbatch(tmp_path, "--time", "2", "--requeue")) == 2  # default lead 120 s = the whole job
    assert "--signal-lead = 120" in capsys.readouterr().err
    assert not (tmp_path / "job.sbatch").exists()
    assert cli_main(_sbatch(tmp_path, "--time", "00:05:00", "--requeue", "--signal-lead", "60")) == 0


def test_sbatch_script_is_created_exclusively(tmp_path, capsys):
    script = tmp_path / "job.sbatch"
    script.write_text("my own script\n")
    assert cli_main(_sbatch(tmp_path)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.search(r"--output = .*job\.sbatch.*already exists.*--force", err[0]), err
    assert script.read_text() == "my own script\n"
    # --force replaces the file itself: a symlink planted there is replaced, never written through
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    script.unlink()
    script.symlink_to(victim)
    assert cli_main(_sbatch(tmp_path)) == 2
    assert victim.read_text() == "precious\n"
    assert cli_main(_sbatch(tmp_path, "--force")) == 0
    assert victim.read_text() == "precious\n"
    assert not script.is_symlink() and script.read_text().startswith("#!/bin/bash")
    assert os.access(script, os.X_OK)
