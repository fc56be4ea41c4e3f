"""``moonrt sbatch``: the script it writes, the config checks it makes, and its errors (no SLURM needed)."""

from __future__ import annotations

import os
import subprocess

import pytest

from moonrt.cli import main as cli_main
from moonrt.cluster.sbatch import SbatchJob, job_from_config, render_sbatch
from moonrt.config import ConfigError
from moonrt.jobs.train.sbatch import load_job


def test_render_script():
    job = SbatchJob(command=["/venv/bin/python", "-m", "train", "--lr", "1e-3 x"], nodes=2, ntasks_per_node=4,
                    job_name="k3", partition="gpu", time="01:00:00", cpus_per_task=8, workdir="/work dir",
                    timeout_s=90)
    text = render_sbatch(job)
    lines = text.splitlines()
    assert lines[0] == "#!/bin/bash"
    for directive in ("--job-name=k3", "--nodes=2", "--ntasks-per-node=4", "--output=moonrt-%j.out",
                      "--partition=gpu", "--time=01:00:00", "--cpus-per-task=8"):
        assert f"#SBATCH {directive}" in lines
    assert "cd '/work dir'" in lines
    assert "export MOONRT_DIST_TIMEOUT=90" in lines
    assert "srun --kill-on-bad-exit=1 --ntasks=8 --ntasks-per-node=4 \\" in lines
    assert lines[-1] == "    /venv/bin/python -m train --lr '1e-3 x'"
    res = subprocess.run(["bash", "-n"], input=text, text=True, capture_output=True)
    assert res.returncode == 0, res.stderr


def test_config_is_checked_and_passed(tmp_path):
    cfg = tmp_path / "job.yaml"
    cfg.write_text("parallel:\n  dp: 2\n  ep: 4\ndist:\n  timeout_s: 45\n  rdzv_host: 10.0.0.1\nmodel: k3_tiny\n")
    job = job_from_config(SbatchJob(command=["prog"], nodes=2, ntasks_per_node=4), cfg, load_job)
    assert job.command == ["prog", "--config", str(cfg.resolve())]
    assert job.timeout_s == 45 and job.rdzv_host == "10.0.0.1"
    with pytest.raises(ConfigError, match=r"parallel = dp 2 x pp 1 x ep 4 x cp 1 = 8: expected nodes 1 x "
                                          r"ntasks_per_node 4 = 4"):
        job_from_config(SbatchJob(command=["prog"], nodes=1, ntasks_per_node=4), cfg, load_job)
    # a flag that agrees with the config is fine; one that contradicts it is refused (the config wins in the ranks)
    same = SbatchJob(command=["prog"], nodes=2, ntasks_per_node=4, timeout_s=45)
    assert job_from_config(same, cfg, load_job, given=["timeout_s"]).timeout_s == 45
    with pytest.raises(ConfigError, match=r"--timeout = 60: expected the config's dist.timeout_s = 45.0 .*the job "
                                          r"config wins in every rank\), or no --timeout"):
        job_from_config(SbatchJob(command=["prog"], nodes=2, ntasks_per_node=4, timeout_s=60), cfg, load_job,
                        given=["timeout_s"])
    with pytest.raises(ConfigError, match=r"--rdzv-host = '10.0.0.2': expected the config's dist.rdzv_host = "
                                          r"'10.0.0.1'"):
        job_from_config(SbatchJob(command=["prog"], nodes=2, ntasks_per_node=4, rdzv_host="10.0.0.2"), cfg,
                        load_job, given=["rdzv_host"])


def test_config_without_dist_keeps_the_flags_and_infers_dp(tmp_path):
    """A config that leaves dist.timeout_s null keeps --timeout; parallel without dp fills the allocation as
    moonrt train does (dp = world / (pp x ep x cp))."""
    cfg = tmp_path / "job.yaml"
    cfg.write_text("parallel:\n  ep: 2\n")
    job = job_from_config(SbatchJob(command=["prog"], nodes=2, ntasks_per_node=4, timeout_s=77), cfg, load_job,
                          given=["timeout_s"])
    assert job.timeout_s == 77 and job.rdzv_host is None
    with pytest.raises(ConfigError, match=r"ep 2 x cp 1 = 2: expected nodes 1 x ntasks_per_node 3 = 3 \(or dp 1 "
                                          r"and a divisor of it"):
        job_from_config(SbatchJob(command=["prog"], nodes=1, ntasks_per_node=3), cfg, load_job)


@pytest.mark.parametrize(
    ("text", "message"),
    [("parallel:\n  dp: 0\n", r"dp = 0: expected an integer >= 1"),
     ("parallel:\n  tp: 2\n", r"tp: unknown key in ParallelConfig"),
     ("dist:\n  timeout_s: -1\n", r"dist.timeout_s = -1.0: expected a positive number of seconds"),
     ("dist:\n  port: 29500\n", r"dist.port: unknown key in DistConfig"),
     ("model: anything\n", r"model = 'anything': expected a registered model preset: one of"),
     ("parallel: [1, 2\n", r"malformed YAML"),
     ("- 1\n", r"<root> = \[1\]: expected a mapping of JobConfig fields")],
)
def test_bad_config(tmp_path, text, message):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(text)
    with pytest.raises(ConfigError, match=message):
        job_from_config(SbatchJob(command=["prog"], nodes=1, ntasks_per_node=2), cfg, load_job)


@pytest.mark.parametrize(
    ("changes", "message"),
    [({"command": []}, r"command = \[\]: expected a program"),
     ({"nodes": 0}, r"nodes = 0: expected an integer >= 1"),
     ({"ntasks_per_node": -1}, r"ntasks_per_node = -1: expected an integer >= 1"),
     ({"job_name": "a b"}, r"job_name = 'a b': expected letters"),
     ({"timeout_s": 0}, r"timeout_s = 0: expected a positive number"),
     ({"timeout_s": float("inf")}, r"timeout_s = inf: expected a positive number"),
     ({"timeout_s": 1e7}, r"timeout_s = 10000000.0: expected a positive number of seconds <= 604800"),
     ({"partition": "gpu\ntouch x"}, r"partition = 'gpu\\ntouch x': expected a partition name"),
     ({"time": "1:00; id"}, r"time = '1:00; id': expected a SLURM time limit"),
     ({"log": "out.log\nid"}, r"log = 'out.log\\nid': expected a file path"),
     ({"log": "my log.txt"}, r"log = 'my log.txt': expected a file path"),
     ({"job_name": "k3\nid"}, r"job_name = 'k3\\nid': expected letters"),
     ({"cpus_per_task": True}, r"cpus_per_task = True: expected an integer >= 1")],
)
def test_bad_job(changes, message):
    job = SbatchJob(**{"command": ["prog"], **changes})
    with pytest.raises(ConfigError, match=message):
        render_sbatch(job)


def test_cli_writes_script_and_reports_errors(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "job.sbatch"
    assert cli_main(["sbatch", "--nodes", "1", "--ntasks-per-node", "2", "--output", str(out), "--",
                     "true", "--flag"]) == 0
    text = out.read_text()
    assert text.rstrip().endswith("true --flag") and "srun --kill-on-bad-exit=1 --ntasks=2" in text
    assert os.access(out, os.X_OK)
    cfg = tmp_path / "c.yaml"
    cfg.write_text("parallel:\n  dp: 4\n")
    assert cli_main(["sbatch", "--nodes", "1", "--ntasks-per-node", "2", "--config", str(cfg), "--", "true"]) == 2
    assert "expected nodes 1 x ntasks_per_node 2 = 2" in capsys.readouterr().err
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch here
    assert cli_main(["sbatch", "--nodes", "1", "--ntasks-per-node", "2", "--submit", "--", "/bin/true"]) == 2
    assert "--submit needs the `sbatch` command, which is not on PATH" in capsys.readouterr().err
    assert not (tmp_path / "moonrt.sbatch").exists()  # nothing submitted, nothing written


def _fake_sbatch(bin_dir, ok: bool = True) -> None:
    """An ``sbatch`` that takes the script on stdin (as SLURM's does without a file argument), keeps a copy of each
    in ``received-N`` and answers ``--parsable`` with job ids 100, 101, ...; or refuses every submission."""
    bin_dir.mkdir()
    script = bin_dir / "sbatch"
    body = ('n=$(ls "$(dirname "$0")" | grep -c received); cat > "$(dirname "$0")/received-$n"; '
            'echo "$((100 + n));cluster"') if ok else \
        'cat > /dev/null; echo "sbatch: error: Batch job submission failed: Invalid account" >&2; exit 1'
    script.write_text(f"#!/bin/sh\n[ \"$1\" = --parsable ] && [ $# = 1 ] || exit 9\n{body}\n")
    script.chmod(0o755)


def test_two_submissions_from_one_directory_both_submit(tmp_path, capsys, monkeypatch):
    """Issue 49 item 5: a second ``--submit`` from one directory used to be refused (``./moonrt.sbatch`` exists).
    Each submission goes to sbatch from memory and is kept under its job id."""
    work, bin_dir = tmp_path / "work", tmp_path / "bin"
    work.mkdir()
    _fake_sbatch(bin_dir)
    monkeypatch.chdir(work)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    ids = []
    for _ in range(2):
        assert cli_main(["sbatch", "--nodes", "1", "--ntasks-per-node", "2", "--submit", "--", "/bin/true"]) == 0
        ids.append(capsys.readouterr().out.strip())
    assert ids == ["100", "101"]
    assert sorted(p.name for p in work.iterdir()) == ["moonrt-100.sbatch", "moonrt-101.sbatch"]
    for n, job_id in enumerate(ids):  # the kept script is exactly what sbatch received
        assert (work / f"moonrt-{job_id}.sbatch").read_text() == (bin_dir / f"received-{n}").read_text()
        assert os.access(work / f"moonrt-{job_id}.sbatch", os.X_OK)


def test_a_refused_submission_writes_nothing(tmp_path, capsys, monkeypatch):
    work, bin_dir = tmp_path / "work", tmp_path / "bin"
    work.mkdir()
    _fake_sbatch(bin_dir, ok=False)
    monkeypatch.chdir(work)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    assert cli_main(["sbatch", "--nodes", "1", "--ntasks-per-node", "2", "--submit", "--", "/bin/true"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Invalid account" in err[0] and "failed (exit code 1)" in err[0], err
    assert list(work.iterdir()) == []


INJECTIONS = [("--partition", "gpu\ntouch {pwned}"), ("--time", "01:00:00\ntouch {pwned}"),
              ("--log", "x.log\ntouch {pwned}"), ("--job-name", "k3\ntouch {pwned}"),
              ("--partition", "gpu $(touch {pwned})"), ("--time", "1`touch {pwned}`"),
              ("--log", "x.log'; touch {pwned}; '"), ("--timeout", "nan"), ("--rdzv-host", "10.0.0.1\ntouch {pwned}")]


@pytest.mark.parametrize(("flag", "value"), INJECTIONS)
def test_cli_refuses_values_that_would_inject_shell_commands(tmp_path, capsys, monkeypatch, flag, value):
    monkeypatch.chdir(tmp_path)
    pwned = tmp_path / "PWNED"
    out = tmp_path / "job.sbatch"
    value = value.format(pwned=pwned)
    code = cli_main(["sbatch", "--nodes", "1", "--ntasks-per-node", "2", "--output", str(out), flag, value, "--",
                     "true"])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"moonrt sbatch: {flag} = "), err
    assert not out.exists()  # nothing was written that a later `sbatch` or `bash` could run


def test_script_with_ordinary_values_runs(tmp_path, capsys, monkeypatch):
    """Normal values of every flag give a script that bash runs as intended: ``srun`` (a stand-in that
    records its arguments) gets the exact command, and the #SBATCH lines carry the values verbatim."""
    work = tmp_path / "work dir"
    work.mkdir()
    monkeypatch.chdir(work)
    bindir = tmp_path / "bin"
    bindir.mkdir()
    fake_srun = bindir / "srun"
    fake_srun.write_text('#!/bin/bash\n'
                         'printf "%s\\n" "$PWD" "$MOONRT_DIST_TIMEOUT" "$MOONRT_RDZV_HOST" "$@" > srun.args\n')
    fake_srun.chmod(0o755)
    out = tmp_path / "job.sbatch"
    argv = ["sbatch", "--nodes", "2", "--ntasks-per-node", "3", "--job-name", "k3.run-1", "--partition", "gpu,debug",
            "--time", "1-02:30:00", "--cpus-per-task", "4", "--log", "logs/%x-%j.out", "--timeout", "45",
            "--rdzv-host", "10.0.0.1",
            "--output", str(out), "--", "echo", "a b", "$(not run)", "--lr=1e-3"]
    assert cli_main(argv) == 0, capsys.readouterr().err
    text = out.read_text()
    for directive in ("--job-name=k3.run-1", "--nodes=2", "--ntasks-per-node=3", "--output=logs/%x-%j.out",
                      "--partition=gpu,debug", "--time=1-02:30:00", "--cpus-per-task=4"):
        assert f"#SBATCH {directive}" in text.splitlines()
    env = {**os.environ, "PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}"}
    res = subprocess.run(["bash", str(out)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    recorded = (work / "srun.args").read_text().splitlines()
    assert recorded[:3] == [str(work), "45", "10.0.0.1"]
    assert recorded[3:6] == ["--kill-on-bad-exit=1", "--ntasks=6", "--ntasks-per-node=3"]
    assert recorded[6].endswith("/echo") and recorded[7:] == ["a b", "$(not run)", "--lr=1e-3"]


def test_every_sbatch_flag_has_help():
    """Issue 49 item 9: --job-name, --partition and --cpus-per-task had no help text."""
    import argparse

    from moonrt.jobs.train.sbatch import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    missing = [a.option_strings for a in p._actions if a.option_strings and a.option_strings != ["-h", "--help"]
               and not a.help]
    assert not missing
    text = p.format_help()  # the help renders (a stray % would raise here)
    assert "#SBATCH --partition" in text and "#SBATCH --cpus-per-task" in text and "#SBATCH --job-name" in text
