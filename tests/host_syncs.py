"""Count the host synchronizations moonrt's own code makes (issue 47 item 5): a ``torch.cuda.set_sync_debug_mode``
that works on CPU.

:class:`HostSyncCounter` is a :class:`~torch.overrides.TorchFunctionMode` that records each call made by code in the
``moonrt`` package (the calling frame is moonrt's) of what waits for a GPU on CUDA:

- ``item``: ``Tensor.item()``; ``scalar``: ``int(t)``, ``float(t)``, ``bool(t)`` (an ``if`` on a tensor),
  ``operator.index(t)``; ``tolist``: ``Tensor.tolist()``;
- ``d2h``: ``Tensor.cpu()`` and ``Tensor.to("cpu")`` (a device -> host copy on CUDA; on a CPU run the tensor is
  already there, so a CPU-only branch that asks for it counts too; ``.to(device)`` with a ``torch.device`` is the
  job's device and is not counted);
- ``h2d``: ``torch.tensor(data, device=...)`` / ``torch.as_tensor(data, device=...)`` of host data (a list):
  a pageable host -> device copy on CUDA, per call.

``Tensor.numpy()`` is not counted: it raises on a CUDA tensor, so only CPU-only code (numba passes) calls it.
``counts`` maps ``(kind, "path:line")`` to calls; ``total`` sums them.
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_TORCH = Path(torch.__file__).parent
_WRAPPERS = {str(Path(__file__).resolve()), str(_TORCH / "overrides.py"), str(_TORCH / "_tensor.py")}
"""Frames between the caller and this mode: torch's Python dispatch (a call torch makes inside a torch function, such
as an optimizer's ``step.item()`` on its CPU step counters, is torch's, not moonrt's)."""
_MOONRT = str(Path(__import__("moonrt").__file__).resolve().parent)

_KINDS = {
    torch.Tensor.item: "item",
    torch.Tensor.__int__: "scalar",
    torch.Tensor.__float__: "scalar",
    torch.Tensor.__bool__: "scalar",
    torch.Tensor.__index__: "scalar",
    torch.Tensor.tolist: "tolist",
    torch.Tensor.cpu: "d2h",
}


def _to_host(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """``t.to("cpu")`` named as such (a string): a ``torch.device`` is the job's device in moonrt's code (the CPU only
    on a CPU run, where it moves nothing), so it is not counted."""
    dev = kwargs.get("device", args[1] if len(args) > 1 else None)
    return isinstance(dev, str) and torch.device(dev).type == "cpu"


def _from_host(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    data = args[0] if args else kwargs.get("data")
    return kwargs.get("device") is not None and not isinstance(data, torch.Tensor)


class HostSyncCounter(TorchFunctionMode):
    """``with HostSyncCounter() as c: ...``, then ``c.total`` / ``c.counts`` (module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[tuple[str, str]] = collections.Counter()

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def by_kind(self) -> dict[str, int]:
        out: collections.Counter[str] = collections.Counter()
        for (kind, _), n in self.counts.items():
            out[kind] += n
        return dict(out)

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        kind = _KINDS.get(func)
        if kind is None and func is torch.Tensor.to and _to_host(args, kwargs):
            kind = "d2h"
        if kind is None and func in (torch.tensor, torch.as_tensor) and _from_host(args, kwargs):
            kind = "h2d"
        if kind is not None:
            where = self._caller()
            if where is not None:
                self.counts[(kind, where)] += 1
        return func(*args, **kwargs)

    @staticmethod
    def _caller() -> str | None:
        """``path:line`` of the frame that made the call (past torch's dispatch wrappers), if it is moonrt's."""
        f = sys._getframe(2)
        while f is not None and f.f_code.co_filename in _WRAPPERS:
            f = f.f_back
        if f is None or not f.f_code.co_filename.startswith(_MOONRT):
            return None
        return f"{Path(f.f_code.co_filename).relative_to(Path(_MOONRT).parent)}:{f.f_lineno}"
