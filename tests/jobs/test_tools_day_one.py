"""The README's ``moonrt checkpoint``, ``mem-plan`` and ``ep-sim`` lines as a new user runs them (issue 36, items
4, 5 and 9).

- ``checkpoint info`` / ``export`` take what the README's own ``runs/a`` example leaves (one process: only
  ``runs/a/checkpoint.pt``): the run directory, the ``.pt`` file, and ``OUT/checkpoint`` that does not exist is
  one line naming the file the run did write (and ``convert`` for the sharded format).
- ``mem-plan --budget-gib B --out DIR`` for a budget that does not fit says that no policy was written and the
  minimum budget.
- ``ep-sim --trace`` of a one-rank trace warns that it cannot show imbalance (output line and summary field), and
  sizes the MB columns from the trace's model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from moonrt import checkpoint
from moonrt.cli import main as cli
from moonrt.config import to_dict
from moonrt.job import JobConfig


def _one_line(capsys: Any, prefix: str) -> str:
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(prefix), err
    assert "Traceback" not in err, err
    return lines[0]


def _single_process_run(out: Path, step: int = 100) -> None:
    """What ``moonrt train --steps 200 --until 100 --out runs/a`` leaves: ``OUT/checkpoint.pt`` only."""
    from moonrt.assemble import build_model
    from moonrt.optimizers import build_optimizer

    out.mkdir(parents=True)
    job = JobConfig(model="k3_tiny")
    model = build_model(job)
    opt = build_optimizer(model, job.optim)
    checkpoint.save(out / "checkpoint.pt", {"model": model.state_dict(), "optimizer": opt.state_dict(),
                                            "step": step, "config": to_dict(job)})


# ---- item 4: checkpoint info / export on a single-process run -------------------------------------------


def test_info_and_export_take_the_readme_runs_a(tmp_path: Path, capsys: Any, monkeypatch: Any) -> None:
    monkeypatch.chdir(tmp_path)
    run = Path("runs/a")
    _single_process_run(run)
    before = sorted(p.name for p in run.iterdir())

    assert cli(["checkpoint", "info", "runs/a"]) == 0  # the README's info line
    text = capsys.readouterr().out
    assert "--resume takes runs/a/checkpoint.pt (step 100)" in text, text
    assert cli(["checkpoint", "info", "runs/a/checkpoint.pt", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["step"] == 100

    assert cli(["checkpoint", "export", "runs/a", "w.safetensors"]) == 0  # a run directory: --resume's choice
    out = capsys.readouterr().out
    assert "from runs/a/checkpoint.pt" in out and "step 100" in out, out
    from safetensors.torch import load_file

    weights = load_file("w.safetensors")
    assert torch.equal(weights["model.embed_tokens.weight"],
                       checkpoint.load(run / "checkpoint.pt")["model"]["embed.weight"])
    assert cli(["checkpoint", "export", "runs/a/checkpoint.pt", "w2.safetensors", "--names", "moonrt"]) == 0
    capsys.readouterr()
    assert sorted(p.name for p in run.iterdir()) == before  # nothing written into the run


@pytest.mark.parametrize("action", ["info", "export"])
def test_a_missing_checkpoint_root_names_the_file_the_run_wrote(tmp_path: Path, capsys: Any, monkeypatch: Any,
                                                                action: str) -> None:
    monkeypatch.chdir(tmp_path)
    _single_process_run(Path("runs/a"))
    argv = ["checkpoint", action, "runs/a/checkpoint"] + (["w.safetensors"] if action == "export" else [])
    assert cli(argv) == 2
    line = _one_line(capsys, "moonrt checkpoint: ")
    assert ("runs/a/checkpoint does not exist; this run wrote runs/a/checkpoint.pt: give runs/a or that file"
            in line), line
    assert "moonrt checkpoint convert runs/a/checkpoint.pt runs/a/checkpoint" in line, line
    assert not Path("w.safetensors").exists() and not Path("runs/a/checkpoint").exists()


def test_a_path_that_is_no_checkpoint_is_one_line(tmp_path: Path, capsys: Any) -> None:
    for action in ("info", "export"):
        argv = ["checkpoint", action, str(tmp_path / "nothing")] + (
            [str(tmp_path / "w.safetensors")] if action == "export" else [])
        assert cli(argv) == 2
        line = _one_line(capsys, "moonrt checkpoint: ")
        assert "does not exist" in line and "nothing" in line, line


# ---- item 5: mem-plan --out for a budget that does not fit -------------------------------------------------

_TINY = ["mem-plan", "--model", "k3_tiny", "--pp", "2", "--ep", "1", "--cp", "1", "--vpp", "1", "--schedule", "1f1b",
         "--seq-len", "4096", "--microbatches", "8", "--reserve-gib", "0", "--host-gib", "0"]


def test_mem_plan_says_no_policy_is_written_for_a_budget_that_does_not_fit(tmp_path: Path, capsys: Any) -> None:
    out = tmp_path / "mp"
    assert cli([*_TINY, "--budget-gib", "0.02", "--out", str(out)]) == 1
    text = capsys.readouterr().out
    line = next((ln for ln in text.splitlines() if ln.startswith("0.02 GiB does not fit")), None)
    assert line is not None and "no policy written; the minimum budget is " in line, text
    least = float(line.split("the minimum budget is ")[1].split(" GiB")[0])
    assert sorted(p.name for p in (out / "budget0.02").iterdir()) == ["plan.json", "plan.png"]
    # the named minimum fits and writes the policies the README promises
    assert cli([*_TINY, "--budget-gib", f"{least:g}", "--out", str(out)]) == 0
    capsys.readouterr()
    assert sorted(p.name for p in (out / f"budget{least:g}").iterdir()) == [
        "plan.json", "plan.png", "policy_rank0.yaml", "policy_rank1.yaml"]
