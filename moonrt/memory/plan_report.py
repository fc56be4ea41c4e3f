"""Outputs of a memory plan (:class:`~moonrt.memory.plan.Plan`): the per-rank table ``moonrt mem-plan``
prints, its JSON form and a figure: per rank, device memory stacked by term under the budget line, and the memory
offloaded to host, disk or a peer (all in GiB)."""

from __future__ import annotations

import dataclasses
import textwrap
from pathlib import Path
from typing import BinaryIO

from moonrt.memory.model_memory import GIB
from moonrt.memory.plan import Plan


def table(p: Plan) -> str:
    """Per-rank breakdown in GiB."""
    qat = any("qat_fake_quant" in r.static for r in p.ranks)  # --qat: the fake-quantized weight copies
    cols = ["rank", "layers", "inflight", "params", "grads", "optim", "slots", "comm", *(["qat"] if qat else []),
            "act(keep)", "act", "remote_in", "total", "host", "remote_out", "added_ms"]
    terms = ("params", "grads", "optimizer", "slot_pool", "comm_buffers", *(("qat_fake_quant",) if qat else ()))
    lines = [" ".join(f"{c:>10}" for c in cols)]
    for r in p.ranks:
        s = r.static
        vals = [str(r.rank), f"{len(r.layers)}", f"{r.in_flight_microbatches:.2f}",
                *(f"{s[k] / GIB:.2f}" for k in terms),
                f"{r.activations_keep / GIB:.2f}", f"{r.activations / GIB:.2f}", f"{r.remote_in / GIB:.2f}",
                f"{r.total / GIB:.2f}", f"{r.host / GIB:.2f}", f"{r.remote_out / GIB:.2f}", f"{r.added_s * 1e3:.1f}"]
        lines.append(" ".join(f"{v:>10}" for v in vals))
    lines.append(f"{p.message}; solver {p.solver}, {p.solve_s:.2f} s")
    return "\n".join(lines)


def plan_json(p: Plan) -> dict:
    d = dataclasses.asdict(p)
    for r, rp in zip(d["ranks"], p.ranks):
        r["total"] = rp.total
    return d


# Device terms stacked per rank, bottom to top, with their legend names.
DEVICE_TERMS = {"params": "params", "grads": "grads", "optimizer": "optimizer states",
                "slot_pool": "MoonEP slot pool", "comm_buffers": "comm buffers",
                "qat_fake_quant": "QAT fake-quantized weights", "activations": "activations",
                "remote_in": "remote in (a peer's offload)"}
# Memory a rank's plan puts off its device: hatched bars in the lower panel.
OFFLOAD_TERMS = {"host": ("host (offloaded activations)", "//"), "disk": ("disk (offloaded activations)", "xx"),
                 "remote_out": ("remote out (on the peer's device)", "..")}


def _wrap(text: str, chars: int) -> str:
    """``text`` wrapped at ``; `` and spaces into lines of at most ``chars`` characters (a longer word stays)."""
    return "\n".join(textwrap.wrap(text, chars, break_long_words=False, break_on_hyphens=False))


def figure(p: Plan, header: str = ""):
    """The plan as a :class:`matplotlib.figure.Figure` (not saved), all in GiB. Upper panel: per rank, device memory
    stacked by term (:data:`DEVICE_TERMS`), the budget line and, for a plan that does not fit, the minimum budget;
    its y-limit covers every bar and both lines. Lower panel: per rank, the memory moved off the device
    (:data:`OFFLOAD_TERMS`: host always, disk and remote where used), hatched. ``header`` (the job's layout line)
    and the plan's message are wrapped to the figure width; legends sit right of the panels."""
    from matplotlib.figure import Figure

    n = len(p.ranks)
    width = min(20.0, max(9.0, 0.42 * n + 5.0))
    head, title = _wrap(header, int(width * 9)), _wrap(p.message, int(width * 10))
    lines = (head.count("\n") + 1 if head else 0) + title.count("\n") + 1
    fig = Figure(figsize=(width, 6.6 + 0.2 * lines), layout="constrained")  # panels keep their height
    dev, off = fig.subplots(2, 1, sharex=True, height_ratios=(3, 1.4))
    xs = [r.rank for r in p.ranks]
    bottom = [0.0] * n
    for t, name in DEVICE_TERMS.items():
        if t == "qat_fake_quant" and not any(t in r.static for r in p.ranks):
            continue
        vals = [(r.static[t] if t in r.static else getattr(r, t)) / GIB for r in p.ranks]
        dev.bar(xs, vals, bottom=bottom, width=0.8, label=name)
        bottom = [b + v for b, v in zip(bottom, vals)]
    top = max([*bottom, p.budget_gib])
    dev.axhline(p.budget_gib, color="k", ls="--", lw=1.2, label=f"budget {p.budget_gib:g} GiB")
    if not p.feasible and p.min_budget_gib:
        dev.axhline(p.min_budget_gib, color="#c44e52", ls=":", lw=1.5,
                    label=f"minimum budget {p.min_budget_gib:.1f} GiB")
        top = max(top, p.min_budget_gib)
    dev.set_ylim(0, top * 1.08)
    dev.set_ylabel("device GiB")
    dev.set_title(title, fontsize=10, loc="left")
    handles, labels = dev.get_legend_handles_labels()  # the lines, then the stack top first, as drawn
    order = [i for i, h in enumerate(handles) if not hasattr(h, "patches")]
    order += [i for i, h in enumerate(handles) if hasattr(h, "patches")][::-1]
    dev.legend([handles[i] for i in order], [labels[i] for i in order], fontsize=9, loc="upper left",
               bbox_to_anchor=(1.01, 1.0))
    bottom = [0.0] * n
    for t, (name, hatch) in OFFLOAD_TERMS.items():
        vals = [getattr(r, t) / GIB for r in p.ranks]
        if t != "host" and not any(vals):  # host always (an empty tier says "nothing offloaded"); others if used
            continue
        off.bar(xs, vals, bottom=bottom, width=0.8, label=name, hatch=hatch, facecolor="white",
                edgecolor={"host": "#4c72b0", "disk": "#8172b3", "remote_out": "#937860"}[t])
        bottom = [b + v for b, v in zip(bottom, vals)]
    off.set_ylim(0, max(1.0, max(bottom, default=0.0)) * 1.12)
    if not any(bottom):
        off.text(0.5, 0.5, "nothing moved off the device", transform=off.transAxes, ha="center", va="center",
                 fontsize=10, color="0.4")
    off.set_ylabel("off-device GiB")
    off.set_xlabel("pipeline rank")
    off.set_xticks(xs)
    off.legend(fontsize=9, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    if head:
        fig.suptitle(head, fontsize=10)
    return fig


def plot(p: Plan, path: str | Path | BinaryIO, header: str = "") -> None:
    """:func:`figure` as PNG to ``path`` (a file name, or an open binary file: what :func:`moonrt.config.write_new`
    hands its writer)."""
    figure(p, header).savefig(path, dpi=100, format="png")


__all__ = ["DEVICE_TERMS", "OFFLOAD_TERMS", "figure", "plan_json", "plot", "table"]
