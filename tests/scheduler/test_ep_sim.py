"""Routing workloads, traces and ``moonrt ep-sim`` (K3_SYSTEMS §6)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moonrt.cli import main
from moonrt.scheduler import baselines as bl
from moonrt.scheduler.moonep import plan, transfer_matrix
from moonrt.scheduler.sim import POLICIES, dedup_rows, figure, simulate, summarize
from moonrt.scheduler.workload import load_trace, maxvio, sample_counts, save_trace, synthetic

SMALL = ["--experts", "32", "--ranks", "4", "--top-k", "4", "--tokens", "64", "--steps", "4", "--layers", "2",
         "--quiet"]


@pytest.mark.parametrize("kind", ["uniform", "lognormal", "zipf"])
def test_synthetic_counts_are_valid_topk_routing(kind: str) -> None:
    wl = synthetic(kind, num_experts=32, num_ranks=4, top_k=4, tokens_per_rank=64, steps=3, layers=2,
                   zipf_s=2.0, seed=1)
    assert wl.counts.shape == (3, 2, 4, 32) and wl.counts.dtype == np.int64
    assert (wl.counts.sum(-1) == 64 * 4).all()
    assert (wl.counts >= 0).all() and (wl.counts <= 64).all()  # a token picks an expert at most once
    again = synthetic(kind, num_experts=32, num_ranks=4, top_k=4, tokens_per_rank=64, steps=3, layers=2,
                      zipf_s=2.0, seed=1)
    np.testing.assert_array_equal(wl.counts, again.counts)


def test_sample_counts_respects_per_token_cap() -> None:
    shares = np.array([0.9, 0.05, 0.03, 0.02] + [0.0] * 4)
    c = sample_counts(shares / shares.sum(), 3, 10, 4, np.random.default_rng(0))
    assert (c.sum(1) == 40).all() and (c <= 10).all()


def test_maxvio() -> None:
    assert maxvio(np.array([2, 2, 2, 2])) == 0.0
    assert maxvio(np.array([4, 3, 1, 0])) == pytest.approx(1.0)
    assert maxvio(np.zeros(3)) == 0.0


def test_trace_roundtrip_and_errors(tmp_path) -> None:
    wl = synthetic("zipf", num_experts=16, num_ranks=4, top_k=2, tokens_per_rank=8, steps=2, layers=3)
    path = tmp_path / "t.npz"
    save_trace(path, wl.counts, top_k=2, layer_ids=np.array([3, 7, 11]))
    back = load_trace(path)
    np.testing.assert_array_equal(back.counts, wl.counts)
    assert back.top_k == 2 and back.tokens_per_rank is None
    np.savez(tmp_path / "one_layer.npz", counts=wl.counts[:, 0].astype(np.int32))
    assert load_trace(tmp_path / "one_layer.npz").counts.shape == (2, 1, 4, 16)
    np.savez(tmp_path / "bad.npz", routes=wl.counts)
    with pytest.raises(ValueError, match="no 'counts' array"):
        load_trace(tmp_path / "bad.npz")
    np.savez(tmp_path / "neg.npz", counts=-wl.counts)
    with pytest.raises(ValueError, match="negative"):
        load_trace(tmp_path / "neg.npz")
    np.savez(tmp_path / "flt.npz", counts=wl.counts.astype(np.float32))
    with pytest.raises(ValueError, match="expected integer"):
        load_trace(tmp_path / "flt.npz")


def test_simulate_metrics_match_direct_computation() -> None:
    wl = synthetic("lognormal", num_experts=32, num_ranks=4, top_k=4, tokens_per_rank=64, steps=4, layers=2,
                   sigma=1.5, seed=3)
    res = simulate(wl, ["none", "eplb", "eplb-oracle", "moonep"], progress=False, token_bytes=1, expert_bytes=1)
    np.testing.assert_array_equal(res["moonep"]["balance"], 1.0)  # exact balance, every step and layer
    for t in range(4):
        for l in range(2):
            c = wl.counts[t, l]
            groups = c.sum(0).reshape(4, 8).sum(1)
            assert res["none"]["balance"][t, l] == pytest.approx(groups.max() / groups.mean())
            assert res["maxvio"][t, l] == pytest.approx(maxvio(c.sum(0)))
            moved = c.sum() - sum(c[r, 8 * r: 8 * r + 8].sum() for r in range(4))
            assert res["none"]["token_bytes"][t, l] == pytest.approx(moved)
            oracle = bl.rank_loads(c.sum(0), bl.eplb(c.sum(0), 4, 32))
            assert res["eplb-oracle"]["balance"][t, l] == pytest.approx(oracle.max() / oracle.mean())
    assert (res["moonep"]["copies_max"] <= 8).all()
    assert (res["moonep"]["prefetch_bytes"] == res["moonep"]["copies_mean"] * 4).all()
    s = summarize(res, ["none", "moonep"], warmup=1)
    assert s["moonep"]["balance_max"] == 1.0 and s["none"]["balance_mean"] > 1.0
    # dedup model: one row per (token, destination) never exceeds one per assignment, bytes = rows * token_bytes
    rec = res["moonep"]
    assert (rec["token_rows_dedup"] <= rec["token_rows"]).all() and (rec["token_rows_dedup"] > 0).all()
    np.testing.assert_array_equal(rec["token_rows"], rec["token_bytes"])
    np.testing.assert_array_equal(rec["token_rows_dedup"], rec["token_bytes_dedup"])
    tm = transfer_matrix(wl.counts[3, 1], plan(wl.counts[3, 1]).cuts)
    dd = dedup_rows(tm, 4)
    assert rec["token_rows_dedup"][3, 1] == pytest.approx(dd.sum() - np.trace(dd))
    assert s["moonep"]["token_rows_per_layer_step_dedup"] < s["moonep"]["token_rows_per_layer_step"]


def test_dedup_rows_model() -> None:
    """The count-only dedup model: ``s (1 - (1 - q)^k)`` rows per (source, destination) with independent draws."""
    s, k = 10, 4
    np.testing.assert_allclose(dedup_rows(np.array([[s * k, 0], [0, s * k]]), k), [[s, 0], [0, s]])  # all on one rank
    uniform = np.full((1, 4), s * k / 4)
    np.testing.assert_allclose(dedup_rows(uniform, k), s * (1 - (3 / 4) ** k))
    tm = np.array([[5, 3], [0, 8]])
    np.testing.assert_array_equal(dedup_rows(tm, 1), tm)  # k = 1: nothing to merge


def test_cli_writes_table_json_png(tmp_path, capsys) -> None:
    out = tmp_path / "sim"
    assert main(["ep-sim", *SMALL, "--workload", "zipf", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "moonep" in text and "eplb" in text and "balance" in text
    doc = json.loads((out / "summary.json").read_text())
    assert doc["summary"]["moonep"]["balance_max"] == 1.0
    assert set(doc["per_step"]) == {"none", "eplb", "eplb-oracle", "moonep"}
    png = (out / "ep_sim.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def _policy_artists(ax) -> dict:
    """Policy name -> (rgb colour, marker or None for a bar, the artist) of one ep-sim panel, from legend labels."""
    from matplotlib.colors import to_rgb

    out = {}
    for ln in ax.get_lines():
        out[ln.get_label().split(" ")[0]] = (to_rgb(ln.get_color()), ln.get_marker(), ln)
    for c in ax.containers:
        out[c.get_label().split(" ")[0]] = (to_rgb(c.patches[0].get_facecolor()), None, c)
    return out


def test_figure_one_style_per_policy_oracle_not_hidden() -> None:
    """ep_sim.png: each policy has one colour (and marker) in both panels, the policies' colours differ, the EPLB
    oracle line differs from MoonEP's in style and is drawn over it; a curve equal to another's says so."""
    wl = synthetic("zipf", num_experts=32, num_ranks=4, top_k=4, tokens_per_rank=64, steps=4, layers=2, seed=0)
    pols = list(POLICIES)
    res = simulate(wl, pols, progress=False)
    fig = figure(res, pols, "title")
    left, right = (_policy_artists(ax) for ax in fig.axes[:2])
    assert set(pols) <= set(left) and set(pols) <= set(right)
    for p in pols:
        assert left[p][0] == right[p][0], p
        if right[p][1] is not None:
            assert left[p][1] == right[p][1], p
    assert len({left[p][0] for p in pols}) == len(pols)
    for side in (left, right):
        o, m = side["eplb-oracle"][2], side["moonep"][2]
        assert (o.get_linestyle(), o.get_marker(), o.get_linewidth()) != (m.get_linestyle(), m.get_marker(),
                                                                            m.get_linewidth())
        assert o.get_zorder() > m.get_zorder()
    same = dict(res, moonep=res["eplb-oracle"])
    fig = figure(same, pols, "title")
    for ax in fig.axes[:2]:
        assert "moonep (= eplb-oracle)" in [t.get_text() for t in ax.get_legend().get_texts()]


def test_cli_on_trace_with_unequal_rank_totals(tmp_path, capsys) -> None:
    """A recorded trace whose ranks routed different token counts: MoonEP uses floor/ceil targets."""
    rng = np.random.default_rng(0)
    counts = np.stack([np.stack([rng.multinomial(int(rng.integers(1, 30)) * 2, np.ones(16) / 16, size=1)[0]
                                 for _ in range(4)]) for _ in range(3)])[:, None]  # [3, 1, 4, 16]
    save_trace(tmp_path / "tr.npz", counts, top_k=2)
    out = tmp_path / "o"
    assert main(["ep-sim", "--trace", str(tmp_path / "tr.npz"), "--policies", "none,moonep", "--out", str(out),
                 "--no-plot", "--quiet", "--warmup", "0"]) == 0
    doc = json.loads((out / "summary.json").read_text())
    totals = counts.sum((1, 2, 3))  # [steps]
    expected = np.ceil(totals / 4) / (totals / 4)  # floor/ceil targets: max rank = ceil(total / R)
    np.testing.assert_allclose(np.array(doc["per_step"]["moonep"]["balance"])[:, 0], expected)
    assert not (out / "ep_sim.png").exists()


def test_cli_bad_policy(tmp_path, capsys) -> None:
    assert main(["ep-sim", *SMALL, "--policies", "moonep,magic", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--policies: 'moonep,magic'" in err
