"""The masked row scatter the heap's exchanges are made of (:mod:`moonrt.ops.rows`, issue 48):

- ``dst[dst_rows[i]] = src[src_rows[i]]`` where ``dst_rows[i] >= 0``, bitwise, for fp32 / bf16 / fp64 / int8 rows of
  every width (the numba path copies the widest integer word the row divides into), and nothing else in ``dst``
  changes (the rows not sent are not written: that is what the heap's exchanges save);
- an index out of range is one ``IndexError`` naming the row, never a write outside ``dst``;
- the Triton kernel (the CUDA path, run here under Triton's interpreter) writes the same bytes as the numba path.
"""

from __future__ import annotations

import re

import pytest
import torch

from moonrt.ops.rows import scatter_rows

DTYPES = [torch.float32, torch.bfloat16, torch.float64, torch.int8]


def _case(n: int, m: int, width: int, dtype: torch.dtype, with_src: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    src = torch.randn(n, width, generator=g).mul(40).to(dtype)
    dst = torch.randn(m, width, generator=g).mul(40).to(dtype)
    count = n if not with_src else n + 3
    dst_rows = torch.randperm(m, generator=g)[:count] if count <= m else torch.randint(0, m, (count,), generator=g)
    dst_rows = torch.where(torch.rand(count, generator=g) < 0.4, -1, dst_rows)
    src_rows = torch.randint(0, n, (count,), generator=g) if with_src else None
    return dst, dst_rows, src, src_rows


def _reference(dst, dst_rows, src, src_rows):
    want = dst.clone()
    for i, r in enumerate(dst_rows.tolist()):
        if r >= 0:
            want[r] = src[src_rows[i] if src_rows is not None else i]
    return want


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [1, 3, 7, 64, 3584])
@pytest.mark.parametrize("with_src", [False, True])
def test_numba_scatter_writes_exactly_the_rows_sent(dtype: torch.dtype, width: int, with_src: bool) -> None:
    dst, dst_rows, src, src_rows = _case(24, 40, width, dtype, with_src, seed=width)
    want = _reference(dst, dst_rows, src, src_rows)
    scatter_rows(dst, dst_rows, src, src_rows)
    assert torch.equal(dst.view(torch.uint8), want.view(torch.uint8))


def test_rows_not_sent_are_not_touched() -> None:
    """Every destination row the scatter does not name keeps its bytes (a NaN payload too): nothing is written to a
    spare row or masked by overwriting."""
    dst = torch.full((8, 5), float("nan"))
    src = torch.arange(15, dtype=torch.float32).view(3, 5)
    scatter_rows(dst, torch.tensor([6, -1, 1]), src)
    assert torch.equal(dst[6], src[0]) and torch.equal(dst[1], src[2])
    assert torch.isnan(dst[[0, 2, 3, 4, 5, 7]]).all()


@pytest.mark.parametrize("dst_rows,src_rows,where", [
    ([0, 8], None, "row 1 goes from src row 1 (of 2) to dst row 8 (of 8)"),
    ([0, 1], [0, 2], "row 1 goes from src row 2 (of 2) to dst row 1 (of 8)"),
    ([0, 1], [-1, 0], "row 0 goes from src row -1 (of 2) to dst row 0 (of 8)"),
])
def test_an_index_out_of_range_is_one_error_and_no_write_outside(dst_rows, src_rows, where: str) -> None:
    base = torch.zeros(10, 4)
    dst = base[1:9]  # the rows either side of dst are watched
    src = torch.ones(2, 4)
    with pytest.raises(IndexError, match=re.escape(where)):
        scatter_rows(dst, torch.tensor(dst_rows), src, None if src_rows is None else torch.tensor(src_rows))
    assert torch.equal(base[0], torch.zeros(4)) and torch.equal(base[9], torch.zeros(4))


@pytest.mark.parametrize("bad,message", [
    (lambda d, r, s: (d, r, s.double()), "expected the same dtype and row shape"),
    (lambda d, r, s: (d, r.int(), s), "expected 1-D int64"),
    (lambda d, r, s: (d.t(), r, s[:, :3]), "expected a row-major contiguous dst"),
    (lambda d, r, s: (d, r[:1], s), "expected one per row"),
])
def test_bad_arguments_are_one_line(bad, message: str) -> None:
    dst, rows, src = torch.zeros(3, 3), torch.tensor([0, 1, 2]), torch.ones(3, 3)
    with pytest.raises(ValueError, match=message):
        scatter_rows(*bad(dst, rows, src))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_src", [False, True])
def test_the_triton_kernel_writes_what_the_numba_path_writes(triton_kernels, dtype: torch.dtype,
                                                             with_src: bool) -> None:
    rows_triton = triton_kernels.load("moonrt.ops.rows_triton")
    dst, dst_rows, src, src_rows = _case(12, 20, 1100, dtype, with_src, seed=3)  # two column blocks, a ragged one
    dev = triton_kernels.device
    want = dst.clone()
    scatter_rows(want, dst_rows, src, src_rows)
    got = dst.to(dev)
    rows_triton.scatter_rows(got, dst_rows.to(dev), src.to(dev), None if src_rows is None else src_rows.to(dev))
    assert torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8))
