"""``moonrt train --ep N`` on N ranks (``helpers._ranks``) trains like the single process (K3_SYSTEMS §6).

Both runs see the same global batch every step (a function of seed and step); with ``--ep N`` each rank
trains on 1/N of the batch rows, holds E/N home experts, and MoonEP moves the latent activations (and
copies of hot experts) between ranks; dense gradients are summed over the ranks, expert gradients stay
with their home rank, the clip uses the global norm. What this test is for: every rank computes exactly
``s * k`` rows per MoE layer at every step (where the unbalanced home placement would not), the routing
traces of both runs (``--routing-trace``) hold the same per-expert counts, and the first steps' losses
agree within 1e-4 relative. Exact parity (1e-5 on loss, parameters and moments) is the teacher-forced
test in ``tests/jobs/test_compose_train.py``; long loss curves prove nothing (tiny fp32 summation-order
differences grow chaotically: at the default lr 4e-3 even the single process against itself with two
accumulated micro-batches drifts to 3e-3 by step 20), so this run is short and uses ``--lr 1e-3``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from jobs.helpers import _here, _ranks, _run

from moonrt.models.k3.model.config import k3_tiny
from moonrt.scheduler.workload import load_trace

BATCH, SEQ, STEPS = 4, 32, 5
FLAGS = ["--steps", str(STEPS), "--seed", "0", "--batch-size", str(BATCH), "--seq-len", str(SEQ), "--eval-every", "100",
         "--threads", "1", "--no-progress", "--lr", "1e-3"]


def _moonrt(*args: str) -> list[str]:
    return [sys.executable, "-m", "moonrt.cli", *args]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_ep_training_matches_single_process_loss_curve(tmp_path: Path) -> None:
    flags = FLAGS
    # the single process is the reference: in this process (test_pp_train._here)
    runs: dict[int, Any] = {1: _here("train", *flags, "--metrics", "m1.jsonl", "--out", "r1", "--routing-trace",
                                     "t1.npz")}
    for n in (2, 4):
        runs[n] = _ranks(n, "train", "--ep", str(n), *flags, "--metrics", f"m{n}.jsonl", "--out", f"r{n}",
                         "--routing-trace", f"t{n}.npz")
    _run(tmp_path, {f"--ep {n}": cmd for n, cmd in runs.items()}, timeout=840)
    metrics = {n: [json.loads(line) for line in (tmp_path / f"m{n}.jsonl").read_text().splitlines()] for n in runs}
    ref = metrics[1]
    assert [r["step"] for r in ref] == list(range(1, STEPS + 1))
    cfg = k3_tiny()
    k = cfg.num_experts_per_token
    num_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    t1 = load_trace(tmp_path / "t1.npz")
    assert t1.counts.shape == (STEPS, num_moe, 1, cfg.num_experts)
    for n in (2, 4):
        got = metrics[n]
        assert [r["step"] for r in got] == list(range(1, STEPS + 1))
        for x, y in zip(ref, got):
            assert abs(x["loss"] - y["loss"]) <= 1e-4 * abs(x["loss"]), (n, x["step"], x["loss"], y["loss"])
            assert y["ep_rows"] == [BATCH * SEQ // n * k] * n, "every EP rank computes exactly s*k rows"
            assert y["ep_rows_max"] == BATCH * SEQ // n * k <= y["ep_rows_unbalanced_max"]
            # parallel.ep_dedup (default on): at most one token row per assignment
            assert 0 < y["ep_token_rows_sent"] <= y["ep_assignments_sent"] < y["ep_token_bytes_sent"]
        assert abs(ref[-1]["eval_loss"] - got[-1]["eval_loss"]) <= 1e-4 * ref[-1]["eval_loss"]
        tn = load_trace(tmp_path / f"t{n}.npz")
        assert tn.counts.shape == (STEPS, num_moe, n, cfg.num_experts) and tn.top_k == k
        assert (tn.counts.sum(-1) == BATCH * SEQ // n * k).all()
        np.testing.assert_array_equal(tn.counts.sum(2), t1.counts[:, :, 0])
    # k3_tiny's early routing is skewed: the hottest home group would get far more than its share
    assert max(r["ep_rows_unbalanced_max"] for r in metrics[2]) > BATCH * SEQ // 2 * k


def test_ep_degree_that_does_not_fit_the_world_is_a_clear_error(tmp_path: Path) -> None:
    out = subprocess.run(_moonrt("train", "--ep", "2", "--steps", "1", "--no-progress", "--out", str(tmp_path)),
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "ranks per data-parallel replica: expected a divisor of the world size 1" in out.stderr, out.stderr
