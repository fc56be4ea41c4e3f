"""A kernel planted to exceed sm_90's shared memory (:mod:`sm90`'s own test: the checker must report it over the
limit). Its own module so that the compile worker can import it by name, as it imports moonrt's kernel modules.

``planted_dot_kernel`` multiplies a ``[BM, BK]`` by a ``[BK, BN]`` bf16 tile with one ``tl.dot`` (no loop over K):
on sm_90 the tensor-core dot reads both operands from shared memory, ``2 * BK * (BM + BN)`` bytes, so
``BM = BN = 64, BK = 1024`` asks for 256 KiB, over the 227 KiB (232,448 B) a block may use, with a 64 x 64
accumulator that keeps registers and compile time small.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def planted_dot_kernel(a_ptr, b_ptr, c_ptr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    rm = tl.arange(0, BM)
    rn = tl.arange(0, BN)
    rk = tl.arange(0, BK)
    a = tl.load(a_ptr + rm[:, None] * BK + rk[None, :])
    b = tl.load(b_ptr + rk[:, None] * BN + rn[None, :])
    c = tl.dot(a, b)
    tl.store(c_ptr + rm[:, None] * BN + rn[None, :], c)


def planted(bm: int = 64, bk: int = 1024) -> None:
    """Launch :func:`planted_dot_kernel` once with ``BM = BN = bm, BK = bk`` (under :mod:`sm90`: recorded, never
    run)."""
    a = torch.zeros(bm, bk, dtype=torch.bfloat16)
    b = torch.zeros(bk, bm, dtype=torch.bfloat16)
    c = torch.empty(bm, bm)
    planted_dot_kernel[(1,)](a, b, c, BM=bm, BN=bm, BK=bk, num_stages=1)
