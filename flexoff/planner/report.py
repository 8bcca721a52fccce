"""A policy in one line, as the planner's messages and the reference table name it."""

from __future__ import annotations

from ..policy import Policy


def policy_summary(policy: Policy) -> str:
    """One line: '48x3 w 0/100/0 c 0/100/0 a 0/100/0 cpu-attention 4-bit'; a split CPU attention
    says the share of the CPU cache it attends: 'cpu-attention 62.5% (rest travels)'."""
    def short(fractions):
        return "/".join(f"{100 * v:.3g}" for v in fractions.as_tuple())
    flags = []
    if policy.cpu_attention:
        split = policy.cpu_attention_split
        flags.append("cpu-attention" + (f" {100 * split:.3g}% (rest travels)" if split < 1 else ""))
    if policy.compress_weight or policy.compress_cache:
        flags.append(f"{(policy.compress_weight or policy.compress_cache).bits}-bit")
    return (f"{policy.gpu_batch_size}x{policy.num_gpu_batches} w {short(policy.weights)} "
            f"c {short(policy.cache)} a {short(policy.activations)}" + "".join(f" {f}" for f in flags))
