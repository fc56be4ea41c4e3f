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

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from jobs.helpers import FLAGS, RTOL, _assert_same_step, _ckpt, _cli, _close, _launch, _metrics, _moonrt, _ranks, _run

from moonrt.config import ConfigError, ParallelConfig
from moonrt.jobs.train.config import JobConfig


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_pp_resumes_a_single_process_checkpoint_and_matches_it(tmp_path: Path, single_process_steps: Path) -> None:
    shared = single_process_steps
    runs = {"pp2": _ranks(2, "train", *FLAGS, "--resume", "--until", "2", "--out", "pp2", "--metrics", "pp2.jsonl",
                          "--pp", "2", "--microbatches", "2"),
            "pp2v2": _ranks(2, "train", *FLAGS, "--resume", "--until", "2", "--out", "pp2v2", "--metrics",
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


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_pp2_ep2_resumes_a_single_process_checkpoint_and_matches_it(tmp_path: Path,
                                                                   single_process_steps: Path) -> None:
    """``--pp 2 --ep 2`` on 4 ranks: MoonEP inside each stage; the pipeline combines the expert shards'
    gradient norm and checkpoint state over its stages."""
    shared = single_process_steps
    shutil.copytree(shared / "base", tmp_path / "ppep")
    _run(tmp_path, {"ppep": _ranks(4, "train", *FLAGS, "--resume", "--until", "2", "--out", "ppep", "--metrics",
                                   "ppep.jsonl", "--pp", "2", "--ep", "2", "--microbatches", "2")})
    got = _assert_same_step(tmp_path, "ppep", _metrics(shared / "single.jsonl")[2], _ckpt(shared / "single"))
    assert len(got["ep_rows"]) == 2 and len(got["pp_blocks_sent"]) == 2, got  # both parts ran


@pytest.mark.slow
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
                    "ppcp": _ranks(4, "train", *flags, "--out", "ppcp", "--metrics", "ppcp.jsonl", "--pp", "2",
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
    want = "parallel.pp x vpp = 2 x 5 = 10 stages: expected at most the model's decoder layers, 9"
    assert want in out.stdout + out.stderr
