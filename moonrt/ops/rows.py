"""Masked row scatter: the copy the symmetric heap's exchanges are made of (issue 48).

``scatter_rows(dst, dst_rows, src, src_rows)`` sets ``dst[dst_rows[i]] = src[src_rows[i]]`` for every ``i`` with
``dst_rows[i] >= 0`` and touches nothing else: one pass over the rows that are sent, read from their place in
``src`` and written to their place in ``dst`` (a peer's receive slot in the heap), with no compacted copy in
between and no host read of which rows those are. That is the verb DeepEP's and Megatron's dispatch kernels are
built around (each token row written once, straight into its slot on the destination), and what lets a device
layout name every row by its destination row without masking on the host.

- CPU (the ``shm`` heap): a numba loop over the rows, on integer-word views of the tensors (any dtype; a copy is
  bitwise),
  without the GIL (a dispatch on the transport's worker thread runs beside the caller's compute). Rows out of range
  (``dst_rows[i] >= len(dst)``, ``src_rows[i]`` outside ``src``) are an ``IndexError`` naming the first, written
  nothing past it.
- CUDA (the ``cuda`` heap): :mod:`moonrt.ops.rows_triton`, one program per (row, column block), the mask in the
  kernel; nothing is read back, so a bad row index is the caller's bug (the layouts that feed it are built by
  :mod:`moonrt.comm.ep.layout` in range by construction).

Returns nothing; ``dst`` is written in place. Both tensors must have the same dtype and row shape; ``dst`` row-major
contiguous (a heap view is).
"""

from __future__ import annotations

import torch
from numba import njit


@njit(cache=True, nogil=True)
def _scatter(dst, dst_rows, src, src_rows):  # pragma: no cover - compiled by numba
    n_dst, n_src = dst.shape[0], src.shape[0]
    for i in range(dst_rows.shape[0]):
        r = dst_rows[i]
        if r < 0:
            continue
        s = src_rows[i] if src_rows.shape[0] else i
        if r >= n_dst or s < 0 or s >= n_src:
            return i
        dst[r, :] = src[s, :]
    return -1


_WORDS = (torch.int64, torch.int32, torch.int16, torch.uint8)


def _words(t: torch.Tensor, word: torch.dtype):
    """``t [n, *row]`` as a ``[n, row bytes / word size]`` numpy view of ``word`` (no copy; ``t`` row-major
    contiguous): the widest integer word the row's bytes divide into, so numba copies 8 bytes at a time."""
    return t.detach().reshape(t.shape[0], -1).view(torch.uint8).view(word).numpy()


def _word(t: torch.Tensor) -> torch.dtype:
    row = t[0].numel() * t.element_size() if t.shape[0] else 1
    return next(w for w in _WORDS if row % w.itemsize == 0)


def _check(dst: torch.Tensor, dst_rows: torch.Tensor, src: torch.Tensor, src_rows: torch.Tensor | None) -> None:
    if dst.dtype != src.dtype or dst.shape[1:] != src.shape[1:]:
        raise ValueError(f"scatter_rows: dst {tuple(dst.shape)} {dst.dtype} and src {tuple(src.shape)} {src.dtype}: "
                         "expected the same dtype and row shape")
    if not dst.is_contiguous():
        raise ValueError("scatter_rows: expected a row-major contiguous dst (a heap view)")
    if dst_rows.dim() != 1 or dst_rows.dtype != torch.int64:
        raise ValueError(f"scatter_rows: dst_rows {tuple(dst_rows.shape)} {dst_rows.dtype}: expected 1-D int64")
    if src_rows is not None and (src_rows.shape != dst_rows.shape or src_rows.dtype != torch.int64):
        raise ValueError(f"scatter_rows: src_rows {tuple(src_rows.shape)} {src_rows.dtype}: expected int64 of "
                         f"dst_rows' shape {tuple(dst_rows.shape)}")
    if src_rows is None and dst_rows.shape[0] != src.shape[0]:
        raise ValueError(f"scatter_rows: {dst_rows.shape[0]} dst_rows for {src.shape[0]} src rows: expected one per "
                         "row (or src_rows)")


def scatter_rows(dst: torch.Tensor, dst_rows: torch.Tensor, src: torch.Tensor,
                 src_rows: torch.Tensor | None = None) -> None:
    """``dst[dst_rows[i]] = src[src_rows[i]]`` (``src_rows`` None: ``src[i]``) where ``dst_rows[i] >= 0`` (module
    docstring)."""
    _check(dst, dst_rows, src, src_rows)
    if dst.device.type == "cuda":
        from moonrt.ops import rows_triton

        rows_triton.scatter_rows(dst, dst_rows, src.contiguous(), src_rows)
        return
    if dst.device.type != "cpu" or src.device.type != "cpu":
        raise ValueError(f"scatter_rows: tensors on {dst.device} / {src.device}: expected cpu or cuda")
    if dst.shape[0] == 0 or dst.numel() == 0:
        return
    empty = dst_rows.new_empty(0)
    word = _word(dst)
    bad = _scatter(_words(dst, word), dst_rows.numpy(), _words(src.contiguous(), word),
                   (empty if src_rows is None else src_rows).numpy())
    if bad >= 0:
        s = int(src_rows[bad]) if src_rows is not None else bad
        raise IndexError(f"scatter_rows: row {bad} goes from src row {s} (of {src.shape[0]}) to dst row "
                         f"{int(dst_rows[bad])} (of {dst.shape[0]}): expected both in range")
