"""The chunk terms of ``moonrt.ops.kda.terms`` computed both ways, for the tests that compare them: the numba path
(no graph) and the torch path (taken when an input requires grad)."""

from __future__ import annotations

from collections.abc import Iterator

import torch

import moonrt.ops.kda.terms as kda_terms


def fused_and_autograd_terms(ch: dict[str, torch.Tensor], *, with_q: bool = True,
                             scale: float = 0.3) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
    """``chunk_terms_with_factors`` on the chunked inputs ``ch`` (q, k, v, g, beta) without and with grad:
    ``(field, numba tensor, torch tensor detached)`` for every field both compute (lists element by element; the
    derived ``WU`` skipped)."""
    q = ch["q"] if with_q else None
    fused = kda_terms.chunk_terms_with_factors(ch["k"], ch["v"], ch["g"], ch["beta"], q=q, scale=scale)
    grad = {n: t.clone().requires_grad_() for n, t in ch.items()}
    ref = kda_terms.chunk_terms_with_factors(grad["k"], grad["v"], grad["g"], grad["beta"],
                                             q=grad["q"] if with_q else None, scale=scale)
    compared = 0
    for part_f, part_r in zip(fused, ref):
        for field in part_f.__dataclass_fields__:
            a, b = getattr(part_f, field), getattr(part_r, field)
            if field == "WU" or (a is None and b is None):
                continue
            for ai, bi in zip(a, b) if isinstance(a, list) else [(a, b)]:
                compared += 1
                yield field, ai, bi.detach()
    assert compared, "chunk_terms_with_factors returned no terms to compare"
