from __future__ import annotations

import pytest

from moonrt.config import ConfigError, ParallelConfig, from_dict, load_yaml, save_yaml
from moonrt.models.k3.model.config import K3Config, k3, k3_tiny


def test_parallel_roundtrip(tmp_path):
    cfg = from_dict(ParallelConfig, {"dp": 2, "ep": 4})
    assert (cfg.dp, cfg.pp, cfg.ep, cfg.cp, cfg.world_size) == (2, 1, 4, 1, 8)
    save_yaml(cfg, tmp_path / "p.yaml")
    assert load_yaml(ParallelConfig, tmp_path / "p.yaml") == cfg


@pytest.mark.parametrize(
    "data, match",
    [
        ({"dp": 0}, r"dp = 0: expected an integer >= 1"),
        ({"dp": "two"}, r"dp = 'two': expected an integer"),
        ({"dp": 2.5}, r"dp = 2.5: expected an integer"),
        ({"ddp": 2}, r"ddp: unknown key in ParallelConfig; expected one of attn_res_comm, cp, cp_transport, dp, "
                     r"ep, ep_dedup, ep_dispatcher, ep_transport, microbatches, pp, schedule, token_padding, vpp"),
        ({"token_padding": 0}, r"token_padding = 0: expected an integer >= 1"),
        ({"ep_dedup": 1}, r"ep_dedup = 1: expected true or false"),
        ({"ep_dispatcher": "deepep"}, r"ep_dispatcher = 'deepep': expected one of 'moonep', 'alltoall'"),
        ({"ep_transport": "nvlink"}, r"ep_transport = 'nvlink': expected one of 'auto', 'shm', 'cuda', 'collectives'"),
        ({"cp_transport": "cuda"}, r"cp_transport = 'cuda': expected one of 'auto', 'shm', 'collectives'"),
    ],
)
def test_parallel_bad_values(data, match):
    with pytest.raises(ConfigError, match=match):
        from_dict(ParallelConfig, data)


def test_malformed_yaml_names_line(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("dp: 2\nep: [1,\n")
    with pytest.raises(ConfigError, match=r"bad.yaml.* line \d+.*malformed YAML"):
        load_yaml(ParallelConfig, p)


def test_nested_error_has_dotted_path():
    from moonrt.config import to_dict

    data = to_dict(k3_tiny())
    data["linear_attn_config"]["num_heads"] = -1
    with pytest.raises(ConfigError, match=r"linear_attn_config\.num_heads = -1"):
        from_dict(K3Config, data)
    data = to_dict(k3_tiny())
    data["linear_attn_config"]["nheads"] = 4
    with pytest.raises(ConfigError, match=r"linear_attn_config\.nheads: unknown key"):
        from_dict(K3Config, data)


def test_model_presets_structure(tmp_path):
    big = k3()
    assert big.pattern.count("M") == 24 and big.pattern.count("K") == 69
    assert big.pattern.endswith("KKKMM") and big.num_attn_res_blocks == 8
    tiny = k3_tiny()
    assert tiny.pattern == "KKKMKKKMM"
    assert tiny.num_attn_res_blocks == 3 and tiny.num_hidden_layers % tiny.attn_res_block_size != 0
    save_yaml(tiny, tmp_path / "t.yaml")
    assert load_yaml(K3Config, tmp_path / "t.yaml") == tiny
