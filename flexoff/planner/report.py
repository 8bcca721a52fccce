"""The planner's words: a policy in one line, as its messages and the reference table name it, and
why a model fits no placement."""

from __future__ import annotations

from ..models.config import ModelConfig
from ..policy import TIERS, CompressionConfig, Policy
from ..units import format_size
from .frame import PolicyFrame
from .hardware import HardwareProfile


def compression_words(weight: CompressionConfig | None, cache: CompressionConfig | None) -> str:
    """'4-bit' where weights and cache are compressed alike, else each compressed part's: '4-bit
    weights' (a model stored compressed, its cache lossless), '4-bit cache'; '' for neither."""
    if weight is not None and cache is not None and weight.bits == cache.bits:
        return f"{weight.bits}-bit"
    return " ".join(f"{config.bits}-bit {what}" for what, config in (("weights", weight), ("cache", cache))
                    if config is not None)


def policy_summary(policy: Policy) -> str:
    """One line: '48x3 w 0/100/0 c 0/100/0 a 0/100/0 cpu-att 4-bit'."""
    def short(fractions):
        return "/".join(f"{100 * v:.3g}" for v in fractions.as_tuple())
    flags = []
    if policy.cpu_attention:
        flags.append("cpu-attention")
    if policy.compress_weight or policy.compress_cache:
        flags.append(compression_words(policy.compress_weight, policy.compress_cache))
    return (f"{policy.gpu_batch_size}x{policy.num_gpu_batches} w {short(policy.weights)} "
            f"c {short(policy.cache)} a {short(policy.activations)}" + "".join(f" {f}" for f in flags))


def no_fit_message(config: ModelConfig, hardware: HardwareProfile, frame: PolicyFrame | None = None,
                   needs: dict | None = None, total: float = 0.0) -> str:
    """Why ``config`` fits no placement: the least each tier needs (``needs``) and all of them
    together (``total``) under ``frame``, the frame that needs least; no frame: no LP was feasible."""
    usable = {t: hardware.capacity(t) for t in TIERS}
    offered = " + ".join(f"{format_size(usable[t])} {t}" for t in TIERS)
    if frame is None or needs is None:
        return f"{config.name} fits no placement on this machine ({offered} usable)"
    weight, cache = frame.compress_weight, frame.compress_cache
    compressed = compression_words(weight, cache)
    if weight is not None and cache is not None and weight.bits == cache.bits:
        compressed += " compression"
    how = f"gpu batch size {frame.gpu_batch_size}, {compressed or 'no compression'}"
    if needs["gpu"] > usable["gpu"]:
        return (f"{config.name} cannot run on this machine even with everything offloaded: the GPU needs at "
                f"least {format_size(needs['gpu'])} for working buffers ({how}), but only "
                f"{format_size(usable['gpu'])} is usable")
    if total > sum(usable.values()):
        return (f"{config.name} cannot fit this machine even with everything offloaded: it needs at least "
                f"{format_size(total)} ({how}), but the tiers offer {offered} usable")
    tier = max(TIERS, key=lambda t: needs[t] - usable[t])
    return (f"{config.name} cannot fit this machine: the {tier} tier needs at least {format_size(needs[tier])} "
            f"({how}) but offers {format_size(usable[tier])} usable")
