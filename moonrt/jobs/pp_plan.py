"""``moonrt pp-plan``: a pipeline schedule and its Block AttnRes traffic, without processes.

A job: it takes the model's depth, AttnRes block size and width from a preset's pipeline layout (the registry,
:mod:`moonrt.models`; :class:`moonrt.parallel.model.PipelineLayout`),
builds the schedule (:mod:`moonrt.scheduler.pipeline`: generator, lowering, validator, unit-cost simulator)
and the cache-based communication plan (:mod:`moonrt.scheduler.attnres_comm`) for an even contiguous split
of the decoder layers into ``pp * vpp`` stages, and prints

- per rank: its stages and layers, the compute actions run-length compressed, idle fraction and peak live
  activations in micro-batches (a micro-batch's activations on a rank are its ``vpp`` chunks': the unit of
  ``moonrt mem-plan``'s ``inflight`` column), with the live (micro-batch, chunk) pairs in parentheses;
- per forward hop: blocks and bytes naive vs cached (per micro-batch; a block is one ``[mbs, seq, hidden]``
  tensor; the open partial block crosses too and counts in bytes, not in blocks);
- totals, and blocks / bytes each rank sends per step (micro-batches x per-micro-batch counts; the
  backward sends the same blocks' gradients back, not counted).

``--json FILE`` writes the same as a dict (:func:`plan_dict`), ``--out DIR`` a PNG timeline and the JSON, each
file created exclusively (never through a symlink); one that exists is refused before any work unless ``--force``.
Bad input: one line on stderr naming the flag, exit 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, BinaryIO

from moonrt.config import existing_outputs, schedule_cells_error, write_new
from moonrt.models import presets
from moonrt.parallel.model import MAX_LAYERS
from moonrt.scheduler.attnres_comm import even_layer_ranges, hop_plan
from moonrt.scheduler.pipeline import ALIASES, SCHEDULES, SimResult, build_schedule, lower, simulate


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument
    g("--model", default="k3", help="model preset: " + ", ".join(presets()) + " (depth, AttnRes block size, width; "
      "default k3)")
    g("--pp", type=int, default=4, help="pipeline ranks (default 4)")
    g("--vpp", type=int, default=1, help="chunks (virtual stages) per rank: 1 for gpipe/1f1b, >= 2 for "
      "interleaved, 2 for zbv (default 1)")
    g("--microbatches", type=int, default=8, help="micro-batches per step (interleaved: a multiple of --pp; "
      "default 8)")
    g("--schedule", default="1f1b", help=f"one of {', '.join(SCHEDULES)} (zb = ZB1P; default 1f1b)")
    g("--num-layers", type=int, default=None, help="decoder layers (default: the preset's)")
    g("--attn-res-block", type=int, default=None, help="decoder layers per AttnRes block (default: the preset's)")
    g("--seq-len", type=int, default=4096, help="tokens per sequence, for bytes (default 4096)")
    g("--micro-batch-size", type=int, default=1, help="sequences per micro-batch, for bytes (default 1)")
    g("--hidden", type=int, default=None, help="hidden size, for bytes (default: the preset's)")
    g("--dtype", default="bf16", help="activation dtype on the wire: bf16 or fp32 (default bf16)")
    g("--json", default="", help="write the plan as JSON to this new file")
    g("--out", default="", help="directory for timeline.png and plan.json (created if missing)")
    g("--force", action="store_true", help="replace existing output files (default: refuse them, exit 2)")


def compress(labels: list[str]) -> str:
    """Run-length form of action labels: consecutive micro-batches of one op and chunk -> ``F0-3`` / ``F0-3.1``."""
    out: list[str] = []
    run: tuple[str, str, int, int] | None = None  # (op, chunk suffix, first mb, last mb)

    def parse(lab: str) -> tuple[str, str, int]:
        i = next(k for k, ch in enumerate(lab) if ch.isdigit())
        mb, _, chunk = lab[i:].partition(".")
        return lab[:i], ("." + chunk) if chunk else "", int(mb)

    def flush() -> None:
        if run is not None:
            op, ch, a, b = run
            out.append(f"{op}{a}{ch}" if a == b else f"{op}{a}-{b}{ch}")

    for lab in labels:
        op, ch, mb = parse(lab)
        if run is not None and run[0] == op and run[1] == ch and run[3] + 1 == mb:
            run = (op, ch, run[2], mb)
        else:
            flush()
            run = (op, ch, mb, mb)
    flush()
    return " ".join(out)


def plan_dict(num_layers: int, block_size: int, pp: int, vpp: int, microbatches: int, schedule: str,
              block_bytes: float) -> tuple[dict[str, Any], SimResult]:
    """The plan of ``moonrt pp-plan`` as a JSON-ready dict and the simulation it came from.

    Raises ValueError naming the field for bad input (see :func:`build_schedule`, :func:`hop_plan`).
    """
    if num_layers < 1:
        raise ValueError(f"num_layers = {num_layers}: expected an integer >= 1")
    if block_size < 1:
        raise ValueError(f"attn_res_block = {block_size}: expected an integer >= 1")
    sch = build_schedule(schedule, pp, microbatches, vpp)
    if sch.num_stages > num_layers:
        raise ValueError(f"pp * vpp = {sch.num_stages}: expected <= num_layers ({num_layers}), one layer per stage "
                         "at least")
    sim = simulate(sch)
    ranges = even_layer_ranges(num_layers, sch.num_stages)
    plans = {m: hop_plan(ranges, block_size, sch.rank_of, m) for m in ("naive", "cached")}
    hops = []
    sent = {r: {"naive_blocks": 0, "cached_blocks": 0, "naive_bytes": 0.0, "cached_bytes": 0.0} for r in range(pp)}
    for s in range(sch.num_stages - 1):
        src, dst = sch.rank_of(s), sch.rank_of(s + 1)
        h: dict[str, Any] = {"from_stage": s, "to_stage": s + 1, "from_rank": src, "to_rank": dst,
                             "partial": plans["cached"].partial[s]}
        for m, p in plans.items():
            h[m] = list(p.sends[s])
            h[f"{m}_bytes"] = p.bytes_per_hop(block_bytes)[s]
            sent[src][f"{m}_blocks"] += len(p.sends[s]) * microbatches
            sent[src][f"{m}_bytes"] += h[f"{m}_bytes"] * microbatches
        hops.append(h)
    n, c = plans["naive"], plans["cached"]
    nb, cb = n.bytes_per_hop(block_bytes), c.bytes_per_hop(block_bytes)
    low = lower(sch)
    d: dict[str, Any] = {
        "schedule": sch.kind, "pp": pp, "vpp": vpp, "microbatches": microbatches, "num_layers": num_layers,
        "attn_res_block": block_size, "placement": sch.placement,
        "stages": [{"stage": s, "rank": sch.rank_of(s), "layers": [r.start, r.stop]} for s, r in enumerate(ranges)],
        "blocks": {"naive_total": n.total, "cached_total": c.total, "naive_max_hop": n.max_hop,
                   "cached_max_hop": c.max_hop},
        "bytes": {"block": block_bytes, "naive_total": sum(nb), "cached_total": sum(cb),
                  "naive_max_hop": max(nb, default=0.0), "cached_max_hop": max(cb, default=0.0)},
        "hops": hops,
        "sent_per_step": {str(r): v for r, v in sent.items()},
        "held_blocks": {str(r): sorted(b) for r, b in c.held.items()},
        "bubble_fraction": sim.bubble_fraction,
        "makespan": sim.makespan,
        "idle_fraction": {str(r): sim.idle_fraction(r) for r in range(pp)},
        "peak_live": {str(r): sim.peak_live[r] for r in range(pp)},
        "peak_live_microbatches": {str(r): sim.peak_live_microbatches[r] for r in range(pp)},
        "actions": {str(r): sch.labels(r) for r in range(pp)},
        "lowered_actions": {str(r): low.labels(r) for r in range(pp)},
    }
    return d, sim


def table(d: dict[str, Any]) -> str:
    """Human-readable per-rank and per-hop tables of a :func:`plan_dict` result."""
    mib = 2.0**20
    lines = [f"schedule {d['schedule']} pp={d['pp']} vpp={d['vpp']} m={d['microbatches']} "
             f"layers={d['num_layers']} attn-res-block={d['attn_res_block']} placement={d['placement']}: "
             f"bubble {d['bubble_fraction']:.4f} (unit costs F=I=W=1, B=2)", "",
             f"{'rank':>4} {'stages':>10} {'layers':>14} {'peak live mb (chunks)':>21} {'idle':>6}  actions"]
    for r in range(d["pp"]):
        st = [x for x in d["stages"] if x["rank"] == r]
        lay = ",".join(f"{x['layers'][0]}-{x['layers'][1] - 1}" for x in st)
        live = f"{d['peak_live_microbatches'][str(r)]:.2f} ({d['peak_live'][str(r)]})"  # mem-plan's inflight, too
        lines.append(f"{r:>4} {','.join(str(x['stage']) for x in st):>10} {lay:>14} {live:>21} "
                     f"{d['idle_fraction'][str(r)]:>6.3f}  {compress(d['actions'][str(r)])}")
    lines += ["", f"{'hop':>7} {'ranks':>6} {'naive':>6} {'cached':>6} {'partial':>7} {'naive MiB':>10} "
              f"{'cached MiB':>10}  cached blocks"]
    for h in d["hops"]:
        if h["from_rank"] == h["to_rank"]:
            continue
        lines.append(f"{h['from_stage']:>3}->{h['to_stage']:<3} {h['from_rank']:>2}->{h['to_rank']:<2} "
                     f"{len(h['naive']):>6} {len(h['cached']):>6} {'yes' if h['partial'] else 'no':>7} "
                     f"{h['naive_bytes'] / mib:>10.2f} {h['cached_bytes'] / mib:>10.2f}  {h['cached']}")
    b, y = d["blocks"], d["bytes"]
    lines += ["", f"per micro-batch: blocks naive {b['naive_total']} (largest hop {b['naive_max_hop']}), cached "
              f"{b['cached_total']} (largest hop {b['cached_max_hop']}); MiB naive {y['naive_total'] / mib:.2f}, "
              f"cached {y['cached_total'] / mib:.2f} (block {y['block'] / mib:.2f} MiB)"]
    return "\n".join(lines)


OP_COLORS = {"F": "#4C72B0", "B": "#DD8452", "I": "#C44E52", "W": "#55A868"}
OP_NAMES = {"F": "F forward", "B": "B backward", "I": "I input-grad backward", "W": "W weight-grad backward"}
# Timeline layout, inches at DPI: the figure is at most MAX_WIDTH_IN wide and MAX_HEIGHT_IN tall; time wraps into
# rows of panels so one unit of time gets UNIT_IN where that fits; a box is labelled (LABEL_PT, micro-batch number)
# only where the label fits inside it.
DPI = 110
MAX_WIDTH_IN, MAX_HEIGHT_IN, UNIT_IN, LABEL_PT = 16.0, 30.0, 0.2, 7.0
_DIGIT_EM = 0.64  # DejaVu Sans digit advance / font size (a label's width estimate, a little over the true 0.636)


def _label_fits(width_pt: float, height_pt: float, text: str) -> bool:
    return width_pt >= len(text) * _DIGIT_EM * LABEL_PT + 2.0 and height_pt >= 1.25 * LABEL_PT


def timeline_figure(sim: SimResult):
    """PNG-ready timeline of ``sim`` (a :class:`matplotlib.figure.Figure`, not saved): per rank its compute actions
    as boxes coloured by op (odd chunks lighter), labelled with the micro-batch where the label fits the box.

    Size adapts to the schedule: width ``min(MAX_WIDTH_IN, ...)`` at ``UNIT_IN`` per unit of time; a longer
    makespan wraps into rows of panels (each all ranks over one time window) as far as ``MAX_HEIGHT_IN`` allows,
    and past that the boxes shrink and lose their labels. Rank rows are 0.26 in (less beyond 46 ranks, and
    then every k-th rank is named). A legend names the ops present."""
    import math

    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    sch = sim.schedule
    pp, span = sch.pp, max(sim.makespan, 1.0)
    rank_in = min(0.26, 12.0 / pp)
    panel_in = pp * rank_in + 0.45  # one time row: the rank rows and its tick labels
    head_in, left_in, right_in = 0.9, 0.75, 0.25
    plot_w = MAX_WIDTH_IN - left_in - right_in
    want_rows = math.ceil(span * UNIT_IN / plot_w)
    rows = max(1, min(want_rows, int((MAX_HEIGHT_IN - head_in) // panel_in)))
    window = span / rows
    if rows == 1 and span * UNIT_IN < plot_w:
        plot_w = max(5.0, span * UNIT_IN)
    width, height = plot_w + left_in + right_in, head_in + rows * panel_in
    fig = Figure(figsize=(width, height), dpi=DPI)
    fig.subplots_adjust(left=left_in / width, right=1 - right_in / width, top=1 - (head_in - 0.15) / height,
                        bottom=0.45 / height, hspace=0.45 / panel_in)
    axes = fig.subplots(rows, 1, squeeze=False)[:, 0]
    unit_pt, rank_pt = plot_w / window * 72, rank_in * 72
    edge = 0.4 if unit_pt >= 3 else 0.0
    step = max(1, math.ceil(pp / 32))
    labelled = 0
    for k, ax in enumerate(axes):
        lo, hi = k * window, (k + 1) * window
        boxes: dict[tuple[int, str, int], list[tuple[float, float]]] = {}
        for r, slots in enumerate(sim.timelines):
            for sl in slots:
                op = sl.action.op
                if op not in OP_COLORS or sl.end <= lo or sl.start >= hi:
                    continue
                boxes.setdefault((r, op, sl.action.chunk % 2), []).append((sl.start, sl.end - sl.start))
                a, b = max(sl.start, lo), min(sl.end, hi)
                text = str(sl.action.microbatch)
                if _label_fits((b - a) * unit_pt, rank_pt, text):
                    ax.text((a + b) / 2, r, text, ha="center", va="center", fontsize=LABEL_PT, color="white",
                            clip_on=True)
                    labelled += 1
        for (r, op, odd), segs in boxes.items():
            ax.broken_barh(segs, (r - 0.42, 0.84), facecolors=OP_COLORS[op], alpha=0.6 if odd else 1.0,
                           edgecolors="white", linewidths=edge, antialiaseds=edge > 0)
        ax.set_xlim(lo, hi)
        ax.set_ylim(pp - 0.5, -0.5)
        ax.set_yticks(range(0, pp, step), [f"rank {r}" for r in range(0, pp, step)], fontsize=8)
        ax.tick_params(axis="x", labelsize=8)
    axes[-1].set_xlabel("time (unit costs: F = I = W = 1, B = 2)", fontsize=9)
    ops = [op for op in OP_COLORS if any(sl.action.op == op for t in sim.timelines for sl in t)]
    handles = [Patch(color=OP_COLORS[op], label=OP_NAMES[op]) for op in ops]
    if sch.vpp > 1:
        handles.append(Patch(facecolor=OP_COLORS[ops[0]], alpha=0.6, label="odd chunk: lighter"))
    fig.legend(handles=handles, loc="upper right", bbox_to_anchor=(1 - right_in / width, 1 - 0.05 / height),
               ncol=len(handles), fontsize=8, frameon=False)
    title = (f"{sch.kind} pp={pp} vpp={sch.vpp} m={sch.microbatches}: bubble {sim.bubble_fraction:.3f}, makespan "
             f"{sim.makespan:g}" + (f", {rows} rows of {window:g} units" if rows > 1 else "")
             + ("" if labelled else "; boxes too narrow to label"))
    fig.text(left_in / width, 1 - 0.55 / height, title, fontsize=10, ha="left", va="bottom")
    return fig


def plot(sim: SimResult, path: Path | BinaryIO) -> None:
    """:func:`timeline_figure` as PNG to ``path`` (a file name or an open binary file)."""
    timeline_figure(sim).savefig(path, dpi=DPI, format="png")


def _fail(msg: str) -> int:
    print(f"pp-plan: {msg}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    registry = presets()
    if args.model not in registry:
        return _fail(f"--model = {args.model!r}: expected one of {', '.join(registry)}")
    spec = registry[args.model]
    layout = spec.pipeline_layout(spec.presets[args.model]())
    layers = layout.num_layers if args.num_layers is None else args.num_layers
    block = layout.block_size if args.attn_res_block is None else args.attn_res_block
    hidden = layout.width if args.hidden is None else args.hidden
    for flag, v in (("--pp", args.pp), ("--vpp", args.vpp), ("--microbatches", args.microbatches),
                    ("--num-layers", layers), ("--attn-res-block", block), ("--seq-len", args.seq_len),
                    ("--micro-batch-size", args.micro_batch_size), ("--hidden", hidden)):
        if v < 1:
            return _fail(f"{flag} = {v}: expected an integer >= 1")
    if layers > MAX_LAYERS:
        return _fail(f"--num-layers = {layers}: expected an integer <= {MAX_LAYERS} (MAX_LAYERS)")
    too_many = schedule_cells_error(args.pp, args.vpp, args.microbatches)
    if too_many:
        return _fail(f"--microbatches = {args.microbatches}: expected {too_many}")
    if ALIASES.get(args.schedule, args.schedule) not in SCHEDULES:
        return _fail(f"--schedule = {args.schedule!r}: expected one of {', '.join(SCHEDULES)}")
    if args.dtype not in ("bf16", "fp32"):
        return _fail(f"--dtype = {args.dtype!r}: expected bf16 or fp32")
    if args.pp * args.vpp > layers:
        return _fail(f"--pp = {args.pp}: pp * vpp = {args.pp * args.vpp} stages, expected <= --num-layers ({layers})")
    outputs = [(Path(args.json), "--json")] if args.json else []
    if args.out:
        outputs += [(Path(args.out) / "plan.json", "--out"), (Path(args.out) / "timeline.png", "--out")]
    if not args.force:
        for path, flag in outputs:
            if existing_outputs([path]):
                return _fail(f"{flag} = {str(args.json if flag == '--json' else args.out)!r}: {path} exists; expected "
                             "a new file (--force replaces it)")
    block_bytes = float(args.micro_batch_size * args.seq_len * hidden * (2 if args.dtype == "bf16" else 4))
    try:
        d, sim = plan_dict(layers, block, args.pp, args.vpp, args.microbatches, args.schedule, block_bytes)
    except ValueError as exc:
        msg = str(exc)
        for field in ("vpp", "microbatches", "pp", "schedule"):
            if msg.startswith(f"{field} = "):
                msg = "--" + msg
                break
        return _fail(msg)
    d["model"] = args.model
    print(table(d))
    targets = []
    if args.json:
        targets.append(Path(args.json))
    if args.out:
        out = Path(args.out)
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            return _fail(f"--out = {args.out!r}: expected a writable directory ({exc.strerror or exc})")
        targets.append(out / "plan.json")
    for t in targets:
        try:
            write_new(t, json.dumps(d, indent=1) + "\n", force=args.force)
        except OSError as exc:
            return _fail(f"--json = {str(t)!r}: cannot write ({exc.strerror or exc})")
        print(f"wrote {t}")
    if args.out:
        png = Path(args.out) / "timeline.png"
        try:
            write_new(png, lambda f: plot(sim, f), force=args.force)
        except OSError as exc:
            return _fail(f"--out = {args.out!r}: cannot write {png} ({exc.strerror or exc})")
        print(f"wrote {png}")
    return 0


__all__ = ["add_arguments", "compress", "plan_dict", "plot", "run", "table", "timeline_figure"]
