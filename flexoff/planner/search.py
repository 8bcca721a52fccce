"""Policy search: enumerate GPU batch size x number of GPU batches, solve an LP per pair.

For a fixed pair (and compression and CPU-attention choice: a PolicyFrame) every time and memory
term of the cost model is affine in the nine placement fractions, so the best placement is an LP:
minimize the block latency subject to each tier's peak memory, as in FlexGen's Eq. (1).
Pairs are visited best bound first and skipped once their bound cannot beat the best found, so
only a few LPs are solved.

The runtime splits the cache and the activations by whole sequences of a GPU batch, so an LP's
answer is realised by fixing those two triples at whole rows next to it and solving again for the
weights (``FrameProblem.solve_in_rows``): the policy returned is the one the runtime will run, and
its predicted memory is the memory it will take. The LP of one frame is ``placement_lp``'s.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from ..errors import PolicyError
from ..models.config import ModelConfig
from ..policy import CompressionConfig, Policy, check_choice
from .cost_model import CostModel, PolicyFrame, Prediction, Workload
from .hardware import HardwareProfile
from .placement_lp import LP_MEMORY_MARGIN, VERTICES, FrameProblem, round_fractions, row_splits  # noqa: F401
from .report import no_fit_message

DEFAULT_COMPRESSION = CompressionConfig(bits=4, group_size=64)
# FlexGen keeps GPU batch sizes at multiples of 4 and blocks of a few dozen batches at most.
GPU_BATCH_SIZES = (1, 2, 4, 8, 12, 16, 20, 24, 28, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192,
                   224, 256, 320, 384, 448, 512, 640, 768, 1024)
NUM_GPU_BATCHES = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, 48, 64)
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


# ---- enumeration


def _choices(value: str, what: str) -> tuple[bool, ...]:
    check_choice(value, what)
    return {"auto": (False, True), "on": (True,), "off": (False,)}[value]


def candidate_frames(compress: str = "auto", cpu_attention: str = "auto",
                     gpu_batch_sizes=GPU_BATCH_SIZES, num_gpu_batches=NUM_GPU_BATCHES,
                     overlap: bool = True, stored: CompressionConfig | None = None) -> list[PolicyFrame]:
    """Every frame to try. ``stored``: the format the model's checkpoint stores its matrices in
    (``ModelConfig.stored_compression``), every frame's weight compression, since they are read as
    stored; ``compress`` then decides the cache's alone."""
    frames = []
    for compressed in _choices(compress, "compress"):
        compression = DEFAULT_COMPRESSION if compressed else None
        weights = compression if stored is None else stored
        for delegate in _choices(cpu_attention, "cpu attention"):
            for nb in num_gpu_batches:
                for gbs in gpu_batch_sizes:
                    frames.append(PolicyFrame(gbs, nb, weights, compression, delegate, overlap))
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
            needs[tier] = max(needs.get(tier, 0.0), float(values[VERTICES].min()))
        return PolicyError(no_fit_message(config, hardware, problem.frame, needs, problem.minimum_total_memory()))


def _searcher(config, workload, hardware, compress, cpu_attention, gpu_batch_sizes, num_gpu_batches, overlap):
    frames = candidate_frames(compress, cpu_attention, gpu_batch_sizes or GPU_BATCH_SIZES,
                              num_gpu_batches or NUM_GPU_BATCHES, overlap, config.stored_compression)
    searcher = _Searcher(config, workload, hardware, frames)
    if not searcher.candidates:
        raise searcher.no_fit_error(config)
    return searcher


def search_policy(config: ModelConfig, workload: Workload, hardware: HardwareProfile, *,
                  compress: str = "off", cpu_attention: str = "auto", max_latency: float | None = None,
                  gpu_batch_sizes=None, num_gpu_batches=None, overlap: bool = True) -> SearchResult:
    """The policy with the highest predicted throughput, optionally within a block latency.

    ``compress`` and ``cpu_attention`` are "auto" (try both), "on" or "off". Compression changes
    the outputs, so the default is lossless, as the command line's ``--compress`` is. A model whose
    checkpoint stores its matrices compressed is planned with them as stored in every policy, and
    ``compress`` decides the KV cache's compression alone.
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
                    compress: str = "off", cpu_attention: str = "auto", gpu_batch_sizes=None,
                    num_gpu_batches=None, overlap: bool = True) -> list[SearchResult]:
    """Policies no other policy beats in both block latency and throughput, fastest first; lossless
    unless ``compress`` says otherwise, as ``search_policy``."""
    searcher = _searcher(config, workload, hardware, compress, cpu_attention, gpu_batch_sizes,
                         num_gpu_batches, overlap)
    frontier = searcher.frontier()
    if not frontier:
        raise searcher.no_fit_error(config)
    return [searcher.result(cand) for cand in frontier]
