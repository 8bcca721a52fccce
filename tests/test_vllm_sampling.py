"""vLLM's sampling parameters, token for token against transformers' generate and logits processors
(and, for the presence and frequency penalties, which transformers lacks, against vLLM's formula)."""

import pytest
import torch

from flexoff import LLM, SamplingParams
from tests.conftest import PROMPTS

KINDS = ["llama-gqa", "opt-pre"]
EOS = 2  # both tiny families' end-of-sequence id


@pytest.fixture(scope="module", params=KINDS)
def model(request, tiny_model_dir):
    """(LLM, the same weights in transformers, its tokenizer), closed after the module."""
    from transformers import AutoTokenizer

    path, hf = tiny_model_dir(request.param)
    llm = LLM(model=str(path), dtype="float32")
    yield llm, hf, AutoTokenizer.from_pretrained(path)
    llm.close()


def hf_generate(hf, prompt_ids: list[int], max_tokens: int, **kwargs) -> list[int]:
    """transformers' greedy continuation with its logits processors (kwargs), EOS included."""
    kwargs.setdefault("eos_token_id", EOS)
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt_ids]), max_new_tokens=max_tokens, do_sample=False, pad_token_id=0,
                          **kwargs)
    return out[0, len(prompt_ids):].tolist()


def hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits at every position of ``ids``: (len(ids), vocab)."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


def vllm_penalised_greedy(hf, prompt_ids: list[int], max_tokens: int, presence: float, frequency: float,
                          repetition: float) -> list[int]:
    """Greedy decoding under vLLM's documented penalties: repetition over prompt and output tokens
    (positive logits divided, others multiplied), then frequency × count and presence × seen over
    output tokens only, subtracted."""
    out: list[int] = []
    for _ in range(max_tokens):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt_ids + out])).logits[0, -1].float()
        for token in set(prompt_ids + out):
            logits[token] = logits[token] / repetition if logits[token] > 0 else logits[token] * repetition
        for token in set(out):
            logits[token] -= frequency * out.count(token) + presence
        out.append(int(logits.argmax()))
        if out[-1] == EOS:
            break
    return out


def generated(llm, params: SamplingParams) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]


@pytest.mark.parametrize("penalty", [1.6, 0.6])
def test_repetition_penalty_is_transformers(model, penalty):
    llm, hf, _ = model
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=12, repetition_penalty=penalty))
    for out in outs:
        assert out.outputs[0].token_ids == hf_generate(hf, out.prompt_token_ids, 12, repetition_penalty=penalty)
    assert generated(llm, SamplingParams(max_tokens=12)) != [o.token_ids for o in outs]


@pytest.mark.parametrize("presence,frequency,repetition", [(1.5, 0.0, 1.0), (0.0, 1.2, 1.0), (-0.8, 0.6, 1.3),
                                                            (0.4, -1.0, 1.0)])
def test_presence_and_frequency_penalties_follow_vllms_formula(model, presence, frequency, repetition):
    llm, hf, _ = model
    params = SamplingParams(max_tokens=12, presence_penalty=presence, frequency_penalty=frequency,
                            repetition_penalty=repetition)
    outs = llm.generate(PROMPTS, params)
    for out in outs:
        assert out.token_ids == vllm_penalised_greedy(hf, out.prompt_token_ids, 12, presence, frequency, repetition)
    assert generated(llm, SamplingParams(max_tokens=12)) != [o.token_ids for o in outs]


def test_min_tokens_masks_eos_and_stop_ids_as_transformers_min_new_tokens(model):
    llm, hf, _ = model
    free = llm.generate(PROMPTS, SamplingParams(max_tokens=10, ignore_eos=True))
    # A token each prompt's greedy text holds early stands in as a stop id.
    stop_ids = sorted({o.token_ids[1] for o in free})
    plain = llm.generate(PROMPTS, SamplingParams(max_tokens=10, stop_token_ids=stop_ids))
    held = llm.generate(PROMPTS, SamplingParams(max_tokens=10, stop_token_ids=stop_ids, min_tokens=5))
    for short, out in zip(plain, held):
        expected = hf_generate(hf, out.prompt_token_ids, 10, min_new_tokens=5, eos_token_id=[EOS, *stop_ids])
        assert out.token_ids == expected
        assert len(out.token_ids) >= 5 and not set(out.token_ids[:5]) & {EOS, *stop_ids}
        assert out.finish_reason == ("stop" if expected[-1] in (EOS, *stop_ids) else "length")
    assert any(len(o.token_ids) < 5 for o in plain)  # without min_tokens, some stop sooner


def test_min_p_keeps_greedy_and_bounds_what_is_sampled(model):
    llm, hf, _ = model
    assert generated(llm, SamplingParams(max_tokens=8, min_p=0.9)) == generated(llm, SamplingParams(max_tokens=8))
    # Sampled under min_p, every token is one transformers' MinPLogitsWarper keeps at that step.
    from transformers.generation.logits_process import MinPLogitsWarper

    temperature, min_p = 1.0, 0.6
    outside = 0
    for chosen in (min_p, 0.0):
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=temperature, min_p=chosen, seed=4,
                                                    ignore_eos=True))
        for out in outs:
            ids = out.prompt_token_ids + out.token_ids
            logits = hf_logprobs(hf, ids)[len(out.prompt_token_ids) - 1:-1] / temperature
            kept = torch.isfinite(MinPLogitsWarper(min_p)(None, logits)).gather(1, torch.tensor(out.token_ids)[:, None])
            if chosen:
                assert kept.all()
            else:
                outside += int((~kept).sum())
    assert outside > 0  # without min_p, the same seeds do sample tokens min_p drops


@pytest.mark.parametrize("temperature", [0.0, 3.0])
def test_logprobs_are_the_sampled_token_and_the_top_k_of_transformers(model, temperature):
    llm, hf, tok = model
    k = 4
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=temperature, logprobs=k, seed=3,
                                                ignore_eos=True))
    sizes = set()
    for out in outs:
        completion = out.outputs[0]
        reference = hf_logprobs(hf, out.prompt_token_ids + completion.token_ids)[len(out.prompt_token_ids) - 1:-1]
        assert len(completion.logprobs) == len(completion.token_ids)
        for token, entry, row in zip(completion.token_ids, completion.logprobs, reference):
            values, ids = torch.topk(row, k)
            assert list(entry)[0] == token and set(entry) == {token, *ids.tolist()}
            sizes.add(len(entry))
            for rank, (i, v) in enumerate(zip(ids.tolist(), values.tolist()), 1):
                assert entry[i].logprob == pytest.approx(v, abs=1e-4)
                assert entry[i].decoded_token == (tok.convert_ids_to_tokens(i) or "")  # "" past the tokenizer's ids
                if i != token:
                    assert entry[i].rank == rank
            assert entry[token].rank == int((row >= row[token] - 1e-6).sum())
            assert entry[token].logprob == pytest.approx(row[token].item(), abs=1e-4)
        assert out.top_logprobs is completion.logprobs
        assert completion.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in
                                                                  zip(completion.token_ids, completion.logprobs)))
    # Greedy tokens are each the likeliest; sampled ones at a high temperature are sometimes outside the top k.
    assert sizes == ({k} if temperature == 0 else {k, k + 1})


def test_prompt_logprobs_are_transformers_per_prompt_token(model):
    llm, hf, tok = model
    outs = llm.generate(PROMPTS, [SamplingParams(max_tokens=2, prompt_logprobs=3), SamplingParams(max_tokens=2)]
                        + [SamplingParams(max_tokens=2, prompt_logprobs=0)] * (len(PROMPTS) - 2))
    assert outs[1].prompt_logprobs is None
    for out, k in zip(outs, [3, None, 0, 0, 0]):
        if k is None:
            continue
        ids = out.prompt_token_ids
        reference = hf_logprobs(hf, ids)
        assert len(out.prompt_logprobs) == len(ids) and out.prompt_logprobs[0] is None
        for position, entry in enumerate(out.prompt_logprobs[1:], 1):
            row, token = reference[position - 1], ids[position]
            values, top = torch.topk(row, k)
            assert list(entry)[0] == token and set(entry) == {token, *top.tolist()}
            assert entry[token].logprob == pytest.approx(row[token].item(), abs=1e-4)
            assert entry[token].rank == int((row >= row[token] - 1e-6).sum())
            assert entry[token].decoded_token == (tok.convert_ids_to_tokens(token) or "")
            for i, v in zip(top.tolist(), values.tolist()):
                assert entry[i].logprob == pytest.approx(v, abs=1e-4)


def test_n_samples_differ_are_seeded_and_each_a_sample(model):
    llm, hf, _ = model
    params = SamplingParams(n=4, max_tokens=8, temperature=1.0, seed=5, ignore_eos=True)
    outs = llm.generate(PROMPTS[:3], params)
    again = llm.generate(PROMPTS[:3], params)
    for out, repeat in zip(outs, again):
        samples = [c.token_ids for c in out.outputs]
        assert [c.index for c in out.outputs] == [0, 1, 2, 3]
        assert len({tuple(s) for s in samples}) == 4
        assert samples == [c.token_ids for c in repeat.outputs]
        assert (out.text, out.token_ids) == (out.outputs[0].text, out.outputs[0].token_ids)
        for completion in out.outputs:  # a valid sample: its tokens, scored by transformers
            reference = hf_logprobs(hf, out.prompt_token_ids + completion.token_ids)[len(out.prompt_token_ids) - 1:-1]
            expected = reference.gather(1, torch.tensor(completion.token_ids)[:, None]).sum().item()
            assert completion.cumulative_logprob == pytest.approx(expected, abs=1e-3)
    # Sample j is what seed + j gives alone (as vLLM seeds n samples).
    for j in range(4):
        alone = llm.generate(PROMPTS[1], SamplingParams(max_tokens=8, temperature=1.0, seed=5 + j, ignore_eos=True))
        assert alone[0].token_ids == outs[1].outputs[j].token_ids


def test_n_without_a_seed_differs_per_sample_and_greedy_repeats(model):
    llm, _, _ = model
    sampled = llm.generate(PROMPTS[:2], SamplingParams(n=3, max_tokens=8, temperature=1.0, ignore_eos=True))
    assert all(len({tuple(c.token_ids) for c in out.outputs}) == 3 for out in sampled)
    greedy = llm.generate(PROMPTS[:2], SamplingParams(n=2, max_tokens=8, prompt_logprobs=1))
    for out, single in zip(greedy, llm.generate(PROMPTS[:2], SamplingParams(max_tokens=8, prompt_logprobs=1))):
        assert [c.token_ids for c in out.outputs] == [single.token_ids] * 2
        assert out.prompt_logprobs == single.prompt_logprobs and len(out.prompt_logprobs) == len(out.prompt_token_ids)


def test_samples_of_a_prompt_split_over_blocks_come_back_together(tiny_model_dir):
    from flexoff import Policy

    path, _ = tiny_model_dir("llama-gqa")
    seen = []
    params = SamplingParams(n=3, max_tokens=4, temperature=1.0, seed=9, ignore_eos=True)
    with LLM(str(path), policy=Policy(gpu_batch_size=2), dtype="float32") as small:
        outs = small.generate(PROMPTS[:3], params, on_block=lambda block, _: seen.append([o.index for o in block]))
    with LLM(str(path), dtype="float32") as large:
        whole = large.generate(PROMPTS[:3], params)
    assert sorted(i for block in seen for i in block) == [0, 1, 2] and len(seen) > 1
    assert [[c.token_ids for c in o.outputs] for o in outs] == [[c.token_ids for c in o.outputs] for o in whole]


def test_a_stop_string_before_min_tokens_does_not_stop(model):
    llm, _, tok = model
    free = llm.generate(PROMPTS[0], SamplingParams(max_tokens=10, ignore_eos=True))[0]
    stop = tok.decode([free.token_ids[0]])
    out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=10, ignore_eos=True, stop=[stop], min_tokens=3))[0]
    # Only a stop string ending in the third token's text or later stops it.
    cut = free.text.find(stop, len(tok.decode(free.token_ids[:2])) - len(stop) + 1)
    if cut < 0:
        assert (out.token_ids, out.finish_reason, out.text) == (free.token_ids, "length", free.text)
    else:
        assert out.finish_reason == "stop" and out.text == free.text[:cut] and len(out.token_ids) >= 3


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
def test_on_cuda_penalties_match_the_cpu_and_seeded_samples_ignore_their_batch(tiny_model_dir, kind):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    path, _ = tiny_model_dir(kind)
    greedy = SamplingParams(max_tokens=12, repetition_penalty=1.3, presence_penalty=0.7, frequency_penalty=0.4,
                            min_tokens=3, logprobs=2)
    sampled = SamplingParams(n=3, max_tokens=12, temperature=0.9, top_p=0.9, min_p=0.05, seed=5,
                             repetition_penalty=1.2, ignore_eos=True)
    with LLM(str(path), dtype="float32", device="cpu") as cpu:
        expected = [o.token_ids for o in cpu.generate(PROMPTS, greedy)]
    with LLM(str(path), dtype="float32", device="cuda") as gpu:
        outs = gpu.generate(PROMPTS, greedy)
        together = gpu.generate(PROMPTS, sampled)
        alone = gpu.generate(PROMPTS[2], sampled)[0]
    assert [o.token_ids for o in outs] == expected
    assert all(len(o.outputs[0].logprobs) == len(o.token_ids) for o in outs)
    assert [c.token_ids for c in together[2].outputs] == [c.token_ids for c in alone.outputs]
    assert len({tuple(c.token_ids) for c in alone.outputs}) == 3
