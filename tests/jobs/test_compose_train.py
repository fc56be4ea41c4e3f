"""Every parallel dimension composed in ``moonrt train`` (K3_SYSTEMS §10): pp x dp x ep x cp, with or without
ZeRO-1, resumed from a single-process checkpoint, one step equals the single process's; the layout is printed
once at start in the mesh's documented rank order; degrees that do not divide the world or the model are a
clear error.

Runs (teacher-forced, the scheme of ``tests/jobs/test_pp_train.py`` and ``tests/jobs/test_zero_train.py``): a
single-process job trains step 1 and checkpoints; copies of that directory are resumed for step 2 by the
single process and by each layout, all at once:

- ``--ep 2 --zero 1`` on 4 ranks (dp 2 inferred): dense parameters sharded over 4 replicas, experts over 2;
- ``--pp 2 --ep 2 --zero 1`` on 8 ranks (dp 2 inferred): ZeRO-1 inside each stage, MoonEP inside ZeRO-1;
- ``--pp 2 --ep 2 --cp 2`` on 8 ranks: KCP and MoonEP inside each stage;
- ``--pp 2 --vpp 2 --cp 2`` on 4 ranks: interleaved 1F1B (4 stages over 2 ranks) with KCP.

Then the sharded checkpoint the 8-rank ``--pp 2 --ep 2 --zero 1`` run wrote at step 2 resumes for step 3 in one
process, in ``--ep 4`` and in ``--pp 2 --cp 2`` (issue 13's layouts for sharded checkpoints), each against the
single process's own step 3 (one 8-rank run serves both checks: these runs are the slowest of the suite).

The global batch is 8 rows of 32 tokens, so every layout has at least one row per batch shard and each
pipeline splits its rows into micro-batches. A layout's step sums partial gradients in another fp32 order
than the single process's one backward (micro-batches, batch shards, sequence slices: ~1e-7 relative) and
clips with an fp64 norm where the single process uses torch's fp32 one (~1e-6 relative at k3_tiny's size);
one resumed AdamW step keeps that order of difference, so loss, grad norm, every parameter and every
optimizer moment agree within 1e-5 relative (normwise per tensor, :func:`test_pp_train._close`).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from jobs.helpers import (
    RTOL,
    _adamw_bytes_per_rank,
    _assert_same_step,
    _ckpt,
    _close,
    _here,
    _launch,
    _metrics,
    _ranks,
    _run,
)

from moonrt.jobs.checkpoint import sharded as checkpoint_dcp
from moonrt.jobs.checkpoint import store
from moonrt.jobs.train.resume import BUILDER

FLAGS = ["--steps", "4", "--seed", "0", "--batch-size", "8", "--seq-len", "32", "--eval-every", "100", "--lr", "1e-3",
         "--threads", "1", "--no-progress", "--set", "optim.eval_windows=8"]
"""The job every run here takes. Its eval (at each run's last step; not compared here: layouts' evals are compared
in ``tests/jobs/test_pp_train.py``, ``test_ep_train.py`` and ``test_cp_train.py``) is one batch of 8 held-out
windows, not the default 32: every data-parallel replica evaluates all windows, and 32 are ~40% of a two-step run."""

LAYOUTS: dict[str, tuple[int, list[str]]] = {
    "ep2_zero1": (4, ["--ep", "2", "--zero", "1"]),
    "pp2_ep2_zero1": (8, ["--pp", "2", "--ep", "2", "--zero", "1", "--microbatches", "2"]),
    "pp2_ep2_cp2": (8, ["--pp", "2", "--ep", "2", "--cp", "2", "--microbatches", "2"]),
    "pp2_vpp2_cp2": (4, ["--pp", "2", "--vpp", "2", "--cp", "2", "--microbatches", "4"]),
}


@pytest.mark.slow
@pytest.mark.timeout(3000)
def test_composed_layouts_resume_a_single_process_checkpoint_and_match_it(tmp_path: Path) -> None:
    _run(tmp_path, {"base": _here("train", *FLAGS, "--until", "1", "--out", "base")})
    common = ("train", *FLAGS, "--resume", "--until", "2")
    runs = {"single": _here(*common, "--out", "single", "--metrics", "single.jsonl")}
    for name, (n, flags) in LAYOUTS.items():
        runs[name] = _ranks(n, *common, "--out", name, "--metrics", f"{name}.jsonl", *flags)
    for name in runs:
        shutil.copytree(tmp_path / "base", tmp_path / name)
    _run(tmp_path, runs, timeout=2900)
    ref = _metrics(tmp_path / "single.jsonl")[2]
    ref_ckpt = _ckpt(tmp_path / "single")
    for name, (_, flags) in LAYOUTS.items():
        got = _assert_same_step(tmp_path, name, ref, ref_ckpt)
        if "--pp" in flags:  # the pipeline ran (2 pp ranks reporting)
            assert len(got["pp_blocks_sent"]) == 2 and got["pp_blocks_sent"][0] > 0, (name, got)
        if "--ep" in flags:  # MoonEP ran (2 EP ranks reporting)
            assert len(got["ep_rows"]) == 2, (name, got)
        if "--cp" in flags:
            assert got["cp_bytes_sent"] > 0, (name, got)
    # ZeRO-1 composed with EP (and the pipeline): no rank holds the full AdamW state
    full = _adamw_bytes_per_rank(1)
    for name, n in (("ep2_zero1", 4), ("pp2_ep2_zero1", 8)):
        per_rank = _metrics(tmp_path / f"{name}.jsonl")[2]["optimizer_state_bytes"]
        assert len(per_rank) == n and max(per_rank) < 0.5 * full, (name, per_rank, full)
    _resume_the_8_rank_sharded_checkpoint_elsewhere(tmp_path)


def _resume_the_8_rank_sharded_checkpoint_elsewhere(tmp_path: Path) -> None:
    """Step 3 from ``pp2_ep2_zero1``'s sharded step-2 checkpoint (``moonrt.jobs.checkpoint.sharded``) in one process, in
    ``--ep 4`` and in ``--pp 2 --cp 2``, against the single process continued from its own step 2: two steps of
    summation-order differences (~1e-7 each), within 1e-5. The save passed DCP shards only (no rank more than a
    quarter of the AdamW state) and every stored byte was written by exactly one rank."""
    root = tmp_path / "pp2_ep2_zero1"
    marker = checkpoint_dcp.read_marker(checkpoint_dcp.resolve(root / "checkpoint"))
    assert marker["step"] == 2 and marker["layout"] == {"world": 8, "dp": 2, "pp": 2, "vpp": 1, "ep": 2, "cp": 1,
                                                        "zero": 1}, marker
    state = store.read_state(root, BUILDER)
    full = sum(t.numel() * t.element_size() for st in state["optimizer"]["state"].values() for t in st.values())
    assert max(r["optimizer_bytes"] for r in marker["ranks"]) < 0.25 * full, (marker["ranks"], full)
    assert sum(r["written_bytes"] for r in marker["ranks"]) == marker["bytes"], marker["ranks"]
    common = ("train", *FLAGS, "--resume", "--until", "3")
    runs = {"single3": (1, "single", []), "from8_one": (1, "pp2_ep2_zero1", []),
            "from8_ep4": (4, "pp2_ep2_zero1", ["--ep", "4"]),
            "from8_pp2_cp2": (4, "pp2_ep2_zero1", ["--pp", "2", "--cp", "2", "--microbatches", "2"])}
    cmds = {}
    for name, (n, src, flags) in runs.items():
        shutil.copytree(tmp_path / src, tmp_path / name)
        args = (*common, "--out", name, "--metrics", f"{name}.jsonl", *flags)
        cmds[name] = _ranks(n, *args) if n > 1 else _here(*args)  # one process: in this one (no new interpreter)
    _run(tmp_path, cmds, timeout=2900)
    ref, ref_ckpt = _metrics(tmp_path / "single3.jsonl")[3], _ckpt(tmp_path / "single3")
    for name in runs:
        got = _metrics(tmp_path / f"{name}.jsonl")[3]
        assert abs(got["loss"] - ref["loss"]) <= RTOL * abs(ref["loss"]), (name, got["loss"], ref["loss"])
        ck = _ckpt(tmp_path / name)
        assert ck["step"] == 3, name
        _close(ck["model"], ref_ckpt["model"], f"{name}.model")


def _expected_coords(rank: int, pp: int, dp: int, ep: int, cp: int) -> tuple[int, int, int, int]:
    """``(pp, dp, ep, cp)`` of ``rank`` from the rank order documented in :mod:`moonrt.comm.mesh`:
    ``rank = ((pp_idx * dp + dp_idx) * ep + ep_idx) * cp + cp_idx`` (written out here, not the mesh's code)."""
    for c in range(cp):
        for e in range(ep):
            for d in range(dp):
                for s in range(pp):
                    if ((s * dp + d) * ep + e) * cp + c == rank:
                        return s, d, e, c
    raise AssertionError(rank)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_train_prints_the_layout_once_in_the_mesh_rank_order(tmp_path: Path) -> None:
    """``--pp 2 --ep 2`` on 4 ranks (dp 1) with progress on: rank 0 prints one table, every rank's coordinates
    as the mesh's documented order gives them, its batch shard (index in ``dp_ep``) and its pipeline stage."""
    flags = [f for f in FLAGS if f != "--no-progress"]
    out = subprocess.run(_launch(4, "train", *flags, "--until", "1", "--out", "o", "--pp", "2", "--ep", "2",
                                 "--microbatches", "2"), cwd=tmp_path, capture_output=True, text=True, timeout=850)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    heads = [line for line in text.splitlines() if "moonrt train: layout" in line]
    assert heads == ["[rank 0] moonrt train: layout pp 2 x dp 1 x ep 2 x cp 1 = 4 ranks, zero 0; "
                     "rank = ((pp * 1 + dp) * 2 + ep) * 1 + cp"], heads
    rows = {}
    for line in text.splitlines():
        m = re.fullmatch(r"\[rank 0\]\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)/(\d+)\s+(\S+)\s+\S+", line)
        if m:
            rows[int(m[1])] = tuple(map(int, m.groups()[1:7])) + (m[8],)
    assert sorted(rows) == [0, 1, 2, 3], text[-4000:]
    for r, (pp, dp, ep, cp, batch, shards, stages) in rows.items():
        assert (pp, dp, ep, cp) == _expected_coords(r, 2, 1, 2, 1), (r, rows[r])
        assert (batch, shards) == (ep, 2), (r, rows[r])  # dp 1: the batch shard is the EP index
        assert stages == str(pp), (r, rows[r])  # 1F1B: pipeline rank i runs stage i
    assert "[rank 0]     pp: [0,2] [1,3]  (pipeline send/recv)" in text, text[-4000:]
    # dp 1, cp 1: the batch-row, EP, dense-replica and stage-replica groups are the same pairs
    assert "[rank 0]     dp_ep = ep = dp_ep_cp = ep_cp: [0,1] [2,3]  (" in text, text[-4000:]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("n, flags, message", [
    # 6 ranks per data-parallel replica do not divide 8 (dp cannot be inferred)
    (8, ["--pp", "2", "--ep", "3", "--microbatches", "2"],
     "parallel = pp 2 x ep 3 x cp 1 = 6 ranks per data-parallel replica: expected a divisor of the world size 8"),
    # more sequence slices than tokens (uneven slices are allowed: --cp 3 of 32 tokens runs)
    (4, ["--cp", "4", "--seq-len", "3"], "parallel.cp (--cp) = 4: expected at most optim.seq_len (--seq-len) = 3"),
])
def test_degrees_that_do_not_divide_the_world_or_the_model_are_one_clear_line(tmp_path: Path, n: int,
                                                                               flags: list[str], message: str) -> None:
    """Every rank of ``moonrt launch`` refuses before it imports torch (``JobConfig.fit_world``), so the launcher
    ends with the ranks' exit 2 and one line, whatever the world size."""
    out = subprocess.run(_launch(n, "train", *FLAGS, "--out", "o", *flags), cwd=tmp_path, capture_output=True,
                         text=True, timeout=550)
    assert out.returncode == 2, out.stdout + out.stderr
    assert f"moonrt train: error: {message}" in out.stderr, out.stderr
    assert "Traceback" not in out.stdout + out.stderr
