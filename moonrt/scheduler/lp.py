"""LP (MILP) placement oracle for MoonEP: the fewest copied experts that still balance the ranks.

K3_SYSTEMS §6.4: an exact MILP for placement is far too large to solve per micro-batch at E=896,
R=64, but on small instances (E <= 64) it gives reference optima for the greedy of §6.2 and the
trade-off between copies and imbalance. Model (PuLP; HiGHS through highspy, CBC as fallback):

    x[e, r] >= 0 integer   assignments of expert e computed on rank r
    y[e, r] in {0, 1}      rank r holds a copy of foreign expert e (r != home(e))
    minimize   sum y
    subject to sum_r x[e, r] = load[e]                      every assignment computed once
               sum_e x[e, r] = capacity[r]                  exact balance (floor/ceil targets, §6.1)
                  (or <= (1 + eps) * mean in the bounded-imbalance variant)
               x[e, r] <= min(load[e], capacity[r]) * y[e, r]   for r != home(e)
               sum_e y[e, r] <= B                           slots per rank
    optional  one_group: z[h, r] in {0, 1}, y[e, r] <= z[home(e), r], sum_h z[h, r] <= 1
              (the structure the greedy guarantees: a rank's copies come from one home group)

The status is reported honestly: "optimal" only when the solver proved optimality; a
time-limited solve with an incumbent is "feasible" (its objective is an upper bound, ``bound`` the
best proven lower bound where the solver reports one).
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass

import numpy as np
import pulp

from moonrt.scheduler.moonep import capacities, validate_counts

__all__ = ["LPResult", "solve_placement"]


@dataclass(frozen=True)
class LPResult:
    """Outcome of :func:`solve_placement`.

    Attributes:
        status: "optimal" (proved), "feasible" (incumbent, optimality not proved, e.g. time
            limit), "infeasible", or "not_solved" (no solution found in the time limit).
        num_copies: copied experts (sum of y) of the returned solution, or None.
        bound: best proven lower bound on the number of copies (the optimum when "optimal"), or None.
        alloc: ``[E, R]`` int64 assignments per (expert, rank) of the solution, or None.
        copies: per rank, the sorted list of copied expert ids, or None.
        solver: the solver used ("HiGHS" or "PULP_CBC_CMD").
        seconds: wall time of the solve.
        raw_status: the solver's own status (HiGHS model status, e.g. "kTimeLimit"; for CBC the
            PuLP status and solution status).
    """

    status: str
    num_copies: int | None
    bound: float | None
    alloc: np.ndarray | None
    copies: list[list[int]] | None
    solver: str
    seconds: float
    raw_status: str = ""


def _solver(name: str | None, time_limit: float | None) -> pulp.LpSolver:
    available = pulp.listSolvers(onlyAvailable=True)
    order = [name] if name else ["HiGHS", "PULP_CBC_CMD"]
    for n in order:
        if n in available:
            with warnings.catch_warnings():  # PULP_CBC_CMD (bundled CBC) warns about PuLP 4.0
                warnings.simplefilter("ignore", DeprecationWarning)
                return pulp.getSolver(n, msg=False, timeLimit=time_limit)
    raise ValueError(f"solver: {name!r} is not available; available MILP solvers: {available}")


def solve_placement(counts: np.ndarray, num_slots: int | None = None, *, total_tokens: int | None = None,
                    imbalance: float | None = None, one_group: bool = False, time_limit: float | None = 30.0,
                    solver: str | None = None) -> LPResult:
    """Minimize the number of copied experts subject to (exact or bounded) per-rank balance.

    Args:
        counts: ``[R, E]`` integer, assignments of source rank r to expert e (as for ``moonep.plan``).
        num_slots: B, copies per rank at most (default E // R).
        total_tokens: as in ``moonep.plan`` (allows unequal per-rank totals).
        imbalance: None for exact balance (targets floor/ceil of total/R); eps >= 0 for the
            bounded-imbalance variant, every rank computing at most ``floor((1 + eps) * total / R)``.
        one_group: also require each rank's copies to come from one home group (as the greedy does).
        time_limit: seconds for the solver (None: no limit).
        solver: "HiGHS" or "PULP_CBC_CMD"; default HiGHS, CBC if HiGHS is unavailable.

    Returns:
        :class:`LPResult` (status reported as the solver proved it).
    """
    arr, B, total = validate_counts(counts, num_slots, total_tokens)
    if imbalance is not None and not imbalance >= 0:
        raise ValueError(f"imbalance: {imbalance!r}, expected eps >= 0 (max/mean <= 1 + eps) or None for exact")
    if time_limit is not None and not time_limit > 0:
        raise ValueError(f"time_limit: {time_limit!r}, expected seconds > 0 or None")
    R, E = arr.shape
    G = E // R
    load = arr.sum(0)
    cap = capacities(total, R)
    home = np.arange(E) // G
    experts = [e for e in range(E) if load[e] > 0]

    prob = pulp.LpProblem("moonep_placement", pulp.LpMinimize)
    var = prob.add_variable if hasattr(prob, "add_variable") else pulp.LpVariable  # PuLP >= 3.3 / older
    x = {(e, r): var(f"x_{e}_{r}", 0, int(load[e]), cat="Integer") for e in experts for r in range(R)}
    y = {(e, r): var(f"y_{e}_{r}", 0, 1, cat="Binary") for e in experts for r in range(R) if home[e] != r}
    prob += pulp.lpSum(y.values()) if y else pulp.LpAffineExpression(0)
    for e in experts:
        prob += pulp.lpSum(x[e, r] for r in range(R)) == int(load[e]), f"load_{e}"
    upper = int(np.floor((1.0 + imbalance) * total / R)) if imbalance is not None else None
    for r in range(R):
        row = pulp.lpSum(x[e, r] for e in experts)
        if upper is None:
            prob += row == int(cap[r]), f"cap_{r}"
        else:
            prob += row <= max(upper, int(cap[r])), f"cap_{r}"
        prob += pulp.lpSum(y[e, r] for e in experts if home[e] != r) <= B, f"slots_{r}"
    for (e, r), yv in y.items():
        room = max(upper, int(cap[r])) if upper is not None else int(cap[r])
        prob += x[e, r] <= int(min(load[e], room)) * yv, f"link_{e}_{r}"
    if one_group:
        z = {(h, r): var(f"z_{h}_{r}", 0, 1, cat="Binary") for h in range(R) for r in range(R) if h != r}
        for (e, r), yv in y.items():
            prob += yv <= z[int(home[e]), r], f"group_{e}_{r}"
        for r in range(R):
            prob += pulp.lpSum(z[h, r] for h in range(R) if h != r) <= 1, f"onegroup_{r}"

    slv = _solver(solver, time_limit)
    t0 = time.perf_counter()
    prob.solve(slv)
    seconds = time.perf_counter() - t0
    sol = prob.sol_status
    status = {pulp.LpSolutionOptimal: "optimal", pulp.LpSolutionIntegerFeasible: "feasible",
              pulp.LpSolutionInfeasible: "infeasible"}.get(sol, "not_solved")
    bound: float | None = None
    raw = f"{pulp.LpStatus[prob.status]}/{pulp.LpSolution[sol]}"
    if slv.name == "HiGHS" and hasattr(prob, "solverModel"):
        raw = str(prob.solverModel.getModelStatus()).split(".")[-1]
        if status == "optimal" and raw != "kOptimal":  # PuLP maps limits with an incumbent to "optimal"
            status = "feasible"
    if status in ("optimal", "feasible"):
        alloc = np.zeros((E, R), np.int64)
        for (e, r), v in x.items():
            alloc[e, r] = int(round(v.varValue or 0.0))
        copies = [sorted(int(e) for e in range(E) if home[e] != r and alloc[e, r] > 0) for r in range(R)]
        n = sum(len(c) for c in copies)
        if status == "optimal":
            bound = float(n)
        elif slv.name == "HiGHS" and hasattr(prob, "solverModel"):
            try:
                bound = float(prob.solverModel.getInfo().mip_dual_bound)
            except Exception:  # noqa: BLE001 - the bound is informational only
                bound = None
        return LPResult(status, n, bound, alloc, copies, slv.name, seconds, raw)
    return LPResult(status, None, None, None, None, slv.name, seconds, raw)
