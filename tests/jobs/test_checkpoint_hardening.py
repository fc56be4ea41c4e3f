"""``moonrt checkpoint`` and sharded checkpoints against hostile-but-fair use (issue 28).

- ``export`` / ``convert`` never overwrite what the user or the run owns: an existing target is refused
  unless ``--force``, a run's own checkpoint (the source, any ``checkpoint.pt``, anything inside a sharded
  checkpoint) never; ``convert`` writes a sharded checkpoint only into a new or empty directory.
- Damaged checkpoints are detected: ``moonrt.json`` records every file's size and CRC-32; a flipped bit, a
  truncated shard, a missing or truncated ``.metadata`` are one line naming the file (no DCP traceback);
  markers written before checksums still load ("not verified" in ``info``).
- A full disk during a 2-rank save (a real 2 MiB tmpfs, and a writer failing with ENOSPC in one rank) says
  "no space left on device", removes the save's ``step-N.tmp`` and keeps the previous step.
- A crafted ``.metadata`` cannot point reads outside the checkpoint directory.
- Malformed ``.pt`` files are one line naming the file; the unsafe-pickle refusal never suggests allow-listing.
- ``info`` checks every marker key it uses, and on a run directory says which checkpoint ``--resume`` takes.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import pickle
import shutil
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from dist import dist_run
from jobs.helpers import _linear, _load_linear, _one_line, _sharded
from mounts import small_tmpfs

from moonrt.cli import main as cli
from moonrt.comm.parallelism import Parallelism
from moonrt.config import to_dict
from moonrt.jobs.checkpoint import sharded as checkpoint_dcp
from moonrt.jobs.checkpoint import single as checkpoint
from moonrt.jobs.checkpoint import store
from moonrt.jobs.checkpoint.single import CheckpointError
from moonrt.jobs.train.config import JobConfig


def _pt(path: Path, step: int, value: float = 1.0) -> None:
    checkpoint.save(path, {"model": {"w": torch.full((4,), value)}, "optimizer": {}, "step": step,
                           "config": to_dict(JobConfig())})


# ---- 1. our own commands never destroy data ------------------------------------------------------------


def test_export_refuses_an_existing_file_and_never_overwrites_a_runs_checkpoint(tmp_path: Path, capsys: Any) -> None:
    run = tmp_path / "run"
    run.mkdir()
    _pt(run / "checkpoint.pt", 3)
    own = (run / "checkpoint.pt").read_bytes()
    user = tmp_path / "mine.safetensors"
    user.write_bytes(b"the user's file")
    src = str(run / "checkpoint.pt")

    assert cli(["checkpoint", "export", src, str(user)]) == 2
    assert "exists; not overwritten (--force replaces it)" in _one_line(capsys)
    assert user.read_bytes() == b"the user's file"
    for target in (run / "checkpoint.pt", tmp_path / "other" / "checkpoint.pt"):  # the source, any checkpoint.pt
        target.parent.mkdir(exist_ok=True)
        assert cli(["checkpoint", "export", src, str(target), "--force"]) == 2
        assert "never overwritten (not even with --force)" in _one_line(capsys)
    assert (run / "checkpoint.pt").read_bytes() == own
    assert not (tmp_path / "other" / "checkpoint.pt").exists()
    step_dir = _sharded(run / "checkpoint", 5)  # inside a sharded checkpoint: its step dir, its root
    for target in (step_dir / "w.safetensors", step_dir.parent / "w.safetensors", step_dir / "__0_0.distcp"):
        before = sorted(p.name for p in step_dir.iterdir())
        assert cli(["checkpoint", "export", str(step_dir), str(target), "--force"]) == 2
        assert "sharded checkpoint" in _one_line(capsys)
        assert sorted(p.name for p in step_dir.iterdir()) == before and not (step_dir.parent / "w.safetensors").exists()
    assert checkpoint_dcp.verify(step_dir) == 2  # its files untouched

    assert cli(["checkpoint", "export", src, str(user), "--force"]) == 0  # --force replaces a user's file
    from safetensors.torch import load_file

    assert torch.equal(load_file(user)["w"], torch.ones(4))
    new = tmp_path / "new.safetensors"
    assert cli(["checkpoint", "export", src, str(new)]) == 0 and torch.equal(load_file(new)["w"], torch.ones(4))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.safetensors", "new.safetensors", "other", "run"]


def _tiny_pt(path: Path, step: int) -> None:
    """A real ``checkpoint.pt`` of k3_tiny (convert rebuilds the model of its config)."""
    from moonrt.jobs.train.assemble import build_model
    from moonrt.jobs.train.optimizers import build_optimizer

    job = JobConfig(model="k3_tiny")
    model = build_model(job)
    opt = build_optimizer(model, job.optim)
    checkpoint.save(path, {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step,
                           "config": to_dict(job)})


@pytest.mark.slow  # a training run, then converts: CI runs it, the fast lane need not
def test_convert_writes_only_into_a_new_or_empty_directory(tmp_path: Path, capsys: Any) -> None:
    out = tmp_path / "out"
    newer = _sharded(out / "checkpoint", 30)  # the run's newer committed step
    users = [out / "checkpoint" / "step-00000007", out / "checkpoint" / "notes.tmp"]  # user folders, no marker
    for d in users:
        d.mkdir()
        (d / "keep.txt").write_text("mine")
    _tiny_pt(tmp_path / "old.pt", 10)
    assert cli(["checkpoint", "convert", str(tmp_path / "old.pt"), str(out / "checkpoint")]) == 2
    assert "not empty" in _one_line(capsys)
    assert checkpoint_dcp.resolve(out / "checkpoint") == newer and checkpoint_dcp.verify(newer) == 2
    assert all((d / "keep.txt").read_text() == "mine" for d in users)

    (tmp_path / "empty").mkdir()
    assert cli(["checkpoint", "convert", str(tmp_path / "old.pt"), str(tmp_path / "empty")]) == 0
    assert checkpoint_dcp.read_marker(checkpoint_dcp.resolve(tmp_path / "empty"))["step"] == 10
    capsys.readouterr()

    # sharded -> .pt: an existing .pt only with --force, a checkpoint.pt never
    other = tmp_path / "other.pt"
    other.write_bytes(b"user data")
    assert cli(["checkpoint", "convert", str(tmp_path / "empty"), str(other)]) == 2
    assert "exists" in _one_line(capsys) and other.read_bytes() == b"user data"
    pt = tmp_path / "checkpoint.pt"
    shutil.copy(tmp_path / "old.pt", pt)
    before = pt.read_bytes()
    assert cli(["checkpoint", "convert", str(tmp_path / "empty"), str(pt), "--force"]) == 2
    assert "never overwritten" in _one_line(capsys) and pt.read_bytes() == before
    assert cli(["checkpoint", "convert", str(tmp_path / "empty"), str(other), "--force"]) == 0
    assert checkpoint.load(other)["step"] == 10
    fresh = tmp_path / "fresh" / "checkpoint.pt"  # a new checkpoint.pt: what convert is for
    fresh.parent.mkdir()
    assert cli(["checkpoint", "convert", str(tmp_path / "empty"), str(fresh)]) == 0
    assert checkpoint.load(fresh)["step"] == 10


# ---- 2. damaged checkpoints are detected, naming the file --------------------------------------------------


def _flip_a_weight_bit(step_dir: Path, model: torch.nn.Module) -> None:
    shard = step_dir / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    at = bytes(data).find(model.weight.detach().numpy().tobytes())
    assert at > 0
    data[at + 5] ^= 0x10  # one bit of one weight's mantissa
    shard.write_bytes(bytes(data))


def test_a_flipped_bit_in_a_shard_is_refused_naming_the_file(tmp_path: Path, capsys: Any) -> None:
    step_dir = _sharded(tmp_path / "checkpoint")
    marker = checkpoint_dcp.read_marker(step_dir)
    assert set(marker["files"]) == {".metadata", "__0_0.distcp"}
    ref, _ = _linear(0)
    _flip_a_weight_bit(step_dir, ref)
    with pytest.raises(CheckpointError, match=r"file __0_0\.distcp is damaged: CRC-32 [0-9a-f]{8}, moonrt\.json "
                                              r"records [0-9a-f]{8}"):
        _load_linear(step_dir)
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp is damaged"):
        checkpoint_dcp.read_full(step_dir)
    assert cli(["checkpoint", "info", str(step_dir)]) == 0  # info reads the marker only
    assert "checksums: 2 files recorded" in capsys.readouterr().out
    assert cli(["checkpoint", "info", str(step_dir), "--verify"]) == 2
    assert "file __0_0.distcp is damaged" in _one_line(capsys)


@pytest.mark.slow  # a two-rank training run, then a resume: CI runs it, the fast lane need not
def test_resume_from_a_shard_with_a_flipped_bit_is_refused(tmp_path: Path, capsys: Any) -> None:
    """The probe's case end to end: ``moonrt train --resume`` of a sharded checkpoint with one bit flipped in its
    shard exits 2 naming the file (it resumed with rc 0 and one weight changed)."""
    from jobs.helpers import _train_argv

    assert cli(_train_argv(tmp_path, "run", "--steps", "3", "--until", "2")) == 0
    run = tmp_path / "run"
    assert cli(["checkpoint", "convert", str(run / "checkpoint.pt"), str(run / "checkpoint")]) == 0
    state = checkpoint.load(run / "checkpoint.pt")
    (run / "checkpoint.pt").unlink()  # the sharded checkpoint is what a 2-rank run leaves
    step_dir = checkpoint_dcp.resolve(run / "checkpoint")
    shard = next(step_dir.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    at = bytes(data).find(state["model"]["norm.weight"].numpy().tobytes())
    assert at > 0
    data[at + 1] ^= 0x01
    shard.write_bytes(bytes(data))
    capsys.readouterr()
    assert cli(_train_argv(tmp_path, "run", "--steps", "3", "--resume")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"file {shard.name} is damaged" in err, err
    assert sorted(p.name for p in step_dir.iterdir()) == sorted([".metadata", shard.name, "moonrt.json"])


def test_a_truncated_shard_or_metadata_is_one_line_naming_the_file(tmp_path: Path, capsys: Any,
                                                                    caplog: Any) -> None:
    good = _sharded(tmp_path / "good" / "checkpoint")
    cases = {"shard": ("__0_0.distcp", "truncate"), "metadata-truncated": (".metadata", "truncate"),
             "metadata-missing": (".metadata", "remove")}
    for old_marker in (False, True):  # with checksums, and a marker written before them
        for case, (name, how) in cases.items():
            step_dir = tmp_path / f"{case}-{old_marker}" / good.name
            shutil.copytree(good, step_dir)
            if old_marker:
                marker = json.loads((step_dir / "moonrt.json").read_text())
                del marker["files"], marker["marker_crc32"]  # neither: both came later
                (step_dir / "moonrt.json").write_text(json.dumps(marker))
            if how == "remove":
                (step_dir / name).unlink()
            else:
                os.truncate(step_dir / name, (step_dir / name).stat().st_size // 2)
            caplog.clear()
            with pytest.raises(CheckpointError) as exc:
                _load_linear(step_dir)
            msg = str(exc.value)
            assert f"file {name} " in msg and "does not fit" not in msg and "\n" not in msg, (case, msg)
            assert ("missing" if how == "remove" else "truncated") in msg, (case, msg)
            assert not [r for r in caplog.records if "torch/distributed/checkpoint" in r.pathname], caplog.records
            assert cli(["checkpoint", "export", str(step_dir), str(tmp_path / f"{case}-{old_marker}.st")]) == 2
            assert f"file {name} " in _one_line(capsys)


def test_a_marker_written_before_checksums_still_loads(tmp_path: Path, capsys: Any) -> None:
    step_dir = _sharded(tmp_path / "checkpoint")
    marker = json.loads((step_dir / "moonrt.json").read_text())
    del marker["files"], marker["marker_crc32"]  # neither: both came later
    (step_dir / "moonrt.json").write_text(json.dumps(marker))
    ref, _ = _linear(0)
    assert torch.equal(_load_linear(step_dir).weight, ref.weight)
    assert checkpoint_dcp.verify(step_dir) is None
    assert cli(["checkpoint", "info", str(step_dir), "--verify"]) == 0
    assert "not verified (written before checksums)" in capsys.readouterr().out


def _two_ranks_load_a_damaged_shard(rank: int, world: int, root: str) -> dict[str, Any]:
    """2 ranks save (a replicated state: DCP splits the writing between them), one shard gets a flipped bit, both
    ranks load: each must fail naming the file, whichever rank summed it."""
    import torch.distributed as dist

    rt = Parallelism(dp_rank=rank, dp_size=world, is_main=rank == 0)
    model, opt = _linear(0, 64)
    step_dir = checkpoint_dcp.save_sharded(Path(root), model, opt, 1, JobConfig(), rt)
    files = sorted(checkpoint_dcp.read_marker(step_dir)["files"])
    if rank == 0:
        shard = step_dir / files[-1]  # the last data file: summed by the last rank of a 2-rank load
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0x04
        shard.write_bytes(bytes(data))
    dist.barrier()
    fresh, fresh_opt = _linear(5, 64)
    try:
        checkpoint_dcp.load_sharded(step_dir, fresh, fresh_opt, rt)
        error = None
    except CheckpointError as exc:
        error = str(exc)
    return {"files": files, "error": error}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_every_rank_of_a_load_refuses_a_damaged_shard(tmp_path: Path) -> None:
    got = dist_run(_two_ranks_load_a_damaged_shard, 2, str(tmp_path / "checkpoint"), timeout=240)
    files = got[0]["files"]
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp"], files  # each rank's file summed by it
    for r in got:
        assert r["error"] is not None and f"file {files[-1]} is damaged" in r["error"], got


# ---- 3. a full disk during a 2-rank save ---------------------------------------------------------------


def _save_two_ranks_on_a_full_disk(rank: int, world: int, root: str, mode: str) -> dict[str, Any]:
    """Save step 1 (fits), fill the disk (``tmpfs``) or fail rank 1's shard writes with ENOSPC (``patched``), save
    step 2; returns step 2's error and what is left in ``root``."""
    import pathlib

    import torch.distributed as dist

    rt = Parallelism(dp_rank=rank, dp_size=world, is_main=rank == 0)
    model, opt = _linear(0, 128)
    job = JobConfig()
    checkpoint_dcp.save_sharded(Path(root), model, opt, 1, job, rt)
    filler = Path(root).parent / "filler"
    if mode == "tmpfs" and rank == 0:  # leave ~64 KiB: step 2 (~200 KB) cannot fit
        free = os.statvfs(root).f_bavail * os.statvfs(root).f_frsize
        with contextlib.suppress(OSError), open(filler, "wb") as f:
            f.write(b"\0" * max(free - (64 << 10), 0))
    if mode == "patched" and rank == 1:
        real_open = pathlib.Path.open

        class Full:  # the disk fills after 4 KiB of the shard: inside torch's zip writer ("unexpected pos")
            def __init__(self, f: Any) -> None:
                self.f, self.n = f, 0

            def write(self, data: Any) -> int:
                self.n += len(data)
                if self.n > 4096:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                return self.f.write(data)

            def __getattr__(self, name: str) -> Any:
                return getattr(self.f, name)

            def __enter__(self) -> Any:
                return self

            def __exit__(self, *exc: Any) -> None:
                self.f.close()

        def full_open(self: Path, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
            f = real_open(self, mode, *args, **kwargs)
            return Full(f) if "w" in mode and self.suffix == ".distcp" else f

        pathlib.Path.open = full_open  # type: ignore[method-assign]
    dist.barrier()
    with torch.no_grad():
        model.weight.add_(1.0)
    try:
        checkpoint_dcp.save_sharded(Path(root), model, opt, 2, job, rt)
        error = None
    except CheckpointError as exc:
        error = str(exc)
    dist.barrier()
    left = sorted(p.name for p in Path(root).iterdir())
    if rank == 0:
        filler.unlink(missing_ok=True)
    return {"error": error, "left": left}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["patched", "tmpfs"])
@pytest.mark.slow  # a two-rank training run on a full filesystem: CI runs it, the fast lane need not
def test_no_space_during_a_two_rank_save_keeps_the_previous_step(tmp_path: Path, mode: str) -> None:
    with contextlib.ExitStack() as stack:
        if mode == "tmpfs":
            disk = stack.enter_context(small_tmpfs(tmp_path / "disk", "2m"))
        else:
            disk = tmp_path / "disk"
            disk.mkdir()
        root = disk / "checkpoint"
        got = dist_run(_save_two_ranks_on_a_full_disk, 2, str(root), mode, timeout=240)
        for r in got:
            assert r["error"] == f"checkpoint write failed: no space left on device in {root}", got
            assert r["left"] == ["step-00000001"], got  # no step-2.tmp left behind
        ref, _ = _linear(0, 128)
        model, opt = _linear(5, 128)
        assert checkpoint_dcp.load_sharded(root, model, opt) == 1
        assert torch.equal(model.weight, ref.weight)


def test_a_symlink_planted_at_the_save_directory_is_not_written_through(tmp_path: Path) -> None:
    root, foreign = tmp_path / "checkpoint", tmp_path / "foreign"
    foreign.mkdir()
    _sharded(root, 1)
    (root / "step-00000002.tmp").symlink_to(foreign)
    (root / "step-00000003").symlink_to(foreign)
    _sharded(root, 2)
    step_dir = _sharded(root, 3)
    assert list(foreign.iterdir()) == []
    # the planted .tmp link removed, the planted step-00000003 link replaced; keep_latest 2: steps 2 and 3 stay
    assert sorted(p.name for p in root.iterdir()) == ["step-00000002", "step-00000003"] and not step_dir.is_symlink()
    assert checkpoint_dcp.verify(step_dir) == 2


# ---- 4. a crafted .metadata cannot read outside the checkpoint -----------------------------------------------


def test_a_metadata_pointing_outside_the_checkpoint_is_refused(tmp_path: Path, capsys: Any) -> None:
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    from moonrt.comm.state.dcp import SafeReader, read_metadata_safely

    step_dir = _sharded(tmp_path / "a" / "checkpoint", seed=0)
    other = _sharded(tmp_path / "b" / "checkpoint", seed=1)  # outside: another checkpoint's shard
    md = read_metadata_safely((step_dir / ".metadata").read_bytes())
    (step_dir / "link.distcp").symlink_to(other / "__0_0.distcp")
    outside = str(other / "__0_0.distcp")
    for rel in (outside, f"../../../b/checkpoint/{other.name}/__0_0.distcp", "link.distcp"):
        crafted = md
        for index, info in list(md.storage_data.items()):
            crafted.storage_data[index] = _StorageInfo(relative_path=rel, offset=info.offset, length=info.length)
        (step_dir / ".metadata").write_bytes(pickle.dumps(crafted))
        with pytest.raises(ValueError, match=r"checkpoint entry 'model\.\w+': stored in .*outside the checkpoint"):
            SafeReader(step_dir).read_metadata()
        with pytest.raises(CheckpointError, match="outside the checkpoint directory"):
            _load_linear(step_dir)
        assert cli(["checkpoint", "export", str(step_dir), str(tmp_path / "x.safetensors")]) == 2
        assert "outside the checkpoint directory" in _one_line(capsys)
    assert not (tmp_path / "x.safetensors").exists()


# ---- 5. malformed .pt files, unsafe pickles -------------------------------------------------------------------


class _Evil:
    def __reduce__(self) -> tuple[Any, ...]:
        return os.system, ("true",)


@pytest.mark.parametrize("kind", ["random", "zip", "no_config", "model_not_dict", "config_not_job",
                                  "config_not_dict", "evil"])
def test_a_malformed_pt_is_one_line_naming_the_file(tmp_path: Path, capsys: Any, kind: str) -> None:
    pt = tmp_path / f"{kind}.pt"
    good = {"model": {"w": torch.zeros(2)}, "optimizer": {}, "step": 1, "config": to_dict(JobConfig())}
    if kind == "random":
        pt.write_bytes(os.urandom(4096))
    elif kind == "zip":
        with zipfile.ZipFile(pt, "w") as z:
            z.writestr("a.txt", "hello")
    else:
        bad = {"no_config": {k: v for k, v in good.items() if k != "config"}, "model_not_dict": {**good, "model": 5},
               "config_not_job": {**good, "config": {"model": "nope"}}, "config_not_dict": {**good, "config": 5},
               "evil": {**good, "optimizer": _Evil()}}[kind]
        torch.save(bad, pt)
    for action, dst in (("export", tmp_path / "x.safetensors"), ("convert", tmp_path / "x")):
        if kind == "config_not_job" and action == "export":
            continue  # export needs no model of the config: the weights are exported as stored
        assert cli(["checkpoint", action, str(pt), str(dst)]) == 2
        line = _one_line(capsys)
        assert str(pt) in line, line
        assert not dst.exists()
        if kind == "evil":
            assert "objects other than tensors and plain containers" in line, line
            for advice in ("allowlist", "add_safe_globals", "safe_globals", "weights_only=False", "trust"):
                assert advice not in line, line


def test_the_unsafe_pickle_refusal_never_suggests_allow_listing(tmp_path: Path) -> None:
    pt = tmp_path / "checkpoint.pt"
    torch.save({"model": {"x": torch.nn.Linear(1, 1)}, "optimizer": {}, "step": 1, "config": {}}, pt)
    with pytest.raises(CheckpointError) as exc:
        checkpoint.load(pt)
    msg = str(exc.value)
    assert "refused to load (weights_only=True)" in msg and "torch.nn.modules.linear.Linear" in msg, msg
    assert "safe_globals" not in msg and "allowlist" not in msg and "trust" not in msg, msg


# ---- 6. info on a marker with missing or wrong keys ----------------------------------------------------------


@pytest.mark.parametrize("key", ["layout", "ranks", "config", "param_groups", "tensors", "bytes", "layout.world",
                                 "config.optim", "config.optim.steps", "config.model", "ranks.0.written_bytes",
                                 "files.__0_0.distcp.crc32"])
@pytest.mark.parametrize("how", ["missing", "wrong type"])
def test_info_on_a_marker_with_a_bad_key_names_it(tmp_path: Path, capsys: Any, key: str, how: str) -> None:
    step_dir = _sharded(tmp_path / "checkpoint")
    marker = json.loads((step_dir / "moonrt.json").read_text())
    *path, last = key.split(".") if not key.startswith("files.") else ["files", "__0_0.distcp", "crc32"]
    at: Any = marker
    for part in path:
        at = at[int(part)] if isinstance(at, list) else at[part]
    if how == "missing":
        del at[last]
    else:
        at[last] = "x" if not isinstance(at[last], str) else 7
    (step_dir / "moonrt.json").write_text(json.dumps(marker))
    assert cli(["checkpoint", "info", str(step_dir)]) == 2
    line = _one_line(capsys)
    name = key.split(".")[-1] if not key.startswith("files.") else "crc32"
    assert name in line and "moonrt.json" in line, line


# ---- 7. which checkpoint --resume takes ---------------------------------------------------------------------


def test_info_on_a_run_directory_says_which_checkpoint_resume_takes(tmp_path: Path, capsys: Any) -> None:
    out = tmp_path / "out"
    step_dir = _sharded(out / "checkpoint", 30)
    _pt(out / "checkpoint.pt", 10)  # the older single file a multi-rank resume leaves beside the newer step
    assert cli(["checkpoint", "info", str(out)]) == 0
    text = capsys.readouterr().out
    assert f"--resume takes {step_dir} (step 30)" in text, text
    assert f"{out / 'checkpoint.pt'} (step 10) is not newer: --resume ignores it" in text, text
    assert store.resume_state(out)[0] == step_dir

    _pt(out / "checkpoint.pt", 40)  # now the file is newer
    assert cli(["checkpoint", "info", str(out)]) == 0
    text = capsys.readouterr().out
    assert f"--resume takes {out / 'checkpoint.pt'} (step 40)" in text, text
    assert f"{step_dir} (step 30) is not newer: --resume ignores it" in text, text
    assert store.resume_state(out)[0] == out / "checkpoint.pt"
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint", "checkpoint.pt"]  # nothing retired
    assert cli(["checkpoint", "info", str(out), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["resume_takes"] == str(out / "checkpoint.pt") and got["step"] == 40, got
    assert got["ignored"] == {"path": str(step_dir), "step": 30}, got

    assert cli(["checkpoint", "info", str(out / "checkpoint.pt"), "--verify"]) == 0  # a .pt file on its own
    text = capsys.readouterr().out
    assert "step 40 of" in text and "every zip record matches its CRC-32" in text, text
