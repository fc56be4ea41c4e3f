"""How a job's parallel parts compose, as data: one table of part kinds in order, and what each wraps.

:class:`~moonrt.comm.parallelism.Parallelism` asks its parts in list order and the first part that handles a verb
wins (``forward_backward``, ``sync_grads``, ``clip_grad_norm``, ``step``); hooks that every part sees
(``parallelize``, ``step_metrics``, ``close``) run in the same order, and the checkpoint description
(:meth:`~moonrt.comm.parallelism.Part.describe`) is refined by every part in the reverse order, innermost first.
So the order is the composition, and it is decided here, not by whoever builds the parts: :func:`compose` sorts
the parts a job built by :data:`COMPOSITION` (each part names its row by its class attribute :attr:`Part.kind`)
and gives every part whose row ``wraps`` other kinds the first of them that is present (:meth:`Part.wrap`: the
pipeline's ``inner``, ZeRO's ``ep``). A wrapping part delegates to its inner part what that part shards further
(the gradient-norm contribution) and combines the result over its own dimension.

=========  ================  ===========================================================================
kind       wraps             why here
=========  ================  ===========================================================================
pipeline   zero, expert      runs the step and eval (the first runner wins); its pseudo-query gradient sum
                             returns False and must precede the part that sums the rest; combines the
                             wrapped part's norm and state over the stages
zero       expert            owns the sum, norm, update and state of every parameter, experts included, so
                             it precedes the expert part whose verbs it replaces; asks the expert part
                             which parameters are experts and lets it gather their checkpoint rows
expert     -                 shards experts, installs the dispatchers; sums and clips when no ZeRO part does
trace      -                 records routing counts after the step (a metrics hook only)
=========  ================  ===========================================================================
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from moonrt.comm.parallelism import Part


@dataclasses.dataclass(frozen=True, slots=True)
class Rule:
    """One row of :data:`COMPOSITION`: a part ``kind``, the kinds it ``wraps`` (preference order) and ``why``."""

    kind: str
    wraps: tuple[str, ...]
    why: str


COMPOSITION: tuple[Rule, ...] = (
    Rule("pipeline", ("zero", "expert"), "runs the step; its shared-gradient sum precedes the replica sum; "
         "combines the wrapped part's norm and state over the stages"),
    Rule("zero", ("expert",), "owns sum, norm, update and state of every parameter: before the expert part; "
         "the expert part says which parameters are experts and gathers their rows"),
    Rule("expert", (), "shards experts; sums and clips when no ZeRO part does"),
    Rule("trace", (), "records routing counts after the step"),
)
"""The parts' order, outermost first (see the module docstring's table)."""


def compose(parts: Iterable[Part]) -> list[Part]:
    """``parts`` in :data:`COMPOSITION` order, each wrapping part given its inner part (:meth:`Part.wrap`).

    ValueError naming the kind when a part's :attr:`Part.kind` is not in the table or two parts share one.
    """
    by_kind: dict[str, Part] = {}
    for part in parts:
        if part.kind not in {r.kind for r in COMPOSITION}:
            raise ValueError(f"{type(part).__name__}.kind = {part.kind!r}: expected one of "
                             f"{', '.join(r.kind for r in COMPOSITION)}")
        if part.kind in by_kind:
            raise ValueError(f"{type(part).__name__}.kind = {part.kind!r}: expected one part per kind")
        by_kind[part.kind] = part
    for rule in COMPOSITION:
        inner = next((by_kind[k] for k in rule.wraps if k in by_kind), None)
        if rule.kind in by_kind and inner is not None:
            by_kind[rule.kind].wrap(inner)
    return [by_kind[r.kind] for r in COMPOSITION if r.kind in by_kind]
