"""The LP solver the planner runs, and the PuLP calls whose form differs between PuLP 3 and 4.

HiGHS, through the ``highspy`` package (a dependency of flexoff), is the solver on every PuLP:
PuLP 4 bundles none, and CBC ran the searches of ``policies/`` 1.6 times (PuLP 3's bundled
binary) to 3 times (the ``cbcbox`` wheel, 60 times highspy's size) slower (``bench/lp_solvers.py``;
bench/RESULTS.md, "The planner's LP solver"). This module imports nothing of flexoff but its
errors, so that it can be tried on any PuLP alone.
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager

import numpy as np
import pulp

from ..errors import MissingSolverError

SOLVER_PACKAGE = "highspy"
OPTIMAL = 1  # PuLP 3's LpStatusOptimal, PuLP 4's LpSolveStatus.Optimal


def solver() -> pulp.LpSolver:
    """The planner's solver, or MissingSolverError naming the package to install."""
    highs = pulp.HiGHS(msg=False)
    if not highs.available():
        raise MissingSolverError(f"planning a policy needs the HiGHS LP solver: pip install {SOLVER_PACKAGE}")
    return highs


def variable(prob: pulp.LpProblem, name: str, low, high) -> pulp.LpVariable:
    if hasattr(prob, "add_variable"):  # PuLP >= 3.3 attaches variables to their problem
        return prob.add_variable(name, lowBound=low, upBound=high)
    return pulp.LpVariable(name, lowBound=low, upBound=high)


def affine(constant: float, coefficients: np.ndarray, x) -> pulp.LpAffineExpression:
    """``constant + sum(c * x_i)``, the zero coefficients left out. Built by PuLP's operators:
    PuLP 4's LpAffineExpression takes no terms or constant in its constructor."""
    terms = [float(c) * v for v, c in zip(x, coefficients) if c != 0.0]
    return pulp.lpSum(terms) + float(constant)


def solved(prob: pulp.LpProblem) -> bool:
    """Solve ``prob`` with the planner's solver; True where an optimum was found."""
    chosen = solver()
    with _stdout_closed():
        outcome = prob.solve(chosen)
    # PuLP 3 returns the status, PuLP 4 an LpSolveStats that holds it (and has no LpStatus)
    return getattr(outcome, "status", outcome) == OPTIMAL


@contextmanager
def _stdout_closed():
    """HiGHS prints its banner on the process's stdout even with its output off (PuLP turns it off
    only after making the solver), and stdout may be what flexoff writes results to: the solve
    writes to /dev/null instead."""
    try:
        sys.stdout.flush()
        saved = os.dup(1)
    except (AttributeError, OSError, ValueError):  # no stdout to keep clean
        yield
        return
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)
