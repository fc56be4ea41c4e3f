"""The local multi-rank runner reports a rank that raises, dies, or exits early, by rank number."""

from __future__ import annotations

import os
import signal

import pytest
import torch
import torch.distributed as dist

from moonrt.cluster.local import RankError, run_ranks


def _sum_of_ranks(rank: int, world: int) -> float:
    x = torch.tensor([float(rank)])
    dist.all_reduce(x)
    return x.item()


def _misbehave(rank: int, world: int, how: str) -> int:
    if rank == 1:
        if how == "raise":
            raise KeyError("rank one lost its key")
        if how == "exit0":
            os._exit(0)
        if how == "exit3":
            os._exit(3)
        if how == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()  # the others wait in a collective for the rank that is gone
    return rank


def _kernels_at_start(rank: int, world: int) -> tuple[int, int, bool]:
    import numba.np.ufunc.parallel as numba_parallel

    import moonrt.ops.kda.backends.numba as kda_numba

    return (len(kda_numba.tile_operands.signatures), len(kda_numba.assemble_blocks.signatures),
            numba_parallel._is_initialized)


@pytest.mark.slow  # launches ranks that compile and run the KDA kernels: CI runs it, the fast lane need not
def test_ranks_inherit_the_compiled_kda_kernels_and_no_numba_threads():
    """The fork server loaded both numba kernels for fp32 and fp64 (``moonrt.cluster.rank_preload``) without
    starting numba's threading layer, so a rank starts with them compiled and forks no thread pool."""
    assert run_ranks(_kernels_at_start, 2, timeout=60) == [(2, 2, False)] * 2


def test_results_in_rank_order():
    assert run_ranks(_sum_of_ranks, 3, timeout=60) == [3.0, 3.0, 3.0]


@pytest.mark.parametrize(
    ("how", "message"),
    [("raise", r"(?s)rank 1 of 3 failed:\n.*KeyError: 'rank one lost its key'"),
     ("exit0", r"rank 1 of 3 failed: exited early \(exit code 0\) before fn returned"),
     ("exit3", r"rank 1 of 3 failed:\nexit code 3 without a Python traceback"),
     ("sigkill", r"rank 1 of 3 failed:\nkilled by signal SIGKILL without a Python traceback")],
)
def test_failing_rank_is_named(how, message):
    with pytest.raises(RankError, match=message) as info:
        run_ranks(_misbehave, 3, how, timeout=60, collective_timeout_s=30)
    assert info.value.rank == 1


def test_bad_nprocs():
    with pytest.raises(ValueError, match=r"nprocs = 0: expected an integer >= 1"):
        run_ranks(_sum_of_ranks, 0)
