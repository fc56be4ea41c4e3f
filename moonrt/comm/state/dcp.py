"""The ``torch.distributed.checkpoint`` (DCP) side of sharded checkpoints: the planners that save and load the
sharded state of :mod:`moonrt.comm.state.shards` (:class:`~moonrt.comm.state.shards.Shard` and
:class:`~moonrt.comm.state.shards.Boxes` values beside whole tensors), and the reader and writer that make a load
execute no pickled object and read only its own directory's files, and a failed write keep its ``errno``.

Imported by the functions of :mod:`moonrt.jobs.checkpoint.sharded` that read or write a DCP checkpoint, never at a
rank's start (DCP's import costs ~0.6-0.8 s per process).
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem

from moonrt.comm.state.shards import Boxes, local_tensor


def _target(obj: Any, index: MetadataIndex) -> torch.Tensor:
    """The local tensor of ``obj`` that write / read item ``index`` names (a :class:`Boxes` box by its offsets)."""
    return obj.box(index.offset) if isinstance(obj, Boxes) else local_tensor(obj)


def _numel(obj: Any) -> int:
    return obj.numel() if isinstance(obj, Boxes) else local_tensor(obj).numel()


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
        meta = getattr(md, "storage_meta", None)
        if meta is None:
            meta = md.storage_meta = StorageMeta()
        meta.load_id = self.load_id
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


__all__ = ["SafeReader", "SafeWriter", "ShardLoadPlanner", "ShardSavePlanner", "check_storage_paths",
           "read_metadata_safely"]
