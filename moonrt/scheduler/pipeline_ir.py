"""The pipeline schedule IR: per-rank ordered action lists (K3_SYSTEMS §9, §10).

An :class:`Action` is one unit of work of one rank on one micro-batch through one of the rank's local
model chunks. Compute ops:

- ``F``: forward of (stage, micro-batch);
- ``B``: full backward (input and weight gradients);
- ``I`` / ``W``: the two halves of ``B`` for zero-bubble schedules (input-grad backward, then later the
  weight-grad backward of the same (stage, micro-batch)); ``B == I + W`` fused.

Communication ops (inserted by :func:`moonrt.scheduler.pipeline_sim.lower`): ``RECV_F`` / ``SEND_F`` move
a stage's activations to the next stage, ``RECV_B`` / ``SEND_B`` the input gradient to the previous one.
``SEND_*`` is non-blocking (isend); ``RECV_*`` blocks until the matching send has been issued.

Stages: with ``pp`` ranks and ``vpp`` chunks per rank the model is cut into ``pp * vpp`` stages. Loop
placement (Megatron's interleaved, the default): chunk ``c`` of rank ``r`` is stage ``c * pp + r``. V
placement (ZB-V): even chunks run forward across the ranks, odd chunks back, so stage ``c * pp + j``
is on rank ``j`` for even ``c`` and on rank ``pp - 1 - j`` for odd ``c`` (rank 0 holds the first and
the last stage). Always go through :meth:`Schedule.stage` and :meth:`Schedule.rank_of`.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

Op = Literal["F", "B", "I", "W", "SEND_F", "RECV_F", "SEND_B", "RECV_B"]
COMPUTE_OPS: tuple[str, ...] = ("F", "B", "I", "W")
COMM_OPS: tuple[str, ...] = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
OPS: tuple[str, ...] = COMPUTE_OPS + COMM_OPS
PLACEMENTS: tuple[str, ...] = ("loop", "v")


@dataclasses.dataclass(frozen=True, slots=True)
class Action:
    """One unit of pipeline work: ``op`` of ``microbatch`` through the rank's local ``chunk``."""

    op: Op
    microbatch: int
    chunk: int = 0

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"op = {self.op!r}: expected one of {', '.join(OPS)}")

    def label(self, with_chunk: bool = True) -> str:
        """Short text form: ``F3`` (chunk 0 of a one-chunk rank) or ``F3.1`` (micro-batch 3, chunk 1)."""
        return f"{self.op}{self.microbatch}" + (f".{self.chunk}" if with_chunk else "")

    def __str__(self) -> str:
        return self.label()


@dataclasses.dataclass(frozen=True, slots=True)
class Schedule:
    """Per-rank action lists of one pipeline schedule (``actions[r]`` is rank r's order).

    ``placement`` is "loop" (chunk c of rank r = stage c * pp + r) or "v" (see the module docstring).
    """

    kind: str
    pp: int
    vpp: int
    microbatches: int
    actions: tuple[tuple[Action, ...], ...]
    placement: str = "loop"

    def __post_init__(self) -> None:
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement = {self.placement!r}: expected one of {', '.join(PLACEMENTS)}")
        if len(self.actions) != self.pp:
            raise ValueError(f"actions: {len(self.actions)} rank lists, expected pp = {self.pp}")

    @property
    def num_stages(self) -> int:
        """Number of global stages (``pp * vpp``)."""
        return self.pp * self.vpp

    def stage(self, rank: int, chunk: int) -> int:
        """Global stage index of ``chunk`` on ``rank``."""
        if not (0 <= rank < self.pp and 0 <= chunk < self.vpp):
            raise ValueError(f"(rank, chunk) = ({rank}, {chunk}): expected rank < {self.pp}, chunk < {self.vpp}")
        if self.placement == "v" and chunk % 2:
            return chunk * self.pp + self.pp - 1 - rank
        return chunk * self.pp + rank

    def rank_of(self, stage: int) -> int:
        """Pipeline rank that runs global ``stage``."""
        if not 0 <= stage < self.num_stages:
            raise ValueError(f"stage = {stage}: expected 0 <= stage < {self.num_stages}")
        chunk, pos = divmod(stage, self.pp)
        return self.pp - 1 - pos if self.placement == "v" and chunk % 2 else pos

    def chunk_of(self, stage: int) -> int:
        """Local chunk index of global ``stage`` on :meth:`rank_of` (stage)."""
        if not 0 <= stage < self.num_stages:
            raise ValueError(f"stage = {stage}: expected 0 <= stage < {self.num_stages}")
        return stage // self.pp

    @property
    def lowered(self) -> bool:
        """True when the action lists contain communication actions."""
        return any(a.op in COMM_OPS for acts in self.actions for a in acts)

    def compute_only(self) -> Schedule:
        """The same schedule without communication actions."""
        return dataclasses.replace(
            self, actions=tuple(tuple(a for a in acts if a.op in COMPUTE_OPS) for acts in self.actions))

    def labels(self, rank: int) -> list[str]:
        """Text form of ``rank``'s actions (chunk shown only when ``vpp > 1``)."""
        return [a.label(self.vpp > 1) for a in self.actions[rank]]


__all__ = ["Action", "COMM_OPS", "COMPUTE_OPS", "OPS", "Op", "PLACEMENTS", "Schedule"]
