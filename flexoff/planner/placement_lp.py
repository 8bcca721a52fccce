"""One frame's placement LP: the cost model's terms read off at whole-tier placements, the LP over
the nine fractions, and its answer realised in whole rows of a GPU batch.

For a fixed PolicyFrame every time and memory term of the cost model is affine in the placement
fractions, so the best placement is an LP, as in FlexGen's Eq. (1); a few terms are affine only once
the cache's split is fixed, and are read again at it (``FrameProblem.terms_for``).
"""

from __future__ import annotations

import math

import numpy as np
import pulp

from .cost_model import PHASES, STREAM_TERMS, CostModel, Placement, PolicyFrame
from .lp_solver import affine, solved, variable
from ..policy import TIERS

FRACTION_NAMES = Placement._fields
# The LP keeps this share of each tier free so that rounding the fractions cannot overflow it.
LP_MEMORY_MARGIN = 1e-3


def _basis_points() -> Placement:
    """Placements to evaluate: the origin, the nine unit vectors, then the 27 pure vertices."""
    rows = [np.zeros(9)] + list(np.eye(9))
    for w in range(3):
        for c in range(3):
            for h in range(3):
                v = np.zeros(9)
                v[w] = v[3 + c] = v[6 + h] = 1.0
                rows.append(v)
    points = np.array(rows)
    return Placement(*points.T)


_POINTS = _basis_points()
VERTICES = slice(10, None)


def row_splits(triple, rows: int) -> list[tuple[float, float, float]]:
    """Tier triples that whole rows of a GPU batch realise next to ``triple``: the gpu and the disk
    row counts each rounded down and up, the cpu taking the rest."""
    gpu, disk = rows * triple[0], rows * triple[2]
    splits = set()
    for g in {math.floor(gpu + 1e-6), math.ceil(gpu - 1e-6)}:
        for d in {math.floor(disk + 1e-6), math.ceil(disk - 1e-6)}:
            if g + d <= rows:
                splits.add((g / rows, (rows - g - d) / rows, d / rows))
    return sorted(splits)


ROW_SPLIT = (3, 6)  # the first fraction of the cache's and of the activations' triples
CACHE_FIRST = ROW_SPLIT[0]


def _unsplit_cache(split: tuple[float, float, float]) -> list[tuple[float, float, float]]:
    """Without CPU attention, a batch with cache rows both on the GPU and off it attends in two
    passes a layer (its GPU rows in place, the others in the workspace), each with its own slot
    write, dequantization and attention: more host time than either whole side takes
    (``bench/split_cache_host.py``), a cost no affine term holds. Such a split is realised as
    either whole side: its GPU rows moved to the CPU, or every row on the GPU."""
    gpu, cpu, disk = split
    if 0 < gpu < 1:
        return [(0.0, cpu + gpu, disk), (1.0, 0.0, 0.0)]
    return [split]


class FrameProblem:
    """One frame's affine terms, read off the cost model, and the LP over its placement."""

    def __init__(self, model: CostModel, frame: PolicyFrame):
        self.model, self.frame = model, frame
        self.lps_solved = 0
        # phase -> list of affine terms whose max (or sum, without overlap) is the phase's seconds
        self.time_terms = self._time_terms(_POINTS)
        self._at_cache: dict[tuple, dict] = {}
        self.memory = {key: _full(v) for key, v in model.memory_terms(frame, _POINTS).items()}
        self.capacity = model.capacities()

    # ---- cheap necessary conditions and bounds, from the 27 vertices

    def may_fit(self) -> bool:
        for (tier, _phase), values in self.memory.items():
            if values[VERTICES].min() > self.capacity[tier]:
                return False
        total_capacity = sum(self.capacity.values())
        for phase in PHASES:
            total = sum(self.memory[(t, phase)] for t in TIERS)
            if total[VERTICES].min() > total_capacity:
                return False
        return True

    def minimum_total_memory(self) -> float:
        """The fewest bytes, over all tiers together, that any placement of this frame needs."""
        return max(float(sum(self.memory[(t, phase)] for t in TIERS)[VERTICES].min()) for phase in PHASES)

    def latency_lower_bound(self) -> float:
        """A latency no placement of this frame can beat: each term at its own best, and the
        weight and disk traffic that the tier capacities force."""
        model, frame = self.model, self.frame
        forced = self._forced_traffic()
        bounds = {}
        for phase in PHASES:
            per_term = [values[VERTICES].min() for values in self.time_terms[phase]]
            bounds[phase] = max(per_term + forced[phase]) if frame.overlap else per_term[0]
        return model.block_seconds(bounds["prefill"], bounds["decode"])

    def _forced_traffic(self) -> dict:
        """Seconds per layer of weight reads that cannot stay on the GPU, and of disk reads that
        cannot stay in RAM, in each phase."""
        model, frame, hw, w = self.model, self.frame, self.model.hardware, self.model.workload
        layers, bls = model.num_layers, frame.block_size
        s, n = w.prompt_len, w.gen_len
        weight_layer = model.weight_bytes_per_layer(frame)
        weights_total = weight_layer * layers
        offloaded_weights = max(0.0, 1.0 - self.capacity["gpu"] / weights_total)
        ctog = offloaded_weights * weight_layer / hw.cpu_to_gpu_bandwidth
        # Spill to disk what GPU and RAM cannot hold, cheapest to read back first.
        act_total = 2 * model.hidden * s * bls
        kv_total = model.kv_bytes_per_token(frame) * (s + n) * bls * layers
        spill = weights_total + act_total + kv_total - self.capacity["gpu"] - self.capacity["cpu"]
        decode_read = 0.0
        for stored, read_per_stored in ((act_total, 1 / (s * layers)),
                                        (kv_total, (s + n / 2) / ((s + n) * layers)),
                                        (weights_total, 1 / layers)):
            moved = min(max(spill, 0.0), stored)
            decode_read += moved * read_per_stored
            spill -= moved
        dtoc = decode_read / hw.disk_to_cpu_bandwidth
        return {"prefill": [ctog], "decode": [ctog, dtoc]}

    # ---- the LP

    def _problem(self, margin: float, fixed: dict[int, float]):
        """The constraints: memory per tier and phase, fractions summing to 1 (those in ``fixed``,
        by index, at their value), and each phase's seconds per layer above each of its terms.
        Returns (problem, fractions, phase seconds)."""
        self.lps_solved += 1
        prob = pulp.LpProblem("placement", pulp.LpMinimize)
        x = [variable(prob, name, fixed.get(i, 0), fixed.get(i, 1)) for i, name in enumerate(FRACTION_NAMES)]
        t = {phase: variable(prob, f"t_{phase}", 0, None) for phase in PHASES}
        time_terms = self.terms_for(fixed)
        for phase in PHASES:
            for values in time_terms[phase]:
                prob += _affine(values, x) <= t[phase]
        for (tier, _phase), values in self.memory.items():
            # in GB, so that the constraint's numbers sit near those of the time terms
            prob += _affine(values / 1e9, x) <= self.capacity[tier] * (1 - margin) / 1e9
        for group in range(3):
            prob += pulp.lpSum(x[3 * group: 3 * group + 3]) == 1
        return prob, x, t

    def _time_terms(self, points: Placement) -> dict:
        terms = self.model.phase_terms(self.frame, points)
        time_terms = {}
        for phase in PHASES:
            io, compute = terms[phase]
            compute_total = sum(_full(v) for v in compute.values())
            parts = [_full(io[k]) for k in STREAM_TERMS] + [compute_total]
            time_terms[phase] = parts if self.frame.overlap else [sum(parts)]
        return time_terms

    def terms_for(self, fixed: dict[int, float]) -> dict:
        """The time terms for an LP whose cache split is ``fixed`` (or is free). A few terms are not
        affine in the cache's fractions (the host's charge for a batch with disk rows, a step; with
        CPU attention, the host's share of attention for the GPU's rows, a product), so the terms
        read at whole-tier placements only bound them; with the split fixed, they are read again
        at it, and are exact in the weights and activations that stay free."""
        cache = tuple(fixed.get(CACHE_FIRST + i) for i in range(3))
        if None in cache:
            return self.time_terms
        if cache not in self._at_cache:
            columns = _POINTS._asdict()
            for name, share in zip(FRACTION_NAMES[CACHE_FIRST:CACHE_FIRST + 3], cache):
                columns[name] = np.full_like(columns[name], share)
            self._at_cache[cache] = self._time_terms(Placement(**columns))
        return self._at_cache[cache]

    def _latency(self, t) -> pulp.LpAffineExpression:
        layers, n = self.model.num_layers, self.model.workload.gen_len
        return layers * t["prefill"] + layers * (n - 1) * t["decode"]

    def solve(self, margin: float = LP_MEMORY_MARGIN, fixed: dict[int, float] | None = None):
        """Best placement as (fractions, block latency), or None if no placement fits."""
        prob, x, t = self._problem(margin, fixed or {})
        prob += self._latency(t)
        if not solved(prob):
            return None
        return _fractions(x), float(pulp.value(prob.objective))

    def solve_tidy(self, latency: float, margin: float = LP_MEMORY_MARGIN, fixed: dict[int, float] | None = None):
        """Among placements within ``latency``, the one that moves the least data.

        The latency LP is degenerate when one stream bounds a phase: the others may grow for free
        until they tie, e.g. putting cache on disk although RAM is free. Minimizing the unoverlapped
        sum of all terms as a second objective removes that traffic.
        """
        prob, x, t = self._problem(margin, fixed or {})
        prob += self._latency(t) <= latency * (1 + 1e-7)
        layers, n = self.model.num_layers, self.model.workload.gen_len
        weights = {"prefill": layers, "decode": layers * max(n - 1, 0)}
        time_terms = self.terms_for(fixed or {})
        prob += pulp.lpSum(weights[phase] * _affine(values, x) for phase in PHASES for values in time_terms[phase])
        if not solved(prob):
            return None
        return _fractions(x), float(pulp.value(self._latency(t)))

    def solve_in_rows(self, fractions, latency: float):
        """The best placement whose cache and activations split whole rows of a GPU batch, given
        the LP's best ``fractions`` and ``latency``: (fixed fractions, block latency), or None.
        Each of the two triples is tried at the row counts around the LP's; of equally fast ones,
        the nearest to the LP's answer is kept. That answer is the tidy one (``solve_tidy``): the
        latency LP is degenerate, and which of its equally fast vertices a solver returns differs
        between PuLP releases (the cache of OPT-30B 4-bit on the T4 machine split 14 rows to 6 on
        one, 15 to 5 on the other); the one moving the least data is the same on every release."""
        tidy = self.solve_tidy(latency)
        if tidy is not None:
            fractions = tidy[0]
        options = [row_splits(fractions[first:first + 3], self.frame.gpu_batch_size) for first in ROW_SPLIT]
        if not self.frame.cpu_attention:
            options[0] = sorted({whole for split in options[0] for whole in _unsplit_cache(split)})
        best, best_key = None, None
        for cache in options[0]:
            for activations in options[1]:
                fixed = dict(enumerate(cache, ROW_SPLIT[0])) | dict(enumerate(activations, ROW_SPLIT[1]))
                distance = sum(abs(fractions[i] - v) for i, v in fixed.items())
                solution = self.solve(fixed=fixed)
                if solution is None:
                    continue
                key = (round(solution[1] / latency, 9), distance)
                if best_key is None or key < best_key:
                    best, best_key = (fixed, solution[1]), key
        return best


def _fractions(x) -> np.ndarray:
    return np.clip([v.value() or 0.0 for v in x], 0.0, 1.0)


def _full(values) -> np.ndarray:
    """A term evaluated at the basis points, as an array even if the term is constant."""
    return np.broadcast_to(np.asarray(values, dtype=float), _POINTS.wg.shape).astype(float)


def _affine(values: np.ndarray, x) -> pulp.LpAffineExpression:
    """The affine term through ``values`` at the origin and the nine unit vectors."""
    constant = float(values[0])
    return affine(constant, values[1:10] - constant, x)


def round_fractions(fractions, decimals: int = 4) -> list[float]:
    """Round each tier triple to ``decimals`` places while keeping its sum exactly 1."""
    result = []
    for group in range(3):
        triple = [round(float(v), decimals) for v in fractions[3 * group: 3 * group + 3]]
        largest = max(range(3), key=lambda i: triple[i])
        triple[largest] = round(1.0 - sum(v for i, v in enumerate(triple) if i != largest), decimals)
        result.extend(triple)
    return result
