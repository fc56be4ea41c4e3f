"""The kernel-backend registry: which implementation runs each hot op, chosen by the tensors' device or by config.

Ops and their families (the config keys of a job's ``kernels:`` section, :data:`FAMILIES`):

============================  ======  ==========================================================================
op                            family  contract
============================  ======  ==========================================================================
``kda_chunk``                 kda     :func:`moonrt.ops.kda.kda_chunk` (forward; differentiable: its autograd
                                      op holds the backward)
``kda_transition``            kda     :func:`moonrt.ops.kda.kda_transition` (KCP's ``M``, ``S_ext``, §7)
``kda_state_grad``            kda     :func:`moonrt.ops.kda.kda_state_grad` (KCP's backward step 1)
``fp8_quantize``              fp8     ``(x2 [M, N] fp32 contiguous, block) -> (payload [M, nb * block] E4M3,
                                      scales [M, nb] fp32)``: the row codec of :mod:`moonrt.ops.fp8.codec`
``fp8_dequantize``            fp8     ``(payload [M, nb * block] E4M3, scales [M, nb] fp32, n) -> [M, n] fp32``
``moonep_greedy``             moonep  ``(load [R, G] int64, cap [R] int64) -> alloc3 [R, G, R] int64``: MoonEP's
                                      greedy placement (:mod:`moonrt.ops.moonep.greedy`), every backend bit-equal
============================  ======  ==========================================================================

Backends: ``torch`` (torch ops, any device: the reference), ``numba`` (CPU only; where a numba pass exists),
``triton`` (CUDA; on CPU tensors only under Triton's interpreter, ``TRITON_INTERPRET=1``, which is how CI checks
the kernels) and ``fla`` (``kda_chunk`` only: fla-core's ``chunk_kda``, the field's Triton kernels, behind moonrt's
contract by :mod:`moonrt.ops.kda.backends.fla`; CUDA, or CPU under the interpreter; chosen only by name, so a GPU
user can pick it and moonrt can measure itself against it; :func:`family_choices`). The choice ``auto`` follows the
device: CPU -> ``numba`` where the op has one, else ``torch``; CUDA -> ``triton``; any other device -> ``torch``.
A job overrides it per family (``kernels: {kda: torch}``) and passes the choice down to the call sites (the
attention context, KCP, the activation manager): nothing here reads a process-wide switch (STYLE habit 7).

Backends are registered as ``"module:function"`` paths and imported on first use, so Triton is imported only when a
Triton backend is chosen. Each failure is one line naming the config key, the choice and what to do: a backend the
op lacks or that cannot run on the device (``ValueError``), Triton not installed or a backend module missing from
this install (:class:`KernelUnavailable`). Resolved callables are cached per ``(op, choice, device type)``.
Importing this module does not import torch (the train CLI catches :class:`KernelUnavailable` and stays torch-free
for ``--help``).

Known limitation of the KDA ``torch`` backend on CPU: :mod:`moonrt.ops.kda` itself runs its graph-free elementwise
passes in numba on CPU tensors (``kda_terms._use_fused``), so on CPU ``torch`` and ``numba`` are the same code until
that module gains a torch-only switch; on CUDA ``torch`` is the chunk form in plain torch ops.

Plugging in a backend (what ``moonrt.ops.kda.backends.triton`` does by existing: its entries are registered here)::

    REGISTRY.register("kda_chunk", "triton", "moonrt.ops.kda.backends.triton:kda_chunk", devices=("cuda",),
                      requires="triton")
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import importlib.util
import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

if TYPE_CHECKING:
    import torch

KernelFn = Callable[..., Any]
"""A backend function as the registry holds it. ``...`` and ``Any``: one registry holds every op, and the ops'
signatures differ (the module docstring's table is each op's contract); a caller gets the function of the op it
names and calls it by that contract."""

_P = ParamSpec("_P")
_R = TypeVar("_R")

FAMILIES: dict[str, tuple[str, ...]] = {
    "kda": ("kda_chunk", "kda_transition", "kda_state_grad"),
    "fp8": ("fp8_quantize", "fp8_dequantize"),
    "moonep": ("moonep_greedy",),
}
"""Config key (``kernels.<family>``) -> the ops it chooses the backend of."""

OPS: dict[str, str] = {op: family for family, ops in FAMILIES.items() for op in ops}
"""Op -> its family."""

BACKENDS = ("torch", "numba", "triton", "fla")
"""Backend names."""

CHOICES = ("auto", "torch", "numba", "triton")
"""What every ``kernels.<family>`` config field may say (:func:`family_choices`: a family's own, ``fla`` for KDA)."""

FAMILY_EXTRA: dict[str, tuple[str, ...]] = {"kda": ("fla",)}
"""Backends a family offers beyond :data:`CHOICES` (never picked by ``auto``)."""

TRITON_INSTALL = "pip install 'triton==3.8.0'"
"""How to install the Triton the kernels are tested with (the ``test`` extra pins it)."""

FLA_INSTALL = "pip install 'moonrt[fla]'"
"""How to install fla-core (the ``fla`` extra: ``fla-core>=0.6``), whose ``chunk_kda`` is the ``fla`` backend."""

TRITON_PACKAGES = ("triton", "fla")
"""Packages whose backends are Triton kernels (run on CPU tensors under Triton's interpreter)."""

_INSTALL = {"triton": TRITON_INSTALL, "fla": f"{FLA_INSTALL} (fla-core)"}


def family_choices(family: str) -> tuple[str, ...]:
    """What ``kernels.<family>`` may say: :data:`CHOICES` and the family's extra backends (KDA: ``fla``)."""
    return (*CHOICES, *FAMILY_EXTRA.get(family, ()))


class KernelUnavailable(RuntimeError):
    """The chosen backend cannot be loaded here (its package is not installed, or its module is missing)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Backend:
    """One implementation of one op."""

    op: str
    name: str
    """One of :data:`BACKENDS`."""
    target: str | KernelFn
    """``"module:function"`` (imported on first use), or the function itself (plug-ins, tests)."""
    devices: tuple[str, ...] | None = None
    """Device types it runs on (``torch.device.type``); None: any."""
    requires: str | None = None
    """Top-level package that must be importable (``triton``, ``numba``); checked before importing ``target``."""


def _interpreted(backend: Backend, device_type: str) -> bool:
    """A Triton backend on CPU tensors runs under Triton's interpreter (its own switch, ``TRITON_INTERPRET=1``)."""
    return backend.requires in TRITON_PACKAGES and device_type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"


class KernelRegistry:
    """Backends per op and the rule that picks one (module docstring). :data:`REGISTRY` is the one moonrt uses;
    tests build their own or swap an entry for a while (:meth:`swapped`)."""

    def __init__(self) -> None:
        self._table: dict[str, dict[str, Backend]] = {op: {} for op in OPS}
        self._cache: dict[tuple[str, str, str], KernelFn] = {}  # (op, choice, device type)

    def register(self, op: str, name: str, target: str | KernelFn, *, devices: tuple[str, ...] | None = None,
                 requires: str | None = None) -> None:
        """Register (or replace) backend ``name`` of ``op``."""
        if op not in OPS:
            raise ValueError(f"op = {op!r}: expected one of {', '.join(OPS)}")
        if name not in BACKENDS:
            raise ValueError(f"backend = {name!r}: expected one of {', '.join(BACKENDS)}")
        if isinstance(target, str) and (target.count(":") != 1 or not all(target.split(":"))):
            raise ValueError(f"target = {target!r}: expected 'module:function' or a callable")
        self._table[op][name] = Backend(op, name, target, devices, requires)
        self._cache.clear()

    @contextlib.contextmanager
    def swapped(self, op: str, name: str, target: str | KernelFn, *, devices: tuple[str, ...] | None = None,
                requires: str | None = None) -> Iterator[None]:
        """Backend ``name`` of ``op`` replaced by ``target`` inside the block (restored after; tests)."""
        old = self._table.get(op, {}).get(name)
        self.register(op, name, target, devices=devices, requires=requires)
        try:
            yield
        finally:
            if old is None:
                self._table[op].pop(name, None)
            else:
                self._table[op][name] = old
            self._cache.clear()

    def backends(self, op: str) -> tuple[str, ...]:
        """Names of ``op``'s registered backends."""
        return tuple(self._table[op])

    def choose(self, op: str, choice: str, device: torch.device | str) -> Backend:
        """The backend ``choice`` means for ``op`` on ``device`` (ValueError, one line, when it cannot run there)."""
        if op not in OPS:
            raise ValueError(f"op = {op!r}: expected one of {', '.join(OPS)}")
        key = f"kernels.{OPS[op]}"
        choices = family_choices(OPS[op])
        if choice not in choices:
            raise ValueError(f"{key} = {choice!r}: expected one of {', '.join(choices)}")
        dev = _device_type(device)
        table = self._table[op]
        if choice == "auto":
            name = {"cuda": "triton", "cpu": "numba" if "numba" in table else "torch"}.get(dev, "torch")
        else:
            name = choice
        backend = table.get(name)
        if backend is None:
            have = ", ".join(("auto", *table))
            raise ValueError(f"{key} = {choice!r}: {op} has no {name} backend; expected one of {have}")
        if backend.devices is not None and dev not in backend.devices and not _interpreted(backend, dev):
            where = ", ".join(backend.devices)
            hint = {"triton": " (or set TRITON_INTERPRET=1 to run Triton's interpreter)",
                    "fla": " (fla's Triton kernels need a CUDA GPU)"}.get(backend.requires or "", "")
            raise ValueError(f"{key} = {choice!r}: the {name} backend of {op} runs on {where} tensors, got {dev} "
                             f"tensors{hint}; expected another choice of {', '.join(choices)}")
        return backend

    def resolve(self, op: str, choice: str, device: torch.device | str) -> KernelFn:
        """The function that runs ``op`` for ``choice`` on ``device`` (imported on first use, then cached)."""
        dev = _device_type(device)
        # (Triton on CPU tensors is allowed only while Triton's interpreter is on: part of the key)
        interp = choice in TRITON_PACKAGES and dev == "cpu"
        key = (op, choice, f"cpu:{os.environ.get('TRITON_INTERPRET')}" if interp else dev)
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        backend = self.choose(op, choice, dev)
        fn = _load(backend, choice)
        self._cache[key] = fn
        return fn


def _device_type(device: torch.device | str) -> str:
    """``torch.device(device).type`` (torch imported only for a string that is not a plain device type)."""
    if not isinstance(device, str):
        return device.type
    if device.isalpha():
        return device
    import torch

    return torch.device(device).type


def _load(backend: Backend, choice: str) -> KernelFn:
    """Import ``backend.target`` (KernelUnavailable, one line, when its package or module is missing)."""
    if callable(backend.target):
        return backend.target
    key = f"kernels.{OPS[backend.op]} = {choice!r}"
    if backend.requires is not None and importlib.util.find_spec(backend.requires) is None:
        install = _INSTALL.get(backend.requires, f"pip install {backend.requires}")
        raise KernelUnavailable(f"{key}: {backend.op} runs the {backend.name} backend, but {backend.requires} is not "
                                f"installed: {install}, or set {key.split(' = ')[0]}: torch")
    module, _, name = backend.target.partition(":")
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name is not None and module.startswith(exc.name) and exc.name.startswith("moonrt"):
            raise KernelUnavailable(f"{key}: the {backend.name} backend of {backend.op} is {backend.target}, but "
                                    f"module {module} is not in this install; expected another choice of "
                                    f"{', '.join(family_choices(OPS[backend.op]))}") from None
        raise
    fn = getattr(mod, name, None)
    if not callable(fn):
        raise KernelUnavailable(f"{key}: the {backend.name} backend of {backend.op} is {backend.target}, but {module} "
                                f"has no function {name}")
    return fn


def default_registry() -> KernelRegistry:
    """A registry holding moonrt's own backends (what :data:`REGISTRY` starts with)."""
    reg = KernelRegistry()
    for op in FAMILIES["kda"]:
        # the chunk form of moonrt.ops.kda: torch ops on any device; on CPU its graph-free passes run in numba
        reg.register(op, "torch", f"moonrt.ops.kda:{op}")
        reg.register(op, "numba", f"moonrt.ops.kda:{op}", devices=("cpu",), requires="numba")
        reg.register(op, "triton", f"moonrt.ops.kda.backends.triton:{op}", devices=("cuda",), requires="triton")
    # fla-core's chunk_kda behind moonrt's contract (KCP's summaries have no fla form: kernels.kda = fla, cp = 1)
    reg.register("kda_chunk", "fla", "moonrt.ops.kda.backends.fla:kda_chunk", devices=("cuda",), requires="fla")
    reg.register("fp8_quantize", "torch", "moonrt.ops.fp8.codec:quantize_rows_torch")
    reg.register("fp8_quantize", "numba", "moonrt.ops.fp8.codec:quantize_rows_numba", devices=("cpu",),
                 requires="numba")
    reg.register("fp8_quantize", "triton", "moonrt.ops.fp8.triton:quantize_rows", devices=("cuda",), requires="triton")
    reg.register("fp8_dequantize", "torch", "moonrt.ops.fp8.codec:dequantize_rows_torch")
    reg.register("fp8_dequantize", "numba", "moonrt.ops.fp8.codec:dequantize_rows_numba", devices=("cpu",),
                 requires="numba")
    reg.register("fp8_dequantize", "triton", "moonrt.ops.fp8.triton:dequantize_rows", devices=("cuda",),
                 requires="triton")
    reg.register("moonep_greedy", "torch", "moonrt.ops.moonep.greedy:greedy_torch")
    reg.register("moonep_greedy", "numba", "moonrt.ops.moonep.greedy:greedy_numba", devices=("cpu",),
                 requires="numba")
    reg.register("moonep_greedy", "triton", "moonrt.ops.moonep.triton:greedy", devices=("cuda",), requires="triton")
    return reg


REGISTRY = default_registry()
"""The registry moonrt's call sites resolve through (static: which implementations exist; the choice is passed
in by each caller)."""


def kernel(op: str, choice: str, device: torch.device | str) -> KernelFn:
    """``REGISTRY.resolve(op, choice, device)``: the function that runs ``op`` (module docstring)."""
    return REGISTRY.resolve(op, choice, device)


def on_tensor_device(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """Run ``fn`` (a Triton host wrapper) with its first tensor argument's CUDA device current
    (``torch.cuda.device(t.device)``): Triton launches on the calling thread's current device, which on a rank with
    ``LOCAL_RANK != 0`` need not be the tensors' (a worker thread starts on device 0, the autograd engine's threads
    follow their own devices). CPU tensors (Triton's interpreter) run ``fn`` as it is."""

    @functools.wraps(fn)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        import torch

        t = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
        if t is None or t.device.type != "cuda":
            return fn(*args, **kwargs)
        with torch.cuda.device(t.device):
            return fn(*args, **kwargs)

    return wrapper


def check_choice(family: str, choice: object) -> str:
    """``choice`` for ``kernels.<family>`` if valid (ValueError naming the key and the choices otherwise)."""
    if family not in FAMILIES:
        raise ValueError(f"kernels family = {family!r}: expected one of {', '.join(FAMILIES)}")
    choices = family_choices(family)
    if choice not in choices:
        raise ValueError(f"kernels.{family} = {choice!r}: expected one of {', '.join(choices)}")
    return choice


__all__ = ["BACKENDS", "CHOICES", "FAMILIES", "FAMILY_EXTRA", "FLA_INSTALL", "OPS", "REGISTRY", "TRITON_INSTALL",
           "TRITON_PACKAGES", "Backend", "KernelFn", "KernelRegistry", "KernelUnavailable", "check_choice",
           "default_registry", "family_choices", "kernel", "on_tensor_device"]
