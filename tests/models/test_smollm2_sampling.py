"""SmolLM2-135M-Instruct (tests/smollm2.py): seeded sampling, the checkpoint's generation_config.json
defaults, and its chat template, on a trained model's real distributions."""

from __future__ import annotations

import json

import pytest

from flexoff import LLM, Policy, SamplingParams, TierFractions

PROMPTS = ["Once upon a time,", "My favourite food is"]
SAMPLED = SamplingParams(n=3, temperature=0.9, top_k=50, top_p=0.95, seed=1234, max_new_tokens=12)
# Six rows in two GPU batches of three, weights partly on disk, the cache on the CPU: the rows'
# draws meet other batch shapes and another order of work than the default policy's one batch.
OTHER_PLACEMENT = Policy(gpu_batch_size=3, num_gpu_batches=2, weights=TierFractions(0.3, 0.4, 0.3),
                         cache=TierFractions(0, 1, 0), cpu_attention=True)


def samples(outs) -> list[list[list[int]]]:
    """Each prompt's n samples' tokens."""
    return [[sample.token_ids for sample in out.outputs] for out in outs]


@pytest.fixture(scope="module")
def llm(smollm2_dir):
    with LLM(str(smollm2_dir), dtype="float32") as model:
        yield model


def test_seeded_samples_repeat_and_differ(llm, smollm2_dir, tmp_path):
    first = samples(llm.generate(PROMPTS, SAMPLED))
    assert samples(llm.generate(PROMPTS, SAMPLED)) == first
    with LLM(str(smollm2_dir), dtype="float32", policy=OTHER_PLACEMENT, offload_dir=str(tmp_path)) as other:
        assert samples(other.generate(PROMPTS, SAMPLED)) == first
    for prompt in first:  # a request's samples draw from seed, seed + 1, ...: all different
        assert len(prompt) == 3 and len({tuple(s) for s in prompt}) == 3
    reseeded = samples(llm.generate(PROMPTS, SamplingParams(**{**_fields(SAMPLED), "seed": 99})))
    assert all(a != b for a, b in zip(reseeded, first))


def _fields(params: SamplingParams) -> dict:
    from dataclasses import fields

    return {f.name: getattr(params, f.name) for f in fields(params)}


# generation_config.json's sampling defaults, as transformers writes them; EXTRA_EOS is chosen from
# a run (a token the samples really produce), so that it visibly ends a sequence.
DEFAULTS = {"do_sample": True, "temperature": 0.7, "top_k": 40, "top_p": 0.9, "max_new_tokens": 18,
            "repetition_penalty": 1.1}


def with_generation_config(directory, extra_eos: int):
    config = json.loads((directory / "generation_config.json").read_text())
    config.update(DEFAULTS, eos_token_id=[config["eos_token_id"], extra_eos])
    (directory / "generation_config.json").write_text(json.dumps(config))
    return directory


def test_generation_config_defaults_apply(smollm2_dir, tmp_path):
    """With no sampling parameters, a checkpoint whose generation_config.json asks for sampling
    samples with its values (the same tokens as those values passed explicitly, under the same
    seed) and ends a sequence at its extra end-of-sequence id."""
    from transformers import GenerationConfig

    from tests import smollm2

    explicit = SamplingParams(temperature=0.7, top_k=40, top_p=0.9, max_new_tokens=18, repetition_penalty=1.1)
    with LLM(str(smollm2_dir), dtype="float32", seed=5) as plain:
        free = plain.generate(PROMPTS, explicit)
    tokens = free[0].token_ids
    assert len(tokens) == 18  # no EOS of the model's own in the reference
    extra = tokens[4]  # ends the first sequence at its first occurrence, at or before position 4
    directory = with_generation_config(smollm2.copy_checkpoint(tmp_path / "smollm2"), extra)
    hf = GenerationConfig.from_pretrained(directory)  # the file means to transformers what flexoff reads
    assert (hf.do_sample, hf.temperature, hf.top_k, hf.top_p, hf.max_new_tokens) == (True, 0.7, 40, 0.9, 18)
    with LLM(str(directory), dtype="float32", seed=5) as model:
        assert model.get_default_sampling_params() == explicit
        assert extra in model.config.eos_token_ids
        outs = model.generate(PROMPTS)
    for out, ref in zip(outs, free, strict=True):
        cut = ref.token_ids.index(extra) + 1 if extra in ref.token_ids else len(ref.token_ids)
        assert out.token_ids == ref.token_ids[:cut]
        assert out.finish_reason == ("stop" if extra in ref.token_ids else ref.finish_reason)
    assert outs[0].token_ids[-1] == extra and len(outs[0].token_ids) <= 5


CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Capital of Italy?"}],
    [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Tell me a fact about owls."}],
]


def test_chat_prompts_are_the_templates(llm, smollm2_gguf):
    """LLM.chat's prompt ids are transformers' apply_chat_template of the GGUF's own tokenizer and
    template, with the system prompt the template inserts where a conversation has none."""
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)
    outs = llm.chat(CONVERSATIONS, SamplingParams(max_new_tokens=1))
    default_system = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    for out, conversation in zip(outs, CONVERSATIONS, strict=True):
        expected = reference.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True,
                                                 return_dict=False)
        assert out.prompt_token_ids == expected
        assert out.prompt.endswith("<|im_start|>assistant\n")
        assert (default_system in out.prompt) is (conversation[0]["role"] != "system")
    assert "You answer in one word." in outs[1].prompt
