"""The released Kimi K3 Hugging Face layout at the job level (issue 32 items 2-3): a directory written by the
independent fixture generator imports strictly and gives the model's own logits (bf16/fp32 and packed MXFP4
experts, text-only and multimodal); ``moonrt checkpoint export --format hf`` writes bounded shards, an index and
the released config and reads back bitwise; ``moonrt train --init-from`` trains on identically."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from jobs.helpers import _ckpt, _cli, _here, _metrics, _run

from moonrt.config import ConfigError, from_dict
from moonrt.jobs.checkpoint import hf
from moonrt.jobs.train.assemble import build_model
from moonrt.jobs.train.config import JobConfig
from moonrt.models.k3.hf_config import read_config
from moonrt.models.k3.model.config import k3_tiny
from moonrt.models.k3.model.model import K3Model
from moonrt.ops.qat import fake_quantize_values
from tests.model.k3_release_fixture import fp4_representable, text_config_of, write_release

RUN = ["--steps", "2", "--seed", "0", "--batch-size", "2", "--seq-len", "32", "--eval-every", "2", "--set",
       "optim.eval_windows=2", "--threads", "1", "--no-progress", "--qat-block", "8"]


def tiny_model(mxfp4_block: int | None = None) -> K3Model:
    """k3_tiny with nonzero AttnRes queries and router biases (the fold and the buffer are exercised); with
    ``mxfp4_block`` the routed experts take MXFP4-representable values."""
    torch.manual_seed(0)
    model = K3Model(k3_tiny()).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        model.attn_res.queries.copy_(torch.randn(model.attn_res.queries.shape, generator=g))
        model.attn_res.final_query.copy_(torch.randn(model.attn_res.final_query.shape, generator=g))
        for _, moe in model.moe_layers():
            moe.router.bias.copy_(torch.randn(moe.router.bias.shape, generator=g) * 0.01)
            if mxfp4_block is not None:
                for w in (moe.experts.w_gate, moe.experts.w_up, moe.experts.w_down):
                    w.copy_(fp4_representable(tuple(w.shape), mxfp4_block, g))
    return model


@pytest.mark.parametrize(("multimodal", "block"), [(False, None), (True, None), (True, 8)])
def test_fixture_directory_imports_strictly_to_the_same_logits(tmp_path: Path, multimodal: bool,
                                                               block: int | None) -> None:
    model = tiny_model(block)
    written = write_release(tmp_path, text_config_of(k3_tiny()), model.state_dict(), multimodal=multimodal,
                            mxfp4_block=block)
    assert any(k.endswith("w2.weight_packed") for k in written) == (block is not None)
    state, cfg, skipped = hf.load_state(tmp_path)
    assert cfg.model == k3_tiny() and cfg.mxfp4_block == block and cfg.extra["top_k"] == 50
    assert skipped == (["mm_projector.proj.0.weight", "vision_tower.patch_embed.weight"] if multimodal else [])
    fresh = K3Model(k3_tiny()).eval()
    fresh.load_state_dict(state, strict=True)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    if multimodal:
        job = from_dict(JobConfig, {"init_from": str(tmp_path)})
        assert hf.job_init(job)[1] == (
            f"initial weights from {str(tmp_path)!r} (the released Kimi K3 layout"
            f"{', MXFP4 experts decoded' if block else ''}); 2 vision tensors skipped (mm_projector, vision_tower: "
            "moonrt's K3 is the text model)") and job.model_config == k3_tiny()
    if multimodal and block is None:
        return  # the same state as the text-only case (asserted above); its logits are that case's
    tokens = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(fresh(tokens), model(tokens))


def test_fixture_directory_errors_name_the_key(tmp_path: Path) -> None:
    model = tiny_model()
    write_release(tmp_path, text_config_of(k3_tiny()), model.state_dict(), shards=1)
    from safetensors.torch import load_file, save_file

    shard = tmp_path / "model-00001-of-00001.safetensors"
    tensors = load_file(str(shard))
    del tensors["model.layers.4.self_attn.dt_bias"]
    save_file(tensors, str(shard))
    index = json.loads((tmp_path / hf.INDEX).read_text())
    del index["weight_map"]["model.layers.4.self_attn.dt_bias"]
    (tmp_path / hf.INDEX).write_text(json.dumps(index))
    with pytest.raises(ConfigError, match=r"missing key 'model\.layers\.4\.self_attn\.dt_bias'"):
        hf.load_state(tmp_path)
    index["weight_map"]["model.layers.4.self_attn.dt_bias"] = shard.name
    (tmp_path / hf.INDEX).write_text(json.dumps(index))
    with pytest.raises(ConfigError, match="dt_bias' is not in its shard"):
        hf.load_state(tmp_path)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hf_interchange")
    job = from_dict(JobConfig, {"optim": {"seed": 0}})
    (root / "w0").mkdir()  # the seeded initial weights of the runs below, in the released layout
    hf.export_dir(root / "w0", build_model(job).state_dict(), job.model_cfg())
    _run(root, {"a": _here("train", *RUN, "--out", "a", "--metrics", "a.jsonl"),
                "b": _here("train", *RUN, "--out", "b", "--metrics", "b.jsonl", "--init-from", "w0")})
    return root


def test_init_from_trains_on_identically(run: Path) -> None:
    a, b = _metrics(run / "a.jsonl"), _metrics(run / "b.jsonl")
    assert [a[s]["loss"] for s in (1, 2)] == [b[s]["loss"] for s in (1, 2)] and a[2]["eval_loss"] == b[2]["eval_loss"]
    ca, cb = _ckpt(run / "a")["model"], _ckpt(run / "b")["model"]
    assert all(torch.equal(ca[k], cb[k]) for k in ca)


def test_export_format_hf_bounded_shards_round_trip(run: Path, capfd: pytest.CaptureFixture[str]) -> None:
    out = run / "hf_out"
    code, text, err = _cli(["checkpoint", "export", str(run / "a"), str(out), "--format", "hf", "--max-shard-size",
                            "1MB"], capfd)
    assert code == 0, err
    index = json.loads((out / hf.INDEX).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 3 and shards == sorted(p.name for p in out.glob("model-*.safetensors"))
    assert all((out / s).stat().st_size <= 10**6 + 64 * 1024 for s in shards if s != shards[0])  # + header
    assert index["metadata"]["total_size"] == sum((out / s).stat().st_size for s in shards) - sum(
        8 + int.from_bytes((out / s).read_bytes()[:8], "little") for s in shards)
    assert read_config(out / "config.json").model == k3_tiny()
    state, _, _ = hf.load_state(out)
    model = _ckpt(run / "a")["model"]
    assert state.keys() == model.keys() and all(torch.equal(state[k], model[k]) for k in model)
    assert f"wrote {out}: " in text


def test_export_format_hf_mxfp4_and_refusals(run: Path, capfd: pytest.CaptureFixture[str]) -> None:
    out = run / "hf_mx"
    code, _, err = _cli(["checkpoint", "export", str(run / "a"), str(out), "--format", "hf", "--mxfp4",
                         "--multimodal"], capfd)
    assert code == 0, err
    doc = json.loads((out / "config.json").read_text())
    assert doc["model_type"] == "kimi_k3" and doc["text_config"]["quantization_config"]["config_groups"][
        "group_0"]["weights"]["group_size"] == 8
    keys = json.loads((out / hf.INDEX).read_text())["weight_map"]
    assert all(k.startswith("language_model.") for k in keys)
    assert sum(k.endswith(".weight_packed") for k in keys) == 8 * 16 * 3  # routed experts only
    state, cfg, _ = hf.load_state(out)
    model = _ckpt(run / "a")["model"]
    for k, v in model.items():
        want = fake_quantize_values(v, "mxfp4", 8) if ".experts.w_" in k else v
        assert torch.equal(state[k], want), k
    code, _, err = _cli(["checkpoint", "export", str(run / "a"), str(out), "--format", "hf"], capfd)
    assert code == 2 and "not empty" in err
    code, _, err = _cli(["checkpoint", "export", str(run / "a"), str(run / "bad"), "--format", "hf",
                         "--max-shard-size", "5XB"], capfd)
    assert code == 2 and err.strip() == ("moonrt checkpoint: --max-shard-size = '5XB': expected a size such as 5GB, "
                                         "200MB or 1000 (bytes)"), err
    assert not [p for p in run.iterdir() if p.name.startswith("bad")]


def test_export_release_dtypes(run: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """``--release-dtypes``: BF16 except the release's F32 tensors; reading back gives the checkpoint rounded to them
    (the packed experts from the fp32 values)."""
    out = run / "hf_bf16"
    code, _, err = _cli(["checkpoint", "export", str(run / "a"), str(out), "--format", "hf", "--release-dtypes",
                         "--mxfp4"], capfd)
    assert code == 0, err
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    tensors = hf.read_tensors(out)
    f32 = ("conv1d.weight", "A_log", "dt_bias", "o_norm.weight", "e_score_correction_bias")
    for k, t in tensors.items():
        packed = k.endswith(("_packed", "_scale"))
        assert t.dtype == (torch.uint8 if packed else torch.float32 if k.endswith(f32) else torch.bfloat16), k
    state, _, _ = hf.load_state(out)
    model = _ckpt(run / "a")["model"]
    for k, v in model.items():
        if ".experts.w_" in k:
            want = fake_quantize_values(v, "mxfp4", 8)
        elif k.endswith(("conv_weight", "A_log", "dt_bias", "o_norm_weight", "router.bias")):
            want = v
        else:
            want = v.to(torch.bfloat16)
        assert torch.equal(state[k], want), k


def test_init_from_refusals(run: Path, capfd: pytest.CaptureFixture[str]) -> None:
    code, _, err = _cli(["train", "--init-from", str(run / "nowhere"), "--out", str(run / "x")], capfd)
    assert code == 2 and "init_from (--init-from) = " in err and "no config.json" in err, err
    code, _, err = _cli(["train", "--init-from", str(run / "w0"), "--out", str(run / "x"), "--model", "dense_tiny"],
                        capfd)
    assert code == 2 and "family 'dense'" in err, err
    code, _, err = _cli(["train", "--init-from", str(run / "w0"), "--out", str(run / "x"), "--set",
                         "model_config.hidden_size=64"], capfd)
    assert code == 2 and "model_config.hidden_size = 64: expected 128" in err, err
    assert not (run / "x").exists()
