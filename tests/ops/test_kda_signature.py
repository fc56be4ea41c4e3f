"""KDA op signatures (issue 28, defect 12): options after the tensors are keyword-only, chunk_size is validated.

fla's ``chunk_kda(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, ...)`` takes
a flag as its 9th positional argument where moonrt's ``kda_chunk`` took ``chunk_size``: the peer-style call
``kda_chunk(q, k, v, g, beta, None, h0, True, True)`` ran with 1-token chunks (``True == 1``) and no error.
"""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch
from dist import dist_run
from numerics import rel_l2

from moonrt.comm.cp.context import ContextParallel
from moonrt.comm.cp.ops import slice_bounds
from moonrt.comm.cp.kcp import kcp_kda
from moonrt.ops.kda import kda_chunk, kda_recurrent, kda_state_grad, kda_transition
from moonrt.ops.kda.autograd import chunk_state_grad
from moonrt.ops.kda.terms import chunk_terms, chunk_terms_with_factors
from moonrt.parallel.context import AttentionContext


def _inputs(T: int = 40, seed: int = 0, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    B, H, K, V = 1, 2, 8, 4
    q = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen)
    g = -5.0 * torch.sigmoid(torch.randn(B, T, H, K, generator=gen) - 1.0)
    beta = torch.sigmoid(torch.randn(B, T, H, generator=gen))
    h0 = torch.randn(B, H, K, V, generator=gen)
    return {n: t.to(dtype) for n, t in dict(q=q, k=k, v=v, g=g, beta=beta, h0=h0).items()}


def test_fla_positional_probe_raises() -> None:
    """The probe's exact call: fla's 9th positional argument (use_qk_l2norm_in_kernel=True) must not become
    chunk_size=1; nothing after the five tensors is accepted positionally."""
    x = _inputs()
    q, k, v, g, beta, h0 = (x[n] for n in ("q", "k", "v", "g", "beta", "h0"))
    with pytest.raises(TypeError, match="positional"):
        kda_chunk(q, k, v, g, beta, None, h0, True, True)
    with pytest.raises(TypeError, match="positional"):
        kda_recurrent(q, k, v, g, beta, None, h0, True, True)
    with pytest.raises(TypeError, match="positional"):
        kda_chunk(q, k, v, g, beta, None)  # even the scale: fla's order is not ours to guess


# (function, number of leading positional parameters: the required tensors / group; self counted for methods)
PUBLIC = [
    (kda_chunk, 5),
    (kda_recurrent, 5),
    (kda_state_grad, 6),  # q, k, v, g, beta, d_o
    (kda_transition, 4),  # k, v, g, beta
    (kcp_kda, 6),  # q, k, v, g, beta, group
    (AttentionContext.kda, 6),  # self, q, k, v, g, beta
    (ContextParallel.kda, 6),
    (chunk_terms, 4),  # k, v, g, beta (chunk-major)
    (chunk_terms_with_factors, 4),
    (chunk_state_grad, 6),  # q, k, g, beta, dO, d_final (chunk-major, all required)
]


@pytest.mark.parametrize(("fn", "n_pos"), PUBLIC, ids=[f.__qualname__ for f, _ in PUBLIC])
def test_options_are_keyword_only(fn: object, n_pos: int) -> None:
    params = list(inspect.signature(fn).parameters.values())  # type: ignore[arg-type]
    kinds = [p.kind for p in params]
    assert kinds[:n_pos] == [inspect.Parameter.POSITIONAL_OR_KEYWORD] * n_pos, fn
    assert all(p.default is inspect.Parameter.empty for p in params[:n_pos]), fn
    assert all(kind == inspect.Parameter.KEYWORD_ONLY for kind in kinds[n_pos:]), \
        [p.name for p in params[n_pos:] if p.kind != inspect.Parameter.KEYWORD_ONLY]


BAD_CHUNK = [
    (True, TypeError, "chunk_size = True: expected an integer, not a bool"),
    (False, TypeError, "chunk_size = False: expected an integer, not a bool"),
    (16.0, TypeError, "chunk_size = 16.0: expected an integer"),
    ("64", TypeError, "chunk_size = '64': expected an integer"),
    (None, TypeError, "chunk_size = None: expected an integer"),
    (0, ValueError, "chunk_size = 0: expected an integer >= 1"),
    (-32, ValueError, "chunk_size = -32: expected an integer >= 1"),
    (40, ValueError, "chunk_size = 40: expected <= 32 or a multiple of 32"),
]


@pytest.mark.parametrize(("value", "exc", "msg"), BAD_CHUNK, ids=[repr(b[0]) for b in BAD_CHUNK])
@pytest.mark.parametrize("op", ["kda_chunk", "kda_chunk_varlen", "kda_state_grad", "kda_transition"])
def test_bad_chunk_size_is_rejected(op: str, value: object, exc: type[Exception], msg: str) -> None:
    x = _inputs()
    t5 = [x[n] for n in ("q", "k", "v", "g", "beta")]
    with pytest.raises(exc) as info:
        if op == "kda_chunk":
            kda_chunk(*t5, chunk_size=value)  # type: ignore[arg-type]
        elif op == "kda_chunk_varlen":
            kda_chunk(*t5, chunk_size=value, cu_seqlens=torch.tensor([0, 13, 40]))  # type: ignore[arg-type]
        elif op == "kda_state_grad":
            kda_state_grad(*t5, torch.ones_like(x["v"]), chunk_size=value)  # type: ignore[arg-type]
        else:
            kda_transition(*t5[1:], chunk_size=value)  # type: ignore[arg-type]
    assert str(info.value) == msg


def test_keyword_calls_unchanged() -> None:
    """Keyword calls give the results they gave before: the chunk form equals the recurrence (fp64, 1e-12) for
    several chunk sizes (an integer-like numpy chunk size too), with and without packed sequences."""
    x = _inputs(T=77, seed=3, dtype=torch.float64)
    t5 = [x[n] for n in ("q", "k", "v", "g", "beta")]
    o_r, s_r = kda_recurrent(*t5, scale=0.3, initial_state=x["h0"], output_final_state=True)
    for C in (64, 32, 16, 5, 1, np.int64(96)):
        o, s = kda_chunk(*t5, scale=0.3, initial_state=x["h0"], output_final_state=True, chunk_size=C)
        assert rel_l2(o, o_r) < 1e-12 and rel_l2(s, s_r) < 1e-12, C
    o, s = AttentionContext().kda(*t5, scale=0.3, initial_state=x["h0"], output_final_state=True)
    assert rel_l2(o, o_r) < 1e-12 and rel_l2(s, s_r) < 1e-12
    cu = torch.tensor([0, 30, 77])
    o, s = kda_chunk(*t5, scale=0.3, output_final_state=True, chunk_size=16, cu_seqlens=cu)
    for i, (a, b) in enumerate(((0, 30), (30, 77))):
        o_i, s_i = kda_recurrent(*(t[:, a:b] for t in t5), scale=0.3, output_final_state=True)
        assert rel_l2(o[:, a:b], o_i) < 1e-12 and rel_l2(s[i : i + 1], s_i) < 1e-12
    # the state-only gradient and the segment transition, keyword options
    d_o = torch.randn_like(x["v"])
    dS = kda_state_grad(*t5, d_o, d_final=torch.ones_like(x["h0"]), scale=0.3, chunk_size=32)
    h0 = x["h0"].clone().requires_grad_(True)
    o2, s2 = kda_recurrent(*t5, scale=0.3, initial_state=h0, output_final_state=True)
    ((o2 * d_o).sum() + s2.sum()).backward()
    assert rel_l2(dS, h0.grad) < 1e-10
    M, S_ext = kda_transition(*t5[1:], chunk_size=32)
    assert rel_l2(M @ x["h0"] + S_ext, s_r) < 1e-12


def _kcp_bad_chunk_rank(rank: int, world: int) -> list[str]:
    """chunk_size=True on rank 1 only: every rank raises a ValueError naming chunk_size (no hang)."""
    x = _inputs(T=64)
    a, b = slice_bounds(64, world, rank)
    args = {n: x[n][:, a:b] for n in ("q", "k", "v", "g", "beta")}
    msgs = []
    for bad in (True, 40):
        try:
            kcp_kda(**args, group=None, chunk_size=bad if rank == 1 else 64)
        except ValueError as exc:
            msgs.append(str(exc))
        else:
            msgs.append("<no error>")
    o, _ = kcp_kda(**args, group=None)  # the group is still usable
    ref, _ = kda_chunk(*(x[n] for n in ("q", "k", "v", "g", "beta")))
    msgs.append(f"{rel_l2(o, ref[:, a:b]):.1e}")
    return msgs


def test_kcp_bad_chunk_size_is_rejected_on_every_rank() -> None:
    good, bad = dist_run(_kcp_bad_chunk_rank, 2, timeout=120.0)
    assert "chunk_size = True: expected an integer, not a bool" in bad[0], bad
    assert "chunk_size = 40: expected <= 32 or a multiple of 32" in bad[1], bad
    assert all("CP rank(s) [1] of 2 received invalid input" in m for m in good[:2]), good
    assert float(good[2]) <= 1e-5 and float(bad[2]) <= 1e-5, (good, bad)
