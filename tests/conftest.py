"""Shared fixtures. Multi-rank tests use :func:`dist_run` from ``tests/dist.py``; tests taking the ``device``
fixture run on every device :envvar:`MOONRT_TEST_DEVICE` lends."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import os
import re
import sys
import types
from pathlib import Path
from typing import NoReturn

TEST_DEVICE_ENV = "MOONRT_TEST_DEVICE"
"""``MOONRT_TEST_DEVICE=cuda`` runs the tests that take the ``device`` fixture on CUDA too (benchmarks/gpu/check.sh)."""

if os.environ.get(TEST_DEVICE_ENV) != "cuda":  # Triton kernels under its interpreter (fixture triton_kernels)
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import pytest  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))


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


def pytest_configure(config: pytest.Config) -> None:
    """moonrt's and the tests' bytecode, written once before any test starts a process (the controller under
    pytest-xdist, else this process): where ``PYTHONDONTWRITEBYTECODE`` is set (the CI machine sets it) nothing
    imported writes its ``.pyc``, so each of the suite's rank, launcher and CLI processes would compile the sources
    it imports again. ``__pycache__`` is ignored by git; an unwritable tree compiles nothing, as before."""
    if hasattr(config, "workerinput"):
        return
    import compileall

    root = Path(__file__).resolve().parent.parent
    for tree in ("moonrt", "tests", "benchmarks"):
        compileall.compile_dir(root / tree, quiet=2)


REQUIRE_TRITON_ENV = "MOONRT_REQUIRE_TRITON"
"""``MOONRT_REQUIRE_TRITON=1`` (``.ci/run``): a test that needs Triton fails where it is missing instead of skipping."""


@dataclasses.dataclass(frozen=True)
class TritonKernels:
    """What the ``triton_kernels`` fixture gives a test: ``load(name)`` imports a Triton kernel module (e.g.
    ``moonrt.ops.fp8.triton``) whose kernels then run on ``device``."""

    device: torch.device
    """``cpu`` (Triton's interpreter: kernels run on CPU tensors), or ``cuda`` with ``MOONRT_TEST_DEVICE=cuda``."""

    def load(self, name: str) -> types.ModuleType:
        return importlib.import_module(name)


def _triton_missing(reason: str) -> NoReturn:
    """Skip with ``reason``; under ``MOONRT_REQUIRE_TRITON=1`` (CI) fail instead."""
    if os.environ.get(REQUIRE_TRITON_ENV) == "1":
        pytest.fail(f"{REQUIRE_TRITON_ENV}=1 but {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def triton_kernels() -> TritonKernels:
    """Triton for a test: skip with the reason where it is not installed (fail under ``MOONRT_REQUIRE_TRITON=1``).

    Without ``MOONRT_TEST_DEVICE=cuda`` the kernels run under Triton's interpreter on CPU tensors:
    ``TRITON_INTERPRET=1`` is set when this conftest is imported (the top of this file), because ``@triton.jit``
    decides at decoration time, for Triton's own library functions (``tl.max``, ...) too, which are decorated when
    anything first imports triton (torch may, during other tests). It only changes how Triton kernels run. With
    ``MOONRT_TEST_DEVICE=cuda`` on a CUDA machine the kernels run compiled on the GPU.
    """
    if importlib.util.find_spec("triton") is None:
        _triton_missing("triton is not installed (pip install -e '.[test]' installs triton==3.8.0)")
    if os.environ.get("TRITON_INTERPRET") == "1":
        return TritonKernels(torch.device("cpu"))
    if "cuda" in _test_devices():
        return TritonKernels(torch.device("cuda"))
    _triton_missing(f"TRITON_INTERPRET = {os.environ.get('TRITON_INTERPRET')!r} and no CUDA device under test: "
                    "Triton kernels need one of them")


BACKGROUND_MODULES: list[types.ModuleType] = []
"""Test modules whose ``start_in_background(items)`` ran this session (``stop_in_background()`` runs at its end)."""


def pytest_collection_finish(session: pytest.Session) -> None:
    """A test module may define ``start_in_background(items)``: called here with its selected tests once collection
    (and ``-m`` / ``-k`` deselection) ended, to start slow preparation in other processes that overlaps the tests
    before it (tests/ops/test_sm90_compile.py's cold compiles); ``stop_in_background()`` ends what still runs."""
    if session.config.option.collectonly or hasattr(session.config, "workerinput"):
        return  # nothing runs; or a pytest-xdist worker (each would start its own): tests then prepare on demand
    selected: dict[types.ModuleType, list[pytest.Item]] = {}
    for item in session.items:
        module = getattr(item, "module", None)
        if module is not None and callable(getattr(module, "start_in_background", None)):
            selected.setdefault(module, []).append(item)
    for module, items in selected.items():
        module.start_in_background(items)
        BACKGROUND_MODULES.append(module)


def pytest_sessionfinish(session: pytest.Session) -> None:
    while BACKGROUND_MODULES:
        stop = getattr(BACKGROUND_MODULES.pop(), "stop_in_background", None)
        if callable(stop):
            stop()


@functools.cache
def _module_scope(module: str) -> str | None:
    """:func:`xdist_scope` of a module's tests (None: each test alone), from the module's source, read once."""
    try:
        text = (Path(__file__).parent.parent / module).read_text()
    except OSError:
        return None
    if "pytest.mark.slurm" in text:
        return "cluster"
    if re.search(r"@pytest\.fixture\(scope=[\"'](module|session)[\"']", text):
        return module
    return None


def xdist_scope(nodeid: str) -> str:
    """The pytest-xdist scope of test ``nodeid`` under ``--dist loadgroup`` (one worker runs a scope's tests, in
    order): ``cluster`` for every test of a module with a ``slurm`` test (the single-node SLURM and the cluster in a box
    are one machine each: their jobs, node kills and process scans must not overlap); the module for a module that
    defines a module- or session-scoped fixture (computed once, not once per worker); else the test alone. Read from
    the module's source: the controller schedules by node ids, it collects nothing."""
    return _module_scope(nodeid.split("::")[0]) or nodeid


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """``--dist loadgroup``: xdist's scope scheduling over :func:`xdist_scope` (xdist's own ``xdist_group`` markers
    are read from ``Item._nodeid``, which pytest 9 no longer reads)."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        """Scopes handed out in collection order (:func:`pytest_collection_modifyitems`: the ``cluster`` modules,
        then slow modules), not xdist's default of the scopes with the most tests first, which starts a lone slow
        test late."""

        def _split_scope(self, nodeid: str) -> str:
            return xdist_scope(nodeid)

    config.option.loadscopereorder = False
    return GroupScheduling(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The ``cluster`` modules (:func:`xdist_scope`: one worker runs them one after another, the longest chain) run
    first, then modules with a ``slow`` test, each module's tests kept together and in their order: under xdist the
    longest tests start first, so no worker is left with one at the end."""
    slow_modules = {item.nodeid.split("::")[0] for item in items if item.get_closest_marker("slow")}

    def rank(item: pytest.Item) -> tuple[bool, bool]:
        module = item.nodeid.split("::")[0]
        return xdist_scope(item.nodeid) != "cluster", module not in slow_modules

    items.sort(key=rank)


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: one worker per core, at most 4 (a test may start up to 8 ranks of its own); the environment
    variable ``PYTEST_XDIST_AUTO_NUM_WORKERS`` overrides (as in xdist's own hook)."""
    env = os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    return max(1, min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))
