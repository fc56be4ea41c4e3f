"""The device-discipline checker (issue 30 item 3): every tensor moonrt code creates lives on the job's device.

:func:`device_discipline` is a context manager (``with device_discipline("cpu") as found: ...``) that, while it is
active, watches every tensor factory call and every device transfer and records a :class:`Violation` for each one
issued *directly* from a moonrt source file (the calling frame, after torch's own dispatch frames and this module's;
a factory that torch code calls, e.g. an optimizer's step counter, is torch's business):

- a factory (``torch.zeros``, ``arange``, ``tensor``, ``as_tensor``, ``randn``, ...) without ``device=``: on CUDA it
  would land on the CPU;
- ``torch.from_numpy`` (always a host tensor; wrapped while the checker is active: the torch function mode does not
  see it);
- a factory, ``*_like`` / ``new_*`` call or ``.to()`` with a device other than the job's, or with the device spelled
  as the string ``"cpu"`` (an explicit host placement; the job's device reaches code as a ``torch.device``, the
  runtime's ``Parallelism.device`` or a tensor's ``.device``);
- ``.cpu()``, ``.cuda()`` and ``.numpy()`` (a host copy: on CUDA ``.numpy()`` needs one).

On the CPU this proves the code names the device everywhere it creates a tensor, so that on CUDA everything lands
on the CUDA device. Host work that stays on the CPU by design is declared in :data:`SANCTIONED` (file and function,
with the reason), like ``tests/test_import_direction.py``'s table of allowed imports; calls from those functions are
not flagged. The one spelling the checker cannot see is ``torch.device("cpu")`` built in moonrt code and passed as a
device: :func:`literal_host_devices` finds those in the source.

A factory without ``device=`` is flagged at a sanctioned site too (host work says ``device="cpu"``); only the
functions of :data:`SCOPES` (the model's build on the host, moved whole right after) are exempt from that. (A tensor
a module keeps outside its parameters and buffers would not move with it: module state lives in buffers.)

Violations are collected, not raised (a raise inside a forward may be caught by the code under test); the caller
asserts the list is empty. :data:`CHECKERS` is the list of per-layout checkers a layout run enters around its step
(``tests/jobs/test_layout_checks.py``): each a factory ``(device) -> context manager`` whose ``__enter__`` returns a
list that holds the violations after ``__exit__``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

MOONRT = Path(__file__).resolve().parents[1] / "moonrt"
"""The package whose frames the checker judges (this tree's, also in the ranks a test forks)."""

SANCTIONED: dict[tuple[str, str], str] = {
    ("jobs/train/device.py", "host_tensor"): "the data path: numpy batches become tensors here and move to the job's "
                                              "device in the same call",
    ("ops/kda/terms.py", "_chunk_terms_fused"): "the numba KDA pass (CPU fp32/fp64 tensors only, _use_fused) works "
                                                "on numpy views of its tensors by design",
    ("models/k3/model/moe.py", "update_bias"): "the step's routing statistics (summed counts, maxvio) are read on the "
                                               "host once per step for the metrics",
    ("comm/parallelism.py", "step_metrics"): "the routing trace's counts are written with numpy on the host",
    ("ops/muon.py", "step_count"): "optimizer step counts live on the host, as in torch's optimizers without "
                                   "capturable/fused (Optimizer.load_state_dict keeps them there too)",
    ("comm/zero/core.py", "_host_counts"): "ZeRO's per-parameter step counts and had-a-gradient flags: host "
                                           "bookkeeping the step reads as Python numbers",
    ("comm/zero/core.py", "scatter_grads"): "the reduced had-a-gradient flags come to the host once per bucket and "
                                            "step, for that bookkeeping",
    ("jobs/checkpoint/sharded.py", "read_full"): "a checkpoint read whole into host memory (single-process layout, a "
                                                 "conversion tool: no model involved)",
    ("comm/ep/dispatch.py", "dispatch"): "the routing table, the plan (made on the counts' device) and the "
                                            "top-k ids come to the host in one copy per MoE layer: the transport "
                                            "layout and the all-to-all split sizes (NCCL takes them as host lists) "
                                            "are host data",
    ("scheduler/moonep_torch.py", "to_host"): "that one copy per MoE layer: the table, the device-made plan and the "
                                              "top-k ids in a single device-to-host transfer (see dispatch)",
    ("ops/moonep/greedy.py", "greedy_numba"): "the numba backend runs on CPU tensors only (the registry refuses it "
                                              "elsewhere): .numpy() / from_numpy share memory, nothing is copied",
    ("comm/ep/collectives.py", "build_dedup"): "the dedup layout (which received rows share a token) is built on "
                                               "the host beside the plan's layout: the per-assignment metadata "
                                               "comes there once per MoE layer",
    ("comm/ep/placement.py", "place"): "a placement made on the host (the all-to-all baseline's; MoonEP's where no "
                                       "device plan is made) from the counts' host copy",
    ("scheduler/placement.py", "conv"): "a plan's placement is made on the host (the planners run there)",
    ("jobs/checkpoint/store.py", "_on_host"): "a checkpoint file holds the single-process state on the host",
    ("memory/backends.py", "_take"): "the host tier's (pinned) host buffers, the destination of its offload copies",
    ("memory/backends.py", "put"): "the disk tier writes saved tensors' bytes from the host with pwrite",
    ("memory/backends.py", "get"): "the disk tier reads saved tensors' bytes into the host with pread",
    ("ops/fp8/codec.py", "quantize_rows_numba"): "the FP8 codec's numba backend, chosen for CPU tensors only, works on "
                                           "numpy views",
    ("ops/rows.py", "scatter_rows"): "the row scatter's numba backend, chosen for CPU tensors only (CUDA goes to "
                                     "the Triton kernel), works on numpy views: nothing is copied",
    ("ops/rows.py", "_words"): "a CPU tensor's bytes as a numpy view for that numba loop (no copy)",
    ("ops/fp8/codec.py", "dequantize_rows_numba"): "the FP8 codec's numba backend, chosen for CPU tensors only, "
                                                   "works on numpy views",
}
"""``(file under moonrt/, function)`` -> why a host tensor or copy made directly in that function is by design.
Globs allowed (fnmatch); ``"*"`` as the function: the whole file. A comprehension is judged as the function it is
written in."""

SCOPES: dict[tuple[str, str], str] = {
    ("jobs/train/assemble.py", "build_model"): "the model is built on the host and moved whole (parameters and "
                                               "buffers) to the job's device right after (moonrt.jobs.train.loop)",
}
"""``(file under moonrt/, function)`` -> why every placement made while that function runs (anywhere below it) is
by design."""

FACTORIES = frozenset({
    torch.zeros, torch.ones, torch.empty, torch.full, torch.arange, torch.range, torch.tensor, torch.as_tensor,
    torch.asarray, torch.randn, torch.rand, torch.randint, torch.randperm, torch.eye, torch.linspace, torch.logspace,
    torch.scalar_tensor, torch.empty_strided, torch.tril_indices, torch.triu_indices,
})
"""Functions that make a new tensor on the default device unless given ``device=``."""

LIKE = frozenset({torch.zeros_like, torch.ones_like, torch.empty_like, torch.full_like, torch.rand_like,
                  torch.randn_like, torch.randint_like, torch.Tensor.new_zeros, torch.Tensor.new_ones,
                  torch.Tensor.new_empty, torch.Tensor.new_full, torch.Tensor.new_tensor})
"""Functions that follow their input's device unless given another one."""

HOST_COPIES = {torch.Tensor.cpu: ".cpu()", torch.Tensor.cuda: ".cuda()", torch.Tensor.numpy: ".numpy()"}

_SKIP = (str(Path(torch.__file__).parent / "overrides.py"), str(Path(torch.__file__).parent / "utils" / "_device.py"),
         __file__)
_TORCH = str(Path(torch.__file__).parent)


@dataclasses.dataclass(frozen=True)
class Violation:
    """One tensor placed away from the job's device: where (``file:line`` under moonrt/, the function) and what."""

    where: str
    function: str
    what: str

    def __str__(self) -> str:
        return f"{self.where} in {self.function}: {self.what}"


def _site() -> tuple[str, int, str, Any] | None:
    """The moonrt frame that issued the call being checked: ``(path under moonrt/, line, function, frame)``, or None
    when the caller is not moonrt code (torch's own code, a test, another library)."""
    f = sys._getframe(1)
    while f is not None and f.f_code.co_filename in _SKIP:
        f = f.f_back
    if f is None:
        return None
    rel = _moonrt_path(f.f_code.co_filename)
    if rel is None:
        return None
    line, fn = f.f_lineno, f
    while fn.f_code.co_name in _COMPREHENSIONS and fn.f_back is not None:
        fn = fn.f_back
    return rel, line, fn.f_code.co_name, f


_COMPREHENSIONS = frozenset({"<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>"})
_PATHS: dict[str, str | None] = {}


def _moonrt_path(filename: str) -> str | None:
    """``filename`` relative to moonrt/ (posix), or None outside it."""
    if filename not in _PATHS:
        try:
            _PATHS[filename] = Path(filename).resolve().relative_to(MOONRT).as_posix()
        except ValueError:
            _PATHS[filename] = None
    return _PATHS[filename]


def _sanctioned(rel: str, function: str, table: dict[tuple[str, str], str] | None = None) -> str | None:
    from fnmatch import fnmatch

    for (file, fn), why in (SANCTIONED if table is None else table).items():
        if fnmatch(rel, file) and (fn == "*" or fnmatch(function, fn)):
            return why
    return None


def _in_scope(frame: Any) -> str | None:
    """The :data:`SCOPES` entry of a frame on the stack from ``frame`` up, or None."""
    f = frame
    while f is not None:
        rel = _moonrt_path(f.f_code.co_filename)
        if rel is not None and (why := _sanctioned(rel, f.f_code.co_name, SCOPES)) is not None:
            return why
        f = f.f_back
    return None


def _device_of(value: Any) -> torch.device | str | None:
    if isinstance(value, torch.Tensor):
        return value.device
    if isinstance(value, str):
        return value
    if isinstance(value, torch.device):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return torch.device("cuda", value)
    return None


def _to_target(args: tuple, kwargs: dict) -> torch.device | str | None:
    """The device a ``Tensor.to`` call moves to (None: a dtype-only conversion)."""
    if "device" in kwargs:
        return _device_of(kwargs["device"])
    if "other" in kwargs:
        return kwargs["other"].device
    for a in args[1:]:
        if isinstance(a, torch.dtype | bool) or a is None:
            continue
        return _device_of(a)
    return None


class DisciplineMode(TorchFunctionMode):
    """Records each placement off ``device`` issued from a moonrt frame (see the module docstring)."""

    def __init__(self, device: str | torch.device, parent: DisciplineMode | None = None) -> None:
        super().__init__()
        self.device = torch.device(device)
        self.found: list[Violation] = [] if parent is None else parent.found
        self.hits: set[tuple[str, str]] = set() if parent is None else parent.hits
        self._lock = threading.Lock() if parent is None else parent._lock

    def _bad_device(self, dev: torch.device | str | None) -> str | None:
        if dev is None:
            return None
        if isinstance(dev, str):
            if torch.device(dev).type == "cpu":
                return f"device {dev!r} spelled as a string (an explicit host placement)"
            dev = torch.device(dev)
        if dev.type != self.device.type or (dev.index is not None and self.device.index is not None
                                            and dev.index != self.device.index):
            return f"device {dev} (the job's is {self.device})"
        return None

    def record(self, site: tuple[str, int, str, Any] | None, what: str, implicit: bool = False) -> None:
        """Record ``what`` at ``site`` unless the site is sanctioned (an ``implicit`` placement, a factory without a
        device, only inside a :data:`SCOPES` function: host work must say it is host work)."""
        if site is None:
            return
        rel, line, function, frame = site
        why = None if implicit else _sanctioned(rel, function)
        if why is None and _in_scope(frame) is not None:
            return
        with self._lock:
            if why is not None:
                self.hits.add((rel, function))
                return
            self.found.append(Violation(f"moonrt/{rel}:{line}", function, what))

    def judge(self, func: Any, args: tuple, kwargs: dict) -> None:
        name = getattr(func, "__name__", repr(func))
        if func in FACTORIES:
            if "device" not in kwargs or kwargs["device"] is None:
                self.record(_site(), f"torch.{name} without device=", implicit=True)
            elif (bad := self._bad_device(_device_of(kwargs["device"]))) is not None:
                self.record(_site(), f"torch.{name} on {bad}")
        elif func in LIKE:
            if (bad := self._bad_device(_device_of(kwargs.get("device")))) is not None:
                self.record(_site(), f"{name} on {bad}")
        elif func is torch.Tensor.to:
            if (bad := self._bad_device(_to_target(args, kwargs))) is not None:
                self.record(_site(), f".to() to {bad}")
        elif func in HOST_COPIES:
            self.record(_site(), f"{HOST_COPIES[func]} (a host copy)")

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        self.judge(func, args, kwargs)
        return func(*args, **kwargs)


@contextlib.contextmanager
def device_discipline(device: str | torch.device, require_hits: bool = False) -> Iterator[list[Violation]]:
    """Check device discipline while active (see the module docstring); yields the list of violations, filled as
    they happen. ``torch.from_numpy`` is wrapped for the duration (the torch function mode does not see it). A torch
    function mode is per thread: every thread started while the checker is active (the activation manager's copy and
    prefetch workers) runs under its own mode that records into the same list."""
    mode = DisciplineMode(device)
    real, run = torch.from_numpy, threading.Thread.run

    def from_numpy(array: Any) -> torch.Tensor:
        mode.record(_site(), "torch.from_numpy (a host tensor)")
        return real(array)

    def checked_run(thread: threading.Thread) -> None:
        with DisciplineMode(device, parent=mode):
            run(thread)

    torch.from_numpy, threading.Thread.run = from_numpy, checked_run
    try:
        with mode:
            yield mode.found
    finally:
        torch.from_numpy, threading.Thread.run = real, run


def literal_host_devices() -> list[str]:
    """``file:line`` of every ``torch.device("cpu")`` spelled in moonrt/ (the checker sees a ``torch.device`` only
    by value, the same as the job's device on the CPU); a test compares them with the sites allowed one."""
    pattern = re.compile(r"torch\.device\(\s*['\"]cpu['\"]")
    hits = []
    for path in sorted(MOONRT.rglob("*.py")):
        rel = path.relative_to(MOONRT).as_posix()
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line):
                hits.append(f"moonrt/{rel}:{i}")
    return hits


def _collective_check(device: torch.device | str) -> Any:
    from collective_check import collective_check

    return collective_check(device)


_collective_check.__name__ = "collective_check"

CHECKERS: list[Callable[[torch.device | str], Any]] = [device_discipline, _collective_check]
"""The checkers a layout run enters around its step (each ``(device) -> context manager`` yielding its violation
list): the device discipline and the NCCL-op check (:mod:`collective_check`: its findings also keep every rank's
recorded calls, ``.calls``)."""
