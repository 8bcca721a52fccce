"""Tiny random Hugging Face models, built and saved by the tests themselves (nothing is downloaded)."""

from __future__ import annotations

import os

# Torch on one thread, here and in every child process the tests start (they inherit the variable):
# set before torch is first imported. The tests' models are tiny, so a second thread gains nothing;
# and where other jobs share the cores, torch's threads spin waiting on each other: a batch job of
# the tiny OPT took 60 s instead of 3 s on two loaded cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

WORDS = [
    "the", "a", "cat", "dog", "sat", "on", "mat", "ran", "to", "house", "big", "small", "red", "blue",
    "and", "then", "it", "was", "happy", "sad", "tree", "car", "moved", "slowly", "quickly", "over",
    "under", "bird", "sang", "song", "night", "day", "sun", "moon", "cold", "warm", "river", "stone",
]
PROMPTS = [
    "the cat sat on the mat",
    "a dog",
    "the big red car moved slowly over the river and then it was",
    "bird sang",
    "the moon was cold and the sun was warm",
]


def generate(path, policy, offload_dir=None, *, params, prompts=PROMPTS, **llm_args):
    """Outputs of ``prompts`` from the model saved at ``path`` under ``policy``, closing it after."""
    from flexoff import LLM

    where = {} if offload_dir is None else {"offload_dir": str(offload_dir)}
    with LLM(str(path), policy=policy, **where, **llm_args) as llm:
        return llm.generate(prompts, params)


def assert_same_outputs(outs, ref, rtol: float = 0.0, atol: float = 1e-4) -> None:
    """The same tokens and finish reasons, and log-probabilities within the tolerances."""
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert [o.finish_reason for o in outs] == [o.finish_reason for o in ref]
    torch.testing.assert_close(torch.tensor([o.logprobs for o in outs]), torch.tensor([o.logprobs for o in ref]),
                               rtol=rtol, atol=atol)


def build_tokenizer(directory, bos: str, eos: str, pad: str):
    """A word-level tokenizer over WORDS with the model family's special tokens, saved as tokenizer.json."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = list(dict.fromkeys([pad, bos, eos, "<unk>"]))
    vocab = {tok: i for i, tok in enumerate(specials + WORDS)}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    raw.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, vocab[bos])])
    from tokenizers import decoders

    raw.decoder = decoders.WordPiece(prefix="##")  # joins word tokens with spaces
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token=bos, eos_token=eos, pad_token=pad, unk_token="<unk>")
    tok.save_pretrained(directory)
    return tok, vocab


def _opt(pre_norm: bool, proj_dim: int | None, layers: int = 2):
    from transformers import OPTConfig, OPTForCausalLM

    kwargs = dict(
        vocab_size=64, hidden_size=32, num_hidden_layers=layers, ffn_dim=48, num_attention_heads=4,
        max_position_embeddings=64, do_layer_norm_before=pre_norm, pad_token_id=1, bos_token_id=2,
        eos_token_id=2, dropout=0.0, attention_dropout=0.0,
    )
    if proj_dim:
        kwargs["word_embed_proj_dim"] = proj_dim
    return OPTForCausalLM(OPTConfig(**kwargs)), ("</s>", "</s>", "<pad>")


def _llama(model_type: str, layers: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    common = dict(
        vocab_size=64, hidden_size=32, num_hidden_layers=layers, intermediate_size=40, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=False, rms_norm_eps=1e-6,
    )
    if model_type == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**common, rope_theta=1000000.0)), ("<s>", "</s>", "<pad>")
    if model_type == "qwen3":  # head_dim 16, not hidden_size / heads = 8, as Qwen3-32B's 128 is not 5120 / 64
        return Qwen3ForCausalLM(Qwen3Config(**common, head_dim=16, rope_theta=1000000.0)), ("<s>", "</s>", "<pad>")
    if model_type == "llama3":
        scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 16}
        return LlamaForCausalLM(LlamaConfig(**common, rope_theta=500000.0, rope_scaling=scaling)), \
            ("<s>", "</s>", "<pad>")
    return LlamaForCausalLM(LlamaConfig(**common)), ("<s>", "</s>", "<pad>")


def _moe(model_type: str):
    """Tiny mixtures of experts, each with a twist of its family: Mixtral's experts in every layer;
    Qwen3-MoE renormalising its top-k, with layer 1 dense (mlp_only_layers); Qwen2-MoE with a gated
    shared expert, every second layer sparse (decoder_sparse_step), top-k not renormalised."""
    import transformers

    common = dict(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, intermediate_size=40, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=False, rms_norm_eps=1e-6, num_experts_per_tok=2,
    )
    tokens = ("<s>", "</s>", "<pad>")
    if model_type == "mixtral":
        config = transformers.MixtralConfig(**{**common, "intermediate_size": 16}, num_local_experts=4)
        return transformers.MixtralForCausalLM(config), tokens
    if model_type == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(**common, num_experts=4, moe_intermediate_size=16, head_dim=16,
                                             norm_topk_prob=True, mlp_only_layers=[1])
        return transformers.Qwen3MoeForCausalLM(config), tokens
    config = transformers.Qwen2MoeConfig(**common, num_experts=4, moe_intermediate_size=16, decoder_sparse_step=2,
                                         shared_expert_intermediate_size=24, norm_topk_prob=False)
    return transformers.Qwen2MoeForCausalLM(config), tokens


BUILDERS = {
    "opt-pre": lambda layers=2: _opt(True, None, layers),
    "opt-post-proj": lambda: _opt(False, 16),
    "llama-gqa": lambda layers=2: _llama("llama", layers),
    "llama3-rope": lambda: _llama("llama3"),
    "qwen2-bias": lambda: _llama("qwen2"),
    "qwen3-qk-norm": lambda: _llama("qwen3"),
    "mixtral": lambda: _moe("mixtral"),
    "qwen3-moe": lambda: _moe("qwen3_moe"),
    "qwen2-moe": lambda: _moe("qwen2_moe"),
}


def build_model(directory, kind: str, safetensors: bool = True, seed: int = 0, layers: int | None = None):
    """Save a tiny random model of ``kind`` (with a tokenizer) to ``directory``; return the HF model.
    ``layers``: other than the kind's two decoder layers (opt-pre and llama-gqa only)."""
    torch.manual_seed(seed)
    model, (bos, eos, pad) = BUILDERS[kind]() if layers is None else BUILDERS[kind](layers)
    with torch.no_grad():  # larger-than-default weights make greedy choices decisive, not near-ties
        for param in model.parameters():
            param.normal_(0.0, 0.2)
    model.eval()
    model.save_pretrained(directory)
    if not safetensors:  # the classic pickle format, which newer save_pretrained no longer writes
        for file in directory.glob("*.safetensors"):
            file.unlink()
        torch.save({k: v.contiguous() for k, v in model.state_dict().items()}, directory / "pytorch_model.bin")
    build_tokenizer(directory, bos, eos, pad)
    return model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Factory: tiny_model_dir(kind, safetensors=True) -> (path, hf_model), built once per session."""
    cache = {}

    def make(kind: str, safetensors: bool = True):
        key = (kind, safetensors)
        if key not in cache:
            directory = tmp_path_factory.mktemp(f"{kind}-{'st' if safetensors else 'bin'}")
            cache[key] = (directory, build_model(directory, kind, safetensors))
        return cache[key]

    return make


@pytest.fixture
def fused_moe_kernels():
    """Skips the test where a sparse layer's fused Triton kernels do not run (no CUDA, no Triton)."""
    from flexoff.models import moe
    if not torch.cuda.is_available() or moe.fused_kernels(torch.zeros(1, device="cuda", dtype=torch.bfloat16)) is None:
        pytest.skip("needs CUDA and Triton")


def untimed_records(path) -> list[dict]:
    """A results file's records without their timing fields, which differ from run to run."""
    import json

    return [{k: v for k, v in json.loads(line).items() if k not in ("block_seconds", "finished_at")}
            for line in open(path, encoding="utf-8").read().splitlines()]


@pytest.fixture(scope="session")
def three_layers(tmp_path_factory):
    """A tiny OPT of three decoder layers (an odd count, which the weight ring's wrap needs): (path, HF model)."""
    from transformers import OPTConfig, OPTForCausalLM

    torch.manual_seed(0)
    model = OPTForCausalLM(OPTConfig(vocab_size=64, hidden_size=32, num_hidden_layers=3, ffn_dim=48,
                                     num_attention_heads=4, max_position_embeddings=64, pad_token_id=1,
                                     bos_token_id=2, eos_token_id=2))
    directory = tmp_path_factory.mktemp("opt-3")
    model.save_pretrained(directory)
    build_tokenizer(directory, "</s>", "</s>", "<pad>")
    return directory, model


@pytest.fixture(scope="session")
def smollm2_gguf():
    """The GGUF file of SmolLM2-135M-Instruct (tests/smollm2.py), or a skip saying why it is absent."""
    from . import smollm2

    try:
        return smollm2.gguf_file()
    except smollm2.Unavailable as exc:
        pytest.skip(f"SmolLM2-135M-Instruct unavailable: {exc}")


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_gguf):
    """SmolLM2-135M-Instruct as a float32 safetensors checkpoint directory (converted once)."""
    from . import smollm2

    try:
        return smollm2.checkpoint()
    except smollm2.Unavailable as exc:
        pytest.skip(f"SmolLM2-135M-Instruct unavailable: {exc}")
