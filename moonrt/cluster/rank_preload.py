"""Imported once by the fork server of :mod:`moonrt.cluster.local` (its ``_PRELOAD``) before any rank is forked.

Loads numba's compiled KDA kernels (:func:`moonrt.ops.kda.backends.numba.load_compiled`), so every rank inherits them instead
of importing numba and loading the cached code itself (~0.4 s per rank that runs KDA, on 2 cores). On a fresh
checkout the fork server compiles them once, where ranks starting together would each compile them. Runs no kernel:
numba's threading layer is never started (forking a parent that started OpenMP or TBB threads can hang the child).
"""

from __future__ import annotations

import moonrt.ops.kda.backends.numba as kda_numba

kda_numba.load_compiled()
