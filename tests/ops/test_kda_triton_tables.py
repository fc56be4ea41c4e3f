"""The Triton KDA's chunk tables (``chunk_bos`` / ``chunk_len`` / ``seq_chunk0``) are built once per (sequence lengths,
chunk, device) and reused (issue 47 item 5): on a GPU each build is a host-to-device copy, three per KDA call before.
Counted with ``tests/host_syncs.py`` on CPU tensors under Triton's interpreter; the results stay those of a fresh
build (the second call equals the first bitwise)."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: kernels then run on CPU tensors

import pytest  # noqa: E402
import torch  # noqa: E402
from host_syncs import HostSyncCounter  # noqa: E402

import moonrt.ops.kda.backends.triton as kt  # noqa: E402

pytestmark = pytest.mark.usefixtures("triton_kernels")


def _inputs(B: int, T: int, H: int = 1, K: int = 16, V: int = 16) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(T)
    q = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    return dict(q=q, k=k, v=torch.randn(B, T, H, V, generator=gen),
                g=-5.0 * torch.sigmoid(torch.randn(B, T, H, K, generator=gen)),
                beta=torch.sigmoid(torch.randn(B, T, H, generator=gen)))


def _table_copies(counter: HostSyncCounter) -> int:
    return sum(n for (kind, where), n in counter.counts.items()
               if kind == "h2d" and where.startswith("moonrt/ops/kda/backends/triton.py:"))


def test_chunk_tables_are_built_once_per_shape_and_reused() -> None:
    kt._chunk_tables.cache_clear()
    inputs = _inputs(B=2, T=24)
    with HostSyncCounter() as first:
        o1, _ = kt.kda_chunk(**inputs, chunk_size=16)
    with HostSyncCounter() as second:
        o2, _ = kt.kda_chunk(**inputs, chunk_size=16)
    assert _table_copies(first) == 3, first.counts  # chunk_bos, chunk_len, seq_chunk0
    assert _table_copies(second) == 0, second.counts
    assert torch.equal(o1, o2)
    bos, length, first_chunk = kt._chunk_tables((24, 24), 16, torch.device("cpu"))
    assert bos.tolist() == [0, 16, 24, 40] and length.tolist() == [16, 8, 16, 8] and first_chunk.tolist() == [0, 2, 4]
    with HostSyncCounter() as other:  # another length is another table
        kt.kda_chunk(**_inputs(B=2, T=20), chunk_size=16)
    assert _table_copies(other) == 3, other.counts
