"""Outputs of a memory plan (:class:`~moonrt.memory.plan.Plan`): the per-rank table ``moonrt mem-plan``
prints, its JSON form and a stacked-bar plot per rank with the budget line (all in GiB)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import BinaryIO

from moonrt.memory.model_memory import GIB
from moonrt.memory.plan import Plan


def table(p: Plan) -> str:
    """Per-rank breakdown in GiB."""
    cols = ["rank", "layers", "inflight", "params", "grads", "optim", "slots", "comm", "act(keep)", "act", "remote_in",
            "total", "host", "remote_out", "added_ms"]
    lines = [" ".join(f"{c:>10}" for c in cols)]
    for r in p.ranks:
        s = r.static
        vals = [str(r.rank), f"{len(r.layers)}", f"{r.in_flight_microbatches:.2f}",
                *(f"{s[k] / GIB:.2f}" for k in ("params", "grads", "optimizer", "slot_pool", "comm_buffers")),
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


def plot(p: Plan, path: str | Path | BinaryIO) -> None:
    """Stacked bars per rank (device memory by term) with the budget line, as PNG to ``path`` (a file name, or an
    open binary file: what :func:`moonrt.config.write_new` hands its writer)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    terms = ["params", "grads", "optimizer", "slot_pool", "comm_buffers"]
    fig, ax = plt.subplots(figsize=(max(6, 0.5 * len(p.ranks) + 3), 4))
    xs = [r.rank for r in p.ranks]
    bottom = [0.0] * len(xs)
    for t in terms + ["activations", "remote_in"]:
        vals = [(r.static[t] if t in r.static else getattr(r, t)) / GIB for r in p.ranks]
        ax.bar(xs, vals, bottom=bottom, label=t)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.axhline(p.budget_gib, color="k", linestyle="--", label=f"budget {p.budget_gib:.0f} GiB")
    ax.set_xlabel("pipeline rank")
    ax.set_ylabel("GiB")
    ax.set_title(p.message[:90])
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=100, format="png")
    plt.close(fig)


__all__ = ["plan_json", "plot", "table"]
