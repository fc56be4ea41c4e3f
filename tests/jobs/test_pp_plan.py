"""``moonrt pp-plan``: the JSON equals the closed forms in an aligned layout, the PNG is
written with a size bounded for any schedule and labels that fit their boxes, and bad input is one line on stderr
with exit 2."""

from __future__ import annotations

import json

import pytest

from moonrt.cli import main
from moonrt.jobs.pp_plan import LABEL_PT, MAX_HEIGHT_IN, MAX_WIDTH_IN, compress, plan_dict, timeline_figure


@pytest.mark.parametrize("p,v,n_p,b,kind", [(4, 2, 2, 3, "interleaved"), (2, 3, 1, 4, "interleaved"),
                                            (4, 1, 3, 2, "1f1b"), (3, 2, 2, 2, "zbv")])
def test_json_equals_formulas_aligned(tmp_path, capsys, p, v, n_p, b, kind):
    c = p * v
    m = 2 * p
    f = tmp_path / "plan.json"
    rc = main(["pp-plan", "--model", "k3_tiny", "--pp", str(p), "--vpp", str(v), "--microbatches", str(m),
               "--schedule", kind, "--num-layers", str(c * n_p * b), "--attn-res-block", str(b), "--json", str(f)])
    assert rc == 0
    assert "per micro-batch: blocks naive" in capsys.readouterr().out
    d = json.loads(f.read_text())
    blocks = d["blocks"]
    tip = p * n_p + 1 if kind == "zbv" else 0  # V placement: hop P-1 -> P stays on rank P-1
    assert blocks["naive_total"] == n_p * c * (c - 1) // 2 + (c - 1) - tip
    assert blocks["naive_max_hop"] == (c - 1) * n_p + 1
    if kind != "zbv":  # the closed form is for loop placement
        assert blocks["cached_total"] == n_p * p * (p - 1) // 2 + (p - 1) + (v - 1) * p * (p - 1) * n_p
        assert blocks["cached_max_hop"] == (p - 1) * n_p + 1
    else:  # V placement: the tip hop is local, every block still reaches every later rank once
        assert blocks["cached_total"] < blocks["naive_total"]
    if kind == "1f1b":
        assert d["bubble_fraction"] == pytest.approx((p - 1) / (m + p - 1))
        assert d["peak_live"] == {str(r): p - r for r in range(p)}
    if kind == "interleaved":
        assert d["peak_live"] == {str(r): min(2 * (p - r - 1) + (v - 1) * p + 1, m * v) for r in range(p)}
    assert set(d["actions"]) == {str(r) for r in range(p)}
    ops = "FIW" if kind == "zbv" else "FB"
    assert all(len(a) == len(ops) * m * v for a in d["actions"].values())
    # bytes: (blocks + partial) * mbs * seq * hidden * 2 (bf16); aligned cuts carry no partial block
    assert d["bytes"]["block"] == 4096 * 128 * 2
    assert d["bytes"]["cached_total"] == blocks["cached_total"] * d["bytes"]["block"]
    per_rank = sum(x["cached_blocks"] for x in d["sent_per_step"].values())
    assert per_rank == blocks["cached_total"] * m


def test_unaligned_k3_tiny_and_png(tmp_path, capsys):
    out = tmp_path / "o"
    rc = main(["pp-plan", "--model", "k3_tiny", "--pp", "2", "--vpp", "2", "--microbatches", "4",
               "--schedule", "interleaved", "--out", str(out)])
    assert rc == 0
    d = json.loads((out / "plan.json").read_text())
    # 9 layers in 4 stages (2, 2, 2, 3), blocks of 4: stage 0 -> 1 carries the embedding and an open block
    assert [s["layers"] for s in d["stages"]] == [[0, 2], [2, 4], [4, 6], [6, 9]]
    assert d["hops"][0]["cached"] == [0] and d["hops"][0]["partial"]
    assert d["blocks"] == {"naive_total": 5, "cached_total": 2, "naive_max_hop": 2, "cached_max_hop": 1}
    png = (out / "timeline.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 2000


def _drawn(sim):
    """The timeline figure of ``sim``, drawn (text extents known), and its box labels per panel."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = timeline_figure(sim)
    FigureCanvasAgg(fig).draw()
    return fig, [ax.texts for ax in fig.axes]


def _assert_readable(fig, labels) -> None:
    """Every text is >= LABEL_PT (tick labels, legend, title >= 8 pt); box labels of one rank row do not overlap and
    stay inside their panel."""
    from matplotlib.text import Text

    texts = [t for t in fig.findobj(Text) if t.get_text() and t.get_visible()]
    assert texts and min(t.get_fontsize() for t in texts) >= LABEL_PT
    assert all(t.get_fontsize() >= 8 for t in texts if not any(t in row for row in labels))
    for ax, row in zip(fig.axes, labels):
        panel = ax.get_window_extent()
        by_rank: dict[float, list] = {}
        for t in row:
            by_rank.setdefault(t.get_position()[1], []).append(t.get_window_extent())
        for boxes in by_rank.values():
            boxes.sort(key=lambda b: b.x0)
            assert all(b.x0 >= panel.x0 - 0.5 and b.x1 <= panel.x1 + 0.5 for b in boxes)
            assert all(a.x1 <= b.x0 for a, b in zip(boxes, boxes[1:]))


def test_timeline_small_labels_every_action():
    _, sim = plan_dict(8, 4, 2, 2, 4, "interleaved", 1.0)
    fig, labels = _drawn(sim)
    compute = [sl for t in sim.timelines for sl in t if sl.action.op in ("F", "B", "I", "W")]
    assert len(fig.axes) == 1 and len(labels[0]) == len(compute)
    assert sorted(int(t.get_text()) for t in labels[0]) == sorted(sl.action.microbatch for sl in compute)
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend[:2] == ["F forward", "B backward"]
    _assert_readable(fig, labels)


def test_timeline_wraps_long_schedule_into_rows():
    _, sim = plan_dict(8, 4, 4, 2, 24, "interleaved", 1.0)  # makespan ~ 100 units: longer than one row
    fig, labels = _drawn(sim)
    w, h = fig.get_size_inches()
    assert len(fig.axes) >= 2 and w <= MAX_WIDTH_IN and h <= MAX_HEIGHT_IN
    assert all(row for row in labels)  # every row of time is labelled
    _assert_readable(fig, labels)


@pytest.mark.slow  # plans and renders a large pipeline schedule: CI runs it, the fast lane need not
def test_timeline_size_bounded_for_large_schedule():
    _, sim = plan_dict(64, 4, 32, 1, 256, "1f1b", 1.0)  # makespan ~ 830 units, 32 ranks: 3 rows at most
    fig = timeline_figure(sim)
    w, h = fig.get_size_inches() * fig.dpi
    assert w <= MAX_WIDTH_IN * fig.dpi and h <= MAX_HEIGHT_IN * fig.dpi and w * h <= 2000 * 3500
    assert len(fig.axes) > 1  # wrapped into rows of time, not one strip


def test_compress():
    assert compress(["F0", "F1", "F2", "B0", "F3", "B1", "B2", "B3"]) == "F0-2 B0 F3 B1-3"
    assert compress(["F0.0", "F1.0", "F0.1", "F1.1", "W3.1"]) == "F0-1.0 F0-1.1 W3.1"


@pytest.mark.parametrize("argv,msg", [
    (["--pp", "4", "--vpp", "2", "--schedule", "interleaved", "--microbatches", "2"],
     "--microbatches = 2: expected >= pp (4) for schedule 'interleaved'"),
    (["--pp", "4", "--vpp", "2", "--schedule", "interleaved", "--microbatches", "6"],
     "--microbatches = 6: expected a multiple of pp (4)"),
    (["--vpp", "2", "--schedule", "gpipe"], "--vpp = 2: expected 1 for schedule 'gpipe'"),
    (["--vpp", "2", "--schedule", "1f1b"], "--vpp = 2: expected 1 for schedule '1f1b'"),
    (["--schedule", "dualpipe"], "--schedule = 'dualpipe': expected one of gpipe, 1f1b, interleaved, zb, zbv"),
    (["--model", "k3_tiny", "--pp", "10"], "--pp = 10: pp * vpp = 10 stages, expected <= --num-layers (9)"),
    (["--model", "k2"], "--model = 'k2': expected one of k3, k3_tiny, dense_tiny"),
    (["--pp", "0"], "--pp = 0: expected an integer >= 1"),
    (["--attn-res-block", "0"], "--attn-res-block = 0: expected an integer >= 1"),
    (["--dtype", "fp8"], "--dtype = 'fp8': expected bf16 or fp32"),
])
def test_bad_input_exit_2_one_line(capsys, argv, msg):
    assert main(["pp-plan", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and msg in err, err


def test_peak_live_is_printed_in_micro_batches_as_mem_plan_counts_them(capsys):
    """Issue 49 item 9: pp-plan's table gives peak live activations in micro-batches (23.50 on rank 0 of K3's
    pp 16 vpp 2, mem-plan's ``inflight``), the live (micro-batch, chunk) pairs (47) in parentheses."""
    from moonrt.config import ParallelConfig
    from moonrt.memory.model_memory import JobLayout, rank_models
    from moonrt.models.k3.memory import kernel_profile
    from moonrt.models.k3.model.config import k3
    from moonrt.models.k3.spec import K3

    assert main(["pp-plan", "--model", "k3", "--pp", "16", "--vpp", "2", "--schedule", "interleaved",
                 "--microbatches", "32"]) == 0
    out = capsys.readouterr().out
    assert "peak live mb (chunks)" in out
    row0 = next(line.split() for line in out.splitlines() if line.split()[:2] == ["0", "0,16"])
    assert row0[3:5] == ["23.50", "(47)"], row0
    cfg = k3()
    layout = JobLayout(parallel=ParallelConfig(pp=16, vpp=2, ep=64, cp=64, microbatches=32, schedule="interleaved"),
                       seq_len=1 << 20)
    rms = rank_models(cfg, layout, K3.memory.param_sizes(cfg), kernel_profile(cfg))
    assert f"{rms[0].in_flight_microbatches:.2f}" == row0[3]  # the figure mem-plan prints as inflight
