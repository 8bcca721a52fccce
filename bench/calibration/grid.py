"""The policies one step away from a searched one, kept where the planner predicts they fit.

One step: the GPU batch size or the number of GPU batches to the next value of the search's lists,
the weights' GPU or disk share by WEIGHT_STEP (taken from or given to the CPU), one row of a GPU
batch's cache moved between the CPU and the GPU or the disk, one row of its activations between the
GPU and the CPU, CPU attention flipped. Cache and activations stay in whole
rows of a GPU batch, as the search returns them and the runtime splits them. The searched policy
fills a tier, so most steps up overflow it: those keep the least share of the weights moved off
the full tier that makes them fit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from flexoff.errors import PolicyError
from flexoff.models.config import ModelConfig
from flexoff.planner.cost_model import CostModel, Workload
from flexoff.planner.hardware import HardwareProfile
from flexoff.planner.search import GPU_BATCH_SIZES, NUM_GPU_BATCHES
from flexoff.policy import Policy, TierFractions

WEIGHT_STEP = 0.05
MIN_NEIGHBOURS = 6


@dataclass(frozen=True)
class Neighbour:
    label: str  # what changed, from the searched policy
    policy: Policy


def _step(values, current: int, direction: int) -> int | None:
    """The next value of ``values`` after ``current`` in ``direction`` (+1 or -1), if any."""
    if direction > 0:
        larger = [v for v in values if v > current]
        return min(larger) if larger else None
    smaller = [v for v in values if v < current]
    return max(smaller) if smaller else None


def in_rows(fractions: TierFractions, rows: int) -> TierFractions:
    """``fractions`` at whole rows of a GPU batch of ``rows``: gpu and disk rows rounded, cpu the rest."""
    gpu = min(rows, round(fractions.gpu * rows))
    disk = min(rows - gpu, round(fractions.disk * rows))
    return TierFractions(gpu / rows, (rows - gpu - disk) / rows, disk / rows)


def _rows(fractions: TierFractions, rows: int) -> tuple[int, int, int]:
    gpu, disk = round(fractions.gpu * rows), round(fractions.disk * rows)
    return gpu, rows - gpu - disk, disk


def _with_batch_size(policy: Policy, gbs: int) -> Policy:
    return replace(policy, gpu_batch_size=gbs, cache=in_rows(policy.cache, gbs),
                   activations=in_rows(policy.activations, gbs))


def _shift_weights(policy: Policy, tier: str, delta: float) -> Policy | None:
    """``delta`` of the weights moved from the CPU to ``tier`` (or back, when negative)."""
    w = dict(zip(("gpu", "cpu", "disk"), policy.weights.as_tuple()))
    w[tier], w["cpu"] = round(w[tier] + delta, 6), round(w["cpu"] - delta, 6)
    if w[tier] < 0 or w["cpu"] < 0:
        return None
    return replace(policy, weights=_fractions(w["gpu"], w["cpu"], w["disk"]))


def _fractions(gpu: float, cpu: float, disk: float) -> TierFractions:
    """A triple rounded to 6 places (no -0 in the summaries), the CPU share taking the rounding."""
    gpu, disk = round(gpu, 6) + 0.0, round(disk, 6) + 0.0
    return TierFractions(gpu, round(1.0 - gpu - disk, 6) + 0.0, disk)


def _shift_row(policy: Policy, part: str, tier: str, delta: int) -> Policy | None:
    """One row of each GPU batch's ``part`` (cache or activations) moved from the CPU to ``tier``
    (or back)."""
    rows = policy.gpu_batch_size
    counts = dict(zip(("gpu", "cpu", "disk"), _rows(getattr(policy, part), rows)))
    counts[tier], counts["cpu"] = counts[tier] + delta, counts["cpu"] - delta
    if not all(0 <= n <= rows for n in counts.values()):
        return None
    return replace(policy, **{part: TierFractions(*(counts[t] / rows for t in ("gpu", "cpu", "disk")))})


def _batch_size_step(direction: int):
    def step(policy: Policy):
        gbs = _step(GPU_BATCH_SIZES, policy.gpu_batch_size, direction)
        return None if gbs is None else (f"gpu batch {gbs}", _with_batch_size(policy, gbs))
    return step


def _batches_step(direction: int):
    def step(policy: Policy):
        nb = _step(NUM_GPU_BATCHES, policy.num_gpu_batches, direction)
        return None if nb is None else (f"{nb} gpu batches", replace(policy, num_gpu_batches=nb))
    return step


def _weights_step(tier: str, direction: int):
    def step(policy: Policy):
        moved = _shift_weights(policy, tier, direction * WEIGHT_STEP)
        share = None if moved is None else getattr(moved.weights, tier)
        return None if moved is None else (f"weights {tier} {100 * share:.3g}%", moved)
    return step


def _row_step(part: str, tier: str, direction: int):
    def step(policy: Policy):
        moved = _shift_row(policy, part, tier, direction)
        if moved is None:
            return None
        rows = round(getattr(getattr(moved, part), tier) * moved.gpu_batch_size)
        return f"{part} {tier} {rows} of {moved.gpu_batch_size} rows", moved
    return step


def _cpu_attention_step(policy: Policy):
    if policy.cache.gpu >= 1:  # CPU attention serves only the cache held off the card
        return None
    return ("cpu attention " + ("off" if policy.cpu_attention else "on"),
            replace(policy, cpu_attention=not policy.cpu_attention))


# (step, whether moving weights may make room for it: not for a step of the weights, which it would undo)
STEPS = [(make(direction), True) for direction in (1, -1) for make in (_batch_size_step, _batches_step)] + \
    [(_weights_step(tier, direction), False) for tier in ("gpu", "disk") for direction in (1, -1)] + \
    [(_row_step(part, tier, direction), True)
     for part, tier in (("cache", "gpu"), ("cache", "disk"), ("activations", "gpu")) for direction in (1, -1)] + \
    [(_cpu_attention_step, True)]


def one_step(policy: Policy) -> list[tuple[Neighbour, object, bool]]:
    """Every policy one step from ``policy``, whether it fits or not: (neighbour, step, repairable)."""
    found = []
    for step, repairable in STEPS:
        try:
            made = step(policy)
        except PolicyError:  # a step the policy rules forbid (say, fractions past a tier)
            continue
        if made is not None and made[1] != policy:
            found.append((Neighbour(*made), step, repairable))
    return found


def _move_weights(policy: Policy, source: str, target: str, amount: float) -> Policy:
    w = dict(zip(("gpu", "cpu", "disk"), policy.weights.as_tuple()))
    w[source] -= amount
    w[target] += amount
    return replace(policy, weights=_fractions(w["gpu"], w["cpu"], w["disk"]))


# Where the weights make room on a full tier: the GPU gives to the CPU, the CPU to the disk.
ROOM = {"gpu": "cpu", "cpu": "disk"}
BISECTIONS = 30


def repaired(neighbour: Neighbour, model: CostModel) -> Neighbour | None:
    """``neighbour`` made to fit by moving the least share of the weights off each tier it
    overflows, the GPU's first (as the search's LP would); None if no share makes room."""
    policy = neighbour.policy
    moves = []
    for tier in ("gpu", "cpu"):
        if tier not in model.predict(policy).over_capacity:
            continue
        target = ROOM[tier]
        available = getattr(policy.weights, tier)

        def fits_tier(amount, policy=policy, tier=tier, target=target):
            return tier not in model.predict(_move_weights(policy, tier, target, amount)).over_capacity

        if available <= 0 or not fits_tier(available):
            return None
        low, high = 0.0, available
        for _ in range(BISECTIONS):
            middle = (low + high) / 2
            low, high = (low, middle) if fits_tier(middle) else (middle, high)
        amount = min(available, math.ceil(high * 1e4) / 1e4)  # policies keep 4 decimals
        policy = _move_weights(policy, tier, target, amount)
        moves.append(f"weights {amount:.2%} {tier}->{target}")
    if not model.predict(policy).fits:
        return None
    return Neighbour(f"{neighbour.label}, " + ", ".join(moves), policy)


def neighbours(policy: Policy, config: ModelConfig, workload: Workload, hardware: HardwareProfile,
               exclude: tuple[str, ...] = ()) -> tuple[list[Neighbour], list[Neighbour]]:
    """(neighbours that fit, those that cannot), by the search's own check: the cost model's peak
    memory of each tier within its usable capacity for ``workload``. A step that overflows a tier
    (the searched policy usually fills one) is kept with the least share of the weights moved off it,
    but for a step of the weights' share. While fewer than MIN_NEIGHBOURS fit, steps that fitted are
    taken once more in the same direction. Steps whose label contains a text of ``exclude`` are
    left out before counting (say, a step predicted to run for minutes)."""
    model = CostModel(config, workload, hardware)
    fitting, rejected, again = [], [], []
    for neighbour, step, repairable in one_step(policy):
        if any(text in neighbour.label for text in exclude):
            continue
        if model.predict(neighbour.policy).fits:
            fitting.append(neighbour)
            if step is not _cpu_attention_step:  # flipped twice is the searched policy
                again.append((neighbour, step))
            continue
        fixed = repaired(neighbour, model) if repairable else None
        if fixed is None or fixed.policy == policy or fixed.policy in {n.policy for n in fitting}:
            rejected.append(neighbour)
        else:
            fitting.append(fixed)
    for neighbour, step in again:
        if len(fitting) >= MIN_NEIGHBOURS:
            break
        try:
            made = step(neighbour.policy)
        except PolicyError:
            continue
        if made is not None and model.predict(made[1]).fits and made[1] not in {n.policy for n in fitting}:
            fitting.append(Neighbour(made[0] + " (two steps)", made[1]))
    return fitting, rejected
