"""How many of a layer's experts a block touches, and their bytes.

Each token of a sparse layer picks ``k`` of its ``E`` experts. Under uniform routing a given expert
escapes one token with probability (E - k) / E, so N tokens touch E * (1 - ((E - k) / E) ** N)
distinct experts on average. Real routers are less even than uniform, which only lowers the count:
the figure is what loading only the touched experts (route first) could save at most. The runtime
loads every expert of a layer (prefetch-all), so the cost model prices all their bytes unless it is
asked about route-first loading.
"""

from __future__ import annotations

from ..layout import compressible, stored_parts
from ..models import Stage, stage_specs
from ..models.config import ModelConfig
from ..policy import CompressionConfig
from .sizes import FP16_BYTES


def expected_experts_touched(num_experts: int, experts_per_token: int, tokens: float) -> float:
    """Expected distinct experts that ``tokens`` tokens, each routed uniformly to
    ``experts_per_token`` distinct experts of ``num_experts``, touch together."""
    if num_experts <= 0:
        return 0.0
    missed = (num_experts - experts_per_token) / num_experts
    return num_experts * (1.0 - missed ** tokens)


def expert_bytes_per_layer(config: ModelConfig, compression: CompressionConfig | None) -> float:
    """Stored bytes of a layer's routed experts (all of them), averaged over the layers."""
    sparse = [i for i in range(config.num_layers) if config.sparse_layer(i)]
    if not sparse:
        return 0.0
    # Sparse layers are alike: one of them, times their number.
    one = sum(sum(stored_parts(spec.shape, compression if compressible(spec) else None, FP16_BYTES))
              for spec in stage_specs(config, Stage("layer", sparse[0])) if spec.experts)
    return one * len(sparse) / config.num_layers


def expected_expert_bytes(config: ModelConfig, compression: CompressionConfig | None, tokens: float) -> float:
    """Expected stored bytes of the experts ``tokens`` tokens touch in a layer, averaged over the
    layers: what a layer moves when only the routed experts are loaded."""
    if not config.num_experts:
        return 0.0
    share = expected_experts_touched(config.num_experts, config.experts_per_token, tokens) / config.num_experts
    return share * expert_bytes_per_layer(config, compression)
