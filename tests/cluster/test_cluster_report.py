"""Independent check of a ``moonrt selftest --report`` file, shared by the launcher, MPI and SLURM tests.

The expected collective outputs are recomputed here from the definitions of the inputs (not from
moonrt code), so a wrong all_reduce or all_to_all on any rank fails the calling test. Also holds
:func:`cluster_unavailable`: skip where a cluster tool is absent, fail under MOONRT_REQUIRE_CLUSTER=1.
"""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest

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


def test_expected_outputs_catch_a_wrong_result(tmp_path):
    """The checker itself must reject a report whose all_to_all is off on one rank."""
    world = 2
    report = {"world_size": world, "passed": True, "bandwidth": [],
              "ranks": [{"source": "mpi", "outputs": expected_outputs(r, world)} for r in range(world)]}
    report["ranks"][1]["outputs"]["all_to_all"][3] += 1
    path = tmp_path / "r.json"
    path.write_text(json.dumps(report))
    with pytest.raises(AssertionError, match="rank 1"):
        verify_selftest_report(path, world, "mpi")


def test_cluster_unavailable_skips_or_fails(monkeypatch):
    monkeypatch.delenv("MOONRT_REQUIRE_CLUSTER", raising=False)
    with pytest.raises(pytest.skip.Exception, match="no srun here"):
        cluster_unavailable("no srun here")
    monkeypatch.setenv("MOONRT_REQUIRE_CLUSTER", "1")
    with pytest.raises(pytest.fail.Exception, match="MOONRT_REQUIRE_CLUSTER=1 but no srun here"):
        cluster_unavailable("no srun here")


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
