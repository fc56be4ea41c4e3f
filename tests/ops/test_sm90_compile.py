"""Every Triton kernel moonrt launches on CUDA, compiled for sm_90 without a GPU (issue 47 item 2,
``benchmarks/gpu/sm90.py``): driven through moonrt's own host wrappers at the interpreter tests', k3_tiny's, head_dim
64, the 100M config's (96) and K3's (128) shapes, each compiled kernel must fit one Hopper block: shared memory
<= 232,448 B, registers <= 255, spill stores <= ``SPILL_LIMIT_BYTES``, compile CPU seconds <=
``COMPILE_SECONDS_LIMIT``. A kernel planted over the shared-memory limit must fail the same check.

The compiles run in a subprocess with ``TRITON_INTERPRET`` unset (tests/conftest.py sets it for this process), one per
shape, cached on disk by ``sm90`` (an unchanged kernel compiles once per machine). KDA shapes take minutes cold: slow.
The groups the selected tests need start in one background process when collection ends
(:func:`start_in_background`), so a cold compile overlaps the tests that run before this file's.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))

import sm90  # noqa: E402

KDA_KERNELS = ("chunk_terms_kernel", "state_fwd_kernel", "state_bwd_kernel", "chunk_grads_v_kernel",
               "chunk_grads_wy_kernel", "chunk_grads_k_kernel", "transition_kernel")
EXPECTED = {
    "fp8": ("_quantize_kernel", "_dequantize_kernel"),
    "moonep": ("_balance_kernel", "_split_kernel"),
    "rows": ("_scatter_rows_kernel",),
    **{shape: KDA_KERNELS for shape in sm90.KDA_SHAPES},
}
"""The kernels each shape's host wrappers launch (a kernel added or renamed by a redesign goes here)."""

FAILS_TODAY: dict[tuple[str, str], str] = {
    # empty since issue 47 item 1 (benchmarks/RESULTS.md, "KDA rows after the second spill pass"): every kernel fits
    # sm_90 at every shape with Triton 3.8.0. A kernel a redesign cannot yet fit goes here with what it misses.
}
"""``(shape, kernel)`` that do not fit sm_90 today, each with what it misses: strict xfail, so a case a later change
fixes fails loudly until its entry is removed here (and one that stops fitting fails at once)."""


def _params() -> list:
    out = []
    for shape, kernels in EXPECTED.items():
        for kernel in kernels:
            marks = [pytest.mark.slow] if shape in sm90.KDA_SHAPES else []
            if (shape, kernel) in FAILS_TODAY:
                marks.append(pytest.mark.xfail(strict=True, reason=f"issue 47 item 1: {FAILS_TODAY[shape, kernel]}"))
            out.append(pytest.param(shape, kernel, marks=marks, id=f"{shape}-{kernel}"))
    return out


FAST_GROUP = ("fp8", "moonep", "rows", sm90.PLANTED)
"""Shapes checked by one subprocess (a few seconds once cached); each KDA shape has its own."""


def _group_of(shape: str) -> tuple[str, ...]:
    return FAST_GROUP if shape in FAST_GROUP else (shape,)


GROUP_TIMEOUT_S = 3600
"""Wall seconds a test waits for one group's compiles (cold KDA shapes take minutes)."""

CHAIN = """
import json, os, subprocess, sys
from pathlib import Path
for cmd, log, done in json.loads(sys.argv[1]):
    if os.getppid() != int(sys.argv[2]):  # pytest is gone (killed): start nothing more
        break
    with open(log, "w") as out:
        rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL).returncode
    Path(done).write_text(str(rc))
"""
"""The background process: each group's ``sm90`` CLI in turn, its output in ``log``, its exit code in ``done`` once
it ended (the group's JSON is complete then); no further group once pytest (``argv[2]``) is gone."""


class _Background:
    """The compiles of the groups the selected tests need, started in one process at the end of collection
    (:func:`start_in_background`), one group after another in the tests' order, so they run on the second core
    while the tests before them run (a cold KDA group takes minutes). A test collects its group's results."""

    def __init__(self, groups: list[tuple[str, ...]]) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="moonrt-sm90-tests-"))
        self.paths = {g: self.tmp / f"sm90-{'-'.join(g)}" for g in groups}
        steps, env = [], None
        for g, path in self.paths.items():
            cmd, env = sm90.subprocess_command(g, path.with_suffix(".json"), cache_dir=sm90.default_cache_dir())
            steps.append([cmd, str(path.with_suffix(".log")), str(path.with_suffix(".done"))])
        self.proc = subprocess.Popen([sys.executable, "-c", CHAIN, json.dumps(steps), str(os.getpid())], cwd=ROOT,
                                     env=env, stdin=subprocess.DEVNULL, start_new_session=True)

    def results(self, group: tuple[str, ...]) -> list[sm90.Result]:
        path = self.paths[group]
        deadline = time.monotonic() + GROUP_TIMEOUT_S
        while not path.with_suffix(".done").exists():
            if self.proc.poll() is not None and not path.with_suffix(".done").exists():
                raise RuntimeError(f"the background sm90 process ended (exit {self.proc.returncode}) before {group}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"sm90 {group}: no result after {GROUP_TIMEOUT_S} s")
            time.sleep(0.5)
        json_path = path.with_suffix(".json")
        if not json_path.exists():
            log = path.with_suffix(".log").read_text()
            raise RuntimeError(f"sm90 check wrote no {json_path} (exit {path.with_suffix('.done').read_text()}):\n"
                               f"{log[-6000:]}")
        return sm90.read_results(json_path)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the chain, its sm90 CLI and their compile workers
        self.proc.wait()
        shutil.rmtree(self.tmp, ignore_errors=True)


BACKGROUND: list[_Background] = []
"""The session's background compiles (none before collection ends, or when no selected test needs one)."""


def start_in_background(items: list[pytest.Item]) -> None:
    """tests/conftest.py calls this once collection ended with this module's selected tests: start the compiles of
    every group they need (:class:`_Background`)."""
    groups: list[tuple[str, ...]] = []
    for item in items:
        if "sm90_results" not in getattr(item, "fixturenames", ()):
            continue
        callspec = getattr(item, "callspec", None)
        group = _group_of(callspec.params["shape"] if callspec else sm90.PLANTED)
        if group not in groups:
            groups.append(group)
    if groups:
        BACKGROUND.append(_Background(groups))


def stop_in_background() -> None:
    """tests/conftest.py calls this at the end of the session: stop what still runs (a session cut short)."""
    while BACKGROUND:
        BACKGROUND.pop().stop()


@functools.cache
def _group(shapes: tuple[str, ...], tmp: Path) -> list[sm90.Result]:
    started = next((b for b in BACKGROUND if shapes in b.paths), None)
    if started is not None:
        return started.results(shapes)
    return sm90.check_in_subprocess(shapes, tmp / f"sm90-{'-'.join(shapes)}.json", cache_dir=sm90.default_cache_dir(),
                                    timeout=GROUP_TIMEOUT_S)


def _results(shape: str, tmp: Path) -> list[sm90.Result]:
    return [r for r in _group(_group_of(shape), tmp) if r.shape == shape]


@pytest.fixture(scope="session")
def sm90_results(tmp_path_factory: pytest.TempPathFactory):
    """``shape`` -> its kernels' results: from the background compiles when they were started, else compiled now."""
    tmp = tmp_path_factory.mktemp("sm90")
    return lambda shape: _results(shape, tmp)


@pytest.mark.parametrize(("shape", "kernel"), _params())
def test_kernel_fits_sm90(sm90_results, shape: str, kernel: str) -> None:
    results = sm90_results(shape)
    launched = {r.kernel for r in results}
    assert launched == set(EXPECTED[shape]), f"{shape}: launched {sorted(launched)}, EXPECTED lists "\
                                             f"{sorted(EXPECTED[shape])}"
    mine = [r for r in results if r.kernel == kernel]
    for r in mine:
        assert r.shared is not None and r.compile_cpu_s is not None or r.error, r
        assert not r.violations(), f"{shape} {kernel} ({r.case}): {'; '.join(r.violations())}"


def test_planted_kernel_over_shared_memory_fails(sm90_results) -> None:
    """``sm90_planted``: a 64 x 1024 @ 1024 x 64 bf16 dot stages 2 * 1024 * 128 = 262,144 B of operands in shared
    memory; the checker reads more than the limit from the compiled kernel and reports it."""
    (r,) = sm90_results(sm90.PLANTED)
    assert r.error is None and r.shared is not None and r.shared >= 262_144 > sm90.SHARED_LIMIT, r
    assert any(v.startswith("shared memory") for v in r.violations()), r.violations()
    assert os.environ.get("TRITON_INTERPRET") == "1"  # this process still interprets (conftest)


def test_violations_name_each_limit() -> None:
    ok = sm90.Result("k", "s", "c", 4, 1, shared=sm90.SHARED_LIMIT, registers=sm90.REGISTER_LIMIT, stack=0,
                     spill_stores=sm90.SPILL_LIMIT_BYTES, spill_loads=0, compile_s=1.0,
                     compile_cpu_s=sm90.COMPILE_SECONDS_LIMIT)
    assert ok.violations() == []
    for field, bad, word in (("shared", sm90.SHARED_LIMIT + 1, "shared memory"),
                             ("registers", sm90.REGISTER_LIMIT + 1, "registers"),
                             ("spill_stores", sm90.SPILL_LIMIT_BYTES + 1, "spill stores"),
                             ("compile_cpu_s", sm90.COMPILE_SECONDS_LIMIT + 0.1, "compile"),
                             ("error", "stopped after 240 s", "did not compile"),
                             ("registers", None, "resources not read")):
        r = dataclasses.replace(ok, **{field: bad})
        assert [v for v in r.violations() if v.startswith(word)], (field, r.violations())


def test_cache_digest_ignores_where_triton_is_installed(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A fresh clone's .venv holds the same Triton at another path (its libdevice is named in the options): the
    cached result must still be found (CI compiles nothing twice); any other change of the specialization misses."""
    import triton

    def spec_in(pkg: str, warps: int = 4, source: str = "src") -> sm90.Spec:
        options = {"extern_libs": [["libdevice", f"{pkg}/backends/nvidia/lib/libdevice.10.bc"]], "num_warps": warps}
        return sm90.Spec("m", "k", "s", "c", json.dumps(options), source)

    here = str(Path(triton.__file__).resolve().parent)
    mine = spec_in(here).digest(1.0)
    assert spec_in(here).digest(2.0) != mine  # the worker's budget
    assert spec_in(here, warps=8).digest(1.0) != mine and spec_in(here, source="src2").digest(1.0) != mine
    assert spec_in("/another/venv/triton").digest(1.0) != mine  # seen from this install: not its libdevice
    other = tmp_path / "venv2" / "triton"
    other.mkdir(parents=True)
    monkeypatch.setattr(triton, "__file__", str(other / "__init__.py"))  # the same Triton, another clone's .venv
    assert spec_in(str(other)).digest(1.0) == mine


def test_resource_parsers() -> None:
    """The two tools' formats as Triton 3.8's ptxas and cuobjdump print them."""
    log = ("ptxas info    : Compiling entry function 'k' for 'sm_90a'\nptxas info    : Function properties for k\n"
           "    5976 bytes stack frame, 6976 bytes spill stores, 7032 bytes spill loads\n"
           "ptxas info    : Used 32 registers, used 1 barriers, 5976 bytes cumulative stack size")
    assert sm90.parse_ptxas_log(log) == {"registers_ptxas": 32, "stack_ptxas": 5976, "spill_stores": 6976,
                                         "spill_loads": 7032}
    usage = ("Resource usage:\n Function k:\n  REG:32 STACK:5976 SHARED:0 LOCAL:0 CONSTANT[0]:1000 TEXTURE:0 "
             "SURFACE:0 SAMPLER:0")
    assert sm90.parse_resource_usage(usage) == {"REG": 32, "STACK": 5976, "SHARED": 0, "LOCAL": 0}


def test_stand_in_driver_refuses_the_interpreter() -> None:
    """In this process (TRITON_INTERPRET=1) kernels are interpreted: the check says so instead of compiling."""
    pytest.importorskip("triton")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"), sm90.stand_in_driver():
        pass


RESTORE = """
import sm90, triton
from triton import knobs
from triton.runtime.driver import driver
import moonrt.ops.fp8.triton as f
import moonrt.ops.kda.backends.triton as kda
guard = kda._check_device
specs = sm90.record(("fp8", "moonep"))
assert len(specs) == 8, specs  # 2 fp8 + 2 moonep cases, 2 kernels each
assert driver._active is None and knobs.runtime.jit_cache_hook is None
assert kda._check_device is guard
assert not f._quantize_kernel.device_caches
print("restored")
"""


@pytest.mark.slow
def test_stand_in_driver_restores_everything() -> None:
    """After recording: the real (lazily created) driver, no hook, the host guard back, no kernel holding the sm_90
    target in its per-device cache."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "benchmarks" / "gpu")])
    res = subprocess.run([sys.executable, "-c", RESTORE], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0 and "restored" in res.stdout, res.stderr[-3000:]
