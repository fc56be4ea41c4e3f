"""Sharded checkpoint state: what each rank owns, by single-process name (the entries ``torch.distributed.checkpoint``,
DCP, saves and loads: :mod:`moonrt.comm.state.dcp`).

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
part's ``load_sharded_state_dict`` finishes (step counts into the optimizer).

This module imports no ``torch.distributed.checkpoint`` (DCP imports ``torch.distributed.tensor`` and sympy:
~0.6-0.8 s per process, and every rank imports this module through :mod:`moonrt.comm.parallelism`, while a single
process never writes DCP): :class:`Shard`'s DCP hooks import DCP's classes when DCP calls them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from moonrt.ops.muon import Blocking, block_grid, step_count

if TYPE_CHECKING:  # DCP's types, for the annotations only (module docstring: DCP is imported when it runs)
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    from torch.distributed.checkpoint.planner import WriteItem

MOMENTS = ("exp_avg", "exp_avg_sq")
MOMENTUM = "momentum_buffer"
"""Muon's state key (``torch.optim.Muon``'s name, kept by :class:`moonrt.ops.muon.Muon`)."""


@dataclasses.dataclass
class Shard:
    """``local`` is the box ``offsets + local.shape`` of a tensor whose single-process shape is ``shape``.

    DCP's hooks (``__create_write_items__``, ``__create_chunk_list__``, ``size``) describe it as one chunk;
    the planners of :mod:`moonrt.comm.state.dcp` hand DCP ``local`` itself to write from or read into.
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
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return ChunkStorageMetadata(offsets=torch.Size(self.offsets), sizes=torch.Size(self.local.shape))

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        from torch.distributed.checkpoint.metadata import MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

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

    DCP sees one write item / chunk per box; the planners of :mod:`moonrt.comm.state.dcp` find the box of an item
    by its offsets (a ``MetadataIndex.offset``: every box of a tensor starts at its own offsets).
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
    tensors = [p.local for p in obj.parts] if isinstance(obj, Boxes) else [local_tensor(obj)]
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
    index: list[int] = []
    for n in reversed(local_shape[:sd]):  # the stack index s over the stacked dims, row-major
        s, i = divmod(s, n)
        index.insert(0, i)
    offsets = index + ([h * a, 0] if heads == 1 or (spec is not None and spec.axis == 0) else [0, h * b])
    offsets[0] += first
    return Shard(buf.view(*([1] * sd), a, b), tuple(shape), tuple(offsets))


def local_tensor(obj: Any) -> Any:
    """The tensor a sharded-state value holds on this rank (a :class:`Shard`'s ``local``, a tensor itself)."""
    return obj.local if isinstance(obj, Shard) else obj


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
                optim.state[p] = {MOMENTUM: local_tensor(state[f"optimizer.{name}.{MOMENTUM}"]).view_as(p)}
                continue
            moments = {k: local_tensor(state[f"optimizer.{name}.{k}"]).view_as(p) for k in MOMENTS}
            optim.state[p] = {"step": step_count(step), **moments}


__all__ = ["MOMENTS", "MOMENTUM", "Boxes", "Shard", "block_box", "entry_bytes", "finish_local_load", "flat_shard",
           "local_state", "local_tensor", "model_entries", "optim_entries"]
