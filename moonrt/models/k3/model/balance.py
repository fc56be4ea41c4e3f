"""Quantile Balancing: set the router bias to the quantile that matches the target load (K3_SYSTEMS §5.3).

K3 report §2.3, Eq. 12-14. For a batch of ``m`` tokens routed top-``k`` over ``n`` experts:

1. Top-(k+1) on the biased scores ``s_ij + b_j``; the (k+1)-th value is token i's threshold ``a_i``.
2. Margins ``m_ij = s_ij - a_i``. With the thresholds fixed, expert j would get
   ``#{i : m_ij > -b_j}`` tokens.
3. The target load is ``q = m k / n``; the bias giving exactly ``q`` is minus the (q+1)-th largest
   margin of column j (the ``1 - k/n`` quantile), then the mean over experts is subtracted (a common
   shift changes no top-k). When ``m k / n`` is not an integer we use ``floor(q)``.

Two estimators of that quantile:

- :func:`qb_bias_exact` sorts the margins (ideal, needs all margins in one place);
- :class:`MarginHistogram` keeps a per-expert histogram of margins over fixed bins (the estimator
  used in practice): counts accumulate over micro-batches, ranks sum them with one all-reduce, and
  the quantile is read off the cumulative counts with linear interpolation inside the bin. Its
  estimate lies in the same bin as the exact value, so the two differ by less than one bin width
  (when no margin falls outside ``[lo, hi]``; out-of-range margins are clamped into the edge bins).

Everything here is plain tensor math: no process groups. Callers pass an ``all_reduce`` callable.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from moonrt.ops.precision import at_least_fp32

AllReduce = Callable[[torch.Tensor], torch.Tensor | None]
"""Sums a tensor across data-parallel ranks in place (like ``dist.all_reduce``); may return it."""


def _check_scores(scores: torch.Tensor, bias: torch.Tensor, k: int) -> None:
    if scores.dim() != 2:
        raise ValueError(f"scores: shape {tuple(scores.shape)}, expected [m, n]")
    n = scores.shape[1]
    if bias.shape != (n,):
        raise ValueError(f"bias: shape {tuple(bias.shape)}, expected [n] = [{n}]")
    if not (isinstance(k, int) and 1 <= k and k + 1 <= n):
        raise ValueError(f"k = {k!r}: expected an integer with 1 <= k and k + 1 <= n = {n}")


def target_load(m: int, n: int, k: int) -> int:
    """Target tokens per expert ``floor(m k / n)`` (Eq. 13) for ``m`` tokens, ``n`` experts, top-``k``."""
    return (m * k) // n


def qb_margins(scores: torch.Tensor, bias: torch.Tensor, k: int) -> torch.Tensor:
    """Margins ``m_ij = s_ij - a_i`` (Eq. 12), ``a_i`` = (k+1)-th largest of ``s_i. + bias``.

    Args:
        scores: ``[m, n]`` router scores (sigmoid, any float dtype).
        bias: ``[n]`` the selection bias the routing used.
        k: top-k of the routing.

    Returns:
        ``[m, n]`` margins (no gradient), fp32 (fp64 for fp64 scores). A token's (k+1)-th expert j
        gets margin ``-bias_j`` (up to rounding): the structural tie of each column.
    """
    _check_scores(scores, bias, k)
    dtype = torch.promote_types(scores.dtype, torch.float32)
    with torch.no_grad():
        s = scores.detach().to(dtype)
        biased = s + bias.detach().to(dtype)
        a = torch.topk(biased, k + 1, dim=-1).values[:, -1:]
        return s - a


def qb_bias_from_margins(margins: torch.Tensor, k: int, center: bool = True) -> torch.Tensor:
    """Exact QB bias from margins (Eq. 14): ``b_j = -(q+1)-th largest of m_.j``, minus the mean.

    Args:
        margins: ``[m, n]`` fp32 margins of :func:`qb_margins` (all tokens of the step).
        k: top-k.
        center: subtract the mean over experts (the report's second line of Eq. 14).

    Returns:
        ``[n]`` new bias in the margins' dtype (fp32 from the router). With fixed thresholds and no
        ties at the cut, ``#{i : m_ij > -b_j} = floor(m k / n)`` for every expert before centering.
    """
    if margins.dim() != 2 or margins.shape[0] < 1:
        raise ValueError(f"margins: shape {tuple(margins.shape)}, expected [m, n] with m >= 1")
    m, n = margins.shape
    if not (isinstance(k, int) and 1 <= k and k + 1 <= n):
        raise ValueError(f"k = {k!r}: expected an integer with 1 <= k and k + 1 <= n = {n}")
    q = target_load(m, n, k)
    # (q+1)-th largest == (m-q)-th smallest; q < m always since k < n
    value = torch.kthvalue(margins, m - q, dim=0).values
    bias = -value
    return bias - bias.mean() if center else bias


def qb_bias_exact(scores: torch.Tensor, bias: torch.Tensor, k: int, center: bool = True) -> torch.Tensor:
    """One exact Quantile Balancing update (Eq. 12-14).

    Args:
        scores: ``[m, n]`` router scores of one step (all its tokens).
        bias: ``[n]`` the bias the routing used.
        k: top-k.
        center: subtract the mean of the new bias over experts.

    Returns:
        ``[n]`` new bias, fp32 (fp64 for fp64 scores).
    """
    return qb_bias_from_margins(qb_margins(scores, bias, k), k, center=center)


def expert_loads(scores: torch.Tensor, bias: torch.Tensor, k: int) -> torch.Tensor:
    """Tokens per expert ``[n]`` int64 when routing top-k on ``scores [m, n] + bias [n]``."""
    _check_scores(scores, bias, k)
    ids = torch.topk(at_least_fp32(scores) + at_least_fp32(bias), k, dim=-1).indices
    return torch.bincount(ids.reshape(-1), minlength=scores.shape[1])


def maxvio(counts: torch.Tensor) -> float:
    """``max_e(T_e / mean T) - 1`` over experts (K3_SYSTEMS §6.3) for ``counts [E]``; 0 when perfectly balanced."""
    c = counts.double()
    mean = c.mean()
    return float(torch.where(mean > 0, c.max() / mean - 1.0, 0.0))  # one host read


class MarginHistogram:
    """Per-expert histogram of QB margins, the practical quantile estimator (K3_SYSTEMS §5.3).

    State: ``counts [n, bins]`` int64, bins of width ``(hi - lo) / bins`` covering ``[lo, hi]``;
    margins outside the range are clamped into the edge bins. ``counts`` is a plain summable
    tensor: accumulate any number of micro-batches with :meth:`add`, sum across ranks with
    :meth:`all_reduce`, then read the new bias with :meth:`bias`.
    """

    def __init__(self, num_experts: int, bins: int = 512, lo: float = -1.0, hi: float = 1.0,
                 device: torch.device | str | None = None) -> None:
        if not (isinstance(num_experts, int) and num_experts >= 2):
            raise ValueError(f"num_experts = {num_experts!r}: expected an integer >= 2")
        if not (isinstance(bins, int) and bins >= 1):
            raise ValueError(f"bins = {bins!r}: expected an integer >= 1")
        if not lo < hi:
            raise ValueError(f"range = ({lo!r}, {hi!r}): expected lo < hi")
        self.num_experts, self.bins, self.lo, self.hi = num_experts, bins, float(lo), float(hi)
        self.counts = torch.zeros(num_experts, bins, dtype=torch.int64, device=device)

    @property
    def bin_width(self) -> float:
        return (self.hi - self.lo) / self.bins

    @property
    def num_tokens(self) -> int:
        """Tokens accumulated (every token adds one margin to every expert's histogram)."""
        return int(self.counts[0].sum())

    def reset(self) -> None:
        self.counts.zero_()

    def add(self, margins: torch.Tensor) -> None:
        """Accumulate ``margins [m, n]`` (fp32, from :func:`qb_margins`) into the histogram."""
        if margins.dim() != 2 or margins.shape[1] != self.num_experts:
            raise ValueError(f"margins: shape {tuple(margins.shape)}, expected [m, {self.num_experts}]")
        with torch.no_grad():
            idx = torch.floor((at_least_fp32(margins) - self.lo) / self.bin_width).long().clamp_(0, self.bins - 1)
            flat = idx + torch.arange(self.num_experts, device=idx.device) * self.bins
            hist = torch.bincount(flat.reshape(-1), minlength=self.num_experts * self.bins)
            self.counts += hist.view(self.num_experts, self.bins).to(self.counts.device)

    def all_reduce(self, all_reduce: AllReduce | None) -> None:
        """Sum ``counts`` across ranks with the caller's ``all_reduce`` (no-op for ``None``)."""
        if all_reduce is None:
            return
        out = all_reduce(self.counts)
        if out is not None and out is not self.counts:
            self.counts.copy_(out)

    def quantile_values(self, k: int, num_tokens: int | None = None) -> torch.Tensor:
        """``[n]`` fp32 estimate of each expert's (q+1)-th largest margin, ``q = floor(m k / n)`` (``m``:
        ``num_tokens`` when the caller already read :attr:`num_tokens` on the host, else read here: one host sync).

        Finds the bin that holds the (q+1)-th largest margin from the cumulative counts taken from
        the top bin down, and places it inside that bin by linear interpolation (the r-th largest of
        the bin's ``c`` margins at ``upper - width * (r - 0.5) / c``).
        """
        n = self.num_experts
        if not (isinstance(k, int) and 1 <= k and k + 1 <= n):
            raise ValueError(f"k = {k!r}: expected an integer with 1 <= k and k + 1 <= n = {n}")
        m = self.num_tokens if num_tokens is None else num_tokens
        if m < 1:
            raise ValueError("MarginHistogram: no margins accumulated; call add() first")
        r = target_load(m, n, k) + 1
        c = self.counts.double()
        incl = c.flip(-1).cumsum(-1).flip(-1)  # incl[j, b] = margins of expert j in bins >= b
        b_star = (incl >= r).sum(-1) - 1  # [n], last bin whose suffix still holds >= r margins
        c_b = c.gather(1, b_star[:, None]).squeeze(1)
        above = incl.gather(1, b_star[:, None]).squeeze(1) - c_b
        pos = r - above  # 1 <= pos <= c_b
        upper = self.lo + (b_star.double() + 1) * self.bin_width
        return (upper - self.bin_width * (pos - 0.5) / c_b).float()

    def bias(self, k: int, center: bool = True, num_tokens: int | None = None) -> torch.Tensor:
        """``[n]`` fp32 new bias ``-quantile`` (minus its mean when ``center``), Eq. 14 with the estimator
        (``num_tokens``: :meth:`quantile_values`)."""
        b = -self.quantile_values(k, num_tokens)
        return b - b.mean() if center else b
