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
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from jobs.helpers import EVAL_SMALL, RTOL, _assert_same_step, _ckpt, _cli, _here, _metrics, _ranks, _run
from jobs.helpers import FLAGS as HELPER_FLAGS

from moonrt.models.k3.model.config import k3_tiny
from moonrt.scheduler.workload import load_trace

BATCH, SEQ, STEPS = 4, 32, 5
FLAGS = ["--steps", str(STEPS), "--seed", "0", "--batch-size", str(BATCH), "--seq-len", str(SEQ), "--eval-every", "100",
         "--threads", "1", "--no-progress", "--lr", "1e-3"]


HELPER_BATCH, HELPER_SEQ = (int(HELPER_FLAGS[HELPER_FLAGS.index(f) + 1]) for f in ("--batch-size", "--seq-len"))
"""``helpers.FLAGS``' batch rows and sequence length (the teacher-forced runs)."""


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


def test_ep_degree_that_does_not_fit_the_world_is_a_clear_error(tmp_path: Path, capfd) -> None:
    """Refused before a job starts: in this process (``_cli``), not a new interpreter's imports."""
    code, out, err = _cli(["train", "--ep", "2", "--steps", "1", "--no-progress", "--out", str(tmp_path)], capfd)
    assert code == 2, out + err
    assert "ranks per data-parallel replica: expected a divisor of the world size 1" in err, err


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_alltoall_dispatcher_trains_like_moonep_and_the_single_process(tmp_path: Path) -> None:
    """``--ep 2 --set parallel.ep_dispatcher=alltoall`` (the plain all-to-all baseline) trains: teacher-forced from
    a single-process step-1 checkpoint (``test_compose_train``'s scheme), its step 2 equals the single process's
    and MoonEP's within ``RTOL`` (loss, grad norm, every parameter and moment), since both placements compute the
    same math; its rows follow the routing (the hottest home rank) where MoonEP's are balanced, and the field is
    recorded in the run's config.yaml and checkpoint."""
    flags = [*HELPER_FLAGS, *EVAL_SMALL]
    _run(tmp_path, {"base": _here("train", *flags, "--until", "1", "--out", "base")})
    common = ("train", *flags, "--resume", "--until", "2")
    runs = {"single": _here(*common, "--out", "single", "--metrics", "single.jsonl"),
            "moonep": _ranks(2, *common, "--ep", "2", "--out", "moonep", "--metrics", "moonep.jsonl"),
            "alltoall": _ranks(2, *common, "--ep", "2", "--set", "parallel.ep_dispatcher=alltoall", "--out",
                               "alltoall", "--metrics", "alltoall.jsonl")}
    for name in runs:
        shutil.copytree(tmp_path / "base", tmp_path / name)
    _run(tmp_path, runs, timeout=840)
    ref, ref_ckpt = _metrics(tmp_path / "single.jsonl")[2], _ckpt(tmp_path / "single")
    got = {name: _assert_same_step(tmp_path, name, ref, ref_ckpt) for name in ("moonep", "alltoall")}
    assert abs(got["alltoall"]["loss"] - got["moonep"]["loss"]) <= RTOL * abs(got["moonep"]["loss"])
    s_k = HELPER_BATCH * HELPER_SEQ // 2 * k3_tiny().num_experts_per_token
    assert got["moonep"]["ep_rows"] == [s_k, s_k], "MoonEP: every rank computes s*k rows"
    home = got["alltoall"]
    assert sum(home["ep_rows"]) == 2 * s_k and home["ep_rows_max"] == home["ep_rows_unbalanced_max"] > s_k, home
    ckpt_cfg = _ckpt(tmp_path / "alltoall")["config"]["parallel"]
    assert ckpt_cfg["ep_dispatcher"] == "alltoall" and ckpt_cfg["ep"] == 2
    recorded = yaml.safe_load((tmp_path / "alltoall" / "config.yaml").read_text())
    assert recorded["parallel"]["ep_dispatcher"] == "alltoall"


def test_unknown_ep_dispatcher_is_a_one_line_error(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    code, out, err = _cli(["train", "--steps", "1", "--no-progress", "--out", str(tmp_path / "run"),
                           "--set", "parallel.ep_dispatcher=deepep"], capfd)
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "parallel.ep_dispatcher (--set) = 'deepep': expected one of 'moonep', 'alltoall'" \
        in lines[0], err
    assert not (tmp_path / "run").exists(), "bad input writes nothing"


def test_ep_dispatcher_is_free_on_resume_like_the_degrees() -> None:
    """A checkpoint of one placement resumes under the other (same math), and a checkpoint written before the field
    existed counts as ``moonep``."""
    from moonrt.config import to_dict
    from moonrt.jobs.train.config import JobConfig
    from moonrt.jobs.train.resume import check_resume

    old = to_dict(JobConfig())
    del old["parallel"]["ep_dispatcher"]  # a config written before the field existed
    new = to_dict(JobConfig())
    new["parallel"]["ep_dispatcher"] = "alltoall"
    check_resume(old, new, step=1)
    check_resume(new, to_dict(JobConfig()), step=1)


def test_layout_head_names_the_baseline_placement() -> None:
    from moonrt.comm.mesh import MeshLayout
    from moonrt.config import ParallelConfig
    from moonrt.jobs.train.assemble import layout_table

    rows = [{"coords": {"pp": 0, "dp": 0, "ep": r, "cp": 0}, "batch": r, "stages": [0], "host": "h"} for r in range(2)]
    heads = {kind: layout_table(MeshLayout(2, ParallelConfig(ep=2, ep_dispatcher=kind)), rows).splitlines()[0]
             for kind in ("moonep", "alltoall")}
    assert heads["alltoall"].startswith("moonrt train: layout pp 1 x dp 1 x ep 2 x cp 1 = 2 ranks, "
                                        "ep_dispatcher alltoall, zero 0;"), heads
    assert "ep_dispatcher" not in heads["moonep"], heads
