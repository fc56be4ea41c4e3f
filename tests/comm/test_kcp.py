"""KCP (K3_SYSTEMS §7): kcp_kda on 2 and 4 gloo ranks equals single-process kda_chunk, outputs and every gradient."""

from __future__ import annotations

import pytest
import torch
from dist import dist_run
from numerics import rel_l2

from moonrt.comm.cp.kcp import kcp_kda
from moonrt.comm.cp.ops import CommRecord, slice_bounds, split_sizes
from moonrt.ops.kda import kda_chunk

B, H, K, V = 1, 2, 16, 24  # K != V catches transposed state maps
TS = (256, 1000, 4096)


def _inputs(T: int, seed: int, init: bool, long_memory: bool = True) -> dict[str, torch.Tensor]:
    """Seeded global inputs. ``long_memory``: decay and write strength scaled so that a state survives a
    whole slice (per-token ``|g| ~ 1/T``, ``beta ~ K/T``); otherwise K3's gate range (-5, 0), where the
    state of one slice barely reaches the next one and the cross-rank chain would go untested."""
    gen = torch.Generator().manual_seed(seed)
    rn = lambda *s: torch.randn(*s, generator=gen)
    q = torch.nn.functional.normalize(rn(B, T, H, K), dim=-1)
    k = torch.nn.functional.normalize(rn(B, T, H, K), dim=-1)
    if long_memory:
        g = -torch.rand(B, T, H, K, generator=gen) / T
        beta = torch.rand(B, T, H, generator=gen) * (K / T)
    else:
        g = -5.0 * torch.sigmoid(rn(B, T, H, K) - 1.0)  # K3's lower-bounded decay, (-5, 0)
        beta = torch.sigmoid(rn(B, T, H))
    return {
        "q": q, "k": k, "v": rn(B, T, H, V), "g": g, "beta": beta,
        "h0": 0.5 * rn(B, H, K, V) if init else None,
        "do": rn(B, T, H, V), "ds": rn(B, H, K, V),
    }


def _reference(x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    leaves = {n: x[n].clone().requires_grad_(True) for n in ("q", "k", "v", "g", "beta")}
    h0 = x["h0"].clone().requires_grad_(True) if x["h0"] is not None else None
    o, s = kda_chunk(**leaves, initial_state=h0, output_final_state=True)
    ((o * x["do"]).sum() + (s * x["ds"]).sum()).backward()
    out = {"o": o.detach(), "s": s.detach(), **{f"d{n}": t.grad for n, t in leaves.items()}}
    if h0 is not None:
        out["dh0"] = h0.grad
    return out


def _kcp_rank(rank: int, world: int, cases: list[tuple[int, bool, dict]], chunk_fn: object = None) -> list[dict]:
    results = []
    for T, init, x in cases:
        a, b = slice_bounds(T, world, rank)
        leaves = {n: x[n][:, a:b].clone().requires_grad_(True) for n in ("q", "k", "v", "g", "beta")}
        h0 = x["h0"].clone().requires_grad_(True) if init and rank == 0 else None
        rec = CommRecord(op="kcp", layer="test")
        o, s = kcp_kda(**leaves, group=None, initial_state=h0, output_final_state=True, record=rec,
                       chunk_fn=chunk_fn)
        loss = (o * x["do"][:, a:b]).sum()
        if rank == world - 1:
            loss = loss + (s * x["ds"]).sum()
        else:
            assert s is None
        loss.backward()
        out = {"o": o.detach(), "s": s.detach() if s is not None else None,
               **{f"d{n}": t.grad for n, t in leaves.items()}, "bytes": rec}
        if h0 is not None:
            out["dh0"] = h0.grad
        results.append(out)
    return results



@pytest.mark.parametrize("world", [2, 4])
def test_kcp_matches_single_process_outputs_state_and_all_gradients(world: int) -> None:
    cases = [(T, init, _inputs(T, seed=T + world, init=init, long_memory=lm))
             for T in TS for init, lm in ((True, True), (False, True), (True, False))]
    got = dist_run(_kcp_rank, world, cases, timeout=240)
    for i, (T, init, x) in enumerate(cases):
        lm = i % 3 != 2
        ref = _reference(x)
        ranks = [got[r][i] for r in range(world)]
        errors = {"o": rel_l2(torch.cat([r["o"] for r in ranks], 1), ref["o"]), "s": rel_l2(ranks[-1]["s"], ref["s"])}
        for n in ("q", "k", "v", "g", "beta"):
            errors[f"d{n}"] = rel_l2(torch.cat([r[f"d{n}"] for r in ranks], 1), ref[f"d{n}"])
        if init:
            errors["dh0"] = rel_l2(ranks[0]["dh0"], ref["dh0"])
        bad = {n: e for n, e in errors.items() if not e <= 1e-5}
        if lm:  # the state entering the last slice matters: KCP is not "each rank from zero"
            a = slice_bounds(T, world, world - 1)[0]
            o_zero, _ = kda_chunk(*(x[n][:, a:] for n in ("q", "k", "v", "g", "beta")))
            assert rel_l2(o_zero, ref["o"][:, a:]) > 1e-2
        assert not bad, f"T={T} world={world} init={init}: relative RMS errors above 1e-5: {bad}"
        # KCP moves one fixed-size summary per rank per direction: B*H*K*(K+V)*4 bytes (§7).
        summary = B * H * K * (K + V) * 4
        for r in ranks:
            rec = r["bytes"]
            assert (rec.fwd_sent, rec.bwd_sent) == (summary, summary)
            assert (rec.fwd_recv, rec.bwd_recv) == ((world - 1) * summary, (world - 1) * summary)


def _backward_count_rank(rank: int, world: int, x: dict) -> dict[str, dict]:
    """kcp_kda's forward + backward with the default kernels and with a custom chunk_fn (the same kda_chunk, but
    given without a state_grad_fn), counting the runs of the chunked kernel's full backward (ChunkKDA.backward)."""
    import moonrt.ops.kda.autograd as kda_autograd

    calls = [0]
    orig = kda_autograd.ChunkKDA.backward

    def counted(ctx: object, *grads: torch.Tensor) -> tuple:
        calls[0] += 1
        return orig(ctx, *grads)

    kda_autograd.ChunkKDA.backward = staticmethod(counted)  # type: ignore[method-assign]
    out = {}
    try:
        for name, fn in (("default", None), ("custom", lambda *a, **kw: kda_chunk(*a, **kw))):
            calls[0] = 0
            (r,) = _kcp_rank(rank, world, [(x["q"].shape[1], True, x)], chunk_fn=fn)
            out[name] = {**r, "calls": calls[0]}
    finally:
        kda_autograd.ChunkKDA.backward = orig  # type: ignore[method-assign]
    return out


def test_kcp_backward_runs_one_full_local_backward_and_custom_chunk_fn_falls_back() -> None:
    """KCP's backward step 1 (the entering-state gradient) uses kda_state_grad: one run of the chunked kernel's
    full backward per rank (two before: step 1 asked autograd, which ran all of it). A custom chunk_fn without a
    state_grad_fn falls back to autograd (two runs). Both give single-process kda_chunk's gradients."""
    x = _inputs(300, seed=5, init=True)
    got = dist_run(_backward_count_rank, 2, x, timeout=240)
    ref = _reference(x)
    for name, calls in (("default", 1), ("custom", 2)):
        assert [got[r][name]["calls"] for r in range(2)] == [calls, calls], name
        for n in ("q", "k", "v", "g", "beta"):
            err = rel_l2(torch.cat([got[r][name][f"d{n}"] for r in range(2)], 1), ref[f"d{n}"])
            assert err <= 1e-5, (name, n, err)
        assert rel_l2(got[0][name]["dh0"], ref["dh0"]) <= 1e-5, name


def _bad_rank(rank: int, world: int) -> dict[str, str]:
    """Each bad call must raise ValueError on every rank; a valid call afterwards must still work."""
    x = _inputs(64, seed=1, init=False)
    msgs = {}

    def attempt(name: str, **over: object) -> None:
        a, b = slice_bounds(64, world, rank)
        args = {n: x[n][:, a:b] for n in ("q", "k", "v", "g", "beta")}
        args.update(over)
        try:
            kcp_kda(**args, group=None)
        except ValueError as exc:
            msgs[name] = str(exc)
        else:
            msgs[name] = "<no error>"

    rn = lambda *s: torch.randn(*s)
    # rank 1 holds 10 tokens too many: not the contiguous split of the total
    if rank == 1:
        t = 42
        attempt("length", q=rn(B, t, H, K), k=rn(B, t, H, K), v=rn(B, t, H, V), g=-torch.rand(B, t, H, K),
                beta=torch.rand(B, t, H))
    else:
        attempt("length")
    a, b = slice_bounds(64, world, rank)
    if rank == 1:
        attempt("dtype", **{n: x[n][:, a:b].double() for n in ("q", "k", "v", "g", "beta")})
        attempt("heads", **{n: x[n][:, a:b, :1] for n in ("q", "k", "v", "g", "beta")})
        attempt("init", initial_state=torch.zeros(B, H, K, V))
        attempt("local", beta=x["beta"][:, a:b, :1])  # wrong beta shape on one rank only
        attempt("decay", g=x["g"][:, a:b] + float("nan"))  # NaN log-decays, on one rank only
    else:
        for name in ("dtype", "heads", "init", "local", "decay"):
            attempt(name)
    args = {n: x[n][:, a:b] for n in ("q", "k", "v", "g", "beta")}
    o, _ = kcp_kda(**args, group=None)  # the group is still usable
    ref, _ = kda_chunk(*(x[n] for n in ("q", "k", "v", "g", "beta")))
    msgs["after"] = f"{rel_l2(o, ref[:, a:b]):.1e}"
    return msgs


def test_kcp_bad_input_raises_on_every_rank_without_hang() -> None:
    got = dist_run(_bad_rank, 2, timeout=60)
    for rank, msgs in enumerate(got):
        assert "slice lengths T_r = [32, 42]" in msgs["length"] and "[37, 37]" in msgs["length"], msgs["length"]
        assert "dtype differs across CP ranks" in msgs["dtype"], msgs["dtype"]
        assert "head count H differs across CP ranks: [2, 1]" in msgs["heads"], msgs["heads"]
        if rank == 1:
            assert "initial_state given on a CP rank other than 0" in msgs["init"], msgs["init"]
            assert "beta.shape = (1, 32, 1)" in msgs["local"], msgs["local"]
            assert "g.min() = nan" in msgs["decay"] and "not NaN" in msgs["decay"], msgs["decay"]
        else:
            assert "CP rank(s) [1] of 2 received invalid input" in msgs["decay"], msgs["decay"]
            assert "CP rank(s) [1] of 2 received invalid input" in msgs["init"], msgs["init"]
            assert "CP rank(s) [1] of 2 received invalid input" in msgs["local"], msgs["local"]
        assert float(msgs["after"]) <= 1e-5


def test_split_sizes_is_the_contiguous_rule() -> None:
    assert split_sizes(1000, 4) == [250] * 4
    assert split_sizes(10, 4) == [2, 3, 2, 3]
    assert sum(split_sizes(4097, 3)) == 4097
    assert [slice_bounds(10, 4, r) for r in range(4)] == [(0, 2), (2, 5), (5, 7), (7, 10)]
    with pytest.raises(ValueError, match="index = 4"):
        slice_bounds(10, 4, 4)
