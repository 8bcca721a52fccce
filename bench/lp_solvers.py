"""Seconds each LP solver takes on the searches of ``policies/`` (``planner.reference``).

    python bench/lp_solvers.py [--repeat 3]

Solvers: HiGHS through highspy (the planner's), CBC from the ``cbcbox`` wheel (PuLP's ``cbc``
extra), and the CBC that PuLP 3 bundles; those not installed are skipped. Each search runs
``--repeat`` times per solver, the solvers interleaved, and the fastest time is kept. Also
checks that every solver finds the same policy, up to the LP's ties (the reference test's sliver).
"""

from __future__ import annotations

import argparse
import time
import warnings

import pulp

from flexoff.planner import lp_solver
from flexoff.planner.reference import REFERENCE_SEARCHES, run_reference_search


def _cbcbox():
    try:
        import cbcbox
    except ImportError:
        return None
    return pulp.COIN_CMD(path=cbcbox.cbc_bin_path(), msg=False)


def _bundled_cbc():
    cbc = getattr(pulp, "PULP_CBC_CMD", None)  # gone in PuLP 4
    return cbc(msg=False) if cbc is not None and cbc().available() else None


SOLVERS = {"HiGHS (highspy)": lambda: pulp.HiGHS(msg=False) if pulp.HiGHS().available() else None,
           "CBC (cbcbox)": _cbcbox, "CBC (bundled with PuLP 3)": _bundled_cbc}


def _placements(result) -> list[float]:
    policy = result.policy
    return [*policy.weights.as_tuple(), *policy.cache.as_tuple(), *policy.activations.as_tuple()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    solvers = {name: make() for name, make in SOLVERS.items()}
    solvers = {name: made for name, made in solvers.items() if made is not None}
    print(f"PuLP {pulp.__version__}; solvers: {', '.join(solvers)}")
    totals = dict.fromkeys(solvers, 0.0)
    print("| search | LPs | " + " | ".join(f"{name} (s)" for name in solvers) + " | same policy |")
    print("| --- | --- | " + " | ".join("---" for _ in solvers) + " | --- |")
    for spec in REFERENCE_SEARCHES:
        best, found = dict.fromkeys(solvers, float("inf")), {}
        for _ in range(args.repeat):
            for name, made in solvers.items():
                lp_solver.solver = lambda made=made: made
                started = time.perf_counter()
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", DeprecationWarning)  # PuLP 3.3's bundled CBC
                    found[name] = run_reference_search(spec)
                best[name] = min(best[name], time.perf_counter() - started)
        for name in solvers:
            totals[name] += best[name]
        first = next(iter(found.values()))
        same = all(r.policy.gpu_batch_size == first.policy.gpu_batch_size
                   and r.policy.num_gpu_batches == first.policy.num_gpu_batches
                   and max(abs(a - b) for a, b in zip(_placements(r), _placements(first))) <= 0.01
                   for r in found.values())
        print(f"| {spec.filename} | {first.lps_solved} | " + " | ".join(f"{best[n]:.2f}" for n in solvers)
              + f" | {'yes' if same else 'NO'} |")
    print("| all | | " + " | ".join(f"{totals[n]:.2f}" for n in solvers) + " | |")


if __name__ == "__main__":
    main()
