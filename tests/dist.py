"""The one multi-rank test helper: ``dist_run(fn, nprocs, *args)``.

Runs module-level ``fn(rank, world_size, *args)`` on ``nprocs`` gloo ranks (forked from a fork
server that imported torch once; free port; one thread per rank) and returns the results in rank
order. A failing rank fails the test with that rank's traceback; a hang fails it after
``timeout`` seconds with every live rank's stack.
"""

from __future__ import annotations

from typing import Any

import pytest

from moonrt.cluster.local import RankError, run_ranks


def dist_run(fn: Any, nprocs: int, *args: Any, timeout: float = 120.0, **kwargs: Any) -> list[Any]:
    try:
        return run_ranks(fn, nprocs, *args, timeout=timeout, **kwargs)
    except RankError as exc:
        pytest.fail(str(exc), pytrace=False)
