"""``moonrt mem-plan`` input handling: every bad flag is one line on stderr
naming it, exit 2; the README's k3_tiny example fits as written; the reserve is named; every flag has help."""

from __future__ import annotations

import argparse
import subprocess

import pytest
from jobs.helpers import _cli
from mounts import read_only_dir

from moonrt.jobs.mem_plan import add_arguments

README_TINY = ["--model", "k3_tiny", "--pp", "2", "--ep", "1", "--cp", "1", "--vpp", "1", "--schedule", "1f1b",
               "--seq-len", "4096", "--microbatches", "8", "--budget-gib", "1"]


def _run(capfd: pytest.CaptureFixture[str], *args: str) -> subprocess.CompletedProcess:
    """``moonrt mem-plan ARGS`` in this process (``jobs.helpers._cli``: the exit code and the output
    ``python -m moonrt.cli`` gives, without a new interpreter's imports)."""
    code, out, err = _cli(["mem-plan", *args], capfd)
    return subprocess.CompletedProcess(["moonrt", "mem-plan", *args], code, out, err)


@pytest.mark.parametrize("flag,value,expect", [
    ("--budget-gib", "nan", "--budget-gib = nan: expected a positive, finite number"),
    ("--budget-gib", "-1", "--budget-gib = -1.0: expected a positive"),
    ("--reserve-gib", "inf", "--reserve-gib = inf: expected a finite number >= 0"),
    ("--host-gbs", "0", "--host-gbs = 0.0: expected a finite number > 0"),
    ("--tflops", "nan", "--tflops = nan"),
    ("--pp", "0", "--pp = 0: expected an integer >= 1"),
    ("--probe-tokens", "0", "--probe-tokens = 0"),
    ("--tiers", "host,nvme", "--tiers = 'host,nvme': 'nvme' is not a tier; expected a comma-separated subset of"),
])
def test_bad_flag_is_one_line_exit_2(flag, value, expect, capfd):
    r = _run(capfd, "--model", "k3_tiny", "--pp", "1", "--vpp", "1", "--ep", "1", "--cp", "1", "--schedule", "1f1b",
             "--seq-len", "256", "--microbatches", "1", flag, value)
    assert r.returncode == 2, r.stderr
    assert expect in r.stderr and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


def test_unwritable_out_exit_2(tmp_path, capfd):
    with read_only_dir(tmp_path / "ro") as ro:  # a read-only bind mount as root (CI), chmod 0500 otherwise
        r = _run(capfd, *README_TINY, "--out", str(ro / "plan"))
    assert r.returncode == 2 and "--out = " in r.stderr and "expected a writable directory" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_out_is_a_file_exit_2(tmp_path, capfd):
    f = tmp_path / "file"
    f.write_text("x")
    r = _run(capfd, *README_TINY, "--out", str(f))
    assert r.returncode == 2 and "expected a writable directory" in r.stderr, r.stderr


def test_readme_k3_tiny_example_fits_and_names_the_reserve(capfd):
    r = _run(capfd, *README_TINY)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "fits 1 GiB" in r.stdout and "(reserve 0.05 GiB)" in r.stdout


def test_reserve_larger_than_budget_is_named(capfd):
    r = _run(capfd, *README_TINY[:-1], "1", "--reserve-gib", "4")
    assert r.returncode == 2 and "--reserve-gib = 4: expected less than --budget-gib 1" in r.stderr, r.stderr


def test_every_flag_has_help():
    p = argparse.ArgumentParser()
    add_arguments(p)
    missing = [a.option_strings for a in p._actions if a.option_strings != ["-h", "--help"] and not a.help]
    assert not missing


@pytest.mark.slow
def test_default_plan_uses_only_train_tiers_and_one_minimum_budget(tmp_path, capfd):
    """Issue 49 item 4: K3's headline plan (141 GiB) and its policy YAMLs use only the tiers moonrt train runs (no
    remote: train refuses it), and an infeasible budget's minimum is printed as one figure (98.6 vs 98.7 before)."""
    import re

    import yaml

    from moonrt.config import from_dict
    from moonrt.jobs.train.config import TRAIN_TIERS
    from moonrt.memory.policy import MemoryPolicy

    r = _run(capfd, "--shard-grads", "--budget-gib", "80", "141", "--out", str(tmp_path / "plan"))
    assert r.returncode == 1, r.stdout + r.stderr  # 80 does not fit
    assert "tiers keep,recompute,fp8,host,disk;" in r.stdout
    figures = set(re.findall(r"minimum budget (?:is )?([0-9.]+) GiB", r.stdout))
    assert len(figures) == 1 and len(re.findall(r"minimum budget", r.stdout)) == 2, r.stdout
    assert f"--budget-gib {figures.pop()} writes its policies" in r.stdout
    policies = sorted((tmp_path / "plan" / "budget141").glob("policy_rank*.yaml"))
    assert len(policies) == 16
    for f in policies:
        policy = from_dict(MemoryPolicy, yaml.safe_load(f.read_text()))
        assert policy.tiers_used() <= set(TRAIN_TIERS), (f, policy.tiers_used())
    section = r.stdout.split("budget 141 GiB")[1]
    remote_cols = [line.split()[-2] for line in section.splitlines()[2:18]]  # remote_out per rank
    assert remote_cols == ["0.00"] * 16, section
