"""GGUFWeights: every stored type decoded as the gguf package decodes it, the q/k rows put back as
transformers puts them, 4- and 8-bit blocks handed over as flexoff's compressed tensors with the
same values, and the config read from the metadata."""

import sys

import numpy as np
import pytest
import torch

from flexoff.compression import dequantize
from flexoff.errors import CheckpointError, ConfigError, FlexoffError, UnsupportedModelError
from flexoff.models import stage_specs, stages
from flexoff.models.gguf_config import config_from_gguf
from flexoff.policy import CompressionConfig
from flexoff.weights import GGUFWeights
from tests.weights.gguf_files import gguf_tensors, tiny_llama, write_gguf

gguf = pytest.importorskip("gguf")
CPU = torch.device("cpu")


def reference(path) -> dict[str, torch.Tensor]:
    """Every tensor as transformers' GGUF loader makes it: the gguf package's dequantize, then
    transformers' reverse permutation of q and k."""
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    reader = gguf.GGUFReader(str(path))
    field = reader.fields["llama.attention.head_count"]
    heads = int(field.parts[field.data[0]][0])
    field = reader.fields["llama.attention.head_count_kv"]
    kv_heads = int(field.parts[field.data[0]][0])
    processor = LlamaTensorProcessor({"num_attention_heads": heads, "num_key_value_heads": kv_heads})
    out = {}
    for tensor in reader.tensors:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        out[tensor.name] = torch.from_numpy(np.array(processor.process(values, tensor.name).weights))
    return out


def named_specs(weights: GGUFWeights):
    """(stage, spec, GGUF name) of every weight the model reads."""
    from flexoff.weights.gguf import gguf_name

    for stage in stages(weights.config):
        for spec in stage_specs(weights.config, stage):
            names = [gguf_name(key) for key in spec.checkpoint_keys]
            yield stage.name, spec, next(n for n in names if n in weights.file.tensors)


@pytest.mark.parametrize("kind", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"])
def test_every_tensor_equals_the_gguf_packages_dequantization(gguf_llama, kind):
    path = gguf_llama[1][kind]
    expected = reference(path)
    weights = GGUFWeights(path)
    seen = set()
    for stage, spec, name in named_specs(weights):
        assert torch.equal(weights.load_tensor(stage, spec, CPU, torch.float32), expected[name]), name
        half = weights.load_tensor(stage, spec, CPU, torch.float16)
        assert half.dtype == torch.float16 and torch.equal(half, expected[name].half()), name
        seen.add(name)
    assert seen == set(expected)  # every tensor of the file is read, the head's through token_embd when tied


def test_values_go_into_the_buffer_given(gguf_llama):
    weights = GGUFWeights(gguf_llama[1]["Q4_0"])
    stage, spec, name = next(item for item in named_specs(weights) if item[2] == "blk.1.attn_k.weight")
    out = torch.zeros(spec.shape, dtype=torch.bfloat16)
    assert weights.load_tensor(stage, spec, CPU, torch.bfloat16, out=out) is out
    assert torch.equal(out, reference(weights.path)[name].bfloat16())


def test_the_unpermuted_rows_are_the_models_own(gguf_llama):
    """Up to the F16 rounding, the rows come back in the Hugging Face model's order."""
    model, files = gguf_llama
    weights = GGUFWeights(files["F32"])
    state = model.state_dict()
    for stage, spec, _ in named_specs(weights):
        key = spec.checkpoint_keys[0] if spec.checkpoint_keys[0] in state else spec.checkpoint_keys[-1]
        assert torch.equal(weights.load_tensor(stage, spec, CPU, torch.float32), state[key]), key


@pytest.mark.parametrize("kind, bits", [("Q4_0", 4), ("Q4_1", 4), ("Q8_0", 8)])
@pytest.mark.parametrize("meta_dtype", [torch.float16, torch.float32])
def test_compressed_blocks_decode_to_the_same_bits(gguf_llama, kind, bits, meta_dtype):
    path = gguf_llama[1][kind]
    expected = reference(path)
    weights = GGUFWeights(path)
    assert weights.config.stored_compression == CompressionConfig(bits, 32)
    matrices = 0
    for stage, spec, name in named_specs(weights):
        compressed = weights.load_compressed(stage, spec, CompressionConfig(bits, 32), CPU, meta_dtype)
        if len(spec.shape) == 1:  # norms are F32 in the file
            assert compressed is None
            continue
        matrices += 1
        assert (compressed.bits, compressed.group_size, compressed.dtype) == (bits, 32, meta_dtype)
        assert torch.equal(dequantize(compressed, dtype=torch.float32), expected[name]), name
    assert matrices == 16  # the embedding, seven of each layer, the output


def test_no_compressed_tensor_where_the_format_or_the_scales_differ(gguf_llama):
    files = gguf_llama[1]
    q4 = GGUFWeights(files["Q4_1"])
    stage, spec, _ = next(item for item in named_specs(q4) if item[2] == "blk.0.ffn_up.weight")
    for compression in (CompressionConfig(4, 64), CompressionConfig(8, 32), None):
        assert q4.load_compressed(stage, spec, compression, CPU, torch.float16) is None
    # bfloat16 cannot hold a random fp16 scale exactly: the store quantizes the values instead.
    assert q4.load_compressed(stage, spec, CompressionConfig(4, 32), CPU, torch.bfloat16) is None
    f16 = GGUFWeights(files["F16"])
    assert f16.load_compressed(stage, spec, CompressionConfig(4, 32), CPU, torch.float16) is None
    assert f16.config.stored_compression is None


def test_the_config_comes_from_the_metadata(gguf_llama):
    model, files = gguf_llama
    hf = model.config
    config = config_from_gguf(files["F32"])
    assert (config.family, config.vocab_size, config.hidden_size, config.num_layers, config.num_heads,
            config.num_kv_heads, config.head_dim, config.intermediate_size, config.max_positions) == \
        ("llama", hf.vocab_size, hf.hidden_size, hf.num_hidden_layers, hf.num_attention_heads,
         hf.num_key_value_heads, hf.head_dim, hf.intermediate_size, hf.max_position_embeddings)
    assert (config.bos_token_id, config.eos_token_ids, config.pad_token_id) == (1, (2,), 0)
    assert config.norm_eps == float(np.float32(hf.rms_norm_eps)) and config.rope_theta == 10000.0
    assert not config.tie_word_embeddings and config.name == "tiny-F32"
    assert config_from_gguf(files["BF16"]).native_dtype == "bfloat16"
    assert config_from_gguf(files["F16"]).native_dtype == "float16"


def test_mostly_by_elements_decides_the_stored_format(tmp_path):
    """Q4 attention with a wider Q8_0 MLP is stored as Q8_0; the embedding does not count."""
    model = tiny_llama(320)
    tensors = gguf_tensors(model)
    types = {name: "Q8_0" for name in tensors if "ffn_" in name}
    path = write_gguf(tmp_path / "mixed.gguf", model, "Q4_0", tensors=tensors, types=types)
    assert config_from_gguf(path).stored_compression == CompressionConfig(8, 32)


def test_tied_embeddings_without_an_output_tensor(tmp_path):
    model = tiny_llama(320, tied=True)
    path = write_gguf(tmp_path / "tied.gguf", model, "Q8_0")
    weights = GGUFWeights(path)
    assert weights.config.tie_word_embeddings
    head = stage_specs(weights.config, stages(weights.config)[-1])[-1]
    assert torch.equal(weights.load_tensor("head", head, CPU, torch.float32), reference(path)["token_embd.weight"])


def one_line(exc: FlexoffError, *needles: str) -> None:
    message = str(exc)
    assert "\n" not in message, message
    for needle in needles:
        assert needle in message, message


def check_all(path):
    weights = GGUFWeights(path)
    weights.check({stage.name: stage_specs(weights.config, stage) for stage in stages(weights.config)})
    return weights


def test_other_block_types_go_through_the_gguf_package(tmp_path, monkeypatch):
    model = tiny_llama(320)
    path = write_gguf(tmp_path / "q5.gguf", model, "Q5_0")
    weights = check_all(path)
    expected = reference(path)
    for stage, spec, name in named_specs(weights):
        assert torch.equal(weights.load_tensor(stage, spec, CPU, torch.float32), expected[name]), name
    monkeypatch.setitem(sys.modules, "gguf", None)  # as if not installed
    with pytest.raises(UnsupportedModelError) as caught:
        check_all(path)
    one_line(caught.value, str(path), "tensor 'token_embd.weight'", "Q5_0", "pip install gguf")


def test_a_missing_tensor_is_named(tmp_path):
    model = tiny_llama(320)
    tensors = gguf_tensors(model)
    del tensors["blk.1.ffn_gate.weight"]
    path = write_gguf(tmp_path / "missing.gguf", model, tensors=tensors)
    with pytest.raises(CheckpointError) as caught:
        check_all(path)
    one_line(caught.value, str(path), "'blk.1.ffn_gate.weight'", "layer.1", "not in the file")


def test_a_shape_the_metadata_disagrees_with_names_both(tmp_path):
    path = write_gguf(tmp_path / "kv.gguf", tiny_llama(320), "Q8_0", metadata={"llama.attention.head_count_kv": 4})
    with pytest.raises(CheckpointError) as caught:
        check_all(path)
    one_line(caught.value, str(path), "blk.0.attn_k.weight has shape [32, 64] but "
             "llama.attention.head_count_kv=4 × head dim 16 needs [64, 64]")


@pytest.mark.parametrize("metadata, error, needles", [
    ({"llama.embedding_length": 128, "llama.rope.dimension_count": 32}, ConfigError,
     ("token_embd.weight has shape [320, 64]", "llama.embedding_length=128", "[320, 128]")),
    ({"llama.block_count": None}, UnsupportedModelError, ("lacks the metadata key 'llama.block_count'",)),
    ({"llama.block_count": "two"}, ConfigError, ("llama.block_count must be a positive integer, got 'two'",)),
    ({"llama.attention.head_count": 3}, ConfigError, ("llama.attention.head_count (3) must be a multiple",)),
    ({"tokenizer.ggml.eos_token_id": 999}, ConfigError, ("tokenizer.ggml.eos_token_id must be below",)),
    ({"llama.rope.scaling.type": "yarn"}, UnsupportedModelError, ("llama.rope.scaling.type 'yarn'",)),
    ({"llama.expert_count": 8}, UnsupportedModelError, ("llama.expert_count", "mixture-of-experts")),
])
def test_bad_metadata_is_one_line_naming_the_key(tmp_path, metadata, error, needles):
    path = write_gguf(tmp_path / "bad.gguf", tiny_llama(320), metadata=metadata)
    with pytest.raises(error) as caught:
        config_from_gguf(path)
    one_line(caught.value, str(path), *needles)


def test_an_unsupported_architecture_is_refused_by_name(tmp_path):
    model = tiny_llama(320)
    path = write_gguf(tmp_path / "gpt2.gguf", model, arch="gpt2")
    with pytest.raises(UnsupportedModelError) as caught:
        config_from_gguf(path)
    one_line(caught.value, str(path), "general.architecture 'gpt2' is not supported", "llama")


def test_integer_tensors_are_not_weights(tmp_path):
    model = tiny_llama(320)
    tensors = gguf_tensors(model)
    tensors["blk.0.attn_v.weight"] = tensors["blk.0.attn_v.weight"].astype(np.int32)
    path = write_gguf(tmp_path / "int.gguf", model, types={"blk.0.attn_v.weight": "I32"}, tensors=tensors)
    with pytest.raises(CheckpointError) as caught:
        check_all(path)
    one_line(caught.value, str(path), "'blk.0.attn_v.weight'", "I32")


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}


def test_llama3_frequency_factors_become_its_rope_scaling(tmp_path):
    """llama.cpp stores Llama 3's scaling as rope_freqs.weight; flexoff runs it as the model it came
    from (transformers' GGUF loader ignores the tensor, so the reference is the original model)."""
    from flexoff.models.config import RopeScaling
    from tests.weights.gguf_files import llama3_rope_factors

    model = tiny_llama(320, rope_scaling=LLAMA3)
    tensors = {**gguf_tensors(model), "rope_freqs.weight": llama3_rope_factors(16, 8.0, 16)}
    path = write_gguf(tmp_path / "llama3.gguf", model, tensors=tensors,
                      metadata={"llama.rope.scaling.original_context_length": 16})
    config = config_from_gguf(path)
    assert config.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 16)
    assert_generates_as(path, model)
    other = {**tensors, "rope_freqs.weight": llama3_rope_factors(16, 8.0, 16, high=2.0)}
    path = write_gguf(tmp_path / "other.gguf", model, tensors=other,
                      metadata={"llama.rope.scaling.original_context_length": 16})
    with pytest.raises(UnsupportedModelError) as caught:
        config_from_gguf(path)
    one_line(caught.value, str(path), "rope_freqs.weight", "not Llama 3's")


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qwen_files_run_as_the_model_they_came_from(tmp_path, arch):
    """No permutation; Qwen2's q/k/v biases and Qwen3's q/k norms and 32-wide heads (the key
    length). F32 holds the model's own values, so the model itself is the reference."""
    from tests.weights.gguf_files import tiny_qwen

    model = tiny_qwen(arch, 320)
    path = write_gguf(tmp_path / f"{arch}.gguf", model, arch=arch)
    config = config_from_gguf(path)
    assert (config.attention_bias, config.qk_norm, config.head_dim) == \
        ((True, False, 16) if arch == "qwen2" else (False, True, 32))
    assert_generates_as(path, model)


def assert_generates_as(path, model) -> None:
    """flexoff's 8 greedy tokens of the test prompts from the file are ``model``'s own."""
    from flexoff import LLM, SamplingParams
    from tests.conftest import PROMPTS

    with LLM(str(path), dtype="float32") as llm:
        outs = llm.generate(PROMPTS, SamplingParams(max_new_tokens=8, min_tokens=8))
    for out in outs:
        prompt = torch.tensor([out.prompt_token_ids])
        ref = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8, min_new_tokens=8,
                             do_sample=False, pad_token_id=0)
        assert out.token_ids == ref[0, prompt.shape[1]:].tolist()
