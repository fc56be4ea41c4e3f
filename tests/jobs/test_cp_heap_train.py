"""``moonrt train --cp 2`` with KCP's summaries over the shm heap (``parallel.cp_transport``, issue 48 item 3).

Teacher-forced (the scheme of ``tests/jobs/test_compose_train.py``): a single-process job trains step 1 and
checkpoints; copies of that directory are resumed for step 2 by the single process, by ``--cp 2`` with the default
``cp_transport: auto`` (CPU ranks of one host: the heap) and by ``--cp 2`` with ``cp_transport: collectives``. The
heap run records that it resolved to ``shm``; its step 2 equals the single process's within 1e-5 relative (loss,
grad norm, every parameter and optimizer moment, normwise per tensor: KCP's fp32 summation order, ~1e-7); and it
equals the collectives run bitwise (the heap moves the same bytes into the same merges).

Also: ``cp_transport`` is in ``config.yaml``, free on resume, and a bad value is one line, exit 2, nothing written.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from jobs.helpers import _assert_same_step, _ckpt, _cli, _equal, _here, _metrics, _ranks, _run

FLAGS = ["--steps", "4", "--seed", "0", "--batch-size", "4", "--seq-len", "32", "--eval-every", "100", "--lr", "1e-3",
         "--threads", "1", "--no-progress", "--set", "optim.eval_windows=4"]




@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_cp2_over_the_heap_matches_the_single_process_and_the_collectives_bitwise(tmp_path: Path) -> None:
    _run(tmp_path, {"base": _here("train", *FLAGS, "--until", "1", "--out", "base")})
    common = ("train", *FLAGS, "--resume", "--until", "2")
    runs = {"single": _here(*common, "--out", "single", "--metrics", "single.jsonl"),
            "cp2_heap": _ranks(2, *common, "--cp", "2", "--out", "cp2_heap", "--metrics", "cp2_heap.jsonl"),
            "cp2_coll": _ranks(2, *common, "--cp", "2", "--set", "parallel.cp_transport=collectives",
                               "--out", "cp2_coll", "--metrics", "cp2_coll.jsonl")}
    for name in runs:
        shutil.copytree(tmp_path / "base", tmp_path / name)
    _run(tmp_path, runs, timeout=1400)
    ref, ref_ckpt = _metrics(tmp_path / "single.jsonl")[2], _ckpt(tmp_path / "single")
    heap = _assert_same_step(tmp_path, "cp2_heap", ref, ref_ckpt)
    coll = _metrics(tmp_path / "cp2_coll.jsonl")[2]
    assert heap["cp_transport"] == "shm" and coll["cp_transport"] == "collectives", (heap, coll)
    assert heap["cp_bytes_sent"] == coll["cp_bytes_sent"] > 0, (heap, coll)
    assert (heap["loss"], heap["grad_norm"]) == (coll["loss"], coll["grad_norm"]), (heap, coll)
    a, b = _ckpt(tmp_path / "cp2_heap"), _ckpt(tmp_path / "cp2_coll")
    _equal(a["model"], b["model"], "model")
    _equal(a["optimizer"], b["optimizer"], "optimizer")


def test_cp_transport_bad_value_is_one_line_and_writes_nothing(tmp_path: Path,
                                                                capfd: pytest.CaptureFixture[str]) -> None:
    code, out, err = _cli(["train", "--steps", "1", "--no-progress", "--out", str(tmp_path / "run"),
                           "--set", "parallel.cp_transport=cuda"], capfd)
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and ("parallel.cp_transport (--set) = 'cuda': expected one of 'auto', 'shm', "
                                "'collectives'") in lines[0], err
    assert not (tmp_path / "run").exists()


def test_cp_transport_is_recorded_and_free_on_resume() -> None:
    from moonrt.config import to_dict
    from moonrt.jobs.train.config import JobConfig
    from moonrt.jobs.train.resume import check_resume

    assert to_dict(JobConfig())["parallel"]["cp_transport"] == "auto"  # what config.yaml records
    old = to_dict(JobConfig())
    del old["parallel"]["cp_transport"]  # a config written before the field existed
    new = to_dict(JobConfig())
    new["parallel"]["cp_transport"] = "collectives"
    check_resume(old, new, step=1)
    check_resume(new, to_dict(JobConfig()), step=1)
