"""SmolLM2-135M-Instruct (tests/smollm2.py) in float16 and bfloat16, and on CUDA: flexoff's greedy
text against transformers' on the same device in the same dtype.

In float32 the tokens must be transformers' exactly (this prompt set's closest call between two
tokens is a gap of 0.005 in log-probability, far above float32's error). In float16 and bfloat16
two correct implementations may part ways at a near-tie, so the tokens must agree through each
prompt's decisive prefix (every step whose top-2 gap in the reference is wider than the dtype's
error); and teacher-forced, score() of transformers' whole continuation must give its
log-probabilities within the dtype's tolerance, near-ties or not. The CUDA cases run the
placements of the CPU tests (test_smollm2.py)."""

from __future__ import annotations

import os

import pytest
import torch

from flexoff import LLM
from tests.models.test_smollm2 import CHATS, NEW_TOKENS, PARAMS, PLACEMENTS, PLAIN, chat_ids, hf_greedy

# dtype -> (the top-2 gap at or below which a reference step is a near-tie, log-probability
# tolerance). On the CPU flexoff's bfloat16 log-probabilities were within 0.21 of transformers'
# (teacher-forced; 0.12 along its own tokens, which were all transformers'), its float16 ones
# within 0.03.
TOLERANCES = {"float32": (0.0, 1e-3), "float16": (0.25, 0.1), "bfloat16": (0.5, 0.4)}
HALF_PLACEMENTS = ["all-gpu-tier", "weights-partly-disk", "cache-cpu-attention", "everything-off-gpu-no-overlap"]
CUDA_CASES = [("float32", name) for name in PLACEMENTS] + [(dtype, name) for dtype in ("float16", "bfloat16")
                                                           for name in HALF_PLACEMENTS]
needs_cuda = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def reference(smollm2_dir):
    """reference(device, dtype): transformers' entries of PLAIN and CHATS there, as
    test_smollm2.hf_reference's, computed once each."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    prompts = {"plain": [tokenizer(p).input_ids for p in PLAIN], "chat": [chat_ids(tokenizer, c) for c in CHATS]}
    cache = {}

    def get(device: str, dtype: str):
        if (device, dtype) not in cache:
            model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=getattr(torch, dtype)).to(device).eval()
            cache[device, dtype] = {kind: [(ids, *hf_greedy(model, ids, NEW_TOKENS)) for ids in batch]
                                    for kind, batch in prompts.items()}
            del model
            if device == "cuda":
                torch.cuda.empty_cache()
        return cache[device, dtype]

    return get


def decisive(gaps: list[float], near_tie: float) -> int:
    """How many leading steps chose their token by more than ``near_tie``."""
    return next((i for i, gap in enumerate(gaps) if gap <= near_tie), len(gaps))


def assert_agrees(outs, reference, dtype: str) -> int:
    """Tokens equal through each prompt's decisive prefix, log-probabilities close there; returns how
    many tokens were compared."""
    near_tie, atol = TOLERANCES[dtype]
    compared = 0
    for out, (prompt_ids, tokens, logprobs, gaps) in zip(outs, reference, strict=True):
        assert out.prompt_token_ids == prompt_ids
        k = decisive(gaps, near_tie) if near_tie else len(tokens)
        assert out.token_ids[:k] == tokens[:k], (dtype, out.text)
        if k == len(tokens):
            assert out.token_ids == tokens  # nor does it go on past transformers' EOS
        torch.testing.assert_close(torch.tensor(out.logprobs[:k]), torch.tensor(logprobs[:k]), rtol=0, atol=atol)
        compared += k
    return compared


def check_agreement(smollm2_dir, reference, offload_dir, device: str, dtype: str, name: str) -> None:
    expected = reference(device, dtype)
    with LLM(str(smollm2_dir), policy=PLACEMENTS[name], device=device, dtype=dtype,
             offload_dir=str(offload_dir)) as llm:
        plain = llm.generate(PLAIN, PARAMS)
        chats = llm.chat(CHATS, PARAMS)
        everything = expected["plain"] + expected["chat"]
        scores = llm.score([ids for ids, *_ in everything], [tokens for _, tokens, *_ in everything])
    compared = assert_agrees(plain, expected["plain"], dtype) + assert_agrees(chats, expected["chat"], dtype)
    total = sum(len(tokens) for _, tokens, *_ in everything)
    assert compared == total if dtype == "float32" else compared >= 5  # never a vacuous comparison
    atol = TOLERANCES[dtype][1]
    for score, (_, tokens, logprobs, _) in zip(scores, everything, strict=True):
        assert score.token_ids == tokens
        torch.testing.assert_close(torch.tensor(score.logprobs), torch.tensor(logprobs), rtol=0, atol=atol)
    assert os.listdir(offload_dir) == []


def test_bfloat16_on_cpu_agrees_with_transformers(smollm2_dir, reference, tmp_path):
    check_agreement(smollm2_dir, reference, tmp_path, "cpu", "bfloat16", "cache-cpu-attention")


@pytest.mark.parametrize(("dtype", "name"), [pytest.param(*case, marks=needs_cuda) for case in CUDA_CASES])
def test_cuda_greedy_agrees_with_transformers(smollm2_dir, reference, tmp_path, dtype, name):
    check_agreement(smollm2_dir, reference, tmp_path, "cuda", dtype, name)
