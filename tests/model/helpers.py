"""Helpers of the model tests (``from model.helpers import ...``): :class:`Calls`, a ``TorchFunctionMode`` that
records the result dtypes of the torch math calls moonrt's code makes (the precision-island tests, and the bf16
rounding count of ``tests/jobs/test_precision_train.py``)."""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

import moonrt

ROOT = str(Path(moonrt.__file__).parent)
MATH = {"matmul", "__matmul__", "einsum", "mm", "bmm", "linear", "softmax", "exp", "sigmoid", "topk", "cross_entropy",
        "scaled_dot_product_attention", "rms_norm"}


class Calls(TorchFunctionMode):
    """``(file stem, function name) -> {op name: {result dtypes}}`` of the torch math calls moonrt code makes."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[tuple[str, str], dict[str, set[torch.dtype]]] = defaultdict(lambda: defaultdict(set))

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        name = getattr(func, "__name__", "")
        if name in MATH:
            f = sys._getframe(1)
            while f is not None and not f.f_code.co_filename.startswith(ROOT):
                f = f.f_back
            if f is not None:
                results = out if isinstance(out, tuple) else (out,)
                for r in results:
                    if isinstance(r, torch.Tensor) and r.is_floating_point():
                        self.seen[(Path(f.f_code.co_filename).stem, f.f_code.co_name)][name].add(r.dtype)
        return out
