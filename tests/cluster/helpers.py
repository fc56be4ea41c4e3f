"""Helpers of the cluster tests (``from cluster.helpers import ...``; tests/ is on ``sys.path``, so the directory
qualifies the name: a bare ``helpers`` would be any package's).

- Launcher-free environments and the cluster-tool gate: :func:`clean_env`, :func:`cluster_unavailable` (skip where
  a cluster tool is absent, fail under ``MOONRT_REQUIRE_CLUSTER=1``), :func:`require_slurm`.
- Independent check of a ``moonrt selftest --report`` file (launcher, MPI and SLURM tests): the expected collective
  outputs are recomputed here from the definitions of the inputs (not from moonrt code), so a wrong all_reduce or
  all_to_all on any rank fails the calling test (:func:`verify_selftest_report`, :func:`expected_outputs`).
- Ranks that hold their sockets (``HOLD``) and what a process listens on (:func:`listening_sockets`,
  :func:`only_loopback`); processes gone (:func:`_gone`) and polling (:func:`_wait_for`).
- The small preemptible job of ``test_preempt.py`` and ``test_cluster_box.py`` (``STEPS``, :func:`_config`,
  :func:`_train`, :func:`_finish`, :func:`_wait_for_step`, :func:`_assert_same_run`).
"""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from moonrt.jobs.checkpoint import store
from moonrt.jobs.train.resume import BUILDER

N = 8  # elements per rank per peer in moonrt.jobs.selftest.cli.check_collectives

LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID")


def clean_env() -> dict[str, str]:
    """This environment without launcher variables (a test may itself run under torchrun/SLURM/MPI)."""
    return {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS and not k.startswith("SLURM_")}


def cluster_unavailable(reason: str) -> None:
    """Skip with ``reason``; under ``MOONRT_REQUIRE_CLUSTER=1`` (CI) fail instead."""
    if os.environ.get("MOONRT_REQUIRE_CLUSTER") == "1":
        pytest.fail(f"MOONRT_REQUIRE_CLUSTER=1 but {reason}", pytrace=False)
    pytest.skip(reason)


def require_slurm(*tools: str) -> None:
    """A SLURM that can take a step: the ``tools`` on PATH and a usable node; otherwise :func:`cluster_unavailable`
    with the reason."""
    for tool in tools:
        if shutil.which(tool) is None:
            cluster_unavailable(f"SLURM command {tool!r} not found (start one with .ci/slurm-ci.sh)")
    try:
        res = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        cluster_unavailable("sinfo did not answer in 30 s (slurmctld down?)")
    if res.returncode != 0 or not any(s.rstrip("*~#") in ("idle", "mix", "alloc") for s in res.stdout.split()):
        cluster_unavailable(f"no usable SLURM node (sinfo: {res.stdout.strip() or res.stderr.strip()!r})")


def expected_outputs(rank: int, world: int) -> dict[str, list[float]]:
    i = list(range(N))
    return {
        "all_reduce": [world * (world + 1) / 2 * (k + 1) for k in i],
        "all_to_all": [1000 * s + 10 * rank + k for s in range(world) for k in i],
        "all_gather": [100 * s + k for s in range(world) for k in i],
        "ring": [7 * ((rank - 1) % world) + k for k in i],
    }


def verify_selftest_report(path: Path, world: int, source: str) -> dict:
    """Assert the report covers ``world`` ranks that all joined via ``source`` and got the right results."""
    report = json.loads(Path(path).read_text())
    assert report["world_size"] == world
    assert report["passed"] is True
    assert [r["source"] for r in report["ranks"]] == [source] * world
    for rank, rep in enumerate(report["ranks"]):
        assert rep["outputs"] == expected_outputs(rank, world), f"rank {rank}"
    assert {row["op"] for row in report["bandwidth"]} == {"all_reduce", "all_to_all", "all_gather", "ring"}
    assert all(row["time_s"] > 0 and row["busbw_GBps"] >= 0 for row in report["bandwidth"])
    return report


# Every rank joins, talks once, reports its pid, and holds its sockets open until the test is done looking.
HOLD = textwrap.dedent("""
    import os, sys, time
    import torch, torch.distributed as dist
    from moonrt.cluster.env import init_distributed
    r = init_distributed()
    x = torch.ones(2)
    dist.all_reduce(x)
    print("READY", os.getpid(), r.master_addr, r.master_port, flush=True)
    deadline = time.monotonic() + 120
    while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:
        time.sleep(0.05)
    dist.barrier()
    dist.destroy_process_group()
""")


def listening_sockets(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket in LISTEN state that process ``pid`` holds (from /proc)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    found = []
    for table in ("tcp", "tcp6"):
        for line in open(f"/proc/{pid}/net/{table}").read().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A" or fields[9] not in inodes:  # 0A: TCP_LISTEN
                continue
            hex_addr, hex_port = fields[1].split(":")
            raw = bytes.fromhex(hex_addr)  # /proc prints each 32-bit word in host (little-endian) order
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            found.append((str(ipaddress.ip_address(raw)), int(hex_port, 16)))
    return found


def only_loopback(sockets: dict[int, list[tuple[str, int]]], store_port: int) -> None:
    """Assert that the rendezvous store (``store_port``) is among ``sockets`` (pid -> listening (address,
    port)) and that none of them is bound to a non-loopback address (a wildcard counts as non-loopback)."""
    listening = [s for socks in sockets.values() for s in socks]
    assert any(p == store_port for _, p in listening), sockets

    def loopback(addr: str) -> bool:
        ip = ipaddress.ip_address(addr)
        return (getattr(ip, "ipv4_mapped", None) or ip).is_loopback

    exposed = [s for s in listening if not loopback(s[0])]
    assert not exposed, f"listening beyond loopback: {exposed} (all: {sockets})"


def _gone(pid: int) -> bool:
    """``pid`` no longer runs (absent, or a zombie nobody has reaped yet)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False
    return stat[stat.rindex(")") + 2] in "ZX"


def _wait_for(predicate, deadline_s: float = 120.0, what: str = "condition") -> None:
    deadline = time.monotonic() + deadline_s
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} not reached within {deadline_s:g} s")
        time.sleep(0.1)


# ---- the preemptible job (test_preempt.py, test_cluster_box.py) ------------------------------------------------

STEPS = 8
MOONRT = [sys.executable, "-m", "moonrt.cli"]


def _config(directory: Path) -> Path:
    """A small job: k3_tiny on a synthetic corpus, 2 x 16 tokens per step, eval only after the last step."""
    corpus = directory / "corpus.txt"
    corpus.write_text("".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(400)))
    cfg = directory / "job.yaml"
    cfg.write_text(f"data:\n  corpus: {corpus}\noptim:\n  steps: {STEPS}\n  batch_size: 2\n  seq_len: 16\n"
                   "  lr: 1.0e-3\n  warmup_steps: 2\n  eval_every: 1000\n  eval_windows: 4\n  checkpoint_every: 1000\n")
    return cfg


def _train(cfg: Path, run: Path, *extra: str) -> list[str]:
    return ["train", "--config", str(cfg), "--out", str(run / "out"), "--metrics", str(run / "metrics.jsonl"),
            "--no-progress", *extra]


def _finish(proc: subprocess.Popen, timeout: float = 240) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{proc.args} still running after {timeout} s:\n{out[-4000:]}")
    return proc.returncode, out


def _records(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    return [json.loads(line) for line in lines if line.endswith("}")]


def _wait_for_step(run: Path, step: int, alive: Callable[[], bool], timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not (_records(run) and _records(run)[-1]["step"] >= step):
        assert alive(), f"the job ended before step {step}"
        assert time.monotonic() < deadline, f"no step {step} in {run / 'metrics.jsonl'} after {timeout} s"
        time.sleep(0.05)


def _assert_same_run(run: Path, ref: Path) -> None:
    """The same steps with bit-identical losses, gradient norms, parameters and optimizer state."""
    got, want = _records(run), _records(ref)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1)) == [r["step"] for r in want]
    assert [(r["loss"], r["grad_norm"]) for r in got] == [(r["loss"], r["grad_norm"]) for r in want]
    a, b = (store.read_state(p / "out", BUILDER) for p in (run, ref))  # 2 ranks: sharded, gathered here
    assert a["step"] == b["step"] == STEPS
    for key in ("model", "optimizer"):
        flat_a, flat_b = _tensors(a[key]), _tensors(b[key])
        assert flat_a.keys() == flat_b.keys()
        for name, t in flat_a.items():
            assert torch.equal(t, flat_b[name]), f"{key}.{name}"


def _tensors(tree: object, prefix: str = "") -> dict[str, torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return {prefix: tree}
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, list) else ()
    return {k: v for key, value in items for k, v in _tensors(value, f"{prefix}.{key}").items()}
