"""Context-parallel KDA layer (KCP + conv halo) and MLA layer (latent all-gather) on 2 and 4 gloo ranks.

Each layer runs on contiguous slices through :class:`ContextParallel`; outputs, input gradients and the
parameter gradients (summed over ranks, as CP gradient sync does) must equal the single-process layer on
the whole sequence within 1e-5 relative RMS (K3_SYSTEMS §7).
"""

from __future__ import annotations

import pytest
import torch
from dist import dist_run
from numerics import rel_l2

from moonrt.comm.cp.context import ContextParallel
from moonrt.models.k3.model.config import k3_tiny
from moonrt.models.k3.model.kda_layer import KDALayer
from moonrt.models.k3.model.mla import GatedMLA

TS = (256, 1000, 4096)
D = k3_tiny().hidden_size


def _layers(seed: int = 0) -> dict[str, torch.nn.Module]:
    torch.manual_seed(seed)
    layers = {"kda": KDALayer(k3_tiny()), "mla": GatedMLA(k3_tiny())}
    for layer in layers.values():
        for p in layer.parameters():  # move norm weights / conv off their init values too
            p.data.add_(0.05 * torch.randn_like(p))
    return layers


def _run_layer(layer: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor, ctx: object | None) -> dict:
    x = x.clone().requires_grad_(True)
    y = layer(x) if ctx is None else layer(x, ctx=ctx)
    (y * dy).sum().backward()
    out = {"y": y.detach(), "dx": x.grad, **{n: p.grad.clone() for n, p in layer.named_parameters()}}
    layer.zero_grad(set_to_none=True)
    return out


def _cp_rank(rank: int, world: int, states: dict, cases: list[tuple[int, torch.Tensor, torch.Tensor]]) -> list:
    layers = _layers()
    for name, layer in layers.items():
        layer.load_state_dict(states[name])
    ctx = ContextParallel(None)
    ctx.tag_layers(layers.items())
    results = []
    for _T, x, dy in cases:
        per = {}
        for name, layer in layers.items():
            ctx.new_step()
            per[name] = _run_layer(layer, ctx.slice(x), ctx.slice(dy), ctx)
            per[name]["bytes"] = ctx.log.by_op()
            per[name]["layers"] = list(ctx.log.by_layer())
        results.append(per)
    return results



@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_cp_kda_and_mla_layers_match_single_process(world: int) -> None:
    layers = _layers()
    states = {n: layer.state_dict() for n, layer in layers.items()}
    gen = torch.Generator().manual_seed(world)
    cases = [(T, torch.randn(1, T, D, generator=gen), torch.randn(1, T, D, generator=gen)) for T in TS]
    got = dist_run(_cp_rank, world, states, cases, timeout=300)
    cfg = k3_tiny()
    H, K = cfg.linear_attn_config.num_heads, cfg.linear_attn_config.head_dim
    for i, (T, x, dy) in enumerate(cases):
        for name, layer in layers.items():
            ref = _run_layer(layer, x, dy, None)
            ranks = [got[r][i][name] for r in range(world)]
            errors = {"y": rel_l2(torch.cat([r["y"] for r in ranks], 1), ref["y"]),
                      "dx": rel_l2(torch.cat([r["dx"] for r in ranks], 1), ref["dx"])}
            for pname, _ in layer.named_parameters():
                errors[pname] = rel_l2(sum(r[pname] for r in ranks), ref[pname])
            bad = {n: e for n, e in errors.items() if not e <= 1e-5}
            assert not bad, f"{name} T={T} world={world}: relative RMS errors above 1e-5: {bad}"
            assert all(r["layers"] == [name] for r in ranks)  # records carry the tagged layer name
            if name == "kda":
                summary = H * K * (K + K) * 4  # B=1: the §7 per-rank KCP summary, both passes
                halo = (cfg.linear_attn_config.short_conv_kernel_size - 1) * 3 * H * K * 4
                for rank, r in enumerate(ranks):
                    kcp, hal = r["bytes"]["kcp"], r["bytes"]["halo"]
                    assert kcp["fwd_sent"] == kcp["bwd_sent"] == summary
                    assert hal["fwd_sent"] == (halo if rank < world - 1 else 0)  # to the next rank
                    assert hal["bwd_sent"] == (halo if rank > 0 else 0)  # gradient back to the previous rank
            else:
                latent = (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4
                for rank, r in enumerate(ranks):
                    t_r = ctx_len(T, world, rank)
                    assert r["bytes"]["gather"]["fwd_sent"] == t_r * latent  # grows with T


def ctx_len(total: int, world: int, rank: int) -> int:
    return (rank + 1) * total // world - rank * total // world


def _halo_bad_rank(rank: int, world: int) -> dict[str, str]:
    ctx = ContextParallel(None)
    msgs = {}
    for name, x in (("short", torch.randn(1, 2 if rank == 0 else 3, 8)),  # T_r < halo width 3
                    ("channels", torch.randn(1, 8, 8 if rank == 0 else 9))):
        try:
            ctx.conv_prefix(x, 3)
            msgs[name] = "<no error>"
        except ValueError as exc:
            msgs[name] = str(exc)
    try:
        ctx.gather_sequence(torch.randn(1, 8 + 5 * rank, 4))
        msgs["gather"] = "<no error>"
    except ValueError as exc:
        msgs["gather"] = str(exc)
    return msgs


def test_cp_halo_and_gather_bad_input_raise_on_every_rank() -> None:
    for msgs in dist_run(_halo_bad_rank, 2, timeout=60):
        assert "at least 3 token(s)" in msgs["short"], msgs["short"]
        assert "channel count C differs across CP ranks: [8, 9]" in msgs["channels"], msgs["channels"]
        assert "slice lengths T_r = [8, 13]" in msgs["gather"], msgs["gather"]


def _checkpoint_rank(rank: int, world: int) -> list[float]:
    """Activation checkpointing (non-reentrant: the recompute reruns KCP and the halo inside backward)."""
    from torch.utils.checkpoint import checkpoint

    layer = _layers()["kda"]
    ctx = ContextParallel(None)
    x = ctx.slice(torch.randn(1, 256, D, generator=torch.Generator().manual_seed(3)))
    plain = _run_layer(layer, x, torch.ones(1, x.shape[1], D), ctx)

    class Wrapped(torch.nn.Module):
        def forward(self, t: torch.Tensor, ctx: ContextParallel) -> torch.Tensor:
            return checkpoint(layer, t, ctx, use_reentrant=False)

    ckpt = _run_layer(Wrapped(), x, torch.ones(1, x.shape[1], D), ctx)
    grads = {n: p.grad for n, p in layer.named_parameters()}
    return [rel_l2(ckpt["y"], plain["y"]), rel_l2(ckpt["dx"], plain["dx"])] + [
        rel_l2(grads[n], plain[n]) for n in grads]


def test_cp_kda_layer_under_activation_checkpointing() -> None:
    for errors in dist_run(_checkpoint_rank, 2, timeout=120):
        assert max(errors) <= 1e-6, errors


def _packed_kda_rank(rank: int, world: int) -> str | None:
    ctx = ContextParallel(None)
    q = torch.zeros(1, 4, 1, 2)
    try:
        ctx.kda(q, q, q, q, torch.zeros(1, 4, 1), cu_seqlens=torch.tensor([0, 2, 4]))
    except ValueError as exc:
        return str(exc)
    return None


def test_cp_kda_takes_the_seam_signature_and_refuses_packed_documents() -> None:
    """``ContextParallel.kda`` accepts every keyword of the attention-context seam (``cu_seqlens`` included, so a
    model written against the seam never calls it with one it lacks) and refuses packed documents with one line
    naming the field, on every rank, before any collective."""
    got = dist_run(_packed_kda_rank, 2, timeout=120)
    assert got == ["cu_seqlens: expected None under context parallelism (packed documents run on a single device; "
                   "the job refuses packing with cp > 1)"] * 2
