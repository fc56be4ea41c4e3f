"""The CUDA half of :func:`moonrt.ops.rows.scatter_rows`: one Triton program per (row, column block).

Program ``(i, c)`` loads ``dst_rows[i]`` (and ``src_rows[i]``) and, when the destination row is >= 0, copies columns
``[c * BLOCK, (c + 1) * BLOCK)`` of that source row to that destination row; the mask is the kernel's, nothing is
read back to the host. ``dst`` may be a peer's buffer of a symmetric heap (a device pointer like any other). Runs on
CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``), which is how CI checks it against the numba path,
and is compiled for sm_90 by ``benchmarks/gpu/sm90.py`` (shape ``rows``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moonrt.ops.kernels import on_tensor_device

BLOCK = 1024
"""Elements per program: 4 KiB of fp32 (a K3 latent row of 3584 fp32 is 4 programs)."""


@triton.jit
def _scatter_rows_kernel(dst_ptr, dst_rows_ptr, src_ptr, src_rows_ptr, width, HAS_SRC_ROWS: tl.constexpr,
                         BLOCK: tl.constexpr):
    i = tl.program_id(0)
    c = tl.program_id(1)
    r = tl.load(dst_rows_ptr + i)
    if HAS_SRC_ROWS:
        s = tl.load(src_rows_ptr + i)
    else:
        s = i.to(tl.int64)
    cols = c * BLOCK + tl.arange(0, BLOCK)
    mask = (cols < width) & (r >= 0)
    v = tl.load(src_ptr + s * width + cols, mask=mask)
    tl.store(dst_ptr + r * width + cols, v, mask=mask)


@on_tensor_device
def scatter_rows(dst: torch.Tensor, dst_rows: torch.Tensor, src: torch.Tensor,
                 src_rows: torch.Tensor | None = None) -> None:
    """:func:`moonrt.ops.rows.scatter_rows` on the device (arguments checked there; ``src`` contiguous)."""
    n = dst_rows.shape[0]
    width = dst[0].numel() if dst.shape[0] else 0
    if n == 0 or width == 0:
        return
    grid = (n, triton.cdiv(width, BLOCK))
    _scatter_rows_kernel[grid](dst, dst_rows, src, dst_rows if src_rows is None else src_rows, width,
                               HAS_SRC_ROWS=src_rows is not None, BLOCK=BLOCK)
