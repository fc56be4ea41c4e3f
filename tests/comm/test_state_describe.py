"""``moonrt.comm.state.describe``: the generic gather / scatter over a part's description of its checkpoint state, on
2 real gloo ranks.

A part that shards the rows of a ``Linear`` weight over 2 ranks (as expert parallelism shards ``[E, ...]``) says
only which rows each rank holds (:meth:`Part.describe`). After one AdamW step on each rank's rows of one gradient,
:func:`gather_full_state` is bit for bit the unsharded model's ``state_dict`` and ``optimizer.state_dict`` after the
same step (AdamW is elementwise, so the rows' arithmetic is the same); :func:`scatter_full_state` of it into fresh
sharded objects gives the same pieces back; a description that leaves rows to no rank is refused on every rank, and
a state of another shape is refused before anything is loaded.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from dist import dist_run
from jobs.helpers import _equal
from torch import nn

from moonrt.comm.parallelism import Parallelism, Part
from moonrt.comm.state.describe import StateDescription, gather_full_state, scatter_full_state


class RowShard(Part):
    """Rank ``r`` of 2 holds rows ``[3r, 3r + 3)`` of ``weight [6, 4]`` (``first``: where its rows start)."""

    def __init__(self, rank: int, first: int | None = None) -> None:
        self.rank, self.first = rank, 3 * rank if first is None else first

    def parallelize(self, model: nn.Module) -> nn.Module:
        model.weight = nn.Parameter(model.weight.detach()[3 * self.rank:3 * self.rank + 3].clone())
        return model

    def describe(self, model: nn.Module, optim: torch.optim.Optimizer, desc: StateDescription) -> StateDescription:
        desc.shards[id(model.weight)] = ((6, 4), self.first)
        return desc


def _stepped(rank: int, part: RowShard | None) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(4, 6)
    if part is not None:
        model = part.parallelize(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    grads = torch.Generator().manual_seed(1)
    gw, gb = torch.randn(6, 4, generator=grads), torch.randn(6, generator=grads)
    model.weight.grad = gw if part is None else gw[3 * rank:3 * rank + 3].clone()
    model.bias.grad = gb
    opt.step()
    return model, opt


def _gather_scatter(rank: int, world: int) -> dict[str, Any]:
    ref, ref_opt = _stepped(rank, None)
    rt = Parallelism(parts=[RowShard(rank)])
    model, opt = _stepped(rank, rt.parts[0])
    full = rt.full_state_dict(model, opt)
    want = {"model": ref.state_dict(), "optimizer": ref_opt.state_dict()}

    torch.manual_seed(5)
    fresh = RowShard(rank)
    model2 = fresh.parallelize(nn.Linear(4, 6))
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1.0)
    bad = {"model": {**full["model"], "weight": full["model"]["weight"][:3]}, "optimizer": full["optimizer"]}
    with pytest.raises(ValueError, match=r"checkpoint weight: shape \(3, 4\), expected \(6, 4\)"):
        scatter_full_state(fresh.state_description(model2, opt2), bad)
    assert not opt2.state and opt2.param_groups[0]["lr"] == 1.0  # refused: nothing loaded
    scatter_full_state(fresh.state_description(model2, opt2), full)
    again = gather_full_state(fresh.state_description(model2, opt2))

    desc = RowShard(rank, first=0).state_description(model, opt)  # both ranks claim rows [0, 3): rows 3-5 of none
    with pytest.raises(ValueError, match=r"state entry 'model.weight': the ranks hold 12 of its 24 elements"):
        gather_full_state(desc)
    scatter_full_state(rt.describe(model, opt), full)  # a load of the gathered state leaves every piece as it was
    return {"full": full, "want": want, "again": again, "lr": opt2.param_groups[0]["lr"],
            "rows": model2.weight.detach().clone(), "moment": opt2.state[model2.weight]["exp_avg"].clone(),
            "mine": model.weight.detach().clone(), "my_moment": opt.state[model.weight]["exp_avg"].clone()}




@pytest.mark.timeout(300)
def test_gather_and_scatter_of_a_row_sharded_description_are_the_unsharded_state() -> None:
    got = dist_run(_gather_scatter, 2, timeout=240)
    for rank, r in enumerate(got):
        _equal(r["full"], r["want"], f"rank {rank} gathered")
        _equal(r["again"], r["want"], f"rank {rank} scattered and gathered again")
        assert r["lr"] == 1e-2  # the saved hyperparameters
        rows = slice(3 * rank, 3 * rank + 3)
        assert torch.equal(r["rows"], r["want"]["model"]["weight"][rows]), rank
        assert torch.equal(r["moment"], r["want"]["optimizer"]["state"][0]["exp_avg"][rows]), rank
        assert torch.equal(r["mine"], r["rows"]) and torch.equal(r["my_moment"], r["moment"]), rank
