"""Broken checkpoints are refused with the file and tensor named, before anything large is allocated."""

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from flexoff import LLM
from flexoff.errors import CheckpointError, UnsupportedModelError
from flexoff.weights import DummyWeights
from flexoff.models import REGISTRY, Stage, stage_specs


def copy_model(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_missing_weight_file(tiny_model_dir, tmp_path):
    path = copy_model(tiny_model_dir("opt-pre")[0], tmp_path / "m")
    (path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        LLM(str(path))


def test_corrupt_weight_file_is_named(tiny_model_dir, tmp_path):
    path = copy_model(tiny_model_dir("opt-pre")[0], tmp_path / "m")
    (path / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(CheckpointError, match="model.safetensors"):
        LLM(str(path))


def test_shape_mismatch_names_file_and_tensor(tiny_model_dir, tmp_path):
    path = copy_model(tiny_model_dir("llama-gqa")[0], tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    key = "model.layers.1.mlp.up_proj.weight"
    tensors[key] = torch.randn(7, 32)
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*model\.layers\.1\.mlp\.up_proj\.weight.*\[7, 32\]"):
        LLM(str(path))


def test_missing_tensor_is_named(tiny_model_dir, tmp_path):
    path = copy_model(tiny_model_dir("llama-gqa")[0], tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.0.self_attn.k_proj.weight"]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(CheckpointError, match="model.layers.0.self_attn.k_proj.weight"):
        LLM(str(path))


def test_prequantized_checkpoint_is_refused(tiny_model_dir, tmp_path):
    path = copy_model(tiny_model_dir("llama-gqa")[0], tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="gptq"):
        LLM(str(path))


def test_gptq_tensors_without_config_are_refused(tiny_model_dir, tmp_path):
    path = copy_model(tiny_model_dir("llama-gqa")[0], tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.0.self_attn.q_proj.qweight"] = torch.zeros(4, 32, dtype=torch.int32)
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(UnsupportedModelError, match="qweight"):
        LLM(str(path))


def test_sharded_safetensors_with_index(tiny_model_dir, tmp_path):
    """A checkpoint split into shards with an index reads the same as the single file."""
    src, _ = tiny_model_dir("opt-pre")
    path = copy_model(src, tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    (path / "model.safetensors").unlink()
    names = sorted(tensors)
    half = len(names) // 2
    weight_map = {}
    for shard, chunk in (("model-00001-of-00002.safetensors", names[:half]),
                         ("model-00002-of-00002.safetensors", names[half:])):
        save_file({n: tensors[n] for n in chunk}, path / shard)
        weight_map.update({n: shard for n in chunk})
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    ids = [[5, 6, 7], [8, 9]]
    torch.testing.assert_close(LLM(str(path)).next_token_logits(ids), LLM(str(src)).next_token_logits(ids))


def test_dummy_weights_are_seeded_varied_and_not_constant():
    cfg = REGISTRY["opt-125m"]
    spec = stage_specs(cfg, Stage("layer", 0))[0]
    a = DummyWeights(seed=1).make("layer.0", spec, torch.device("cpu"), torch.float32)
    b = DummyWeights(seed=1).make("layer.0", spec, torch.device("cpu"), torch.float32)
    c = DummyWeights(seed=1).make("layer.1", spec, torch.device("cpu"), torch.float32)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert a.std() > 0.01 and a.unique().numel() > 1000


def test_missing_expert_tensor_is_one_line_naming_it(tiny_model_dir, tmp_path, capsys):
    """An expert saved one by one, with one of its matrices gone, is named, by the CLI in one line."""
    from flexoff.commands.main import main

    path = copy_model(tiny_model_dir("mixtral")[0], tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    key = "model.layers.1.block_sparse_moe.experts.3.w2.weight"
    del tensors[key]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(CheckpointError, match=re.escape(key)):
        LLM(str(path))
    capsys.readouterr()
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a dog\n")
    assert main(["run", "--model", str(path), "--prompts", str(prompts), "--gen-len", "2", "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and key in err[0], err


@pytest.mark.parametrize("stacked", [False, True])
def test_router_disagreeing_with_the_expert_count_is_named(tiny_model_dir, tmp_path, stacked):
    """A router of three rows where config.json says four experts, in either expert layout."""
    path = copy_model(tiny_model_dir("qwen3-moe", safetensors=not stacked)[0], tmp_path / "m")
    key = "model.layers.0.mlp.gate.weight"
    if stacked:
        tensors = torch.load(path / "pytorch_model.bin", weights_only=True)
        tensors[key] = tensors[key][:3].clone()
        torch.save(tensors, path / "pytorch_model.bin")
    else:
        tensors = load_file(path / "model.safetensors")
        tensors[key] = tensors[key][:3].contiguous()
        save_file(tensors, path / "model.safetensors")
    with pytest.raises(CheckpointError, match=re.escape(key) + r".*\[3, 32\].*\[4, 32\]"):
        LLM(str(path))


def test_stacked_experts_of_the_wrong_count_are_named(tiny_model_dir, tmp_path):
    path = copy_model(tiny_model_dir("mixtral", safetensors=False)[0], tmp_path / "m")
    tensors = torch.load(path / "pytorch_model.bin", weights_only=True)
    key = "model.layers.0.mlp.experts.down_proj"
    tensors[key] = tensors[key][:2].clone()
    torch.save(tensors, path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=re.escape(key) + r".*\[2, 32, 16\]"):
        LLM(str(path))


def test_an_unsupported_family_lists_the_supported_ones(tiny_model_dir, tmp_path):
    path = copy_model(tiny_model_dir("mixtral")[0], tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    config["model_type"] = "deepseek_v3"
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="deepseek_v3.*mixtral, qwen2_moe, qwen3_moe"):
        LLM(str(path))
