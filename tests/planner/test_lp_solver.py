"""The planner's LP solver and the PuLP calls that PuLP 3 and PuLP 4 both accept."""

import os
import subprocess
import sys

import numpy as np
import pulp
import pytest

from flexoff.commands import main as cli
from flexoff.planner import lp_solver
from flexoff.planner.cost_model import CostModel, PolicyFrame, Workload
from flexoff.planner.hardware import packaged_profile
from flexoff.planner.placement_lp import FrameProblem
from flexoff.models import REGISTRY


class _AffineOfPulp4(pulp.LpAffineExpression):
    """PuLP 4's LpAffineExpression, whose constructor takes neither terms nor a constant."""

    def __init__(self, *args, **kwargs):
        if args or kwargs:
            raise TypeError("LpAffineExpression.__init__() got an unexpected keyword argument 'constant'")
        super().__init__()


def test_the_lp_is_built_without_the_constructor_pulp_4_dropped(monkeypatch):
    monkeypatch.setattr(pulp, "LpAffineExpression", _AffineOfPulp4)
    model = CostModel(REGISTRY["opt-30b"], Workload(512, 32), packaged_profile("t4"))
    fractions, latency = FrameProblem(model, PolicyFrame(16, 5, None, None, True, True)).solve()
    assert latency > 0
    assert sum(fractions[:3]) == pytest.approx(1)


def test_an_affine_term_keeps_its_constant_and_drops_zero_coefficients():
    prob = pulp.LpProblem("affine", pulp.LpMinimize)
    x = [lp_solver.variable(prob, name, 0, 1) for name in "abc"]
    expression = lp_solver.affine(2.5, np.array([1.0, 0.0, -3.0]), x)
    for v, value in zip(x, (0.5, 0.25, 0.125)):
        v.varValue = value
    assert pulp.value(expression) == pytest.approx(2.5 + 0.5 - 0.375)
    assert {v.name for v in expression.keys()} == {"a", "c"}


def test_the_solver_is_highs(monkeypatch):
    chosen = []
    real = lp_solver.solver
    monkeypatch.setattr(lp_solver, "solver", lambda: chosen.append(real()) or chosen[-1])
    model = CostModel(REGISTRY["opt-30b"], Workload(512, 32), packaged_profile("t4"))
    assert FrameProblem(model, PolicyFrame(16, 5, None, None, True, True)).solve() is not None
    assert chosen and all(isinstance(s, pulp.HiGHS) for s in chosen)


class _Unavailable:
    def __init__(self, *args, **kwargs):
        pass

    def available(self):
        return False


def test_a_missing_solver_is_one_line_naming_the_package(monkeypatch, capsys):
    monkeypatch.setattr(pulp, "HiGHS", _Unavailable)
    code = cli.main(["search", "--model", "opt-30b", "--hardware", "t4"])
    out, err = capsys.readouterr()
    assert code == 2
    assert err.strip().splitlines() == [
        "flexoff: error: planning a policy needs the HiGHS LP solver: pip install highspy"]


def test_solving_writes_nothing_to_stdout():
    """HiGHS prints a banner on a process's first solve, even with its output off, and `flexoff run`
    may write its results to stdout: a fresh process, as a first solve is once a process."""
    script = ("import pulp; from flexoff.planner import lp_solver\n"
              "prob = pulp.LpProblem('quiet', pulp.LpMinimize); x = lp_solver.variable(prob, 'x', 1, 2)\n"
              "prob += x; assert lp_solver.solved(prob) and abs(x.value() - 1) < 1e-9; print('solved')\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 0, done.stderr
    assert done.stdout == "solved\n"
