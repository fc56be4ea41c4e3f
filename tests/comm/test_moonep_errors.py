"""Bad input to MoonEP dispatch on one rank: a clear ValueError on every rank, no hang, no corrupted state."""

from __future__ import annotations

import pytest
import torch
from dist import dist_run

from moonrt.comm.ep.dispatch import EPDispatcher
from moonrt.comm.ep.placement import MoonEPPlacement

H, E, K, S = 8, 8, 2, 4


def _rank_fn(rank: int, world: int, cases: list[str]) -> list[tuple[str, int]]:
    return [_one_case(rank, case) for case in cases]


def _one_case(rank: int, case: str) -> tuple[str, int]:
    g = torch.Generator().manual_seed(rank)
    disp = EPDispatcher(None, capacity=S, hidden=H, top_k=K, num_experts=E, placement=MoonEPPlacement())
    x = torch.randn(S, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(S)])
    w = torch.full((S, K), 0.5)
    bad_x, bad_ids, bad_w = x, ids.clone(), w
    if rank == 1:
        if case == "out_of_range":
            bad_ids[2, 1] = E
        elif case == "negative":
            bad_ids[0, 0] = -1
        elif case == "too_many_tokens":
            bad_x = torch.randn(S + 1, H, generator=g)
            bad_ids = torch.cat([ids, ids[:1]])
            bad_w = torch.cat([w, w[:1]])
        elif case == "wrong_dtype":
            bad_ids = ids.to(torch.int32)
    try:
        disp.dispatch(bad_x, bad_ids, bad_w)
        message = ""
    except ValueError as exc:
        message = str(exc)
    # The dispatcher is still usable after the error (same collectives on every rank).
    recv_x, _, _, handle = disp.dispatch(x, ids, w)
    out = disp.combine(recv_x, handle, weighted=False)
    assert torch.allclose(out, x * K, rtol=1e-6, atol=1e-6)
    return message, handle.rows


CASES = {
    "out_of_range": "out of range, expected expert ids in [0, 8)",
    "negative": "value -1 out of range",
    "too_many_tokens": "s = 5 tokens, expected s <= capacity = 4",
    "wrong_dtype": "topk_ids: shape (4, 2) dtype torch.int32, expected int64",
}


def test_bad_input_fails_on_every_rank() -> None:
    """Rank 1 passes bad input; both ranks raise (rank 0 names rank 1), then both dispatch fine."""
    res0, res1 = dist_run(_rank_fn, 2, list(CASES), timeout=60)
    for (case, needle), (msg0, rows0), (msg1, rows1) in zip(CASES.items(), res0, res1):
        assert needle in msg1, (case, msg1)
        assert "EP rank 1 passed invalid input" in msg0, (case, msg0)
        assert rows0 == rows1 == S * K


def test_constructor_errors() -> None:
    with pytest.raises(ValueError, match="capacity = 0"):
        EPDispatcher(None, capacity=0, hidden=H, top_k=K, num_experts=E, placement=MoonEPPlacement())
    with pytest.raises(ValueError, match="top_k = 9"):
        EPDispatcher(None, capacity=S, hidden=H, top_k=9, num_experts=E, placement=MoonEPPlacement())
    with pytest.raises(ValueError, match="num_slots = -1"):
        EPDispatcher(None, capacity=S, hidden=H, top_k=K, num_experts=E,
                     placement=MoonEPPlacement(num_slots=-1))
