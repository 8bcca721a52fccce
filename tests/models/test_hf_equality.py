"""flexoff's own layer math against transformers on tiny random models of every supported shape."""

import pytest
import torch

from flexoff import LLM, SamplingParams
from tests.conftest import PROMPTS

MOE_KINDS = ["mixtral", "qwen3-moe", "qwen2-moe"]
KINDS = ["opt-pre", "opt-post-proj", "llama-gqa", "llama3-rope", "qwen2-bias", "qwen3-qk-norm", *MOE_KINDS]


def hf_greedy(model, tokenizer_ids, max_new_tokens):
    """transformers' greedy continuation of one unpadded prompt."""
    ids = torch.tensor([tokenizer_ids])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False, min_new_tokens=max_new_tokens, pad_token_id=0)
    return out[0, len(tokenizer_ids):].tolist()


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_tokens_match_transformers(tiny_model_dir, kind):
    path, hf = tiny_model_dir(kind)
    llm = LLM(str(path), policy=None)
    # transformers' min_new_tokens keeps EOS from being chosen; min_tokens does the same here.
    params = SamplingParams(max_new_tokens=10, min_tokens=10)
    outs = llm.generate(PROMPTS, params)
    for out in outs:
        assert out.token_ids == hf_greedy(hf, out.prompt_token_ids, 10), out.prompt


@pytest.mark.parametrize("kind", KINDS)
def test_batched_left_padded_generate_matches_transformers(tiny_model_dir, kind):
    """transformers' own left-padded batch agrees with flexoff's batch of mixed lengths."""
    from transformers import AutoTokenizer

    path, hf = tiny_model_dir(kind)
    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    ref = hf.generate(**enc, max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id)
    outs = LLM(str(path)).generate(PROMPTS, SamplingParams(max_new_tokens=8, min_tokens=8))
    width = enc["input_ids"].shape[1]
    assert [o.token_ids for o in outs] == ref[:, width:].tolist()


def assert_last_logits_match(llm, hf, tolerance: float) -> None:
    """flexoff's logits after each prompt equal transformers' on the unpadded prompt."""
    ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    ours = llm.next_token_logits(ids)
    for row, prompt_ids in enumerate(ids):
        with torch.no_grad():
            ref = hf(torch.tensor([prompt_ids])).logits[0, -1]
        torch.testing.assert_close(ours[row], ref, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("kind", KINDS)
def test_last_logits_match_within_1e4(tiny_model_dir, kind):
    path, hf = tiny_model_dir(kind)
    assert_last_logits_match(LLM(str(path)), hf, 1e-4)


@pytest.mark.parametrize("kind", ["opt-pre", "llama-gqa", *MOE_KINDS])
def test_bin_checkpoint_matches_safetensors(tiny_model_dir, kind):
    """For the mixtures of experts this is also the two expert layouts: save_pretrained writes each
    expert apart, while the .bin holds the state dict as transformers 5 keeps it, experts stacked."""
    st_path, _ = tiny_model_dir(kind, safetensors=True)
    bin_path, _ = tiny_model_dir(kind, safetensors=False)
    assert not list(bin_path.glob("*.safetensors"))
    if kind in MOE_KINDS:
        from safetensors import safe_open

        stacked = set(torch.load(bin_path / "pytorch_model.bin", weights_only=True))
        with safe_open(str(next(st_path.glob("*.safetensors"))), "pt") as f:
            apart = set(f.keys())
        assert any(key.endswith(".mlp.experts.gate_up_proj") for key in stacked), sorted(stacked)
        assert not any(".experts.gate_up_proj" in key for key in apart)
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    a = LLM(str(st_path)).generate(PROMPTS, params)
    b = LLM(str(bin_path)).generate(PROMPTS, params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]


def test_padding_never_changes_results(tiny_model_dir):
    """A prompt alone and the same prompt in a batch of longer ones give identical logprobs."""
    path, _ = tiny_model_dir("llama-gqa")
    llm = LLM(str(path))
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    alone = llm.generate([PROMPTS[1]], params)[0]
    batched = llm.generate(PROMPTS, params)[1]
    assert alone.token_ids == batched.token_ids
    torch.testing.assert_close(torch.tensor(alone.logprobs), torch.tensor(batched.logprobs), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["opt-post-proj", "qwen2-bias"])
def test_score_matches_transformers_logprobs(tiny_model_dir, kind):
    path, hf = tiny_model_dir(kind)
    llm = LLM(str(path))
    prompts = ["the cat", "a big red car moved"]
    conts = ["sat on the mat", "slowly"]
    scores = llm.score(prompts, conts)
    for prompt, score in zip(prompts, scores):
        prompt_ids = llm.tokenizer.encode(prompt)
        full = torch.tensor([prompt_ids + score.token_ids])
        with torch.no_grad():
            logprobs = torch.log_softmax(hf(full).logits[0].float(), dim=-1)
        n = len(score.token_ids)
        positions = range(len(prompt_ids) - 1, len(prompt_ids) - 1 + n)
        ref = [logprobs[p, t].item() for p, t in zip(positions, score.token_ids)]
        torch.testing.assert_close(torch.tensor(score.logprobs), torch.tensor(ref), rtol=1e-4, atol=1e-4)
