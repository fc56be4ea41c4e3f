"""Hardware profiles for the MoE layer step-time model of ``moonrt ep-sim --hardware``.

A profile is a YAML file (examples with their sources in ``moonrt/configs/hardware/``)::

    name: h800-ib400                  # required
    description: ...                  # optional text
    sources: [url, ...]               # optional: where the figures come from
    ranks_per_node: 8                 # EP ranks (GPUs) sharing the fast intra-node fabric
    intra_node: {bandwidth_GBps: 160, latency_us: 5}    # per rank, per direction (NVLink)
    inter_node: {bandwidth_GBps: 50, latency_us: 15}    # per rank, per direction (one NIC per GPU)
    gemm_tflops: 640                  # sustained expert GEMM rate per rank (1e12 FLOP/s)
    overlap_prefetch: true            # slot-weight prefetch runs concurrently with token dispatch
    moonep_plan_us: 50                # optional: MoonEP planning time per layer on this hardware;
                                      # absent: the simulation's measured CPU planner time is used
    measured: {...}                   # optional free-form record (cpu-local: how it was measured)

Every field is checked (:func:`load_profile`): unknown names, missing required fields, wrong types,
non-finite numbers, a bandwidth <= 0 or a latency < 0 each raise one ValueError naming the file,
the field, the value and what was expected. ``GB`` is 1e9 bytes.

``cpu-local`` is not a file: :func:`moonrt.jobs.selftest.cli.measure_local_profile` measures it on
the spot (the selftest's all_to_all bandwidth table on local gloo ranks, fitted to latency +
bytes / bandwidth, and a single-thread GEMM micro-benchmark).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moonrt.config import read_yaml

__all__ = ["Link", "HardwareProfile", "load_profile", "profile_from_dict", "builtin_profiles",
           "PROFILE_DIR"]

PROFILE_DIR = Path(__file__).resolve().parent.parent / "configs" / "hardware"
"""Where the documented example profiles live (package data)."""


@dataclass(frozen=True, slots=True)
class Link:
    """One fabric as seen by one rank: ``bandwidth_GBps`` per direction (1e9 B/s), ``latency_us`` per phase."""

    bandwidth_GBps: float
    latency_us: float

    def seconds(self, nbytes: Any) -> Any:
        """Time to move ``nbytes`` (scalar or array) one way: latency (if any bytes) + bytes / bandwidth."""
        import numpy as np

        b = np.asarray(nbytes, dtype=np.float64)
        return np.where(b > 0, self.latency_us * 1e-6 + b / (self.bandwidth_GBps * 1e9), 0.0)


@dataclass(frozen=True, slots=True)
class HardwareProfile:
    """A validated hardware profile (see the module docstring for the fields)."""

    name: str
    ranks_per_node: int
    intra_node: Link
    inter_node: Link
    gemm_tflops: float
    overlap_prefetch: bool = True
    moonep_plan_us: float | None = None
    description: str = ""
    sources: tuple[str, ...] = ()
    measured: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        """Plain dict in the YAML layout (round-trips through :func:`profile_from_dict`)."""
        out: dict[str, Any] = {"name": self.name}
        if self.description:
            out["description"] = self.description
        if self.sources:
            out["sources"] = list(self.sources)
        out["ranks_per_node"] = self.ranks_per_node
        for key in ("intra_node", "inter_node"):
            link = getattr(self, key)
            out[key] = {"bandwidth_GBps": link.bandwidth_GBps, "latency_us": link.latency_us}
        out["gemm_tflops"] = self.gemm_tflops
        out["overlap_prefetch"] = self.overlap_prefetch
        if self.moonep_plan_us is not None:
            out["moonep_plan_us"] = self.moonep_plan_us
        if self.measured:
            out["measured"] = self.measured
        return out


_TOP = {"name", "description", "sources", "ranks_per_node", "intra_node", "inter_node", "gemm_tflops",
        "overlap_prefetch", "moonep_plan_us", "measured"}
_LINK = {"bandwidth_GBps", "latency_us"}
_REQUIRED = ("name", "ranks_per_node", "intra_node", "inter_node", "gemm_tflops")


def _number(where: str, key: str, v: Any, *, positive: bool) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0 or (positive and v == 0):
        want = "a finite number > 0" if positive else "a finite number >= 0"
        raise ValueError(f"{where}: {key} = {v!r}, expected {want}")
    return float(v)


def _link(where: str, key: str, v: Any) -> Link:
    if not isinstance(v, dict):
        raise ValueError(f"{where}: {key} = {v!r}, expected a mapping with {sorted(_LINK)}")
    unknown = sorted(set(v) - _LINK)
    if unknown:
        raise ValueError(f"{where}: unknown field {key}.{unknown[0]}; expected only {sorted(_LINK)}")
    missing = sorted(_LINK - set(v))
    if missing:
        raise ValueError(f"{where}: missing field {key}.{missing[0]}")
    return Link(_number(where, f"{key}.bandwidth_GBps", v["bandwidth_GBps"], positive=True),
                _number(where, f"{key}.latency_us", v["latency_us"], positive=False))


def profile_from_dict(doc: Any, where: str = "hardware profile") -> HardwareProfile:
    """Validate a parsed profile; ``where`` prefixes every error (the file name)."""
    if not isinstance(doc, dict):
        raise ValueError(f"{where}: top level is {type(doc).__name__}, expected a mapping of profile fields")
    unknown = sorted(set(map(str, doc)) - _TOP)
    if unknown:
        raise ValueError(f"{where}: unknown field {unknown[0]!r}; expected fields from {sorted(_TOP)}")
    for key in _REQUIRED:
        if key not in doc:
            raise ValueError(f"{where}: missing required field {key!r}")
    name = doc["name"]
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"{where}: name = {name!r}, expected a non-empty string")
    rpn = doc["ranks_per_node"]
    if isinstance(rpn, bool) or not isinstance(rpn, int) or rpn < 1:
        raise ValueError(f"{where}: ranks_per_node = {rpn!r}, expected an integer >= 1")
    overlap = doc.get("overlap_prefetch", True)
    if not isinstance(overlap, bool):
        raise ValueError(f"{where}: overlap_prefetch = {overlap!r}, expected true or false")
    plan_us = doc.get("moonep_plan_us")
    if plan_us is not None:
        plan_us = _number(where, "moonep_plan_us", plan_us, positive=False)
    desc = doc.get("description", "")
    if not isinstance(desc, str):
        raise ValueError(f"{where}: description = {desc!r}, expected a string")
    sources = doc.get("sources", [])
    if not isinstance(sources, list) or not all(isinstance(s, str) for s in sources):
        raise ValueError(f"{where}: sources = {sources!r}, expected a list of strings")
    measured = doc.get("measured", {})
    if not isinstance(measured, dict):
        raise ValueError(f"{where}: measured = {measured!r}, expected a mapping")
    return HardwareProfile(name=name, ranks_per_node=rpn, intra_node=_link(where, "intra_node", doc["intra_node"]),
                           inter_node=_link(where, "inter_node", doc["inter_node"]),
                           gemm_tflops=_number(where, "gemm_tflops", doc["gemm_tflops"], positive=True),
                           overlap_prefetch=overlap, moonep_plan_us=plan_us, description=desc,
                           sources=tuple(sources), measured=measured)


def load_profile(path: str | Path) -> HardwareProfile:
    """Read and validate a profile YAML file (ValueError: one line naming the file and field)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--hardware: {str(path)!r} is not a file; expected a profile YAML, a built-in name from "
                         f"{sorted(builtin_profiles())} or 'cpu-local'")
    doc = read_yaml(path, "hardware profile")  # ConfigError (a ValueError): bounded size, depth, aliases, nodes
    return profile_from_dict(doc, str(path))


def builtin_profiles() -> dict[str, Path]:
    """Documented example profiles shipped with the package: name (file stem) -> path."""
    return {p.stem: p for p in sorted(PROFILE_DIR.glob("*.yaml"))}

