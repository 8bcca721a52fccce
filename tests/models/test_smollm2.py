"""SmolLM2-135M-Instruct, a trained Llama (tests/smollm2.py): the converted checkpoint is the
package's GGUF, and flexoff's greedy text is transformers' on every placement.

The reference is transformers' own ``generate`` on the same float32 checkpoint on the CPU, one
unpadded prompt at a time; flexoff batches the prompts (padded) and moves weights, cache and
activations between its tiers, and must give the same tokens and log-probabilities."""

from __future__ import annotations

import os

import pytest
import torch

from flexoff import LLM, Policy, SamplingParams, TierFractions

NEW_TOKENS = 20
PLAIN = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a concise assistant."},
     {"role": "user", "content": "Name three primary colors."}],
]
PARAMS = SamplingParams(max_new_tokens=NEW_TOKENS)  # greedy; EOS ends a sequence, as in transformers

ON_CPU = TierFractions(0, 1, 0)
ON_DISK = TierFractions(0, 0, 1)

# Blocks of four sequences (three plain prompts, or two chats, in one block).
PLACEMENTS = {
    "all-gpu-tier": Policy(gpu_batch_size=4),
    "weights-gpu-cpu": Policy(gpu_batch_size=4, weights=TierFractions(0.5, 0.5, 0)),
    "weights-partly-disk": Policy(gpu_batch_size=4, weights=TierFractions(0.3, 0.4, 0.3)),
    "cache-cpu-attention": Policy(gpu_batch_size=4, cache=ON_CPU, cpu_attention=True),
    "cache-disk": Policy(gpu_batch_size=4, cache=ON_DISK),
    "activations-off-gpu": Policy(gpu_batch_size=4, activations=TierFractions(0, 0.5, 0.5)),
    "two-gpu-batches": Policy(gpu_batch_size=2, num_gpu_batches=2, weights=TierFractions(0.5, 0.5, 0), cache=ON_CPU,
                              overlap=True),
    "everything-off-gpu-no-overlap": Policy(gpu_batch_size=2, num_gpu_batches=2, weights=TierFractions(0, 0.6, 0.4),
                                            cache=TierFractions(0, 0.5, 0.5), activations=ON_CPU, cpu_attention=True,
                                            overlap=False),
}


# -- the checkpoint is the GGUF ---------------------------------------------------------------------

GGUF_NAMES = {  # llama.cpp's tensor names -> the checkpoint's
    "token_embd": "model.embed_tokens", "output_norm": "model.norm", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}


def checkpoint_name(gguf_name: str) -> str:
    stem, kind = gguf_name.rsplit(".", 1)
    if stem.startswith("blk."):
        _, layer, part = stem.split(".")
        return f"model.layers.{layer}.{GGUF_NAMES[part]}.{kind}"
    return f"{GGUF_NAMES[stem]}.{kind}"


def unpermute(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k permutation (convert_hf_to_gguf.py writes each head's rotary halves
    interleaved, ``w.reshape(heads, 2, d // heads // 2, ...).swapaxes(1, 2)``)."""
    return rows.reshape(heads, rows.shape[0] // heads // 2, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


@pytest.fixture(scope="module")
def gguf_reader(smollm2_gguf):
    gguf = pytest.importorskip("gguf")
    return gguf.GGUFReader(str(smollm2_gguf))


def metadata(reader, key: str):
    """A metadata value as the gguf package reads it (``ReaderField.contents`` where the release
    has it; gguf 0.13's fields hold their parts alone)."""
    field = reader.fields[key]
    if hasattr(field, "contents"):
        return field.contents()
    values = [field.parts[i] for i in field.data]
    decoded = [bytes(v).decode() if v.dtype.kind == "u" and v.itemsize == 1 else v.tolist()[0] for v in values]
    is_array = field.types[0].name == "ARRAY"
    return decoded if is_array else decoded[0]


def test_every_tensor_is_the_ggufs_dequantized(gguf_reader, smollm2_dir):
    from gguf.quants import dequantize
    from safetensors import safe_open

    heads = metadata(gguf_reader, "llama.attention.head_count")
    kv_heads = metadata(gguf_reader, "llama.attention.head_count_kv")
    with safe_open(str(smollm2_dir / "model.safetensors"), "pt") as saved:
        names = set(saved.keys())
        expected = {checkpoint_name(t.name) for t in gguf_reader.tensors}
        assert names == expected  # tied embeddings: no lm_head, as the GGUF has no output.weight
        quantized = set()
        for tensor in gguf_reader.tensors:
            values = torch.from_numpy(dequantize(tensor.data, tensor.tensor_type).copy())
            if ".attn_q." in tensor.name:
                values = unpermute(values, heads)
            elif ".attn_k." in tensor.name:
                values = unpermute(values, kv_heads)
            ours = saved.get_tensor(checkpoint_name(tensor.name))
            assert ours.dtype == torch.float32
            assert torch.equal(ours, values), tensor.name
            quantized.add(tensor.tensor_type.name)
    assert {"Q4_1", "Q8_0"} <= quantized  # the dequantization was exercised, not only float copies


def test_the_permutation_is_undone_not_skipped(gguf_reader, smollm2_dir):
    """The q/k rows really are reordered: the raw GGUF rows differ from the checkpoint's."""
    from gguf.quants import dequantize
    from safetensors import safe_open

    raw = next(t for t in gguf_reader.tensors if t.name == "blk.0.attn_q.weight")
    with safe_open(str(smollm2_dir / "model.safetensors"), "pt") as saved:
        ours = saved.get_tensor("model.layers.0.self_attn.q_proj.weight")
    assert not torch.equal(ours, torch.from_numpy(dequantize(raw.data, raw.tensor_type).copy()))


def test_config_is_the_ggufs_metadata(gguf_reader, smollm2_dir):
    """config.json as transformers and flexoff read it, against the GGUF's metadata."""
    from transformers import AutoConfig

    from flexoff.models.hf_config import config_from_dir

    hf, ours = AutoConfig.from_pretrained(smollm2_dir), config_from_dir(smollm2_dir)
    field = lambda key: metadata(gguf_reader, f"llama.{key}")  # noqa: E731
    tied = not any(t.name == "output.weight" for t in gguf_reader.tensors)
    assert metadata(gguf_reader, "general.architecture") == "llama"
    assert (hf.model_type, ours.family) == ("llama", "llama")
    assert hf.num_hidden_layers == ours.num_layers == field("block_count") == 30
    assert hf.hidden_size == ours.hidden_size == field("embedding_length") == 576
    assert hf.num_attention_heads == ours.num_heads == field("attention.head_count")
    assert hf.num_key_value_heads == ours.num_kv_heads == field("attention.head_count_kv")
    assert hf.intermediate_size == ours.intermediate_size == field("feed_forward_length")
    assert hf.max_position_embeddings == ours.max_positions == field("context_length")
    assert hf.rope_parameters["rope_theta"] == ours.rope_theta == pytest.approx(field("rope.freq_base"))
    assert hf.rms_norm_eps == ours.norm_eps == pytest.approx(field("attention.layer_norm_rms_epsilon"))
    assert ours.head_dim == field("rope.dimension_count")
    assert hf.vocab_size == ours.vocab_size == field("vocab_size")
    assert hf.tie_word_embeddings is ours.tie_word_embeddings is tied is True
    assert hf.bos_token_id == ours.bos_token_id == metadata(gguf_reader, "tokenizer.ggml.bos_token_id")
    assert metadata(gguf_reader, "tokenizer.ggml.eos_token_id") in ours.eos_token_ids


TEXTS = ["Hello, world!", "The capital of France is Paris.", "def f(x):\n    return x ** 2  # squared",
         "  leading spaces, émigré café, 東京, and 123456789", "<|im_start|>user\nhi<|im_end|>\n"]


@pytest.fixture(scope="module")
def gguf_tokenizer(smollm2_gguf):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)


def test_tokenizer_is_the_ggufs(smollm2_dir, smollm2_gguf, gguf_tokenizer, gguf_reader):
    """flexoff's tokenizer of the checkpoint encodes as transformers' tokenizer read from the GGUF,
    and its vocabulary is the GGUF's token list."""
    from flexoff.tokenizer import Tokenizer

    ours, from_file = Tokenizer(smollm2_dir), Tokenizer(smollm2_gguf)
    # The file's own word on BOS (transformers 5.0 adds one regardless; later releases read the key).
    bos = [metadata(gguf_reader, "tokenizer.ggml.bos_token_id")] * metadata(gguf_reader, "tokenizer.ggml.add_bos_token")
    for text in TEXTS:
        expected = bos + gguf_tokenizer(text, add_special_tokens=False).input_ids
        assert ours.encode(text) == from_file.encode(text) == expected, text
    for text in TEXTS[:-1]:  # decoding drops special tokens, as vLLM's does
        assert ours.decode(ours.encode(text)) == text
    assert ours.encode(TEXTS[-1])[0] == metadata(gguf_reader, "tokenizer.ggml.bos_token_id")  # a special token
    vocab = metadata(gguf_reader, "tokenizer.ggml.tokens")
    assert ours.tokens(list(range(len(vocab)))) == vocab


# -- greedy text equals transformers' on every placement ---------------------------------------------

def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], list[float], list[float]]:
    """transformers' greedy continuation of one unpadded prompt: its tokens, each token's
    log-probability under the raw logits, and each step's gap between its two likeliest tokens
    (how decisive the choice was)."""
    ids = torch.tensor([prompt_ids], device=model.device)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt_ids):].tolist()
    steps = [torch.log_softmax(step[0].float(), dim=-1) for step in out.logits]
    top = [step.topk(2).values.tolist() for step in steps]
    return tokens, [step[t].item() for step, t in zip(steps, tokens)], [a - b for a, b in top]


def chat_ids(tokenizer, conversation) -> list[int]:
    return tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True, return_dict=False)


@pytest.fixture(scope="module")
def hf_reference(smollm2_dir):
    """transformers' prompt ids and greedy tokens of PLAIN and CHATS: {"plain": [...], "chat": [...]},
    each entry (prompt ids, tokens, logprobs, top-2 gaps)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    prompts = {"plain": [tokenizer(p).input_ids for p in PLAIN], "chat": [chat_ids(tokenizer, c) for c in CHATS]}
    return {kind: [(ids, *hf_greedy(model, ids, NEW_TOKENS)) for ids in batch] for kind, batch in prompts.items()}


def assert_matches(outs, reference, atol: float = 1e-4) -> None:
    """flexoff's outputs have transformers' prompt ids and tokens, and log-probabilities within atol."""
    for out, (prompt_ids, tokens, logprobs, _) in zip(outs, reference, strict=True):
        assert out.prompt_token_ids == prompt_ids
        assert out.token_ids == tokens, (out.text, out.prompt)
        torch.testing.assert_close(torch.tensor(out.logprobs), torch.tensor(logprobs), rtol=0, atol=atol)
        assert out.finish_reason == ("stop" if len(tokens) < NEW_TOKENS else "length")


def test_the_reference_is_sensible(hf_reference):
    """Not the test's point (the equality is): that the model is a trained one, ending its turns."""
    (_, answer, _, _), _ = hf_reference["chat"]
    assert answer[-1] == 2 and len(answer) < NEW_TOKENS  # <|im_end|> closes the short answer


@pytest.mark.parametrize("name", list(PLACEMENTS))
def test_greedy_text_equals_transformers(smollm2_dir, hf_reference, tmp_path, name):
    with LLM(str(smollm2_dir), policy=PLACEMENTS[name], dtype="float32", offload_dir=str(tmp_path)) as llm:
        plain = llm.generate(PLAIN, PARAMS)
        chats = llm.chat(CHATS, PARAMS)
    assert_matches(plain, hf_reference["plain"])
    assert_matches(chats, hf_reference["chat"])
    assert "Paris" in chats[0].text
    assert os.listdir(tmp_path) == []  # the disk tier's files are gone once the model is closed


@pytest.mark.parametrize("name", ["all-gpu-tier", "everything-off-gpu-no-overlap"])
def test_scores_along_transformers_path_are_its_logprobs(smollm2_dir, hf_reference, tmp_path, name):
    """score() of transformers' own continuations, in one prefill each, gives the log-probabilities
    its generate saw token by token."""
    reference = hf_reference["plain"] + hf_reference["chat"]
    with LLM(str(smollm2_dir), policy=PLACEMENTS[name], dtype="float32", offload_dir=str(tmp_path)) as llm:
        scores = llm.score([ids for ids, *_ in reference], [tokens for _, tokens, *_ in reference])
    for score, (_, tokens, logprobs, _) in zip(scores, reference, strict=True):
        assert score.token_ids == tokens
        torch.testing.assert_close(torch.tensor(score.logprobs), torch.tensor(logprobs), rtol=0, atol=1e-4)
