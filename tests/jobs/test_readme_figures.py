"""README's quick-start figures are a recorded run's (issue 49 item 7): the table after ``<!-- quick-start-table -->``
in README.md equals the JSON record after ``<!-- quick-start-run -->`` in benchmarks/RESULTS.md at the table's
rounding, and the summary line README quotes for that run equals the record at the program's 3 decimals."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
RESULTS = ROOT / "benchmarks" / "RESULTS.md"
COLUMNS = {"eval loss (nats/token)": "eval_loss", "train loss (mean of the last 10 steps)": "train_loss_mean_last_10"}
"""README table header -> the record's field (a ``{step: value}`` map)."""


def quick_start_record(text: str) -> dict:
    """The JSON block after ``<!-- quick-start-run -->`` (steps as ints)."""
    found = re.search(r"<!-- quick-start-run -->\n```json\n(.*?)\n```", text, flags=re.S)
    assert found, "benchmarks/RESULTS.md: no <!-- quick-start-run --> JSON block"
    record = json.loads(found[1])
    for key in COLUMNS.values():
        record[key] = {int(step): value for step, value in record[key].items()}
    return record


def quick_start_table(text: str) -> tuple[list[str], list[list[str]]]:
    """The header and rows of the Markdown table after ``<!-- quick-start-table -->``."""
    found = re.search(r"<!-- quick-start-table -->\n((?:\|.*\|\n)+)", text)
    assert found, "README.md: no table after <!-- quick-start-table -->"
    rows = [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in found[1].splitlines()]
    assert set(rows[1]) <= {"---"}, rows[1]
    return rows[0], [r for r in rows[2:]]


def _number(cell: str) -> tuple[float, int] | None:
    """The first number of a cell and its decimals (``**2.11** vs ...`` -> (2.11, 2)); None for ``-``."""
    if cell == "-":
        return None
    found = re.match(r"\**(\d+\.(\d+))\**", cell)
    assert found, f"README quick-start table: cell {cell!r} is not a number or '-'"
    return float(found[1]), len(found[2])


def _mismatches(readme: str, results: str) -> list[str]:
    record = quick_start_record(results)
    header, rows = quick_start_table(readme)
    assert header[0] == "step" and all(h in COLUMNS for h in header[1:]), header
    bad = []
    steps = [int(r[0]) for r in rows]
    for col, name in enumerate(header[1:], start=1):
        field = record[COLUMNS[name]]
        shown = {int(r[0]) for r in rows if _number(r[col]) is not None}
        if shown != set(field):
            bad.append(f"{name}: README shows steps {sorted(shown)}, the record has {sorted(field)}")
        for r in rows:
            got = _number(r[col])
            if got is not None and int(r[0]) in field and got[0] != round(field[int(r[0])], got[1]):
                bad.append(f"{name} at step {r[0]}: README {r[col]!r}, the record {field[int(r[0])]}")
    if steps != sorted(record["eval_loss"]):
        bad.append(f"steps: README {steps}, the record {sorted(record['eval_loss'])}")
    last = rows[-1][1]
    entropy = re.search(r"unigram entropy \**(\d+\.(\d+))\**", last)
    if not entropy or float(entropy[1]) != round(record["unigram_entropy"], len(entropy[2])):
        bad.append(f"unigram entropy: README {last!r}, the record {record['unigram_entropy']}")
    # the summary line README quotes, at the program's 3 decimals
    final, mean, h = record["eval_loss"][record["steps"]], record["train_loss_mean_last_10"][record["steps"]], \
        record["unigram_entropy"]
    quoted = (f"eval loss {final:.3f} nats/token vs held-out unigram entropy {h:.3f} ({final - h:+.3f})",
              f"train loss {mean:.3f} (mean of the last 10 steps)")
    flat = " ".join(readme.split())
    bad += [f"README does not quote the summary as {q!r}" for q in quoted if q not in flat]
    # the fp32 run the bf16 comparison names is this run
    fp32 = re.search(r"eval loss (\d\.\d{3}) in bf16 vs (\d\.\d{3}) in fp32", flat)
    if not fp32 or float(fp32[2]) != final:
        bad.append(f"README's bf16 comparison quotes fp32 {fp32 and fp32[2]}, the record {final}")
    return bad


def test_readme_quick_start_figures_are_the_recorded_runs() -> None:
    assert _mismatches(README.read_text(), RESULTS.read_text()) == []


@pytest.mark.parametrize(("old", "new"), [
    ("| 100 | 2.38 |", "| 100 | 2.39 |"), ("| 1.87 |", "| 1.89 |"), ("**2.11** vs", "**2.12** vs"),
    ("| 150 | 2.19 | 2.03 |\n", ""), ("| 150 | 2.19 | 2.03 |", "| 150 | 2.19 | - |")])
def test_a_stale_readme_figure_is_found(old: str, new: str) -> None:
    readme = README.read_text()
    assert old in readme
    assert _mismatches(readme.replace(old, new, 1), RESULTS.read_text())


def test_a_changed_record_is_found() -> None:
    results = RESULTS.read_text()
    assert '"150": 2.192' in results
    assert _mismatches(README.read_text(), results.replace('"150": 2.192', '"150": 2.212', 1))
