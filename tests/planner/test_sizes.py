import pytest
import torch

from flexoff.compression import compressed_nbytes
from flexoff.models import resolve_model_config
from flexoff.models import REGISTRY
from flexoff.planner.sizes import (
    bytes_per_element, embedding_numel, head_matmul_numel, layer_active_matmul_numel, layer_matrix_numel,
    layer_elementwise_bytes_per_token, layer_routed_matmul_numel, layer_vector_numel, layer_weight_numel,
    parameter_count,
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


def test_elementwise_bytes_by_hand(tiny_opt, tiny_llama):
    # OPT, 4 wide, MLP 8: 2 LayerNorms read and write 4 x 2 B, 2 residual adds read 2 and write 1,
    # ReLU reads and writes 8 x 2 B
    assert layer_elementwise_bytes_per_token(tiny_opt) == 2 * 16 + 2 * 24 + 32
    # Llama, 8 wide, 4 query and 2 KV heads of 2, MLP 12: 2 fp32 RMS norms (26 B an element), 2 adds,
    # the rotation of 6 heads x 2 (14 B an element), SiLU and the gate's product over 12 (10 B)
    assert layer_elementwise_bytes_per_token(tiny_llama) == 2 * 26 * 8 + 2 * 6 * 8 + 14 * 12 + 10 * 12
    # Qwen3 normalises each head's queries and keys before rotating them
    normed = tiny_llama.replace(qk_norm=True)
    assert layer_elementwise_bytes_per_token(normed) == layer_elementwise_bytes_per_token(tiny_llama) + 26 * 12


def test_a_sparse_layers_routed_experts_are_not_counted_as_elementwise(tiny_llama):
    """The rate measured for routed experts runs them whole (sparse_rate); a shared expert's
    activation and a dense layer's count."""
    moe = tiny_llama.replace(num_experts=4, experts_per_token=2, expert_intermediate_size=6)
    dense = layer_elementwise_bytes_per_token(tiny_llama)
    assert layer_elementwise_bytes_per_token(moe) == dense - 10 * 12
    shared = moe.replace(shared_expert_intermediate_size=5)
    assert layer_elementwise_bytes_per_token(shared) == dense - 10 * 12 + 10 * 5
    # one dense layer of two: the mean over the layers
    half = moe.replace(dense_layers=(0,))
    assert layer_elementwise_bytes_per_token(half) == dense - 10 * 12 / 2


@pytest.mark.parametrize("name, params", [
    ("opt-125m", 125_239_296),  # published Hugging Face parameter counts
    ("opt-350m", 331_196_416),
    ("opt-1.3b", 1_315_758_080),
    ("llama-2-7b", 6_738_415_616),
    ("llama-3-8b", 8_030_261_248),
    ("qwen2.5-7b", 7_615_616_512),
    ("qwen3-8b", 8_190_735_360),
    ("qwen3-32b", 32_762_123_264),
    ("mixtral-8x7b", 46_702_792_704),
    ("qwen3-30b-a3b", 30_532_122_624),
    ("qwen1.5-moe-a2.7b", 14_315_784_192),
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


@pytest.mark.parametrize("name, active", [
    ("mixtral-8x7b", 12.9e9),  # the active parameters their model cards quote
    ("mixtral-8x22b", 39e9),
    ("qwen3-30b-a3b", 3.3e9),
    ("qwen3-235b-a22b", 22e9),
    ("qwen1.5-moe-a2.7b", 2.7e9),
    ("qwen2-57b-a14b", 14e9),
])
def test_active_counts_match_the_published_ones(name, active):
    """A token multiplies through k of E experts (plus the router and any shared expert): the
    active parameters model cards quote, which count the embeddings and the head too. The cards
    give two digits, rounded or cut (3.35e9 is Qwen3-30B-A3B's "3.3B"), hence 2%; a shared
    expert left out or every expert counted misses by far more."""
    config = REGISTRY[name]
    counted = config.num_layers * layer_active_matmul_numel(config) + embedding_numel(config)
    assert counted == pytest.approx(active, rel=0.02)
    assert counted < parameter_count(config) / 3


def test_a_dense_models_active_count_is_its_matrices(tiny_llama):
    assert layer_active_matmul_numel(tiny_llama) == layer_matrix_numel(tiny_llama)
    assert layer_routed_matmul_numel(tiny_llama) == 0


@pytest.mark.parametrize("kind", ["mixtral", "qwen3-moe", "qwen2-moe"])
def test_moe_counts_average_sparse_and_dense_layers(tiny_model_dir, kind):
    """Counts against the transformers model's parameters, layer by layer averaged: qwen3-moe's
    second layer and qwen2-moe's first are dense, the rest sparse."""
    path, model = tiny_model_dir(kind)
    config = resolve_model_config(str(path))
    assert parameter_count(config) == sum(p.numel() for p in model.parameters())
    layers = model.model.layers
    per_layer = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    assert len(set(per_layer)) == (1 if kind == "mixtral" else 2)
    assert layer_weight_numel(config) == pytest.approx(sum(per_layer) / len(layers))


@pytest.mark.parametrize("kind", ["mixtral", "qwen2-moe"])
def test_the_sparse_mlps_matmuls_are_the_routed_ones(tiny_model_dir, monkeypatch, kind):
    """FLOPs counted while flexoff's sparse MLP runs (a matmul per expert, so that the counter sees
    them) over tokens routed by their own router: twice each token's active MLP elements, the
    router, its k experts and any shared expert, and the weighted sum of the k outputs; the attention's
    matrices are the rest."""
    from torch.utils.flop_counter import FlopCounterMode

    from flexoff.models import moe, stage_specs, Stage

    path, model = tiny_model_dir(kind)
    config = resolve_model_config(str(path))
    index = next(i for i in range(config.num_layers) if config.sparse_layer(i))
    weights = {spec.name: torch.randn(spec.shape, generator=torch.Generator().manual_seed(1))
               for spec in stage_specs(config, Stage("layer", index))}
    monkeypatch.setattr(moe, "_grouped_kernel_fits", lambda *args: False)
    tokens = 37
    x = torch.randn(1, tokens, config.hidden_size)
    with FlopCounterMode(display=False) as counter:
        moe.sparse_mlp(config, weights, x)
    attention = sum(p.numel() for name, p in model.model.layers[index].self_attn.named_parameters()
                    if p.dim() == 2)
    dense_layers = config.num_layers - sum(config.sparse_layer(i) for i in range(config.num_layers))
    dense_layer = attention + 3 * config.hidden_size * config.intermediate_size
    sparse_active = (config.num_layers * layer_active_matmul_numel(config) - dense_layers * dense_layer) \
        / (config.num_layers - dense_layers) - attention
    # Each token's k outputs are summed under their weights by a batched matmul the counter sees too.
    combine = 2 * tokens * config.experts_per_token * config.hidden_size
    assert counter.get_total_flops() == pytest.approx(2 * tokens * sparse_active + combine)
