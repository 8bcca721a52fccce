"""A GGUF file as a model argument: flexoff.LLM and the CLI run it as transformers runs the same
file, with its tokenizer and chat template from the metadata; a directory holding one works, and a
bad file is one line and exit code 2."""

import shutil
import sys

import pytest
import torch

from flexoff import LLM, SamplingParams
from flexoff.errors import TokenizerError, UnsupportedModelError
from flexoff.models import resolve_model
from flexoff.policy import CompressionConfig
from flexoff.tokenizer import Tokenizer
from tests.conftest import PROMPTS
from tests.test_cli import run_cli

pytest.importorskip("gguf")


def transformers_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)


def hf_greedy(model, ids, count):
    prompt = torch.tensor([ids])
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=count,
                         min_new_tokens=count, do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("kind", ["F32", "F16", "Q4_1"])
def test_greedy_generation_equals_transformers_on_the_same_file(gguf_llama, kind):
    from transformers import AutoTokenizer

    path = gguf_llama[1][kind]
    hf = transformers_model(path)
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    with LLM(str(path), dtype="float32") as llm:
        assert llm.config.stored_compression == (None if kind.startswith("F") else CompressionConfig(4, 32))
        outs = llm.generate(PROMPTS, SamplingParams(max_new_tokens=8, min_tokens=8))
    for out in outs:
        assert out.prompt_token_ids == tokenizer(out.prompt)["input_ids"]
        assert out.token_ids == hf_greedy(hf, out.prompt_token_ids, 8), out.prompt


def test_a_directory_holding_one_gguf_file_is_the_model(gguf_llama):
    path = gguf_llama[1]["F16"]
    config, found = resolve_model(path.parent)
    assert found == path.parent and config.name == "tiny-F16"
    with LLM(str(path.parent), dtype="float32") as llm:
        chat = llm.chat([{"role": "user", "content": "the dog"}], SamplingParams(max_new_tokens=3))[0]
    assert chat.prompt == "<s>user the dog</s><s>assistant"  # the file's chat template


def test_a_directory_with_two_gguf_files_names_both(gguf_llama, tmp_path):
    for kind in ("F16", "Q8_0"):
        shutil.copy(gguf_llama[1][kind], tmp_path)
    with pytest.raises(UnsupportedModelError, match="tiny-F16.gguf, tiny-Q8_0.gguf"):
        LLM(str(tmp_path))


def test_the_tokenizer_without_the_gguf_package_says_how_to_install_it(gguf_llama, monkeypatch):
    monkeypatch.setitem(sys.modules, "gguf", None)
    with pytest.raises(TokenizerError, match="pip install gguf"):
        Tokenizer(gguf_llama[1]["F32"])


def test_the_cli_runs_a_gguf_file(gguf_llama, tmp_path):
    out = tmp_path / "out.jsonl"
    code, _, err = run_cli("run", "--quiet", "--model", str(gguf_llama[1]["Q8_0"]), "--prompt-len", "4",
                           "--gen-len", "3", "--num-prompts", "2", "--output", str(out))
    assert code == 0, err
    assert len(out.read_text().splitlines()) == 2


@pytest.mark.parametrize("damage, needle", [
    (lambda data: b"XXXX" + data[4:], "not a GGUF file"),
    (lambda data: data[:len(data) // 2], "truncated: tensor"),
])
def test_a_bad_gguf_through_the_cli_is_one_line_and_exit_2(gguf_llama, tmp_path, damage, needle):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(damage(gguf_llama[1]["Q4_0"].read_bytes()))
    code, _, err = run_cli("run", "--quiet", "--model", str(bad), "--num-prompts", "1")
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("flexoff: error:"), err
    assert str(bad) in lines[0] and needle in lines[0]


def test_smollm2_reads_with_its_shapes_and_config(smollm2_gguf):
    import gguf

    from flexoff.gguf_format import GGUFFile
    from flexoff.models.gguf_config import config_from_gguf

    ours = GGUFFile(smollm2_gguf)
    theirs = gguf.GGUFReader(str(smollm2_gguf))
    assert len(ours.tensors) == 272
    assert {t.name: tuple(int(d) for d in reversed(t.shape)) for t in theirs.tensors} == \
        {name: info.shape for name, info in ours.tensors.items()}
    config = config_from_gguf(smollm2_gguf)
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads, config.intermediate_size,
            config.vocab_size, config.tie_word_embeddings) == (30, 576, 9, 3, 1536, 49152, True)
    assert config.stored_compression == CompressionConfig(4, 32)


def test_smollm2_from_its_gguf_runs_as_transformers_converted_checkpoint(smollm2_gguf, smollm2_dir):
    """The same weights (transformers dequantizes as flexoff does), tokenizer and template: the
    same greedy text."""
    params = SamplingParams(max_new_tokens=6, temperature=0)
    conversation = [{"role": "user", "content": "What is the capital of France?"}]
    outs = {}
    for source in (smollm2_gguf, smollm2_dir):
        with LLM(str(source), dtype="float32") as llm:
            outs[source] = [(o.prompt_token_ids, o.token_ids) for o in
                            llm.generate(["The capital of France is"], params) + llm.chat(conversation, params)]
    assert outs[smollm2_gguf] == outs[smollm2_dir]


def test_a_batch_jobs_model_identity_is_the_file_and_its_header(gguf_llama, tmp_path):
    from flexoff.harness.batch import model_identity

    path = gguf_llama[1]["Q8_0"]
    identity = model_identity(str(path), dummy=False, seed=0)
    assert identity["path"] == str(path.resolve()) and model_identity(str(path.parent), False, 0) == identity
    assert model_identity(str(gguf_llama[1]["Q4_0"]), False, 0)["gguf_header_sha256"] != identity["gguf_header_sha256"]


def test_a_gguf_without_a_tokenizer_runs_token_ids(tmp_path):
    from tests.weights.gguf_files import tiny_llama, write_gguf

    dropped = dict.fromkeys(["tokenizer.ggml.model", "tokenizer.ggml.tokens", "tokenizer.ggml.merges",
                             "tokenizer.ggml.token_type", "tokenizer.chat_template"])
    path = write_gguf(tmp_path / "bare.gguf", tiny_llama(320), metadata={**dropped, "llama.vocab_size": 320})
    with LLM(str(path)) as llm:
        assert llm.tokenizer is None
        out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_new_tokens=2, min_tokens=2))[0]
    assert len(out.token_ids) == 2
