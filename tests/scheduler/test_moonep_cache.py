"""The MoonEP planner's numba kernels plan alike whichever processes wrote their on-disk cache.

numba's cached kernels name the helpers they were compiled with by qualified name, signature and an ABI tag that
counts the functions the compiling process had compiled. The sort and the argsort helper numba generates for
``np.sort`` / ``np.argsort`` share name and signature (``make_quicksort_impl.<locals>.run_quicksort1(int64[:])``),
so two kernels cached by different processes can name different code alike, and a process that loads both links
one to the other's helper (numba issue #10128). Seen here with numba 0.68.1: after a full test run (test workers,
ranks, ``moonrt sim`` writing one ``__pycache__``) the prefix planner's plans differed from its torch twin's, and
two processes whose counters lined up left a cache that segfaulted the next process to plan with both methods. The
planner sorts with its own :func:`moonrt.scheduler.moonep._argsort` instead (a name of its own: every tag of it is
the same code).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from moonrt.scheduler.moonep import _argsort

PLANS = textwrap.dedent("""
    import hashlib, json, sys
    import numpy as np
    from numba import njit
    for _ in range(int(sys.argv[1])):  # compile k throwaway functions first: moves this process's ABI-tag counter
        njit(lambda x: x + 1)(1)
    from moonrt.scheduler import moonep
    counts = np.random.default_rng(7).integers(0, 50, size=(8, 2048)).astype(np.int64)
    counts[:, :256] *= 3  # rank 0's group hot: donors, receivers and slot cuts all in play
    total = int(counts.sum())
    out = {}
    for method in sys.argv[2].split(","):
        for B in (0, 1, 3, 256):
            p = moonep.plan(counts, num_slots=B, total_tokens=total, method=method)
            out[f"{method}/{B}"] = hashlib.sha256(p.alloc.tobytes() + p.copies.tobytes()).hexdigest()
    print(json.dumps(out))
""")


def _plans(cache: Path, k: int, methods: str) -> dict[str, str]:
    """Plan hashes from a new process whose numba cache is ``cache`` (after ``k`` throwaway compiles)."""
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache))
    r = subprocess.run([sys.executable, "-c", PLANS, str(k), methods], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, (k, methods, r.returncode, r.stderr[-2000:])
    return json.loads(r.stdout.splitlines()[-1])


def test_argsort_orders_by_key_then_index() -> None:
    rng = np.random.default_rng(0)
    for n in (0, 1, 2, 3, 7, 64, 257):
        for hi in (2, 5, 10**12):  # many ties, some, none
            keys = rng.integers(-hi, hi, size=n).astype(np.int64)
            np.testing.assert_array_equal(_argsort(keys), np.argsort(keys, kind="stable"), err_msg=f"{n} {hi}")
    assert _argsort(np.zeros(0, np.int64)).shape == (0,)


def test_cached_kernels_link_no_numba_sort_helper(tmp_path: Path) -> None:
    """Every numba kernel of the planner, compiled fresh, defines none of numba's generated sort helpers."""
    script = textwrap.dedent("""
        import json, re
        import numpy as np
        from numba.core.registry import CPUDispatcher
        from moonrt.ops.moonep import greedy
        from moonrt.scheduler import moonep
        SORT_HELPER = re.compile(r"define [^@]*@\\"?(_ZN5numba4misc\\d+(?:quicksort|mergesort)\\w*)")
        counts = np.random.default_rng(1).integers(0, 30, size=(4, 64)).astype(np.int64)
        counts[:, :16] *= 4
        for method in moonep.METHODS:
            for B in (0, 1, 2, 16):
                moonep.plan(counts, num_slots=B, total_tokens=int(counts.sum()), method=method)
        found = {}
        for mod in (greedy, moonep):
            for name, f in vars(mod).items():
                if isinstance(f, CPUDispatcher) and f.__module__ == mod.__name__:
                    llvm = "".join(cres.library.get_llvm_str() for cres in f.overloads.values())
                    found[name] = sorted(set(SORT_HELPER.findall(llvm)))
        print(json.dumps(found))
    """)
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "cache"))  # fresh: compiled here, so inspectable
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    found = json.loads(r.stdout.splitlines()[-1])
    assert {"plan_core", "group_balance", "_prefix_core", "_finish_core", "_argsort"} <= found.keys(), found
    assert not any(found.values()), found


@pytest.mark.slow  # 13 new processes with numba compiles (~25 s on 2 cores)
def test_kernels_cached_by_other_processes_plan_alike(tmp_path: Path) -> None:
    """One process caches the greedy's kernels; processes whose ABI-tag counters start k apart (k = 0..5) each add
    the prefix planner's to a copy of that cache; a process loading both (the greedy first) plans what this one
    plans. Before :func:`moonrt.scheduler.moonep._argsort`, k = 3 segfaulted that process (numba 0.68.1)."""
    ref = _plans(tmp_path / "fresh", 0, "greedy,prefix")
    base = tmp_path / "base"
    assert _plans(base, 0, "greedy") == {k: v for k, v in ref.items() if k.startswith("greedy/")}
    for k in range(6):
        cache = tmp_path / f"k{k}"
        shutil.copytree(base, cache)
        _plans(cache, k, "prefix")
        assert _plans(cache, 0, "greedy,prefix") == ref, k
