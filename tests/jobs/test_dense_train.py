"""``moonrt train --model dense_tiny``: the second model client (``moonrt/models/dense``) trains through the same
job, parts and checkpoints as K3, selected only by its registry record.

- It learns: 60 steps at the default lr take the held-out loss (nats/token) at least 20% below the first
  step's training loss (byte-level text: the first step's loss is ~ln 256 = 5.55 nats; the unigram entropy of the
  corpus is ~3.2, so a 20% drop is reached only by learning the byte distribution, not by luck).
- Every layout it can use equals the single process for one step, teacher-forced (``tests/jobs/test_pp_train.py``'s
  scheme): a single-process run trains step 1 and checkpoints; copies resume step 2 by one process, by ``--pp 2``
  (1F1B, 2 micro-batches: the residual stream crosses the cut as the executor's blocks), by ``--zero 1`` on dp 2
  and by ``--cp 2`` (softmax attention gathers ``[k | v]`` of earlier slices, as K3's MLA gathers its latent).
  Each layout sums the same token losses and gradients in another fp32 order (~1e-7 relative); one AdamW step keeps
  that order, so loss, every parameter and every moment agree within ``RTOL`` = 1e-5 (normwise per tensor).
- Its checkpoints resume (the resumed runs above load the single-process file) and its config round-trips.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from jobs.helpers import _assert_same_step, _ckpt, _here, _metrics, _ranks, _run

DENSE = ["--model", "dense_tiny", "--steps", "4", "--seed", "0", "--batch-size", "4", "--seq-len", "32",
         "--eval-every", "100", "--lr", "1e-3", "--threads", "1", "--no-progress"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_dense_tiny_learns(tmp_path: Path) -> None:
    _run(tmp_path, {"learn": _here("train", "--model", "dense_tiny", "--steps", "60", "--eval-every", "60",
                                   "--threads", "1", "--no-progress", "--out", "learn", "--metrics", "m.jsonl")})
    rows = _metrics(tmp_path / "m.jsonl")
    first, last = rows[1]["loss"], rows[60]["eval_loss"]
    assert last <= 0.8 * first, (first, last)
    cfg = (tmp_path / "learn" / "config.yaml").read_text()
    assert "model: dense_tiny" in cfg, cfg


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_dense_layouts_resume_the_single_process_checkpoint_and_match_it(tmp_path: Path) -> None:
    _run(tmp_path, {"base": _here("train", *DENSE, "--until", "1", "--out", "base")})
    common = ("train", *DENSE, "--resume", "--until", "2")
    runs = {"single": _here(*common, "--out", "single", "--metrics", "single.jsonl"),
            "pp2": _ranks(2, *common, "--out", "pp2", "--metrics", "pp2.jsonl", "--pp", "2", "--microbatches", "2"),
            "zero_dp2": _ranks(2, *common, "--out", "zero_dp2", "--metrics", "zero_dp2.jsonl", "--zero", "1"),
            "cp2": _ranks(2, *common, "--out", "cp2", "--metrics", "cp2.jsonl", "--cp", "2")}
    for name in runs:
        shutil.copytree(tmp_path / "base", tmp_path / name)
    _run(tmp_path, runs, timeout=1700)
    ref = _metrics(tmp_path / "single.jsonl")[2]
    ref_ckpt = _ckpt(tmp_path / "single")
    assert not any(k.startswith("layers.0.moe") for k in ref_ckpt["model"])  # really the dense model
    for name in ("pp2", "zero_dp2", "cp2"):
        _assert_same_step(tmp_path, name, ref, ref_ckpt)
    # the ZeRO run held half the AdamW moments per rank
    per_rank = _metrics(tmp_path / "zero_dp2.jsonl")[2]["optimizer_state_bytes"]
    assert len(per_rank) == 2 and per_rank[0] == per_rank[1], per_rank
    assert json.loads((tmp_path / "single.jsonl").read_text().splitlines()[-1])["step"] == 2
