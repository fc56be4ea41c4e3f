"""Memory policy: which storage policy each saved tensor gets (K3_SYSTEMS §8, "annotations, not model code").

The YAML a training run loads (``moonrt train --memory-policy FILE``) and ``moonrt mem-plan``
writes. Rules map glob patterns over module paths (``layers.*.attn``) or region names
(a module's optional ``memory_region`` attribute, or :meth:`ActivationManager.region`) to a
policy. For a saved tensor the innermost active module with a matching rule decides; among
rules, the first listed wins; otherwise ``default`` applies::

    default: fp8+host
    rules:
      - {match: "layers.*.attn_res", policy: recompute}
      - {match: "layers.*.ffn.experts", policy: fp8}
      - {match: "embed", policy: keep}
    moe_dispatch_only: ["layers.*.moe"]      # checkpoint LatentMoE.routed: save the dispatch input only
    attnres_checkpoint: ["layers.*.attn_res"]

Quantizing policies: ``fp8`` (1x128 E4M3 tiles with fp32 scales, batched per layer) and ``mxfp8`` (OCP MXFP8:
E4M3 with one E8M0 scale per 32 elements along the last axis, QAT's activation format; a tensor whose last axis is
not a multiple of 32 is kept as it is), each alone (device) or ``+host`` (``fp8`` also ``+disk``, ``+remote``).

``recompute`` rules and the two options wrap the matching modules in non-reentrant checkpointing
(only their inputs are saved; the forward is replayed in backward). A rule on a parent module
spans all layers inside it. ``moe_dispatch_only`` on a module with a ``routed(z, topk_ids,
topk_weights)`` method (LatentMoE) checkpoints only that method: the dispatch input is saved and
dispatch, experts and combine are replayed; router, projections and shared experts follow the
rules (a ``recompute`` rule on the same module checkpoints it whole instead).
"""

from __future__ import annotations

import dataclasses
import os

from moonrt.config import ConfigError, check
from moonrt.memory.backends import POLICIES


@dataclasses.dataclass(kw_only=True, slots=True)
class PolicyRule:
    """One rule: module paths / region names matching the glob ``match`` get ``policy``."""

    match: str
    policy: str

    def validate(self) -> None:
        check(bool(self.match), "match", self.match, "a non-empty glob pattern")
        check(self.policy in POLICIES, "policy", self.policy, "one of " + ", ".join(POLICIES))


@dataclasses.dataclass(kw_only=True, slots=True)
class MemoryPolicy:
    """How the activation manager stores saved tensors (K3_SYSTEMS §8)."""

    default: str = "keep"
    """Policy of tensors no rule matches."""
    rules: list[PolicyRule] = dataclasses.field(default_factory=list)
    moe_dispatch_only: list[str] = dataclasses.field(default_factory=list)
    """MoE module patterns whose routed path (``routed`` method) is checkpointed so that only the
    dispatch input is saved (modules without ``routed`` are checkpointed whole)."""
    attnres_checkpoint: list[str] = dataclasses.field(default_factory=list)
    """Module patterns of the AttnRes math, checkpointed; block representations stay resident."""
    fp8_block: int = 128
    prefetch: bool = True
    """Bring offloaded tensors back one layer ahead of their use in backward."""
    min_bytes: int = 0
    """Saved tensors smaller than this are kept as they are (not worth a copy)."""
    disk_path: str = ""
    """Directory of the disk tier (created if missing; empty: the system temp directory). Each process
    creates its own new unnamed file there (``O_TMPFILE`` / ``O_EXCL``), freed when it closes or exits
    in any way; an existing file given here is refused, never overwritten."""
    disk_capacity_mib: int = 4096
    """Size of each process's disk-tier file, allocated when the manager starts (``posix_fallocate``): a filesystem
    without that much free space is refused at once (``disk tier: no space left on DIR: need X bytes, free Y
    bytes``), never a crash later."""
    remote_timeout_s: float = 60.0

    def validate(self) -> None:
        check(self.default in POLICIES and self.default != "recompute", "default", self.default,
              "a storage policy: one of " + ", ".join(p for p in POLICIES if p != "recompute"))
        check(self.fp8_block >= 1, "fp8_block", self.fp8_block, "an integer >= 1")
        check(self.min_bytes >= 0, "min_bytes", self.min_bytes, "an integer >= 0")
        check(self.disk_capacity_mib >= 1, "disk_capacity_mib", self.disk_capacity_mib, "an integer >= 1")
        check(not (self.disk_path and os.path.exists(self.disk_path) and not os.path.isdir(self.disk_path)),
              "disk_path", self.disk_path, "a directory (each process creates its own offload file in it); "
              "this is an existing file and is never overwritten")
        check(self.remote_timeout_s > 0, "remote_timeout_s", self.remote_timeout_s, "a positive number")
        for i, r in enumerate(self.rules):
            try:
                r.validate()
            except ConfigError as exc:
                raise ConfigError(f"rules[{i}].{exc}") from None

    def policies_used(self) -> set[str]:
        return {self.default} | {r.policy for r in self.rules}

    def tiers_used(self) -> set[str]:
        """The storage tiers the policies end in (``fp8+host`` -> ``host``): which stores a manager needs."""
        return {p.split("+")[-1] for p in self.policies_used()}


__all__ = ["MemoryPolicy", "PolicyRule"]
