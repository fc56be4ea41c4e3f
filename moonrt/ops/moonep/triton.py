"""MoonEP's greedy placement as Triton kernels: the registry's ``triton`` backend of ``moonep_greedy``.

Contract and algorithm: :mod:`moonrt.ops.moonep.greedy` (same tensor out, bit for bit). Two launches per plan, no
host synchronization:

- ``_balance_kernel`` (one program): the group-balance rounds on the ``[R]`` surpluses held in registers; round t
  writes ``quota[h, u]`` once (a receiver's surplus is zero after it receives, so no pair repeats) and the loop ends
  when no surplus is left (at most ``R - 1`` rounds).
- ``_split_kernel`` (one program per home group): the hottest-first split with the group's ``[G]`` remainders, its
  ``[R]`` quotas and its ``[G, R]`` share of ``alloc`` in registers, ending when the group's quotas are spent (at most
  ``R - 1 + G`` steps); then the rest goes home and the block is stored once.

Both loops end whatever the input (each round zeroes a deficit, each step a quota or a remainder, and a loop stops
when no surplus/deficit or quota/remainder is left), so malformed counts give a wrong plan, never a hung GPU.

Every selection is a max/min reduction followed by a min/max over the indices that attain it, which is how the
tie-breaks (smaller rank, larger expert id) are written without relying on a reduction's own tie rule. The kernels
run on CUDA tensors, or on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1`` before triton is first
imported), which is how CI checks them against the numba planner.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moonrt.ops.kernels import on_tensor_device

MAX_BLOCK = 1 << 16
"""Largest ``[G, R]`` register block (both padded to powers of two) one split program holds."""


@triton.jit
def _balance_kernel(bal_ptr, quota_ptr, R, BLOCK_R: tl.constexpr):
    r = tl.arange(0, BLOCK_R)
    live = r < R
    bal = tl.load(bal_ptr + r, mask=live, other=0)  # padding lanes hold 0: never a donor or a receiver below
    mx = tl.max(bal, 0)
    mn = tl.min(bal, 0)
    while (mx > 0) & (mn < 0):  # the surpluses sum to zero: a surplus left means a deficit left
        h = tl.min(tl.where(live & (bal == mx), r, BLOCK_R), 0)  # largest surplus, smaller rank on ties
        u = tl.min(tl.where(live & (bal == mn), r, BLOCK_R), 0)  # largest deficit, smaller rank on ties
        m = -mn
        tl.store(quota_ptr + h * R + u, m)
        bal = tl.where(r == u, 0, bal)
        bal = tl.where(r == h, bal - m, bal)
        mx = tl.max(bal, 0)
        mn = tl.min(bal, 0)


@triton.jit
def _split_kernel(load_ptr, quota_ptr, alloc_ptr, R, G, BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr):
    h = tl.program_id(0)
    u = tl.arange(0, BLOCK_R)
    i = tl.arange(0, BLOCK_G)
    q = tl.load(quota_ptr + h * R + u, mask=u < R, other=0)
    rem = tl.load(load_ptr + h * G + i, mask=i < G, other=0)
    acc = tl.zeros([BLOCK_G, BLOCK_R], dtype=tl.int64)
    mq = tl.max(q, 0)
    mr = tl.max(rem, 0)
    while (mq > 0) & (mr > 0):  # a group never gives more than it holds: quotas run out first
        uu = tl.min(tl.where(q == mq, u, BLOCK_R), 0)  # largest quota, smaller rank on ties
        ee = tl.max(tl.where((rem == mr) & (i < G), i, -1), 0)  # hottest expert, larger id on ties
        m = tl.minimum(mq, mr)
        q = tl.where(u == uu, q - m, q)
        rem = tl.where(i == ee, rem - m, rem)
        acc = tl.where((i[:, None] == ee) & (u[None, :] == uu), acc + m, acc)
        mq = tl.max(q, 0)
        mr = tl.max(rem, 0)
    acc = tl.where(u[None, :] == h, acc + rem[:, None], acc)  # the rest stays home
    offs = (h * G + i[:, None]).to(tl.int64) * R + u[None, :]
    tl.store(alloc_ptr + offs, acc, mask=(i[:, None] < G) & (u[None, :] < R))


@on_tensor_device
def greedy(load: torch.Tensor, cap: torch.Tensor) -> torch.Tensor:
    """``moonep_greedy`` (:mod:`moonrt.ops.moonep.greedy`) in two launches on ``load.device``."""
    R, G = load.shape
    block_r, block_g = triton.next_power_of_2(R), triton.next_power_of_2(G)
    if block_r * block_g > MAX_BLOCK:
        raise ValueError(f"load: shape [R, G] = [{R}, {G}], expected next_pow2(R) * next_pow2(G) <= {MAX_BLOCK} "
                         "for the triton backend of moonep_greedy (one program holds a group's [G, R] share); "
                         "use kernels.moonep: torch")
    load = load.to(torch.int64).contiguous()
    bal = (load.sum(1) - cap).contiguous()
    quota = torch.zeros(R, R, dtype=torch.int64, device=load.device)
    _balance_kernel[(1,)](bal, quota, R, BLOCK_R=block_r)
    alloc3 = torch.empty(R, G, R, dtype=torch.int64, device=load.device)
    _split_kernel[(R,)](load, quota, alloc3, R, G, BLOCK_R=block_r, BLOCK_G=block_g)
    return alloc3
