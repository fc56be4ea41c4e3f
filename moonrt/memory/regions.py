"""Region and policy resolution of the activation manager: which region, policy and layer a save made
inside the active modules / named regions belongs to.

Module forward pre/post hooks (registered by :class:`moonrt.memory.manager.ActivationManager`) push and
pop frames; a save reads the innermost :class:`_Frame` instead of matching rules. :class:`RegionsMixin`
is a base of the manager, which sets the state it reads in ``__init__``.
"""

from __future__ import annotations

import fnmatch
import re
import threading
from contextlib import contextmanager
from typing import Any

import torch

from moonrt.memory.policy import MemoryPolicy


def _generalize(path: str) -> str:
    """``layers.3.attn`` -> ``layers.*.attn`` (for listing known regions)."""
    return re.sub(r"(^|\.)\d+(?=\.|$)", r"\1*", path)


def layer_key(path: str) -> str:
    """The layer a module path belongs to: the path up to its first numeric component
    (``layers.3.attn.q`` -> ``layers.3``), else its first component."""
    parts = path.split(".")
    for i, p in enumerate(parts):
        if p.isdigit():
            return ".".join(parts[: i + 1])
    return parts[0]


class _Frame:
    """What a save inside an active module/region resolves to: region name, policy, layer, whether a rule
    decided it (inherited by children) and the layer index (assigned on first use)."""

    __slots__ = ("region", "policy", "layer_name", "decided", "layer")

    def __init__(self, region: str, policy: str, layer_name: str, decided: bool) -> None:
        self.region = region
        self.policy = policy
        self.layer_name = layer_name
        self.decided = decided
        self.layer: int | None = None


class RegionsMixin:
    """Frames per active module/region (``_push`` / ``_pop``, ``region``), rule lookup (``_rule_of``,
    ``resolve``) and the layer index of a frame (``_layer_of``)."""

    policy: MemoryPolicy
    _lock: threading.RLock
    _stack: list[str]
    _frames: list[_Frame]
    _frame_cache: dict[tuple[str, int], _Frame]
    _own_rule: dict[str, str | None]
    _layer_names: dict[str, str]
    _layers: dict[str, int]
    _module_regions: dict[str, str]
    _active: bool
    _hooks_on: bool
    _hook_marks: list[tuple[int, bool]]
    _set_hooks: Any
    _hooks_wanted: Any

    def _rule_of(self, name: str) -> str | None:
        """Policy of the first non-recompute rule matching module/region ``name`` (or its
        ``memory_region``), else None. Cached: names repeat every step."""
        try:
            return self._own_rule[name]
        except KeyError:
            pass
        mod_region = self._module_regions.get(name)
        own = None
        for rule in self.policy.rules:
            if rule.policy != "recompute" and (fnmatch.fnmatchcase(name, rule.match) or (
                    mod_region and fnmatch.fnmatchcase(mod_region, rule.match))):
                own = rule.policy
                break
        self._own_rule[name] = own
        return own

    def _push(self, name: str) -> None:
        self._stack.append(name)
        parent = self._frames[-1]
        key = (name, id(parent))
        frame = self._frame_cache.get(key)
        if frame is None:
            own = self._rule_of(name)
            lk = self._layer_names.get(name)
            if lk is None:
                lk = self._layer_names[name] = layer_key(name)
            if own is not None:
                frame = _Frame(name, own, lk, True)
            elif parent.decided:
                frame = _Frame(parent.region, parent.policy, lk, True)
            else:
                frame = _Frame(name, self.policy.default, lk, False)
            self._frame_cache[key] = frame  # frames are never dropped, so the parent's id stays unique
        self._frames.append(frame)
        if self._active:  # hooks on where the frame's policy needs them (saved_hooks._set_hooks)
            self._hook_marks.append((len(self._frames), self._hooks_on))
            self._set_hooks(self._hooks_wanted(frame.policy))

    def _pop(self) -> None:
        marks = self._hook_marks
        if marks and marks[-1][0] == len(self._frames):  # restore the hooks state of the enclosing frame
            self._set_hooks(marks.pop()[1])
        self._stack.pop()
        self._frames.pop()

    def _enter(self, name: str, mod: torch.nn.Module, args: Any) -> None:
        self._push(name)

    def _exit(self, name: str, mod: torch.nn.Module, args: Any, out: Any) -> None:
        if self._stack and self._stack[-1] == name:
            self._pop()

    @contextmanager
    def region(self, name: str):
        """Mark a named region (for code outside modules, e.g. a pipeline stage executor)."""
        self._push(name)
        try:
            yield
        finally:
            self._pop()

    def resolve(self, stack: list[str] | None = None) -> tuple[str, str]:
        """``(region, policy)`` for a save under module stack ``stack`` (innermost last)."""
        stack = self._stack if stack is None else stack
        for name in reversed(stack):
            mod_region = self._module_regions.get(name)
            for rule in self.policy.rules:
                if rule.policy == "recompute":
                    continue
                hit = fnmatch.fnmatchcase(name, rule.match)
                if hit or (mod_region and fnmatch.fnmatchcase(mod_region, rule.match)):
                    return name, rule.policy
        return (stack[-1] if stack else "<root>"), self.policy.default

    def _layer_of(self, frame: _Frame) -> int:
        layer = frame.layer
        if layer is None:
            with self._lock:
                layer = frame.layer = self._layers.setdefault(frame.layer_name, len(self._layers))
        return layer


__all__ = ["layer_key"]
