"""Helpers of the scheduler tests (``from scheduler.helpers import ...``): MoonEP routing-count generators, one per
load shape in ``MODES`` (:func:`make_counts`)."""

from __future__ import annotations

import numpy as np

MODES = ["lognormal", "zipf", "uniform", "one_expert", "empty_home", "one_rank_group", "zeros"]


def make_counts(rng: np.random.Generator, R: int, G: int, mode: str, equal: bool = True) -> np.ndarray:
    """``[R, E]`` int64 counts; rows sum to the same s*k unless ``equal`` is False."""
    E = R * G
    k = int(rng.integers(1, E + 1))
    s = int(rng.integers(0, 40))
    rows = []
    for _ in range(R):
        n = s * k if equal else int(rng.integers(0, 40)) * k
        if mode == "lognormal":
            p = rng.lognormal(0.0, 2.0, E)
        elif mode == "zipf":
            p = 1.0 / np.arange(1, E + 1) ** 1.5
            rng.shuffle(p)
        elif mode == "uniform":
            p = np.ones(E)
        elif mode == "one_expert":  # every assignment on one expert (not a valid top-k; a stress test)
            p = np.zeros(E)
            p[E // 2] = 1.0
        elif mode == "empty_home":  # rank 0's experts are never chosen
            p = rng.random(E) + 0.01
            p[:G] = 0.0 if R > 1 else p[:G]
        elif mode == "one_rank_group":  # all load on the last rank's home group
            p = np.zeros(E)
            p[E - G:] = rng.random(G) + 0.01
        else:  # zeros
            n = 0
            p = np.ones(E)
        rows.append(rng.multinomial(n, p / p.sum()))
    return np.stack(rows).astype(np.int64)
