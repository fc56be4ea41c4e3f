"""Sharded checkpoint state for ``torch.distributed.checkpoint`` (DCP): what each rank owns, by single-process name.

A **sharded state** is a flat ``dict[str, torch.Tensor | Shard]`` a rank hands to DCP (runtime layer: the
parts of :class:`moonrt.comm.parallelism.Parallelism` build it, :mod:`moonrt.jobs.checkpoint.sharded` saves and loads
it):

- ``model.<name>``: every entry of the single-process ``model.state_dict()`` with its single-process shape.
  A whole tensor (a replica: DCP keeps one copy, from the rank with the least to write) or a :class:`Shard`
  (expert weights under EP: rows ``[first, first + E/R)`` of the stacked ``[E, ...]`` tensor).
- ``optimizer.<name>.exp_avg`` / ``.exp_avg_sq``: the AdamW moments of parameter ``<name>``, **flattened**
  to ``[numel]`` of the single-process parameter, so that every layout's piece is one contiguous range:
  an EP rank's experts, a ZeRO-1 owner's piece of its flat bucket (``moonrt.comm.zero.core.Slot``), or both.
  ``optimizer.<name>.step``: the parameter's AdamW step count, a 0-d float64 tensor (0: no state yet).
- ``optimizer.<name>.momentum_buffer``: the momentum of a parameter in a ``use_muon`` group of
  :class:`moonrt.ops.muon.Muon`, with the parameter's **single-process shape** (not flattened: a Muon block
  ``[a, b]`` of ``[*S, A, B]`` is a box, rows or columns, one per block a ZeRO-Muon owner holds: :class:`Boxes`);
  zeros when the parameter has no state yet. Its ``optimizer.<name>.step`` says whether it has state (> 0; a
  ZeRO-Muon owner counts steps, the single-process Muon, which keeps no count, writes 1). A zero buffer and no
  buffer give the same next step bit for bit (``Muon._muon_param`` starts an absent buffer as zeros, then the
  same ``lerp_``), so loading never needs the marker for exactness; it is there so that a checkpoint converted to
  the gathered format has state for exactly the parameters the gathered ``optimizer.state_dict()`` has (a buffer
  can be all zeros after a step: a parameter whose gradients were exactly zero), and so that every rank agrees on
  it without a collective (EP gathers every rank's state of a parameter together).
  The AdamW-group parameters of Muon have AdamW's three entries (above).

Loading builds the same dict with the *target* tensors (views of the parameters and optimizer buffers where
possible), DCP copies every requested range from whichever saved chunks overlap it (resharding), and the
part's ``load_sharded_state_dict`` finishes (step counts into the optimizer). :class:`SafeReader` and
:class:`ShardLoadPlanner` make loading execute no pickled object (see their docstrings).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import math
import os
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem, TensorWriteData, WriteItem, WriteItemType

from moonrt.ops.muon import Blocking, block_grid, step_count

MOMENTS = ("exp_avg", "exp_avg_sq")
MOMENTUM = "momentum_buffer"
"""Muon's state key (``torch.optim.Muon``'s name, kept by :class:`moonrt.ops.muon.Muon`)."""


@dataclasses.dataclass
class Shard:
    """``local`` is the box ``offsets + local.shape`` of a tensor whose single-process shape is ``shape``.

    DCP's hooks (``__create_write_items__``, ``__create_chunk_list__``, ``size``) describe it as one chunk;
    the planners below hand DCP ``local`` itself to write from or read into.
    """

    local: torch.Tensor
    shape: tuple[int, ...]
    offsets: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.offsets) != len(self.shape) or self.local.dim() != len(self.shape) or any(
                o < 0 or o + n > s for o, n, s in zip(self.offsets, self.local.shape, self.shape)):
            raise ValueError(f"Shard: local {tuple(self.local.shape)} at {self.offsets} does not fit in {self.shape}")

    def size(self) -> torch.Size:
        return torch.Size(self.shape)

    def chunk(self) -> ChunkStorageMetadata:
        return ChunkStorageMetadata(offsets=torch.Size(self.offsets), sizes=torch.Size(self.local.shape))

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(self.offsets)), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=self.chunk(),
                                                      properties=TensorProperties.create_from_tensor(self.local),
                                                      size=self.size()))]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [self.chunk()]


@dataclasses.dataclass
class Boxes:
    """Several boxes ``parts`` (each a :class:`Shard` of single-process shape ``shape``) of one tensor on one rank:
    the Muon blocks a ZeRO-Muon owner holds of one parameter (rows or columns: a column block is no contiguous
    range of the flattened tensor, so the moment cannot be one flat :class:`Shard`).

    DCP sees one write item / chunk per box; the planners below find the box of an item by its offsets (a
    ``MetadataIndex.offset``: every box of a tensor starts at its own offsets).
    """

    shape: tuple[int, ...]
    parts: list[Shard]

    def __post_init__(self) -> None:
        starts = [p.offsets for p in self.parts]
        if any(p.shape != self.shape for p in self.parts) or len(set(starts)) != len(starts):
            raise ValueError(f"Boxes: parts {[(p.shape, p.offsets) for p in self.parts]} of {self.shape}: expected "
                             "the same shape and distinct offsets")

    def size(self) -> torch.Size:
        return torch.Size(self.shape)

    def box(self, offsets: Any) -> torch.Tensor:
        """The local tensor of the box starting at ``offsets``."""
        want = tuple(offsets)
        for p in self.parts:
            if p.offsets == want:
                return p.local
        raise KeyError(f"Boxes: no box at offsets {want} (boxes at {[p.offsets for p in self.parts]})")

    def numel(self) -> int:
        return sum(p.local.numel() for p in self.parts)

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        return [w for p in self.parts for w in p.__create_write_items__(fqn, p)]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [p.chunk() for p in self.parts]


def entry_bytes(obj: Any) -> int:
    """Bytes of this rank's data in a sharded-state value (a tensor, :class:`Shard` or :class:`Boxes`)."""
    tensors = [p.local for p in obj.parts] if isinstance(obj, Boxes) else [_local(obj)]
    return sum(t.numel() * t.element_size() for t in tensors)


def flat_shard(local: torch.Tensor, numel: int, start: int) -> Shard:
    """Elements ``[start, start + local.numel())`` of a flattened ``[numel]`` tensor (``local`` viewed 1-D)."""
    return Shard(local.reshape(-1), (numel,), (start,))


def block_box(buf: torch.Tensor, local_shape: torch.Size, spec: Blocking | None, k: int, shape: tuple[int, ...],
              first: int = 0) -> Shard:
    """Block ``k`` (``block_view``'s numbering) of a parameter of this rank's shape ``local_shape`` as a box of its
    single-process ``shape``: ``buf [a, b]`` viewed ``[1, ..., 1, a, b]`` at the block's stack index, row or
    column offset, shifted by ``first`` rows along dim 0 (EP: the rank's first home expert)."""
    stack, heads, a, b = block_grid(local_shape, spec)
    sd = spec.stack_dims if spec is not None else 0
    s, h = divmod(k, heads)
    index = []
    for n in reversed(local_shape[:sd]):  # the stack index s over the stacked dims, row-major
        s, i = divmod(s, n)
        index.insert(0, i)
    offsets = index + ([h * a, 0] if heads == 1 or spec.axis == 0 else [0, h * b])
    offsets[0] += first
    return Shard(buf.view(*([1] * sd), a, b), tuple(shape), tuple(offsets))


def _local(obj: Any) -> Any:
    return obj.local if isinstance(obj, Shard) else obj


def _target(obj: Any, index: MetadataIndex) -> torch.Tensor:
    """The local tensor of ``obj`` that write / read item ``index`` names (a :class:`Boxes` box by its offsets)."""
    return obj.box(index.offset) if isinstance(obj, Boxes) else _local(obj)


def _numel(obj: Any) -> int:
    return obj.numel() if isinstance(obj, Boxes) else _local(obj).numel()


class ShardSavePlanner(DefaultSavePlanner):
    """DCP's default save planner (replicas deduplicated across ranks) that also writes :class:`Shard` and
    :class:`Boxes` values (of a flat dict: nothing to flatten)."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def lookup_object(self, index: MetadataIndex) -> Any:
        return _target(self.state_dict[index.fqn], index)


class ShardLoadPlanner(DefaultLoadPlanner):
    """Loads into :class:`Shard`, :class:`Boxes` and tensor targets; refuses non-tensor (pickled) entries.

    DCP's default planner unpickles a ``BytesStorageMetadata`` entry with ``torch.load(weights_only=False)``;
    here such an entry is an error before any byte of it is read. The state dict is flat and its values are
    targets as they are (DCP's own set-up would replace a :class:`Shard` by None: it only knows tensors).
    """

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict: dict[str, Any], metadata: Metadata | None = None,
                       is_coordinator: bool = False) -> None:
        self.original_state_dict = self.state_dict = state_dict
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def create_local_plan(self) -> LoadPlan:
        """DCP's resharding reads, checked to cover every target element (DCP leaves an uncovered range as it was)."""
        plan = super().create_local_plan()
        covered: dict[str, int] = {}
        for item in plan.items:
            covered[item.dest_index.fqn] = covered.get(item.dest_index.fqn, 0) + math.prod(item.lengths)
        for fqn, target in self.state_dict.items():
            want = _numel(target)
            if covered.get(fqn, 0) != want:
                raise ValueError(f"checkpoint entry {fqn!r}: the saved chunks hold {covered.get(fqn, 0)} of the "
                                 f"{want} elements this rank needs (a checkpoint missing some ranks' files?)")
        return plan

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return _target(self.state_dict[index.fqn], index)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        raise ValueError(f"checkpoint entry {read_item.dest_index.fqn!r}: a pickled object, expected a tensor "
                         "(refused: loading executes no pickled objects)")


# DCP's ``.metadata`` file is a pickle (torch 2.13 reads it with plain ``pickle.load``): these are the only
# globals a DCP metadata pickle of tensors needs; anything else (a class whose reduce would run code) is refused.
_METADATA_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", n) for n in (
        "Metadata", "TensorStorageMetadata", "ChunkStorageMetadata", "TensorProperties", "BytesStorageMetadata",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.distributed.checkpoint.planner", "TensorWriteData"),
    ("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset")}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_GLOBALS or (module == "torch" and isinstance(
                getattr(torch, name, None), torch.dtype | torch.memory_format)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not a DCP metadata type")


def read_metadata_safely(data: bytes) -> Metadata:
    """Unpickle a DCP ``.metadata`` file allowing only DCP metadata classes, torch sizes, dtypes and formats."""
    md = _MetadataUnpickler(io.BytesIO(data)).load()
    if not isinstance(md, Metadata):
        raise pickle.UnpicklingError(f"holds {type(md).__name__}, expected DCP Metadata")
    return md


def check_storage_paths(md: Metadata, directory: str | os.PathLike[str]) -> None:
    """Refuse a ``.metadata`` whose entries are stored outside ``directory``: every ``storage_data`` entry's
    ``relative_path`` must be a plain relative file name (not absolute, no ``..`` part) that resolves, symlinks
    followed, to a path inside ``directory`` (DCP joins it to the directory, and an absolute path would replace
    the directory: a crafted index could make a load read any file). ``ValueError`` naming the entry."""
    storage = md.storage_data
    if not isinstance(storage, dict):
        raise ValueError(f"storage_data is a {type(storage).__name__}, expected a mapping of entries to files")
    root = os.path.realpath(directory)
    for index, info in storage.items():
        name = index.fqn if isinstance(index, MetadataIndex) else repr(index)
        rel = getattr(info, "relative_path", None)
        if not isinstance(rel, str) or not rel:
            raise ValueError(f"checkpoint entry {name!r}: stored in {rel!r}, expected a file name")
        parts = rel.replace("\\", "/").split("/")
        real = os.path.realpath(os.path.join(root, rel))
        if os.path.isabs(rel) or ".." in parts or os.path.commonpath([root, real]) != root or real == root:
            raise ValueError(f"checkpoint entry {name!r}: stored in {rel!r}, outside the checkpoint directory "
                             "(refused: a checkpoint reads only its own files)")


class SafeReader(FileSystemReader):
    """DCP's file-system reader with :func:`read_metadata_safely` for the pickled ``.metadata`` file (the tensor
    data files DCP reads with ``torch.load(weights_only=True)`` already) and :func:`check_storage_paths` (every
    entry read from a file of this directory)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        from torch.distributed.checkpoint.metadata import StorageMeta

        with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as f:
            md = read_metadata_safely(f.read())
        check_storage_paths(md, self.path)
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


class _Stream:
    """A written file that keeps the ``OSError`` of a failed write (a full disk, a quota), which torch's zip
    writer turns into ``RuntimeError("... unexpected pos ...")``; everything else is the file's."""

    def __init__(self, f: Any) -> None:
        self.f = f
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return self.f.write(data)
        except OSError as exc:
            self.error = exc
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self.f, name)


class _ErrnoFileSystem(FileSystem):
    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[Any]:
        with super().create_stream(path, mode) as f:
            if "r" in mode:
                yield f
                return
            stream = _Stream(f)
            try:
                yield stream
            except RuntimeError:
                if stream.error is not None:  # the write's own error (ENOSPC, EDQUOT, EIO), errno kept
                    raise stream.error from None
                raise


class SafeWriter(FileSystemWriter):
    """DCP's file-system writer whose failed writes raise the ``OSError`` itself (with its ``errno``: the caller can
    say "no space left on device"), not torch's "unexpected pos"."""

    def __init__(self, path: str | os.PathLike[str] | Path, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self.fs = _ErrnoFileSystem()


# ---- the single-process layout (the default of Parallelism and of the parts' unsharded parameters) ----------


def local_state(model: nn.Module, optim: torch.optim.Optimizer, shards: dict[int, tuple[tuple[int, ...], int]]
                | None = None) -> dict[str, Any]:
    """The sharded state of a model whose tensors are whole except ``shards``: ``id(param) -> (full shape,
    first row)`` (EP's home experts): :func:`model_entries` and :func:`optim_entries`."""
    return model_entries(model, shards) | optim_entries(model, optim, shards)


def model_entries(model: nn.Module, shards: dict[int, tuple[tuple[int, ...], int]] | None = None) -> dict[str, Any]:
    """``model.<name>`` for every ``model.state_dict()`` entry: a view of the tensor itself (save source and load
    target), a :class:`Shard` of rows ``[first, first + n)`` for the parameters in ``shards``."""
    shards = shards or {}
    out: dict[str, Any] = {}
    for name, t in model.state_dict(keep_vars=True).items():  # keep_vars: parameters are the objects themselves
        if id(t) in shards:
            shape, first = shards[id(t)]
            out[f"model.{name}"] = Shard(t.detach(), shape, (first,) + (0,) * (t.dim() - 1))
        else:
            out[f"model.{name}"] = t.detach()
    return out


def optim_entries(model: nn.Module, optim: torch.optim.Optimizer,
                  shards: dict[int, tuple[tuple[int, ...], int]] | None = None) -> dict[str, Any]:
    """The optimizer entries of every parameter of ``optim`` (torch AdamW, or :class:`moonrt.ops.muon.Muon`):
    ``optimizer.<name>.exp_avg`` / ``.exp_avg_sq`` (flat, a :class:`Shard` under ``shards``) of AdamW
    parameters, ``optimizer.<name>.momentum_buffer`` (the parameter's shape; under ``shards`` a :class:`Shard` of
    rows ``(first, 0, ...)``) of a ``use_muon`` group's, and ``.step`` (0-d float64) of both. A parameter without
    state yet gets zeros and step 0, so the same dict serves as the save source and the load target."""
    shards = shards or {}
    name_of = {id(p): n for n, p in model.named_parameters()}
    out: dict[str, Any] = {}
    for group in optim.param_groups:
        for p in group["params"]:
            name = name_of[id(p)]
            st = optim.state.get(p) or {}
            shape, first = shards.get(id(p), (tuple(p.shape), 0))
            if group.get("use_muon", False):
                buf = st.get(MOMENTUM)
                buf = buf if buf is not None else torch.zeros_like(p)
                out[f"optimizer.{name}.{MOMENTUM}"] = (Shard(buf, shape, (first,) + (0,) * (p.dim() - 1))
                                                       if id(p) in shards else buf)
                out[f"optimizer.{name}.step"] = step_count(float(MOMENTUM in st), torch.float64)
                continue
            row = p[0].numel() if p.dim() else 1
            for key in MOMENTS:
                buf = st.get(key)
                out[f"optimizer.{name}.{key}"] = flat_shard(buf if buf is not None else torch.zeros_like(p),
                                                            math.prod(shape), first * row)
            out[f"optimizer.{name}.step"] = step_count(float(st["step"]) if "step" in st else 0.0, torch.float64)
    return out


def finish_local_load(model: nn.Module, optim: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """After DCP filled a :func:`local_state` target (model tensors are loaded in place, being views): put the loaded
    moments / momentum buffers and step counts into ``optim.state`` (a parameter with step 0 gets no state, as in
    torch and :class:`moonrt.ops.muon.Muon`)."""
    name_of = {id(p): n for n, p in model.named_parameters()}
    for group in optim.param_groups:
        for p in group["params"]:
            name = name_of[id(p)]
            step = float(state[f"optimizer.{name}.step"])
            if step == 0:
                optim.state.pop(p, None)
                continue
            if group.get("use_muon", False):
                optim.state[p] = {MOMENTUM: _local(state[f"optimizer.{name}.{MOMENTUM}"]).view_as(p)}
                continue
            moments = {k: _local(state[f"optimizer.{name}.{k}"]).view_as(p) for k in MOMENTS}
            optim.state[p] = {"step": step_count(step), **moments}


__all__ = ["MOMENTS", "MOMENTUM", "Boxes", "SafeReader", "SafeWriter", "Shard", "ShardLoadPlanner", "ShardSavePlanner",
           "block_box", "entry_bytes", "finish_local_load", "flat_shard", "local_state", "model_entries",
           "optim_entries", "check_storage_paths", "read_metadata_safely"]
