"""Shared fixtures. Multi-rank tests use :func:`dist_run` from ``tests/dist.py``; tests taking the ``device``
fixture run on every device :envvar:`MOONRT_TEST_DEVICE` lends."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

TEST_DEVICE_ENV = "MOONRT_TEST_DEVICE"
"""``MOONRT_TEST_DEVICE=cuda`` runs the tests that take the ``device`` fixture on CUDA too (benchmarks/gpu/check.sh)."""


def _test_devices() -> list[str]:
    devices = ["cpu"]
    if os.environ.get(TEST_DEVICE_ENV, "") == "cuda" and torch.cuda.is_available():
        devices.append("cuda")
    return devices


@pytest.fixture(params=_test_devices())
def device(request: pytest.FixtureRequest) -> torch.device:
    """The device a device-parametrized test runs on: ``cpu``, and ``cuda`` when ``MOONRT_TEST_DEVICE=cuda`` and
    CUDA is present."""
    return torch.device(request.param)


REQUIRE_TRITON_ENV = "MOONRT_REQUIRE_TRITON"
"""``MOONRT_REQUIRE_TRITON=1`` (``.ci/run``): a test that needs Triton fails where it is missing instead of skipping."""


@dataclasses.dataclass(frozen=True)
class TritonKernels:
    """What the ``triton_kernels`` fixture gives a test: ``load(name)`` imports a Triton kernel module (e.g.
    ``moonrt.ops.fp8_triton``) so its kernels run on ``device``."""

    device: torch.device
    """``cpu`` (Triton's interpreter: kernels run on CPU tensors), or ``cuda`` with ``MOONRT_TEST_DEVICE=cuda``."""
    interpreted: bool

    def load(self, name: str) -> types.ModuleType:
        module = sys.modules.get(name)
        if module is not None and self.interpreted and name not in _INTERPRETED:
            module = importlib.reload(module)  # imported before the interpreter was on: its kernels were compiled
        module = module or importlib.import_module(name)
        if self.interpreted:
            _INTERPRETED.add(name)
        return module


_INTERPRETED: set[str] = set()


@pytest.fixture(scope="session")
def triton_kernels() -> Iterator[TritonKernels]:
    """Triton for a test: skip with the reason where it is not installed (fail under ``MOONRT_REQUIRE_TRITON=1``).

    Without a CUDA device under test, Triton's interpreter runs the kernels on CPU tensors: ``TRITON_INTERPRET=1``
    must be set before a kernel module is imported (``@triton.jit`` decides then), so the fixture sets it for the
    rest of the session (it only changes how Triton kernels run; restored at the end) and modules are imported
    through :meth:`TritonKernels.load`. With ``MOONRT_TEST_DEVICE=cuda`` on a CUDA machine the kernels run on the GPU.
    """
    if importlib.util.find_spec("triton") is None:
        reason = "triton is not installed (pip install -e '.[test]' installs triton==3.8.0)"
        if os.environ.get(REQUIRE_TRITON_ENV) == "1":
            pytest.fail(f"{REQUIRE_TRITON_ENV}=1 but {reason}", pytrace=False)
        pytest.skip(reason)
    if "cuda" in _test_devices():
        yield TritonKernels(torch.device("cuda"), interpreted=False)
        return
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield TritonKernels(torch.device("cpu"), interpreted=True)
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old
