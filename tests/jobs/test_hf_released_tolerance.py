"""Released-format details an outside reader of the format disagrees on (issue 49 item 11), written and read both
ways: KDA ``A_log`` stored ``[1, 1, H, 1]`` (the public Kimi Linear readers' shape) loads as moonrt's ``[H]``;
the written ``quantization_config`` carries compressed-tensors' ``strategy: "group"`` and null activations (a reader
that indexes them finds them), and moonrt's reader takes a weights block without ``type`` / ``strategy`` /
activation entries (compressed-tensors' defaults) while refusing one that says something else."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from moonrt.config import ConfigError
from moonrt.jobs.checkpoint import hf
from moonrt.models.k3.model.config import k3_tiny
from moonrt.models.k3.model.model import K3Model


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """k3_tiny's seeded weights in the released layout, MXFP4 experts (block 8), one shard."""
    out = tmp_path_factory.mktemp("hf_tolerance") / "mx"
    out.mkdir()
    torch.manual_seed(0)
    hf.export_dir(out, K3Model(k3_tiny()).state_dict(), k3_tiny(), mxfp4_block=8)
    return out


def _copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "hf"
    shutil.copytree(src, dst)
    return dst


def _quant(d: Path) -> tuple[dict, dict]:
    doc = json.loads((d / hf.CONFIG).read_text())
    return doc, doc["quantization_config"]


def test_written_quantization_config_names_strategy_and_null_activations(exported: Path) -> None:
    _, q = _quant(exported)
    scheme = q["config_groups"]["group_0"]
    assert scheme["input_activations"] is None and scheme["output_activations"] is None  # indexed: no KeyError
    assert scheme["weights"]["strategy"] == "group" and scheme["weights"]["type"] == "float"
    assert scheme["weights"]["group_size"] == 8


@pytest.mark.slow
def test_a_weights_block_without_type_or_strategy_reads_as_written(exported: Path, tmp_path: Path) -> None:
    want, cfg, _ = hf.load_state(exported)
    d = _copy(exported, tmp_path)
    doc, q = _quant(d)
    scheme = q["config_groups"]["group_0"]
    for key in ("type", "strategy"):
        del scheme["weights"][key]
    del scheme["input_activations"], scheme["output_activations"]
    (d / hf.CONFIG).write_text(json.dumps(doc))
    got, got_cfg, _ = hf.load_state(d)
    assert got_cfg.mxfp4_block == cfg.mxfp4_block == 8
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize(("where", "value"), [("strategy", "channel"), ("type", "int"),
                                              ("input_activations", {"num_bits": 8, "type": "float"})])
def test_another_quantization_is_refused_in_one_line(exported: Path, tmp_path: Path, where: str,
                                                     value: object) -> None:
    d = _copy(exported, tmp_path)
    doc, q = _quant(d)
    scheme = q["config_groups"]["group_0"]
    (scheme if where == "input_activations" else scheme["weights"])[where] = value
    (d / hf.CONFIG).write_text(json.dumps(doc))
    with pytest.raises(ConfigError, match="quantization_config = .*: expected compressed-tensors mxfp4-pack-quantized"):
        hf.load_state(d)


@pytest.mark.slow
def test_a_log_stored_as_kimi_linear_readers_hold_it_loads(exported: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    want, _, _ = hf.load_state(exported)
    d = _copy(exported, tmp_path)
    weight_map = json.loads((d / hf.INDEX).read_text())["weight_map"]
    names = [k for k in weight_map if k.endswith(".self_attn.A_log")]
    assert names
    for shard in sorted({d / weight_map[k] for k in names}):
        tensors = load_file(str(shard))
        for k in names:
            if k in tensors:
                assert tensors[k].shape == (4,)  # moonrt writes [H]
                tensors[k] = tensors[k].view(1, 1, -1, 1).contiguous()
        save_file(tensors, str(shard), metadata={"format": "pt"})
    got, _, _ = hf.load_state(d)
    assert all(torch.equal(got[k], want[k]) for k in want)
    shard = d / weight_map[names[0]]
    tensors = load_file(str(shard))
    tensors[names[0]] = torch.ones(1, 2, 4, 1)  # two dimensions above 1: not a per-head vector
    save_file(tensors, str(shard), metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=r"A_log: shape \(1, 2, 4, 1\): expected \(4,\)"):
        hf.load_state(d)
