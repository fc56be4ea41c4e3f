"""Activation manager (K3_SYSTEMS §8) on stand-in modules: every policy's gradients vs keep-everything,
bytes actually saved per tier, storage dedupe, parameters not stored, prefetch, bad input."""

from __future__ import annotations

import warnings

import pytest
import torch
from memory.helpers import Stack, _policy, _run, _run_mgr
from torch import nn

from moonrt.config import ConfigError
from moonrt.memory.manager import ActivationManager
from moonrt.memory.policy import MemoryPolicy


@pytest.mark.parametrize("spec", [
    {"default": "keep"},
    {"default": "host"},
    {"default": "disk", "disk_capacity_mib": 64},
    {"default": "keep", "rules": [{"match": "layers.*.attn", "policy": "recompute"}]},
    {"default": "keep", "rules": [{"match": "layers.1", "policy": "recompute"}]},  # spans a whole layer
    {"default": "host", "rules": [{"match": "layers.0.ffn", "policy": "disk"}], "disk_capacity_mib": 64},
])
def test_exact_policies_match_keep_everything(spec, device):
    ref, _ = _run(None, device=device)
    got, acc = _run(_policy(**spec), device=device)
    for a, b in zip(got, ref):
        assert a.device == b.device and torch.equal(a, b)
    assert acc.live == {"device": 0, "host": 0, "disk": 0, "remote": 0}  # all released after backward


def test_offload_moves_bytes_off_device():
    _, keep = _run(_policy(default="keep"))
    _, host = _run(_policy(default="host"))
    _, disk = _run(_policy(default="disk", disk_capacity_mib=64))
    assert keep.peak["device"] > 0 and keep.peak["host"] == 0
    assert host.peak["device"] == 0 and host.peak["host"] == keep.peak["device"]
    assert disk.peak["device"] == 0 and disk.peak["disk"] == keep.peak["device"]
    assert disk.prefetched > 0  # reloads were started one layer ahead
    assert 0.0 <= disk.hidden_fraction <= 1.0
    if not torch.cuda.is_available():
        assert host.prefetched == 0  # host memory is the compute memory: nothing to bring back early


def test_recompute_saves_only_region_inputs():
    _, keep = _run(_policy(default="keep"))
    _, rec = _run(_policy(default="keep", rules=[{"match": "layers.*.attn", "policy": "recompute"}]))
    attn_keep = sum(st.logical_bytes for (reg, _), st in keep.regions.items() if ".attn" in reg)
    attn_rec = sum(st.logical_bytes for (reg, pol), st in rec.regions.items() if ".attn" in reg and pol == "keep")
    inputs = sum(st.logical_bytes for (reg, pol), st in rec.regions.items() if pol == "recompute")
    assert attn_keep > 0 and attn_rec == 0  # inside the region nothing is saved
    assert inputs == 3 * 4 * 16 * 128 * 4  # only the region inputs (one [4, 16, 128] fp32 per layer)
    assert rec.peak["device"] < keep.peak["device"]


@pytest.mark.parametrize("dtype,lo,hi", [(torch.float32, 3.5, 4.0), (torch.bfloat16, 1.8, 2.0)])
def test_fp8_gradients_within_bound_and_bytes_drop(dtype, lo, hi):
    ref, keep = _run(_policy(default="keep"), dtype)
    got, q = _run(_policy(default="fp8"), dtype)
    for a, b in zip(got, ref):
        assert float((a.float() - b.float()).norm() / b.float().norm()) < 0.05
    quantized = sum(st.logical_bytes for st in q.regions.values())
    ratio = keep.peak["device"] / q.peak["device"]
    assert quantized == keep.saved_bytes()
    assert lo < ratio < hi, ratio


def test_fp8_then_host_composition(device):
    ref, _ = _run(_policy(default="fp8"), device=device)
    got, acc = _run(_policy(default="fp8+host"), device=device)
    for a, b in zip(got, ref):
        assert a.device == b.device and torch.equal(a, b)  # same quantization, only the tier differs
    assert acc.peak["device"] == 0 and acc.peak["host"] > 0


class Views(nn.Module):
    """Saves three views of one storage (a fused projection split in three) and a parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(64, 192)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.proj(x).chunk(3, dim=-1)
        return (q * k * v).sum(-1)


@pytest.mark.parametrize("policy", ["keep", "host"])
def test_views_and_parameters_stored_once(policy):
    torch.manual_seed(0)
    model = Views()
    x = torch.randn(8, 64, requires_grad=True)
    ref = torch.autograd.grad(model(x).sum(), [x, *model.parameters()])
    mgr = ActivationManager(model, _policy(default=policy))
    with mgr:
        y = model(x).sum()
    got = torch.autograd.grad(y, [x, *model.parameters()])
    acc = mgr.accounting
    mgr.close()
    for a, b in zip(got, ref):
        assert torch.equal(a, b)
    assert acc.parameter_saves >= 1
    tier = "device" if policy == "keep" else "host"
    proj_bytes = 8 * 192 * 4
    # x and q*k ([8, 64] each) + the projection output once, although q, k, v were saved separately
    assert acc.peak[tier] == proj_bytes + 2 * 8 * 64 * 4
    assert sum(st.deduped for st in acc.regions.values()) >= 2


def test_bad_input_messages():
    with pytest.raises(ConfigError, match="policy.*'fp7'.*expected one of"):
        _policy(default="keep", rules=[{"match": "layers.*", "policy": "fp7"}])
    with pytest.raises(ConfigError, match="default"):
        _policy(default="recompute")
    with pytest.warns(UserWarning, match=r"'layers\.\*\.mlp' matches no module.*known regions: .*layers\.\*\.attn"):
        ActivationManager(Stack(), _policy(rules=[{"match": "layers.*.mlp", "policy": "fp8"}])).close()
    with pytest.raises(ValueError, match="remote client"):
        ActivationManager(Stack(), _policy(default="remote"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ActivationManager(Stack(), _policy(rules=[{"match": "layers.*.ffn", "policy": "fp8"}])).close()


def test_disk_store_capacity_and_reuse(tmp_path):
    from moonrt.memory.backends import DiskStore

    store = DiskStore(tmp_path / "offload", capacity=1024)
    a = store.put(torch.arange(100, dtype=torch.uint8))
    b = store.put(torch.arange(200, dtype=torch.uint8))
    assert torch.equal(store.get(a, torch.device("cpu")), torch.arange(100, dtype=torch.uint8))
    with pytest.raises(ValueError, match="capacity = 1024 bytes exhausted"):
        store.put(torch.zeros(900, dtype=torch.uint8))
    store.free(a)
    store.free(b)
    c = store.put(torch.full((900,), 7, dtype=torch.uint8))  # freed extents merged and reused
    assert torch.equal(store.get(c, torch.device("cpu")), torch.full((900,), 7, dtype=torch.uint8))
    store.close()
    assert list((tmp_path / "offload").iterdir()) == []  # the directory is kept, no file left in it


def test_fp8_layer_batches_equal_single_saves():
    """FP8 saves quantized per layer in one call (default) vs one call per save (fp8_batch_bytes=1): the same
    gradients bit for bit and the same bytes per region and tier."""
    got, batched = _run_mgr(_policy(default="fp8"))
    ref, single = _run_mgr(_policy(default="fp8"), fp8_batch_bytes=1)
    for a, b in zip(got, ref):
        assert torch.equal(a, b)
    assert batched.accounting.to_dict()["regions"] == single.accounting.to_dict()["regions"]
    assert batched.accounting.peak == single.accounting.peak and batched.accounting.live["device"] == 0
    batched.close()
    single.close()


def test_host_buffers_reused_across_steps():
    ref, _ = _run(None)
    got, mgr = _run_mgr(_policy(default="host"), steps=2)
    store = mgr._stores["host"]
    assert store.reused > 0  # the second step copied into the first step's buffers
    for a, b in zip(got, ref):
        assert torch.equal(a, b)
    assert mgr.accounting.live["host"] == 0
    mgr.close()
    assert store.pooled_bytes == 0


def _top_pack():
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return None if top is None else top[0]


def _steps(policy: MemoryPolicy, steps: int, probes: tuple[str, ...] = (), **kw):
    """``steps`` forward/backward steps of ``Stack`` under one manager: gradients of every step, the manager,
    and per step the top of the saved-tensor hooks stack seen inside each module of ``probes``."""
    torch.manual_seed(0)
    model = Stack()
    x = torch.randn(4, 16, 128, requires_grad=True)
    mgr = ActivationManager(model, policy, **kw)
    seen: list[dict[str, object]] = []
    for name in probes:
        model.get_submodule(name).register_forward_pre_hook(lambda m, a, name=name: seen[-1].__setitem__(name,
                                                                                                          _top_pack()))
    grads = []
    for _ in range(steps):
        seen.append({})
        model.zero_grad(set_to_none=True)
        x.grad = None
        with mgr:
            loss = model(x).float().square().mean()
        loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()] + [x.grad.clone()])
    assert _top_pack() is None  # nothing left on the stack
    return grads, mgr, seen


def _counts(acc, policy: str) -> int:
    return sum(st.count for (_, pol), st in acc.regions.items() if pol == policy)


def test_keep_regions_run_without_hooks_after_first_forward():
    """Default ``keep_accounting="first"``: the first forward accounts keep saves (hooks on); later forwards
    run keep regions with no saved-tensor hooks at all, with the same gradients bit for bit."""
    ref, _ = _run(None)
    grads, mgr, seen = _steps(_policy(default="keep"), 3, probes=("layers.0.attn", "layers.2.ffn"))
    for g in grads:
        assert all(torch.equal(a, b) for a, b in zip(g, ref))
    assert seen[0]["layers.0.attn"] is mgr._pack_fn
    assert all(s == {"layers.0.attn": None, "layers.2.ffn": None} for s in seen[1:])
    acc = mgr.accounting
    _, one = _run(_policy(default="keep"))
    assert acc.to_dict()["regions"] == one.to_dict()["regions"]  # the first forward's rows, exactly
    assert acc.peak == one.peak and acc.live["device"] == 0
    assert (acc.forwards, acc.keep_forwards) == (3, 1) and "keep saves accounted in 1 of 3" in acc.summary()
    mgr.account_keep_next()
    with mgr:
        loss = mgr.model(torch.randn(4, 16, 128)).square().mean()
    loss.backward()
    assert _counts(acc, "keep") == 2 * _counts(one, "keep") and acc.keep_forwards == 2
    mgr.close()


def test_keep_accounting_every_forward():
    ref, _ = _run(None)
    grads, mgr, seen = _steps(_policy(default="keep"), 2, probes=("layers.1",), keep_accounting="every")
    _, one = _run(_policy(default="keep"))
    assert all(torch.equal(a, b) for g in grads for a, b in zip(g, ref))
    assert all(s["layers.1"] is mgr._pack_fn for s in seen)
    assert _counts(mgr.accounting, "keep") == 2 * _counts(one, "keep") and mgr.accounting.keep_forwards == 2
    mgr.close()
    with pytest.raises(ValueError, match="keep_accounting = 'last'"):
        ActivationManager(Stack(), _policy(), keep_accounting="last")


def test_hooks_only_inside_offloaded_regions():
    """Default keep with a host rule: after the first forward the hooks are on inside ``ffn`` only; host saves
    are stored every forward, keep saves only in the first; gradients exact; a keep rule inside an
    offloaded region takes the hooks off there and puts them back after it."""
    ref, _ = _run(None)
    pol = _policy(default="keep", rules=[{"match": "layers.*.ffn.0", "policy": "keep"},
                                         {"match": "layers.*.ffn", "policy": "host"}])
    grads, mgr, seen = _steps(pol, 2, probes=("layers.0.attn", "layers.1.ffn", "layers.1.ffn.0", "layers.1.ffn.2"))
    assert all(torch.equal(a, b) for g in grads for a, b in zip(g, ref))
    assert seen[1] == {"layers.0.attn": None, "layers.1.ffn": mgr._pack_fn, "layers.1.ffn.0": None,
                       "layers.1.ffn.2": mgr._pack_fn}
    _, one = _run(pol)
    assert _counts(mgr.accounting, "host") == 2 * _counts(one, "host") > 0
    assert _counts(mgr.accounting, "keep") == _counts(one, "keep") > 0
    assert mgr.accounting.live == {"device": 0, "host": 0, "disk": 0, "remote": 0}
    mgr.close()


@pytest.mark.parametrize("spec", [
    {"default": "keep", "rules": [{"match": "layers.*.attn", "policy": "recompute"}]},
    # a checkpointed layer of a host policy with a keep module inside: the checkpoint's hooks are on top there
    # and the manager leaves the stack alone
    {"default": "host", "rules": [{"match": "layers.1", "policy": "recompute"},
                                  {"match": "layers.*.ffn", "policy": "keep"}]},
])
def test_recompute_anchors_every_forward_without_keep_hooks(spec):
    ref, _ = _run(None)
    grads, mgr, _ = _steps(_policy(**spec), 2)
    _, one = _run(_policy(**spec))
    assert all(torch.equal(a, b) for g in grads for a, b in zip(g, ref))
    assert _counts(mgr.accounting, "recompute") == 2 * _counts(one, "recompute") > 0
    assert mgr.accounting.live == {"device": 0, "host": 0, "disk": 0, "remote": 0}
    mgr.close()
