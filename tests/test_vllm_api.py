"""Code written against vLLM's offline API runs with only the import line changed; tokens are
checked against Hugging Face transformers' greedy generation."""

import dataclasses

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
    llm = LLM(model=str(path), dtype="float32")  # vLLM's keyword; float32 on any device, as transformers here
    yield llm, hf, AutoTokenizer.from_pretrained(path)
    llm.close()


def hf_greedy(hf, prompt_ids: list[int], max_tokens: int, stop_ids: list[int]) -> list[int]:
    """transformers' greedy continuation, ending at (and keeping) EOS or any of ``stop_ids``."""
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt_ids]), max_new_tokens=max_tokens, do_sample=False,
                          eos_token_id=[EOS, *stop_ids], pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def hf_logprob_sum(hf, prompt_ids: list[int], token_ids: list[int]) -> float:
    with torch.no_grad():
        logits = hf(torch.tensor([prompt_ids + token_ids])).logits[0, len(prompt_ids) - 1:-1]
    return torch.log_softmax(logits.double(), -1).gather(1, torch.tensor(token_ids)[:, None]).sum().item()


def first_new_token(ids: list[int]) -> tuple[int, int]:
    """(position, token) of the first token after the first that none before it equals."""
    return next((i, t) for i, t in enumerate(ids) if i > 0 and t not in ids[:i] and t != EOS)


def test_a_vllm_script_runs_and_agrees_with_transformers(model):
    llm, hf, tok = model
    free = llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    at, stop_id = first_new_token(free[0].outputs[0].token_ids)

    # vLLM's documented offline use, unchanged but for the import line.
    sampling_params = SamplingParams(max_tokens=8, temperature=0, top_k=-1, stop_token_ids=[stop_id])
    outputs = llm.generate(PROMPTS, sampling_params)
    for i, (prompt, output) in enumerate(zip(PROMPTS, outputs)):
        completion = output.outputs[0]
        assert output.request_id == str(i) and output.prompt == prompt
        assert output.prompt_token_ids == tok(prompt).input_ids
        expected = hf_greedy(hf, output.prompt_token_ids, 8, [stop_id])
        assert completion.index == 0 and completion.token_ids == expected
        ended = expected[-1] in (EOS, stop_id)
        assert completion.finish_reason == ("stop" if ended else "length")
        assert completion.stop_reason == (stop_id if expected[-1] == stop_id else None)
        # As vLLM: the stop token stays in token_ids and out of the text.
        assert completion.text == tok.decode(expected[:-1] if ended else expected, skip_special_tokens=True)
        assert completion.cumulative_logprob == pytest.approx(
            hf_logprob_sum(hf, output.prompt_token_ids, expected), abs=1e-4)
        assert completion.logprobs is None
        # flexoff's flat fields read the same data.
        assert (output.text, output.token_ids, output.finish_reason) == \
            (completion.text, completion.token_ids, completion.finish_reason)
    first = outputs[0].outputs[0]
    assert first.token_ids[-1] == stop_id and len(first.token_ids) == at + 1 and first.finish_reason == "stop"


def test_include_stop_str_in_output_keeps_the_stop_token_and_string(model):
    llm, _, tok = model
    free = llm.generate(PROMPTS[0], SamplingParams(max_tokens=8, ignore_eos=True))[0].outputs[0]
    at, stop_id = first_new_token(free.token_ids)
    kept = llm.generate(PROMPTS[0], SamplingParams(max_tokens=8, stop_token_ids=[stop_id], ignore_eos=True,
                                                    include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == tok.decode(free.token_ids[:at + 1], skip_special_tokens=True)
    stop = free.text.split()[3]
    cut = free.text.find(stop)
    for include, text in ((False, free.text[:cut]), (True, free.text[:cut + len(stop)])):
        out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=8, stop=[stop], ignore_eos=True,
                                                      include_stop_str_in_output=include))[0].outputs[0]
        assert (out.text, out.finish_reason, out.stop_reason) == (text, "stop", stop)


def test_every_prompt_form_gives_the_same_tokens(model):
    llm, _, _ = model
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    listed = llm.generate(PROMPTS[:2], params)
    ids = listed[0].prompt_token_ids
    single = llm.generate(PROMPTS[0], sampling_params=params)
    dicts = llm.generate([{"prompt": PROMPTS[0]}, {"prompt_token_ids": listed[1].prompt_token_ids}],
                         sampling_params=params, use_tqdm=False)
    by_ids = llm.generate({"prompt_token_ids": ids}, params)
    assert len(single) == 1 and single[0].token_ids == listed[0].token_ids
    assert [o.token_ids for o in dicts] == [o.token_ids for o in listed]
    assert dicts[0].prompt == PROMPTS[0] and dicts[1].prompt is None
    assert by_ids[0].token_ids == listed[0].token_ids and by_ids[0].prompt_token_ids == ids


def test_a_list_of_sampling_params_applies_one_per_prompt(model):
    llm, _, _ = model
    outs = llm.generate(PROMPTS[:3], sampling_params=[SamplingParams(max_tokens=n, ignore_eos=True)
                                                      for n in (2, 5, 3)])
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 5, 3]


def test_use_tqdm_turns_the_progress_bar_on_and_off(model, capsys):
    llm, _, _ = model
    llm.generate(PROMPTS[0], SamplingParams(max_tokens=2), use_tqdm=True)
    assert "generating" in capsys.readouterr().err
    llm.generate(PROMPTS[0], SamplingParams(max_tokens=2), use_tqdm=False)
    assert "generating" not in capsys.readouterr().err


def test_max_tokens_is_max_new_tokens():
    assert SamplingParams(max_tokens=8) == SamplingParams(max_new_tokens=8) == SamplingParams(
        max_tokens=8, max_new_tokens=8)
    assert SamplingParams(max_tokens=8).max_tokens == 8
    assert SamplingParams().max_new_tokens == 32 and SamplingParams().temperature == 0  # flexoff's defaults
    assert SamplingParams(top_k=-1) == SamplingParams(top_k=0)
    # dataclasses.replace changes the budget under flexoff's name.
    assert dataclasses.replace(SamplingParams(max_tokens=8), max_new_tokens=5).max_tokens == 5
    # vLLM's values that mean "off" are flexoff's defaults.
    assert SamplingParams(**OFF, stop=None, stop_token_ids=None) == SamplingParams()


OFF = {"n": 1, "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0, "min_p": 0.0,
       "min_tokens": 0, "logprobs": None, "prompt_logprobs": None}


def test_best_of_is_refused_as_vllm_v1_does():
    with pytest.raises(TypeError, match="best_of"):
        SamplingParams(best_of=2)


BAD_PARAMS = [
    (dict(max_tokens=8, max_new_tokens=9), ValueError, "max_tokens=8 and max_new_tokens=9 disagree"),
    (dict(max_tokens=0), ValueError, "max_tokens must be an integer >= 1"),
    (dict(n=0), ValueError, "n must be an integer >= 1"),
    (dict(top_k=-2), ValueError, "top_k"),
    (dict(stop_token_ids=[3, -1]), TypeError, "stop_token_ids"),
    (dict(stop_token_ids=5), TypeError, "stop_token_ids"),
    (dict(include_stop_str_in_output=1), TypeError, "include_stop_str_in_output"),
    (dict(n=1.5), TypeError, "n must be an integer"),
    (dict(presence_penalty=2.5), ValueError, r"presence_penalty must be a number in \[-2, 2\], got 2.5"),
    (dict(frequency_penalty=-2.1), ValueError, r"frequency_penalty must be a number in \[-2, 2\], got -2.1"),
    (dict(frequency_penalty="1"), TypeError, "frequency_penalty"),
    (dict(repetition_penalty=0.0), ValueError, "repetition_penalty must be a number > 0, got 0.0"),
    (dict(repetition_penalty=float("nan")), ValueError, "repetition_penalty must be a finite number"),
    (dict(min_p=1.5), ValueError, r"min_p must be a number in \[0, 1\], got 1.5"),
    (dict(min_p=-0.1), ValueError, "min_p"),
    (dict(min_tokens=-1), ValueError, "min_tokens must be an integer >= 0"),
    (dict(min_tokens=9, max_tokens=8), ValueError, "min_tokens=9 is more than max_tokens=8"),
    (dict(min_tokens=33), ValueError, "min_tokens=33 is more than max_tokens=32"),
    (dict(logprobs=-1), ValueError, "logprobs must be an integer >= 0"),
    (dict(logprobs=True), TypeError, "logprobs must be an integer"),
    (dict(prompt_logprobs=2.0), TypeError, "prompt_logprobs must be an integer"),
]


@pytest.mark.parametrize("kwargs,kind,message", BAD_PARAMS)
def test_bad_sampling_params_give_one_line(kwargs, kind, message):
    with pytest.raises(kind, match=message) as info:
        SamplingParams(**kwargs)
    assert "\n" not in str(info.value)


BAD_CALLS = [
    (lambda m: m.generate([{"prompt_token_ids": [5, 6]}, {"prompt_token_ids": [5, 10_000]}]), ValueError,
     "prompt 1 has token id 10000, outside the vocabulary"),
    (lambda m: m.generate({"prompt": "a dog", "prompt_token_ids": [5]}), ValueError, "prompt 0 must be .*one of"),
    (lambda m: m.generate([{"prompt": "a dog", "multi_modal_data": {}}]), ValueError, "'multi_modal_data'"),
    (lambda m: m.generate([{"prompt": [5, 6]}]), TypeError, "prompt 0: field 'prompt' must be text"),
    (lambda m: m.generate([{"prompt_token_ids": "a dog"}]), TypeError, "prompt 0: field 'prompt_token_ids'"),
    (lambda m: m.generate(["a", "b"], sampling_params=[SamplingParams()]), ValueError, "1 sampling parameter sets"),
    (lambda m: m.generate(["a"], SamplingParams(max_tokens=2), sampling_params=SamplingParams(max_tokens=3)),
     TypeError, "params and sampling_params"),
    (lambda m: m.generate(["a"], progress=True, use_tqdm=False), TypeError, "progress and use_tqdm"),
    (lambda m: m.generate(["a"], use_tqdm="yes"), TypeError, "use_tqdm must be true or false"),
    (lambda m: m.generate(["a"], SamplingParams(logprobs=65)), ValueError,
     "logprobs=65 is more than the 64 tokens of .*'s vocabulary"),
    (lambda m: m.generate(["a", "b"], [SamplingParams(), SamplingParams(prompt_logprobs=100)]), ValueError,
     "prompt_logprobs=100 is more than the 64 tokens"),
]


@pytest.mark.parametrize("call,kind,message", BAD_CALLS)
def test_bad_generate_calls_give_one_line(model, call, kind, message):
    with pytest.raises(kind, match=message) as info:
        call(model[0])
    assert "\n" not in str(info.value)
