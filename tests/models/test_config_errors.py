"""Malformed config.json values are refused in one line naming the file and the field, by every
command, before any tokenizer or weight is loaded."""

import json
import re
import shutil

import pytest

from flexoff.commands.main import main
from flexoff.errors import ConfigError
from flexoff.models import ModelConfig
from flexoff.models.config import RopeScaling
from tests.conftest import PROMPTS

DROP = object()  # a change that removes the key
# (tiny model, config.json changes, the field the message must name)
CASES = {
    "heads as text": ("opt-pre", {"num_attention_heads": "4"}, "num_attention_heads"),
    "zero heads": ("opt-pre", {"num_attention_heads": 0}, "num_attention_heads"),
    "heads not dividing hidden": ("opt-pre", {"num_attention_heads": 3}, "num_attention_heads"),
    "boolean size": ("opt-pre", {"hidden_size": True}, "hidden_size"),
    "fractional layers": ("opt-pre", {"num_hidden_layers": 2.0}, "num_hidden_layers"),
    "negative vocabulary": ("opt-pre", {"vocab_size": -1}, "vocab_size"),
    "null positions": ("opt-pre", {"max_position_embeddings": None}, "max_position_embeddings"),
    "ffn as text": ("opt-pre", {"ffn_dim": "48"}, "ffn_dim"),
    "eos as text": ("opt-pre", {"eos_token_id": "2"}, "eos_token_id"),
    "eos list with text": ("opt-pre", {"eos_token_id": [2, "x"]}, "eos_token_id"),
    "eos past the vocabulary": ("opt-pre", {"eos_token_id": 64}, "eos_token_id"),
    "pad past the vocabulary": ("opt-pre", {"pad_token_id": 1000}, "pad_token_id"),
    "switch as text": ("opt-pre", {"do_layer_norm_before": "yes"}, "do_layer_norm_before"),
    "tie as integer": ("opt-pre", {"tie_word_embeddings": 1}, "tie_word_embeddings"),
    "projection as text": ("opt-post-proj", {"word_embed_proj_dim": "16"}, "word_embed_proj_dim"),
    "kv heads not dividing heads": ("llama-gqa", {"num_key_value_heads": 3}, "num_key_value_heads"),
    "zero epsilon": ("llama-gqa", {"rms_norm_eps": 0}, "rms_norm_eps"),
    "NaN epsilon": ("llama-gqa", {"rms_norm_eps": float("nan")}, "rms_norm_eps"),
    "negative rope base": ("llama-gqa", {"rope_parameters": {"rope_type": "default", "rope_theta": -1}},
                           "rope_parameters.rope_theta"),
    "negative rope base, older layout": ("llama-gqa", {"rope_parameters": DROP, "rope_theta": -1}, "rope_theta"),
    "rope scaling as text": ("llama-gqa", {"rope_scaling": "linear"}, "rope_scaling"),
    "rope factor as text": ("llama-gqa", {"rope_parameters": DROP, "rope_theta": 1e4,
                                          "rope_scaling": {"rope_type": "linear", "factor": "2"}},
                            "rope_scaling.factor"),
    "llama3 flat ramp": ("llama3-rope", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
                                                             "low_freq_factor": 4.0, "high_freq_factor": 4.0,
                                                             "original_max_position_embeddings": 16}},
                         "rope_parameters.high_freq_factor"),
    "odd head size": ("llama-gqa", {"head_dim": 7}, "head_dim"),
    "zero intermediate": ("llama-gqa", {"intermediate_size": 0}, "intermediate_size"),
    "bias switch as text": ("qwen2-bias", {"attention_bias": "no"}, "attention_bias"),
    "mlp bias as text": ("llama-gqa", {"mlp_bias": "false"}, "mlp_bias"),
    "window as text": ("llama-gqa", {"use_sliding_window": True, "sliding_window": "x"}, "sliding_window"),
    "qwen3 odd head size": ("qwen3-qk-norm", {"head_dim": 11}, "head_dim"),
    "qwen3 with an o_proj bias": ("qwen3-qk-norm", {"attention_bias": True}, "attention_bias"),
    "llama with an o_proj bias": ("llama-gqa", {"attention_bias": True}, "attention_bias"),
    "experts as text": ("mixtral", {"num_local_experts": "4"}, "num_local_experts"),
    "more chosen experts than experts": ("mixtral", {"num_experts_per_tok": 5}, "num_experts_per_tok"),
    "no chosen expert": ("qwen3-moe", {"num_experts_per_tok": 0}, "num_experts_per_tok"),
    "expert width as text": ("qwen3-moe", {"moe_intermediate_size": "16"}, "moe_intermediate_size"),
    "renormalisation as text": ("qwen3-moe", {"norm_topk_prob": "yes"}, "norm_topk_prob"),
    "dense layer past the model": ("qwen3-moe", {"mlp_only_layers": [5]}, "mlp_only_layers"),
    "sparse step of zero": ("qwen2-moe", {"decoder_sparse_step": 0}, "decoder_sparse_step"),
    "qwen3-moe with an o_proj bias": ("qwen3-moe", {"attention_bias": True}, "attention_bias"),
    "shared expert width negative": ("qwen2-moe", {"shared_expert_intermediate_size": -1},
                                     "shared_expert_intermediate_size"),
}


@pytest.fixture
def corrupted(tiny_model_dir, tmp_path):
    def make(kind: str, changes: dict):
        path = tmp_path / "model"
        shutil.copytree(tiny_model_dir(kind)[0], path)
        config = json.loads((path / "config.json").read_text())
        config.update(changes)
        config = {key: value for key, value in config.items() if value is not DROP}
        (path / "config.json").write_text(json.dumps(config))
        return path

    return make


def commands(path, tmp_path) -> dict[str, list[str]]:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    lines = tmp_path / "in.jsonl"
    lines.write_text("\n".join(json.dumps({"id": i, "prompt": p}) for i, p in enumerate(PROMPTS)) + "\n")
    auto = ["--policy", "auto", "--hardware", "t4", "--dtype", "bfloat16"]
    return {
        "run": ["run", "--model", str(path), "--prompts", str(prompts), "--gen-len", "2", "--quiet"],
        "run auto": ["run", "--model", str(path), "--prompts", str(prompts), "--gen-len", "2", "--quiet", *auto],
        "search": ["search", "--model", str(path), "--prompt-len", "8", "--gen-len", "2", "--hardware", "t4"],
        "batch": ["batch", "--model", str(path), "--input", str(lines), "--output", str(tmp_path / "out.jsonl"),
                  "--no-progress"],
        "batch auto": ["batch", "--model", str(path), "--input", str(lines),
                       "--output", str(tmp_path / "auto.jsonl"), "--no-progress", *auto],
    }


@pytest.mark.parametrize("case", CASES)
def test_malformed_config_is_one_line_naming_file_and_field(case, corrupted, tmp_path, capsys):
    kind, changes, field = CASES[case]
    path = corrupted(kind, changes)
    capsys.readouterr()  # building the model prints progress
    for command, argv in commands(path, tmp_path).items():
        code = main(argv)
        err = capsys.readouterr().err
        lines = err.strip().splitlines()
        assert code == 2, (command, err)
        assert len(lines) == 1 and "Traceback" not in err, (command, err)
        assert lines[0].startswith(f"flexoff: error: {path / 'config.json'}: "), (command, err)
        assert re.search(rf"(?<![\w.]){re.escape(field)}(?![\w.])", lines[0]), (command, err)


def test_config_errors_name_the_field_in_python_too():
    with pytest.raises(ConfigError, match="num_heads must be a positive integer, got 0"):
        ModelConfig(name="m", family="opt", vocab_size=8, hidden_size=8, num_layers=1, num_heads=0,
                    intermediate_size=8, max_positions=8)
    with pytest.raises(ConfigError, match="norm_eps must be a positive finite number"):
        ModelConfig(name="m", family="llama", vocab_size=8, hidden_size=8, num_layers=1, num_heads=2,
                    intermediate_size=8, max_positions=8, norm_eps=-1e-5)
    with pytest.raises(ConfigError, match="qk_norm must be true or false, got 'yes'"):
        ModelConfig(name="m", family="llama", vocab_size=8, hidden_size=8, num_layers=1, num_heads=2,
                    intermediate_size=8, max_positions=8, qk_norm="yes")
    with pytest.raises(ConfigError, match="kind must be one of default, linear, llama3, got 'yarn'"):
        RopeScaling(kind="yarn")


def test_a_negative_pad_id_means_no_padding_token(corrupted):
    from flexoff.models import config_from_dir

    assert config_from_dir(corrupted("llama-gqa", {"pad_token_id": -1})).pad_token_id is None


def test_qwen3_head_size_defaults_as_transformers_does(corrupted):
    """Without head_dim, transformers' Qwen3 takes 128, where the Llama family takes hidden / heads (8 here)."""
    from flexoff.models import config_from_dir

    assert config_from_dir(corrupted("qwen3-qk-norm", {"head_dim": DROP})).head_dim == 128


def test_a_config_error_is_not_blamed_on_the_tokenizer(corrupted):
    """Without a tokenizer class of its own, transformers reads config.json to load the tokenizer."""
    from flexoff.tokenizer import Tokenizer

    path = corrupted("opt-pre", {"vocab_size": "abc"})
    settings = json.loads((path / "tokenizer_config.json").read_text())
    settings.pop("tokenizer_class", None)
    (path / "tokenizer_config.json").write_text(json.dumps(settings))
    with pytest.raises(ConfigError, match=r"config\.json: vocab_size must be a positive integer, got 'abc'"):
        Tokenizer.for_model(path)
