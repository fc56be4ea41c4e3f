"""``moonrt train --init-from`` and ``moonrt checkpoint export --format hf`` against hostile-but-fair Hugging Face
directories (issue 45).

- Bounds before reading: config.json's size (``MAX_CONFIG_BYTES``) before it is parsed, every structural field
  (``MAX_LAYERS``) and the model's size (``MAX_PARAMS``, ``MAX_TENSORS``) before any tensor is read; the
  safetensors headers (length bounded first) are validated and checked against the config's names, shapes and
  dtypes before any tensor data is read (``safe_open`` is never called on a refused directory).
- Damaged or hostile files (truncated shards, huge or garbage headers, offsets past the end or overlapping, a
  dtype/shape that is not its byte range, empty files, a malformed or oversized index, a 0-dim packed tensor,
  bool/int/uint8 weights, NaN/inf weights) are one line on stderr naming the file (and the tensor), exit 2.
- A run started from a directory resumes (``--resume``, ``--resume-if-exists``) after the directory is removed;
  a directory that is there but changed (config.json, index) is named.
- ``export --format hf`` on a full disk is one line naming the output, and leaves nothing of its own behind.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from jobs.helpers import _ckpt, _cli, _main_here, _metrics

from moonrt.jobs.checkpoint import hf
from moonrt.models.k3 import hf_adapter
from moonrt.models.k3.model.config import k3_tiny
from moonrt.models.k3.model.model import K3Model

RUN = ["--seed", "0", "--batch-size", "2", "--seq-len", "32", "--eval-every", "100", "--set", "optim.eval_windows=2",
       "--no-progress", "--qat-block", "8"]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """k3_tiny's seeded weights in the released layout: ``plain`` (fp32, 2 MB shards) and ``mx`` (MXFP4 experts)."""
    root = tmp_path_factory.mktemp("hf_hardening")
    torch.manual_seed(0)
    state = K3Model(k3_tiny()).state_dict()
    out = {"plain": root / "plain", "mx": root / "mx"}
    for name, block in (("plain", None), ("mx", 8)):
        out[name].mkdir()
        hf.export_dir(out[name], state, k3_tiny(), mxfp4_block=block, max_shard_bytes=2 * 10**6)
    return out


@pytest.fixture
def no_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every ``safetensors.safe_open`` call (a tensor read) recorded; a refusal before reading leaves it empty."""
    import safetensors

    calls: list[str] = []
    real = safetensors.safe_open

    def spy(path: str, *args: Any, **kwargs: Any) -> Any:
        calls.append(path)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(safetensors, "safe_open", spy)
    return calls


def _copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "hf"
    shutil.copytree(src, dst)
    return dst


def _shard_of(d: Path, name: str) -> Path:
    return d / json.loads((d / hf.INDEX).read_text())["weight_map"][name]


def _split(path: Path) -> tuple[dict[str, Any], bytes]:
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _join(path: Path, header: dict[str, Any] | bytes, data: bytes, length: int | None = None) -> None:
    h = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes((len(h) if length is None else length).to_bytes(8, "little") + h + data)


def _refused(tmp_path: Path, capfd: pytest.CaptureFixture[str], src: Path, *extra: str) -> str:
    """``moonrt train --init-from src``: exit 2 and one line on stderr, no traceback; returns the line."""
    code, _, err = _cli(["train", "--init-from", str(src), "--out", str(tmp_path / "out"), "--steps", "1",
                         "--threads", "0", *RUN, *extra], capfd)
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    return err.strip()


# ---- 1. bounds before reading ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("field", "value", "expected"), [
    ("num_hidden_layers", 10**9, "num_hidden_layers = 1000000000: expected an integer <= 4096 (MAX_LAYERS)"),
    ("num_experts", 10**8, "parameters (hidden_size 128, num_hidden_layers 9, num_experts 100000000, vocab_size "
                           "256); expected at most 5,000,000,000 (MAX_PARAMS"),
    ("hidden_size", 10**7, "expected at most 5,000,000,000 (MAX_PARAMS"),
    ("vocab_size", 10**10, "expected at most 5,000,000,000 (MAX_PARAMS"),
], ids=lambda v: v if isinstance(v, str) and "=" not in v and "(" not in v else "")
def test_config_fields_bounded_before_any_tensor(dirs: dict[str, Path], tmp_path: Path, no_reads: list[str],
                                                 capfd: pytest.CaptureFixture[str], field: str, value: int,
                                                 expected: str) -> None:
    d = _copy(dirs["plain"], tmp_path)
    doc = json.loads((d / hf.CONFIG).read_text())
    doc[field] = value
    (d / hf.CONFIG).write_text(json.dumps(doc))
    t0 = time.monotonic()
    err = _refused(tmp_path, capfd, d)
    assert time.monotonic() - t0 < 20 and expected in err and repr(str(d / hf.CONFIG)) in err, err
    assert no_reads == [] and not (tmp_path / "out").exists()


def test_many_small_experts_bounded_by_the_tensor_count(dirs: dict[str, Path], tmp_path: Path, no_reads: list[str],
                                                        capfd: pytest.CaptureFixture[str]) -> None:
    """Within the parameter bound, yet 3 x 8 x 50,000 released tensors: refused before a name is listed."""
    d = _copy(dirs["plain"], tmp_path)
    doc = json.loads((d / hf.CONFIG).read_text())
    doc |= {"num_experts": 50_000, "moe_intermediate_size": 1, "routed_expert_hidden_size": 2}
    (d / hf.CONFIG).write_text(json.dumps(doc))
    err = _refused(tmp_path, capfd, d)
    n = 3 * 8 * 50_000 + len(hf_adapter.released_shapes(dataclasses.replace(k3_tiny(), num_experts=0)))
    assert f"{n:,} released tensors (num_experts 50000 x 3 in each MoE layer); expected at most {hf.MAX_TENSORS:,} " \
           "(MAX_TENSORS)" in err and repr(str(d / hf.CONFIG)) in err, err
    assert no_reads == []


def test_config_json_size_checked_before_parsing(dirs: dict[str, Path], tmp_path: Path,
                                                 capfd: pytest.CaptureFixture[str]) -> None:
    d = _copy(dirs["plain"], tmp_path)
    text = (d / hf.CONFIG).read_text()
    (d / hf.CONFIG).write_text(text + " " * (1 << 20))  # still valid JSON
    err = _refused(tmp_path, capfd, d)
    assert err.endswith(f"{str(d / hf.CONFIG)!r}: {len(text) + (1 << 20):,} bytes; expected a config.json of at "
                        "most 1,048,576 bytes (MAX_CONFIG_BYTES)"), err
    (d / hf.CONFIG).write_text("[" * 200_000 + "]" * 200_000)
    err = _refused(tmp_path, capfd, d)
    assert err.endswith(f"{str(d / hf.CONFIG)!r}: not a JSON config.json (nested too deeply)"), err
    (d / hf.CONFIG).write_text(text.rstrip().removesuffix("}") + ', "deep": ' + "[" * 900 + "]" * 900 + "}")
    err = _refused(tmp_path, capfd, d)  # parsed, then too deep for the copy of its unknown fields
    assert err.endswith(f"{str(d / hf.CONFIG)!r}: a value nested too deeply; expected a config.json"), err


# ---- 3. damaged or hostile safetensors files and indexes -----------------------------------------------------


def _truncated(path: Path) -> None:
    raw = path.read_bytes()
    path.write_bytes(raw[:len(raw) // 2])


def _huge_header(path: Path) -> None:
    header, data = _split(path)
    _join(path, json.dumps(header).encode(), data, length=2**63)


def _header_past_end(path: Path) -> None:
    header, data = _split(path)
    h = json.dumps(header).encode()
    _join(path, h, data, length=len(h) + len(data) + 1)  # one byte more than there is


def _garbage_header(path: Path) -> None:
    header, data = _split(path)
    _join(path, b"\xff{" + b"x" * 30, data)


def _not_an_object(path: Path) -> None:
    _join(path, b"[1, 2]", b"")


def _overlap(path: Path) -> None:
    header, data = _split(path)
    a, b = "model.layers.0.input_layernorm.weight", "model.layers.0.post_attention_layernorm.weight"
    header[b]["data_offsets"] = header[a]["data_offsets"]
    _join(path, header, data)


def _size_mismatch(path: Path) -> None:
    header, data = _split(path)
    header["model.layers.0.input_layernorm.weight"]["shape"] = [129]
    _join(path, header, data)


def _unknown_dtype(path: Path) -> None:
    header, data = _split(path)
    header["model.layers.0.input_layernorm.weight"]["dtype"] = "F4"
    _join(path, header, data)


def _empty(path: Path) -> None:
    path.write_bytes(b"")


@pytest.mark.parametrize(("damage", "expected"), [
    (_truncated, "tensor '.*': data_offsets \\[\\d+, \\d+\\] past the end of the data \\([\\d,]+ bytes after the "
                 "header\\); expected a whole file \\(truncated\\?\\)"),
    (_huge_header, "header length 9,223,372,036,854,775,808 bytes; expected at most 100,000,000 "
                   "\\(MAX_HEADER_BYTES; a damaged file, or not safetensors\\)"),
    (_header_past_end, "header length [\\d,]+ bytes, but the file has [\\d,]+; expected a whole safetensors file"),
    (_garbage_header, "not a safetensors file \\(its header\\) \\(not JSON: "),
    (_not_an_object, "header is a JSON list; expected an object of tensors"),
    (_overlap, "tensor 'model.layers.0.post_attention_layernorm.weight': data_offsets \\[\\d+, \\d+\\] overlap those "
               "of 'model.layers.0.input_layernorm.weight'; expected disjoint byte ranges"),
    (_size_mismatch, "tensor 'model.layers.0.input_layernorm.weight': F32 \\[129\\] is 516 bytes, its data_offsets "
                     "\\[\\d+, \\d+\\] hold 512; expected the same"),
    (_unknown_dtype, "tensor 'model.layers.0.input_layernorm.weight': dtype 'F4'; expected one of BOOL, U8"),
    (_empty, "0 bytes; expected a safetensors file \\(an 8-byte header length and a JSON header; the file is empty "
             "or truncated\\)"),
], ids=lambda v: v.__name__.strip("_") if callable(v) else "")
def test_damaged_shard_is_one_line_naming_it(dirs: dict[str, Path], tmp_path: Path, no_reads: list[str],
                                             capfd: pytest.CaptureFixture[str], damage: Any, expected: str) -> None:
    d = _copy(dirs["plain"], tmp_path)
    shard = _shard_of(d, "model.layers.0.input_layernorm.weight")
    damage(shard)
    err = _refused(tmp_path, capfd, d)
    assert re.fullmatch(f"moonrt train: error: {re.escape(repr(str(shard)))}: {expected}.*", err), err
    assert no_reads == []


def test_malformed_index_is_one_line_naming_it(dirs: dict[str, Path], tmp_path: Path, no_reads: list[str],
                                               capfd: pytest.CaptureFixture[str]) -> None:
    d = _copy(dirs["plain"], tmp_path)
    index = d / hf.INDEX
    doc = json.loads(index.read_text())
    where = f"moonrt train: error: {str(index)!r}: "
    index.write_text(json.dumps({**doc, "weight_map": list(doc["weight_map"])}))
    assert _refused(tmp_path, capfd, d) == where + ("weight_map is a JSON list; expected an object {tensor name: "
                                                    "shard file} (not a safetensors index)")
    index.write_text('{"weight_map": ' + "[" * 100_000 + "]" * 100_000 + "}")
    assert _refused(tmp_path, capfd, d) == where + "not a safetensors index (not JSON: nested too deeply)"
    index.write_text(json.dumps({"weight_map": {"model.norm.weight": "../plain/model-00001-of-00007.safetensors"}}))
    assert "weight_map['model.norm.weight'] = '../plain/" in _refused(tmp_path, capfd, d)
    with index.open("wb") as f:  # sparse: the size is refused before a byte is read
        f.truncate(hf.MAX_INDEX_BYTES + 1)
    assert _refused(tmp_path, capfd, d) == where + (f"{hf.MAX_INDEX_BYTES + 1:,} bytes; expected a safetensors index "
                                                    f"of at most {hf.MAX_INDEX_BYTES:,} bytes (MAX_INDEX_BYTES)")
    assert no_reads == []


def _replace(d: Path, name: str, tensor: torch.Tensor) -> Path:
    """Rewrite the shard holding ``name`` with ``tensor`` in its place (the index stays right)."""
    from safetensors.torch import load_file, save_file

    shard = _shard_of(d, name)
    tensors = load_file(str(shard))
    tensors[name] = tensor
    save_file(tensors, str(shard))
    return shard


def test_zero_dim_tensors_are_refused_from_the_header(dirs: dict[str, Path], tmp_path: Path, no_reads: list[str],
                                                      capfd: pytest.CaptureFixture[str]) -> None:
    d = _copy(dirs["mx"], tmp_path)
    name = "model.layers.1.block_sparse_moe.experts.3.w2.weight_packed"
    shard = _replace(d, name, torch.tensor(7, dtype=torch.uint8))
    no_reads.clear()
    assert _refused(tmp_path, capfd, d) == (f"moonrt train: error: {str(shard)!r}: {name}: shape (): expected (64, 28) "
                                            "(two MXFP4 codes a byte of (64, 56))")
    d = _copy(dirs["plain"], tmp_path / "matrix")
    shard = _replace(d, "lm_head.weight", torch.tensor(1.0))
    no_reads.clear()
    assert _refused(tmp_path, capfd, d) == (f"moonrt train: error: {str(shard)!r}: lm_head.weight: shape (): expected "
                                            "(256, 128) (from the config)")
    assert no_reads == []


# ---- 4. dtypes -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("dtype", "code"), [(torch.bool, "BOOL"), (torch.int32, "I32"), (torch.uint8, "U8")])
def test_non_float_weights_are_refused_not_cast(dirs: dict[str, Path], tmp_path: Path, no_reads: list[str],
                                                capfd: pytest.CaptureFixture[str], dtype: torch.dtype,
                                                code: str) -> None:
    d = _copy(dirs["plain"], tmp_path)
    shard = _replace(d, "model.norm.weight", torch.ones(128, dtype=dtype))
    no_reads.clear()
    assert _refused(tmp_path, capfd, d) == (
        f"moonrt train: error: {str(shard)!r}: model.norm.weight: dtype {code}: expected a floating-point weight "
        "(F32, BF16, F16, F64; the release stores BF16 and F32); not converted")
    assert no_reads == []


def test_packed_pair_of_another_dtype_is_refused(dirs: dict[str, Path], tmp_path: Path,
                                                 capfd: pytest.CaptureFixture[str]) -> None:
    d = _copy(dirs["mx"], tmp_path)
    name = "model.layers.1.block_sparse_moe.experts.0.w1.weight_scale"
    shard = _replace(d, name, torch.zeros(56, 8, dtype=torch.float32))
    assert _refused(tmp_path, capfd, d) == (f"moonrt train: error: {str(shard)!r}: {name}: dtype F32: expected U8 "
                                            "(packed MXFP4)")


# ---- 5. non-finite weights -------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_weight_is_named_at_load(dirs: dict[str, Path], tmp_path: Path,
                                            capfd: pytest.CaptureFixture[str], bad: float) -> None:
    d = _copy(dirs["plain"], tmp_path)
    name = "model.layers.2.self_attn.A_log"
    shard = _shard_of(d, name)
    from safetensors.torch import load_file

    w = load_file(str(shard))[name].clone()
    w[1] = bad
    _replace(d, name, w)
    assert _refused(tmp_path, capfd, d) == (f"moonrt train: error: {str(shard)!r}: tensor {name!r} holds 1 NaN or "
                                            "infinite values (of 4); expected finite weights")


def test_nan_mxfp4_scale_is_named_at_load(dirs: dict[str, Path], tmp_path: Path,
                                          capfd: pytest.CaptureFixture[str]) -> None:
    d = _copy(dirs["mx"], tmp_path)
    name = "model.layers.1.block_sparse_moe.experts.0.w1.weight_scale"
    shard = _shard_of(d, name)
    from safetensors.torch import load_file

    s = load_file(str(shard))[name].clone()
    s[0, 0] = 255  # E8M0 NaN
    _replace(d, name, s)
    assert _refused(tmp_path, capfd, d) == (
        f"moonrt train: error: {str(shard)!r}: tensor {name!r} decodes "
        "'model.layers.1.block_sparse_moe.experts.0.w1.weight' to NaN or infinite values; expected finite weights")


# ---- 2. resumable without the source ---------------------------------------------------------------------------


@contextlib.contextmanager
def _cwd(path: Path) -> Iterator[None]:
    here = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(here)


@pytest.mark.slow
def test_resume_without_the_source_and_a_changed_source_named(dirs: dict[str, Path], tmp_path: Path,
                                                               capfd: pytest.CaptureFixture[str]) -> None:
    src = _copy(dirs["plain"], tmp_path)
    base = ("train", "--init-from", "hf", "--out", "run", "--metrics", "m.jsonl", "--steps", "4", *RUN)
    _main_here(tmp_path, (*base, "--threads", "1", "--until", "1"))
    saved = tmp_path / "saved"
    src.rename(saved)  # a scratch purge: the run needs nothing of it now
    _main_here(tmp_path, (*base, "--threads", "1", "--until", "2", "--resume"))
    _main_here(tmp_path, (*base, "--threads", "1", "--until", "3", "--resume-if-exists"))
    assert sorted(_metrics(tmp_path / "m.jsonl")) == [1, 2, 3] and _ckpt(tmp_path / "run")["step"] == 3
    recorded = _ckpt(tmp_path / "run")["config"]["init_from_sha256"]  # kept by every resume
    assert recorded == hf.identity(saved) and set(recorded) == {hf.CONFIG, hf.INDEX}

    def refused(changed: str) -> None:
        code, _, err = _cli([*base, "--threads", "0", "--resume"], capfd)
        assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
        assert err.startswith(f"moonrt train: error: init_from (--init-from) = 'hf': {str(Path('hf') / changed)!r} "
                              "changed since the run started from it (sha256 "), err

    with _cwd(tmp_path):
        shutil.copytree(saved, "hf")
        doc = json.loads(Path("hf", hf.CONFIG).read_text())
        Path("hf", hf.CONFIG).write_text(json.dumps({**doc, "top_k": 40}))  # the same model, another file
        refused(hf.CONFIG)
        shutil.copy(saved / hf.CONFIG, Path("hf", hf.CONFIG))
        index = json.loads(Path("hf", hf.INDEX).read_text())
        index["metadata"]["total_size"] += 1
        Path("hf", hf.INDEX).write_text(json.dumps(index))
        refused(hf.INDEX)
        shutil.copy(saved / hf.INDEX, Path("hf", hf.INDEX))
    _main_here(tmp_path, (*base, "--threads", "1", "--until", "4", "--resume"))  # the directory as it was
    assert sorted(_metrics(tmp_path / "m.jsonl")) == [1, 2, 3, 4]


# ---- 3. export on a full disk ----------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["tmpfs", "patched"])
def test_export_hf_on_a_full_disk(tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
                                  mode: str) -> None:
    _main_here(tmp_path, ("train", "--out", "run", "--steps", "1", "--threads", "1", *RUN))
    disk = tmp_path / "disk"
    disk.mkdir()
    if mode == "tmpfs":
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)], capture_output=True,
                              text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a 1 MiB tmpfs here ({done.stderr.strip() or done.returncode}): the 'patched' "
                        "case covers ENOSPC with a writer that fails")
    else:
        import safetensors.torch
        from safetensors import SafetensorError

        real = safetensors.torch.save_file

        def full(tensors: Any, path: str, *args: Any, **kwargs: Any) -> None:
            if "00003-of" in path:  # two shards written, the third half-written when the disk fills
                Path(path).write_bytes(b"\0" * 1000)
                raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
            real(tensors, path, *args, **kwargs)

        monkeypatch.setattr(safetensors.torch, "save_file", full)
    try:
        (disk / "keep.txt").write_text("the user's")
        out = disk / "hf"
        out.mkdir()  # an empty directory of the user's: kept as it is
        code, _, err = _cli(["checkpoint", "export", str(tmp_path / "run"), str(out), "--format", "hf",
                             "--max-shard-size", "2MB"], capfd)
        assert code == 2 and err == (f"moonrt checkpoint: FILE = {str(out)!r}: cannot write the Hugging Face directory "
                                     "(No space left on device); nothing written\n"), err
        assert sorted(p.name for p in disk.iterdir()) == ["hf", "keep.txt"] and list(out.iterdir()) == []
        assert (disk / "keep.txt").read_text() == "the user's"
    finally:
        if mode == "tmpfs":
            subprocess.run(["umount", str(disk)], check=False)
