"""Element counts of a model's weights, computed from its ModelConfig alone.

The planner needs them before any weight exists; a test checks them against the runtime's weight
specs (``flexoff.models.stage_specs``).
"""

from __future__ import annotations

from ..models.config import ModelConfig
from ..policy import CompressionConfig

FP16_BYTES = 2
# Group-wise quantization keeps a minimum and a scale per group, both fp16.
GROUP_METADATA_BYTES = 2 * FP16_BYTES


def layer_matrix_numel(config: ModelConfig) -> int:
    """Elements of one transformer layer's 2-D weights (the ones matmuls read and compression packs)."""
    h = config.hidden_size
    q_width = config.num_heads * config.head_dim
    kv_width = config.num_kv_heads * config.head_dim
    attention = h * q_width * 2 + h * kv_width * 2  # q, o and k, v
    if config.family == "opt":
        mlp = 2 * h * config.intermediate_size  # fc1, fc2
    else:
        mlp = 3 * h * config.intermediate_size  # gate, up, down (SwiGLU)
    return attention + mlp


def layer_vector_numel(config: ModelConfig) -> int:
    """Elements of one layer's biases and norms; they stay fp16 under compression."""
    h = config.hidden_size
    q_width = config.num_heads * config.head_dim
    kv_width = config.num_kv_heads * config.head_dim
    if config.family == "opt":
        norms = 2 * 2 * h  # two LayerNorms, weight and bias
        biases = (q_width + 2 * kv_width + h + config.intermediate_size + h) if config.enable_bias else 0
        return norms + biases
    norms = 2 * h  # two RMSNorms
    biases = (q_width + 2 * kv_width) if config.attention_bias else 0
    return norms + biases


def layer_weight_numel(config: ModelConfig) -> int:
    """All weight elements of one transformer layer."""
    return layer_matrix_numel(config) + layer_vector_numel(config)


def embedding_matrix_numel(config: ModelConfig) -> int:
    """2-D weights outside the layers: token (and OPT position) embeddings, projections, and the head.

    The head counts even when tied to the token embedding: the runtime keeps the embedding and the
    head as separate stages that are placed (and stored) independently.
    """
    h, vocab, proj = config.hidden_size, config.vocab_size, config.word_embed_proj_dim
    numel = 2 * vocab * proj  # token embedding and head
    if config.family == "opt":
        numel += (config.max_positions + 2) * h  # OPT's learned positions carry an offset of 2
        if proj != h:
            numel += 2 * proj * h  # project_in and project_out
    return numel


def embedding_vector_numel(config: ModelConfig) -> int:
    """The final norm, the only 1-D weight outside the layers."""
    h = config.hidden_size
    if config.family == "opt":
        has_final_norm = config.do_layer_norm_before and not config.remove_final_layer_norm
        return 2 * h if has_final_norm else 0
    return h


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
    numel = config.vocab_size * config.word_embed_proj_dim
    if config.family == "opt" and config.word_embed_proj_dim != config.hidden_size:
        numel += config.word_embed_proj_dim * config.hidden_size
    return numel


def largest_matrix_numel(config: ModelConfig) -> int:
    """The biggest single 2-D weight: the size of one dequantization buffer."""
    h = config.hidden_size
    return max(
        h * config.intermediate_size,
        h * config.num_heads * config.head_dim,
        config.vocab_size * config.word_embed_proj_dim,
    )


def bytes_per_element(compression: CompressionConfig | None) -> float:
    """Stored bytes per element: fp16, or packed bits plus per-group min and scale."""
    if compression is None:
        return float(FP16_BYTES)
    return compression.bits / 8 + GROUP_METADATA_BYTES / compression.group_size
