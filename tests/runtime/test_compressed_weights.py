"""Compressed weights: every placement gives the tokens of the same compression all on the device,
the stored bytes really shrink, and compression really changes the numbers."""

import os

import pytest
import torch

from flexoff import LLM, CompressionConfig, Policy, SamplingParams, TierFractions
from tests.conftest import PROMPTS

# The tiny models' rows are 32 or 40 wide; a group of 16 leaves a short last group in some.
FOUR_BIT = CompressionConfig(bits=4, group_size=16)
PARAMS = SamplingParams(max_new_tokens=6, ignore_eos=True)

# Mixtral and Qwen2-MoE: experts stacked in 3-D tensors are compressed, the router is kept exact.
COMPRESSED_KINDS = ["opt-pre", "llama-gqa", "mixtral", "qwen2-moe"]

PLACEMENTS = {
    "gpu": TierFractions(1, 0, 0),
    "cpu": TierFractions(0, 1, 0),
    "disk": TierFractions(0, 0, 1),
    "mixed": TierFractions(0.3, 0.5, 0.2),
}


@pytest.fixture(scope="module")
def compressed_reference(tiny_model_dir):
    refs = {}
    for kind in COMPRESSED_KINDS:
        path, _ = tiny_model_dir(kind)
        refs[kind] = LLM(str(path), policy=Policy(gpu_batch_size=8, compress_weight=FOUR_BIT)).generate(
            PROMPTS, PARAMS)
    return refs


@pytest.mark.parametrize("kind", COMPRESSED_KINDS)
@pytest.mark.parametrize("placement", list(PLACEMENTS))
@pytest.mark.parametrize("batches,cpu_attention", [(1, False), (3, True), (3, False)])
def test_compressed_placements_match(tiny_model_dir, compressed_reference, tmp_path, kind, placement, batches,
                                     cpu_attention):
    """One GPU batch and CPU attention dequantize per read; several batches share a stage's."""
    path, _ = tiny_model_dir(kind)
    policy = Policy(gpu_batch_size=2, num_gpu_batches=batches, weights=PLACEMENTS[placement],
                    cache=TierFractions(0, 1, 0), cpu_attention=cpu_attention, compress_weight=FOUR_BIT)
    with LLM(str(path), policy=policy, offload_dir=str(tmp_path)) as llm:
        outs = llm.generate(PROMPTS, PARAMS)
    ref = compressed_reference[kind]
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    torch.testing.assert_close(torch.tensor([o.logprobs for o in outs]), torch.tensor([o.logprobs for o in ref]),
                               rtol=1e-4, atol=1e-5)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("cpu_attention", [False, True])
def test_gpu_batches_share_each_stages_dequantization(tiny_model_dir, monkeypatch, cpu_attention):
    """Three GPU batches in one block dequantize each matrix once per stage and token, as one batch
    per block does, with CPU attention too (alternate stages in two buffers)."""
    from flexoff.runtime import weight_store

    calls = []
    real = weight_store.dequantize
    monkeypatch.setattr(weight_store, "dequantize", lambda *a, **k: calls.append(1) or real(*a, **k))
    path, _ = tiny_model_dir("opt-pre")
    counts = {}
    for batches in (1, 3):
        calls.clear()
        policy = Policy(gpu_batch_size=2, num_gpu_batches=batches, cache=TierFractions(0, 1, 0),
                        cpu_attention=cpu_attention, compress_weight=FOUR_BIT)
        LLM(str(path), policy=policy).generate(PROMPTS, PARAMS)  # five prompts: 3 blocks of one batch, or one of three
        counts[batches] = len(calls)
    assert counts[1] > 0
    assert counts[3] == counts[1] // 3


@pytest.mark.parametrize("kind", ["llama-gqa", "mixtral"])
def test_compression_changes_logits_but_little_at_8_bits(tiny_model_dir, kind):
    path, _ = tiny_model_dir(kind)
    ids = [[5, 9, 13, 20, 7], [6, 30, 11]]
    plain = LLM(str(path)).next_token_logits(ids)
    eight = LLM(str(path), policy=Policy(compress_weight=CompressionConfig(8, 16))).next_token_logits(ids)
    two = LLM(str(path), policy=Policy(compress_weight=CompressionConfig(2, 16))).next_token_logits(ids)
    assert not torch.equal(plain, eight)
    close = torch.corrcoef(torch.stack([plain.flatten(), eight.flatten()]))[0, 1]
    far = torch.corrcoef(torch.stack([plain.flatten(), two.flatten()]))[0, 1]
    assert close > 0.999
    assert far < close


def test_stored_bytes_shrink(tmp_path):
    """4-bit weights in groups of 64 take about 4.5/16 of their fp16 bytes on the CPU tier."""
    policy = Policy(weights=TierFractions(0, 1, 0))
    plain = LLM("opt-125m", dummy=True, dtype="float16", policy=policy)
    packed = LLM("opt-125m", dummy=True, dtype="float16",
                 policy=Policy(weights=TierFractions(0, 1, 0), compress_weight=CompressionConfig(4, 64)))
    ratio = packed.engine.weights.bytes["cpu"] / plain.engine.weights.bytes["cpu"]
    assert 4.5 / 16 <= ratio < 4.5 / 16 + 0.01  # norms and biases stay fp16


def test_bad_compression_settings_are_refused():
    from flexoff.errors import PolicyError

    with pytest.raises(PolicyError, match="5-bit"):
        Policy(compress_weight=CompressionConfig(bits=5))
    with pytest.raises(PolicyError, match="group size"):
        Policy(compress_cache=CompressionConfig(bits=4, group_size=1))
