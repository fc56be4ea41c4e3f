"""``moonrt train --pp`` (K3_SYSTEMS §9, §10): resumed from a single-process checkpoint, one pipelined step
equals the single process's; its checkpoint is in the single-process layout; bad pipeline input is a
clear error before step 1.

Runs: a single-process job trains step 1 and checkpoints; copies of that directory are resumed for step 2 by
the single process (these two runs are made once per session and shared with
``tests/jobs/test_zero_train.py``: ``single_process_steps`` in ``tests/jobs/conftest.py``), by ``--pp 2``
(1F1B, 2 micro-batches) and by ``--pp 2 --vpp 2 --microbatches 4`` (interleaved, 4 stages: k3_tiny's 9 layers
cut 2/2/2/3, a partial AttnRes block crosses a cut). The pipelined step sums the loss and the gradients over
micro-batches, a different fp32 summation order than one forward of the whole batch (measured: ~1e-7
relative); Adam's update after one resumed step keeps that order of difference, so loss, every parameter and
every optimizer moment agree within 1e-5 relative (normwise per tensor). Then the ``--pp 2`` checkpoint
resumes in one process for step 3.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from moonrt.config import ConfigError, ParallelConfig
from moonrt.jobs.train.config import JobConfig

FLAGS = ["--steps", "4", "--seed", "0", "--batch-size", "4", "--seq-len", "32", "--eval-every", "100", "--lr", "1e-3",
         "--threads", "1", "--no-progress"]
RTOL = 1e-5


def _moonrt(*args: str) -> list[str]:
    return [sys.executable, "-m", "moonrt.cli", *args]


def _cli(args: list[str], capfd: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """``moonrt ARGS`` in this process: the exit code ``python -m moonrt.cli`` exits with, and the stdout and stderr
    it wrote (file-descriptor level). For bad input that ``moonrt train`` refuses before it starts a job (no
    process group, no threads set: asserted), without the ~6 s of imports of a new process."""
    from moonrt.cli import main

    threads = torch.get_num_threads()
    code = main(args)
    out, err = capfd.readouterr()
    assert not torch.distributed.is_initialized() and torch.get_num_threads() == threads, args
    return code, out, err


def _launch(n: int, *args: str) -> list[str]:
    return _moonrt("launch", "-n", str(n), "--", *_moonrt(*args))


def _here(*args: str) -> tuple[str, ...]:
    """A ``moonrt ARGS`` run that :func:`_run` makes in this process (``moonrt.cli.main``) instead of a new one:
    for the single-process runs a test resumes from or compares against (not what it tests), which would
    otherwise each pay a new interpreter's ~6 s of imports (torch, torch._dynamo, numba), alone on one core
    when nothing else runs beside them."""
    return args


def _main_here(cwd: Path, args: tuple[str, ...]) -> None:
    """``moonrt ARGS`` in this process with ``cwd`` as the working directory; the torch thread count and RNG
    state are this process's again afterwards (``moonrt train --threads`` sets the count, the job seeds torch),
    and no process group is left (one process never joins one)."""
    from moonrt.cli import main

    threads, here = torch.get_num_threads(), os.getcwd()
    try:
        os.chdir(cwd)  # contextlib.chdir is Python 3.11+
        with torch.random.fork_rng(devices=[]):
            code = main(list(args))
    finally:
        os.chdir(here)
        torch.set_num_threads(threads)
    assert code == 0 and not torch.distributed.is_initialized(), (args, code)


def _run(cwd: Path, cmds: dict[str, list[str] | tuple[str, ...]], timeout: float = 840) -> None:
    """Every command of ``cmds`` at once in ``cwd``; each must exit 0. Lists are new processes; tuples
    (:func:`_here`) run in this process, one after another, while the new processes run (their output goes to
    files, so none blocks on a full pipe meanwhile)."""
    with contextlib.ExitStack() as stack:
        procs = {}
        for k, c in cmds.items():
            if isinstance(c, list):
                out = stack.enter_context(tempfile.TemporaryFile("w+"))
                procs[k] = (subprocess.Popen(c, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, text=True), out)
        try:
            for c in cmds.values():
                if isinstance(c, tuple):
                    _main_here(cwd, c)
            deadline = time.monotonic() + timeout
            for p, _ in procs.values():
                p.wait(timeout=max(deadline - time.monotonic(), 1))
        finally:  # a failure here leaves no job running on (moonrt launch stops its ranks on SIGTERM)
            for p, _ in procs.values():
                if p.poll() is None:
                    p.terminate()
                    try:
                        p.wait(timeout=60)
                    except subprocess.TimeoutExpired:
                        p.kill()
                        p.wait()
        for k, (p, out) in procs.items():
            out.seek(0)
            assert p.returncode == 0, f"{k}:\n{out.read()[-4000:]}"


def _metrics(path: Path) -> dict[int, dict[str, Any]]:
    return {r["step"]: r for r in map(json.loads, path.read_text().splitlines())}


def _ckpt(path: Path) -> dict[str, Any]:
    """The run's newest checkpoint (multi-rank jobs write the sharded OUT/checkpoint/, one process checkpoint.pt)
    in the single-process ``checkpoint.pt`` format."""
    from moonrt.jobs.checkpoint.store import read_state

    return read_state(path)


def _close(a: Any, b: Any, where: str) -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _close(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _close(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert a.shape == b.shape and a.dtype == b.dtype, where
        if a.is_floating_point():
            err = float((a.double() - b.double()).norm())
            assert err <= RTOL * max(float(b.double().norm()), 1e-12), (where, err, float(b.double().norm()))
        else:
            assert torch.equal(a, b), where
    else:
        assert a == b, (where, a, b)


def _assert_same_step(tmp_path: Path, name: str, ref: dict[str, Any], ref_ckpt: dict[str, Any],
                      step: int = 2) -> dict[str, Any]:
    """Run ``name``'s step ``step`` (``<name>.jsonl`` and ``<name>/``'s checkpoint) against the single process's
    metrics ``ref`` and checkpoint ``ref_ckpt``: loss and grad norm, every parameter and optimizer tensor within
    ``RTOL`` relative (normwise per tensor); returns the run's step record."""
    got = _metrics(tmp_path / f"{name}.jsonl")[step]
    assert abs(got["loss"] - ref["loss"]) <= RTOL * abs(ref["loss"]), (name, got["loss"], ref["loss"])
    assert abs(got["grad_norm"] - ref["grad_norm"]) <= RTOL * ref["grad_norm"], (name, got["grad_norm"],
                                                                                 ref["grad_norm"])
    ck = _ckpt(tmp_path / name)
    assert ck["step"] == step and list(ck["model"]) == list(ref_ckpt["model"]), name
    _close(ck["model"], ref_ckpt["model"], f"{name}.model")
    _close(ck["optimizer"], ref_ckpt["optimizer"], f"{name}.optimizer")
    return got


@pytest.mark.timeout(1500)
def test_pp_resumes_a_single_process_checkpoint_and_matches_it(tmp_path: Path, single_process_steps: Path) -> None:
    shared = single_process_steps
    runs = {"pp2": _launch(2, "train", *FLAGS, "--resume", "--until", "2", "--out", "pp2", "--metrics", "pp2.jsonl",
                           "--pp", "2", "--microbatches", "2"),
            "pp2v2": _launch(2, "train", *FLAGS, "--resume", "--until", "2", "--out", "pp2v2", "--metrics",
                             "pp2v2.jsonl", "--pp", "2", "--vpp", "2", "--microbatches", "4")}
    for name in runs:
        shutil.copytree(shared / "base", tmp_path / name)
    _run(tmp_path, runs)
    ref = _metrics(shared / "single.jsonl")[2]
    ref_ckpt = _ckpt(shared / "single")
    for name, vpp, m in (("pp2", 1, 2), ("pp2v2", 2, 4)):
        got = _assert_same_step(tmp_path, name, ref, ref_ckpt)
        # per rank and step: the blocks and bytes `moonrt pp-plan` counts for the same layout
        plan = tmp_path / f"{name}.plan.json"
        subprocess.run(_moonrt("pp-plan", "--model", "k3_tiny", "--pp", "2", "--vpp", str(vpp), "--microbatches",
                               str(m), "--schedule", "1f1b" if vpp == 1 else "interleaved", "--seq-len", "32",
                               "--micro-batch-size", str(4 // m), "--dtype", "fp32", "--json", str(plan)),
                       check=True, capture_output=True, timeout=120)
        sent = json.loads(plan.read_text())["sent_per_step"]
        assert got["pp_blocks_sent"] == [sent[str(r)]["cached_blocks"] for r in range(2)], (name, got, sent)
        assert got["pp_bytes_sent"] == [sent[str(r)]["cached_bytes"] for r in range(2)], (name, got, sent)
        assert len(got["pp_idle_frac"]) == 2 and all(0.0 <= f < 1.0 for f in got["pp_idle_frac"]), got
    # the --pp 2 checkpoint resumes in one process: step 3 equals the single process's own step 3
    shutil.copytree(tmp_path / "pp2", tmp_path / "from_pp2")
    shutil.copytree(shared / "single", tmp_path / "single3")
    _run(tmp_path, {"a": _moonrt("train", *FLAGS, "--resume", "--until", "3", "--out", "from_pp2", "--metrics",
                                 "a.jsonl"),
                    "b": _moonrt("train", *FLAGS, "--resume", "--until", "3", "--out", "single3", "--metrics",
                                 "b.jsonl")})
    a, b = _metrics(tmp_path / "a.jsonl")[3], _metrics(tmp_path / "b.jsonl")[3]
    assert abs(a["loss"] - b["loss"]) <= RTOL * abs(b["loss"]), (a["loss"], b["loss"])
    _close(_ckpt(tmp_path / "from_pp2")["model"], _ckpt(tmp_path / "single3")["model"], "step3.model")


@pytest.mark.timeout(1200)
def test_pp2_ep2_resumes_a_single_process_checkpoint_and_matches_it(tmp_path: Path,
                                                                   single_process_steps: Path) -> None:
    """``--pp 2 --ep 2`` on 4 ranks: MoonEP inside each stage; the pipeline combines the expert shards'
    gradient norm and checkpoint state over its stages."""
    shared = single_process_steps
    shutil.copytree(shared / "base", tmp_path / "ppep")
    _run(tmp_path, {"ppep": _launch(4, "train", *FLAGS, "--resume", "--until", "2", "--out", "ppep", "--metrics",
                                    "ppep.jsonl", "--pp", "2", "--ep", "2", "--microbatches", "2")})
    got = _assert_same_step(tmp_path, "ppep", _metrics(shared / "single.jsonl")[2], _ckpt(shared / "single"))
    assert len(got["ep_rows"]) == 2 and len(got["pp_blocks_sent"]) == 2, got  # both parts ran


@pytest.mark.timeout(900)
def test_pp2_cp2_with_a_memory_policy_matches_the_single_process(tmp_path: Path) -> None:
    """``--pp 2 --cp 2`` on 4 ranks with an activation-memory policy (MoE recompute): KCP inside each stage
    and the manager around each micro-batch's forward; step 1 and its eval equal the single process under
    the same policy. (Not FP8 here: with CP the attention layers save other tensors than in one process,
    so FP8 rounds different values: ``--cp 2`` alone with FP8 attention saves differs from the single
    process by 1.2e-3 in the step-1 grad norm, measured; ``--pp 2`` alone with them matched it to 1e-8.)"""
    policy = tmp_path / "policy.yaml"
    policy.write_text("default: keep\nrules:\n  - {match: 'layers.*.moe', policy: recompute}\n")
    flags = [*FLAGS, "--until", "1", "--eval-every", "1", "--memory-policy", str(policy)]
    _run(tmp_path, {"single": _moonrt("train", *flags, "--out", "single", "--metrics", "single.jsonl"),
                    "ppcp": _launch(4, "train", *flags, "--out", "ppcp", "--metrics", "ppcp.jsonl", "--pp", "2",
                                    "--cp", "2", "--microbatches", "2")})
    ref, got = _metrics(tmp_path / "single.jsonl")[1], _metrics(tmp_path / "ppcp.jsonl")[1]
    for key in ("loss", "grad_norm", "eval_loss"):
        assert abs(got[key] - ref[key]) <= RTOL * abs(ref[key]), (key, got[key], ref[key])
    assert got["cp_bytes_sent"] > 0 and got["pp_blocks_sent"][0] > 0, got
    _close(_ckpt(tmp_path / "ppcp")["model"], _ckpt(tmp_path / "single")["model"], "model")


@pytest.mark.parametrize("flags, message", [
    (["--pp", "2", "--vpp", "2"], "microbatches = 1: expected >= pp (2)"),
    (["--pp", "2", "--vpp", "2", "--schedule", "gpipe"], "parallel.vpp (--vpp) = 2: expected 1 for schedule 'gpipe'"),
    (["--pp", "2", "--schedule", "zigzag"], "parallel.schedule (--schedule) = 'zigzag'"),
    (["--pp", "2", "--attn-res-comm", "sometimes"], "parallel.attn_res_comm (--attn-res-comm) = 'sometimes'"),
    (["--microbatches", "2"], "parallel.microbatches (--microbatches) = 2: expected 1 without pipeline parallelism"),
    (["--vpp", "2"], "parallel.vpp (--vpp) = 2: expected 1 without pipeline parallelism"),
])
def test_bad_pipeline_flags_are_one_clear_line(tmp_path: Path, flags: list[str], message: str,
                                              capfd: pytest.CaptureFixture[str]) -> None:
    code, out, err = _cli(["train", *FLAGS, "--out", str(tmp_path / "o"), *flags], capfd)
    assert code == 2, out + err
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_microbatches_must_divide_the_replica_batch(tmp_path: Path) -> None:
    from moonrt.comm.parallelism import Parallelism
    from moonrt.jobs.train.loop import train

    job = JobConfig(out_dir=str(tmp_path), parallel=ParallelConfig(pp=2, microbatches=3))
    job.optim.batch_size = 4
    with pytest.raises(ConfigError, match=r"microbatches \(--microbatches\) = 3: expected a divisor of the "
                                          r"per-replica batch 4"):
        train(job, rt=Parallelism(), progress=False)


@pytest.mark.timeout(300)
def test_more_stages_than_layers_is_a_clear_error(tmp_path: Path) -> None:
    out = subprocess.run(_launch(2, "train", *FLAGS, "--out", str(tmp_path / "o"), "--pp", "2", "--vpp", "5",
                                 "--microbatches", "2"), cwd=tmp_path, capture_output=True, text=True, timeout=280)
    assert out.returncode != 0
    assert "parallel.pp x vpp = 2 x 5 = 10 stages: expected at most the model's decoder layers, 9" in out.stdout + out.stderr
