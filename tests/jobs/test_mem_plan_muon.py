"""``moonrt mem-plan --optimizer muon|adamw``: ZeRO-1 optimizer bytes are Muon's (one fp32 momentum, 4 per
parameter) or AdamW's (two fp32 moments, 8; the fp32 parameters are the master weights); ``--optim-bytes`` still
overrides."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from moonrt.jobs.mem_plan import OPTIM_STATE_BYTES, add_arguments, run

TINY = ["--model", "k3_tiny", "--pp", "2", "--ep", "1", "--cp", "1", "--vpp", "1", "--schedule", "1f1b",
        "--seq-len", "4096", "--microbatches", "8", "--budget-gib", "1", "--solver", "greedy"]


def _optimizer_bytes(tmp_path: Path, name: str, *extra: str) -> list[float]:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert run(parser.parse_args([*TINY, "--out", str(tmp_path / name), *extra])) in (0, 1)
    plan = json.loads((tmp_path / name / "budget1" / "plan.json").read_text())
    return [r["static"]["optimizer"] for r in plan["ranks"]]


def test_muon_state_bytes_are_half_of_adamw(tmp_path: Path, capsys) -> None:
    assert OPTIM_STATE_BYTES == {"muon": 4, "adamw": 8}
    muon = _optimizer_bytes(tmp_path, "muon", "--optimizer", "muon")
    adamw = _optimizer_bytes(tmp_path, "adamw", "--optimizer", "adamw")
    assert muon == _optimizer_bytes(tmp_path, "default")  # K3 trains with Muon: the default
    assert all(m > 0 and a == 2 * m for m, a in zip(muon, adamw)), (muon, adamw)
    assert _optimizer_bytes(tmp_path, "explicit", "--optimizer", "adamw", "--optim-bytes", "4") == muon
