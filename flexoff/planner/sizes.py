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


_OUTSIDE = (Stage("embed"), Stage("head"))


def _layer_groups(config: ModelConfig) -> list[tuple[Stage, int]]:
    """(a layer, how many layers have its shapes): a mixture of experts' sparse layers and its
    dense ones (``dense_layers``) differ; the layers of a dense model are all alike."""
    sparse = [i for i in range(config.num_layers) if config.sparse_layer(i)]
    dense = [i for i in range(config.num_layers) if not config.sparse_layer(i)]
    return [(Stage("layer", group[0]), len(group)) for group in (sparse, dense) if group]


def _mean_over_layers(config: ModelConfig, count) -> float:
    return sum(count(stage) * layers for stage, layers in _layer_groups(config)) / config.num_layers


def layer_matrix_numel(config: ModelConfig) -> float:
    """Elements of a transformer layer's 2-D weights (the ones matmuls read and compression packs),
    a MoE layer's experts stacked, averaged over the layers."""
    return _mean_over_layers(config, lambda stage: _numel(config, (stage,), True))


def layer_vector_numel(config: ModelConfig) -> float:
    """Elements of a layer's biases, norms and exact matrices (a router), averaged over the layers;
    they stay fp16 under compression."""
    return _mean_over_layers(config, lambda stage: _numel(config, (stage,), False))


def layer_weight_numel(config: ModelConfig) -> float:
    """All weight elements of a transformer layer, averaged over the layers."""
    return layer_matrix_numel(config) + layer_vector_numel(config)


# Bytes per element of width that the element-wise kernels of a layer move at fp16, as the layer
# files compute them: a LayerNorm reads and writes (2 + 2), a residual add reads two and writes one
# (6), ReLU reads and writes (4); an RMS norm in fp32 measures, copies up, scales, copies down and
# multiplies by its weight (26); a rotation is a product and two half-width updates (14); a gated
# activation is SiLU then a product (10).
_LAYER_NORM, _ADD, _RELU, _RMS_NORM, _ROTATION, _GATED = 4, 6, 4, 26, 14, 10


def _elementwise_bytes(config: ModelConfig, stage: Stage) -> float:
    h = config.hidden_size
    if config.family == "opt":
        return 2 * _LAYER_NORM * h + 2 * _ADD * h + _RELU * config.intermediate_size
    rotated = (config.num_heads + config.num_kv_heads) * config.head_dim
    per_head_norms = _RMS_NORM * rotated if config.qk_norm else 0
    # A sparse layer's routed experts are priced at the rate measured for them as the runtime runs
    # them (sparse_rate), activation included; only a shared expert's is left here.
    mlp = config.shared_expert_intermediate_size if config.sparse_layer(stage.index) else config.intermediate_size
    return 2 * _RMS_NORM * h + 2 * _ADD * h + _ROTATION * rotated + per_head_norms + _GATED * mlp


def layer_elementwise_bytes_per_token(config: ModelConfig) -> float:
    """Bytes the element-wise kernels of one layer (norms, residual adds, the MLP's activation, a
    Llama-family model's rotations) read and write per token, averaged over the layers. A long
    prefill streams them through GPU memory; a decode step's are too few to be more than launches."""
    return _mean_over_layers(config, lambda stage: _elementwise_bytes(config, stage))


def _active_numel(config: ModelConfig, stage: Stage) -> float:
    share = config.experts_per_token / config.num_experts if config.num_experts else 1.0
    # A stacked tensor holds one expert per row of its first dimension; a token uses k of them.
    return sum(spec.numel * (share if spec.experts else 1.0)
               for spec in stage_specs(config, stage) if len(spec.shape) >= 2)


def layer_active_matmul_numel(config: ModelConfig) -> float:
    """Weight elements one token multiplies through in a layer, averaged over the layers: the
    attention's matrices and the MLP's, but of a sparse layer's experts only the
    ``experts_per_token`` it is routed to (besides the router and any shared expert)."""
    return _mean_over_layers(config, lambda stage: _active_numel(config, stage))


def layer_routed_matmul_numel(config: ModelConfig) -> float:
    """Of ``layer_active_matmul_numel``, the elements of the routed experts, averaged over the
    layers: each expert multiplies only the rows routed to it."""
    def routed(stage: Stage) -> float:
        specs = stage_specs(config, stage)
        return sum(spec.numel for spec in specs if spec.experts) \
            * config.experts_per_token / max(config.num_experts, 1)
    return _mean_over_layers(config, routed)


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
    return round(config.num_layers * layer_weight_numel(config)) + embedding_numel(config)


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
