"""Disk tier on a filesystem without room (issue 28, defect 5): one clear line, never SIGBUS, nothing left behind.

The disk tier used to ``ftruncate`` a sparse file to its capacity and memory-map it: the first write to a page the
filesystem could not back killed the process with SIGBUS (exit 135) and no message. The capacity is now allocated
when the store is created and bytes move with ``pwrite`` / ``preadv``.
"""

from __future__ import annotations

import errno
import gc
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from memory.helpers import _open_files_under
from mounts import small_tmpfs
from torch import nn

import moonrt
from moonrt.cli import main
from moonrt.config import ConfigError, from_dict
from moonrt.memory import backends
from moonrt.memory.backends import DiskStore
from moonrt.memory.manager import ActivationManager
from moonrt.memory.policy import MemoryPolicy

MIB = 2**20
ROOT = Path(moonrt.__file__).resolve().parent.parent


def _corpus(tmp_path: Path) -> Path:
    corpus = tmp_path / "corpus.txt"
    if not corpus.exists():
        corpus.write_text("".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(400)))
    return corpus


def _policy_file(tmp_path: Path, disk_path: Path, mib: int = 8) -> Path:
    pol = tmp_path / "policy.yaml"
    pol.write_text(f"default: disk\ndisk_path: {disk_path}\ndisk_capacity_mib: {mib}\n")
    return pol


def _train_args(tmp_path: Path, disk_path: Path) -> list[str]:
    return ["train", "--corpus", str(_corpus(tmp_path)), "--batch-size", "2", "--seq-len", "16", "--steps", "1",
            "--out", str(tmp_path / "run"), "--no-progress", "--memory-policy", str(_policy_file(tmp_path, disk_path))]


@pytest.fixture
def small_fs(tmp_path: Path):
    """A 256 KiB tmpfs (a real full filesystem): :func:`mounts.small_tmpfs`."""
    with small_tmpfs(tmp_path / "small", "256k") as mnt:
        yield mnt


@pytest.mark.slow  # a moonrt train process on a full tmpfs: CI runs it, the fast lane need not
def test_train_on_a_full_filesystem_is_one_line_not_sigbus(tmp_path: Path, small_fs: Path) -> None:
    """The probe: ``moonrt train --memory-policy`` with the disk tier on a 256 KiB filesystem (8 MiB capacity).
    Before: SIGBUS (exit 135 in a shell, -7 here), no message. Now: exit 2, one line naming the directory, the
    bytes needed and the bytes free; nothing left on the small filesystem, no config.yaml written."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "moonrt.cli", *_train_args(tmp_path, small_fs)], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    free = shutil.disk_usage(small_fs).free
    assert lines[0] == (f"moonrt train: error: disk tier: no space left on {small_fs}: need {8 * MIB} bytes, free "
                        f"{free} bytes (memory policy disk_path / disk_capacity_mib)")
    assert list(small_fs.iterdir()) == []
    assert not (tmp_path / "run" / "config.yaml").exists()


def test_store_on_a_full_filesystem_raises_and_closes_its_file(small_fs: Path) -> None:
    with pytest.raises(ConfigError, match=rf"^disk tier: no space left on {small_fs}: need {MIB} bytes, free \d+"):
        DiskStore(small_fs, MIB)
    assert list(small_fs.iterdir()) == [] and _open_files_under(os.getpid(), small_fs) == []
    assert shutil.disk_usage(small_fs).used == 0
    # a capacity that fits works, and its space is taken at once (reserved, not sparse)
    store = DiskStore(small_fs, 128 * 1024)
    assert shutil.disk_usage(small_fs).used >= 128 * 1024
    data = torch.arange(100_000, dtype=torch.int64).to(torch.uint8)
    rec = store.put(data)
    assert torch.equal(store.get(rec, torch.device("cpu")), data)
    store.close()
    assert _open_files_under(os.getpid(), small_fs) == [] and shutil.disk_usage(small_fs).used == 0


def _enospc(*_args: object) -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_reservation_enospc_is_one_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Portable: the reservation fails with ENOSPC (posix_fallocate patched): ConfigError naming the directory,
    the bytes needed and free; the file is closed (it never had a name: nothing in the directory)."""
    directory = tmp_path / "offload"
    monkeypatch.setattr(os, "posix_fallocate", _enospc, raising=False)
    with pytest.raises(ConfigError) as info:
        DiskStore(directory, 3 * MIB)
    msg = str(info.value)
    assert msg.startswith(f"disk tier: no space left on {directory}: need {3 * MIB} bytes, free "), msg
    assert int(msg.split("free ")[1].split(" bytes")[0]) == shutil.disk_usage(directory).free
    assert list(directory.iterdir()) == [] and _open_files_under(os.getpid(), directory) == []


def test_reservation_enospc_in_train_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """The same through ``moonrt train`` in-process: exit 2, one line, before any output is written."""
    directory = tmp_path / "offload"
    monkeypatch.setattr(os, "posix_fallocate", _enospc, raising=False)
    assert main(_train_args(tmp_path, directory)) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(
        f"moonrt train: error: disk tier: no space left on {directory}: need {8 * MIB} bytes, free "), lines
    assert list(directory.iterdir()) == []
    assert not (tmp_path / "run" / "config.yaml").exists()


def test_write_enospc_is_one_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A write that finds no space although the blocks were reserved (copy-on-write filesystems): the same
    ConfigError from the saved-tensor hook, the extent released, no SIGBUS; later writes work again."""
    directory = tmp_path / "offload"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    pol = from_dict(MemoryPolicy, {"default": "disk", "disk_path": str(directory), "disk_capacity_mib": 8})
    mgr = ActivationManager(model, pol)
    store = mgr._stores["disk"]
    real, calls = os.pwrite, []

    def third_write_fails(*args: object) -> int:  # two saved tensors written, the third finds no space
        calls.append(1)
        if len(calls) == 3:
            _enospc()
        return real(*args)  # type: ignore[arg-type]

    with monkeypatch.context() as m:
        m.setattr(os, "pwrite", third_write_fails)
        with pytest.raises(ConfigError, match=rf"^disk tier: no space left on {directory}: need \d+ bytes, free \d+"):
            with mgr:
                model(torch.randn(16, 64, requires_grad=True)).sum()
    assert len(calls) == 3
    gc.collect()  # the failed forward's partial graph: its two stored tensors are released with it
    assert store.used == 0 and mgr.accounting.live["disk"] == 0
    x = torch.randn(16, 64, requires_grad=True)
    ref = torch.autograd.grad(model(x).square().sum(), [x, *model.parameters()])
    with mgr:
        y = model(x).square().sum()
    got = torch.autograd.grad(y, [x, *model.parameters()])
    assert mgr.accounting.peak["disk"] > 0
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    mgr.close()
    assert list(directory.iterdir()) == [] and _open_files_under(os.getpid(), directory) == []


def test_store_without_posix_fallocate_reserves_by_writing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the platform has no posix_fallocate (macOS) the zeros are written; ENOSPC there is the same error."""
    monkeypatch.delattr(os, "posix_fallocate", raising=False)
    store = DiskStore(tmp_path, MIB + 7)
    assert os.fstat(store._fd).st_size == MIB + 7 and os.fstat(store._fd).st_blocks * 512 >= MIB
    data = torch.randint(0, 256, (5000,), dtype=torch.uint8)
    assert torch.equal(store.get(store.put(data), torch.device("cpu")), data)
    store.close()
    monkeypatch.setattr(os, "pwrite", _enospc)
    with pytest.raises(ConfigError, match=rf"^disk tier: no space left on {tmp_path}: need {MIB + 7} bytes"):
        DiskStore(tmp_path, MIB + 7)
    assert list(tmp_path.iterdir()) == [] and _open_files_under(os.getpid(), tmp_path) == []
    assert backends._PREADV is not None or sys.platform != "linux"
