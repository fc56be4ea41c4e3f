"""Hugging Face directories in the released Kimi K3 layout (issue 32 item 2): ``config.json``, safetensors shards
of bounded size and ``model.safetensors.index.json``; written by ``moonrt checkpoint export --format hf`` and read
by ``moonrt train --init-from`` (and :func:`load_state`).

Names, shapes and the config schema: :mod:`moonrt.models.k3.hf_adapter`, :mod:`moonrt.models.k3.hf_config`.
Shards are ``model-00001-of-0000N.safetensors`` holding tensors in the released order, a new shard started
before a tensor would take one past ``max_shard_bytes`` (a single larger tensor gets a shard of its own); the
index maps every tensor to its shard and records ``metadata.total_size`` (bytes). A directory with one
``model.safetensors`` and no index is read too.

Reading (:func:`load_state`, issue 45) bounds before it reads: config.json's size
(:data:`~moonrt.models.k3.hf_config.MAX_CONFIG_BYTES`) before it is parsed, the model's size from the config
(:func:`check_size`: ``MAX_LAYERS``, ``MAX_PARAMS``, :data:`MAX_TENSORS`), the index's size, every header's length
(:data:`MAX_HEADER_BYTES`) before the header; each header is validated as safetensors requires and its names,
shapes and dtypes checked against the config's released layout before any tensor data is read; read tensors must
be finite. Every failure is a ConfigError naming the file (and the tensor or field). A run started from a
directory records its :func:`identity` (``init_from_sha256``) and resumes without it (:func:`job_init`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import torch

from moonrt.config import ConfigError, umask
from moonrt.models.k3 import hf_adapter, hf_config
from moonrt.models.k3.model.config import K3Config
from moonrt.models.spec import MAX_PARAMS

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
CONFIG = "config.json"
DEFAULT_SHARD_BYTES = 5 * 10**9
MAX_INDEX_BYTES = 128 << 20
"""Largest ``model.safetensors.index.json`` read (128 MiB; the MXFP4 K3 release's ~500k entries: some 55 MB)."""
MAX_HEADER_BYTES = 100_000_000
"""Largest safetensors header read (safetensors' own limit): its 8-byte length is checked first."""
MAX_TENSORS = 1 << 20
"""Most tensors of a directory (an index, a header, a config's released layout; the MXFP4 K3 release: ~500k)."""
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
               "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
"""safetensors dtypes read, with their bytes per element (others are refused, naming the tensor)."""
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


class Entry(NamedTuple):
    """One tensor of a safetensors header: its file (a name in the directory), dtype, shape and byte range."""

    file: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


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
    directory ``out``; returns the shard file names. OSError (a full disk: ``ENOSPC``) naming the file it was
    writing; what was written stays for the caller to remove."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    groups = shard_plan(tensors, max_shard_bytes)
    files = [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    weight_map: dict[str, str] = {}
    for file, names in zip(files, groups, strict=True):
        try:
            save_file({n: tensors[n] for n in names}, str(out / file), metadata={"format": "pt", **(metadata or {})})
        except SafetensorError as exc:  # its I/O errors: "Error while serializing: I/O error: ... (os error 28)"
            code = re.search(r"os error (\d+)", str(exc))
            if code is None:
                raise OSError(f"{str(exc).splitlines()[0]}: {out / file}") from None
            raise OSError(int(code.group(1)), os.strerror(int(code.group(1))), str(out / file)) from None
        os.chmod(out / file, 0o666 & ~umask())  # safetensors writes its files 0600: the mode open() gives instead
        weight_map |= dict.fromkeys(names, file)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (out / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    (out / CONFIG).write_text(json.dumps(config_doc, indent=2) + "\n")
    return files


def _bounded(path: Path, limit: int, what: str, bound: str) -> bytes:
    """The bytes of the file ``path``, its size checked against ``limit`` before it is read; ConfigError naming it."""
    try:
        with path.open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            data = f.read(limit + 1) if size <= limit else b""
    except OSError as exc:
        raise ConfigError(f"{str(path)!r}: unreadable ({exc.strerror or exc})") from None
    if size > limit or len(data) > limit:
        raise ConfigError(f"{str(path)!r}: {max(size, len(data)):,} bytes; expected {what} of at most {limit:,} bytes "
                          f"({bound})")
    return data


def _json(path: Path, data: bytes, what: str) -> Any:
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as exc:  # ValueError: JSON or UTF-8; RecursionError: nested too deeply
        reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc).splitlines()[0]
        raise ConfigError(f"{str(path)!r}: not {what} (not JSON: {reason})") from None


def _header_bytes(path: Path) -> tuple[bytes, int]:
    """``(header JSON bytes, file size)`` of the safetensors file ``path``: its 8-byte length read first and
    checked against :data:`MAX_HEADER_BYTES` and the file's size before the header is."""
    try:
        with path.open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 8:
                raise ConfigError(f"{str(path)!r}: {size} bytes; expected a safetensors file (an 8-byte header length "
                                  "and a JSON header; the file is empty or truncated)")
            n = int.from_bytes(f.read(8), "little")
            if n > MAX_HEADER_BYTES:
                raise ConfigError(f"{str(path)!r}: header length {n:,} bytes; expected at most {MAX_HEADER_BYTES:,} "
                                  "(MAX_HEADER_BYTES; a damaged file, or not safetensors)")
            if 8 + n > size:
                raise ConfigError(f"{str(path)!r}: header length {n:,} bytes, but the file has {size:,}; expected "
                                  "a whole safetensors file (truncated?)")
            return f.read(n), size
    except OSError as exc:
        raise ConfigError(f"{str(path)!r}: unreadable ({exc.strerror or exc})") from None


def read_header(path: Path) -> dict[str, Entry]:
    """Tensor name -> :class:`Entry` of the safetensors file ``path``, from its header alone (no tensor data read),
    validated as safetensors requires: a JSON object of ``{dtype, shape, data_offsets}`` (and an optional
    ``__metadata__`` of strings), each tensor's byte range its dtype and shape's size, the ranges covering the data
    after the header exactly (no overlap, gap or range past the end). ConfigError naming the file and the tensor."""
    raw, size = _header_bytes(path)
    doc = _json(path, raw, "a safetensors file (its header)")
    where = f"{str(path)!r}: "
    if not isinstance(doc, dict):
        raise ConfigError(f"{where}header is a JSON {type(doc).__name__}; expected an object of tensors")
    meta = doc.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise ConfigError(f"{where}__metadata__ = {meta!r:.80}: expected an object of strings")
    if len(doc) > MAX_TENSORS:
        raise ConfigError(f"{where}{len(doc):,} tensors; expected at most {MAX_TENSORS:,} (MAX_TENSORS)")
    data = size - 8 - len(raw)
    out: dict[str, Entry] = {}
    for name, info in doc.items():
        dtype = info.get("dtype") if isinstance(info, dict) else None
        shape = info.get("shape") if isinstance(info, dict) else None
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if dtype not in DTYPE_BYTES:
            raise ConfigError(f"{where}tensor {name!r}: dtype {dtype!r:.40}; expected one of {', '.join(DTYPE_BYTES)}")
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise ConfigError(f"{where}tensor {name!r}: shape {shape!r:.80}; expected a list of integers >= 0")
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets)
                or not 0 <= offsets[0] <= offsets[1]):
            raise ConfigError(f"{where}tensor {name!r}: data_offsets {offsets!r:.80}; expected [begin, end] with "
                              "0 <= begin <= end")
        begin, end = offsets
        if end > data:
            raise ConfigError(f"{where}tensor {name!r}: data_offsets [{begin}, {end}] past the end of the data "
                              f"({data:,} bytes after the header); expected a whole file (truncated?)")
        need = math.prod(shape) * DTYPE_BYTES[dtype]
        if end - begin != need:
            raise ConfigError(f"{where}tensor {name!r}: {dtype} {shape} is {need:,} bytes, its data_offsets "
                              f"[{begin}, {end}] hold {end - begin:,}; expected the same")
        out[name] = Entry(path.name, dtype, tuple(shape), begin, end)
    at, last = 0, None
    for name, e in sorted(out.items(), key=lambda kv: (kv[1].begin, kv[1].end)):
        if e.begin < at:
            raise ConfigError(f"{where}tensor {name!r}: data_offsets [{e.begin}, {e.end}] overlap those of {last!r}; "
                              "expected disjoint byte ranges")
        if e.begin > at:
            raise ConfigError(f"{where}bytes [{at}, {e.begin}) before tensor {name!r} belong to no tensor; expected "
                              "the tensors to cover the data exactly")
        at, last = e.end, name
    if at != data:
        raise ConfigError(f"{where}{data - at:,} bytes after the last tensor belong to none; expected the tensors to "
                          "cover the data exactly")
    return out


def read_index(src: Path) -> dict[str, str]:
    """The ``weight_map`` of ``src``'s index (size bounded by :data:`MAX_INDEX_BYTES` before it is read): tensor
    name -> a shard file name in ``src``. ConfigError naming the index for anything else."""
    index = src / INDEX
    what = "a safetensors index"
    doc = _json(index, _bounded(index, MAX_INDEX_BYTES, what, "MAX_INDEX_BYTES"), what)
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict):
        found = type(weight_map if isinstance(doc, dict) else doc).__name__
        raise ConfigError(f"{str(index)!r}: weight_map is a JSON {found}; expected an object {{tensor name: shard "
                          "file} (not a safetensors index)")
    if len(weight_map) > MAX_TENSORS:
        raise ConfigError(f"{str(index)!r}: {len(weight_map):,} tensors; expected at most {MAX_TENSORS:,} "
                          "(MAX_TENSORS)")
    for name, file in weight_map.items():
        if not isinstance(file, str) or Path(file).name != file or file in ("", ".", ".."):
            raise ConfigError(f"{str(index)!r}: weight_map[{name!r}] = {file!r:.80}: expected the name of a shard "
                              f"file in {str(src)!r}")
    return weight_map


def read_headers(src: Path) -> dict[str, Entry]:
    """Tensor name -> :class:`Entry` of every tensor of the directory ``src`` (through its index, or its single
    ``model.safetensors``), from the headers alone (:func:`read_header`); ConfigError naming the file for a
    missing shard, a tensor the index names that its shard lacks, or the reverse."""
    if (src / INDEX).is_file():
        weight_map: dict[str, str] | None = read_index(src)
    elif (src / SINGLE).is_file():
        weight_map = None
    else:
        raise ConfigError(f"{str(src)!r}: no {INDEX} and no {SINGLE}; expected a Hugging Face model directory")
    files = sorted(set(weight_map.values())) if weight_map is not None else [SINGLE]
    out: dict[str, Entry] = {}
    for file in files:
        path = src / file
        if not path.is_file():
            raise ConfigError(f"{str(src / INDEX)!r}: shard {file!r} does not exist in {str(src)!r}")
        header = read_header(path)
        if weight_map is not None and (stray := [n for n in header if weight_map.get(n) != file]):
            raise ConfigError(f"{str(path)!r}: holds {stray[0]!r}, which the index does not map to it")
        out |= header
    if weight_map is not None and (lost := [n for n in weight_map if n not in out]):
        raise ConfigError(f"{str(src / INDEX)!r}: {lost[0]!r} is not in its shard {weight_map[lost[0]]!r}")
    return out


def read_tensors(src: Path, headers: Mapping[str, Entry] | None = None,
                 names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    """The tensors ``names`` (default: all) of the directory ``src`` whose headers are ``headers`` (default: read
    and validated, :func:`read_headers`), read shard by shard; ConfigError naming the tensor and its file for a
    floating-point tensor holding NaN or infinite values, and the file for one safetensors cannot read."""
    from safetensors import SafetensorError, safe_open

    headers = read_headers(src) if headers is None else headers
    by_file: dict[str, list[str]] = {}
    for n in headers if names is None else names:
        by_file.setdefault(headers[n].file, []).append(n)
    out: dict[str, torch.Tensor] = {}
    for file, part in by_file.items():
        path = src / file
        try:
            with safe_open(str(path), framework="pt") as f:
                for n in part:
                    out[n] = t = f.get_tensor(n)
                    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                        bad = int((~torch.isfinite(t)).sum())
                        raise ConfigError(f"{str(path)!r}: tensor {n!r} holds {bad:,} NaN or infinite values (of "
                                          f"{t.numel():,}); expected finite weights")
        except (SafetensorError, OSError) as exc:  # the file changed after its header was checked
            raise ConfigError(f"{str(path)!r}: unreadable ({str(exc).splitlines()[0]})") from None
    return out


def check_size(cfg: K3Config, where: str) -> None:
    """ConfigError naming ``where`` when a model of ``cfg`` has more than :data:`MAX_PARAMS` parameters or its
    released layout more than :data:`MAX_TENSORS` tensors: from the config alone, before any tensor is read."""
    from moonrt.models.k3.model.params import count_params

    total = count_params(cfg).total
    if total > MAX_PARAMS:
        raise ConfigError(f"{where}: {total:,} parameters (hidden_size {cfg.hidden_size}, num_hidden_layers "
                          f"{cfg.num_hidden_layers}, num_experts {cfg.num_experts}, vocab_size {cfg.vocab_size}); "
                          f"expected at most {MAX_PARAMS:,} (MAX_PARAMS: moonrt train builds the whole model in one "
                          "process)")
    n = hf_adapter.released_count(cfg)
    if n > MAX_TENSORS:
        raise ConfigError(f"{where}: {n:,} released tensors (num_experts {cfg.num_experts} x 3 in each MoE layer); "
                          f"expected at most {MAX_TENSORS:,} (MAX_TENSORS)")


def identity(src: Path) -> dict[str, str]:
    """What names the directory ``src``'s content, recorded by a run started from it (``init_from_sha256``):
    the SHA-256 of its ``config.json`` and of its index (or of its single ``model.safetensors``'s header)."""
    config = _bounded(src / CONFIG, hf_config.MAX_CONFIG_BYTES, "a config.json", "MAX_CONFIG_BYTES")
    out = {CONFIG: hashlib.sha256(config).hexdigest()}
    if (src / INDEX).is_file():
        index = _bounded(src / INDEX, MAX_INDEX_BYTES, "a safetensors index", "MAX_INDEX_BYTES")
        out[INDEX] = hashlib.sha256(index).hexdigest()
    elif (src / SINGLE).is_file():
        out[SINGLE] = hashlib.sha256(_header_bytes(src / SINGLE)[0]).hexdigest()
    return out


def load_state(src: str | Path) -> tuple[dict[str, torch.Tensor], hf_config.HFConfig, list[str]]:
    """``(moonrt state dict, its config, skipped vision keys)`` of a released-layout directory, in this order:
    config.json read (its size bounded, :func:`moonrt.models.k3.hf_config.read_config`) and the model's size
    checked (:func:`check_size`); every shard's header read and validated (:func:`read_headers`) and the tensors'
    names, shapes and dtypes checked against the config's released layout
    (:func:`moonrt.models.k3.hf_adapter.check_layout`); only then the text tensors read (finite), packed MXFP4
    experts decoded (fp32) and names mapped (:func:`moonrt.models.k3.hf_adapter.from_hf`). ConfigError naming the
    file and the key / field for anything that does not match."""
    src = Path(src)
    if not (src / CONFIG).is_file():
        raise ConfigError(f"{str(src)!r}: no {CONFIG}; expected a Hugging Face model directory")
    cfg = hf_config.read_config(src / CONFIG)
    check_size(cfg.model, repr(str(src / CONFIG)))
    headers = read_headers(src)
    prefix, skipped = hf_adapter.split_prefix(headers)
    vision = set(skipped)
    keep = [k for k in headers if k not in vision]
    try:
        hf_adapter.check_layout({k: (headers[k].dtype, headers[k].shape) for k in keep}, cfg.model, prefix)
    except hf_adapter.LayoutError as exc:
        where = src / headers[exc.key].file if exc.key in headers else src / (INDEX if (src / INDEX).is_file()
                                                                               else SINGLE)
        raise ConfigError(f"{str(where)!r}: {exc}") from None
    tensors = read_tensors(src, headers, keep)
    state = hf_adapter.unpack(tensors)
    for k in keep:
        base = k.removesuffix(hf_adapter.SCALE)
        if base != k and not bool(torch.isfinite(state[base]).all()):  # an E8M0 scale of 0xFF is NaN
            raise ConfigError(f"{str(src / headers[k].file)!r}: tensor {k!r} decodes {base!r} to NaN or infinite "
                              "values; expected finite weights")
    try:
        state = hf_adapter.from_hf(state, cfg.model, prefix)
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


__all__ = ["CONFIG", "DEFAULT_SHARD_BYTES", "DTYPE_BYTES", "INDEX", "MAX_HEADER_BYTES", "MAX_INDEX_BYTES",
           "MAX_TENSORS", "Entry", "check_size", "export_dir", "identity", "job_init", "load_state", "parse_size",
           "read_header", "read_headers", "read_index", "read_tensors", "shard_plan", "write_dir"]


def job_init(job: Any, load: bool = True, stored: Mapping[str, Any] | None = None
             ) -> tuple[dict[str, torch.Tensor] | None, str]:
    """``init_from`` of a training job (``moonrt train``'s job config): sets the job's
    ``model_config`` to the directory's config when the job gives none (ConfigError if the job's ``model`` is not
    a K3 preset, if the model is too large, :func:`check_size`, or if a given ``model_config`` differs, naming the
    first differing field) and its ``init_from_sha256`` to the directory's :func:`identity` (a given one must
    equal it: a changed file is named) and, with ``load``, returns the moonrt state dict to start from (None
    without) and a note on what was read (tensors, packed experts decoded, vision tensors skipped).

    ``stored``: the job config of the checkpoint a resume continues. A directory that no longer exists is then
    not needed (the checkpoint's ``model_config`` stands in for its config.json); one that exists must still
    have the recorded identity (a checkpoint written before identities were recorded: not compared)."""
    import dataclasses

    src = Path(job.init_from)
    spec = job.model_spec()
    flag = f"init_from (--init-from) = {job.init_from!r}"
    if spec.config_type is not K3Config:
        raise ConfigError(f"{flag}: model {job.model!r} is of family {spec.name!r}; expected a K3 preset (the "
                          "released Kimi K3 layout)")
    want = job.init_from_sha256 if stored is None else stored.get("init_from_sha256")
    if stored is not None and not os.path.lexists(src):  # removed after the run started: the checkpoint has it
        if job.model_config is None and isinstance(stored.get("model_config"), dict):
            try:
                job.model_config = spec.config_from_dict(stored["model_config"])
            except ConfigError as exc:
                raise ConfigError(f"model_config.{exc} (the checkpoint's; {flag} no longer exists)") from None
        job.init_from_sha256 = want
        return None, ""
    if not (src / CONFIG).is_file():
        raise ConfigError(f"{flag}: no {CONFIG}; expected a Hugging Face model directory in the released Kimi K3 "
                          "layout")
    now = identity(src)
    if isinstance(want, dict) and now != want:
        name = next(k for k in (CONFIG, INDEX, SINGLE, *want) if now.get(k) != want.get(k))
        which = "the checkpoint's" if stored is not None else "the job config's"
        raise ConfigError(f"{flag}: {str(src / name)!r} changed since the run started from it (sha256 "
                          f"{str(now.get(name, 'none'))[:16]}, recorded {str(want.get(name, 'none'))[:16]} in "
                          f"{which} init_from_sha256); expected the directory as it was, or gone (a resume reads the "
                          "model from its checkpoint)")
    cfg = hf_config.read_config(src / CONFIG).model
    check_size(cfg, f"{flag}: {str(src / CONFIG)!r}")
    if job.model_config is None:
        job.model_config = cfg
    else:
        mine = job.model_cfg()
        if mine != cfg:
            field = next(f.name for f in dataclasses.fields(K3Config) if getattr(mine, f.name) != getattr(cfg, f.name))
            raise ConfigError(f"model_config.{field} = {getattr(mine, field)!r}: expected {getattr(cfg, field)!r}, "
                              f"the value in {str(src / CONFIG)!r} (init_from)")
    job.init_from_sha256 = want if stored is not None else now  # a resume keeps what its checkpoint recorded
    if not load:
        return None, ""
    state, read, skipped = load_state(src)
    packed = ", MXFP4 experts decoded" if read.mxfp4_block else ""
    note = f"initial weights from {str(src)!r} (the released Kimi K3 layout{packed})"
    if skipped:
        note += (f"; {len(skipped)} vision tensors skipped ({', '.join(sorted({k.split('.')[0] for k in skipped}))}: "
                 "moonrt's K3 is the text model)")
    return state, note
