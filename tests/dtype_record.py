"""A dtype-recording mode for tests: which floating-point dtypes the ATen ops run inside it read and write.

``with DtypeRecorder() as rec: ...`` records, for every ATen op dispatched in the block (forward, and the backward
when ``backward()`` runs inside it: the CPU autograd engine runs on the calling thread), the dtype of each floating
tensor among its inputs and outputs, with the op's name and the innermost ``moonrt/`` source line that issued it.
:meth:`DtypeRecorder.narrower_than` lists the records of dtypes other than the expected one, so an assertion
message names the op and the line that computed in fp32 inside an fp64 run.
"""

from __future__ import annotations

import collections
import os
import sys
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import moonrt

_PACKAGE = os.path.dirname(os.path.abspath(moonrt.__file__)) + os.sep


def _moonrt_line() -> str:
    """``path:line`` of the innermost frame in a ``moonrt/`` source file ("?" if none, e.g. a test's own op)."""
    frame = sys._getframe(1)
    while frame is not None:
        path = frame.f_code.co_filename
        if path.startswith(_PACKAGE):
            return f"moonrt/{path[len(_PACKAGE):].replace(os.sep, '/')}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


class DtypeRecorder(TorchDispatchMode):
    """Counts ``(dtype, op, moonrt source line)`` for every floating tensor an op reads or writes.

    ``expect``: a dtype recorded without the source line (finding the line walks the Python stack, the costly
    part): ops of other dtypes are still located.
    """

    def __init__(self, expect: torch.dtype | None = None) -> None:
        super().__init__()
        self.expect = expect
        self.counts: collections.Counter[tuple[torch.dtype, str, str]] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        dtypes = {t.dtype for t in tree_flatten((args, kwargs, out))[0]
                  if isinstance(t, torch.Tensor) and t.is_floating_point()}
        if dtypes:
            where = "-" if dtypes == {self.expect} else _moonrt_line()
            for dt in dtypes:
                self.counts[(dt, str(func), "-" if dt == self.expect else where)] += 1
        return out

    @property
    def dtypes(self) -> set[torch.dtype]:
        """Every floating dtype seen."""
        return {dt for dt, _, _ in self.counts}

    def narrower_than(self, dtype: torch.dtype) -> list[str]:
        """``"dtype op at file:line (n times)"`` for every record of a floating dtype other than ``dtype``."""
        return [f"{dt} {op} at {where} ({n}x)" for (dt, op, where), n in sorted(self.counts.items(), key=str)
                if dt != dtype]
