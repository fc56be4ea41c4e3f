"""``moonrt checkpoint export --mxfp4`` (issue 33 item 3): the packed file holds uint8 MXFP4 codes (two a byte) and
E8M0 scale bytes for exactly the declared quantizable weights; they decode bitwise to the weights the QAT forward
used; every other tensor is exported unchanged; the loader's model evaluates to the QAT run's own eval loss, exactly
(the fake quantizer leaves decoded MXFP4 weights as they are); a model without quantizable layers is one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from jobs.helpers import _ckpt, _cli, _here, _metrics, _run
from safetensors import safe_open

from moonrt.comm.parallelism import Parallelism
from moonrt.jobs.checkpoint import mxfp4
from moonrt.jobs.train import data
from moonrt.jobs.train.loop import evaluate
from moonrt.jobs.train.resume import BUILDER
from moonrt.models.k3.model.config import k3_tiny
from moonrt.models.k3.spec import qat_weights
from moonrt.ops.qat import fake_quantize_values

RUN = ["--steps", "2", "--seed", "0", "--batch-size", "2", "--seq-len", "32", "--eval-every", "2", "--set",
       "optim.eval_windows=2", "--threads", "1", "--no-progress"]


@pytest.fixture(scope="module")
def qat_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("qat_export")
    _run(root, {"qat": _here("train", *RUN, "--qat", "mxfp4", "--qat-block", "8", "--out", "qat", "--metrics",
                             "qat.jsonl")})
    return root


@pytest.mark.parametrize("names", ["hf", "moonrt"])
def test_mxfp4_export_decodes_bitwise_to_the_qat_forward_weights(qat_run: Path, names: str,
                                                                 capfd: pytest.CaptureFixture[str]) -> None:
    out = qat_run / f"w_{names}.safetensors"
    code, _, err = _cli(["checkpoint", "export", str(qat_run / "qat"), str(out), "--mxfp4", "--names", names], capfd)
    assert code == 0, err
    model = _ckpt(qat_run / "qat")["model"]
    quantized = qat_weights(k3_tiny())
    with safe_open(str(out), framework="pt") as f:
        keys = set(f.keys())  # noqa: SIM118
        packed = sorted(k for k in keys if k.endswith("weight_packed"))
        assert len(packed) == (8 * (3 * 16 + 6) if names == "hf" else 8 * 9)
        for k in packed:
            codes, scales = f.get_tensor(k), f.get_tensor(k[:-len("packed")] + "scale")
            assert codes.dtype == scales.dtype == torch.uint8 and codes.shape[-1] * 2 == scales.shape[-1] * 8, k
    loaded = mxfp4.load(out)
    assert loaded.scheme is not None and loaded.scheme.block == 8 and loaded.step == 2
    assert sorted(loaded.state) == sorted(model)
    for name, t in model.items():
        want = fake_quantize_values(t, "mxfp4", 8) if name in quantized else t
        assert loaded.state[name].dtype == want.dtype and loaded.state[name].equal(want), name
    assert out.stat().st_size < 0.6 * sum(t.numel() * t.element_size() for t in model.values())


def test_the_loaded_export_evaluates_to_the_qat_runs_eval_loss(qat_run: Path, capfd: pytest.CaptureFixture[str]
                                                               ) -> None:
    out = qat_run / "eval.safetensors"
    assert _cli(["checkpoint", "export", str(qat_run / "qat"), str(out), "--mxfp4"], capfd)[0] == 0
    model, job = mxfp4.eval_model(out, BUILDER)
    corpus = data.load_corpus(job.data.corpus, job.data.token_dtype, job.model_cfg().vocab_size)
    windows = data.eval_windows(corpus.heldout, job.optim.eval_windows, job.optim.seq_len)
    got = evaluate(model, windows, job.optim.batch_size, Parallelism())
    assert got == _metrics(qat_run / "qat.jsonl")[2]["eval_loss"]


def test_mxfp4_export_of_a_model_without_quantizable_layers_is_one_line(tmp_path: Path,
                                                                         capfd: pytest.CaptureFixture[str]) -> None:
    _run(tmp_path, {"d": _here("train", *RUN, "--model", "dense_tiny", "--until", "1", "--out", "d")})
    code, _, err = _cli(["checkpoint", "export", str(tmp_path / "d"), str(tmp_path / "d.safetensors"), "--mxfp4"],
                        capfd)
    assert code == 2 and err.strip().splitlines() == [
        "moonrt checkpoint: --mxfp4: model 'dense_tiny' (family 'dense') declares no quantizable layers; expected a "
        "checkpoint of a model with them (K3)"], err
    assert not (tmp_path / "d.safetensors").exists()
