"""The KDA blocks of the GPU check (``benchmarks/gpu/probes.py kda_triton | kda_model``).

- :func:`kda_vs_reference` (``kda_triton``): the Triton KDA (``kernels.kda = triton``, through the registry)
  forward and backward on the device at k3_tiny's KDA shape (B=8, T=128, H=4, K=V=48, chunk 64) against the fp64
  token recurrence (:func:`moonrt.ops.kda.kda_recurrent`) on the same inputs: the rel-L2 of the output, the final
  state and every gradient (q, k, v, g, beta, initial state), the first call's seconds (the compiles) and the
  second's, and each compiled kernel's resources (registers, spilled bytes, shared memory) read from Triton's
  cache of compiled kernels. The torch chunk backend on the same device is measured the same way as a control of
  the harness.
- :func:`kda_in_model` (``kda_model``): k3_tiny with the same weights on one teacher-forced batch, once per KDA
  backend (torch, triton, and fla when the registry has it and it imports): the loss and every parameter's
  gradient against the torch backend's; then each backend's KDA fwd+bwd time at K3's head size (K = V = 128,
  8 heads of K3's 96, T = 8192).

Inputs follow K3's gate (K3_SYSTEMS §2.7): per-token log-decays in [-5, 0), L2-normalized q and k,
``beta = sigmoid(.)``.

Tolerance (:data:`REL_L2_BOUND`, one bound for every tensor, derived, not fitted): the Triton path may round dot
operands to bf16 (unit roundoff ``u = 2^-9``) with fp32 accumulation. One dot of two rounded operands has
relative error <= ``2u``; the output chains at most 4 such dots (``W S``, ``A_qk (U - W S)``, ``Qg S`` after the
UT transform's ``W``/``U``), the gradients at most 8 (the transposes and the reverse state pass), so <= ``16u``;
a factor 2 covers the cancellation in the sums that form ``dg`` and ``dbeta``: ``32u = 2^-4``. With fp32 or
``tf32x3`` operands the same chain gives < ``1e-5``. A wrong kernel (a missing term, a wrong chunk boundary)
gives rel-L2 of order 0.1-1, far above the bound. The driver fails the block when any rel-L2 exceeds it or is
not finite.
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

REL_L2_BOUND = 2.0**-4
"""Largest rel-L2 (``||x - ref|| / ||ref||``) of any KDA output or gradient against the fp64 reference (module
docstring: ``32u`` for bf16 operands, ``u = 2^-9``)."""

K3_TINY_KDA = {"B": 8, "T": 128, "H": 4, "K": 48, "V": 48}
"""k3_tiny's KDA call in ``moonrt train`` (batch 8, seq_len 128, 4 heads of 48)."""

K3_HEAD = {"B": 1, "T": 8192, "H": 8, "K": 128, "V": 128}
"""K3's KDA head size (K = V = 128) on 8 of its 96 heads: the timing shape."""

GRAD_NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")


def _inputs(B: int, T: int, H: int, K: int, V: int, device: Any, seed: int = 0) -> dict[str, Any]:
    import torch

    gen = torch.Generator().manual_seed(seed)

    def rn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    x = {"q": torch.nn.functional.normalize(rn(B, T, H, K), dim=-1),
         "k": torch.nn.functional.normalize(rn(B, T, H, K), dim=-1),
         "v": rn(B, T, H, V),
         "g": -5.0 * torch.rand(B, T, H, K, generator=gen).clamp_min(1e-6),  # K3's gate: [-5, 0)
         "beta": torch.sigmoid(rn(B, T, H)),
         "h0": 0.1 * rn(B, H, K, V),
         "do": rn(B, T, H, V),
         "dht": rn(B, H, K, V)}
    return {k: t.to(device) for k, t in x.items()}


def _sync(device: Any) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _fwd_bwd(fn: Callable[..., Any], x: dict[str, Any], dtype: Any) -> dict[str, Any]:
    """o, the final state and the gradients of ``sum(o * do) + sum(S_T * dht)`` w.r.t. q, k, v, g, beta, h0."""
    import torch

    leaves = [x[n].to(dtype).requires_grad_() for n in ("q", "k", "v", "g", "beta", "h0")]
    q, k, v, g, beta, h0 = leaves
    o, st = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    loss = (o.float() * x["do"].to(o.device)).sum() + (st.float() * x["dht"]).sum()
    grads = torch.autograd.grad(loss, leaves)
    return {"o": o.detach(), "final_state": st.detach(), **dict(zip(GRAD_NAMES, grads, strict=True))}


def rel_l2(a: Any, ref: Any) -> float:
    """``||a - ref|| / ||ref||`` in fp64 (``inf`` for a non-finite ``a``)."""
    import torch

    a, ref = a.double(), ref.double()
    if not torch.isfinite(a).all():
        return math.inf
    return float((a - ref).norm() / ref.norm().clamp_min(1e-300))


def compiled_kernels() -> list[dict[str, Any]]:
    """Every Triton kernel compiled in this process for a device (the ``device_caches`` of moonrt's
    ``@triton.jit`` functions): name, registers, spilled bytes, shared memory, warps, stages. Empty under the
    interpreter (nothing is compiled)."""
    out = []
    for mod in [m for n, m in list(sys.modules.items()) if n.startswith("moonrt.") and m is not None]:
        for attr, fn in vars(mod).items():
            caches = getattr(fn, "device_caches", None)
            if not isinstance(caches, dict):
                continue
            for entry in caches.values():
                cache = entry[0] if isinstance(entry, tuple) else entry
                for kern in getattr(cache, "values", lambda: [])():
                    md = getattr(kern, "metadata", None)
                    try:
                        kern._init_handles()  # n_regs / n_spills are read when the module is loaded
                    except Exception:  # noqa: BLE001 - resources are best effort
                        pass
                    out.append({"kernel": f"{mod.__name__.rsplit('.', 1)[-1]}.{attr}",
                                "registers": getattr(kern, "n_regs", None),
                                "spill_bytes": getattr(kern, "n_spills", None),
                                "shared_bytes": getattr(md, "shared", None),
                                "num_warps": getattr(md, "num_warps", None),
                                "num_stages": getattr(md, "num_stages", None)})
    return out


def kda_vs_reference(device: str = "cuda", shape: dict[str, int] | None = None) -> dict[str, Any]:
    """The ``kda_triton`` block (module docstring)."""
    import torch

    from moonrt.ops.kda import kda_recurrent
    from moonrt.ops.kernels import kernel

    shape = shape or K3_TINY_KDA
    dev = torch.device(device)
    x = _inputs(**shape, device=dev)
    ref = _fwd_bwd(kda_recurrent, x, torch.float64)
    out: dict[str, Any] = {"device": str(dev), "shape": shape, "gate_range": [-5.0, 0.0], "dtype": "float32",
                           "rel_l2_bound": REL_L2_BOUND}
    for name in ("triton", "torch"):
        fn = kernel("kda_chunk", name, dev)
        times = []
        for _ in range(2):  # the first call compiles (Triton); the second runs from the cache
            _sync(dev)
            t0 = time.perf_counter()
            got = _fwd_bwd(fn, x, torch.float32)
            _sync(dev)
            times.append(time.perf_counter() - t0)
        errs = {k: rel_l2(got[k], ref[k]) for k in ref}
        key = "" if name == "triton" else "_torch_control"
        out[f"rel_l2{key}"] = errs
        out[f"first_call_s{key}"], out[f"second_call_s{key}"] = times
    out["compile_s"] = max(0.0, out["first_call_s"] - out["second_call_s"])  # the first call less a cached one
    out["kernels"] = compiled_kernels()
    return out


def _timed_cuda(fn: Callable[[], Any], device: Any, repeat: int = 5) -> float:
    """Median seconds of ``fn`` after one warm-up (CUDA events on a CUDA device, else the host clock)."""
    import torch

    fn()
    _sync(device)
    times = []
    for _ in range(repeat):
        if torch.device(device).type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def kda_backends(device: Any) -> tuple[list[str], dict[str, str]]:
    """KDA backends to compare on ``device``: torch, triton, fla (when registered and importable); and why each
    other one is left out."""
    import importlib.util

    from moonrt.ops.kernels import CHOICES, REGISTRY

    names, skipped = ["torch", "triton"], {}
    if "fla" not in CHOICES or "fla" not in REGISTRY.backends("kda_chunk"):
        skipped["fla"] = "no fla backend in moonrt.ops.kernels"
    elif importlib.util.find_spec("fla") is None:
        skipped["fla"] = "fla-core not installed"
    else:
        names.append("fla")
    return names, skipped


def kda_in_model(device: str = "cuda", batch: int = 8, seq_len: int = 128,
                 timing_shape: dict[str, int] | None = None) -> dict[str, Any]:
    """The ``kda_model`` block (module docstring). Losses and gradients in fp32 (no autocast), so that only the
    KDA backend differs; the gradient figure is the rel-L2 of all parameters' gradients together (a token whose
    top-2 expert choice flips on a tie moves two experts' gradients, which a per-tensor figure would magnify; the
    worst three tensors are listed)."""
    import torch

    from moonrt.models import family
    from moonrt.models.k3.model.config import k3_tiny
    from moonrt.ops.kernels import kernel
    from moonrt.parallel.context import AttentionContext

    dev = torch.device(device)
    torch.manual_seed(0)
    model = family("k3").build(k3_tiny(), None).to(dev)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (batch, seq_len + 1), generator=gen).to(dev)
    inp, tgt = tokens[:, :-1], tokens[:, 1:]
    names, skipped = kda_backends(dev)
    runs: dict[str, tuple[float, dict[str, torch.Tensor]]] = {}
    for name in names:
        model.zero_grad(set_to_none=True)
        loss = model.loss_sum(inp, tgt, ctx=AttentionContext(kda_kernel=name)) / tgt.numel()
        loss.backward()
        runs[name] = (float(loss.detach()), {n: p.grad.detach().clone() for n, p in model.named_parameters()
                                    if p.grad is not None})
    ref_loss, ref_grads = runs["torch"]
    out: dict[str, Any] = {"device": str(dev), "batch": [batch, seq_len], "backends": names, "skipped": skipped,
                           "rel_l2_bound": REL_L2_BOUND, "loss": {n: r[0] for n, r in runs.items()}}
    for name in names[1:]:
        loss, grads = runs[name]
        per = {n: rel_l2(grads[n], g) for n, g in ref_grads.items() if g.norm() > 0}
        flat = torch.cat([grads[n].flatten() for n in ref_grads])
        flat_ref = torch.cat([g.flatten() for g in ref_grads.values()])
        out[f"{name}_vs_torch"] = {
            "rel_l2": {"loss": abs(loss - ref_loss) / abs(ref_loss), "all_grads": rel_l2(flat, flat_ref)},
            "rel_l2_bound": REL_L2_BOUND, "grad_tensors_identical": set(grads) == set(ref_grads),
            "worst_grads": dict(sorted(per.items(), key=lambda kv: -kv[1])[:3])}
    timing = timing_shape or K3_HEAD
    x = _inputs(**timing, device=dev)
    times: dict[str, Any] = {}
    for name in names:
        fn = kernel("kda_chunk", name, dev)
        t0 = time.perf_counter()
        try:
            _fwd_bwd(fn, x, torch.float32)
            _sync(dev)
            first = time.perf_counter() - t0
            times[name] = {"fwd_bwd_s": _timed_cuda(lambda fn=fn: _fwd_bwd(fn, x, torch.float32), dev, repeat=3),
                           "first_call_s": first}
        except Exception as exc:  # noqa: BLE001 - a backend that cannot run this shape is recorded, not fatal
            times[name] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
    out["k3_head_timing"] = {"shape": timing, "dtype": "float32", **times}
    return out
