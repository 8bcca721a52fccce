"""Accuracy of group-wise compression on a small language model trained here, on generated stories.

A 2-layer Llama (head_dim 64, so groups of 64 run along each head) learns the story grammar of
:mod:`.stories` for a fixed number of steps, is saved with ``save_pretrained`` and loaded into
flexoff. Its held-out perplexity is measured three ways: uncompressed fp16, 4-bit weights with a
4-bit cache, and 2-bit weights with a 2-bit cache.

Perplexity must come from decoding, not only from ``score``: ``score`` is one prefill, which
attends on the fresh keys and values, so only decode steps read the (compressed) cache. The
held-out tokens are fed back one by one as if they had been sampled (teacher forcing), so each
decode step gives the log-probability of the true next token given every true token before it,
with the earlier ones read from the cache. That needs the engine's block API, below ``LLM``
(``bench/teacher_forcing.py``, which bench/accuracy.py runs on a trained model too).
"""

from __future__ import annotations

import math
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

from flexoff import LLM, CompressionConfig, Policy

from .stories import build_tokenizer, corpus, train_llama

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.teacher_forcing import decode_logprobs, one_thread, perplexity  # noqa: E402

pytestmark = pytest.mark.slow

TRAIN_STORIES = 1500  # ~160k tokens, ~0.7 MB of text, made on the fly
HELD_OUT_STORIES = 64
TRAIN_STEPS = 800  # about a minute of CPU time; a fixed count, so the model is the same on any machine
PROMPT_TOKENS = 8  # "<s> NAME lived in CITY with a PET ." (or "with two PETS")
SCORED_TOKENS = 80  # every held-out story has more than PROMPT_TOKENS + SCORED_TOKENS tokens
DTYPE = torch.float16
FP16_BOUND = 1.05  # held-out perplexity within 5% of fp16: 4-bit must pass this bar, and 2-bit must fail it


@pytest.fixture(scope="session")
def story_model(tmp_path_factory):
    """(checkpoint directory, held-out token lists, unigram perplexity of the held-out tokens)."""
    directory = tmp_path_factory.mktemp("story-llama")
    texts = corpus(TRAIN_STORIES, seed=0)
    tokenizer = build_tokenizer(directory, texts)
    eos = tokenizer.eos_token_id
    stream = [token for text in texts for token in [*tokenizer(text)["input_ids"], eos]]  # each starts with <s>

    held_out_texts = corpus(HELD_OUT_STORIES, seed=1)
    assert not set(held_out_texts) & set(texts), "held-out stories must not appear in the training text"
    held_out = [tokenizer(text)["input_ids"] for text in held_out_texts]
    assert min(map(len, held_out)) > PROMPT_TOKENS + SCORED_TOKENS
    held_out = [ids[:PROMPT_TOKENS + SCORED_TOKENS] for ids in held_out]

    # A context-free baseline: the training text's token frequencies, over the same scored tokens.
    counts = Counter(stream)
    unigram = perplexity([[math.log(counts[t] / len(stream)) for t in ids[PROMPT_TOKENS:]] for ids in held_out])

    start = time.perf_counter()
    with one_thread():
        loss = train_llama(directory, torch.tensor(stream), len(tokenizer), steps=TRAIN_STEPS, seed=0)
    print(f"\ntrained {TRAIN_STEPS} steps on {len(stream)} tokens in {time.perf_counter() - start:.1f} s; "
          f"final training loss {loss:.3f}")
    return directory, held_out, unigram


def measure(directory, held_out: list[list[int]], weight_bits: int | None, cache_bits: int | None):
    """Held-out log-probabilities under one compression setting: (from score, from teacher-forced decode)."""
    policy = Policy(
        gpu_batch_size=32, num_gpu_batches=2,
        compress_weight=CompressionConfig(weight_bits, 64) if weight_bits else None,
        compress_cache=CompressionConfig(cache_bits, 64) if cache_bits else None,
    )
    prompts = [ids[:PROMPT_TOKENS] for ids in held_out]
    targets = [ids[PROMPT_TOKENS:] for ids in held_out]
    with LLM(str(directory), policy=policy, dtype=DTYPE) as llm:
        scored = [out.logprobs for out in llm.score(prompts, targets)]
        decoded = decode_logprobs(llm, prompts, targets)
    return scored, decoded


@pytest.fixture(scope="session")
def measurements(story_model):
    directory, held_out, _ = story_model
    settings = {"fp16": (None, None), "4-bit": (4, 4), "2-bit": (2, 2), "2-bit cache only": (None, 2)}
    start = time.perf_counter()
    with one_thread():
        results = {name: measure(directory, held_out, *bits) for name, bits in settings.items()}
    print(f"held-out perplexity ({time.perf_counter() - start:.1f} s)   score   decode")
    for name, (scored, decoded) in results.items():
        print(f"  {name:<27} {perplexity(scored):7.4f}  {perplexity(decoded):7.4f}")
    return results


def test_the_model_learned_the_stories(story_model, measurements):
    # Without this, "4-bit is as good as fp16" could just mean both are as bad as chance.
    _, _, unigram = story_model
    fp16 = perplexity(measurements["fp16"][1])
    print(f"unigram perplexity {unigram:.2f}, model {fp16:.4f}")
    assert fp16 < unigram / 5


def test_teacher_forced_decoding_measures_held_out_perplexity(measurements):
    # Uncompressed, decoding with the true tokens fed back must give the prefill's log-probabilities:
    # then the decode figures below are held-out perplexity, only read through the cache.
    scored, decoded = measurements["fp16"]
    torch.testing.assert_close(torch.tensor(decoded), torch.tensor(scored), rtol=0, atol=0.05)


def test_four_bit_weights_and_cache_keep_perplexity_within_five_percent_of_fp16(measurements):
    fp16_scored, fp16 = measurements["fp16"]
    scored, decoded = measurements["4-bit"]
    assert decoded != fp16, "4-bit compression changed nothing: is it applied at all?"
    assert perplexity(decoded) <= FP16_BOUND * perplexity(fp16)
    assert perplexity(scored) <= FP16_BOUND * perplexity(fp16_scored)


def test_two_bit_weights_and_cache_miss_the_bar(measurements):
    # If 2-bit passed too, the bar (or this measurement) would be too blunt to vouch for 4-bit.
    fp16 = perplexity(measurements["fp16"][1])
    assert perplexity(measurements["2-bit"][1]) > FP16_BOUND * fp16
    assert perplexity(measurements["2-bit"][0]) > perplexity(measurements["fp16"][0])


def test_decode_reads_the_compressed_cache(measurements):
    # Weights uncompressed, cache at 2 bits: decoding gets worse, so the decode figures above do
    # include the cache's error, not only the weights'.
    fp16 = perplexity(measurements["fp16"][1])
    assert perplexity(measurements["2-bit cache only"][1]) > 1.01 * fp16
