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

from moonrt.cli import main as cli
from moonrt.config import to_dict
from moonrt.jobs.checkpoint import single as checkpoint
from moonrt.jobs.train.config import JobConfig


def _one_line(capsys: Any, prefix: str) -> str:
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(prefix), err
    assert "Traceback" not in err, err
    return lines[0]


def _single_process_run(out: Path, step: int = 100) -> None:
    """What ``moonrt train --steps 200 --until 100 --out runs/a`` leaves: ``OUT/checkpoint.pt`` only."""
    from moonrt.jobs.train.assemble import build_model
    from moonrt.jobs.train.optimizers import build_optimizer

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


def test_convert_takes_a_run_directory_as_info_and_export_do(tmp_path: Path, capsys: Any, monkeypatch: Any) -> None:
    """Issue 49 item 9: ``checkpoint convert OUT DST`` converts the checkpoint ``--resume`` takes (refused before,
    with a wrong "a save was interrupted?" hint), both ways."""
    monkeypatch.chdir(tmp_path)
    _single_process_run(Path("runs/a"))
    before = sorted(p.name for p in Path("runs/a").iterdir())
    assert cli(["checkpoint", "convert", "runs/a", "runs/b/checkpoint"]) == 0, capsys.readouterr().err
    capsys.readouterr()
    assert sorted(p.name for p in Path("runs/a").iterdir()) == before
    assert cli(["checkpoint", "convert", "runs/b", "b.pt"]) == 0, capsys.readouterr().err  # sharded run -> file
    capsys.readouterr()
    back = checkpoint.load(Path("b.pt"))
    want = checkpoint.load(Path("runs/a/checkpoint.pt"))
    assert back["step"] == 100 and all(torch.equal(back["model"][k], v) for k, v in want["model"].items())


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


# ---- item 9: ep-sim --trace of one rank; MB columns sized by the trace's model ---------------------------------

_EP = ["--policies", "none,eplb,moonep", "--no-plot", "--quiet", "--warmup", "0"]


def _counts(ranks: int, experts: int = 16, top_k: int = 2, steps: int = 3, layers: int = 2) -> Any:
    from moonrt.scheduler.workload import synthetic

    return synthetic("zipf", num_experts=experts, num_ranks=ranks, top_k=top_k, tokens_per_rank=32, steps=steps,
                     layers=layers, zipf_s=1.2, seed=0).counts


def test_ep_sim_warns_that_a_one_rank_trace_cannot_show_imbalance(tmp_path: Path, capsys: Any) -> None:
    from moonrt.scheduler.workload import save_trace

    save_trace(tmp_path / "one.npz", _counts(1), top_k=2)  # what one process of moonrt train records: [T, L, 1, E]
    assert cli(["ep-sim", "--trace", str(tmp_path / "one.npz"), *_EP, "--out", str(tmp_path / "o1")]) == 0
    text = capsys.readouterr().out
    warn = [ln for ln in text.splitlines() if ln.startswith("warning:") and "R=1" in ln]
    assert warn and "cannot show imbalance" in warn[0] and "--ep N" in warn[0], text
    doc = json.loads((tmp_path / "o1" / "summary.json").read_text())
    assert doc["imbalance_observable"] is False and any("R=1" in w for w in doc["warnings"]), doc["warnings"]
    assert {v["balance_mean"] for v in doc["summary"].values()} == {1.0}  # why the warning

    save_trace(tmp_path / "four.npz", _counts(4), top_k=2)  # a 4-rank trace: no such warning
    assert cli(["ep-sim", "--trace", str(tmp_path / "four.npz"), *_EP, "--out", str(tmp_path / "o4")]) == 0
    assert "R=1" not in capsys.readouterr().out
    doc = json.loads((tmp_path / "o4" / "summary.json").read_text())
    assert doc["imbalance_observable"] is True and not any("R=1" in w for w in doc["warnings"])

    # asking for more ranks than a one-rank trace holds: refused, naming how to get such a trace
    assert cli(["ep-sim", "--trace", str(tmp_path / "one.npz"), "--ranks", "4", *_EP,
                "--out", str(tmp_path / "o5")]) == 2
    line = _one_line(capsys, "moonrt ep-sim: ")
    assert "--ranks: 4" in line and "--ep N" in line, line
    assert not (tmp_path / "o5" / "summary.json").exists()


def test_ep_sim_sizes_the_mb_columns_from_the_traces_model(tmp_path: Path, capsys: Any) -> None:
    from moonrt.models import presets
    from moonrt.models.k3.model.config import k3_tiny
    from moonrt.scheduler.workload import expert_sizes, save_trace

    K3_SIZES = {"hidden": 3584, "expert_params": 3 * 3584 * 3072, "bytes_per_elem": 2}  # noqa: N806 -- K3's bf16 expert
    cfg = k3_tiny()
    tiny = expert_sizes(cfg, presets()["k3_tiny"].train_dtype["k3_tiny"])
    assert tiny == {"hidden": 64, "expert_params": 3 * 64 * 56, "bytes_per_elem": 4}
    counts = _counts(4, cfg.num_experts, cfg.num_experts_per_token)
    save_trace(tmp_path / "tiny.npz", counts, top_k=2, model="k3_tiny", sizes=tiny)
    save_trace(tmp_path / "bare.npz", counts, top_k=2)  # the same routing, no model recorded

    assert cli(["ep-sim", "--trace", str(tmp_path / "tiny.npz"), *_EP, "--out", str(tmp_path / "t")]) == 0
    text = capsys.readouterr().out
    assert "tiny.npz (k3_tiny)" in text and "records no model sizes" not in text, text
    assert cli(["ep-sim", "--trace", str(tmp_path / "bare.npz"), *_EP, "--out", str(tmp_path / "b")]) == 0
    text = capsys.readouterr().out
    assert "records no model sizes" in text and "--hidden 3584" in text, text

    got = json.loads((tmp_path / "t" / "summary.json").read_text())
    bare = json.loads((tmp_path / "b" / "summary.json").read_text())
    assert got["model"] == "k3_tiny" and got["sizes"] == tiny and set(got["sizes_from"].values()) == {"trace"}
    assert bare["sizes"] == K3_SIZES and bare["warnings"]
    token_ratio = (64 * 4) / (K3_SIZES["hidden"] * K3_SIZES["bytes_per_elem"])
    expert_ratio = (3 * 64 * 56 * 4) / (K3_SIZES["expert_params"] * K3_SIZES["bytes_per_elem"])
    for policy in ("none", "eplb", "moonep"):
        s, b = got["summary"][policy], bare["summary"][policy]
        assert s["token_MB_per_layer_step"] == pytest.approx(b["token_MB_per_layer_step"] * token_ratio)
        assert s["prefetch_MB_per_layer_step"] == pytest.approx(b["prefetch_MB_per_layer_step"] * expert_ratio)
    assert got["summary"]["moonep"]["token_MB_per_layer_step"] > 0  # k3_tiny-sized, not zero
    # explicit flags still win over the trace's model
    assert cli(["ep-sim", "--trace", str(tmp_path / "tiny.npz"), *_EP, "--hidden", "3584", "--bytes-per-elem",
                "2", "--out", str(tmp_path / "f")]) == 0
    capsys.readouterr()
    flagged = json.loads((tmp_path / "f" / "summary.json").read_text())
    assert flagged["sizes"]["hidden"] == 3584 and flagged["sizes_from"]["hidden"] == "--hidden"
    assert flagged["summary"]["none"]["token_MB_per_layer_step"] == pytest.approx(
        bare["summary"]["none"]["token_MB_per_layer_step"])


def test_train_labels_its_routing_trace_with_its_model_and_expert_sizes(tmp_path: Path) -> None:
    """`moonrt train --routing-trace` stores the model's name and expert sizes (fp32), so `ep-sim --trace` sizes its
    MB columns for k3_tiny instead of falling back to K3's experts."""
    from moonrt.models import from_preset
    from moonrt.scheduler.workload import expert_sizes, open_trace

    trace = tmp_path / "r.npz"
    assert cli(["train", "--steps", "1", "--batch-size", "2", "--seq-len", "16", "--no-progress",
                "--routing-trace", str(trace), "--out", str(tmp_path / "o")]) == 0
    stream = open_trace(trace)
    assert stream.model == "k3_tiny"
    assert dict(stream.sizes) == expert_sizes(from_preset("k3_tiny")[1], "fp32")
    assert dict(stream.sizes)["hidden"] != expert_sizes(from_preset("k3")[1], "fp32")["hidden"]
