"""Hugging Face directories in the released Kimi K3 layout (issue 32 item 2): ``config.json``, safetensors shards
of bounded size and ``model.safetensors.index.json``; written by ``moonrt checkpoint export --format hf`` and read
by ``moonrt train --init-from`` (and :func:`load_state`).

Names, shapes and the config schema: :mod:`moonrt.models.k3.hf_adapter`, :mod:`moonrt.models.k3.hf_config`.
Shards are ``model-00001-of-0000N.safetensors`` holding tensors in the released order, a new shard started
before a tensor would take one past ``max_shard_bytes`` (a single larger tensor gets a shard of its own); the
index maps every tensor to its shard and records ``metadata.total_size`` (bytes). A directory with one
``model.safetensors`` and no index is read too.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from moonrt.config import ConfigError
from moonrt.models.k3 import hf_adapter, hf_config
from moonrt.models.k3.model.config import K3Config

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
CONFIG = "config.json"
DEFAULT_SHARD_BYTES = 5 * 10**9
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str, flag: str = "--max-shard-size") -> int:
    """``"5GB"``, ``"200MB"``, ``"64KiB"``, ``"1000"`` -> bytes (>= 1); ConfigError naming ``flag`` otherwise."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = m.group(2).upper() if m else ""
    if not m or (unit and unit not in _UNITS):
        raise ConfigError(f"{flag} = {text!r}: expected a size such as 5GB, 200MB or 1000 (bytes)")
    n = int(float(m.group(1)) * _UNITS[unit or "B"])
    if n < 1:
        raise ConfigError(f"{flag} = {text!r}: expected at least 1 byte")
    return n


def shard_plan(tensors: Mapping[str, torch.Tensor], max_shard_bytes: int) -> list[list[str]]:
    """Tensor names grouped into shards in order, each group at most ``max_shard_bytes`` (a larger tensor alone)."""
    groups: list[list[str]] = [[]]
    size = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if groups[-1] and size + n > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += n
    return groups


def write_dir(out: Path, tensors: Mapping[str, torch.Tensor], config_doc: dict[str, Any],
              max_shard_bytes: int = DEFAULT_SHARD_BYTES, metadata: dict[str, str] | None = None) -> list[str]:
    """Write ``config_doc`` as ``config.json``, ``tensors`` as shards and the index into the existing, empty
    directory ``out``; returns the shard file names."""
    from safetensors.torch import save_file

    groups = shard_plan(tensors, max_shard_bytes)
    files = [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    weight_map = {}
    for file, names in zip(files, groups, strict=True):
        save_file({n: tensors[n] for n in names}, str(out / file), metadata={"format": "pt", **(metadata or {})})
        weight_map |= dict.fromkeys(names, file)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (out / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    (out / CONFIG).write_text(json.dumps(config_doc, indent=2) + "\n")
    return files


def read_tensors(src: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the directory ``src`` (through its index, or its single ``model.safetensors``); ConfigError
    naming the file for a missing shard, a tensor the index names that its shard lacks, or the reverse."""
    from safetensors import safe_open

    index = src / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"{str(index)!r}: not a safetensors index ({type(exc).__name__}: {exc})") from None
    elif (src / SINGLE).is_file():
        weight_map = None
    else:
        raise ConfigError(f"{str(src)!r}: no {INDEX} and no {SINGLE}; expected a Hugging Face model directory")
    files = sorted(set(weight_map.values())) if weight_map is not None else [SINGLE]
    out: dict[str, torch.Tensor] = {}
    for file in files:
        path = src / file
        if not path.is_file() or Path(file).name != file:
            raise ConfigError(f"{str(index)!r}: shard {file!r} does not exist in {str(src)!r}")
        with safe_open(str(path), framework="pt") as f:
            names = list(f.keys())
            if weight_map is not None and (stray := [n for n in names if weight_map.get(n) != file]):
                raise ConfigError(f"{str(path)!r}: holds {stray[0]!r}, which the index does not map to it")
            out |= {n: f.get_tensor(n) for n in names}
    if weight_map is not None and (lost := [n for n in weight_map if n not in out]):
        raise ConfigError(f"{str(index)!r}: {lost[0]!r} is not in its shard {weight_map[lost[0]]!r}")
    return out


def load_state(src: str | Path) -> tuple[dict[str, torch.Tensor], hf_config.HFConfig, list[str]]:
    """``(moonrt state dict, its config, skipped vision keys)`` of a released-layout directory: config.json read
    (:func:`moonrt.models.k3.hf_config.read_config`), every tensor read, packed MXFP4 experts decoded (fp32),
    names mapped strictly (:func:`moonrt.models.k3.hf_adapter.from_hf`). ConfigError naming the directory and the
    key / field for anything that does not match."""
    src = Path(src)
    if not (src / CONFIG).is_file():
        raise ConfigError(f"{str(src)!r}: no {CONFIG}; expected a Hugging Face model directory")
    cfg = hf_config.read_config(src / CONFIG)
    tensors = read_tensors(src)
    prefix, skipped = hf_adapter.split_prefix(tensors)
    for k in skipped:
        del tensors[k]
    try:
        state = hf_adapter.from_hf(hf_adapter.unpack(tensors), cfg.model, prefix)
    except ValueError as exc:
        raise ConfigError(f"{str(src)!r}: {exc}") from None
    return state, cfg, skipped


def export_dir(out: Path, state: Mapping[str, torch.Tensor], cfg: K3Config, *, mxfp4_block: int | None = None,
               multimodal: bool = False, max_shard_bytes: int = DEFAULT_SHARD_BYTES,
               metadata: dict[str, str] | None = None, release_dtypes: bool = False) -> tuple[list[str], int, int]:
    """Write moonrt state dict ``state`` of ``cfg`` into the empty directory ``out`` in the released layout
    (``mxfp4_block``: routed experts packed in MXFP4 with that block, from the state's values; ``multimodal``:
    the ``language_model.`` prefix and the ``kimi_k3`` wrapper config; ``release_dtypes``: BF16 / F32 as the
    release stores each tensor, :func:`moonrt.models.k3.hf_adapter.release_dtypes`, else the state's dtypes).
    Returns ``(shard files, tensor count, bytes)``."""
    prefix = hf_adapter.MULTIMODAL_PREFIX if multimodal else ""
    tensors = hf_adapter.to_hf(state, cfg, prefix)
    dtypes = {t.dtype for t in tensors.values()}
    dtype = str(next(iter(dtypes))).removeprefix("torch.") if len(dtypes) == 1 else "float32"
    if mxfp4_block is not None:
        tensors = hf_adapter.pack_mxfp4(tensors, mxfp4_block)
    if release_dtypes:
        tensors, dtype = hf_adapter.release_dtypes(tensors), "bfloat16"
    doc = hf_config.to_json(cfg, dtype=dtype, mxfp4_block=mxfp4_block, wrapper={} if multimodal else None)
    files = write_dir(out, tensors, doc, max_shard_bytes, metadata)
    return files, len(tensors), sum(t.numel() * t.element_size() for t in tensors.values())


__all__ = ["CONFIG", "DEFAULT_SHARD_BYTES", "INDEX", "export_dir", "load_state", "parse_size", "read_tensors",
           "shard_plan", "write_dir"]


def job_init(job: Any, load: bool = True) -> tuple[dict[str, torch.Tensor] | None, str]:
    """``init_from`` of a training job (a :class:`moonrt.jobs.train.config.JobConfig`): sets the job's
    ``model_config`` to the directory's config when the job gives none (ConfigError if the job's ``model`` is not
    a K3 preset, or if a given ``model_config`` differs, naming the first differing field) and, with ``load``,
    returns the moonrt state dict to start from (None without) and a note on what was read (tensors, packed
    experts decoded, vision tensors skipped)."""
    import dataclasses

    src = Path(job.init_from)
    spec = job.model_spec()
    if spec.config_type is not K3Config:
        raise ConfigError(f"init_from (--init-from) = {job.init_from!r}: model {job.model!r} is of family "
                          f"{spec.name!r}; expected a K3 preset (the released Kimi K3 layout)")
    if not (src / CONFIG).is_file():
        raise ConfigError(f"init_from (--init-from) = {job.init_from!r}: no {CONFIG}; expected a Hugging Face "
                          "model directory in the released Kimi K3 layout")
    cfg = hf_config.read_config(src / CONFIG).model
    if job.model_config is None:
        job.model_config = cfg
    else:
        mine = job.model_cfg()
        if mine != cfg:
            field = next(f.name for f in dataclasses.fields(K3Config) if getattr(mine, f.name) != getattr(cfg, f.name))
            raise ConfigError(f"model_config.{field} = {getattr(mine, field)!r}: expected {getattr(cfg, field)!r}, "
                              f"the value in {str(src / CONFIG)!r} (init_from)")
    if not load:
        return None, ""
    state, read, skipped = load_state(src)
    packed = ", MXFP4 experts decoded" if read.mxfp4_block else ""
    note = f"initial weights from {str(src)!r} (the released Kimi K3 layout{packed})"
    if skipped:
        note += (f"; {len(skipped)} vision tensors skipped ({', '.join(sorted({k.split('.')[0] for k in skipped}))}: "
                 "moonrt's K3 is the text model)")
    return state, note
