import pytest

from flexoff.compression import compressed_nbytes
from flexoff.models import resolve_model_config
from flexoff.models import REGISTRY
from flexoff.planner.sizes import (
    bytes_per_element, embedding_numel, head_matmul_numel, layer_matrix_numel, layer_vector_numel,
    layer_weight_numel, parameter_count,
)
from flexoff.policy import CompressionConfig


def test_opt_layer_by_hand(tiny_opt):
    # q, k, v, o: 4 * 4*4; fc1, fc2: 2 * 4*8
    assert layer_matrix_numel(tiny_opt) == 64 + 64
    # two LayerNorms (2*4 each), biases q,k,v,o (4 each), fc1 (8), fc2 (4)
    assert layer_vector_numel(tiny_opt) == 16 + 16 + 8 + 4
    assert layer_weight_numel(tiny_opt) == 172
    # tokens 10*4, positions (8 + 2)*4, final LayerNorm 2*4, and the head's own copy 10*4
    assert embedding_numel(tiny_opt) == 40 + 40 + 8 + 40
    assert head_matmul_numel(tiny_opt) == 40


def test_llama_layer_by_hand_counts_gqa_and_swiglu(tiny_llama):
    # q, o: 8 x (4*2); k, v: 8 x (2*2); gate, up, down: 3 * 8*12
    assert layer_matrix_numel(tiny_llama) == 2 * 64 + 2 * 32 + 3 * 96
    assert layer_vector_numel(tiny_llama) == 2 * 8  # two RMSNorms, no biases
    # embedding and an untied head, 10*8 each, plus the final RMSNorm
    assert embedding_numel(tiny_llama) == 80 + 80 + 8


@pytest.mark.parametrize("name, params", [
    ("opt-125m", 125_239_296),  # published Hugging Face parameter counts
    ("opt-350m", 331_196_416),
    ("opt-1.3b", 1_315_758_080),
    ("llama-2-7b", 6_738_415_616),
    ("llama-3-8b", 8_030_261_248),
    ("qwen2.5-7b", 7_615_616_512),
    ("qwen3-8b", 8_190_735_360),
    ("qwen3-32b", 32_762_123_264),
])
def test_whole_model_counts_match_published_checkpoints(name, params):
    assert parameter_count(REGISTRY[name]) == params


@pytest.mark.parametrize("kind", ["opt-pre", "opt-post-proj", "llama-gqa", "qwen2-bias", "qwen3-qk-norm"])
def test_counts_match_the_transformers_model(tiny_model_dir, kind):
    """The counts, read off flexoff's weight specs, against the parameters of the model they load."""
    path, model = tiny_model_dir(kind)
    config = resolve_model_config(str(path))
    assert parameter_count(config) == sum(p.numel() for p in model.parameters())
    layer = model.model.decoder.layers[0] if kind.startswith("opt") else model.model.layers[0]
    assert layer_matrix_numel(config) == sum(p.numel() for p in layer.parameters() if p.dim() == 2)
    assert layer_vector_numel(config) == sum(p.numel() for p in layer.parameters() if p.dim() == 1)


def test_compressed_bytes_match_the_codec():
    config = REGISTRY["opt-30b"]
    shape = (config.intermediate_size, config.hidden_size)
    four_bit = CompressionConfig(4, 64)
    assert shape[0] * shape[1] * bytes_per_element(four_bit) == compressed_nbytes(shape, 4, 64)


def test_compressed_bytes_per_element():
    assert bytes_per_element(None) == 2
    # 4 bits plus an fp16 min and scale per 64 elements
    assert bytes_per_element(CompressionConfig(4, 64)) == pytest.approx(0.5 + 4 / 64)
    assert bytes_per_element(CompressionConfig(8, 32)) == pytest.approx(1 + 4 / 32)
