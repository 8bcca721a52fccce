"""SmolLM2-135M-Instruct run straight from its GGUF file, its Q4_1 matrices kept as stored (4-bit
groups of 32, the file's own scales and minimums): the same text as the float32 checkpoint that
transformers converts from the file, on every placement.

Q4_1 maps onto flexoff's group-wise format exactly, so a matrix decoded on the device holds the
values transformers dequantized; the runs differ only in what the tiers hold (a quarter of the
bytes), so tokens are equal and log-probabilities equal within float32 rounding."""

from __future__ import annotations

import os

import pytest
import torch

from flexoff import LLM, CompressionConfig, Policy, SamplingParams, TierFractions

from .test_smollm2 import CHATS, PLAIN, assert_matches, hf_reference  # noqa: F401  (a fixture)

AS_STORED = CompressionConfig(bits=4, group_size=32)
ON_CPU = TierFractions(0, 1, 0)
PLACEMENTS = {
    "all-gpu-tier": Policy(gpu_batch_size=4),
    "weights-gpu-cpu-disk": Policy(gpu_batch_size=4, weights=TierFractions(0.3, 0.4, 0.3)),
    "two-gpu-batches-cpu-attention": Policy(gpu_batch_size=2, num_gpu_batches=2, weights=ON_CPU, cache=ON_CPU,
                                            cpu_attention=True),
    "compressed-cache-too": Policy(gpu_batch_size=4, weights=ON_CPU, compress_cache=CompressionConfig(8, 32)),
}
PARAMS = SamplingParams(max_new_tokens=20)


@pytest.mark.parametrize("name", [name for name in PLACEMENTS if name != "compressed-cache-too"])
def test_the_gguf_as_stored_generates_the_converted_checkpoints_text(smollm2_gguf, hf_reference, tmp_path, name):
    with LLM(str(smollm2_gguf), policy=PLACEMENTS[name], dtype="float32", offload_dir=str(tmp_path)) as llm:
        assert llm.policy.compress_weight == AS_STORED  # a policy without weight compression takes the file's
        plain = llm.generate(PLAIN, PARAMS)
        chats = llm.chat(CHATS, PARAMS)
    assert_matches(plain, hf_reference["plain"])
    assert_matches(chats, hf_reference["chat"])
    assert os.listdir(tmp_path) == []


def test_the_decoders_matrices_are_held_as_4_bit_codes(smollm2_gguf, smollm2_dir):
    """The store holds each decoder matrix as 4-bit codes with a float32 scale and minimum per 32
    values (float32 compute), where the checkpoint's are float32; the embedding (Q8_0 in the file,
    of another format than the layers') stays exact, as large as the checkpoint's."""
    from flexoff.models import stage_specs, stages

    sizes = {}
    for name, model in (("gguf", smollm2_gguf), ("checkpoint", smollm2_dir)):
        with LLM(str(model), policy=PLACEMENTS["all-gpu-tier"], dtype="float32") as llm:
            sizes[name] = sum(llm.engine.weights.bytes.values())
            config = llm.config
    matrices = sum(spec.numel for stage in stages(config) if stage.is_layer
                   for spec in stage_specs(config, stage) if len(spec.shape) == 2)
    assert sizes["checkpoint"] - sizes["gguf"] == matrices * 4 - matrices // 2 - matrices // 32 * 2 * 4


def test_a_compressed_cache_beside_stored_weights_matches_the_same_cache_on_the_checkpoint(
        smollm2_gguf, smollm2_dir, tmp_path):
    """Cache compression applies alike whether the weights came compressed or as floats."""
    policy = PLACEMENTS["compressed-cache-too"]
    outs = {}
    for name, model in (("gguf", smollm2_gguf), ("checkpoint", smollm2_dir)):
        with LLM(str(model), policy=policy, dtype="float32", offload_dir=str(tmp_path)) as llm:
            outs[name] = llm.generate(PLAIN, PARAMS)
    assert [o.token_ids for o in outs["gguf"]] == [o.token_ids for o in outs["checkpoint"]]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("name", ["all-gpu-tier", "weights-gpu-cpu-disk", "two-gpu-batches-cpu-attention"])
def test_on_cuda_the_gguf_as_stored_runs_as_the_checkpoint_in_the_same_dtype(smollm2_gguf, smollm2_dir, tmp_path,
                                                                               name, dtype):
    """On CUDA the file's matrices are decoded by the Triton kernel, from float16 scales (the file's
    own) into the compute dtype, in one rounding from their exact values: what casting the float32
    checkpoint to that dtype gives. So the two runs compute on the same weights, and agree."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    outs = {}
    for kind, model in (("gguf", smollm2_gguf), ("checkpoint", smollm2_dir)):
        with LLM(str(model), policy=PLACEMENTS[name], dtype=dtype, device="cuda",
                 offload_dir=str(tmp_path)) as llm:
            outs[kind] = llm.generate(PLAIN, PARAMS) + llm.chat(CHATS, PARAMS)
    assert [o.token_ids for o in outs["gguf"]] == [o.token_ids for o in outs["checkpoint"]]
    for ours, theirs in zip(outs["gguf"], outs["checkpoint"]):
        torch.testing.assert_close(torch.tensor(ours.logprobs), torch.tensor(theirs.logprobs), rtol=0, atol=1e-5)
