"""Every Triton kernel moonrt launches on CUDA, compiled for sm_90 (H100/H200) on a machine without a GPU, and held
to what one Hopper block may use (issue 47 item 2). A library (:func:`record`, :func:`compile_specs`,
:func:`check`) and a CLI that prints the table and writes JSON::

    python benchmarks/gpu/sm90.py [--shapes k3_tiny d64 ...] [--json out.json] [--cache-dir DIR]

How, in two phases:

1. **Record** (one process, Triton imported with ``TRITON_INTERPRET`` unset so ``@triton.jit`` makes real
   ``JITFunction`` s). :func:`stand_in_driver` installs a Triton driver (``triton.runtime.driver.set_active``)
   whose current target is ``GPUTarget("cuda", 90, 32)``, device 0, stream 0, and no way to load or launch
   anything. moonrt's own host wrappers (:data:`CASES`: ``kda_chunk`` forward and backward, varlen,
   ``kda_state_grad``, ``kda_transition``; the FP8 codec; the MoonEP greedy planner) then run on CPU tensors of the
   real shapes: each ``kernel[grid](...)`` binds and specializes its arguments exactly as on a GPU (dtypes, the
   ``% 16`` / ``== 1`` integer and 16-byte pointer-alignment specializations, every constexpr, ``num_warps``,
   ``num_stages``) and calls Triton's ``knobs.runtime.jit_cache_hook`` before compiling; the hook records Triton's
   own serialized specialization (``serialize_specialization_data``) and returns True, which makes
   ``JITFunction.run`` return without compiling or launching. The host code goes on with the outputs unwritten
   (nothing in it reads a kernel's result). The one host guard that refuses CPU tensors outside the interpreter
   (:data:`HOST_DEVICE_GUARDS`) is patched out for the duration. Everything is restored on exit: the real driver,
   the hook, the guards, and the per-device caches of the kernels that ran (they held the sm_90 target).
2. **Compile** each recorded specialization in its own worker process (``--compile-one``, a fresh Triton cache so
   every compile is cold, ``RLIMIT_AS`` of ``--mem-gib``, ``RLIMIT_CPU`` of ``WORKER_CPU_S`` and a wall timeout,
   because a kernel can take ptxas many minutes and gigabytes): the worker installs the same driver and calls
   ``JITFunction.preload`` (Triton's compile-from-specialization, ``warmup=True``: nothing is launched). It reads
   shared memory from Triton's metadata (``metadata.shared``, reported as soon as the LLVM stage has it, so a kernel
   that is then stopped still shows it), registers and the stack frame from the cubin with the ``cuobjdump
   --dump-resource-usage`` that Triton ships (``triton/backends/nvidia/bin``), spill stores/loads from ptxas's own
   ``-v`` log, and the compile seconds of ``preload`` (wall, and CPU of the worker and its ptxas). Results are cached
   on disk (``--cache-dir``, default ``~/.cache/moonrt/sm90``) under a hash of the specialization, the kernel's
   source key (``JITFunction.cache_key``: its source and every function it calls), the Triton version and the limits,
   so an unchanged kernel is compiled once per machine and any edit recompiles it.

A result passes when it compiled, ``shared <= SHARED_LIMIT`` (sm_90's opt-in maximum per block),
``registers <= REGISTER_LIMIT``, ``spill stores <= SPILL_LIMIT_BYTES`` and compile CPU seconds ``<=
COMPILE_SECONDS_LIMIT`` (a worker is stopped after ``WORKER_TIMEOUT_S`` wall seconds); :meth:`Result.violations`
names each limit missed.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import importlib
import io
import json
import os
import re
import resource
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent

SHARED_LIMIT = 232_448
"""Bytes of shared memory one block may use on sm_90 (``cudaDevAttrMaxSharedMemoryPerBlockOptin``: 227 KiB)."""

REGISTER_LIMIT = 255
"""Registers per thread (the architectural maximum of sm_90)."""

SPILL_LIMIT_BYTES = 256
"""Spill stores per thread ptxas may report (``-v``): a few spilled values are harmless; kilobytes (the FMA-loop
dots of issue 47) are local-memory traffic in every iteration."""

COMPILE_SECONDS_LIMIT = 30.0
"""CPU seconds one kernel may take to compile cold (Triton's front end and ptxas): the GPU check (one 15-minute
lease, ~420 s of work) compiles k3_tiny's and the 100M config's KDA kernels (about ten), so even at this limit they
would take 300 s of it."""

WORKER_MEM_GIB = 6.0
"""Default address-space limit (``RLIMIT_AS``) of a compile worker and its ptxas, so a runaway ptxas (issue 47:
past 16 GB at head_dim 128) fails that kernel instead of the machine."""

HOST_DEVICE_GUARDS = (("moonrt.ops.kda.backends.triton", "_check_device"),)
"""``(module, function)`` host checks that refuse CPU tensors outside Triton's interpreter; :func:`stand_in_driver`
replaces them by no-ops while recording (a missing one is skipped)."""

TARGET = ("cuda", 90, 32)
"""The stand-in driver's ``GPUTarget``: H100/H200 (compute capability 9.0, warp 32)."""


# ---------------------------------------------------------------------------------------------------------------
# the stand-in driver


def _driver_class() -> type:
    from triton.backends.compiler import GPUTarget
    from triton.backends.driver import DriverBase

    class Sm90StandInDriver(DriverBase):
        """Reports sm_90 as the current target; loads and launches nothing (compile-only)."""

        @classmethod
        def is_active(cls) -> bool:
            return False

        def map_python_to_cpp_type(self, ty: str) -> str:
            raise RuntimeError("sm90 stand-in driver: no launcher (compile only)")

        def get_current_target(self) -> Any:
            return GPUTarget(*TARGET)

        def get_active_torch_device(self) -> Any:
            import torch

            return torch.device("cpu")

        def get_benchmarker(self) -> Any:
            raise RuntimeError("sm90 stand-in driver: nothing runs, so nothing can be benchmarked (a "
                               "@triton.autotune kernel: check each of its configs as a fixed launch)")

        def get_current_device(self) -> int:
            return 0

        def set_current_device(self, device: int) -> None:
            pass

        def get_current_stream(self, device: int | None = None) -> int:
            return 0

        def get_device_interface(self) -> Any:
            raise RuntimeError("sm90 stand-in driver: no device (compile only)")

    return Sm90StandInDriver


def _require_compiler() -> None:
    from triton import knobs

    if knobs.runtime.interpret:
        raise RuntimeError("sm90: TRITON_INTERPRET=1 in this process (kernels are interpreted, not compiled): run "
                           "`python benchmarks/gpu/sm90.py` (or sm90.check_in_subprocess) instead")


@contextlib.contextmanager
def stand_in_driver(record: Callable[[Any, dict[str, Any]], None] | None = None) -> Iterator[None]:
    """Make sm_90 Triton's active target for the duration; with ``record``, every kernel launch calls
    ``record(fn, compile_info)`` (``fn`` the ``JITFunction``, ``compile_info`` Triton's hook payload with
    ``specialization_data``) and returns without compiling or launching, and :data:`HOST_DEVICE_GUARDS` are off.
    Restores the real driver, the hook, the guards and the touched kernels' per-device caches."""
    from triton import knobs
    from triton.runtime.driver import driver

    _require_compiler()
    touched: list[Any] = []

    def hook(*, key: Any, repr: str, fn: Any, compile: dict[str, Any], is_manual_warmup: bool,
             already_compiled: bool) -> bool | None:
        touched.append(fn.jit_function)
        if record is None:
            return None
        record(fn.jit_function, compile)
        return True

    prev_active, prev_hook = driver._active, knobs.runtime.jit_cache_hook
    patched: list[tuple[Any, str, Any]] = []
    driver.set_active(_driver_class()())
    knobs.runtime.jit_cache_hook = hook
    try:
        if record is not None:
            for mod_name, attr in HOST_DEVICE_GUARDS:
                mod = importlib.import_module(mod_name)
                if hasattr(mod, attr):
                    patched.append((mod, attr, getattr(mod, attr)))
                    setattr(mod, attr, lambda *a, **k: None)
        yield
    finally:
        for mod, attr, old in patched:
            setattr(mod, attr, old)
        knobs.runtime.jit_cache_hook = prev_hook
        driver._active = prev_active
        for fn in touched:
            fn.device_caches.clear()


# ---------------------------------------------------------------------------------------------------------------
# what moonrt launches: cases over shapes


@dataclasses.dataclass(frozen=True, slots=True)
class KdaShape:
    """A KDA layer's shape: ``H`` heads of key/value size ``K``; sequences of ``lens`` tokens; chunk ``C``."""

    H: int
    K: int
    C: int = 64
    lens: tuple[int, ...] = (128, 128)
    why: str = ""


KDA_SHAPES: dict[str, KdaShape] = {
    "interp": KdaShape(H=2, K=32, lens=(80, 70), why="tests/ops/test_kda_triton.py's K=V=32"),
    "k3_tiny": KdaShape(H=4, K=48, why="k3_tiny: 4 heads of 48"),
    "d64": KdaShape(H=4, K=64, why="head_dim 64"),
    "k3_100m": KdaShape(H=10, K=96, why="benchmarks/gpu/k3_100m.yaml: 10 heads of 96"),
    "k3": KdaShape(H=96, K=128, why="K3: 96 heads of 128"),
}
"""KDA shapes (V = K, chunk 64, the K3 gate range g in [-5, 0), bf16 inputs as in training)."""

ALL_SHAPES = ("fp8", "moonep", "rows", *KDA_SHAPES)
"""Every shape of :func:`_cases`: the FP8 codec's, MoonEP's, the heap's row scatter, then the KDA shapes."""


def _kda_inputs(s: KdaShape, B: int, T: int, seed: int = 0) -> dict[str, Any]:
    import torch

    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape: int) -> Any:
        return torch.randn(*shape, generator=gen).to(torch.bfloat16)

    k = torch.nn.functional.normalize(torch.randn(B, T, s.H, s.K, generator=gen), dim=-1).to(torch.bfloat16)
    return dict(q=rnd(B, T, s.H, s.K), k=k, v=rnd(B, T, s.H, s.K),
                g=(-5.0 * torch.rand(B, T, s.H, s.K, generator=gen)).to(torch.bfloat16),
                beta=torch.rand(B, T, s.H, generator=gen).to(torch.bfloat16))


def _kda_fwd_bwd(s: KdaShape, varlen: bool) -> None:
    import torch

    from moonrt.ops.kda.backends import triton as kda

    T = sum(s.lens)
    x = _kda_inputs(s, 1, T) if varlen else _kda_inputs(s, len(s.lens), s.lens[0])
    n = len(s.lens)
    S0 = torch.zeros(n, s.H, s.K, s.K, requires_grad=True)
    xs = {name: t.requires_grad_() for name, t in x.items()}
    cu = torch.tensor([0, *torch.tensor(s.lens).cumsum(0).tolist()]) if varlen else None
    o, S = kda.kda_chunk(**xs, initial_state=S0, output_final_state=True, chunk_size=s.C, cu_seqlens=cu)
    (o.float().sum() + S.sum()).backward()


def _kda_state_grad(s: KdaShape) -> None:
    import torch

    from moonrt.ops.kda.backends import triton as kda

    x = _kda_inputs(s, len(s.lens), s.lens[0])
    d_o = torch.randn_like(x["v"], dtype=torch.float32).to(torch.bfloat16)
    kda.kda_state_grad(**x, d_o=d_o, d_final=torch.zeros(len(s.lens), s.H, s.K, s.K), chunk_size=s.C)


def _kda_transition(s: KdaShape) -> None:
    import torch

    from moonrt.ops.kda.backends import triton as kda

    x = _kda_inputs(s, len(s.lens), s.lens[0])
    with torch.no_grad():
        kda.kda_transition(x["k"], x["v"], x["g"], x["beta"], chunk_size=s.C)


def _fp8(M: int, N: int, block: int) -> None:
    import torch

    from moonrt.ops.fp8 import triton as fp8

    payload, scales = fp8.quantize_rows(torch.randn(M, N), block)
    fp8.dequantize_rows(payload, scales, N)


def _moonep(R: int, G: int) -> None:
    import torch

    from moonrt.ops.moonep import triton as moonep

    load = torch.randint(0, 100, (R, G), generator=torch.Generator().manual_seed(0))
    cap = torch.full((R,), int(load.sum()) // R)
    cap[0] += int(load.sum()) - int(cap.sum())
    moonep.greedy(load, cap)


def _rows(n: int, width: int, dtype_name: str, with_src: bool) -> None:
    import torch

    from moonrt.ops import rows_triton

    dtype = getattr(torch, dtype_name)
    src = torch.randn(n, width).to(dtype)
    dst = torch.empty(2 * n, width, dtype=dtype)
    dst_rows = torch.where(torch.arange(n) % 3 == 0, -1, torch.arange(n) * 2)
    rows_triton.scatter_rows(dst, dst_rows, src, torch.arange(n).flip(0) if with_src else None)


@dataclasses.dataclass(frozen=True, slots=True)
class Case:
    """One host-wrapper call at one shape."""

    shape: str
    name: str
    run: Callable[[], None]


def _cases() -> list[Case]:
    out = [
        Case("fp8", "fp8 [256, 7168] block 128", lambda: _fp8(256, 7168, 128)),
        Case("fp8", "fp8 [64, 200] block 128", lambda: _fp8(64, 200, 128)),
        Case("moonep", "moonep R=64 G=14 (K3: 896 experts, EP 64)", lambda: _moonep(64, 14)),
        Case("moonep", "moonep R=2 G=8 (k3_tiny: 16 experts, EP 2)", lambda: _moonep(2, 8)),
        Case("rows", "scatter_rows fp32 [512, 3584] (K3 latent rows)", lambda: _rows(512, 3584, "float32", False)),
        Case("rows", "scatter_rows bf16 [512, 7168] from src_rows (K3 hidden rows)",
             lambda: _rows(512, 7168, "bfloat16", True)),
    ]
    for name, s in KDA_SHAPES.items():
        out += [
            Case(name, "kda_chunk fwd+bwd", lambda s=s: _kda_fwd_bwd(s, varlen=False)),
            Case(name, "kda_chunk varlen fwd+bwd", lambda s=s: _kda_fwd_bwd(s, varlen=True)),
            Case(name, "kda_state_grad", lambda s=s: _kda_state_grad(s)),
            Case(name, "kda_transition", lambda s=s: _kda_transition(s)),
        ]
    return out


PLANTED = "planted"
"""Shape name of :mod:`sm90_planted`'s kernel (never in the default shapes): over the shared-memory limit."""


def _planted_case() -> Case:
    def run() -> None:
        sys.path.insert(0, str(HERE))
        import sm90_planted

        sm90_planted.planted()

    return Case(PLANTED, "planted 64x1024 @ 1024x64 bf16 dot", run)


# ---------------------------------------------------------------------------------------------------------------
# phase 1: record


@dataclasses.dataclass(frozen=True, slots=True)
class Spec:
    """One kernel specialization a host wrapper launched."""

    module: str
    qualname: str
    shape: str
    case: str
    data: str
    """Triton's ``serialize_specialization_data`` JSON (signature, constexprs, attrs, options, target)."""
    source_key: str
    """``JITFunction.cache_key``: the kernel's source and every function it calls."""

    @property
    def kernel(self) -> str:
        return self.qualname

    def digest(self, *budget: float) -> str:
        """Hash of what decides the compile's result: the specialization, the source, Triton, the limits and the
        worker's ``budget`` (timeout, memory)."""
        import triton

        # the options name files inside Triton's package (libdevice): the same compile from another install of the
        # same Triton (each fresh clone's .venv) must hit the cache, so the package's own path is not hashed
        data = self.data.replace(str(Path(triton.__file__).resolve().parent), "<triton>")
        h = hashlib.sha256()
        for part in (self.module, self.qualname, data, self.source_key, triton.__version__,
                     repr((SHARED_LIMIT, COMPILE_SECONDS_LIMIT, *budget))):
            h.update(part.encode() + b"\0")
        return h.hexdigest()[:32]


def record(shapes: tuple[str, ...] = ALL_SHAPES) -> list[Spec]:
    """Run :data:`CASES` of ``shapes`` under :func:`stand_in_driver`; every distinct specialization once per shape,
    in launch order."""
    cases = [c for c in _cases() if c.shape in shapes] + ([_planted_case()] if PLANTED in shapes else [])
    unknown = set(shapes) - {c.shape for c in cases}
    if unknown:
        raise ValueError(f"shapes: {sorted(unknown)} unknown, expected some of {ALL_SHAPES + (PLANTED,)}")
    specs: dict[tuple[str, str, str], Spec] = {}
    current: list[Case] = []

    def rec(fn: Any, info: dict[str, Any]) -> None:
        c = current[0]
        spec = Spec(fn.fn.__module__, fn.fn.__qualname__, c.shape, c.name, info["specialization_data"], fn.cache_key)
        specs.setdefault((c.shape, spec.module + ":" + spec.qualname, spec.data), spec)

    with stand_in_driver(rec):
        for c in cases:
            current[:] = [c]
            c.run()
    return list(specs.values())


# ---------------------------------------------------------------------------------------------------------------
# phase 2: compile


@dataclasses.dataclass(slots=True)
class Result:
    """Resources of one compiled specialization (per thread for registers / stack / spills, per block for
    shared)."""

    kernel: str
    shape: str
    case: str
    num_warps: int
    num_stages: int
    shared: int | None = None
    registers: int | None = None
    stack: int | None = None
    spill_stores: int | None = None
    spill_loads: int | None = None
    compile_s: float | None = None
    """Wall seconds of the compile (inflated on a loaded machine)."""
    compile_cpu_s: float | None = None
    """CPU seconds of the compile, the worker's and ptxas's: what :data:`COMPILE_SECONDS_LIMIT` is held to (the same
    on a busy machine as on an idle one)."""
    error: str | None = None

    def violations(self) -> list[str]:
        """Each limit this kernel misses, in words (empty: it fits one sm_90 block)."""
        out = []
        if self.error:
            out.append(f"did not compile: {self.error}")
        if self.shared is not None and self.shared > SHARED_LIMIT:
            out.append(f"shared memory {self.shared} B > {SHARED_LIMIT} B")
        if self.registers is not None and self.registers > REGISTER_LIMIT:
            out.append(f"registers {self.registers} > {REGISTER_LIMIT}")
        if self.spill_stores is not None and self.spill_stores > SPILL_LIMIT_BYTES:
            out.append(f"spill stores {self.spill_stores} B > {SPILL_LIMIT_BYTES} B")
        if self.compile_cpu_s is not None and self.compile_cpu_s > COMPILE_SECONDS_LIMIT:
            out.append(f"compile {self.compile_cpu_s:.1f} CPU s > {COMPILE_SECONDS_LIMIT:.0f} s")
        if not self.error and None in (self.shared, self.registers, self.spill_stores, self.compile_cpu_s):
            out.append("resources not read")
        return out


def _tool(name: str) -> str:
    import triton

    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    if not path.exists():
        raise FileNotFoundError(f"{path}: Triton's nvidia backend ships {name}; this Triton has none")
    return str(path)


_PTXAS_RE = {
    "registers_ptxas": re.compile(r"Used (\d+) registers"),
    "stack_ptxas": re.compile(r"(\d+) bytes stack frame"),
    "spill_stores": re.compile(r"(\d+) bytes spill stores"),
    "spill_loads": re.compile(r"(\d+) bytes spill loads"),
}


def parse_ptxas_log(log: str) -> dict[str, int]:
    """Registers, stack frame and spill bytes from ptxas ``-v`` (the largest figure over the log's functions)."""
    out = {}
    for name, pat in _PTXAS_RE.items():
        vals = [int(m) for m in pat.findall(log)]
        if vals:
            out[name] = max(vals)
    return out


def parse_resource_usage(text: str) -> dict[str, int]:
    """``REG``, ``STACK``, ``SHARED`` of the (largest) function in ``cuobjdump --dump-resource-usage`` output."""
    out: dict[str, int] = {}
    for field in ("REG", "STACK", "SHARED", "LOCAL"):
        vals = [int(v) for v in re.findall(rf"\b{field}:(\d+)", text)]
        if vals:
            out[field] = max(vals)
    return out


def _compile_one(spec_path: str, out_path: str) -> None:
    """Worker: compile the recorded specialization in ``spec_path`` cold; write a :class:`Result` JSON to
    ``out_path`` (shared memory first, as soon as the LLVM stage has it)."""
    spec = Spec(**json.loads(Path(spec_path).read_text()))
    data = json.loads(spec.data)
    opts = data["options"]
    res = Result(spec.kernel, spec.shape, spec.case, opts["num_warps"], opts["num_stages"])

    def write() -> None:
        Path(out_path).write_text(json.dumps(dataclasses.asdict(res)))

    from triton import knobs
    from triton.backends.nvidia.compiler import CUDABackend

    sys.path.insert(0, str(HERE))
    fn = getattr(importlib.import_module(spec.module), spec.qualname)
    make_cubin = CUDABackend.make_cubin

    def make_cubin_reporting(self: Any, src: Any, metadata: dict[str, Any], opt: Any, capability: int) -> Any:
        res.shared = int(metadata["shared"])
        write()  # survives a ptxas that is then stopped
        return make_cubin(self, src, metadata, opt, capability)

    CUDABackend.make_cubin = make_cubin_reporting
    knobs.nvidia.dump_ptxas_log = True
    log = io.StringIO()
    with stand_in_driver(), contextlib.redirect_stdout(log):
        t0, c0, k0 = time.perf_counter(), time.process_time(), resource.getrusage(resource.RUSAGE_CHILDREN)
        kernel = fn.preload(spec.data)
        k1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        res.compile_s = round(time.perf_counter() - t0, 2)
        res.compile_cpu_s = round(time.process_time() - c0 + k1.ru_utime + k1.ru_stime - k0.ru_utime - k0.ru_stime, 2)
    res.shared = int(kernel.metadata.shared)
    ptxas = parse_ptxas_log(log.getvalue())
    res.spill_stores, res.spill_loads = ptxas.get("spill_stores"), ptxas.get("spill_loads")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = parse_resource_usage(subprocess.run([_tool("cuobjdump"), "--dump-resource-usage", f.name],
                                                    check=True, capture_output=True, text=True).stdout)
    res.registers, res.stack = usage.get("REG"), usage.get("STACK")
    res.shared += usage.get("SHARED", 0)  # static shared (Triton's kernels declare none; metadata is dynamic)
    write()


def _worker_env(cache: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(cache)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(HERE), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "moonrt" / "sm90"


WORKER_CPU_S = COMPILE_SECONDS_LIMIT + 20
"""``RLIMIT_CPU`` of a compile worker and of its ptxas (each): the limit plus the worker's imports; a compile past it
is stopped (SIGXCPU) and its kernel fails."""

WORKER_TIMEOUT_S = 8 * COMPILE_SECONDS_LIMIT
"""Wall seconds after which a compile worker is stopped (its kernel then fails): room for a machine shared with
other work (the CPU limit is what decides on an idle one)."""


def compile_spec(spec: Spec, cache_dir: Path | None = None, timeout_s: float = WORKER_TIMEOUT_S,
                 mem_gib: float = WORKER_MEM_GIB) -> Result:
    """Compile ``spec`` cold in a worker (``timeout_s`` wall seconds, ``mem_gib`` of address space), or return its
    cached result (``cache_dir``; None: no cache)."""
    cached = None if cache_dir is None else cache_dir / "results" / f"{spec.digest(timeout_s, mem_gib)}.json"
    if cached is not None and cached.exists():  # maybe compiled for another shape with the same specialization
        return dataclasses.replace(Result(**json.loads(cached.read_text())), shape=spec.shape, case=spec.case)
    with tempfile.TemporaryDirectory(prefix="moonrt-sm90-") as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec_path.write_text(json.dumps(dataclasses.asdict(spec)))
        limit = int(mem_gib * 2**30)

        def cap() -> None:
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
            resource.setrlimit(resource.RLIMIT_CPU, (int(WORKER_CPU_S), int(WORKER_CPU_S) + 5))

        cmd = [sys.executable, str(Path(__file__).resolve()), "--compile-one", str(spec_path), str(out_path)]
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=_worker_env(Path(tmp) / "triton"), preexec_fn=cap,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            output, _ = proc.communicate(timeout=timeout_s + 30)  # + the worker's imports
            error = None if proc.returncode == 0 else _last_error(output, proc.returncode)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)  # the worker and its ptxas
            proc.communicate()
            error = f"stopped after {time.perf_counter() - t0:.0f} s (limit {timeout_s:.0f} s)"
        data = json.loads(out_path.read_text()) if out_path.exists() else None
    data = json.loads(spec.data)["options"] if data is None else data
    res = (Result(**data) if "kernel" in data
           else Result(spec.kernel, spec.shape, spec.case, data["num_warps"], data["num_stages"]))
    if error is not None:
        res.error = error
    if cached is not None:
        cached.parent.mkdir(parents=True, exist_ok=True)
        cached.write_text(json.dumps(dataclasses.asdict(res)))
    return res


def _last_error(output: str, rc: int) -> str:
    if "SIGXCPU" in output or rc in (-signal.SIGXCPU, 128 + signal.SIGXCPU) or "error code -24" in output:
        return f"over the CPU limit ({WORKER_CPU_S:.0f} s per process, RLIMIT_CPU)"
    if "MemoryError" in output or "std::bad_alloc" in output:
        return "over the memory limit (RLIMIT_AS)"
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    tail = next((ln for ln in reversed(lines) if "Error" in ln or "error" in ln), lines[-1] if lines else "")
    return f"exit {rc}: {tail[:300]}"


def compile_specs(specs: list[Spec], cache_dir: Path | None = None, timeout_s: float = WORKER_TIMEOUT_S,
                  mem_gib: float = WORKER_MEM_GIB, log: Callable[[str], None] | None = None) -> list[Result]:
    out = []
    for i, s in enumerate(specs):
        if log:
            log(f"[{i + 1}/{len(specs)}] {s.shape} {s.kernel} ({s.case})")
        out.append(compile_spec(s, cache_dir, timeout_s, mem_gib))
    return out


def check(shapes: tuple[str, ...] = ALL_SHAPES, cache_dir: Path | None = None,
          timeout_s: float = WORKER_TIMEOUT_S, mem_gib: float = WORKER_MEM_GIB,
          log: Callable[[str], None] | None = None) -> list[Result]:
    """Record and compile every kernel of ``shapes`` (this process must have Triton without the interpreter)."""
    return compile_specs(record(shapes), cache_dir, timeout_s, mem_gib, log)


def subprocess_command(shapes: tuple[str, ...], json_path: Path,
                       cache_dir: Path | None = None) -> tuple[list[str], dict[str, str]]:
    """The command and environment that run :func:`check` of ``shapes`` in a fresh process with ``TRITON_INTERPRET``
    unset (the CLI writes ``json_path``)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--shapes", *shapes, "--json", str(json_path)]
    cmd += ["--no-cache"] if cache_dir is None else ["--cache-dir", str(cache_dir)]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return cmd, env


def read_results(json_path: Path) -> list[Result]:
    """The results the CLI wrote to ``json_path`` (``--json``)."""
    fields = {f.name for f in dataclasses.fields(Result)}
    return [Result(**{k: v for k, v in r.items() if k in fields}) for r in json.loads(json_path.read_text())["results"]]


def check_in_subprocess(shapes: tuple[str, ...], json_path: Path, cache_dir: Path | None = None,
                        timeout: float | None = None) -> list[Result]:
    """:func:`check` in a fresh process with ``TRITON_INTERPRET`` unset (from a process that interprets, e.g.
    pytest under tests/conftest.py); the CLI writes ``json_path``."""
    cmd, env = subprocess_command(shapes, json_path, cache_dir)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if not json_path.exists():
        raise RuntimeError(f"sm90 check wrote no {json_path} (exit {proc.returncode}):\n{proc.stdout[-3000:]}"
                           f"\n{proc.stderr[-3000:]}")
    return read_results(json_path)


# ---------------------------------------------------------------------------------------------------------------
# CLI


def table(results: list[Result]) -> str:
    def f(x: Any) -> str:
        return "-" if x is None else f"{x:,}" if isinstance(x, int) else f"{x:.1f}"

    head = ("shape", "kernel", "case", "warps", "stages", "shared B", "regs", "stack B", "spill st B", "compile s",
            "CPU s", "fits sm_90")
    rows = [(r.shape, r.kernel, r.case, str(r.num_warps), str(r.num_stages), f(r.shared), f(r.registers), f(r.stack),
             f(r.spill_stores), f(r.compile_s), f(r.compile_cpu_s), "; ".join(r.violations()) or "yes")
            for r in results]
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    line = lambda row: "| " + " | ".join(x.ljust(w) for x, w in zip(row, widths)) + " |"  # noqa: E731
    return "\n".join([line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=list(ALL_SHAPES),
                    help=f"of {', '.join(ALL_SHAPES)} (and {PLANTED}); default all")
    ap.add_argument("--json", type=Path, help="write {limits, results} here")
    ap.add_argument("--cache-dir", type=Path, default=default_cache_dir())
    ap.add_argument("--no-cache", action="store_true", help="compile everything cold, store nothing")
    ap.add_argument("--timeout", type=float, default=WORKER_TIMEOUT_S, help="wall seconds per kernel compile")
    ap.add_argument("--mem-gib", type=float, default=WORKER_MEM_GIB, help="address space per compile worker")
    ap.add_argument("--compile-one", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.compile_one:
        _compile_one(*a.compile_one)
        return 0
    t0 = time.perf_counter()
    results = check(tuple(a.shapes), None if a.no_cache else a.cache_dir, a.timeout, a.mem_gib,
                    log=lambda s: print(s, file=sys.stderr, flush=True))
    print(table(results))
    bad = [r for r in results if r.violations()]
    print(f"\n{len(results)} kernels, {len(bad)} over a limit; {time.perf_counter() - t0:.0f} s")
    if a.json:
        limits = dict(shared_bytes=SHARED_LIMIT, registers=REGISTER_LIMIT, spill_store_bytes=SPILL_LIMIT_BYTES,
                      compile_seconds=COMPILE_SECONDS_LIMIT, target=list(TARGET))
        import triton

        a.json.write_text(json.dumps(dict(limits=limits, triton=triton.__version__, shapes=a.shapes,
                                          results=[dataclasses.asdict(r) | {"violations": r.violations()}
                                                   for r in results]), indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    os.environ.pop("TRITON_INTERPRET", None)  # before anything imports triton: compile, never interpret
    sys.exit(main())
