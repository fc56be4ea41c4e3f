"""ProcessMesh on real gloo ranks: every group's members and reductions match the documented layout.

One ``dist_run`` per world size loops over every factorization (rank start-up dominates the cost);
each mesh is destroyed before the next is built.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
from dist import dist_run

from moonrt.comm.mesh import GROUP_NAMES, MeshLayout, ProcessMesh
from moonrt.config import ConfigError, ParallelConfig


def factorizations(n: int) -> list[tuple[int, int, int, int]]:
    return [f for f in itertools.product(range(1, n + 1), repeat=4) if f[0] * f[1] * f[2] * f[3] == n]


def _check_all_meshes(rank: int, world: int) -> list[tuple]:
    """For every (dp, pp, ep, cp): members, index and an all_reduce per group; returns what was checked."""
    checked = []
    for dp, pp, ep, cp in factorizations(world):
        par = ParallelConfig(dp=dp, pp=pp, ep=ep, cp=cp)
        mesh = ProcessMesh(par, timeout_s=60)
        c = mesh.coords
        # documented order: rank = ((pp_i * dp + dp_i) * ep + ep_i) * cp + cp_i
        assert rank == ((c["pp"] * dp + c["dp"]) * ep + c["ep"]) * cp + c["cp"], (par, c)
        sizes = {"pp": pp, "dp": dp, "ep": ep, "cp": cp}
        for name in GROUP_NAMES:
            dims = name.split("_")
            # documented members, enumerated independently of MeshLayout: vary the named dims only
            expected = sorted(
                ((c2["pp"] * dp + c2["dp"]) * ep + c2["ep"]) * cp + c2["cp"]
                for idx in itertools.product(*(range(sizes[d]) for d in dims))
                for c2 in [{**c, **dict(zip(dims, idx))}]
            )
            group = mesh.group(name)
            assert mesh.ranks(name) == expected, (par, name)
            assert dist.get_world_size(group) == len(expected) == mesh.size(name), (par, name)
            assert dist.get_rank(group) == expected.index(rank) == mesh.rank(name), (par, name)
            # the reduction sums over exactly these members: distinct powers of two identify them
            x = torch.tensor([float(1 << rank)], dtype=torch.float64)
            dist.all_reduce(x, group=group)
            assert int(x.item()) == sum(1 << m for m in expected), (par, name, x.item(), expected)
            checked.append((dp, pp, ep, cp, name, tuple(expected)))
        mesh.destroy()
    return checked


@pytest.mark.parametrize("world", [4, 8])
def test_every_factorization_on_real_ranks(world):
    results = dist_run(_check_all_meshes, world, timeout=240)
    # every rank checked every (factorization, group); members agree with the pure layout
    n_fact = len(factorizations(world))
    for rank, checked in enumerate(results):
        assert len(checked) == n_fact * len(GROUP_NAMES)
        for dp, pp, ep, cp, name, members in checked:
            layout = MeshLayout(world, ParallelConfig(dp=dp, pp=pp, ep=ep, cp=cp))
            assert list(members) == layout.group_ranks(name, rank)


def _wrong_degrees(rank: int, world: int) -> str:
    try:
        ProcessMesh(ParallelConfig(dp=2, ep=2))
    except ConfigError as exc:
        return str(exc)
    return "no error"


def _destroyed(rank: int, world: int) -> str:
    mesh = ProcessMesh(ParallelConfig(dp=world))
    mesh.destroy()
    try:
        mesh.group("dp")
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def _timeouts(rank: int, world: int) -> list[float]:
    def seconds(group) -> float:
        return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()

    inherited = ProcessMesh(ParallelConfig(pp=world))
    explicit = ProcessMesh(ParallelConfig(pp=world), timeout_s=17)
    out = [seconds(dist.group.WORLD), seconds(inherited.group("dp")), seconds(explicit.group("dp"))]
    inherited.destroy()
    explicit.destroy()
    return out


def test_mesh_groups_inherit_the_job_timeout():
    # dist_run initializes the job with collective timeout 45 s; torch's own default would be 1800 s
    for world_s, inherited_s, explicit_s in dist_run(_timeouts, 2, timeout=60, collective_timeout_s=45):
        assert (world_s, inherited_s, explicit_s) == (45, 45, 17)


def test_wrong_degrees_on_real_ranks():
    msgs = dist_run(_wrong_degrees, 2, timeout=60)
    assert all("= 4: expected the degrees to multiply to the world size 2" in m for m in msgs), msgs


def test_destroyed_mesh_is_unusable():
    msgs = dist_run(_destroyed, 2, timeout=60)
    assert all("destroyed" in m for m in msgs), msgs


def _cpu_groups(rank: int, world: int) -> dict:
    """The CPU groups of a pp 2 x dp 2 mesh on a gloo job, and as an NCCL job builds them (``default_backend``
    reporting nccl: the mesh makes gloo groups of its own)."""
    import moonrt.comm.mesh as mesh_mod

    out = {}
    gloo = ProcessMesh(ParallelConfig(pp=2, dp=2))
    out["gloo"] = (gloo.cpu_group() is dist.group.WORLD, gloo.cpu_group("pp") is gloo.group("pp"))
    try:
        gloo.cpu_group("cp")
    except ConfigError as exc:
        out["ep"] = str(exc)
    gloo.destroy()
    real, mesh_mod.default_backend = mesh_mod.default_backend, lambda: "nccl"
    try:
        nccl = ProcessMesh(ParallelConfig(pp=2, dp=2))
    finally:
        mesh_mod.default_backend = real
    world_cpu, pp_cpu = nccl.cpu_group(), nccl.cpu_group("pp")
    mine = [1 << rank]
    rows: list = [None] * dist.get_world_size(pp_cpu)
    dist.all_gather_object(rows, mine, group=pp_cpu)
    out["nccl"] = (world_cpu is not dist.group.WORLD, pp_cpu is not nccl.group("pp"), dist.get_backend(world_cpu),
                   dist.get_backend(pp_cpu), dist.get_process_group_ranks(world_cpu),
                   dist.get_process_group_ranks(pp_cpu), sum(r[0] for r in rows))
    nccl.destroy()
    return out


@pytest.mark.slow
def test_the_mesh_owns_cpu_groups_only_where_the_default_backend_is_not_gloo():
    """On gloo the CPU groups are the default group and the pp group themselves; as an NCCL job the mesh makes gloo
    groups over the world and over each pipeline, and objects travel over them; a group without one is refused."""
    for rank, got in enumerate(dist_run(_cpu_groups, 4, timeout=120)):
        assert got["gloo"] == (True, True)
        assert "cpu_group('cp')" in got["ep"] and "expected one of pp, ep" in got["ep"]
        pp_members = MeshLayout(4, ParallelConfig(pp=2, dp=2)).group_ranks("pp", rank)
        assert got["nccl"] == (True, True, "gloo", "gloo", [0, 1, 2, 3], pp_members, sum(1 << m for m in pp_members))
