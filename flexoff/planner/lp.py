"""One frame's LP: the cost model's affine terms read off at basis points, and the placement that
minimizes the block latency under each tier's memory (FlexGen's Eq. (1)), in whole rows where the
runtime splits by sequences.

The variables are the nine fractions and ``cs``, the share of the cache kept on the CPU that
travels to the GPU although CPU attention is on. Only a frame that splits CPU attention frees it
(up to ``cc``), and such a frame keeps no cache on disk; every other frame fixes it at 0.
"""

from __future__ import annotations

import itertools
import math
import warnings

import numpy as np
import pulp

from ..policy import TIERS
from .cost_model import PHASES, STREAM_TERMS, CostModel, Placement, PolicyFrame

FRACTION_NAMES = Placement._fields
CACHE_CPU, CACHE_DISK, SHIPPED = (FRACTION_NAMES.index(name) for name in ("cc", "cd", "cs"))
# The LP keeps this share of each tier free so that rounding the fractions cannot overflow it.
LP_MEMORY_MARGIN = 1e-3


def _basis_points() -> Placement:
    """Placements to evaluate: the origin, the ten unit vectors, then the 27 pure vertices, and the
    9 with the whole cache on the CPU travelling (``cs`` = ``cc`` = 1)."""
    size = len(FRACTION_NAMES)
    rows = [np.zeros(size)] + list(np.eye(size))
    for w in range(3):
        for c in range(3):
            for h in range(3):
                v = np.zeros(size)
                v[w] = v[3 + c] = v[6 + h] = 1.0
                rows.append(v)
    for w in range(3):
        for h in range(3):
            v = np.zeros(size)
            v[w] = v[CACHE_CPU] = v[SHIPPED] = v[6 + h] = 1.0
            rows.append(v)
    points = np.array(rows)
    return Placement(*points.T)


_POINTS = _basis_points()
_FIRST_VERTEX = 1 + len(FRACTION_NAMES)


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


class FrameProblem:
    """One frame's affine terms, read off the cost model, and the LP over its placement."""

    def __init__(self, model: CostModel, frame: PolicyFrame):
        self.model, self.frame = model, frame
        self.lps_solved = 0
        terms = model.phase_terms(frame, _POINTS)
        # phase -> list of affine terms whose max (or sum, without overlap) is the phase's seconds
        self.time_terms = {}
        for phase in PHASES:
            io, compute = terms[phase]
            compute_total = sum(_full(v) for v in compute.values())
            parts = [_full(io[k]) for k in STREAM_TERMS] + [compute_total]
            self.time_terms[phase] = parts if frame.overlap else [sum(parts)]
        self.memory = {key: _full(v) for key, v in model.memory_terms(frame, _POINTS).items()}
        self.capacity = model.capacities()
        # Fractions the frame fixes, by index, and the pure vertices it allows.
        self.frame_fixed = {CACHE_DISK: 0.0} if frame.split_cpu_attention else {SHIPPED: 0.0}
        vertices = np.arange(len(_POINTS.wg)) >= _FIRST_VERTEX
        for index, value in self.frame_fixed.items():
            vertices &= _POINTS[index] == value
        self.vertices = np.flatnonzero(vertices)

    # ---- cheap necessary conditions and bounds, from the frame's pure vertices (an affine term is
    # least at one of them)

    def may_fit(self) -> bool:
        for (tier, _phase), values in self.memory.items():
            if values[self.vertices].min() > self.capacity[tier]:
                return False
        total_capacity = sum(self.capacity.values())
        for phase in PHASES:
            total = sum(self.memory[(t, phase)] for t in TIERS)
            if total[self.vertices].min() > total_capacity:
                return False
        return True

    def minimum_total_memory(self) -> float:
        """The fewest bytes, over all tiers together, that any placement of this frame needs."""
        return max(float(sum(self.memory[(t, phase)] for t in TIERS)[self.vertices].min()) for phase in PHASES)

    def latency_lower_bound(self) -> float:
        """A latency no placement of this frame can beat: each term at its own best, and the
        weight and disk traffic that the tier capacities force."""
        model, frame = self.model, self.frame
        forced = self._forced_traffic()
        bounds = {}
        for phase in PHASES:
            per_term = [values[self.vertices].min() for values in self.time_terms[phase]]
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
        """The constraints: memory per tier and phase, fractions summing to 1 (those the frame and
        ``fixed`` fix, by index, at their value), the travelling cache within the CPU's, and each
        phase's seconds per layer above each of its terms.
        Returns (problem, fractions, phase seconds)."""
        self.lps_solved += 1
        fixed = self.frame_fixed | fixed
        prob = pulp.LpProblem("placement", pulp.LpMinimize)
        x = [_variable(prob, name, fixed.get(i, 0), fixed.get(i, 1)) for i, name in enumerate(FRACTION_NAMES)]
        prob += x[SHIPPED] <= x[CACHE_CPU]  # the cache that travels from the CPU is some of the CPU's
        t = {phase: _variable(prob, f"t_{phase}", 0, None) for phase in PHASES}
        for phase in PHASES:
            for values in self.time_terms[phase]:
                prob += _affine(values, x) <= t[phase]
        for (tier, _phase), values in self.memory.items():
            # in GB, so that the constraint's numbers sit near those of the time terms
            prob += _affine(values / 1e9, x) <= self.capacity[tier] * (1 - margin) / 1e9
        for group in range(3):
            prob += pulp.lpSum(x[3 * group: 3 * group + 3]) == 1
        return prob, x, t

    def _latency(self, t) -> pulp.LpAffineExpression:
        layers, n = self.model.num_layers, self.model.workload.gen_len
        return layers * t["prefill"] + layers * (n - 1) * t["decode"]

    def solve(self, margin: float = LP_MEMORY_MARGIN, fixed: dict[int, float] | None = None):
        """Best placement as (fractions, block latency), or None if no placement fits."""
        prob, x, t = self._problem(margin, fixed or {})
        prob += self._latency(t)
        if not _solved(prob):
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
        prob += pulp.lpSum(weights[phase] * _affine(values, x)
                           for phase in PHASES for values in self.time_terms[phase])
        if not _solved(prob):
            return None
        return _fractions(x), float(pulp.value(self._latency(t)))

    def solve_in_rows(self, fractions, latency: float):
        """The best placement whose cache and activations split whole rows of a GPU batch, given
        the LP's best ``fractions`` and ``latency``: (fixed fractions, block latency), or None.
        Each of the two triples, and the travelling CPU rows, is tried at the row counts around the
        LP's (and at no travelling row); of equally fast ones, the one without travelling rows, then
        the nearest to the LP's answer, is kept."""
        rows = self.frame.gpu_batch_size
        options = [row_splits(fractions[first:first + 3], rows) for first in ROW_SPLIT]
        best, best_key = None, None
        for cache, activations in itertools.product(*options):
            for shipped in self._shipped_rows(fractions[SHIPPED], cache[1], rows):
                fixed = dict(enumerate(cache, ROW_SPLIT[0])) | dict(enumerate(activations, ROW_SPLIT[1]))
                if shipped is not None:
                    fixed[SHIPPED] = shipped
                distance = sum(abs(fractions[i] - v) for i, v in fixed.items())
                solution = (fractions, latency) if distance < 1e-9 else self.solve(fixed=fixed)
                if solution is None:
                    continue
                key = (round(solution[1] / latency, 9), fixed.get(SHIPPED, 0) > 0, distance)
                if best_key is None or key < best_key:
                    best, best_key = (fixed, solution[1]), key
        return best

    def _shipped_rows(self, shipped: float, cpu: float, rows: int) -> list[float | None]:
        """Shares of travelling CPU rows to try, in whole rows of the ``cpu`` share's; [None] where
        the frame does not split CPU attention."""
        if not self.frame.split_cpu_attention:
            return [None]
        cpu_rows = round(cpu * rows)
        counts = {0, math.floor(shipped * rows + 1e-6), math.ceil(shipped * rows - 1e-6)}
        return sorted(min(count, cpu_rows) / rows for count in counts)


def _variable(prob: pulp.LpProblem, name: str, low, high) -> pulp.LpVariable:
    if hasattr(prob, "add_variable"):  # PuLP >= 3.3 attaches variables to their problem
        return prob.add_variable(name, lowBound=low, upBound=high)
    return pulp.LpVariable(name, lowBound=low, upBound=high)


def _solved(prob: pulp.LpProblem) -> bool:
    # PuLP 3.3 deprecates the bundled CBC in favour of a separately installed one; the bundled
    # binary is what a plain `pip install pulp` provides, so keep using it quietly.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        prob.solve(pulp.PULP_CBC_CMD(msg=False))
    return pulp.LpStatus[prob.status] == "Optimal"


def _fractions(x) -> np.ndarray:
    return np.clip([v.value() or 0.0 for v in x], 0.0, 1.0)


def _full(values) -> np.ndarray:
    """A term evaluated at the basis points, as an array even if the term is constant."""
    return np.broadcast_to(np.asarray(values, dtype=float), _POINTS.wg.shape).astype(float)


def _affine(values: np.ndarray, x) -> pulp.LpAffineExpression:
    constant = float(values[0])
    coefficients = values[1:_FIRST_VERTEX] - constant
    return pulp.LpAffineExpression([(v, float(c)) for v, c in zip(x, coefficients) if c != 0.0], constant=constant)


def round_fractions(fractions, decimals: int = 4) -> list[float]:
    """Round each tier triple to ``decimals`` places while keeping its sum exactly 1; a tenth
    fraction (``cs``) is rounded too, and kept within the cache's cpu share."""
    result = []
    for group in range(3):
        triple = [round(float(v), decimals) for v in fractions[3 * group: 3 * group + 3]]
        largest = max(range(3), key=lambda i: triple[i])
        triple[largest] = round(1.0 - sum(v for i, v in enumerate(triple) if i != largest), decimals)
        result.extend(triple)
    if len(fractions) > SHIPPED:
        result.append(min(round(float(fractions[SHIPPED]), decimals), result[CACHE_CPU]))
    return result
