"""The MoonEP slot pool (K3_SYSTEMS §6.3): copies of planned experts' weights, prefetched into slots.

:func:`fetch_slot_weights` is the differentiable prefetch (home expert weights -> slot weights;
backward returns every slot gradient to its home rank), optionally into one :class:`SlotPool`
buffer that every layer's dispatcher shares; :class:`SlotRefill` re-prefetches a layer's copies in
its combine backward, before that layer's expert backward reads them.
"""

from __future__ import annotations

import torch

from moonrt.comm.ep.collectives import Mover, return_weight_grads, send_weights
from moonrt.comm.ep.layout import AnyWeightLayout


class SlotPool:
    """One ``[B, P]`` buffer of prefetched expert weights, shared by every layer's dispatcher (§6.3).

    ``P`` is the number of elements of one expert's weights (all tensors flattened). Slot tensors
    handed out by a prefetch are views of the buffer and stay valid until the next prefetch. The
    buffer is written outside autograd's version tracking; instead each layer's combine backward
    re-prefetches its copies (:class:`SlotRefill`) right before that layer's expert backward reads
    them, and the prefetch backward checks that the pool still holds its layer's copies (``owner``),
    so an overwrite in between is a RuntimeError, never wrong gradients.
    """

    def __init__(self, num_slots: int, numel_per_expert: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        self.buffer = torch.zeros(num_slots, numel_per_expert, dtype=dtype, device=device)
        self.owner: object | None = None
        """Token of the prefetch whose copies the buffer holds now."""


class SlotRefill:
    """Re-prefetch one layer's slot copies into the shared pool (called by that layer's combine backward)."""

    def __init__(self, pool: SlotPool, home: tuple[torch.Tensor, ...], layout: AnyWeightLayout,
                 group: Mover, token: object) -> None:
        self.pool, self.home, self.layout, self.group, self.token = pool, home, layout, group, token

    def __call__(self) -> None:
        n = self.home[0].shape[0]
        flat = torch.cat([w.detach().reshape(n, w[0].numel()) for w in self.home], dim=1)
        send_weights(flat, self.layout, self.group, out=self.pool.buffer.data)
        self.pool.owner = self.token


class _FetchSlots(torch.autograd.Function):
    @staticmethod
    def forward(ctx, layout, group, pool, shapes, dep, *home):
        num_home = home[0].shape[0]
        flat = torch.cat([w.detach().reshape(num_home, w[0].numel()) for w in home], dim=1)
        ctx.pool = pool
        if pool is not None:  # write around version tracking: see SlotPool
            slots = send_weights(flat, layout, group, out=pool.buffer.data)
            ctx.token = pool.owner = object()
        else:
            slots = send_weights(flat, layout, group)
        ctx.layout, ctx.group, ctx.num_home = layout, group, num_home
        ctx.sizes = [w[0].numel() for w in home]
        return tuple(t.view(layout.num_slots, *shape) for t, shape in
                     zip(slots.split(ctx.sizes, dim=1), shapes))

    @staticmethod
    def backward(ctx, *grads):
        if ctx.pool is not None and ctx.pool.owner is not ctx.token:
            raise RuntimeError("MoonEP slot pool was overwritten by another layer's prefetch before this layer's "
                               "expert backward ran: combine must re-prefetch (pass the handle's refill)")
        g = torch.cat([gr.reshape(ctx.layout.num_slots, n) for gr, n in zip(grads, ctx.sizes)], dim=1)
        home = return_weight_grads(g, ctx.num_home, ctx.layout, ctx.group)
        out = [t.reshape(ctx.num_home, *gr.shape[1:]) for t, gr in zip(home.split(ctx.sizes, dim=1), grads)]
        return (None, None, None, None, None, *out)


def fetch_slot_weights(
    home: tuple[torch.Tensor, ...], layout: AnyWeightLayout, group: Mover,
    pool: SlotPool | None = None, dep: torch.Tensor | None = None,
) -> tuple[tuple[torch.Tensor, ...], SlotRefill | None]:
    """Differentiable prefetch: home expert weights (each ``[E/R, *shape]``) -> slot weights ``[B, *shape]``.

    Backward sends each slot's gradient back to its home rank and sums it into the home weight's
    gradient (so slot gradients never appear as parameters). With a shared ``pool`` the slots are
    views of its buffer and the returned :class:`SlotRefill` must run before their backward (pass it
    to :func:`combine_tokens`); without one they are fresh tensors and the refill is None. ``dep``
    (the dispatched rows) orders the backward: the prefetch's collective runs before the dispatch's.
    """
    shapes = tuple(tuple(w.shape[1:]) for w in home)
    slots = _FetchSlots.apply(layout, group, pool, shapes, dep, *home)
    refill = None if pool is None else SlotRefill(pool, tuple(home), layout, group, pool.owner)
    return slots, refill
