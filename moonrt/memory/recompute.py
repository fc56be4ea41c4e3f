"""Recompute of the activation manager (K3_SYSTEMS §8): wrappers that run modules / methods under
non-reentrant ``torch.utils.checkpoint`` and the identity anchor through which a checkpointed region's
inputs are saved (policy ``keep``, label ``recompute``, so they are accounted and deduplicated).

:class:`Recompute` wraps (and unwraps) modules and methods for one manager, which decides what to wrap; it marks
the wrapped calls as regions of the manager's :class:`~moonrt.memory.regions.Regions` and saves the anchors'
inputs through its :class:`~moonrt.memory.saved_hooks.SavedTensorHooks` (:meth:`SavedTensorHooks.anchored`).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from moonrt.memory.regions import Regions
from moonrt.memory.saved_hooks import SavedTensorHooks


class _Anchor(torch.autograd.Function):
    """Identity whose backward is identity; it saves its inputs so the manager sees (and accounts)
    the inputs a checkpointed region keeps."""

    @staticmethod
    def forward(ctx: Any, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.save_for_backward(*xs)
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return grads


class Recompute:
    """Checkpoint wrappers (:meth:`wrap_method`, :meth:`wrap_routed`, :meth:`wrap_checkpoint`), function-level
    :meth:`checkpoint` and :meth:`anchor`; :meth:`unwrap` takes every wrapper off again.

    Args:
        regions: the manager's regions (wrapped calls are marked as regions there).
        hooks: the manager's saved-tensor hooks (the anchors save through them).
    """

    def __init__(self, regions: Regions, hooks: SavedTensorHooks) -> None:
        self.regions = regions
        self.hooks = hooks
        self.wrapped: list[torch.nn.Module] = []
        self.wrapped_methods: list[tuple[torch.nn.Module, str]] = []

    def wrap_method(self, mod: torch.nn.Module, meth: str, region: str, recompute: bool) -> None:
        """Mark calls of ``mod.meth`` as region ``region``; with ``recompute`` run them checkpointed.

        Checkpointed calls get shallow copies of dataclass arguments (list fields copied), so a state
        object the caller mutates later (e.g. the AttnRes stream) is replayed as it was.
        """
        inner = getattr(mod, meth)

        def tagged(*args: Any, **kwargs: Any) -> Any:
            with self.regions.region(region):
                return inner(*args, **kwargs)

        def call(*args: Any, **kwargs: Any) -> Any:
            if not (recompute and torch.is_grad_enabled()):
                return tagged(*args, **kwargs)
            frozen = []
            for a in args:
                if dataclasses.is_dataclass(a) and not isinstance(a, type):
                    a = copy.copy(a)
                    for f in dataclasses.fields(a):
                        v = getattr(a, f.name)
                        if isinstance(v, list):
                            setattr(a, f.name, list(v))
                frozen.append(a)
            return checkpoint(tagged, *self.anchor(frozen), use_reentrant=False, **kwargs)

        setattr(mod, meth, call)
        self.wrapped_methods.append((mod, meth))

    def wrap_routed(self, mod: torch.nn.Module, region: str) -> None:
        """``moe_dispatch_only`` on a module with a ``routed(z, topk_ids, topk_weights)`` method (the
        LatentMoE routed path): checkpoint that method, so its saved inputs are exactly the dispatch
        input ``z [N, L]``, ``topk_ids [N, k]``, ``topk_weights [N, k]`` (accounted in region
        ``region``, label ``recompute``) and backward replays dispatch, experts and combine (K3_SYSTEMS
        §8). Router, down-projection, shared experts and norm/up-projection run outside it and save
        under their own policies; the router is not replayed, so routing is counted once."""
        inner = mod.routed

        def tagged(*args: Any, **kwargs: Any) -> Any:
            with self.regions.region(region):
                return inner(*args, **kwargs)

        def routed(*args: Any, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return tagged(*args, **kwargs)
            with self.regions.region(region):
                anchored = self.anchor(args, floating_only=False)
            return checkpoint(tagged, *anchored, use_reentrant=False, **kwargs)

        mod.routed = routed
        self.wrapped_methods.append((mod, "routed"))

    def wrap_checkpoint(self, mod: torch.nn.Module) -> None:
        inner = mod.forward
        recorders = [m for m in mod.modules() if isinstance(getattr(m, "record_routing", None), bool)]

        def forward(*args: Any, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return inner(*args, **kwargs)
            calls = [0]

            def run(*a: Any, **kw: Any) -> Any:
                calls[0] += 1
                if calls[0] == 1:
                    return inner(*a, **kw)
                # the replay in backward: MoE layers must not count their routing twice
                saved = [m.record_routing for m in recorders]
                for m in recorders:
                    m.record_routing = False
                try:
                    return inner(*a, **kw)
                finally:
                    for m, v in zip(recorders, saved):
                        m.record_routing = v

            return checkpoint(run, *self.anchor(args), use_reentrant=False, **kwargs)

        mod.forward = forward
        self.wrapped.append(mod)

    def checkpoint(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Function-level recompute (non-reentrant); may span several layers."""
        if torch.is_grad_enabled():
            args = self.anchor(args)
        return checkpoint(fn, *args, use_reentrant=False, **kwargs)

    def anchor(self, args: Any, floating_only: bool = True) -> list[Any]:
        """Pass the floating (or, with ``floating_only=False``, all) tensor arguments of a recompute
        region through :class:`_Anchor`, so the inputs the checkpoint keeps are saved (policy label
        ``recompute``, stored as ``keep``)."""
        args = list(args)
        idx = [i for i, a in enumerate(args)
               if isinstance(a, torch.Tensor) and (a.is_floating_point() or not floating_only)]
        if idx:
            with self.hooks.anchored():  # the anchor's saves are accounted in every forward, keep regions included
                anchored = _Anchor.apply(*[args[i] for i in idx])
            for i, t in zip(idx, anchored):
                args[i] = t
        return args

    def unwrap(self) -> None:
        """Give every wrapped module its own ``forward`` and every wrapped method back."""
        for mod in self.wrapped:
            del mod.forward
        self.wrapped.clear()
        for mod, meth in self.wrapped_methods:
            delattr(mod, meth)
        self.wrapped_methods.clear()


__all__ = ["Recompute"]
