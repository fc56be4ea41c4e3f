"""The config loader against hostile or careless input (issue 28): YAML bounded in size, depth, aliases and nodes
(:func:`moonrt.config.read_yaml`), every numeric field of the job and model configs range-checked with a message
that names the field, and :func:`save_yaml` never writing through a planted symlink.

Each YAML refusal is one :class:`ConfigError` line naming the file and the limit; nothing is built first.
"""

from __future__ import annotations

import math
import os
import stat

import pytest

from moonrt.config import (
    YAML_MAX_ALIASES,
    YAML_MAX_BYTES,
    YAML_MAX_DEPTH,
    YAML_MAX_NODES,
    ConfigError,
    DistConfig,
    ParallelConfig,
    from_dict,
    load_yaml,
    parse_yaml,
    read_yaml,
    save_yaml,
    to_dict,
)
from moonrt.jobs.train import config as job_module
from moonrt.jobs.train.config import MAX_THREADS, JobConfig, physical_memory_bytes
from moonrt.models.k3.model.config import K3Config, k3_tiny
from moonrt.scheduler.hardware import load_profile


def alias_bomb(levels: int = 9) -> str:
    """A "billion laughs" list: anchor ``a0`` holds 9 strings, each ``a{i}`` nine aliases of ``a{i-1}`` (9**levels
    strings once expanded, a few hundred bytes written)."""
    items = ["&a0 [" + ",".join(['"lol"'] * 9) + "]"]
    items += [f"&a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, levels)]
    return "[" + ", ".join(items) + "]"


def one_line(exc: pytest.ExceptionInfo) -> str:
    msg = str(exc.value)
    assert "\n" not in msg, msg
    return msg


def test_alias_bomb_refused_by_node_limit(tmp_path):
    p = tmp_path / "bomb.yaml"
    p.write_text(f"optim:\n  muon_adamw_modules: {alias_bomb()}\n")
    assert p.stat().st_size < 500
    with pytest.raises(ConfigError) as exc:
        load_yaml(JobConfig, p)
    msg = one_line(exc)
    assert str(p) in msg and f"YAML_MAX_NODES = {YAML_MAX_NODES}" in msg


def test_deep_nesting_refused_without_recursion_error(tmp_path):
    p = tmp_path / "deep.yaml"
    p.write_text("optim:\n  seed: " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(ConfigError) as exc:
        load_yaml(JobConfig, p)
    msg = one_line(exc)
    assert str(p) in msg and f"YAML_MAX_DEPTH = {YAML_MAX_DEPTH}" in msg
    # just inside the limit still loads (the depth bound, not Python's recursion limit, decides)
    assert parse_yaml("[" * (YAML_MAX_DEPTH - 1) + "1" + "]" * (YAML_MAX_DEPTH - 1), "t") is not None


def test_alias_count_limit_and_cycles():
    many = "a: &x 1\nb: [" + ", ".join(["*x"] * (YAML_MAX_ALIASES + 1)) + "]\n"
    with pytest.raises(ConfigError, match=f"YAML_MAX_ALIASES = {YAML_MAX_ALIASES}"):
        parse_yaml(many, "config file 'many.yaml'")
    with pytest.raises(ConfigError, match=r"cycle"):  # PyYAML would build a list that contains itself
        parse_yaml("a: &x [1, *x]\n", "config file 'cyc.yaml'")
    # ordinary aliases and merge keys are fine
    assert parse_yaml("base: &b {dp: 2}\nrun: {<<: *b, ep: 4}\n", "t") == {"base": {"dp": 2}, "run": {"dp": 2, "ep": 4}}


def test_size_limit_reads_no_more_than_the_limit(tmp_path):
    p = tmp_path / "big.yaml"
    with open(p, "w") as f:
        f.write("dp: 1\n")
        f.write("#" * YAML_MAX_BYTES)
    with pytest.raises(ConfigError) as exc:
        read_yaml(p)
    assert str(p) in one_line(exc) and f"YAML_MAX_BYTES = {YAML_MAX_BYTES}" in str(exc.value)
    with pytest.raises(ConfigError, match=f"YAML_MAX_BYTES = {YAML_MAX_BYTES}"):
        parse_yaml("#" * (YAML_MAX_BYTES + 1), "t")


@pytest.mark.parametrize(("text", "match"), [
    (b"dp: \xff\xfe\n", r"not UTF-8"),
    (b"seed: " + b"9" * 5000 + b"\n", r"unreadable YAML value"),  # Python refuses ints of > 4300 digits
    (b"dp: [1,\n", r"line \d+.*malformed YAML"),
])
def test_other_unreadable_yaml_is_one_line(tmp_path, text, match):
    p = tmp_path / "c.yaml"
    p.write_bytes(text)
    with pytest.raises(ConfigError, match=match) as exc:
        read_yaml(p)
    assert str(p) in one_line(exc)


def test_hardware_profile_reader_is_bounded(tmp_path):
    p = tmp_path / "hw.yaml"
    p.write_text(f"name: {alias_bomb()}\n")
    with pytest.raises(ValueError) as exc:
        load_profile(p)
    msg = one_line(exc)
    assert msg.startswith(f"hardware profile {str(p)!r}") and "YAML_MAX_NODES" in msg


def test_save_yaml_never_writes_through_a_planted_symlink(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.yaml.tmp").symlink_to(victim)  # the old predictable temp name
    save_yaml(ParallelConfig(dp=2), out / "config.yaml")
    assert victim.read_text() == "precious\n"
    assert load_yaml(ParallelConfig, out / "config.yaml").dp == 2
    assert sorted(p.name for p in out.iterdir()) == ["config.yaml", "config.yaml.tmp"]  # no temp file left
    mask = os.umask(0)
    os.umask(mask)
    assert stat.S_IMODE((out / "config.yaml").stat().st_mode) == 0o666 & ~mask


# ---- numeric fields: range-checked, every message names the dotted field ---------------------------------------

def _job(**sections) -> dict:
    data = to_dict(JobConfig())
    for key, value in sections.items():
        if isinstance(value, dict):
            data[key].update(value)
        else:
            data[key] = value
    return data


BAD_JOB = [
    ({"threads": 5000}, rf"^threads = 5000: expected an integer in \[0, {MAX_THREADS}\]"),
    ({"threads": -1}, r"^threads = -1: expected an integer in \[0, "),
    ({"gc_interval": -1}, r"^gc_interval = -1: expected an integer >= 0"),
    ({"optim": {"seed": -1}}, r"^optim.seed = -1: expected an integer in \[0, 9223372036854775807\]"),
    ({"optim": {"seed": 2**70}}, rf"^optim.seed = {2**70}: expected an integer in \[0, "),
    ({"optim": {"batch_size": 10**9}}, r"^optim.batch_size = 1000000000: expected batch_size x \(seq_len \+ 1\) x 8 "
                                       r"bytes .*= 1032000000000 bytes\) <= this host's physical memory "
                                       r"\(68719476736 bytes\)"),
    ({"optim": {"eval_windows": 10**9}}, r"^optim.eval_windows = 1000000000: expected eval_windows x "),
    ({"optim": {"seq_len": 2**62}}, r"^optim.batch_size = 8: expected batch_size x \(seq_len \+ 1\)"),
    ({"optim": {"steps": 2**63}}, r"^optim.steps = 9223372036854775808: expected an integer <= "),
    ({"optim": {"warmup_steps": -1}}, r"^optim.warmup_steps = -1: expected an integer in \[0, "),
    ({"optim": {"lr": math.inf}}, r"^optim.lr = inf: expected a finite number"),
    ({"optim": {"lr": math.nan}}, r"^optim.lr = nan: expected a finite number"),
    ({"optim": {"lr": 0.0}}, r"^optim.lr = 0.0: expected a finite number > 0"),
    ({"optim": {"lr": 10**400}}, r"^optim.lr = 1000.*: expected a finite number"),
    ({"optim": {"weight_decay": math.inf}}, r"^optim.weight_decay = inf: expected a finite number"),
    ({"optim": {"grad_clip": math.inf}}, r"^optim.grad_clip = inf: expected a finite number"),
    ({"optim": {"beta1": math.nan}}, r"^optim.beta1 = nan: expected a finite number"),
    ({"optim": {"beta2": 1.0}}, r"^optim.beta2 = 1.0: expected a finite number in \[0, 1\)"),
    ({"optim": {"min_lr_ratio": -math.inf}}, r"^optim.min_lr_ratio = -inf: expected a finite number"),
    ({"optim": {"muon_momentum": math.nan}}, r"^optim.muon_momentum = nan: expected a finite number"),
    ({"data": {"heldout_fraction": math.nan}}, r"^data.heldout_fraction = nan: expected a finite number"),
    ({"data": {"corpus": "c.txt", "pack_documents": True, "eos_id": 256}},
     r"^data.eos_id = 256: expected a token id < the model's vocab_size \(256\)"),
    ({"parallel": {"ep": 10**9}}, r"^parallel.ep = 1000000000: expected an integer <= 1048576"),
]


@pytest.mark.parametrize(("changes", "match"), BAD_JOB)
def test_job_fields_are_range_checked_naming_the_field(changes, match, monkeypatch):
    monkeypatch.setattr(job_module, "physical_memory_bytes", lambda: 64 << 30)  # the same refusal on any host
    with pytest.raises(ConfigError, match=match) as exc:
        from_dict(JobConfig, _job(**changes))
    one_line(exc)


def test_job_yaml_infinities_are_refused_naming_the_field(tmp_path):
    p = tmp_path / "job.yaml"
    p.write_text("optim:\n  lr: .inf\n")
    with pytest.raises(ConfigError, match=r"job.yaml: optim.lr = inf: expected a finite number"):
        load_yaml(JobConfig, p)


def test_dist_timeout_bounded():
    for bad in (math.inf, math.nan):
        with pytest.raises(ConfigError, match=r"^timeout_s = .*: expected a finite number"):
            from_dict(DistConfig, {"timeout_s": bad})
    for bad in (math.inf, math.nan, 0.0, 1e12):  # built in code, not from YAML: validate() checks the same
        with pytest.raises(ConfigError, match=r"^timeout_s = .*: expected a positive number of seconds <= 604800"):
            DistConfig(timeout_s=bad).validate()
    assert from_dict(DistConfig, {"timeout_s": 3600}).timeout_s == 3600.0


BAD_MODEL = [
    ("routed_scaling_factor", math.nan), ("routed_scaling_factor", 0.0), ("activation_situ_beta", -1.0),
    ("activation_situ_linear_beta", math.inf), ("rms_norm_eps", 0.0), ("initializer_range", -0.02),
    ("num_hidden_layers", 10**9), ("max_position_embeddings", 0),
]


@pytest.mark.parametrize(("field", "value"), BAD_MODEL)
def test_model_fields_are_range_checked_naming_the_field(field, value):
    data = to_dict(k3_tiny())
    data[field] = value
    with pytest.raises(ConfigError, match=rf"^model_config.{field} = ") as exc:
        from_dict(JobConfig, {"model_config": data})
    one_line(exc)


def test_model_gate_lower_bound_finite():
    data = to_dict(k3_tiny())
    data["linear_attn_config"]["gate_lower_bound"] = -math.inf
    with pytest.raises(ConfigError, match=r"linear_attn_config.gate_lower_bound = -inf: expected a finite"):
        from_dict(K3Config, data)


def test_defaults_and_presets_still_valid():
    assert physical_memory_bytes() > 0
    job = from_dict(JobConfig, _job(threads=MAX_THREADS, optim={"seed": 2**63 - 1}))
    assert job.threads == MAX_THREADS and job.optim.seed == 2**63 - 1
    from_dict(K3Config, to_dict(k3_tiny()))


# ---- write_new: exclusive output files --------------------------------------------------------------------------

def test_write_new_is_exclusive_and_never_follows_a_symlink(tmp_path):
    from moonrt.config import existing_outputs, write_new

    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    f = tmp_path / "out.json"
    write_new(f, "{}")
    assert f.read_text() == "{}"
    with pytest.raises(FileExistsError):
        write_new(f, "new")
    assert f.read_text() == "{}"
    link = tmp_path / "link.json"
    link.symlink_to(victim)
    dangling = tmp_path / "dangling.json"
    dangling.symlink_to(tmp_path / "nowhere")
    for target in (link, dangling):
        with pytest.raises(FileExistsError):
            write_new(target, "x")
    assert victim.read_text() == "precious\n" and not (tmp_path / "nowhere").exists()
    assert existing_outputs([f, link, dangling, tmp_path / "new"]) == [f, link, dangling]
    write_new(link, b"replaced", force=True)  # the link itself replaced, its target untouched
    assert not link.is_symlink() and link.read_bytes() == b"replaced" and victim.read_text() == "precious\n"
    write_new(f, lambda out: out.write(b"[1]"), force=True)
    assert f.read_text() == "[1]"

    def boom(out):
        out.write(b"half")
        raise RuntimeError("writer failed")

    with pytest.raises(RuntimeError):
        write_new(tmp_path / "partial.json", boom)
    with pytest.raises(RuntimeError):
        write_new(f, boom, force=True)
    assert not (tmp_path / "partial.json").exists() and f.read_text() == "[1]"  # the old file kept whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dangling.json", "link.json", "out.json", "victim.txt"]
