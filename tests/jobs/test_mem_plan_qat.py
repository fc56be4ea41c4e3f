"""``moonrt mem-plan --qat mxfp4`` (issue 33 item 4): the export size of the declared quantizable weights (half a
byte a weight plus one scale byte a block) and the per-rank fake-quantized weight copies (the rank's largest layer's
quantized weights in fp32) counted from first principles; bad input is one line."""

from __future__ import annotations

import math

import pytest
from jobs.helpers import _cli

from moonrt.config import ParallelConfig
from moonrt.jobs.mem_plan import qat_summary
from moonrt.memory.model_memory import JobLayout, rank_models
from moonrt.models import presets
from moonrt.models.k3.memory import default_profile, param_sizes
from moonrt.models.k3.model.config import k3_tiny
from moonrt.models.k3.spec import qat_weights


def test_k3_export_size_is_codes_plus_scales_of_the_declared_weights() -> None:
    spec = presets()["k3"]
    cfg = spec.presets["k3"]()
    q = qat_summary(spec, cfg, 32)
    n = sum(math.prod(s) for s in qat_weights(cfg).values())
    assert q["quantized"] == n and q["params"] == spec.param_count(cfg) == 2_779_483_053_152
    assert q["packed_bytes"] == n // 2 + n // 32
    assert q["export_bytes_bf16_rest"] == n // 2 + n // 32 + 2 * (q["params"] - n)
    routed = q["groups"]["layers.*.moe.experts"]
    E, L, F = cfg.num_experts, cfg.routed_expert_hidden_size, cfg.moe_intermediate_size
    assert routed["params"] == (cfg.num_hidden_layers - cfg.first_k_dense_replace) * E * 3 * F * L
    assert 1.3e12 < routed["codes"] + routed["scales"] < 1.5e12  # the release's ~1.4 TB of MXFP4 experts


def test_planner_counts_the_largest_layer_of_fake_quantized_weights_per_rank() -> None:
    cfg = k3_tiny()
    par = ParallelConfig(pp=2, ep=2, microbatches=2)
    plain = JobLayout(parallel=par, seq_len=64, param_bytes=4, optim_bytes=8)
    qat = JobLayout(parallel=par, seq_len=64, param_bytes=4, optim_bytes=8, qat_bytes=4)
    sizes = param_sizes(cfg)
    a = rank_models(cfg, plain, sizes, default_profile(cfg, plain))
    b = rank_models(cfg, qat, sizes, default_profile(cfg, qat))
    L, F, D = cfg.routed_expert_hidden_size, cfg.moe_intermediate_size, cfg.hidden_size
    per_layer = (cfg.num_experts // 2) * 3 * F * L + cfg.num_shared_experts * 3 * D * F  # both ranks hold MoE layers
    for ra, rb in zip(a, b):
        assert "qat_fake_quant" not in ra.static
        assert rb.static["qat_fake_quant"] == 4 * per_layer
        assert {k: v for k, v in rb.static.items() if k != "qat_fake_quant"} == ra.static


@pytest.mark.parametrize(("flags", "message"), [
    (["--model", "dense_tiny", "--qat", "mxfp4"],
     "--qat = 'mxfp4': model family 'dense' declares no quantizable layers"),
    (["--model", "k3_tiny", "--qat", "mxfp4", "--qat-block", "32"],
     "--qat = 'mxfp4': qat block = 32: expected a divisor of every quantized reduction axis; "
     "layers.1.moe.experts.w_down [16, 64, 56] has 56 (--qat-block 8 fits this model)"),
])
def test_bad_qat_plan_is_one_line(flags: list[str], message: str, capfd: pytest.CaptureFixture[str]) -> None:
    code, _, err = _cli(["mem-plan", *flags], capfd)
    assert code == 2 and err.strip().splitlines() == [f"mem-plan: {message}"], err


@pytest.mark.parametrize("block", ["qat_block: 8\n", ""])  # k3_tiny's preset block is 8 (issue 49 item 10)
def test_a_qat_job_config_plans_with_its_qat(tmp_path, capfd: pytest.CaptureFixture[str], block: str) -> None:
    cfg = tmp_path / "job.yaml"
    cfg.write_text("qat: mxfp4\n" + block)
    code, out, err = _cli(["mem-plan", "--config", str(cfg), "--budget-gib", "4"], capfd)
    assert code == 0, err
    assert "== QAT mxfp4 (block 8): k3_tiny, 1,720,320 of 3,223,000 parameters quantized" in out, out
    header = next(line for line in out.splitlines() if line.split()[:2] == ["rank", "layers"])
    assert "qat" in header.split(), header
