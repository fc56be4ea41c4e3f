"""Step-time model of one MoE layer per placement policy, on a hardware profile.

Inputs per policy and layer-step (:class:`LayerTraffic`, built by the simulation in O(R·E + R²)):
token-expert assignments each source rank sends to each destination ``tokens [R, R]`` (diagonal:
local), rows each rank computes ``rows [R]``, and expert weights moved ``weights [R, R]`` (MoonEP:
the donor home rank sends each copied expert to the rank whose slot holds it, K3_SYSTEMS §6.3;
EPLB: replicas that change rank at a re-plan, sent by a rank that held the expert before).

Model (every phase ends when its slowest rank ends; phases run one after another):

* a *transfer phase* with a byte matrix ``M [R, R]``: rank r's intra-node bytes are
  ``max(sent, received)`` to/from ranks of its node (``ranks_per_node`` consecutive ranks), its
  inter-node bytes likewise; each class costs ``latency + bytes / bandwidth`` (:class:`Link`), the two
  fabrics run concurrently, so ``t_r = max(t_intra, t_inter)`` and the phase takes ``max_r t_r``;
* dispatch: ``tokens x token_bytes``; combine: the transpose (results go back);
* expert GEMM: ``max_r rows_r x flops_per_assignment / gemm rate``, ``flops_per_assignment =
  2 x expert_params`` forward (three ``H x F`` matrices, multiply-add), 3x that for fwd+bwd;
* slot-weight prefetch: ``weights x expert_bytes``; with ``overlap_prefetch`` it runs under the
  dispatch (phase time ``max(dispatch, prefetch)``), else after it;
* MoonEP planning: all-gather of the ``[R, E]`` int32 counts (inter-node when R > ranks_per_node)
  plus the planner (profile ``moonep_plan_us``, else the measured CPU planner time);
  EPLB plans asynchronously off the critical path (not charged; its weight moves are).

Forward: plan + dispatch(+prefetch) + GEMM + combine. Backward (``passes="fwd+bwd"``) adds the
mirrored exchanges (combine's backward moves ``tokens``, dispatch's backward ``tokens.T``), 2x the
GEMM, and for MoonEP the slot re-prefetch and the reduction of slot weight gradients to their home
rank (§6.3), each a weight phase. Not modeled: EPLB's per-step gradient sync of replicas (once per
optimizer step, amortized over micro-batches), per-segment GEMM overheads, link contention beyond
each rank's own ports.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit

from moonrt.scheduler import baselines as bl
from moonrt.scheduler.hardware import HardwareProfile
from moonrt.scheduler.moonep import MoonEPPlan, transfer_matrix

__all__ = ["LayerTraffic", "moonep_traffic", "placement_traffic", "phase_time", "layer_time", "PASSES"]

PASSES = ("fwd", "fwd+bwd")
PHASES = ("plan", "dispatch", "prefetch", "gemm", "combine")


@dataclass(frozen=True)
class LayerTraffic:
    """What one policy moves and computes in one layer-step.

    Attributes:
        tokens: ``[R, R]`` float64 assignments source -> destination (diagonal stays local).
        rows: ``[R]`` float64 assignments computed per rank.
        weights: ``[R, R]`` float64 expert weight copies sender -> receiver in the forward.
        weights_every_pass: True if the weights move again in backward (MoonEP slots, §6.3);
            False for one-off migrations (an EPLB re-plan).
        plan_s: planning time on the critical path (seconds; 0 for none / EPLB).
        gather_counts: True if the ``[R, E]`` counts are all-gathered before planning (MoonEP).
    """

    tokens: np.ndarray
    rows: np.ndarray
    weights: np.ndarray
    weights_every_pass: bool = False
    plan_s: float = 0.0
    gather_counts: bool = False


def moonep_traffic(counts: np.ndarray, pl: MoonEPPlan, plan_s: float) -> LayerTraffic:
    """Traffic of a MoonEP plan: sweep transfer matrix, exact rows, donor -> slot weights. [counts: R, E]"""
    R = pl.num_ranks
    tm = transfer_matrix(counts, pl.cuts).astype(np.float64)
    w = np.zeros((R, R))
    ncp = pl.copies_per_rank()
    has = pl.donor >= 0
    np.add.at(w, (pl.donor[has], np.nonzero(has)[0]), ncp[has])
    return LayerTraffic(tm, pl.alloc.sum(0).astype(np.float64), w, True, plan_s, True)


def placement_traffic(counts: np.ndarray, place: bl.ReplicaTable, prev: bl.ReplicaTable | None = None) -> LayerTraffic:
    """Traffic under a static placement (none / EPLB): each source's assignments to expert e spread
    over e's replicas in proportion to what each replica computes (as :func:`baselines.moved_assignments`);
    ``prev``: the placement before a re-plan (weights of replicas new on a rank move). O(R·(E + P))."""
    c = np.asarray(counts, np.int64)
    R, E = c.shape
    load = c.sum(0)
    share = bl._replica_shares(load, place).astype(np.float64)  # [P]
    e_p = place.replica_expert
    frac = np.divide(share, load[e_p], out=np.zeros_like(share), where=load[e_p] > 0)  # [P]
    tm = _spread(np.ascontiguousarray(c.T), e_p, place.replica_rank, frac)
    rows = bl.rank_loads(load, place).astype(np.float64)
    w = np.zeros((R, R))
    if prev is not None and prev is not place:
        old, new = prev.holds(), place.holds()
        moves = np.maximum(new - old, 0)  # [R, E] replicas of e that arrive on r
        sender = np.argmax(old > 0, axis=0)  # [E] a rank that held e before
        r_idx, e_idx = np.nonzero(moves)
        np.add.at(w, (sender[e_idx], r_idx), moves[r_idx, e_idx])
    return LayerTraffic(tm, rows, w, False, 0.0, False)


@njit(cache=True)
def _spread(cT: np.ndarray, e_p: np.ndarray, rank_p: np.ndarray, frac: np.ndarray) -> np.ndarray:  # pragma: no cover
    """tm[r, rank_p[p]] += counts[r, e_p[p]] * frac[p] over replicas p. cT [E, R] -> [R, R] float64, O(R·P)."""
    R = cT.shape[1]
    tm = np.zeros((R, R))
    for p in range(e_p.shape[0]):
        f = frac[p]
        if f == 0.0:
            continue
        d = rank_p[p]
        row = cT[e_p[p]]
        for r in range(R):
            tm[r, d] += row[r] * f
    return tm


@njit(cache=True)
def _port_bytes(m: np.ndarray, per_node: int) -> tuple[np.ndarray, np.ndarray]:  # pragma: no cover
    """Per rank ``max(sent, received)`` bytes intra- and inter-node for ``m [R, R]`` (diagonal ignored)."""
    R = m.shape[0]
    s_in, r_in, s_out, r_out = np.zeros(R), np.zeros(R), np.zeros(R), np.zeros(R)
    for i in range(R):
        for j in range(R):
            if i == j:
                continue
            v = m[i, j]
            if i // per_node == j // per_node:
                s_in[i] += v
                r_in[j] += v
            else:
                s_out[i] += v
                r_out[j] += v
    return np.maximum(s_in, r_in), np.maximum(s_out, r_out)


def phase_time(nbytes: np.ndarray, hw: HardwareProfile) -> float:
    """Seconds of one transfer phase with byte matrix ``nbytes [R, R]`` (sender, receiver); diagonal ignored."""
    R = nbytes.shape[0]
    if R == 0:
        return 0.0
    intra, inter = _port_bytes(np.ascontiguousarray(nbytes, dtype=np.float64), hw.ranks_per_node)
    return float(np.maximum(hw.intra_node.seconds(intra), hw.inter_node.seconds(inter)).max())


def layer_time(tr: LayerTraffic, hw: HardwareProfile, *, num_experts: int, token_bytes: float, expert_bytes: float,
               expert_params: float, passes: str = "fwd+bwd") -> dict[str, float]:
    """Estimated seconds of one MoE layer for one policy: per phase (``plan``, ``dispatch``,
    ``prefetch``, ``gemm``, ``combine``; backward folded in) and ``total``; ``gemm_max_rank_s`` is the
    slowest rank's forward GEMM alone."""
    if passes not in PASSES:
        raise ValueError(f"passes: {passes!r}, expected one of {PASSES}")
    bwd = passes == "fwd+bwd"
    R = tr.rows.shape[0]
    tok = tr.tokens * token_bytes
    disp, comb = phase_time(tok, hw), phase_time(tok.T, hw)
    pref = phase_time(tr.weights * expert_bytes, hw)
    gemm_fwd = float(tr.rows.max()) * 2.0 * expert_params / (hw.gemm_tflops * 1e12) if R else 0.0
    plan = tr.plan_s if hw.moonep_plan_us is None or not tr.gather_counts else hw.moonep_plan_us * 1e-6
    if tr.gather_counts and R > 1:
        link = hw.inter_node if R > hw.ranks_per_node else hw.intra_node
        plan += float(link.seconds((R - 1) * num_experts * 4.0))
    pref_b = pref if tr.weights_every_pass else 0.0  # MoonEP: re-prefetch, then grad reduce to home
    both = (lambda a, b: max(a, b)) if hw.overlap_prefetch else (lambda a, b: a + b)
    total = plan + both(disp, pref) + gemm_fwd + comb
    if bwd:  # combine's backward moves like dispatch, dispatch's backward like combine
        total += both(disp, pref_b) + 2.0 * gemm_fwd + both(comb, pref_b)
    out = {"plan": plan, "dispatch": disp * (2.0 if bwd else 1.0), "prefetch": pref + (2.0 * pref_b if bwd else 0.0),
           "gemm": gemm_fwd * (3.0 if bwd else 1.0), "combine": comb * (2.0 if bwd else 1.0), "total": total}
    out["gemm_max_rank_s"] = gemm_fwd
    return out
