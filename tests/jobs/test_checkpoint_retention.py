"""Sharded checkpoints kept as a team keeps them (issue 50 item 3): the newest ``checkpoint.keep_latest`` committed
steps, milestones (multiples of ``checkpoint.keep_every``) never removed, nothing that is not a committed step with
moonrt's marker ever touched; and the flags that reach the checkpoint and eval settings."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import pytest
from jobs.helpers import _cli, _linear, _one_error_line

from moonrt.jobs.checkpoint import sharded
from moonrt.jobs.train.cli import add_arguments, job_from_args
from moonrt.jobs.train.config import CheckpointConfig, JobConfig


def _save_steps(root: Path, steps: range, keep_latest: int, keep_every: int) -> None:
    model, opt = _linear(0)
    job = JobConfig(checkpoint=CheckpointConfig(keep_latest=keep_latest, keep_every=keep_every))
    for step in steps:
        sharded.save_sharded(root, model, opt, step, job)


def _kept(root: Path) -> list[int]:
    return [s for s, _ in sharded.committed_steps(root)]


@pytest.mark.parametrize(("keep_latest", "keep_every", "survivors"),
                         [(2, 0, [6, 7]), (1, 0, [7]), (2, 3, [3, 6, 7]), (3, 2, [2, 4, 5, 6, 7])])
def test_what_survives_after_seven_saves(tmp_path: Path, keep_latest: int, keep_every: int,
                                         survivors: list[int]) -> None:
    root = tmp_path / "checkpoint"
    _save_steps(root, range(1, 8), keep_latest, keep_every)
    assert _kept(root) == survivors
    assert sorted(d.name for d in root.iterdir()) == [f"step-{s:08d}" for s in survivors]  # no .tmp left either
    assert sharded.resolve(root).name == "step-00000007"


def test_the_default_keeps_the_two_newest() -> None:
    assert (CheckpointConfig().keep_latest, CheckpointConfig().keep_every) == (2, 0)


def test_retention_never_removes_what_is_not_ours(tmp_path: Path) -> None:
    """A ``step-N`` directory without a marker, one whose marker is another format's, a symlink named ``step-N`` to a
    directory elsewhere, a file named ``step-N``, and a ``.tmp`` directory not named ``step-N.tmp``: all older than
    what is kept, all left as they were."""
    root = tmp_path / "checkpoint"
    root.mkdir()
    (root / "step-00000001").mkdir()
    (root / "step-00000001" / "notes.txt").write_text("mine")
    (root / "step-00000002").mkdir()
    (root / "step-00000002" / "moonrt.json").write_text(json.dumps({"format": "someone-else/1", "step": 2}))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "data").write_text("keep")
    os.symlink(elsewhere, root / "step-00000003")
    (root / "step-00000004").write_text("a file")
    (root / "scratch.tmp").mkdir()
    before = {p.name for p in root.iterdir()}
    _save_steps(root, range(10, 14), 1, 0)
    assert _kept(root) == [13]
    assert {p.name for p in root.iterdir()} == before | {"step-00000013"}
    assert (root / "step-00000001" / "notes.txt").read_text() == "mine"
    assert (elsewhere / "data").read_text() == "keep"


def test_an_interrupted_save_is_removed_at_the_next_commit(tmp_path: Path) -> None:
    root = tmp_path / "checkpoint"
    _save_steps(root, range(1, 2), 2, 0)
    (root / "step-00000002.tmp").mkdir()  # a save killed mid-write
    (root / "step-00000002.tmp" / "__0_0.distcp").write_bytes(b"torn")
    _save_steps(root, range(3, 4), 2, 0)
    assert sorted(d.name for d in root.iterdir()) == ["step-00000001", "step-00000003"]


# ---- the flags ------------------------------------------------------------------------------------------------


def _job(*argv: str) -> JobConfig:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return job_from_args(parser.parse_args(list(argv)))


def test_the_checkpoint_eval_and_profile_flags_set_their_fields() -> None:
    job = _job("--checkpoint-every", "3", "--eval-every", "5", "--eval-windows", "4", "--keep-latest", "3",
               "--keep-every", "10", "--async-save", "--profile-steps", "2:4", "--profile-ranks", "0,3")
    assert (job.optim.checkpoint_every, job.optim.eval_every, job.optim.eval_windows) == (3, 5, 4)
    assert (job.checkpoint.keep_latest, job.checkpoint.keep_every, job.checkpoint.async_save) == (3, 10, True)
    assert (job.log.profile_steps, job.log.profile_ranks) == ("2:4", [0, 3])
    default = _job()
    assert (default.checkpoint.async_save, default.log.profile_steps, default.log.profile_ranks) == (False, None, [0])


@pytest.mark.parametrize(("flag", "value", "names"), [
    ("--keep-latest", "0", "checkpoint.keep_latest"), ("--keep-every", "-1", "checkpoint.keep_every"),
    ("--checkpoint-every", "0", "optim.checkpoint_every"), ("--eval-windows", "0", "optim.eval_windows"),
    ("--profile-steps", "4:2", "log.profile_steps"), ("--profile-steps", "two", "log.profile_steps"),
    ("--profile-ranks", "0,x", "log.profile_ranks")])
def test_a_bad_value_is_one_line_naming_the_field(tmp_path: Path, capfd: Any, flag: str, value: str,
                                                  names: str) -> None:
    code, _, err = _cli(["train", "--out", str(tmp_path / "run"), flag, value], capfd)
    assert code == 2
    line = _one_error_line(err)
    assert names in line and flag in line, line
    assert not (tmp_path / "run").exists()
