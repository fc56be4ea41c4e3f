"""The shared cluster-test checks of ``tests/cluster/helpers.py`` can fail: the independent check of a ``moonrt
selftest --report`` file (used by the launcher, MPI and SLURM tests; expected collective outputs recomputed from
the definitions of the inputs, not from moonrt code) rejects a wrong all_to_all on one rank, and
:func:`cluster_unavailable` skips, or fails under MOONRT_REQUIRE_CLUSTER=1.
"""

from __future__ import annotations

import json

import pytest
from cluster.helpers import cluster_unavailable, expected_outputs, verify_selftest_report


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


