"""Sharded DCP checkpoints (``moonrt.jobs.checkpoint.sharded``, issue 13 item 3):
save without a gather, load in any layout.

Unit tests (one process, no process group): a k3_tiny model and AdamW after one step round-trip bit for bit
(``load_sharded`` into a fresh model, ``to_single_file`` against ``state_dict()``); ``moonrt checkpoint export``
round-trips through ``safetensors`` (HF names mapped back equal the model's state); a torn checkpoint (no
commit marker, a ``.tmp`` directory) is refused and an interrupted save leaves the previous one loadable; a
``.metadata`` pickle holding code is refused before it runs; a checkpoint of another model is a clear error.

Multi-rank (``moonrt train`` on gloo ranks, ``helpers._ranks``, teacher-forced like ``tests/jobs/test_pp_train.py``):
a layout saves at step 2, copies resume for step 3 in the same layout (bit-identical to the same layout's
uninterrupted run), in one process and in another layout. Those differ from the same layout only by fp32
summation order (different reduction trees over ranks, micro-batches and half-batches: ~1e-7 relative per
step, see ``tests/jobs/test_pp_train.py``) and one AdamW step keeps that order, so the step-3 loss and every
parameter agree within 1e-5 relative. During the save no rank passes more than half the AdamW state to DCP
(``moonrt.json`` records the bytes each rank passed), and every stored byte is written by exactly one rank.
The 8-rank ``--pp 2 --ep 2 --zero 1`` checkpoint resuming in one process, ``--ep 4`` and ``--pp 2 --cp 2`` is
checked in ``tests/jobs/test_compose_train.py``, on the checkpoint its 8-rank run writes anyway.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from jobs.helpers import EVAL_SMALL, FLAGS, RTOL, _close, _equal, _here, _metrics, _ranks, _run

from moonrt.cli import main as cli
from moonrt.jobs.checkpoint import sharded as checkpoint_dcp
from moonrt.jobs.checkpoint import store
from moonrt.jobs.checkpoint.single import CheckpointError
from moonrt.jobs.train.config import JobConfig
from moonrt.jobs.train.resume import BUILDER


def _trained_tiny() -> tuple[torch.nn.Module, torch.optim.Optimizer, JobConfig]:
    """k3_tiny and its AdamW after one step on random tokens (every parameter has state)."""
    from moonrt.jobs.train.assemble import build_model
    from moonrt.jobs.train.optimizers import build_optimizer

    job = JobConfig(model="k3_tiny")
    model = build_model(job)
    opt = build_optimizer(model, job.optim)
    x = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    model.loss_sum(x[:, :-1], x[:, 1:]).backward()
    opt.step()
    return model, opt, job


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """``OUT/checkpoint`` of the trained k3_tiny (step 1, one process) and its ``{"model", "optimizer"}``."""
    model, opt, job = _trained_tiny()
    root = tmp_path_factory.mktemp("ckpt") / "checkpoint"
    step_dir = checkpoint_dcp.save_sharded(root, model, opt, 1, job)
    assert step_dir == root / "step-00000001" and (step_dir / checkpoint_dcp.MARKER).is_file()
    return root, {"model": model.state_dict(), "optimizer": opt.state_dict()}


@pytest.mark.slow
def test_one_process_round_trip_is_bit_identical(saved: tuple[Path, dict[str, Any]]) -> None:
    from moonrt.jobs.train.assemble import build_model
    from moonrt.jobs.train.optimizers import build_optimizer

    root, ref = saved
    job = JobConfig(model="k3_tiny")
    torch.manual_seed(123)
    model = build_model(job)
    with torch.no_grad():  # make sure nothing equals the reference by construction
        for p in model.parameters():
            p.add_(1.0)
    opt = build_optimizer(model, job.optim)
    assert checkpoint_dcp.load_sharded(root, model, opt) == 1
    _equal({"model": model.state_dict(), "optimizer": opt.state_dict()}, ref, "loaded")
    state = checkpoint_dcp.to_single_file(root, BUILDER)
    assert state["step"] == 1
    _equal({"model": state["model"], "optimizer": state["optimizer"]}, ref, "to_single_file")


def test_export_round_trips_through_safetensors(saved: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    from safetensors import safe_open
    from safetensors.torch import load_file

    from moonrt.jobs.checkpoint.cli import from_hf

    root, ref = saved
    for names in ("hf", "moonrt"):
        out = tmp_path / f"{names}.safetensors"
        assert cli(["checkpoint", "export", str(root), str(out), "--names", names]) == 0
        tensors = load_file(out)
        with safe_open(out, "pt") as f:
            meta = f.metadata()
        back = json.loads(meta["moonrt_names"])
        assert meta["moonrt_step"] == "1" and json.loads(meta["moonrt_config"])["model"] == "k3_tiny"
        _equal(from_hf(tensors, back), dict(ref["model"]), names)
    hf = load_file(tmp_path / "hf.safetensors")
    for key in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.0.input_layernorm.weight",
                "model.layers.1.mlp.gate.weight", "model.layers.1.mlp.gate.e_score_correction_bias",
                "model.layers.3.self_attn.kv_a_proj_with_mqa.weight", "model.layers.3.self_attn.o_proj.weight"):
        assert key in hf, key
    w = ref["model"]["layers.1.moe.experts.w_gate"]
    assert torch.equal(hf["model.layers.1.mlp.experts.5.gate_proj.weight"], w[5])
    assert sum(k.startswith("model.layers.1.mlp.experts.") for k in hf) == 3 * w.shape[0]


def test_torn_checkpoints_are_refused_and_the_previous_one_survives(saved: tuple[Path, dict[str, Any]],
                                                                    tmp_path: Path, capsys: Any) -> None:
    root, _ = saved
    good = root / "step-00000001"
    torn = tmp_path / "checkpoint" / "step-00000002.tmp"  # an interrupted save: no marker, not renamed
    shutil.copytree(good, torn)
    (torn / checkpoint_dcp.MARKER).unlink()
    with pytest.raises(CheckpointError, match="no committed checkpoint"):
        checkpoint_dcp.resolve(tmp_path / "checkpoint")
    assert cli(["checkpoint", "info", str(torn)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "incomplete (no moonrt.json commit marker" in err, err
    nomarker = tmp_path / "step-00000003"  # renamed but the marker deleted: refused too
    shutil.copytree(torn, nomarker)
    with pytest.raises(CheckpointError, match="incomplete"):
        checkpoint_dcp.load_sharded(nomarker, torch.nn.Linear(1, 1), torch.optim.AdamW([torch.zeros(1)]))
    shutil.copytree(good, tmp_path / "checkpoint" / good.name)  # the previous checkpoint is what resolves
    assert checkpoint_dcp.resolve(tmp_path / "checkpoint") == tmp_path / "checkpoint" / good.name
    assert cli(["checkpoint", "info", str(tmp_path / "checkpoint")]) == 0
    assert "step 1 of" in capsys.readouterr().out


class _Evil:
    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self) -> tuple[Any, ...]:
        return os.mkdir, (self.path,)


def test_a_metadata_pickle_holding_code_is_refused_before_it_runs(saved: tuple[Path, dict[str, Any]],
                                                                   tmp_path: Path, capsys: Any) -> None:
    root, _ = saved
    bad = tmp_path / "step-00000001"
    shutil.copytree(root / "step-00000001", bad)
    victim = tmp_path / "ran"
    (bad / ".metadata").write_bytes(pickle.dumps(_Evil(victim)))
    assert cli(["checkpoint", "export", str(bad), str(tmp_path / "x.safetensors")]) == 2
    err = capsys.readouterr().err
    assert "global posix.mkdir is not a DCP metadata type" in err, err
    assert not victim.exists()
    pickle.loads((bad / ".metadata").read_bytes())  # the file really is hostile: plain unpickling runs it
    assert victim.exists()


def test_a_checkpoint_of_another_model_is_a_clear_error(tmp_path: Path) -> None:
    small, other = torch.nn.Linear(4, 3), torch.nn.Linear(4, 5)
    opt = torch.optim.AdamW(small.parameters())
    checkpoint_dcp.save_sharded(tmp_path / "checkpoint", small, opt, 7, JobConfig())
    with pytest.raises(CheckpointError, match=r"does not fit this model and optimizer: .*Size mismatch .* for model\."):
        checkpoint_dcp.load_sharded(tmp_path / "checkpoint", other, torch.optim.AdamW(other.parameters()))


# ---- multi-rank: save in one layout, resume in others ---------------------------------------------------


JOB = [*FLAGS, *EVAL_SMALL]
"""The job every multi-rank run here takes (its eval is read by no assertion: ``helpers.EVAL_SMALL``)."""


def _optimizer_bytes(state: dict[str, Any]) -> int:
    """Bytes of the whole AdamW state of a single-process checkpoint (both moments and the step counts)."""
    return sum(t.numel() * t.element_size() for st in state["optimizer"]["state"].values() for t in st.values())


def _resume_everywhere(tmp_path: Path, base: str, same: tuple[int, list[str]],
                       others: dict[str, tuple[int, list[str]]]) -> dict[str, dict[str, Any]]:
    """Copies of ``base`` resumed for step 3 in ``same`` and ``others`` (``name -> (ranks, flags)``, ranks 1: one
    process); returns every run's step-3 metrics (plus ``<base>`` unchanged on disk)."""
    runs = {"same": same, **others}
    cmds = {}
    for name, (n, flags) in runs.items():
        shutil.copytree(tmp_path / base, tmp_path / name)
        args = ("train", *JOB, "--resume", "--until", "3", "--out", name, "--metrics", f"{name}.jsonl", *flags)
        cmds[name] = _ranks(n, *args) if n > 1 else _here(*args)  # one process: in this one (no new interpreter)
    _run(tmp_path, cmds, timeout=1700)
    return {name: _metrics(tmp_path / f"{name}.jsonl")[3] for name in runs}


def _check_other_layouts(tmp_path: Path, got: dict[str, dict[str, Any]]) -> None:
    ref, ref_ckpt = got["same"], store.read_state(tmp_path / "same", BUILDER)
    for name, rec in got.items():
        assert abs(rec["loss"] - ref["loss"]) <= RTOL * abs(ref["loss"]), (name, rec["loss"], ref["loss"])
        ck = store.read_state(tmp_path / name, BUILDER)
        assert ck["step"] == 3, name
        _close(ck["model"], ref_ckpt["model"], f"{name}.model")


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_ep2_zero1_on_4_ranks_saves_sharded_and_resumes_in_any_layout(tmp_path: Path) -> None:
    layout = ["--ep", "2", "--zero", "1"]  # dp 2 inferred: experts sharded over ep, moments over dp
    _run(tmp_path, {"base": _ranks(4, "train", *JOB, "--until", "2", "--out", "base", *layout),
                    "straight": _ranks(4, "train", *JOB, "--until", "3", "--out", "straight", "--metrics",
                                        "straight.jsonl", *layout)}, timeout=1700)
    assert not (tmp_path / "base" / "checkpoint.pt").exists()
    marker = checkpoint_dcp.read_marker(checkpoint_dcp.resolve(tmp_path / "base" / "checkpoint"))
    assert marker["step"] == 2 and marker["layout"] == {"world": 4, "dp": 2, "pp": 1, "vpp": 1, "ep": 2, "cp": 1,
                                                        "zero": 1}
    # no rank held the whole optimizer state: each passed DCP its shard (~1/4), every byte written once
    full = store.read_state(tmp_path / "base", BUILDER)
    ranks = marker["ranks"]
    assert max(r["optimizer_bytes"] for r in ranks) < 0.5 * _optimizer_bytes(full), (ranks, _optimizer_bytes(full))
    assert sum(r["written_bytes"] for r in ranks) == marker["bytes"], ranks
    got = _resume_everywhere(tmp_path, "base", (4, layout), {"one": (1, []), "pp2": (2, ["--pp", "2",
                                                                                       "--microbatches", "2"])})
    # same layout: bit-identical to the uninterrupted run (loss and the whole state)
    assert got["same"]["loss"] == _metrics(tmp_path / "straight.jsonl")[3]["loss"]
    same, straight = store.read_state(tmp_path / "same", BUILDER), store.read_state(tmp_path / "straight", BUILDER)
    keys = ("model", "optimizer", "step")
    _equal({k: same[k] for k in keys}, {k: straight[k] for k in keys})
    _check_other_layouts(tmp_path, got)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_pp2_on_2_ranks_saves_sharded_and_resumes_in_one_process_and_under_ep(tmp_path: Path) -> None:
    layout = ["--pp", "2", "--microbatches", "2"]
    _run(tmp_path, {"base": _ranks(2, "train", *JOB, "--until", "2", "--out", "base", *layout)}, timeout=1700)
    marker = checkpoint_dcp.read_marker(checkpoint_dcp.resolve(tmp_path / "base" / "checkpoint"))
    assert marker["layout"]["pp"] == 2 and marker["layout"]["world"] == 2
    assert sum(r["written_bytes"] for r in marker["ranks"]) == marker["bytes"], marker["ranks"]
    got = _resume_everywhere(tmp_path, "base", (2, layout), {"one": (1, []), "ep2": (2, ["--ep", "2"])})
    _check_other_layouts(tmp_path, got)


def test_convert_between_the_formats_round_trips(saved: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    from moonrt.jobs.checkpoint.single import load

    root, ref = saved
    assert cli(["checkpoint", "convert", str(root), str(tmp_path / "checkpoint.pt")]) == 0
    old = load(tmp_path / "checkpoint.pt")
    assert old["step"] == 1
    _equal({"model": old["model"], "optimizer": old["optimizer"]}, ref, "to .pt")
    assert cli(["checkpoint", "convert", str(tmp_path / "checkpoint.pt"), str(tmp_path / "back")]) == 0
    again = checkpoint_dcp.to_single_file(tmp_path / "back", BUILDER)
    _equal({"model": again["model"], "optimizer": again["optimizer"]}, ref, "back to sharded")
