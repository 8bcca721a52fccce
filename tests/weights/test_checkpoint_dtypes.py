"""A weight stored as integers is refused, naming the file and tensor, where it used to be cast and
run; a checkpoint's integer buffers that are not weights (position_ids) are no reason to refuse."""

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from flexoff import LLM, Policy, SamplingParams
from flexoff.commands.main import main
from flexoff.errors import CheckpointError

KEY = "model.decoder.layers.1.fc1.weight"


def saved_with(src, dst, change, safetensors: bool):
    """A copy of the checkpoint at ``src`` whose tensors went through ``change`` (a dict -> dict)."""
    shutil.copytree(src, dst)
    if safetensors:
        save_file(change(load_file(dst / "model.safetensors")), dst / "model.safetensors")
    else:
        torch.save(change(torch.load(dst / "pytorch_model.bin", weights_only=True)), dst / "pytorch_model.bin")
    return dst


def as_int32(tensors):
    return {**tensors, KEY: (tensors[KEY] * 100).to(torch.int32)}


@pytest.mark.parametrize("safetensors, named", [(True, "I32"), (False, "int32")])
def test_an_integer_weight_is_refused_naming_the_tensor(tiny_model_dir, tmp_path, safetensors, named):
    path = saved_with(tiny_model_dir("opt-pre", safetensors)[0], tmp_path / "m", as_int32, safetensors)
    with pytest.raises(CheckpointError, match=rf"tensor '{KEY}' holds {named} values, but a weight must be "
                                              r"floating point"):
        LLM(str(path), device="cpu")


def test_flexoff_run_on_it_is_one_line_and_exit_code_2(tiny_model_dir, tmp_path, capsys):
    path = saved_with(tiny_model_dir("opt-pre")[0], tmp_path / "m", as_int32, True)
    assert main(["run", "--model", str(path), "--prompt-len", "4", "--num-prompts", "1", "--gen-len", "2", "--quiet",
                 "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"tensor '{KEY}' holds I32 values" in err


def test_integer_buffers_that_are_not_weights_are_left_alone(tiny_model_dir, tmp_path):
    src, _ = tiny_model_dir("opt-pre")
    with_buffer = saved_with(src, tmp_path / "m", lambda t: {**t, "model.decoder.position_ids":
                                                             torch.arange(16, dtype=torch.int64)[None]}, True)
    params = SamplingParams(max_tokens=3)
    outputs = []
    for path in (src, with_buffer):
        llm = LLM(str(path), policy=Policy(gpu_batch_size=1), device="cpu", dtype="float32")
        outputs.append(llm.generate([[5, 6, 7]], params)[0].token_ids)
        llm.close()
    assert outputs[0] == outputs[1] and len(outputs[0]) == 3
