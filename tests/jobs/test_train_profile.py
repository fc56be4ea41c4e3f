"""The profiler switch (issue 50 item 4): ``--profile-steps A:B`` writes a Chrome trace of exactly those steps, the
metrics records carry per-phase times that sum to at most the step time, and TensorBoard gains the memory and
maxvio series."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from jobs.helpers import _cli, _records, _train_argv

from moonrt.config import umask
from moonrt.jobs.train.profile import PHASES


@pytest.fixture(scope="module")
def profiled(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 3-step run profiling step 2, with metrics and TensorBoard."""
    from moonrt.cli import main

    base = tmp_path_factory.mktemp("profile")
    args = _train_argv(base, "run", "--steps", "3", "--eval-every", "100", "--eval-windows", "2", "--profile-steps",
                       "2:2", "--metrics", str(base / "m.jsonl"), "--tensorboard", str(base / "tb"))
    assert main(args) == 0
    return base


@pytest.mark.slow
def test_the_trace_is_chrome_trace_json_of_the_profiled_steps(profiled: Path) -> None:
    traces = list((profiled / "run" / "profile").iterdir())
    assert [t.name for t in traces] == ["trace-rank0-steps2-2.json"]
    assert traces[0].stat().st_mode & 0o777 == 0o666 & ~umask()
    trace = json.loads(traces[0].read_text())
    events = trace["traceEvents"]
    assert isinstance(events, list) and events
    assert all("ph" in e for e in events)
    timed = [e for e in events if e["ph"] == "X"]
    assert timed and all(isinstance(e["ts"], int | float) and "dur" in e for e in timed)
    names = {e.get("name") for e in events}
    assert "moonrt.step 2" in names and not {"moonrt.step 1", "moonrt.step 3"} & names
    step = next(e for e in timed if e["name"] == "moonrt.step 2")
    inside = [e for e in timed if e["name"].startswith("aten::") and step["ts"] <= e["ts"] <= step["ts"] + step["dur"]]
    assert any(e["name"] == "aten::mm" or e["name"] == "aten::addmm" for e in inside)  # the step's own ops


@pytest.mark.slow
def test_phase_times_sum_to_at_most_the_step_time(profiled: Path) -> None:
    records = _records(profiled / "m.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        phases = [r[f"time_{p}_s"] for p in PHASES]
        assert all(t >= 0 for t in phases), r
        assert 0 < sum(phases) <= r["step_s"], r
        assert r["ckpt_wait_s"] >= 0
    assert records[0]["time_fwd_bwd_s"] > records[0]["time_data_s"]


@pytest.mark.slow
def test_tensorboard_has_memory_maxvio_and_phase_series(profiled: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(profiled / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"memory/peak_bytes", "train/maxvio", "time/step_s", "time/fwd_bwd_s", "time/ckpt_wait_s"} <= tags, tags
    assert [e.step for e in acc.Scalars("memory/peak_bytes")] == [1, 2, 3]


def test_a_profile_path_that_is_not_a_directory_is_one_line(tmp_path: Path, capfd: Any) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "profile").write_text("a user's file")
    code, _, err = _cli(_train_argv(tmp_path, "run", "--steps", "1", "--profile-steps", "1:1", "--set",
                                    "optim.eval_windows=2"), capfd)
    assert code == 2
    assert "log.profile_steps (--profile-steps)" in err and "is not a directory" in err, err
    assert (run / "profile").read_text() == "a user's file"
    assert os.path.isfile(run / "profile")
