"""Policy search: enumerate GPU batch size x number of GPU batches, solve an LP per pair.

For a fixed pair (and compression and CPU-attention choice: a PolicyFrame) every time and memory
term of the cost model is affine in the nine placement fractions, so the best placement is an LP:
minimize the block latency subject to each tier's peak memory, as in FlexGen's Eq. (1).
Pairs are visited best bound first and skipped once their bound cannot beat the best found, so
only a few LPs are solved.

The runtime splits the cache and the activations by whole sequences of a GPU batch, so an LP's
answer is realised by fixing those two triples at whole rows next to it and solving again for the
weights (``FrameProblem.solve_in_rows``): the policy returned is the one the runtime will run, and
its predicted memory is the memory it will take.
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass

import numpy as np
import pulp

from ..errors import PolicyError
from ..models.config import ModelConfig
from ..policy import TIERS, CompressionConfig, Policy, check_choice
from .cost_model import PHASES, STREAM_TERMS, CostModel, Placement, PolicyFrame, Prediction, Workload
from .hardware import HardwareProfile
from .report import no_fit_message

FRACTION_NAMES = Placement._fields
DEFAULT_COMPRESSION = CompressionConfig(bits=4, group_size=64)
# FlexGen keeps GPU batch sizes at multiples of 4 and blocks of a few dozen batches at most.
GPU_BATCH_SIZES = (1, 2, 4, 8, 12, 16, 20, 24, 28, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192,
                   224, 256, 320, 384, 448, 512, 640, 768, 1024)
NUM_GPU_BATCHES = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, 48, 64)
# The LP keeps this share of each tier free so that rounding the fractions cannot overflow it.
LP_MEMORY_MARGIN = 1e-3
# Throughputs this close count as equal; the lower latency then wins.
TIE_TOLERANCE = 1e-4


@dataclass(frozen=True)
class SearchResult:
    policy: Policy
    prediction: Prediction
    candidates: int  # frames that passed the cheap memory check
    lps_solved: int
    seconds: float

    @property
    def throughput(self) -> float:
        return self.prediction.total_throughput

    @property
    def latency(self) -> float:
        return self.prediction.block_latency


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
_VERTICES = slice(10, None)


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

    # ---- cheap necessary conditions and bounds, from the 27 vertices

    def may_fit(self) -> bool:
        for (tier, _phase), values in self.memory.items():
            if values[_VERTICES].min() > self.capacity[tier]:
                return False
        total_capacity = sum(self.capacity.values())
        for phase in PHASES:
            total = sum(self.memory[(t, phase)] for t in TIERS)
            if total[_VERTICES].min() > total_capacity:
                return False
        return True

    def minimum_total_memory(self) -> float:
        """The fewest bytes, over all tiers together, that any placement of this frame needs."""
        return max(float(sum(self.memory[(t, phase)] for t in TIERS)[_VERTICES].min()) for phase in PHASES)

    def latency_lower_bound(self) -> float:
        """A latency no placement of this frame can beat: each term at its own best, and the
        weight and disk traffic that the tier capacities force."""
        model, frame = self.model, self.frame
        forced = self._forced_traffic()
        bounds = {}
        for phase in PHASES:
            per_term = [values[_VERTICES].min() for values in self.time_terms[phase]]
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
        x = [_variable(prob, name, fixed.get(i, 0), fixed.get(i, 1)) for i, name in enumerate(FRACTION_NAMES)]
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
        Each of the two triples is tried at the row counts around the LP's; of equally fast ones,
        the nearest to the LP's answer is kept."""
        options = [row_splits(fractions[first:first + 3], self.frame.gpu_batch_size) for first in ROW_SPLIT]
        if not self.frame.cpu_attention:
            options[0] = sorted({whole for split in options[0] for whole in _unsplit_cache(split)})
        best, best_key = None, None
        for cache in options[0]:
            for activations in options[1]:
                fixed = dict(enumerate(cache, ROW_SPLIT[0])) | dict(enumerate(activations, ROW_SPLIT[1]))
                distance = sum(abs(fractions[i] - v) for i, v in fixed.items())
                solution = (fractions, latency) if distance < 1e-9 else self.solve(fixed=fixed)
                if solution is None:
                    continue
                key = (round(solution[1] / latency, 9), distance)
                if best_key is None or key < best_key:
                    best, best_key = (fixed, solution[1]), key
        return best


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
    coefficients = values[1:10] - constant
    return pulp.LpAffineExpression([(v, float(c)) for v, c in zip(x, coefficients) if c != 0.0], constant=constant)


def round_fractions(fractions, decimals: int = 4) -> list[float]:
    """Round each tier triple to ``decimals`` places while keeping its sum exactly 1."""
    result = []
    for group in range(3):
        triple = [round(float(v), decimals) for v in fractions[3 * group: 3 * group + 3]]
        largest = max(range(3), key=lambda i: triple[i])
        triple[largest] = round(1.0 - sum(v for i, v in enumerate(triple) if i != largest), decimals)
        result.extend(triple)
    return result


# ---- enumeration


def _choices(value: str, what: str) -> tuple[bool, ...]:
    check_choice(value, what)
    return {"auto": (False, True), "on": (True,), "off": (False,)}[value]


def candidate_frames(compress: str = "auto", cpu_attention: str = "auto",
                     gpu_batch_sizes=GPU_BATCH_SIZES, num_gpu_batches=NUM_GPU_BATCHES,
                     overlap: bool = True) -> list[PolicyFrame]:
    frames = []
    for compressed in _choices(compress, "compress"):
        compression = DEFAULT_COMPRESSION if compressed else None
        for delegate in _choices(cpu_attention, "cpu attention"):
            for nb in num_gpu_batches:
                for gbs in gpu_batch_sizes:
                    frames.append(PolicyFrame(gbs, nb, compression, compression, delegate, overlap))
    return frames


@dataclass
class _Candidate:
    problem: FrameProblem
    latency_bound: float
    throughput_bound: float


class _Searcher:
    def __init__(self, config: ModelConfig, workload: Workload, hardware: HardwareProfile, frames):
        self.started = time.perf_counter()
        self.model = CostModel(config, workload, hardware)
        self.solutions: dict[PolicyFrame, tuple | None] = {}  # the LP's answer
        self.realised: dict[PolicyFrame, tuple | None] = {}  # in whole rows (see solve_in_rows)
        self.candidates: list[_Candidate] = []
        self.smallest_rejected, smallest_need = None, math.inf
        for frame in self._useful(frames):
            problem = FrameProblem(self.model, frame)
            if not problem.may_fit():
                need = problem.minimum_total_memory()
                if need < smallest_need:
                    self.smallest_rejected, smallest_need = problem, need
                continue
            bound = problem.latency_lower_bound()
            self.candidates.append(_Candidate(problem, bound, self.throughput(frame, bound)))

    @property
    def lps_solved(self) -> int:
        return sum(cand.problem.lps_solved for cand in self.candidates)

    def _useful(self, frames):
        """Drop frames whose block has a whole GPU batch of padding: a smaller block does better."""
        total = self.model.workload.num_prompts
        for frame in frames:
            if total is None or frame.gpu_batch_size * (frame.num_gpu_batches - 1) < total:
                yield frame

    def throughput(self, frame: PolicyFrame, latency: float) -> float:
        w = self.model.workload
        return self.model.useful_share(frame.block_size) * frame.block_size * w.gen_len / latency

    def solve(self, candidate: _Candidate):
        """The LP's (fractions, latency): a bound on the whole-row answer, which is no faster."""
        frame = candidate.problem.frame
        if frame not in self.solutions:
            self.solutions[frame] = candidate.problem.solve()
        return self.solutions[frame]

    def realise(self, candidate: _Candidate):
        """(fixed fractions, latency) in whole rows, or None."""
        frame = candidate.problem.frame
        if frame not in self.realised:
            solution = self.solve(candidate)
            self.realised[frame] = None if solution is None else candidate.problem.solve_in_rows(*solution)
        return self.realised[frame]

    def best_throughput(self, max_latency: float | None):
        best, best_throughput, best_latency = None, 0.0, math.inf

        def improves(throughput: float, latency: float) -> bool:
            clearly_better = throughput > best_throughput * (1 + TIE_TOLERANCE)
            return clearly_better or (throughput >= best_throughput * (1 - TIE_TOLERANCE) and latency < best_latency)

        for cand in sorted(self.candidates, key=lambda c: -c.throughput_bound):
            if cand.throughput_bound < best_throughput * (1 - TIE_TOLERANCE):
                break
            if max_latency is not None and cand.latency_bound > max_latency:
                continue
            frame = cand.problem.frame
            solution = self.solve(cand)
            if solution is None or not improves(self.throughput(frame, solution[1]), solution[1]):
                continue
            realised = self.realise(cand)
            if realised is None:
                continue
            latency = realised[1]
            if max_latency is not None and latency > max_latency:
                continue
            throughput = self.throughput(frame, latency)
            if improves(throughput, latency):
                best, best_throughput, best_latency = cand, throughput, latency
        return best

    def lowest_latency(self):
        best, best_latency = None, math.inf
        for cand in sorted(self.candidates, key=lambda c: c.latency_bound):
            if cand.latency_bound >= best_latency:
                break
            solution = self.solve(cand)
            if solution is None or solution[1] >= best_latency:
                continue
            realised = self.realise(cand)
            if realised is not None and realised[1] < best_latency:
                best, best_latency = cand, realised[1]
        return best

    def frontier(self):
        """Candidates on the latency-throughput Pareto frontier, fastest first."""
        found = []  # (latency, throughput, candidate)
        for cand in sorted(self.candidates, key=lambda c: -c.throughput_bound):
            if any(lat <= cand.latency_bound and tp >= cand.throughput_bound for lat, tp, _ in found):
                continue
            realised = self.realise(cand)
            if realised is not None:
                found.append((realised[1], self.throughput(cand.problem.frame, realised[1]), cand))
        found.sort(key=lambda item: (item[0], -item[1]))
        frontier, best_throughput = [], 0.0
        for _latency, throughput, cand in found:
            if throughput > best_throughput * (1 + TIE_TOLERANCE):
                frontier.append(cand)
                best_throughput = throughput
        return frontier

    def result(self, cand: _Candidate) -> SearchResult:
        policy, prediction = self.finish(cand)
        return SearchResult(policy, prediction, len(self.candidates), self.lps_solved,
                            time.perf_counter() - self.started)

    def finish(self, cand: _Candidate) -> tuple[Policy, Prediction]:
        """Tidy and round the whole-row placement into a Policy, checking that the result still fits."""
        problem = cand.problem
        fixed, latency = self.realise(cand)
        for decimals, margin in ((4, LP_MEMORY_MARGIN), (6, LP_MEMORY_MARGIN), (6, 1e-2)):
            solution = problem.solve_tidy(latency, margin, fixed) or problem.solve(margin, fixed)
            if solution is None:
                continue
            policy = problem.frame.with_placement(round_fractions(solution[0], decimals))
            prediction = self.model.predict(policy)
            if prediction.fits:
                return policy, prediction
        raise AssertionError(f"rounded placement for {problem.frame} overflows memory")

    def no_fit_error(self, config: ModelConfig) -> PolicyError:
        problem, hardware = self.smallest_rejected, self.model.hardware
        if problem is None:  # every frame passed the quick check yet no LP was feasible
            return PolicyError(no_fit_message(config, hardware))
        needs = {}
        for (tier, _phase), values in problem.memory.items():
            needs[tier] = max(needs.get(tier, 0.0), float(values[_VERTICES].min()))
        return PolicyError(no_fit_message(config, hardware, problem.frame, needs, problem.minimum_total_memory()))


def _searcher(config, workload, hardware, compress, cpu_attention, gpu_batch_sizes, num_gpu_batches, overlap):
    frames = candidate_frames(compress, cpu_attention, gpu_batch_sizes or GPU_BATCH_SIZES,
                              num_gpu_batches or NUM_GPU_BATCHES, overlap)
    searcher = _Searcher(config, workload, hardware, frames)
    if not searcher.candidates:
        raise searcher.no_fit_error(config)
    return searcher


def search_policy(config: ModelConfig, workload: Workload, hardware: HardwareProfile, *,
                  compress: str = "auto", cpu_attention: str = "auto", max_latency: float | None = None,
                  gpu_batch_sizes=None, num_gpu_batches=None, overlap: bool = True) -> SearchResult:
    """The policy with the highest predicted throughput, optionally within a block latency.

    ``compress`` and ``cpu_attention`` are "auto" (try both), "on" or "off".
    Raises PolicyError when the model fits no placement, or no policy meets ``max_latency``
    (the message then names the lowest latency possible).
    """
    if max_latency is not None and not (max_latency > 0):
        raise PolicyError(f"maximum latency must be positive, got {max_latency!r}")
    searcher = _searcher(config, workload, hardware, compress, cpu_attention, gpu_batch_sizes,
                         num_gpu_batches, overlap)
    best = searcher.best_throughput(max_latency)
    if best is None:
        fastest = searcher.lowest_latency()
        if fastest is None:
            raise searcher.no_fit_error(config)
        _, prediction = searcher.finish(fastest)
        raise PolicyError(
            f"no policy finishes a block within {max_latency:g} s; the lowest block latency possible is "
            f"{prediction.block_latency:.4g} s (gpu batch size {prediction.policy.gpu_batch_size} x "
            f"{prediction.policy.num_gpu_batches} batches)"
        )
    return searcher.result(best)


def pareto_frontier(config: ModelConfig, workload: Workload, hardware: HardwareProfile, *,
                    compress: str = "auto", cpu_attention: str = "auto", gpu_batch_sizes=None,
                    num_gpu_batches=None, overlap: bool = True) -> list[SearchResult]:
    """Policies no other policy beats in both block latency and throughput, fastest first."""
    searcher = _searcher(config, workload, hardware, compress, cpu_attention, gpu_batch_sizes,
                         num_gpu_batches, overlap)
    frontier = searcher.frontier()
    if not frontier:
        raise searcher.no_fit_error(config)
    return [searcher.result(cand) for cand in frontier]
