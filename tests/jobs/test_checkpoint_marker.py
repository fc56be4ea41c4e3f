"""The commit marker ``moonrt.json`` of a sharded checkpoint, protected like its shards (issue 45).

- The marker records the CRC-32 of its own content (``marker_crc32``, over the canonical JSON of every other key):
  a flipped bit (``"step": 2`` -> 3, a hyperparameter) is one line naming the file, on load, on ``--resume``, on
  ``checkpoint info`` (``--verify`` too) and ``export``; exit 2, nothing written.
- Its ``step`` must be the one its ``step-N`` directory names.
- Its optimizer ``param_groups`` (the schedule's ``lr`` aside) must be what the job's config builds: an edited
  ``weight_decay`` / ``betas`` / ``eps`` with a recomputed checksum is refused like any resume-config change, also
  under ``--zero 1`` on 2 ranks (a value the marker's own job config builds is a config change, which
  ``--resume-allow-changes`` governs); ``convert`` refuses it too.
- Markers written before the checksum still load, with one warning line; ``info --verify`` says "not verified".
- ``export`` / ``convert`` of a run that is still running read the step they pinned: the running job rotating it
  away meanwhile changes nothing they read, or (rotated before it was pinned) is said in one line.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from jobs.helpers import _linear, _load_linear, _one_error_line, _one_line, _ranks, _sharded, _train_argv

from moonrt.cli import main as cli
from moonrt.jobs.checkpoint import sharded as checkpoint_dcp
from moonrt.jobs.checkpoint import single as checkpoint
from moonrt.jobs.checkpoint.single import CheckpointError

MARKER = "moonrt.json"


def _crc(marker: dict[str, Any]) -> str:
    """The marker's checksum as specified: CRC-32 of the JSON of every other key, keys sorted, no spaces."""
    body = {k: v for k, v in marker.items() if k != "marker_crc32"}
    return f"{zlib.crc32(json.dumps(body, sort_keys=True, separators=(',', ':')).encode()):08x}"


def _edit(step_dir: Path, change: Callable[[dict[str, Any]], None], resum: bool = True) -> None:
    """Edit the marker as a deliberate editor would: the change, then (``resum``) its checksum recomputed."""
    marker = json.loads((step_dir / MARKER).read_text())
    change(marker)
    if resum:
        marker["marker_crc32"] = _crc(marker)
    (step_dir / MARKER).write_text(json.dumps(marker, indent=1))


def _files(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run directory whose only checkpoint is sharded, at step 2 of 3 (one process trained it; ``convert``)."""
    base = tmp_path_factory.mktemp("marker")
    assert cli(_train_argv(base, "run", "--steps", "3", "--until", "2")) == 0
    run = base / "run"
    assert cli(["checkpoint", "convert", str(run / "checkpoint.pt"), str(run / "checkpoint")]) == 0
    (run / "checkpoint.pt").unlink()  # the sharded checkpoint is what a multi-rank run leaves
    return base


def _copy(sharded_run: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of :func:`sharded_run`'s run directory in ``tmp_path``: ``(run directory, its committed step)``."""
    run = tmp_path / "run"
    shutil.copytree(sharded_run / "run", run)
    return run, checkpoint_dcp.resolve(run / "checkpoint")


def _resume(sharded_run: Path, tmp_path: Path, *extra: str) -> list[str]:
    """``moonrt train --resume`` of the copy in ``tmp_path`` (the corpus the run was trained on: it is part of the
    job config)."""
    args = _train_argv(sharded_run, "run", "--resume", *extra)
    args[args.index("--out") + 1] = str(tmp_path / "run")
    return args


# ---- 1. the marker's own checksum ---------------------------------------------------------------------------


def test_the_marker_records_the_crc32_of_its_own_content(tmp_path: Path) -> None:
    step_dir = _sharded(tmp_path / "checkpoint", 3)
    marker = json.loads((step_dir / MARKER).read_text())
    assert marker["marker_crc32"] == _crc(marker)
    assert checkpoint_dcp.read_marker(step_dir)["step"] == 3


@pytest.mark.parametrize("flip", ['"step": 2', '"weight_decay": 0.1'])
def test_a_flipped_bit_in_the_marker_is_one_line_naming_it(sharded_run: Path, tmp_path: Path, capsys: Any,
                                                           flip: str) -> None:
    """The probe's case: one bit of ``"step": 2`` (-> 3: AdamW's counters would skip a step) or of a param group's
    ``weight_decay`` (0.1 -> 0.0) resumed silently and ``info --verify`` called the marker verified."""
    run, step_dir = _copy(sharded_run, tmp_path)
    raw = bytearray((step_dir / MARKER).read_bytes())
    at = bytes(raw).rfind(flip.encode())  # the last: param_groups[0] (after the job config's optim.weight_decay)
    assert at > 0
    raw[at + len(flip) - 1] ^= 0x01  # '2' -> '3', '1' -> '0'
    (step_dir / MARKER).write_bytes(bytes(raw))
    before = _files(run)
    capsys.readouterr()
    assert cli(_resume(sharded_run, tmp_path, "--steps", "3")) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert f"checkpoint {str(step_dir)!r}: file {MARKER} is damaged or edited" in line, line
    for args in (["info", str(step_dir)], ["info", str(run), "--verify"], ["export", str(run), str(tmp_path / "x")]):
        assert cli(["checkpoint", *args]) == 2, args
        assert f"file {MARKER} is damaged or edited" in _one_line(capsys), args
    assert not (tmp_path / "x").exists()
    assert _files(run) == before  # nothing trained or written


# ---- 2. the marker's step is its directory's --------------------------------------------------------------------


def test_a_step_other_than_the_directorys_is_refused(sharded_run: Path, tmp_path: Path, capsys: Any) -> None:
    run, step_dir = _copy(sharded_run, tmp_path)
    _edit(step_dir, lambda m: m.update(step=3))  # checksum recomputed: only the name tells
    capsys.readouterr()
    assert cli(_resume(sharded_run, tmp_path, "--steps", "4")) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert f"{MARKER} step = 3, but the directory is step-00000002" in line, line
    assert cli(["checkpoint", "info", str(step_dir), "--verify"]) == 2
    assert "step = 3, but the directory is step-00000002" in _one_line(capsys)
    _edit(step_dir, lambda m: m.update(step=2))
    renamed = step_dir.with_name("step-00000005")  # a renamed directory: resolve takes it as the newest
    step_dir.rename(renamed)
    assert cli(_resume(sharded_run, tmp_path, "--steps", "4")) == 2
    assert f"{MARKER} step = 2, but the directory is step-00000005" in _one_error_line(capsys.readouterr().err)
    with pytest.raises(CheckpointError, match="step = 2, but the directory is step-00000005"):
        checkpoint_dcp.read_full(renamed)


# ---- 3. markers written before the checksum -------------------------------------------------------------------


@pytest.mark.parametrize("drop", [("marker_crc32",), ("marker_crc32", "files")])
def test_an_old_marker_loads_with_one_warning_and_is_said_unverified(tmp_path: Path, capsys: Any,
                                                                     drop: tuple[str, ...]) -> None:
    step_dir = _sharded(tmp_path / "checkpoint")
    _edit(step_dir, lambda m: [m.pop(k) for k in drop], resum=False)
    capsys.readouterr()
    ref, _ = _linear(0)
    assert torch.equal(_load_linear(step_dir).weight, ref.weight)
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and "warning" in err[0] and f"{MARKER} carries no checksum of its own" in err[0], err
    assert str(step_dir) in err[0], err
    assert cli(["checkpoint", "info", str(step_dir), "--verify"]) == 0
    out = capsys.readouterr().out
    assert "marker: not verified (written before marker checksums)" in out, out
    assert cli(["checkpoint", "info", str(_sharded(tmp_path / "new"))]) == 0
    assert "marker: CRC-32 verified" in capsys.readouterr().out


# ---- 4. the optimizer hyperparameters the marker records ------------------------------------------------------


@pytest.mark.parametrize(("key", "value", "shown"), [("weight_decay", 0.0, "checkpoint 0.0, now 0.1"),
                                                     ("betas", [0.9, 0.5], "checkpoint [0.9, 0.5], now [0.9, 0.95]"),
                                                     ("eps", 1e-3, "checkpoint 0.001, now 1e-08")])
def test_an_edited_param_group_is_refused_like_a_changed_setting(sharded_run: Path, tmp_path: Path, capsys: Any,
                                                                 key: str, value: Any, shown: str) -> None:
    run, step_dir = _copy(sharded_run, tmp_path)
    _edit(step_dir, lambda m: m["param_groups"][0].update({key: value}))  # checksum recomputed: a deliberate edit
    before = _files(run)
    capsys.readouterr()
    assert cli(_resume(sharded_run, tmp_path, "--steps", "3")) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert f"--resume: the job differs from the checkpoint's (step 2) in param_groups[0].{key}: {shown}" in line, line
    assert _files(run) == before


def test_a_setting_the_job_may_change_resumes_a_sharded_checkpoint(sharded_run: Path, tmp_path: Path,
                                                                  capsys: Any) -> None:
    """The job changes ``optim.weight_decay`` and names it in ``--resume-allow-changes``: its param group differs from
    the marker's, which the marker's own config builds (the train job's builder, handed to the load: the checkpoint
    package cannot build a job itself), so the resume runs on instead of calling the marker edited."""
    run, _ = _copy(sharded_run, tmp_path)
    capsys.readouterr()
    assert cli(_resume(sharded_run, tmp_path, "--steps", "3", "--set", "optim.weight_decay=0.0",
                       "--resume-allow-changes", "weight_decay")) == 0, capsys.readouterr().err
    assert checkpoint.load(run / "checkpoint.pt")["step"] == 3  # one process: the gathered file, newer


def _train_ranks(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(_ranks(2, *_train_argv(cwd, "run", "--zero", "1", "--threads", "1", *args)), cwd=cwd,
                          capture_output=True, text=True, timeout=400)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_an_edited_param_group_is_refused_under_zero1_on_two_ranks(tmp_path: Path) -> None:
    done = _train_ranks(tmp_path, "--steps", "2", "--until", "1", "--set", "optim.eval_windows=2")
    assert done.returncode == 0, done.stdout + done.stderr
    step_dir = checkpoint_dcp.resolve(tmp_path / "run" / "checkpoint")
    assert checkpoint_dcp.read_marker(step_dir)["layout"]["zero"] == 1
    _edit(step_dir, lambda m: m["param_groups"][0].update(weight_decay=0.0))
    before = _files(tmp_path / "run")
    done = _train_ranks(tmp_path, "--steps", "2", "--resume", "--set", "optim.eval_windows=2")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "param_groups[0].weight_decay: checkpoint 0.0, now 0.1" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert _files(tmp_path / "run") == before


def test_convert_of_an_edited_param_group_is_refused(sharded_run: Path, tmp_path: Path, capsys: Any) -> None:
    """``convert`` to a ``.pt`` would carry the edited value into a file whose param groups a resume applies."""
    run, step_dir = _copy(sharded_run, tmp_path)
    _edit(step_dir, lambda m: m["param_groups"][0].update(weight_decay=0.0))
    assert cli(["checkpoint", "convert", str(step_dir), str(tmp_path / "x.pt")]) == 2
    line = _one_line(capsys)
    assert f"{MARKER} param_groups[0].weight_decay = 0.0, but its job config builds 0.1" in line, line
    assert not (tmp_path / "x.pt").exists()


# ---- 5. export / convert of a run that is still running ----------------------------------------------------------


def _commit_newer(root: Path) -> None:
    """What a running job that keeps one step (``checkpoint.keep_latest = 1``) does at its next checkpoint: commit
    step 3 and remove the older steps."""
    from moonrt.jobs.train.config import CheckpointConfig, JobConfig

    model, opt = _linear(1)
    job = JobConfig(checkpoint=CheckpointConfig(keep_latest=1))
    checkpoint_dcp.save_sharded(root, model, opt, 3, job)


def _exported(action: str, path: Path) -> Any:
    """``(step, every tensor as a list)`` of an exported file (safetensors orders its header's keys freely)."""
    if action == "export":
        from safetensors import safe_open

        with safe_open(str(path), "pt") as f:
            return f.metadata()["moonrt_step"], {k: f.get_tensor(k).tolist() for k in f.keys()}
    state = checkpoint.load(path)
    return state["step"], {k: v.tolist() for k, v in state["model"].items()}


@pytest.mark.parametrize("action", ["export", "convert"])
@pytest.mark.slow  # training runs while checkpoints rotate: CI runs it, the fast lane need not
def test_a_step_rotated_away_while_it_is_read_is_still_read_whole(sharded_run: Path, tmp_path: Path, capsys: Any,
                                                                  monkeypatch: pytest.MonkeyPatch,
                                                                  action: str) -> None:
    """The running job commits a newer step (and removes the one being read) after the reader resolved and opened
    it, before DCP reads the tensors: the reader gets step 2 whole, as from a run that had stopped (it failed
    naming a missing file of the checkpoint)."""
    import torch.distributed.checkpoint as dcp

    run, step_dir = _copy(sharded_run, tmp_path)
    suffix = ".safetensors" if action == "export" else ".pt"
    assert cli(["checkpoint", action, str(sharded_run / "run" / "checkpoint"), str(tmp_path / f"ref{suffix}")]) == 0
    real_load, rotated = dcp.load, []

    def load(*args: Any, **kwargs: Any) -> Any:
        if not rotated:
            _commit_newer(run / "checkpoint")
            rotated.append(True)
        return real_load(*args, **kwargs)

    monkeypatch.setattr(dcp, "load", load)
    capsys.readouterr()
    got = tmp_path / f"got{suffix}"
    assert cli(["checkpoint", action, str(run / "checkpoint"), str(got)]) == 0, capsys.readouterr()
    assert rotated and not step_dir.exists() and checkpoint_dcp.resolve(run / "checkpoint").name == "step-00000003"
    assert _exported(action, got) == _exported(action, tmp_path / f"ref{suffix}")


@pytest.mark.parametrize("when", [1, 2])
def test_a_step_rotated_away_before_it_is_opened_is_said_in_one_line(sharded_run: Path, tmp_path: Path, capsys: Any,
                                                                     monkeypatch: pytest.MonkeyPatch,
                                                                     when: int) -> None:
    """Rotated right after ``export`` resolved ``OUT/checkpoint`` (``when`` = 1) or after the reader resolved the
    step again (2): one line saying step 2 was rotated away, not that the checkpoint is damaged or missing."""
    run, step_dir = _copy(sharded_run, tmp_path)
    real_resolve, calls = checkpoint_dcp.resolve, []

    def resolve(path: Any) -> Path:
        got = real_resolve(path)
        calls.append(path)
        if len(calls) == when:
            _commit_newer(run / "checkpoint")
        return got

    monkeypatch.setattr(checkpoint_dcp, "resolve", resolve)
    capsys.readouterr()
    assert cli(["checkpoint", "export", str(run / "checkpoint"), str(tmp_path / "x.safetensors")]) == 2
    line = _one_line(capsys)
    assert f"checkpoint {str(step_dir)!r}: step 2 was rotated away" in line, line
    assert "damaged" not in line and "missing" not in line, line
    assert not (tmp_path / "x.safetensors").exists()
