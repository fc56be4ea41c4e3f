"""``moonrt train --zero 1`` (ZeRO-1, K3_SYSTEMS §10): resumed from a single-process checkpoint, one step
equals the single process's; each rank holds 1/dp of the AdamW state; bad ``--zero`` is a clear error.

Runs (teacher-forced, the same scheme as ``tests/jobs/test_pp_train.py``): a single-process job trains step 1
and checkpoints; copies of that directory are resumed for step 2 by the single process, by ``--zero 1``
on dp 2 (2 gloo ranks), by ``--pp 2 --zero 1`` on 4 ranks (dp 2 inferred; the pseudo-queries' gradients
are summed over the pipeline before the reduce-scatter and counted once in the norm) and by ``--zero 1``
in one process (a no-op). The dp 2 step sums two half-batches' gradients (a different fp32 summation
order than one backward of the whole batch, ~1e-7 relative) and clips with an fp64 norm where the
single process uses torch's fp32 one (~1e-6 relative off at k3_tiny's size); one resumed AdamW step
keeps that order of difference, so loss, every parameter and every optimizer moment agree within 1e-5
relative (normwise per tensor). The checkpoint of the ZeRO run is in the single-process layout (the
moments gathered from the shards).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from jobs.helpers import (
    FLAGS,
    _adamw_bytes_per_rank,
    _assert_same_step,
    _ckpt,
    _cli,
    _close,
    _here,
    _metrics,
    _ranks,
    _run,
)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_zero1_resumes_a_single_process_checkpoint_and_matches_it(tmp_path: Path, single_process_steps: Path) -> None:
    shared = single_process_steps  # base (step 1) and the single process's step 2, as in test_pp_train
    common = ("train", *FLAGS, "--resume", "--until", "2")
    runs = {"zero_one_process": _here(*common, "--out", "zero_one_process", "--zero", "1"),  # in this process
            "zero_dp2": _ranks(2, *common, "--out", "zero_dp2", "--metrics", "zero_dp2.jsonl", "--zero", "1"),
            "zero_pp2_dp2": _ranks(4, *common, "--out", "zero_pp2_dp2", "--metrics", "zero_pp2_dp2.jsonl",
                                   "--pp", "2", "--microbatches", "2", "--zero", "1")}
    for name in runs:
        shutil.copytree(shared / "base", tmp_path / name)
    _run(tmp_path, runs, timeout=1700)
    ref = _metrics(shared / "single.jsonl")[2]
    ref_ckpt = _ckpt(shared / "single")
    for name in ("zero_dp2", "zero_pp2_dp2"):
        _assert_same_step(tmp_path, name, ref, ref_ckpt)
    # dp 2: each rank holds half the moments (plus the step counts), not the replicated full state
    per_rank = _metrics(tmp_path / "zero_dp2.jsonl")[2]["optimizer_state_bytes"]
    half, full = _adamw_bytes_per_rank(2), _adamw_bytes_per_rank(1)
    assert per_rank == [half, half], (per_rank, half)
    assert half <= 0.51 * full, (half, full)
    # --pp 2 --zero 1: every rank holds a shard of its own stages only, together about the whole state once
    pp_bytes = _metrics(tmp_path / "zero_pp2_dp2.jsonl")[2]["optimizer_state_bytes"]
    assert len(pp_bytes) == 4 and max(pp_bytes) < 0.5 * full, (pp_bytes, full)
    # one process: --zero 1 changes nothing (no replicas to shard over)
    one = _ckpt(tmp_path / "zero_one_process")
    for part in ("model", "optimizer"):
        _close(one[part], ref_ckpt[part], f"zero_one_process.{part}")


@pytest.mark.parametrize("value", ["2", "-1"])
def test_zero_stage_other_than_0_or_1_is_a_clear_error(tmp_path: Path, value: str,
                                                       capfd: pytest.CaptureFixture[str]) -> None:
    code, out, err = _cli(["train", "--zero", value, "--steps", "1", "--no-progress", "--out", str(tmp_path)], capfd)
    assert code == 2, out + err
    assert f"parallel.zero (--zero) = {value}: expected 0 (replicated optimizer states) or 1" in err, err
    assert "Traceback" not in err
