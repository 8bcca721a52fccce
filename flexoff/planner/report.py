"""A policy in one line, as the planner's messages and the reference table name it."""

from __future__ import annotations

from ..policy import Policy


def policy_summary(policy: Policy) -> str:
    """One line: '48x3 w 0/100/0 c 0/100/0 a 0/100/0 cpu-att 4-bit'."""
    def short(fractions):
        return "/".join(f"{100 * v:.3g}" for v in fractions.as_tuple())
    flags = []
    if policy.cpu_attention:
        flags.append("cpu-attention")
    if policy.compress_weight or policy.compress_cache:
        flags.append(f"{(policy.compress_weight or policy.compress_cache).bits}-bit")
    return (f"{policy.gpu_batch_size}x{policy.num_gpu_batches} w {short(policy.weights)} "
            f"c {short(policy.cache)} a {short(policy.activations)}" + "".join(f" {f}" for f in flags))
