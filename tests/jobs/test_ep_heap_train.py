"""``moonrt train --ep 2`` with the rows moved over the shm symmetric heap (issue 48 item 2) trains like the single
process: teacher-forced from a single-process step-1 checkpoint (``test_compose_train``'s scheme), step 2 of
``--ep 2 --set parallel.ep_transport=shm`` and of ``--ep 2 --zero 1`` (``auto``: the heap on one host's CPUs)
equals the single process's within ``RTOL`` (loss, grad norm, every parameter and moment), and the heap run's
checkpoint equals the collectives run's bitwise (the heap moves the same rows in the same order); the run's
config.yaml records the backend ``auto`` resolved to. The heap composes: ``--ep 2 --cp 2`` and ``--pp 2 --ep 2``
(``auto``) match the single process the same way.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml
from jobs.helpers import EVAL_SMALL, FLAGS, _assert_same_step, _ckpt, _equal, _here, _metrics, _ranks, _run


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_ep_over_the_heap_trains_like_the_single_process_and_the_collectives(tmp_path: Path) -> None:
    flags = [*FLAGS, *EVAL_SMALL]
    _run(tmp_path, {"base": _here("train", *flags, "--until", "1", "--out", "base")})
    common = ("train", *flags, "--resume", "--until", "2")
    runs = {"single": _here(*common, "--out", "single", "--metrics", "single.jsonl"),
            "heap": _ranks(2, *common, "--ep", "2", "--set", "parallel.ep_transport=shm", "--out", "heap",
                           "--metrics", "heap.jsonl"),
            "collectives": _ranks(2, *common, "--ep", "2", "--set", "parallel.ep_transport=collectives", "--out",
                                  "collectives", "--metrics", "collectives.jsonl"),
            "zero": _ranks(4, *common, "--ep", "2", "--zero", "1", "--out", "zero", "--metrics", "zero.jsonl")}
    for name in runs:
        shutil.copytree(tmp_path / "base", tmp_path / name)
    _run(tmp_path, runs, timeout=1700)
    ref, ref_ckpt = _metrics(tmp_path / "single.jsonl")[2], _ckpt(tmp_path / "single")
    got = {name: _assert_same_step(tmp_path, name, ref, ref_ckpt) for name in ("heap", "collectives", "zero")}
    assert got["heap"]["loss"] == got["collectives"]["loss"], got
    assert got["heap"]["grad_norm"] == got["collectives"]["grad_norm"], got
    heap, coll = _ckpt(tmp_path / "heap"), _ckpt(tmp_path / "collectives")
    _equal(heap["model"], coll["model"], "model")
    _equal(heap["optimizer"], coll["optimizer"], "optimizer")
    assert len(got["zero"]["ep_rows"]) == 2 and got["heap"]["ep_token_bytes_sent"] > 0, got
    recorded = {name: yaml.safe_load((tmp_path / name / "config.yaml").read_text())["parallel"]["ep_transport"]
                for name in ("heap", "collectives", "zero")}
    assert recorded == {"heap": "shm", "collectives": "collectives", "zero": "shm"}, recorded


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_ep_over_the_heap_composes_with_cp_and_pp(tmp_path: Path) -> None:
    """``--ep 2 --cp 2`` and ``--pp 2 --ep 2`` (4 ranks each, ``parallel.ep_transport`` auto: the heap) match the
    single process teacher-forced within ``RTOL``; both record ``shm``."""
    flags = [*FLAGS, *EVAL_SMALL]
    _run(tmp_path, {"base": _here("train", *flags, "--until", "1", "--out", "base")})
    common = ("train", *flags, "--resume", "--until", "2")
    layouts = {"ep2_cp2": ["--ep", "2", "--cp", "2"], "pp2_ep2": ["--pp", "2", "--ep", "2", "--microbatches", "2"]}
    runs = {"single": _here(*common, "--out", "single", "--metrics", "single.jsonl")}
    for name, extra in layouts.items():
        runs[name] = _ranks(4, *common, *extra, "--out", name, "--metrics", f"{name}.jsonl")
    for name in runs:
        shutil.copytree(tmp_path / "base", tmp_path / name)
    _run(tmp_path, runs, timeout=2300)
    ref, ref_ckpt = _metrics(tmp_path / "single.jsonl")[2], _ckpt(tmp_path / "single")
    for name in layouts:
        got = _assert_same_step(tmp_path, name, ref, ref_ckpt)
        assert len(got["ep_rows"]) == 2, (name, got)
        recorded = yaml.safe_load((tmp_path / name / "config.yaml").read_text())["parallel"]["ep_transport"]
        assert recorded == "shm", (name, recorded)
