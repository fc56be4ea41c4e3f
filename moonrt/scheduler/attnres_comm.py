"""Cache-based Block AttnRes pipeline communication plan (K3_SYSTEMS §4, §9). Pure.

Every stage needs all earlier block representations. Stages ``s = 0 .. C-1`` run the contiguous decoder
layer ranges ``layer_ranges[s]``. Block 0 is the token embedding (produced by stage 0); block
``n >= 1`` is completed at the end of decoder layer ``min(n * block_size, L) - 1`` (the last block may
be shorter) and is produced by the stage holding that layer. A forward hop ``s -> s+1`` exists when
the two stages are on different ranks and carries

- ``naive``: every block completed so far;
- ``cached``: only the completed blocks the receiving rank does not hold yet (a rank holds, per
  micro-batch, every block it produced or received earlier, for all of its stages);

plus, not counted as a block, the partial block when the cut falls inside a block. Backward: the
gradient of block ``b`` travels on hop ``s+1 -> s`` exactly when ``b`` is in ``sends[s]``, after the
receiving rank has accumulated it over all its later uses.

Counting convention (per micro-batch, forward hops, aligned case: P ranks, V chunks per rank in loop
placement, C = P V chunks of N_p blocks each): naive total ``N_p C (C-1) / 2 + (C-1)``, largest hop
``(C-1) N_p + 1``; cached total ``N_p P (P-1) / 2 + (P-1) + (V-1) P (P-1) N_p``, largest hop
``(P-1) N_p + 1``. Example P = 4, V = 2, N_p = 2: naive 63 (largest 15), cached 39 (largest 7).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Literal

MODES: tuple[str, ...] = ("cached", "naive")


@dataclasses.dataclass(frozen=True, slots=True)
class HopPlan:
    """Which completed blocks each forward hop carries.

    ``sends[s]``: sorted block ids on hop ``s -> s+1`` (empty when both stages share a rank: nothing
    crosses); ``partial[s]``: the hop also carries the open partial block; ``remote[s]``: the hop
    crosses ranks; ``produced[s]``: block ids completed by stage s; ``held[r]``: every block rank r
    holds at the end of the micro-batch's forward (each held once); ``total`` / ``max_hop``: sum and
    largest of ``len(sends[s])``.
    """

    mode: str
    sends: tuple[tuple[int, ...], ...]
    partial: tuple[bool, ...]
    remote: tuple[bool, ...]
    produced: tuple[tuple[int, ...], ...]
    held: dict[int, frozenset[int]]

    @property
    def total(self) -> int:
        return sum(len(s) for s in self.sends)

    @property
    def max_hop(self) -> int:
        return max((len(s) for s in self.sends), default=0)

    def bytes_per_hop(self, block_bytes: float) -> tuple[float, ...]:
        """Bytes on each hop: carried blocks plus the partial block, each ``block_bytes`` (B*T*D*bytes)."""
        return tuple((len(s) + (1 if p else 0)) * block_bytes if r else 0.0
                     for s, p, r in zip(self.sends, self.partial, self.remote))


def produced_blocks(layer_ranges: Sequence[range], block_size: int) -> tuple[tuple[int, ...], ...]:
    """Block ids completed by each stage (stage 0 also produces block 0, the embedding)."""
    if block_size < 1:
        raise ValueError(f"block_size = {block_size}: expected an integer >= 1")
    if not layer_ranges:
        raise ValueError("layer_ranges: expected at least one stage")
    nxt = 0
    for s, rng in enumerate(layer_ranges):
        if rng.step != 1 or rng.start != nxt or len(rng) < 1:
            raise ValueError(f"layer_ranges[{s}] = {rng}: expected a non-empty contiguous range starting at {nxt}")
        nxt = rng.stop
    n_layers = nxt
    out = []
    for s, rng in enumerate(layer_ranges):
        blocks = [0] if s == 0 else []
        blocks += [lay // block_size + 1 for lay in rng if (lay + 1) % block_size == 0 or lay == n_layers - 1]
        out.append(tuple(blocks))
    return tuple(out)


def hop_plan(layer_ranges: Sequence[range], block_size: int, rank_of: Callable[[int], int],
             mode: Literal["cached", "naive"] = "cached") -> HopPlan:
    """Blocks carried by each forward hop of one micro-batch (see the module docstring).

    ``layer_ranges[s]``: decoder layers of global stage s (contiguous, covering 0 .. L-1);
    ``rank_of(s)``: the pipeline rank running stage s (``Schedule.rank_of``).
    """
    if mode not in MODES:
        raise ValueError(f"mode = {mode!r}: expected one of {', '.join(MODES)}")
    produced = produced_blocks(layer_ranges, block_size)
    n_layers = layer_ranges[-1].stop
    held: dict[int, set[int]] = {}
    done: list[int] = []
    sends, partial, remote = [], [], []
    for s in range(len(layer_ranges)):
        r = rank_of(s)
        held.setdefault(r, set()).update(produced[s])
        done += produced[s]
        if s == len(layer_ranges) - 1:
            break
        dst = rank_of(s + 1)
        cross = dst != r
        last = layer_ranges[s][-1]
        open_block = (last + 1) % block_size != 0 and last != n_layers - 1
        have = held.setdefault(dst, set())
        if not cross:
            carry: tuple[int, ...] = ()
        elif mode == "naive":
            carry = tuple(sorted(done))
        else:
            carry = tuple(sorted(set(done) - have))
        have.update(carry if cross else ())
        sends.append(carry)
        partial.append(cross and open_block)
        remote.append(cross)
    return HopPlan(mode, tuple(sends), tuple(partial), tuple(remote), produced,
                   {r: frozenset(b) for r, b in sorted(held.items())})


def even_layer_ranges(num_layers: int, num_stages: int) -> list[range]:
    """Even contiguous split of ``num_layers`` decoder layers into ``num_stages`` stages."""
    if not 1 <= num_stages <= num_layers:
        raise ValueError(f"stages = {num_stages}: expected 1 <= stages <= num_layers ({num_layers})")
    cuts = [i * num_layers // num_stages for i in range(num_stages + 1)]
    return [range(cuts[i], cuts[i + 1]) for i in range(num_stages)]


__all__ = ["HopPlan", "MODES", "even_layer_ranges", "hop_plan", "produced_blocks"]
