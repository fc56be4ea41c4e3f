"""Measured vs predicted (K3_SYSTEMS §8): the planner's saved-activation bytes per layer kind for
k3_tiny match the activation manager's measurement within 5%, for each policy.

The profile is fitted from forwards of 1 and 2 sequences of 64 tokens; the check runs 3 sequences,
and compares the planner's per-policy byte model (FP8 sizes, offload moving bytes off the device,
recompute keeping region inputs) and its whole-model prediction with what the manager measured.
"""

from __future__ import annotations

import pytest
import torch

from moonrt.memory.manager import ActivationManager
from moonrt.memory.model_memory import JobLayout, activation_bytes, rank_models
from moonrt.models.k3.memory import param_sizes
from moonrt.models.k3.memory_trace import class_counts, class_of, policy_for_all, traced_profile
from moonrt.models.k3.model.config import k3_tiny
from moonrt.models.k3.model.model import K3Model

SEQ = 64
B_CHECK = 3
T_CHECK = SEQ * B_CHECK


def _build() -> K3Model:
    torch.manual_seed(0)
    return K3Model(k3_tiny())


def _run(model: K3Model, batch: int) -> torch.Tensor:
    tokens = torch.randint(0, 256, (batch, SEQ), generator=torch.Generator().manual_seed(batch))
    return model.loss_sum(tokens, tokens)


@pytest.fixture(scope="module")
def profile():
    return traced_profile(_build, _run, k3_tiny(), SEQ)


def _measure(policy: str) -> tuple[dict[str, float], dict[str, int]]:
    """Per-class stored bytes and the per-tier peak of one forward at ``T_CHECK`` under ``policy``."""
    cfg = k3_tiny()
    model = _build()
    mgr = ActivationManager(model, policy_for_all(policy))
    try:
        with mgr:
            loss = _run(model, B_CHECK)
        res: dict[str, float] = {}
        for (reg, _pol), st in mgr.accounting.regions.items():
            c = class_of(reg, cfg)
            res[c] = res.get(c, 0.0) + st.live_bytes  # held for backward at the end of the forward
        del loss
        return res, dict(mgr.accounting.peak)
    finally:
        mgr.close()


@pytest.fixture(scope="module")
def measured():
    return {p: _measure(p) for p in ("keep", "fp8", "host", "recompute")}


@pytest.mark.parametrize("policy", ["keep", "fp8", "host", "recompute"])
def test_predicted_bytes_per_layer_kind_within_5_percent(profile, measured, policy):
    cfg = k3_tiny()
    by_class, _ = measured[policy]
    counts = class_counts(cfg)
    assert set(by_class) <= set(profile.classes)
    for name, cls in profile.classes.items():
        dev, off = cls.bytes(policy, T_CHECK)
        predicted = counts[name] * (dev + off)
        got = by_class.get(name, 0.0)
        assert abs(predicted - got) <= 0.05 * max(got, 1.0), (policy, name, predicted, got)


@pytest.mark.parametrize("policy", ["keep", "fp8", "host"])
def test_planner_device_peak_matches_manager(profile, measured, policy):
    """The planner's activation term for one rank (pp = 1, one micro-batch) vs the manager's peak."""
    cfg = k3_tiny()
    layout = JobLayout(seq_len=SEQ, micro_batch_size=B_CHECK, act_bytes=4)  # one micro-batch
    (rm,) = rank_models(cfg, layout, param_sizes(cfg), profile)
    dev, off = activation_bytes(rm, profile, dict.fromkeys(profile.classes, policy), T_CHECK)
    _, peak = measured[policy]
    assert abs(dev - peak["device"]) <= 0.05 * max(peak["device"], 1.0)
    assert abs(off - peak["host"]) <= 0.05 * max(peak["host"], 1.0)
