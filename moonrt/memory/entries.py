"""The records behind saved tensors of the activation manager (:mod:`moonrt.memory.manager`), shared by the
saved-tensor hooks (:mod:`.saved_hooks`) and the FP8 / host batchers (:mod:`.fp8_batch`, :mod:`.host_batch`).

- :class:`Entry`: one stored unit (a storage for raw policies, a view for FP8), shared by deduplicated saves.
- :class:`PartEntry`: a storage in a batched host copy (part of a copy group).
- :class:`KeepEntry`: a storage saved under ``keep`` (counted, never copied).
- :class:`Handle`: what autograd holds instead of a saved tensor; releases its entry when dropped.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import torch

from moonrt.memory.backends import Backend, Packed


class Entry:
    """One stored unit (a storage for raw policies, a view for FP8), shared by deduplicated saves.

    An FP8 entry is first *pending* (``raw`` holds the tensor, ``packed`` is None) until its batch is
    quantized in one call; ``decoded`` holds its tensor when a batched decode ran ahead of its unpack. (A save of
    a batched host copy is a :class:`PartEntry`.)"""

    __slots__ = ("backend", "packed", "refs", "layer", "future", "parts", "key", "weak", "region", "raw", "batch",
                 "decoded", "waiting", "__weakref__")

    def __init__(self, backend: Backend, packed: Packed | None, layer: int, key: Any, weak: Any,
                 region: tuple[str, str]) -> None:
        self.backend = backend
        self.packed = packed
        self.refs = 0
        self.layer = layer
        self.future: Future | None = None
        self.parts: list[torch.Tensor] | None = None
        self.key = key
        self.weak = weak
        self.region = region  # (region name, policy label) the save is accounted under
        self.raw: torch.Tensor | None = None
        self.batch: Any = None  # its fp8_batch.Fp8Batch while live (entries know no batch type: no import cycle)
        self.decoded: torch.Tensor | None = None
        self.waiting = 1
        """Saves of the entry not unpacked yet (an upper bound): an FP8 entry keeps ``decoded`` for them."""


class PartEntry:
    """A storage saved under a batched host policy (:mod:`.host_batch`): part ``index`` of the copy ``group``
    (``None`` once released). The class attributes let generic scans of the entries (prefetch) skip it."""

    __slots__ = ("refs", "key", "weak", "region", "label", "tier", "group", "index", "layer", "backend")
    packed = None
    future = None
    parts = None

    def __init__(self, key: Any, weak: Any, region: str, label: str, tier: str, group: Any, index: int,
                 layer: int, backend: Backend) -> None:
        self.refs = 1
        self.key = key
        self.weak = weak
        self.region = region
        self.label = label
        self.tier = tier
        self.group: Any = group  # its host_batch.CopyGroup, None once released
        self.index = index
        self.layer = layer
        self.backend = backend


class KeepEntry:
    """A storage saved under ``keep``: only counted (bytes once per storage), never copied."""

    __slots__ = ("sptr", "nbytes", "refs", "region", "label")

    def __init__(self, sptr: int, nbytes: int, region: str, label: str) -> None:
        self.sptr = sptr
        self.nbytes = nbytes
        self.refs = 1
        self.region = region
        self.label = label


class Handle:
    """What autograd holds instead of a saved tensor; releases its entry when autograd drops it
    (``__del__``: much cheaper per saved tensor than a ``weakref.finalize``). ``slot``: the save's index in its
    entry's pending copy group (:mod:`.host_batch`), else -1."""

    __slots__ = ("entry", "view", "tensor", "release", "slot", "__weakref__")

    def __init__(self, entry: Any, view: Any, tensor: torch.Tensor | None = None,
                 release: Any = None, slot: int = -1) -> None:
        self.entry = entry
        self.view = view
        self.tensor = tensor
        self.release = release
        self.slot = slot

    def __del__(self) -> None:
        if self.release is not None:
            try:
                self.release(self.entry)
            except Exception:  # noqa: BLE001 - interpreter shutdown: nothing left to account
                pass


__all__ = ["Entry", "Handle", "KeepEntry", "PartEntry"]
