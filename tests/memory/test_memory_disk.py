"""Disk tier of the activation manager: ``disk_path`` is a directory in which each
process creates its own new file; existing files are refused and never touched; two ranks sharing
one ``disk_path`` stay exact; no file is left after SIGTERM / SIGINT / SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from dist import dist_run
from memory.helpers import _open_files_under
from torch import nn

from moonrt.config import ConfigError, from_dict
from moonrt.memory.manager import ActivationManager
from moonrt.memory.policy import MemoryPolicy


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64), nn.SiLU(), nn.Linear(64, 64))


def _disk_policy(path: Path | str) -> MemoryPolicy:
    return from_dict(MemoryPolicy, {"default": "disk", "disk_path": str(path), "disk_capacity_mib": 8})


def test_existing_file_is_refused_and_left_untouched(tmp_path):
    victim = tmp_path / "checkpoint.pt"
    payload = os.urandom(100_000)
    victim.write_bytes(payload)
    with pytest.raises(ConfigError, match=r"disk_path = '.*checkpoint\.pt'.*existing file"):
        ActivationManager(_model(), _disk_policy(victim))
    # a policy built without validation reaches the store, which refuses it as well
    pol = MemoryPolicy(default="disk", disk_path=str(victim), disk_capacity_mib=8)
    from moonrt.memory.backends import DiskStore

    with pytest.raises(ConfigError, match="disk_path"):
        DiskStore(pol.disk_path, 2**20)
    assert victim.read_bytes() == payload


def test_files_already_in_the_directory_survive(tmp_path):
    other = tmp_path / "moonrt-offload-1-keep.bin"
    other.write_bytes(b"precious")
    model = _model()
    x = torch.randn(16, 64, requires_grad=True)
    ref = torch.autograd.grad(model(x).square().sum(), [x, *model.parameters()])
    mgr = ActivationManager(model, _disk_policy(tmp_path))
    with mgr:
        y = model(x).square().sum()
    got = torch.autograd.grad(y, [x, *model.parameters()])
    assert mgr.accounting.peak["disk"] > 0 and mgr.accounting.peak["device"] == 0
    mgr.close()
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    assert sorted(p.name for p in tmp_path.iterdir()) == [other.name]
    assert other.read_bytes() == b"precious"


def _two_rank_worker(rank: int, world_size: int, disk_path: str) -> dict:
    model = _model()
    # different data per rank, so a shared file would hand one rank the other's activations
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(100 + rank), requires_grad=True)
    ref = torch.autograd.grad(model(x).square().sum(), [x, *model.parameters()])
    mgr = ActivationManager(model, _disk_policy(disk_path))
    with mgr:
        y = model(x).square().sum()
    dist.barrier()  # both ranks have written all their saved tensors before either reads
    got = torch.autograd.grad(y, [x, *model.parameters()])
    st = os.fstat(mgr._stores["disk"]._fd)
    file_id = (st.st_dev, st.st_ino)
    disk_peak = mgr.accounting.peak["disk"]
    dist.barrier()
    mgr.close()
    return {"exact": all(torch.equal(a, b) for a, b in zip(got, ref)), "file": file_id, "disk_peak": disk_peak}


def test_two_ranks_same_disk_path_own_files_exact(tmp_path):
    shared = tmp_path / "offload"  # does not exist yet: becomes a directory, not one shared file
    r0, r1 = dist_run(_two_rank_worker, 2, str(shared), timeout=120)
    assert r0["exact"] and r1["exact"]
    assert r0["disk_peak"] > 0 and r1["disk_peak"] > 0
    assert r0["file"] != r1["file"]
    assert shared.is_dir() and list(shared.iterdir()) == []


_CHILD = textwrap.dedent("""
    import signal, sys, time, torch
    from torch import nn
    from moonrt.config import from_dict
    from moonrt.memory.manager import ActivationManager
    from moonrt.memory.policy import MemoryPolicy
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    pol = from_dict(MemoryPolicy, {"default": "disk", "disk_path": sys.argv[1], "disk_capacity_mib": 8})
    mgr = ActivationManager(model, pol)
    with mgr:
        y = model(torch.randn(16, 64, requires_grad=True)).sum()
    assert mgr.accounting.live["disk"] > 0
    # Python's own SIGINT behaviour (KeyboardInterrupt) even when started with SIGINT ignored (shells ignore it in
    # commands they run in the background, and exec keeps that); short sleeps, because the kernel may deliver the
    # signal to another thread (torch's, the manager's) and Python runs the handler only when the main thread checks
    signal.signal(signal.SIGINT, signal.default_int_handler)
    print("ready", flush=True)
    for _ in range(1200):
        time.sleep(0.1)
""")


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL], ids=lambda s: s.name)
def test_no_file_left_after_signal(tmp_path, sig):
    directory = tmp_path / "offload"
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(directory)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.strip() == "ready", proc.stderr.read()
        if Path(f"/proc/{proc.pid}/fd").is_dir():  # the offload file is open and lives in the directory
            assert len(set(_open_files_under(proc.pid, directory))) == 1  # (one descriptor: the store file)
        proc.send_signal(sig)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0
    assert directory.is_dir() and list(directory.iterdir()) == []
