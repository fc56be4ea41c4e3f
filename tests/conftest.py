"""Shared fixtures. Multi-rank tests use :func:`dist_run` from ``tests/dist.py``; tests taking the ``device``
fixture run on every device :envvar:`MOONRT_TEST_DEVICE` lends."""

from __future__ import annotations

import os
import sys
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
