"""Accounting of tensors saved for backward (K3_SYSTEMS §8): bytes per region and policy, bytes
resident at the peak, bytes per tier, pack/unpack time and how much reload time the prefetcher hid.

The manager feeds it; :meth:`Accounting.summary` is the table a training run prints at the end.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import defaultdict
from typing import Any

from moonrt.memory.backends import TIERS


@dataclasses.dataclass(slots=True)
class RegionStats:
    """Totals of one (region, policy) pair over the recorded steps."""

    count: int = 0
    logical_bytes: int = 0
    """Bytes of the saved tensors as autograd handed them over (after storage dedupe)."""
    stored_bytes: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    """Bytes actually stored, per tier (FP8 payload + scales, or the raw bytes)."""
    deduped: int = 0
    """Saves that reused an already stored storage (views, repeated saves)."""
    live_bytes: int = 0
    """Stored bytes (all tiers) still held now; after a forward: what backward will need."""


class Accounting:
    """Thread-safe counters. ``live``/``peak`` are per tier; ``peak["device"]`` is the resident peak."""

    def __init__(self, lock: Any = None) -> None:
        self._lock = lock if lock is not None else threading.Lock()
        """Guards every counter; the activation manager passes its own (re-entrant) lock so that its
        per-save updates (:meth:`pack_tier_locked` etc., called with the lock held) need one acquisition."""
        self.regions: dict[tuple[str, str], RegionStats] = defaultdict(RegionStats)
        self.live: dict[str, int] = dict.fromkeys(TIERS, 0)
        self.peak: dict[str, int] = dict.fromkeys(TIERS, 0)
        self.pack_s = 0.0
        self.unpack_s = 0.0
        self.fetch_s = 0.0
        """Time spent bringing offloaded bytes back (in the prefetch thread or inline)."""
        self.exposed_s = 0.0
        """Part of the reload time backward waited for (inline fetches + waits on prefetches)."""
        self.prefetched = 0
        self.fetched_inline = 0
        self.parameter_saves = 0
        self.forwards = 0
        """Forwards run under the manager (``with manager:``)."""
        self.keep_forwards = 0
        """Forwards whose ``keep`` saves were accounted (the others ran keep regions without hooks: their
        keep saves are in no row, no live or peak figure)."""

    def reset(self) -> None:
        """Forget totals and peaks (live bytes stay: tensors still saved are still resident)."""
        with self._lock:
            self.regions.clear()
            self.peak = dict(self.live)
            self.pack_s = self.unpack_s = self.fetch_s = self.exposed_s = 0.0
            self.prefetched = self.fetched_inline = self.parameter_saves = 0
            self.forwards = self.keep_forwards = 0

    def on_pack(self, region: str, policy: str, logical: int, tier_bytes: dict[str, int], dt: float) -> None:
        with self._lock:
            st = self.regions[(region, policy)]
            st.count += 1
            st.logical_bytes += logical
            st.live_bytes += sum(tier_bytes.values())
            for tier, n in tier_bytes.items():
                st.stored_bytes[tier] += n
                self.live[tier] += n
                self.peak[tier] = max(self.peak[tier], self.live[tier])
            self.pack_s += dt

    def on_pack_tier(self, region: str, policy: str, tier: str, logical: int, stored: int, dt: float) -> None:
        """:meth:`on_pack` of a record stored in one tier."""
        with self._lock:
            self.pack_tier_locked(region, policy, tier, logical, stored, dt)

    def pack_tier_locked(self, region: str, policy: str, tier: str, logical: int, stored: int, dt: float) -> None:
        """:meth:`on_pack_tier` for a caller that holds the accounting's lock (the manager's per-save path)."""
        st = self.regions[(region, policy)]
        st.count += 1
        st.logical_bytes += logical
        st.live_bytes += stored
        st.stored_bytes[tier] += stored
        live = self.live[tier] = self.live[tier] + stored
        if live > self.peak[tier]:
            self.peak[tier] = live
        self.pack_s += dt

    def dedupe_locked(self, region: str, policy: str) -> None:
        """:meth:`on_dedupe` for a caller that holds the accounting's lock."""
        st = self.regions[(region, policy)]
        st.count += 1
        st.deduped += 1

    def on_release_tier(self, tier: str, stored: int, region: str, policy: str) -> None:
        """:meth:`on_release` of a record stored in one tier."""
        with self._lock:
            self.release_tier_locked(tier, stored, region, policy)

    def release_tier_locked(self, tier: str, stored: int, region: str, policy: str) -> None:
        """:meth:`on_release_tier` for a caller that holds the accounting's lock."""
        st = self.regions.get((region, policy))
        if st is not None:
            st.live_bytes -= stored
        self.live[tier] -= stored

    def on_dedupe(self, region: str, policy: str) -> None:
        with self._lock:
            st = self.regions[(region, policy)]
            st.count += 1
            st.deduped += 1

    def on_release(self, tier_bytes: dict[str, int], region: str | None = None, policy: str | None = None) -> None:
        with self._lock:
            if region is not None and policy is not None and (region, policy) in self.regions:
                self.regions[(region, policy)].live_bytes -= sum(tier_bytes.values())
            for tier, n in tier_bytes.items():
                self.live[tier] -= n

    def on_unpack(self, dt: float) -> None:
        with self._lock:
            self.unpack_s += dt

    def on_fetch(self, dt: float, exposed: float, prefetched: bool) -> None:
        with self._lock:
            self.fetch_s += dt
            self.exposed_s += exposed
            if prefetched:
                self.prefetched += 1
            else:
                self.fetched_inline += 1

    # ---- reports -------------------------------------------------------------------------------
    @property
    def hidden_fraction(self) -> float:
        """Share of the reload time that overlapped backward compute (1.0 when nothing was reloaded)."""
        if self.fetch_s <= 0:
            return 1.0
        return max(0.0, 1.0 - self.exposed_s / self.fetch_s)

    def saved_bytes(self, tier: str | None = None, policy: str | None = None, region: str | None = None) -> int:
        """Stored bytes (all tiers, or one) summed over matching regions/policies."""
        total = 0
        for (reg, pol), st in self.regions.items():
            if (policy is None or pol == policy) and (region is None or reg == region):
                total += sum(st.stored_bytes.values()) if tier is None else st.stored_bytes[tier]
        return total

    def to_dict(self) -> dict:
        return {
            "regions": [
                {"region": reg, "policy": pol, "count": st.count, "deduped": st.deduped,
                 "logical_bytes": st.logical_bytes, "stored_bytes": dict(st.stored_bytes),
                 "live_bytes": st.live_bytes}
                for (reg, pol), st in sorted(self.regions.items())
            ],
            "peak_bytes": dict(self.peak),
            "live_bytes": dict(self.live),
            "pack_s": self.pack_s,
            "unpack_s": self.unpack_s,
            "fetch_s": self.fetch_s,
            "exposed_s": self.exposed_s,
            "hidden_fraction": self.hidden_fraction,
            "prefetched": self.prefetched,
            "fetched_inline": self.fetched_inline,
            "parameter_saves": self.parameter_saves,
            "forwards": self.forwards,
            "keep_forwards": self.keep_forwards,
        }

    def summary(self) -> str:
        """Human-readable table: one row per (region, policy), then peaks per tier and timings."""
        def mib(n: int) -> str:
            return f"{n / 2**20:10.3f}"

        head = f"{'region':<32} {'policy':<11} {'saves':>6} {'dedup':>6} {'logical MiB':>11} " + " ".join(
            f"{t + ' MiB':>11}" for t in TIERS)
        lines = ["activation memory (tensors saved for backward, K3_SYSTEMS §8)", head, "-" * len(head)]
        for (reg, pol), st in sorted(self.regions.items()):
            lines.append(f"{reg[:32]:<32} {pol:<11} {st.count:>6} {st.deduped:>6} {mib(st.logical_bytes):>11} "
                         + " ".join(f"{mib(st.stored_bytes[t]):>11}" for t in TIERS))
        lines.append("-" * len(head))
        lines.append("peak resident per tier (MiB): " + ", ".join(f"{t} {self.peak[t] / 2**20:.3f}" for t in TIERS))
        lines.append(f"pack {self.pack_s * 1e3:.1f} ms, unpack {self.unpack_s * 1e3:.1f} ms, reload "
                     f"{self.fetch_s * 1e3:.1f} ms of which {self.hidden_fraction:.0%} hidden by prefetch "
                     f"({self.prefetched} prefetched, {self.fetched_inline} inline); "
                     f"{self.parameter_saves} parameter saves not stored again")
        if self.keep_forwards < self.forwards:
            lines.append(f"keep saves accounted in {self.keep_forwards} of {self.forwards} forwards (keep regions "
                         "of the others ran without saved-tensor hooks)")
        return "\n".join(lines)


__all__ = ["Accounting", "RegionStats"]
