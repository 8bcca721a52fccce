"""The experts' bytes a sparse layer moves: all of them, or, where the runtime routes first
(``layout.routes_first``), those a block's tokens are expected to touch (``layout.experts`` holds
the estimate)."""

from __future__ import annotations

from ..layout import compressible, expected_experts_touched, stored_parts
from ..models import Stage, stage_specs
from ..models.config import ModelConfig
from ..policy import CompressionConfig
from .sizes import FP16_BYTES


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
