"""Element counts of a model's weights, read off its weight specs (the ones the runtime stores),
split as the layout splits them: matrices, which matmuls read and compression packs, and vectors
(biases and norms), which stay in the compute dtype."""

from __future__ import annotations

from ..layout import compressible
from ..models import Stage, stage_specs
from ..models.config import ModelConfig
from ..policy import CompressionConfig

FP16_BYTES = 2
# Group-wise quantization keeps a minimum and a scale per group, both fp16.
GROUP_METADATA_BYTES = 2 * FP16_BYTES


def _numel(config: ModelConfig, stages: tuple[Stage, ...], matrices: bool) -> int:
    return sum(spec.numel for stage in stages for spec in stage_specs(config, stage)
               if compressible(spec) == matrices)


# Every decoder layer has the first one's shapes.
_LAYER = (Stage("layer", 0),)
_OUTSIDE = (Stage("embed"), Stage("head"))


def layer_matrix_numel(config: ModelConfig) -> int:
    """Elements of one transformer layer's 2-D weights (the ones matmuls read and compression packs)."""
    return _numel(config, _LAYER, True)


def layer_vector_numel(config: ModelConfig) -> int:
    """Elements of one layer's biases and norms; they stay fp16 under compression."""
    return _numel(config, _LAYER, False)


def layer_weight_numel(config: ModelConfig) -> int:
    """All weight elements of one transformer layer."""
    return layer_matrix_numel(config) + layer_vector_numel(config)


def embedding_matrix_numel(config: ModelConfig) -> int:
    """2-D weights outside the layers: token (and OPT position) embeddings, projections, and the head.

    The head counts even when tied to the token embedding: the runtime keeps the embedding and the
    head as separate stages that are placed (and stored) independently.
    """
    return _numel(config, _OUTSIDE, True)


def embedding_vector_numel(config: ModelConfig) -> int:
    """The final norm, the only 1-D weight outside the layers."""
    return _numel(config, _OUTSIDE, False)


def embedding_numel(config: ModelConfig) -> int:
    """All weight elements outside the transformer layers."""
    return embedding_matrix_numel(config) + embedding_vector_numel(config)


def model_numel(config: ModelConfig) -> int:
    """Weight elements the runtime stores for the whole model."""
    return config.num_layers * layer_weight_numel(config) + embedding_numel(config)


def parameter_count(config: ModelConfig) -> int:
    """Distinct parameters, a tied head counted once: the figure model cards quote."""
    tied_copy = config.vocab_size * config.word_embed_proj_dim if config.tie_word_embeddings else 0
    return model_numel(config) - tied_copy


def head_matmul_numel(config: ModelConfig) -> int:
    """Weight elements a token's logits multiply through (lm head, plus OPT's project_out)."""
    return _numel(config, (Stage("head"),), True)


def bytes_per_element(compression: CompressionConfig | None) -> float:
    """Stored bytes per element: fp16, or packed bits plus per-group min and scale."""
    if compression is None:
        return float(FP16_BYTES)
    return compression.bits / 8 + GROUP_METADATA_BYTES / compression.group_size
