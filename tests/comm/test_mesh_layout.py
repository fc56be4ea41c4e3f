"""Pure rank arithmetic of the mesh (no processes)."""

from __future__ import annotations

import itertools

import pytest

from moonrt.comm.mesh import GROUP_NAMES, MeshLayout
from moonrt.config import ConfigError, ParallelConfig


def factorizations(n: int):
    for dp, pp, ep, cp in itertools.product(range(1, n + 1), repeat=4):
        if dp * pp * ep * cp == n:
            yield ParallelConfig(dp=dp, pp=pp, ep=ep, cp=cp)


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_every_factorization(world):
    for par in factorizations(world):
        layout = MeshLayout(world, par)
        for r in range(world):
            c = layout.coords(r)
            # documented order: rank = ((pp * dp + dp_i) * ep + ep_i) * cp + cp_i
            assert r == ((c["pp"] * par.dp + c["dp"]) * par.ep + c["ep"]) * par.cp + c["cp"]
            for name in GROUP_NAMES:
                members = layout.group_ranks(name, r)
                dims = set(name.split("_"))
                assert len(members) == layout.group_size(name)
                assert r in members
                for m in members:
                    cm = layout.coords(m)
                    assert all(cm[d] == c[d] for d in c if d not in dims)
        for name in GROUP_NAMES:
            groups = layout.all_groups(name)
            assert sorted(x for g in groups for x in g) == list(range(world))


def test_wrong_degrees():
    with pytest.raises(ConfigError, match=r"multiply to the world size 8"):
        MeshLayout(8, ParallelConfig(dp=2, ep=2))


def test_bad_group_name():
    with pytest.raises(ConfigError, match=r"group = 'tp': expected one of"):
        MeshLayout(2, ParallelConfig(dp=2)).group_ranks("tp", 0)
