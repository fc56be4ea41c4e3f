"""ep-sim at cluster scale and its input errors: streamed workloads, memory
refusal, hardware profiles, the step-time model; every bad input is one stderr line, exit 2."""

from __future__ import annotations

import json

import numpy as np
import pytest
import yaml

from moonrt.cli import main
from moonrt.jobs.selftest.cli import fit_link, local_profile
from moonrt.scheduler import baselines as bl
from moonrt.scheduler.hardware import Link, builtin_profiles, load_profile, profile_from_dict
from moonrt.scheduler.moonep import plan, transfer_matrix
from moonrt.scheduler.sim import estimate_memory_bytes
from moonrt.scheduler.steptime import layer_time, moonep_traffic, phase_time, placement_traffic
from moonrt.scheduler.workload import SyntheticStream, load_trace, open_trace, save_trace, synthetic

SMALL = ["--experts", "32", "--ranks", "4", "--top-k", "4", "--tokens", "64", "--steps", "3", "--layers", "2",
         "--quiet", "--no-plot"]
GOOD = {"name": "t", "ranks_per_node": 2, "intra_node": {"bandwidth_GBps": 100, "latency_us": 2},
        "inter_node": {"bandwidth_GBps": 10, "latency_us": 10}, "gemm_tflops": 100}


def _err(capsys, argv: list[str]) -> str:
    assert main(["ep-sim", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_stream_equals_materialized_synthetic_and_trace(tmp_path) -> None:
    kw = dict(num_experts=16, num_ranks=4, top_k=2, tokens_per_rank=8, steps=3, layers=2)
    wl = synthetic("zipf", **kw, seed=5)
    stream = SyntheticStream("zipf", 16, 4, 2, 8, 3, 2, seed=5)
    got = np.stack([c for _, _, c in stream.layer_steps()]).reshape(wl.counts.shape)
    np.testing.assert_array_equal(got, wl.counts)
    save_trace(tmp_path / "t.npz", wl.counts.astype(np.int32), top_k=2)
    tr = open_trace(tmp_path / "t.npz")
    assert tr.shape == (3, 2, 4, 16) and tr.top_k == 2
    got = np.stack([c for _, _, c in tr.layer_steps()]).reshape(wl.counts.shape)
    np.testing.assert_array_equal(got, load_trace(tmp_path / "t.npz").counts)


def test_memory_estimate_is_linear_in_r_times_e_and_refused_with_the_figure(tmp_path, capsys) -> None:
    pol = ["none", "eplb", "eplb-oracle", "moonep"]
    a, b = (estimate_memory_bytes(r, 896, 8, 8, pol) for r in (448, 896))
    assert b - a < 1.2 * (a - estimate_memory_bytes(0, 896, 8, 8, pol)) + 2 * 896 * 896 * 8 * 8
    err = _err(capsys, ["--experts", str(10**7), "--ranks", "64", "--out", str(tmp_path)])
    assert "estimated peak memory" in err and "GiB" in err and "exceeds" in err
    err = _err(capsys, [*SMALL, "--max-memory-gib", "0.01", "--out", str(tmp_path)])
    assert "--max-memory-gib limit of 0.0 GiB" in err


@pytest.mark.parametrize("argv, needle", [
    (["--experts", "30"], "--experts: 30 is not divisible by --ranks 4"),
    (["--top-k", "40"], "--top-k: 40, expected <= --experts (32)"),
    (["--tokens", "-1"], "--tokens: -1, expected an integer >= 0"),
    (["--ranks", "0"], "--ranks: 0, expected an integer >= 1"),
    (["--drift", "1.5"], "--drift: 1.5"),
    (["--sigma", "nan"], "--sigma: nan"),
    (["--warmup", "3"], "--warmup: 3, expected 0 <= warmup < steps (3)"),
    (["--eplb-every", "0"], "--eplb-every: 0"),
    (["--eplb-alpha", "0"], "--eplb-alpha: 0.0"),
    (["--eplb-redundant", "3"], "--eplb-redundant: 3"),
    (["--num-slots", "-2"], "--num-slots: -2"),
    (["--hidden", "0"], "--hidden: 0"),
    (["--max-memory-gib", "nan"], "--max-memory-gib: nan"),
    (["--policies", "moonep,magic"], "--policies: 'moonep,magic'"),
    (["--hardware", "no-such.yaml"], "--hardware: 'no-such.yaml' is not a file"),
])
def test_bad_flags_one_line_exit_2(tmp_path, capsys, argv: list[str], needle: str) -> None:
    assert needle in _err(capsys, [*SMALL, *argv, "--out", str(tmp_path / "o")])


def test_bad_out_and_bad_traces(tmp_path, capsys) -> None:
    (tmp_path / "file").write_text("x")
    assert "--out:" in _err(capsys, [*SMALL, "--out", str(tmp_path / "file")])
    wl = synthetic("uniform", num_experts=16, num_ranks=4, top_k=2, tokens_per_rank=8, steps=2, layers=1)
    save_trace(tmp_path / "t.npz", wl.counts, top_k=2)
    out = ["--out", str(tmp_path / "o"), "--quiet", "--no-plot", "--warmup", "0"]
    err = _err(capsys, ["--trace", str(tmp_path / "t.npz"), "--ranks", "8", *out])
    assert "--ranks: 8, but trace" in err and "ranks = 4" in err
    assert "--top-k: 3, but trace" in _err(capsys, ["--trace", str(tmp_path / "t.npz"), "--top-k", "3", *out])
    assert "no such trace file" in _err(capsys, ["--trace", str(tmp_path / "missing.npz"), *out])
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    assert "not an .npz archive" in _err(capsys, ["--trace", str(tmp_path / "junk.npz"), *out])
    np.savez(tmp_path / "neg.npz", counts=-wl.counts)
    assert "negative entries" in _err(capsys, ["--trace", str(tmp_path / "neg.npz"), *out])
    np.savez(tmp_path / "flt.npz", counts=wl.counts.astype(np.float32))
    assert "expected integer" in _err(capsys, ["--trace", str(tmp_path / "flt.npz"), *out])
    assert main(["ep-sim", "--trace", str(tmp_path / "t.npz"), "--ranks", "4", *out]) == 0  # agreeing flag is fine


@pytest.mark.parametrize("patch, needle", [
    ({"nvlink": 1}, "unknown field 'nvlink'"),
    ({"intra_node": {"bandwidth_GBps": -5, "latency_us": 1}}, "intra_node.bandwidth_GBps = -5, expected a finite"),
    ({"inter_node": {"bandwidth_GBps": 5, "latency_us": 1, "mtu": 9}}, "unknown field inter_node.mtu"),
    ({"inter_node": {"bandwidth_GBps": 5, "latency_us": -1}}, "inter_node.latency_us = -1"),
    ({"gemm_tflops": "fast"}, "gemm_tflops = 'fast'"),
    ({"ranks_per_node": 0}, "ranks_per_node = 0"),
    ({"overlap_prefetch": "yes"}, "overlap_prefetch = 'yes'"),
])
def test_bad_hardware_profiles(tmp_path, capsys, patch: dict, needle: str) -> None:
    path = tmp_path / "hw.yaml"
    path.write_text(yaml.safe_dump({**GOOD, **patch}))
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(".", r"\.")):
        load_profile(path)
    assert needle in _err(capsys, [*SMALL, "--hardware", str(path), "--out", str(tmp_path / "o")])


def test_builtin_profiles_load_and_roundtrip() -> None:
    names = builtin_profiles()
    assert {"h800-ib400", "h200-ib400"} <= set(names)
    for path in names.values():
        hw = load_profile(path)
        assert hw.sources and profile_from_dict(hw.to_dict()) == hw


def test_phase_time_by_hand() -> None:
    hw = profile_from_dict(GOOD)  # 2 ranks per node: intra 100 GB/s + 2 us, inter 10 GB/s + 10 us
    m = np.zeros((4, 4))
    m[0, 1] = 1e9  # intra-node: 2 us + 10 ms
    m[0, 2] = 1e8  # inter-node from rank 0: 10 us + 10 ms; runs concurrently with the intra transfer
    m[1, 2] = 5e8  # rank 2 receives 6e8 inter-node: 10 us + 60 ms -> the slowest rank
    assert phase_time(m, hw) == pytest.approx(10e-6 + 6e8 / 10e9)
    assert Link(1.0, 0.0).seconds(0.0) == 0.0


def test_layer_time_counts_every_phase() -> None:
    """MoonEP traffic from a plan; totals assembled from the phase times as documented."""
    counts = synthetic("zipf", num_experts=16, num_ranks=4, top_k=2, tokens_per_rank=64, steps=1, layers=1,
                       zipf_s=1.5, seed=2).counts[0, 0]
    pl = plan(counts)
    tr = moonep_traffic(counts, pl, plan_s=1e-3)
    np.testing.assert_array_equal(tr.tokens, transfer_matrix(counts, pl.cuts))
    hw = profile_from_dict({**GOOD, "overlap_prefetch": False})
    kw = dict(num_experts=16, token_bytes=100.0, expert_bytes=1e6, expert_params=1e6)
    t = layer_time(tr, hw, passes="fwd", **kw)
    disp, comb = phase_time(tr.tokens * 100.0, hw), phase_time(tr.tokens.T * 100.0, hw)
    pref = phase_time(tr.weights * 1e6, hw)
    gemm = tr.rows.max() * 2e6 / 100e12
    gather = hw.inter_node.seconds(3 * 16 * 4.0)
    assert t["total"] == pytest.approx(1e-3 + gather + disp + pref + gemm + comb)
    tb = layer_time(tr, hw, passes="fwd+bwd", **kw)
    assert tb["total"] == pytest.approx(t["total"] + disp + 2 * pref + 2 * gemm + comb)
    home = placement_traffic(counts, bl.no_redundancy(16, 4))  # none: tokens go to the home group
    np.testing.assert_allclose(home.tokens, counts.reshape(4, 4, 4).sum(2))
    assert home.weights.sum() == 0


def test_cli_hardware_prints_layer_time_and_speedup(tmp_path, capsys) -> None:
    assert main(["ep-sim", *SMALL, "--hardware", "h800-ib400", "--out", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "estimated MoE layer time on h800-ib400" in text and "MoonEP speed-up" in text
    doc = json.loads((tmp_path / "summary.json").read_text())
    assert doc["hardware"]["name"] == "h800-ib400"
    assert doc["summary"]["moonep"]["moonep_speedup"] == 1.0
    assert all(doc["summary"][p]["layer_ms"]["total"] > 0 for p in doc["policies"])


def test_cpu_local_link_fit_recovers_latency_and_bandwidth() -> None:
    rows = [{"op": "all_to_all", "bytes": b, "time_s": 100e-6 + b * 3 / 4 / 2e9} for b in (1 << 16, 1 << 20, 1 << 24)]
    link = fit_link(rows, 4)
    assert link["bandwidth_GBps"] == pytest.approx(2.0, rel=1e-9)
    assert link["latency_us"] == pytest.approx(100.0, rel=1e-6)
    prof = profile_from_dict(local_profile(rows, 4, 0.05, "gloo"))
    assert prof.ranks_per_node == 4 and prof.gemm_tflops == 0.05
