"""Tolerances that follow from the computation, for tests that compare floating-point results.

Two kinds of comparison, never an element-wise ``rtol`` on reduced-precision values (an element that is a
sum of cancelling terms, e.g. one gradient entry, has an arbitrary relative error, and which element is
hit depends on the CPU's summation order: AVX-512 vs AVX2 vs scalar kernels, 1 vs N threads):

- **Mathematical equality** (two algorithms for the same function): run both in float64 and require
  :func:`assert_equal_f64` (normwise relative difference <= ``1e-12``, i.e. ~4500 float64 ulps).
  A real algebra error gives a difference many orders above that; float64 rounding stays far below.
- **Accuracy of a reduced-precision run**: compare it with a float64 reference of the same function
  and bound the *normwise* error, :func:`assert_near_reference`::

      max|got - ref| <= c * eps(got.dtype) * max|ref|

  where ``c`` is an a-priori error-growth constant derived from the computation (:func:`growth`: the
  reduction lengths along the longest chain of dependent ops; each test states its chain). ``max|ref|``
  is the scale that rounding errors are relative to, so entries near zero are not held to a relative
  bound they cannot meet. Where no float64 run exists, two reduced-precision results of the same
  function are each within ``c`` of it, so :func:`assert_same_function` allows ``2 c``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

F64_RTOL = 1e-12


def eps(dtype: torch.dtype) -> float:
    """Unit roundoff scale of ``dtype`` (``torch.finfo(dtype).eps``: 1.19e-7 fp32, 2.2e-16 fp64)."""
    return float(torch.finfo(dtype).eps)


def growth(reductions: Iterable[int], backward: bool = False) -> int:
    """Error-growth constant ``c`` of a chain of well-conditioned ops with these reduction lengths.

    A length-``n`` sum or dot product has relative forward error <= ~``n`` eps (Higham's gamma_n);
    along a chain of O(1)-Lipschitz steps (matmuls of unit-scale weights, RMSNorm, softmax, sigmoid,
    tanh) the errors add. A gradient carries the forward error plus a backward chain of the same
    lengths: twice the constant.
    """
    return (2 if backward else 1) * sum(reductions)


def normwise_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """``max|got - ref| / max|ref|`` computed in float64 (0/0 -> 0): ``got`` and ``ref`` of one shape."""
    if got.shape != ref.shape:
        raise ValueError(f"shapes differ: got {tuple(got.shape)}, reference {tuple(ref.shape)}")
    diff = (got.detach().double() - ref.detach().double()).abs().max().item() if got.numel() else 0.0
    scale = ref.detach().double().abs().max().item() if ref.numel() else 0.0
    if diff == 0.0:
        return 0.0
    return diff / scale if scale > 0 else float("inf")


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b|| / ||b||`` in float64 (also the ratio of RMS values): one number for a whole tensor, so an
    entry that is a sum of cancelling terms cannot dominate it."""
    a64, b64 = a.detach().double(), b.detach().double()
    return float((a64 - b64).norm() / b64.norm().clamp_min(1e-300))


def assert_equal_f64(a: torch.Tensor, b: torch.Tensor, what: str, rtol: float = F64_RTOL) -> None:
    """Two float64 results of mathematically equal computations agree: normwise error <= ``rtol``."""
    if a.dtype != torch.float64 or b.dtype != torch.float64:
        raise TypeError(f"{what}: expected float64 tensors, got {a.dtype} and {b.dtype}")
    err = normwise_err(a, b)
    assert err <= rtol, f"{what}: float64 normwise relative difference {err:.3e} > {rtol:.1e}"


def assert_near_reference(got: torch.Tensor, ref: torch.Tensor, c: float, what: str) -> float:
    """Reduced-precision ``got`` vs float64 ``ref``: ``max|got - ref| <= c * eps(got.dtype) * max|ref|``.

    Returns the measured error in units of ``eps(got.dtype)`` (for reports and stronger assertions).
    """
    if ref.dtype != torch.float64:
        raise TypeError(f"{what}: the reference must be float64, got {ref.dtype}")
    units = normwise_err(got, ref) / eps(got.dtype)
    assert units <= c, f"{what}: normwise error {units:.1f} eps({got.dtype}) > bound {c:.0f} eps"
    return units


def assert_same_function(a: torch.Tensor, b: torch.Tensor, c: float, what: str) -> float:
    """Two reduced-precision results of one exact function (e.g. split vs whole sequence): each is within
    ``c`` eps of it, so ``max|a - b| <= 2 c * eps(b.dtype) * max|b|``. Returns the error in eps units."""
    units = normwise_err(a, b) / eps(b.dtype)
    assert units <= 2 * c, f"{what}: normwise difference {units:.1f} eps({b.dtype}) > bound 2 x {c:.0f} eps"
    return units
