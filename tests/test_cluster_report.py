"""Independent check of a ``moonrt selftest --report`` file, shared by the launcher, MPI and SLURM tests.

The expected collective outputs are recomputed here from the definitions of the inputs (not from
moonrt code), so a wrong all_reduce or all_to_all on any rank fails the calling test. Also holds
:func:`cluster_unavailable`: skip where a cluster tool is absent, fail under MOONRT_REQUIRE_CLUSTER=1.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

N = 8  # elements per rank per peer in moonrt.cluster.selftest.check_collectives

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
