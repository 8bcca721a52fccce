"""The Python API checks its arguments up front and raises flexoff's errors, which are also the
ValueError or TypeError a Python user expects."""

import math

import pytest
import torch

from flexoff import LLM, CompressionConfig, Policy, SamplingParams, TierFractions
from flexoff.errors import ClosedError, FlexoffError, TokenizerError


@pytest.mark.parametrize("kwargs, kind, message", [
    (dict(top_p="x"), TypeError, "top_p"),
    (dict(top_p=1.5), ValueError, r"top_p must be a number in \(0, 1\]"),
    (dict(top_p=math.nan), ValueError, "top_p"),
    (dict(temperature=math.inf), ValueError, "temperature must be a finite number"),
    (dict(temperature="0.5"), TypeError, "temperature"),
    (dict(top_k=True), TypeError, "top_k"),
    (dict(top_k=2.0), TypeError, "top_k"),
    (dict(max_new_tokens=8.0), TypeError, "max_new_tokens"),
    (dict(seed="abc"), TypeError, "seed"),
    (dict(seed=-1), ValueError, "seed"),
    (dict(seed=2**64), ValueError, "seed"),
    (dict(seed=1.0), TypeError, "seed"),
    (dict(stop=5), TypeError, "stop"),
    (dict(stop=["a", 3]), TypeError, "stop"),
    (dict(stop=["a", ""]), ValueError, "non-empty"),
    (dict(ignore_eos="no"), TypeError, "ignore_eos"),
])
def test_sampling_params_are_checked_on_construction(kwargs, kind, message):
    with pytest.raises(kind, match=message) as info:
        SamplingParams(**kwargs)
    assert isinstance(info.value, FlexoffError)


def test_the_largest_seed_samples():
    from flexoff.checks import MAX_SEED
    from types import SimpleNamespace

    from flexoff.runtime.sampler import BatchSampler

    row = SimpleNamespace(params=SamplingParams(temperature=1.0, seed=MAX_SEED), seed=MAX_SEED, prompt_ids=[1])
    choice = BatchSampler([row], [], 10, torch.device("cpu")).choose(torch.randn(1, 10), [True])
    assert 0 <= choice.tokens[0] < 10


@pytest.mark.parametrize("make, kind, message", [
    (lambda: Policy(gpu_batch_size=2.0), TypeError, "gpu_batch_size"),
    (lambda: Policy(num_gpu_batches=True), TypeError, "num_gpu_batches"),
    (lambda: Policy(cpu_attention="no"), TypeError, "cpu_attention must be true or false"),
    (lambda: Policy(overlap=1), TypeError, "overlap"),
    (lambda: Policy(weights={"gpu": 1.0}), TypeError, "weights must be a TierFractions"),
    (lambda: Policy(compress_cache=4), TypeError, "compress_cache"),
    (lambda: TierFractions("1", 0, 0), TypeError, "gpu"),
    (lambda: TierFractions(math.nan, 1, 0), ValueError, "finite"),
    (lambda: TierFractions(0.5, 0.4, 0), ValueError, "sum to 0.9"),
    (lambda: CompressionConfig(bits=4.0), TypeError, "bits"),
    (lambda: CompressionConfig(bits=5), ValueError, "5-bit"),
    (lambda: CompressionConfig(group_size=True), TypeError, "group size"),
    (lambda: CompressionConfig(group_size=1), ValueError, "group size"),
])
def test_policy_parts_are_checked_on_construction(make, kind, message):
    with pytest.raises(kind, match=message) as info:
        make()
    assert isinstance(info.value, FlexoffError)


@pytest.mark.parametrize("kwargs, kind, message", [
    (dict(device="tpu"), ValueError, "unknown device 'tpu'"),
    (dict(device=torch.device("meta")), ValueError, "unknown device 'meta'"),
    (dict(device=0), TypeError, "device"),
    (dict(dtype="int8"), ValueError, "unknown dtype"),
    (dict(dtype=torch.int8), ValueError, "unsupported dtype"),
    (dict(dtype=16), TypeError, "dtype"),
    (dict(seed="abc"), TypeError, "seed"),
    (dict(seed=-1), ValueError, "seed"),
    (dict(seed=2**64), ValueError, "seed"),
    (dict(dummy="yes"), TypeError, "dummy"),
    (dict(policy=5), TypeError, "policy"),
    (dict(tokenizer=5), TypeError, "tokenizer"),
    (dict(offload_dir=["x"]), TypeError, "offload_dir"),
    (dict(gpu_mem="lots"), ValueError, "cannot parse size"),
    (dict(gpu_mem=0), ValueError, "gpu_mem"),
    (dict(cpu_mem=math.nan), ValueError, "cpu_mem"),
    (dict(cpu_mem=[1]), TypeError, "cpu_mem"),
])
def test_llm_arguments_are_checked_before_loading(kwargs, kind, message):
    with pytest.raises(kind, match=message) as info:
        LLM("opt-125m", **{"dummy": True, **kwargs})
    assert isinstance(info.value, FlexoffError)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    with LLM(str(tiny_model_dir("opt-pre")[0])) as model:
        yield model


@pytest.mark.parametrize("call, kind, message", [
    (lambda m: m.generate(["the cat", 5]), TypeError, "prompt 1 must be text or a list of token ids"),
    (lambda m: m.generate(5), TypeError, "prompts must be a list"),
    (lambda m: m.generate(None), TypeError, "prompts must be a list"),
    (lambda m: m.generate([[5, "6"]]), TypeError, "prompt 0 .*holds '6'"),
    (lambda m: m.generate([[5, True]]), TypeError, "prompt 0"),
    (lambda m: m.generate([[]]), ValueError, "prompt 0 is an empty token list"),
    (lambda m: m.generate([[5, 10_000]]), ValueError, "vocabulary"),
    (lambda m: m.generate(["a dog"], params=[1]), TypeError, "params must be a SamplingParams"),
    (lambda m: m.generate(["a dog"], params={"max_new_tokens": 2}), TypeError, "params"),
    (lambda m: m.generate(["a dog"], progress="yes"), TypeError, "progress"),
    (lambda m: m.generate(["a dog"], on_block=3), TypeError, "on_block"),
    (lambda m: m.next_token_logits("a dog"), TypeError, "prompts must be a list"),
    (lambda m: m.score(["a dog"], 5), TypeError, "continuations must be a list"),
    (lambda m: m.score(["a dog"], [7]), TypeError, "continuation 0"),
    (lambda m: m.score(["a dog", "the cat"], ["sat"]), ValueError, "one continuation per prompt"),
])
def test_calls_check_their_arguments(llm, call, kind, message):
    with pytest.raises(kind, match=message) as info:
        call(llm)
    assert isinstance(info.value, FlexoffError)


def test_calls_after_close_raise_a_clear_error(tiny_model_dir):
    llm = LLM(str(tiny_model_dir("opt-pre")[0]))
    assert len(llm.generate(["the cat"], SamplingParams(max_new_tokens=2))) == 1
    llm.close()
    llm.close()  # twice is fine
    for call in (lambda: llm.generate(["the cat"]), lambda: llm.next_token_logits(["the cat"]),
                 lambda: llm.score(["the cat"], ["sat"])):
        with pytest.raises(ClosedError, match="this LLM is closed"):
            call()


def test_a_tokenizer_path_that_does_not_exist_is_named(tmp_path):
    with pytest.raises(TokenizerError, match=f"tokenizer '{tmp_path / 'no'}' does not exist"):
        LLM("opt-125m", dummy=True, tokenizer=str(tmp_path / "no"))
    with pytest.raises(TokenizerError, match="has no tokenizer files"):
        LLM("opt-125m", dummy=True, tokenizer=str(tmp_path))
    (tmp_path / "file").write_text("x")
    with pytest.raises(TokenizerError, match="is not a directory"):
        LLM("opt-125m", dummy=True, tokenizer=str(tmp_path / "file"))

