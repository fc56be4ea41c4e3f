"""Routing workloads for the expert-placement simulation: synthetic generators and recorded traces.

A workload is the per-step, per-layer router counts ``counts [steps, layers, R, E]``:
``counts[t, l, r, e]`` = token-expert assignments that EP rank ``r`` routes to expert ``e`` in MoE
layer ``l`` at step ``t`` (the input of the MoonEP planner, K3_SYSTEMS §6.3).

Trace file format (``.npz``, written by :func:`save_trace`, read by :func:`load_trace` and
``moonrt ep-sim --trace``; ``moonrt train`` records the same format):

* ``counts``: integer array ``[steps, layers, R, E]`` (required; ``[steps, R, E]`` is read as one
  layer). Non-negative. Within one (step, layer), every rank's row sums to ``s_r * k``.
* ``top_k``: integer scalar k (optional; default: inferred as 1 if rows do not share a total).
* ``tokens_per_rank``: integer array ``[steps, layers, R]`` of ``s_r`` (optional). If absent, ranks
  are assumed to route ``counts[t, l, r].sum() / top_k`` tokens each.
* ``layer_ids``: integer array ``[layers]`` of the model's layer indices (optional, informational).
* the model that routed (optional; ``ep-sim`` sizes its MB columns from them, else K3's sizes with a warning):
  ``model`` (string scalar, its preset name), ``hidden`` (the activation width a token carries between EP ranks:
  K3's routed-expert latent width), ``expert_params`` (parameters of one routed expert) and ``bytes_per_elem``
  (2 for bf16, 4 for fp32), integer scalars ``>= 1``. :func:`expert_sizes` derives them from a model config.

Synthetic generators (:func:`synthetic`): expert popularity ``p`` per layer, ``uniform``,
``lognormal`` (``p_e = exp(sigma * N(0, 1))``) or ``zipf`` (``p ∝ 1 / rank^s``), with the hot
experts at random ids; per step each share is multiplied by ``1 + drift * U(-1, 1)`` (``drift``
0.3 = the ±30% per-step fluctuation of K3_SYSTEMS §6.4) and renormalized. Each rank then draws its
``s * k`` assignments from the shares, with no expert receiving more than ``s`` assignments from
one rank (each token picks k distinct experts): shares are water-filled to at most ``1/k`` and any
multinomial overflow is redrawn onto experts with room.
"""

from __future__ import annotations

import contextlib
import math
import os
import tempfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moonrt.config import umask

__all__ = ["SIZE_FIELDS", "Workload", "SyntheticStream", "TraceStream", "synthetic", "save_trace", "load_trace",
           "open_trace", "expert_sizes", "maxvio", "popularity", "sample_counts"]

SIZE_FIELDS = ("hidden", "expert_params", "bytes_per_elem")
"""The optional integer members of a trace that size ``ep-sim``'s MB columns (module docstring)."""


def expert_sizes(cfg: object, dtype: str) -> dict[str, int]:
    """The :data:`SIZE_FIELDS` of a model config with K3's MoE fields (``routed_expert_hidden_size``: the latent
    width crossing EP ranks; ``moe_intermediate_size``; an expert is 3 matrices latent x intermediate) trained in
    ``dtype`` (``"bf16"`` / ``"fp32"``)."""
    latent, inter = int(cfg.routed_expert_hidden_size), int(cfg.moe_intermediate_size)  # type: ignore[attr-defined]
    return {"hidden": latent, "expert_params": 3 * latent * inter, "bytes_per_elem": {"bf16": 2, "fp32": 4}[dtype]}

KINDS = ("uniform", "lognormal", "zipf")


@dataclass(frozen=True)
class Workload:
    """Router counts ``[steps, layers, R, E]`` int64 plus metadata (see the module docstring)."""

    counts: np.ndarray
    top_k: int
    tokens_per_rank: np.ndarray | None
    name: str

    @property
    def shape(self) -> tuple[int, int, int, int]:
        t, l, r, e = self.counts.shape
        return t, l, r, e

    def equal_rank_totals(self) -> bool:
        tot = self.counts.sum(-1)
        return bool((tot == tot[..., :1]).all())

    def steps(self) -> Iterator[tuple[int, int, np.ndarray]]:
        """Yields ``(step, layer, counts [R, E])``."""
        for t in range(self.counts.shape[0]):
            for l in range(self.counts.shape[1]):
                yield t, l, self.counts[t, l]

    layer_steps = steps  # the streaming interface shared with SyntheticStream and TraceStream


def maxvio(load: np.ndarray) -> float:
    """``max_e(T_e / mean_T) - 1`` over experts for ``load [E]`` (K3_SYSTEMS §6.3); 0 for no load."""
    load = np.asarray(load, np.float64)
    mean = load.mean()
    return float(load.max() / mean - 1.0) if mean > 0 else 0.0


def popularity(kind: str, num_experts: int, rng: np.random.Generator, sigma: float = 1.0,
               zipf_s: float = 1.0) -> np.ndarray:
    """``[E]`` float64 expert shares summing to 1, hot experts at random ids."""
    if kind == "uniform":
        p = np.ones(num_experts)
    elif kind == "lognormal":
        p = np.exp(sigma * rng.standard_normal(num_experts))
    elif kind == "zipf":
        p = 1.0 / np.arange(1, num_experts + 1, dtype=np.float64) ** zipf_s
        p = p[rng.permutation(num_experts)]
    else:
        raise ValueError(f"kind: {kind!r}, expected one of {KINDS}")
    return p / p.sum()


def _water_fill(p: np.ndarray, cap: float) -> np.ndarray:
    """Shares with every entry <= cap (excess spread proportionally over the others), sum 1."""
    q = p.copy()
    for _ in range(q.shape[0]):
        over = q > cap + 1e-15
        if not over.any():
            break
        excess = (q[over] - cap).sum()
        q[over] = cap
        room = ~over & (q < cap)
        q[room] += excess * q[room] / q[room].sum()
    return q / q.sum()


def sample_counts(shares: np.ndarray, num_ranks: int, tokens_per_rank: int, top_k: int,
                  rng: np.random.Generator) -> np.ndarray:
    """``[R, E]`` int64 counts: each rank's ``s*k`` assignments drawn from ``shares [E]``, <= s per expert."""
    E = shares.shape[0]
    if top_k > E:
        raise ValueError(f"top_k: {top_k}, expected <= num_experts ({E})")
    s, k = tokens_per_rank, top_k
    q = _water_fill(shares, 1.0 / k)
    c = rng.multinomial(s * k, q, size=num_ranks).astype(np.int64)
    for r in np.nonzero((c > s).any(1))[0]:  # redraw overflow onto experts with room
        while True:
            over = np.maximum(c[r] - s, 0)
            n = int(over.sum())
            if n == 0:
                break
            c[r] -= over
            w = q * (c[r] < s)
            w = w if w.sum() > 0 else (c[r] < s).astype(np.float64)
            c[r] += rng.multinomial(n, w / w.sum())
    return c


@dataclass(frozen=True)
class SyntheticStream:
    """A synthetic workload generated one (step, layer) at a time (memory O(R·E), not O(steps·layers·R·E)).

    Same parameters and the same random stream as :func:`synthetic`: ``layer_steps()`` yields exactly
    the counts of ``synthetic(...).counts[t, l]`` in (step, layer) order. Raises ValueError naming the
    field on construction.
    """

    kind: str = "lognormal"
    num_experts: int = 896
    num_ranks: int = 64
    top_k: int = 16
    tokens_per_rank: int = 4096
    num_steps: int = 16
    num_layers: int = 2
    sigma: float = 1.0
    zipf_s: float = 1.0
    drift: float = 0.3
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind: {self.kind!r}, expected one of {KINDS}")
        for name, v in (("num_experts", self.num_experts), ("num_ranks", self.num_ranks), ("top_k", self.top_k),
                        ("steps", self.num_steps), ("layers", self.num_layers)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"{name}: {v!r}, expected an integer >= 1")
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k: {self.top_k}, expected <= num_experts ({self.num_experts}): "
                             "a token picks k distinct experts")
        if self.tokens_per_rank < 0:
            raise ValueError(f"tokens_per_rank: {self.tokens_per_rank}, expected >= 0")
        if not 0.0 <= self.drift < 1.0:
            raise ValueError(f"drift: {self.drift}, expected 0 <= drift < 1 (relative per-step fluctuation of shares)")
        if not (math.isfinite(self.sigma) and self.sigma >= 0):
            raise ValueError(f"sigma: {self.sigma}, expected a finite lognormal sigma >= 0")
        if not (math.isfinite(self.zipf_s) and self.zipf_s >= 0):
            raise ValueError(f"zipf_s: {self.zipf_s}, expected a finite zipf exponent >= 0")

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """``(steps, layers, R, E)``."""
        return self.num_steps, self.num_layers, self.num_ranks, self.num_experts

    @property
    def name(self) -> str:
        extra = {"lognormal": f"sigma={self.sigma}", "zipf": f"s={self.zipf_s}", "uniform": ""}[self.kind]
        return f"{self.kind}({extra}) drift={self.drift:.0%}" if extra else f"{self.kind} drift={self.drift:.0%}"

    def layer_steps(self) -> Iterator[tuple[int, int, np.ndarray]]:
        """Yields ``(step, layer, counts [R, E] int64)``, generated on demand."""
        rng = np.random.default_rng(self.seed)
        base = [popularity(self.kind, self.num_experts, rng, self.sigma, self.zipf_s) for _ in range(self.num_layers)]
        for t in range(self.num_steps):
            for l in range(self.num_layers):
                p = base[l] * (1.0 + self.drift * rng.uniform(-1.0, 1.0, self.num_experts))
                yield t, l, sample_counts(p / p.sum(), self.num_ranks, self.tokens_per_rank, self.top_k, rng)

    def materialize(self) -> Workload:
        """All counts ``[steps, layers, R, E]`` at once (small workloads, tests)."""
        counts = np.empty(self.shape, np.int64)
        for t, l, c in self.layer_steps():
            counts[t, l] = c
        return Workload(counts, self.top_k, None, self.name)


def synthetic(kind: str = "lognormal", *, num_experts: int = 896, num_ranks: int = 64, top_k: int = 16,
              tokens_per_rank: int = 4096, steps: int = 16, layers: int = 2, sigma: float = 1.0,
              zipf_s: float = 1.0, drift: float = 0.3, seed: int = 0) -> Workload:
    """Generate a synthetic workload (defaults: K3, E=896, k=16, R=64, s=4096; K3_SYSTEMS §1, §6.4).

    Materializes ``[steps, layers, R, E]``; :class:`SyntheticStream` yields the same counts one
    (step, layer) at a time."""
    return SyntheticStream(kind, num_experts, num_ranks, top_k, tokens_per_rank, steps, layers, sigma, zipf_s,
                           drift, seed).materialize()


def save_trace(path: str | Path, counts: np.ndarray, top_k: int, tokens_per_rank: np.ndarray | None = None,
               layer_ids: np.ndarray | None = None, *, model: str | None = None,
               sizes: dict[str, int] | None = None) -> None:
    """Write a trace ``.npz`` (format in the module docstring) to exactly ``path`` (no suffix added), whole: a
    ``mkstemp`` temp file beside it, then renamed over ``path`` (a link at ``path`` is replaced, never written
    through; on failure no temp file is left). Whether ``path`` may be replaced is the caller's decision
    (``moonrt train`` refuses an existing file that is not its own trace before step 1). ``model``: the routing
    model's name; ``sizes``: its :data:`SIZE_FIELDS` (:func:`expert_sizes`)."""
    c = np.asarray(counts)
    if c.ndim != 4:
        raise ValueError(f"counts: shape {c.shape}, expected [steps, layers, R, E]")
    arrays: dict[str, np.ndarray] = {"counts": c, "top_k": np.asarray(int(top_k))}
    if tokens_per_rank is not None:
        arrays["tokens_per_rank"] = np.asarray(tokens_per_rank)
    if layer_ids is not None:
        arrays["layer_ids"] = np.asarray(layer_ids)
    if model is not None:
        arrays["model"] = np.asarray(str(model))
    for key, v in (sizes or {}).items():
        if key not in SIZE_FIELDS or int(v) < 1:
            raise ValueError(f"sizes: {key} = {v!r}; expected integers >= 1 for keys of {SIZE_FIELDS}")
        arrays[key] = np.asarray(int(v))
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez_compressed(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~umask())  # what a plain open() would have made (mkstemp makes 0600)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def load_trace(path: str | Path) -> Workload:
    """Read a trace ``.npz``; validates shape, dtype and signs (ValueError naming the field)."""
    with np.load(path) as z:
        if "counts" not in z.files:
            raise ValueError(f"{path}: no 'counts' array (found {z.files}); expected counts [steps, layers, R, E]")
        c = z["counts"]
        top_k = int(z["top_k"]) if "top_k" in z.files else 1
        tpr = z["tokens_per_rank"] if "tokens_per_rank" in z.files else None
    if c.ndim == 3:
        c = c[:, None]
    if c.ndim != 4 or c.dtype.kind not in "iu":
        raise ValueError(f"{path}: counts has shape {c.shape} dtype {c.dtype}; expected integer [steps, layers, R, E]")
    if c.size and c.min() < 0:
        raise ValueError(f"{path}: counts has negative entries (min {c.min()}); expected assignment counts >= 0")
    if top_k < 1:
        raise ValueError(f"{path}: top_k = {top_k}, expected >= 1")
    if tpr is not None and tpr.shape != c.shape[:3]:
        raise ValueError(f"{path}: tokens_per_rank has shape {tpr.shape}, expected {c.shape[:3]}")
    return Workload(c.astype(np.int64), top_k, None if tpr is None else tpr.astype(np.int64), Path(path).name)


@dataclass(frozen=True)
class TraceStream:
    """A trace ``.npz`` read one (step, layer) at a time from its ``counts`` member (format in the
    module docstring); only the header is read by :func:`open_trace`. Negative entries are reported
    when their (step, layer) is read."""

    path: Path
    shape: tuple[int, int, int, int]
    dtype: np.dtype
    top_k: int
    model: str | None = None
    sizes: tuple[tuple[str, int], ...] = ()  # the recorded SIZE_FIELDS, (name, value)

    @property
    def name(self) -> str:
        return self.path.name

    def layer_steps(self) -> Iterator[tuple[int, int, np.ndarray]]:
        """Yields ``(step, layer, counts [R, E] int64)``."""
        T, L, R, E = self.shape
        nbytes = R * E * self.dtype.itemsize
        with zipfile.ZipFile(self.path) as z, z.open("counts.npy") as f:
            _npy_header(f, self.path)
            for t in range(T):
                for l in range(L):
                    buf = f.read(nbytes)
                    if len(buf) != nbytes:
                        raise ValueError(f"{self.path}: counts ends inside step {t}, layer {l}; expected "
                                         f"{T * L * nbytes} bytes of data for shape {self.shape}")
                    c = np.frombuffer(buf, self.dtype).reshape(R, E).astype(np.int64)
                    if c.size and c.min() < 0:
                        raise ValueError(f"{self.path}: counts[{t}, {l}] has negative entries (min {c.min()}); "
                                         "expected assignment counts >= 0")
                    yield t, l, c


def _npy_header(f, path: Path) -> tuple[tuple[int, ...], bool, np.dtype]:
    """Read the ``.npy`` header of an open member; returns (shape, fortran_order, dtype)."""
    try:
        major, _ = np.lib.format.read_magic(f)
        read = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
        return read(f)
    except ValueError as exc:
        raise ValueError(f"{path}: counts is not a readable .npy array ({exc})") from None


def open_trace(path: str | Path) -> TraceStream:
    """Open a trace ``.npz`` for streaming: checks the file, shape, dtype and ``top_k`` from headers only.

    Raises ValueError naming the path and what was expected (missing file, not an ``.npz``, no
    ``counts`` member, wrong rank or dtype, Fortran order, ``top_k < 1``).
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such trace file; expected a .npz with counts [steps, layers, R, E]")
    if not zipfile.is_zipfile(path):
        raise ValueError(f"{path}: not an .npz archive; expected a trace written by numpy.savez / save_trace")
    try:
        with zipfile.ZipFile(path) as z:
            names = z.namelist()
            if "counts.npy" not in names:
                found = [n.removesuffix(".npy") for n in names]
                raise ValueError(f"{path}: no 'counts' array (found {found}); expected counts [steps, layers, R, E]")
            with z.open("counts.npy") as f:
                shape, fortran, dtype = _npy_header(f, path)
            top_k = 1
            if "top_k.npy" in names:
                with z.open("top_k.npy") as f:
                    top_k = int(np.lib.format.read_array(f, allow_pickle=False))
            model, sizes = None, []
            if "model.npy" in names:
                with z.open("model.npy") as f:
                    m = np.lib.format.read_array(f, allow_pickle=False)
                if m.ndim != 0 or m.dtype.kind != "U":
                    raise ValueError(f"{path}: model is {m.dtype} shape {m.shape}; expected a string scalar")
                model = str(m)
            for key in SIZE_FIELDS:
                if f"{key}.npy" in names:
                    with z.open(f"{key}.npy") as f:
                        v = np.lib.format.read_array(f, allow_pickle=False)
                    if v.ndim != 0 or v.dtype.kind not in "iu" or int(v) < 1:
                        raise ValueError(f"{path}: {key} = {v.tolist()!r}; expected an integer scalar >= 1")
                    sizes.append((key, int(v)))
    except (zipfile.BadZipFile, OSError, EOFError) as exc:
        raise ValueError(f"{path}: unreadable .npz ({exc})") from None
    if len(shape) == 3:
        shape = (shape[0], 1, *shape[1:])
    if len(shape) != 4 or dtype.kind not in "iu":
        raise ValueError(f"{path}: counts has shape {tuple(shape)} dtype {dtype}; "
                         "expected integer [steps, layers, R, E]")
    if fortran:
        raise ValueError(f"{path}: counts is stored in Fortran order; expected C order (numpy.savez of a normal array)")
    if min(shape) < 1:
        raise ValueError(f"{path}: counts has shape {tuple(shape)}; expected every dimension >= 1")
    if top_k < 1:
        raise ValueError(f"{path}: top_k = {top_k}, expected >= 1")
    return TraceStream(path, tuple(int(v) for v in shape), np.dtype(dtype), top_k, model, tuple(sizes))
