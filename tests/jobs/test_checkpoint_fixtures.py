"""Checkpoints written by an older moonrt still load (issue 46 item 3: checkpoint state described once per part).

The fixtures under ``tests/jobs/fixtures/checkpoints/`` were written by the code before the per-part checkpoint
verbs became one description per part (``WRITTEN_BY.json`` names the commit; ``make_checkpoints.py`` beside them
regenerates them): a one-process gathered ``checkpoint.pt`` at step 1 (``single``) and the sharded DCP checkpoints
at step 2 that 2 ranks wrote from it with ``--ep 2 --zero 1`` (``ep2_zero1``) and ``--pp 2`` (``pp2``).

- Loaded into one process, each fixture's state is exactly what it holds: the model and optimizer gathered back
  from the loaded objects equal the fixture's ``checkpoint.pt`` (or the sharded checkpoint read whole) bit for bit.
- Teacher-forced: each fixture resumed for one step in one process and in 2-rank layouts other than the one that
  wrote it; every layout's step equals the one-process step from the same fixture (loss, grad norm, every parameter
  and optimizer tensor within ``RTOL`` = 1e-5 relative normwise: the summation-order differences of one step,
  as the composed-layout resume tests).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from jobs.helpers import FIXTURE_FLAGS, _assert_same_step, _ckpt, _equal, _here, _metrics, _ranks, _run

from moonrt.comm.parallelism import Parallelism
from moonrt.jobs.checkpoint.store import load_checkpoint, read_state, resume_state
from moonrt.jobs.train.resume import BUILDER

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "checkpoints"
STEPS = {"single": 1, "ep2_zero1": 2, "pp2": 2}
"""Fixture -> the step it holds."""
RESUMED_IN: dict[str, dict[str, list[str]]] = {
    "single": {"ep2_zero1": ["--ep", "2", "--zero", "1"], "pp2": ["--pp", "2", "--microbatches", "2"]},
    "ep2_zero1": {"pp2": ["--pp", "2", "--microbatches", "2"], "ep2": ["--ep", "2"]},
    "pp2": {"ep2_zero1": ["--ep", "2", "--zero", "1"], "zero1": ["--zero", "1"]},
}
"""Fixture -> the 2-rank layouts that resume it (each other than the one that wrote it, and one more)."""


def test_fixtures_are_small_and_say_who_wrote_them() -> None:
    import json

    size = sum(f.stat().st_size for f in FIXTURES.rglob("*") if f.is_file())
    assert size < 8 * 2**20, size
    written = json.loads((FIXTURES / "WRITTEN_BY.json").read_text())
    assert len(written["commit"]) == 40 and len(written["commands"]) == 3, written


@pytest.mark.parametrize("name", list(STEPS))
def test_one_process_load_holds_exactly_the_fixture_state(name: str) -> None:
    path, header = resume_state(FIXTURES / name)
    assert path.is_dir() == (name != "single") and int(header["step"]) == STEPS[name], (path, header)
    want = read_state(FIXTURES / name, BUILDER)
    job = BUILDER.read(want["config"])
    torch.manual_seed(1)  # another init than the fixture's: every tensor below comes from the file
    model = BUILDER.model(job)
    opt = BUILDER.optimizer(model, job)
    rt = Parallelism()
    assert load_checkpoint(path, model, opt, rt, builder=BUILDER) == STEPS[name]
    got = rt.full_state_dict(model, opt)
    _equal(got["model"], want["model"], f"{name}.model")
    _equal(got["optimizer"]["state"], want["optimizer"]["state"], f"{name}.optimizer.state")
    assert [g["params"] for g in got["optimizer"]["param_groups"]] == [
        g["params"] for g in want["optimizer"]["param_groups"]], name
    assert len(want["optimizer"]["state"]) > 0, name  # the fixture holds trained optimizer state


@pytest.mark.slow
@pytest.mark.timeout(2400)
@pytest.mark.parametrize("name", list(STEPS))
def test_each_fixture_resumes_in_other_layouts_as_in_one_process(tmp_path: Path, name: str) -> None:
    until = str(STEPS[name] + 1)
    common = ("train", *FIXTURE_FLAGS, "--resume", "--until", until)
    runs: dict[str, list[str] | tuple[str, ...]] = {"one": _here(*common, "--out", "one", "--metrics", "one.jsonl")}
    for layout, flags in RESUMED_IN[name].items():
        runs[layout] = _ranks(2, *common, "--out", layout, "--metrics", f"{layout}.jsonl", *flags)
    for run in runs:
        shutil.copytree(FIXTURES / name, tmp_path / run)
    _run(tmp_path, runs, timeout=2300)
    ref = _metrics(tmp_path / "one.jsonl")[STEPS[name] + 1]
    ref_ckpt = _ckpt(tmp_path / "one")
    for layout in RESUMED_IN[name]:
        _assert_same_step(tmp_path, layout, ref, ref_ckpt, step=STEPS[name] + 1)
