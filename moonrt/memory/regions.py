"""Region and policy resolution of the activation manager: which region, policy and layer a save made
inside the active modules / named regions belongs to.

Module forward pre/post hooks (registered by :class:`moonrt.memory.manager.ActivationManager`) call
:meth:`Regions.enter` / :meth:`Regions.exit`, which push and pop frames; a save reads the innermost :class:`Frame`
(``regions.frames[-1]``) instead of matching rules. A :class:`RegionWatcher` (the saved-tensor hooks,
:mod:`.saved_hooks`) is told of every push and pop, to put its hooks on or off for the frame's policy.
"""

from __future__ import annotations

import fnmatch
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import torch

from moonrt.memory.policy import MemoryPolicy


def generalize(path: str) -> str:
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


class Frame:
    """What a save inside an active module/region resolves to: region name, policy, layer, whether a rule
    decided it (inherited by children) and the layer index (assigned on first use)."""

    __slots__ = ("region", "policy", "layer_name", "decided", "layer")

    def __init__(self, region: str, policy: str, layer_name: str, decided: bool) -> None:
        self.region = region
        self.policy = policy
        self.layer_name = layer_name
        self.decided = decided
        self.layer: int | None = None


class RegionWatcher(Protocol):
    """Told of every frame pushed (``depth``: the frame count with it) and of every frame about to be popped."""

    def entered(self, depth: int, frame: Frame) -> None: ...

    def leaving(self, depth: int) -> None: ...


class Regions:
    """The stack of active modules / named regions of one manager and the frame each resolves to.

    Args:
        policy: the manager's :class:`MemoryPolicy` (rules by module path / region name, the default policy).
        module_regions: module path -> its ``memory_region`` name, for the modules that declare one.
        lock: the manager's lock (guards the layer numbering, read from the copy / prefetch threads' callers).
    """

    def __init__(self, policy: MemoryPolicy, module_regions: dict[str, str], lock: threading.RLock) -> None:
        self.policy = policy
        self.module_regions = module_regions
        self.lock = lock
        self.stack: list[str] = []
        self.root = Frame("<root>", policy.default, "<root>", False)
        self.frames: list[Frame] = [self.root]
        """Per active module/region: (region, policy, layer name, a rule decided), so a save reads the innermost
        frame instead of matching rules (the resolution changes only on enter/exit)."""
        self.watcher: RegionWatcher | None = None
        self.frame_cache: dict[tuple[str, int], Frame] = {}
        self.own_rule: dict[str, str | None] = {}
        self.layer_names: dict[str, str] = {}
        self.layers: dict[str, int] = {}

    def rule_of(self, name: str) -> str | None:
        """Policy of the first non-recompute rule matching module/region ``name`` (or its
        ``memory_region``), else None. Cached: names repeat every step."""
        try:
            return self.own_rule[name]
        except KeyError:
            pass
        mod_region = self.module_regions.get(name)
        own = None
        for rule in self.policy.rules:
            if rule.policy != "recompute" and (fnmatch.fnmatchcase(name, rule.match) or (
                    mod_region and fnmatch.fnmatchcase(mod_region, rule.match))):
                own = rule.policy
                break
        self.own_rule[name] = own
        return own

    def push(self, name: str) -> None:
        self.stack.append(name)
        parent = self.frames[-1]
        key = (name, id(parent))
        frame = self.frame_cache.get(key)
        if frame is None:
            own = self.rule_of(name)
            lk = self.layer_names.get(name)
            if lk is None:
                lk = self.layer_names[name] = layer_key(name)
            if own is not None:
                frame = Frame(name, own, lk, True)
            elif parent.decided:
                frame = Frame(parent.region, parent.policy, lk, True)
            else:
                frame = Frame(name, self.policy.default, lk, False)
            self.frame_cache[key] = frame  # frames are never dropped, so the parent's id stays unique
        frames = self.frames
        frames.append(frame)
        if self.watcher is not None:
            self.watcher.entered(len(frames), frame)

    def pop(self) -> None:
        if self.watcher is not None:
            self.watcher.leaving(len(self.frames))
        self.stack.pop()
        self.frames.pop()

    def enter(self, name: str, mod: torch.nn.Module, args: Any) -> None:
        """A module's forward pre-hook (``functools.partial(regions.enter, name)``)."""
        self.push(name)

    def exit(self, name: str, mod: torch.nn.Module, args: Any, out: Any) -> None:
        """A module's forward hook (``always_call``): pops the module's frame."""
        if self.stack and self.stack[-1] == name:
            self.pop()

    @contextmanager
    def region(self, name: str) -> Iterator[None]:
        """Mark a named region (for code outside modules, e.g. a pipeline stage executor)."""
        self.push(name)
        try:
            yield
        finally:
            self.pop()

    def resolve(self, stack: list[str] | None = None) -> tuple[str, str]:
        """``(region, policy)`` for a save under module stack ``stack`` (innermost last)."""
        stack = self.stack if stack is None else stack
        for name in reversed(stack):
            mod_region = self.module_regions.get(name)
            for rule in self.policy.rules:
                if rule.policy == "recompute":
                    continue
                hit = fnmatch.fnmatchcase(name, rule.match)
                if hit or (mod_region and fnmatch.fnmatchcase(mod_region, rule.match)):
                    return name, rule.policy
        return (stack[-1] if stack else "<root>"), self.policy.default

    def layer_of(self, frame: Frame) -> int:
        """The layer index of ``frame`` (layers numbered in the order the forward first reaches them)."""
        layer = frame.layer
        if layer is None:
            with self.lock:
                layer = frame.layer = self.layers.setdefault(frame.layer_name, len(self.layers))
        return layer


__all__ = ["Frame", "RegionWatcher", "Regions", "generalize", "layer_key"]
