"""``moonrt train --qat mxfp4`` (issue 33 item 2): the job fake-quantizes exactly the layers the family declares; one
teacher-forced step under ``--ep 2`` and under ``--pp 2``, resumed from the single-process QAT checkpoint, equals
the single process's QAT step (the scheme and tolerance of ``tests/jobs/test_pp_train.py``: the layouts sum in
another fp32 order, ~1e-7 relative, and every quantizer block is one row of one weight or one token's activations,
so no layout changes which values share a scale); bad input is one clear line.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from jobs.helpers import EVAL_SMALL, FLAGS, _assert_same_step, _ckpt, _cli, _here, _metrics, _ranks, _run

from moonrt.config import ConfigError
from moonrt.jobs.train.assemble import build_model
from moonrt.jobs.train.config import JobConfig
from moonrt.models.k3.spec import qat_weights

QAT = ["--qat", "mxfp4", "--qat-block", "8"]


def test_qat_quantizes_exactly_the_declared_weights() -> None:
    job = JobConfig(qat="mxfp4", qat_block=8)
    job.validate()
    model = build_model(job)
    names = model.enable_qat(model.layers[1].moe.experts.qat)  # what build_model enabled, re-listed
    assert names == list(qat_weights(job.model_cfg())) and len(names) == 8 * (3 + 2 * 3)
    params = dict(model.named_parameters())
    assert all(tuple(params[n].shape) == s for n, s in qat_weights(job.model_cfg()).items())
    assert model.layers[0].ffn.qat is None  # the dense first layer stays in high precision


@pytest.mark.parametrize(("flags", "message"), [
    (["--qat", "int4"], "qat (--qat) = 'int4': expected one of none, mxfp4"),
    (["--qat", "mxfp4", "--qat-block", "32"], "qat_block (--qat-block) = 32: expected a divisor of every quantized "
     "reduction axis; layers.1.moe.experts.w_down [16, 64, 56] has 56 (--qat-block 8 fits this model)"),
    (["--qat", "mxfp4", "--model", "dense_tiny"], "qat (--qat) = 'mxfp4': expected 'none' for model 'dense_tiny': "
                                                  "its family 'dense' declares no quantizable layers"),
    (["--qat", "mxfp4", "--qat-block", "7"], "qat_block (--qat-block) = 7: expected an even integer >= 2 "
                                                "(mxfp4 packs two codes a byte)"),
])
def test_bad_qat_input_is_one_clear_line(tmp_path: Path, capfd: pytest.CaptureFixture[str], flags: list[str],
                                         message: str) -> None:
    code, out, err = _cli(["train", "--steps", "1", "--out", str(tmp_path / "r"), *flags], capfd)
    assert code == 2 and err.strip().splitlines() == [f"moonrt train: error: {message}"], err
    with pytest.raises(ConfigError):
        JobConfig(qat="mxfp4", model="dense_tiny").validate()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_qat_mxfp4_on_the_default_model_takes_its_preset_block_and_learns(tmp_path: Path) -> None:
    """Issue 49 item 10: ``moonrt train --qat mxfp4`` on the default model (k3_tiny, expert width 56) runs with the
    block its preset declares (8; refused before: 32 does not divide 56), records it, and learns; k3 keeps the OCP
    MX spec's 32, and a non-QAT checkpoint that recorded the old default block 32 still resumes."""
    from moonrt.jobs.train.resume import check_resume
    from moonrt.models import presets

    assert presets()["k3"].default_qat_block("k3") == 32 and presets()["k3_tiny"].default_qat_block("k3_tiny") == 8
    job = JobConfig(qat="mxfp4")
    job.validate()
    assert job.qat_block == 8
    steps = ["--steps", "8", "--seed", "0", "--batch-size", "4", "--seq-len", "32", "--eval-every", "100",
             "--lr", "3e-3", "--set", "optim.warmup_steps=1", "--threads", "1", "--no-progress", *EVAL_SMALL]
    _run(tmp_path, {"qat": _here("train", "--qat", "mxfp4", *steps, "--out", "r", "--metrics", "m.jsonl")})
    loss = [r["loss"] for r in _metrics(tmp_path / "m.jsonl").values() if "loss" in r]
    assert len(loss) == 8 and sum(loss[-3:]) / 3 < loss[0] - 0.1, loss
    assert "qat_block: 8" in (tmp_path / "r" / "config.yaml").read_text()
    stored = {"model": "k3_tiny", "qat": "none", "qat_block": 32}
    check_resume(stored, {"model": "k3_tiny", "qat": "none", "qat_block": 8}, step=1)  # inert without QAT
    with pytest.raises(ValueError, match="qat_block: checkpoint 32, now 8"):
        check_resume({**stored, "qat": "mxfp4"}, {"model": "k3_tiny", "qat": "mxfp4", "qat_block": 8}, step=1)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_qat_under_ep2_and_pp2_resumes_the_single_process_checkpoint_and_matches_it(tmp_path: Path) -> None:
    _run(tmp_path, {"base": _here("train", *FLAGS, *QAT, "--until", "1", "--out", "base")})
    common = ("train", *FLAGS, *QAT, "--resume", "--until", "2")
    runs = {"single": _here(*common, "--out", "single", "--metrics", "single.jsonl"),
            "ep2": _ranks(2, *common, "--out", "ep2", "--metrics", "ep2.jsonl", "--ep", "2"),
            "pp2": _ranks(2, *common, "--out", "pp2", "--metrics", "pp2.jsonl", "--pp", "2", "--microbatches", "2")}
    for name in runs:
        shutil.copytree(tmp_path / "base", tmp_path / name)
    _run(tmp_path, runs)
    ref, ref_ckpt = _metrics(tmp_path / "single.jsonl")[2], _ckpt(tmp_path / "single")
    assert _assert_same_step(tmp_path, "ep2", ref, ref_ckpt)["ep_rows"]
    assert _assert_same_step(tmp_path, "pp2", ref, ref_ckpt)["pp_blocks_sent"]
