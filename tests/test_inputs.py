"""Flags and files are checked by type and range, and an error says what really happened, in one line."""

import json

import pytest

from flexoff import fileio
from flexoff.commands.main import main
from flexoff.errors import ConfigError, PolicyError, PromptError, TokenizerError
from flexoff.harness.batch import read_batch_input
from flexoff.planner.hardware import HardwareProfile, resolve_hardware
from flexoff.prompts import read_prompts
from flexoff.policy import Policy, placement_from_percent
from flexoff.tokenizer import Tokenizer

# (argv, words the one line must hold); every one is refused while parsing, before any model loads.
BAD_FLAGS = [
    (["run", "--device", "tpu"], "--device: unknown device 'tpu'"),
    (["run", "--seed", str(2**64)], "--seed: must be an integer in [0, "),
    (["run", "--seed", "-1"], "--seed: must be an integer in [0, "),
    (["run", "--seed", "1.5"], "--seed: expected an integer"),
    (["run", "--top-p", "1.5"], "--top-p: must be a number in (0, 1]"),
    (["run", "--top-p", "0"], "--top-p: must be a number in (0, 1]"),
    (["run", "--top-p", "nan"], "--top-p"),
    (["run", "--temperature", "-1"], "--temperature: must be a number >= 0"),
    (["run", "--temperature", "inf"], "--temperature"),
    (["run", "--top-k", "-1"], "--top-k: must be an integer >= 0"),
    (["run", "--gpu-batch-size", "0"], "--gpu-batch-size: must be an integer >= 1"),
    (["run", "--num-gpu-batches", "2.5"], "--num-gpu-batches: expected an integer"),
    (["run", "--prompt-len", "0"], "--prompt-len"),
    (["run", "--num-prompts", "many"], "--num-prompts: expected an integer >= 1, got 'many'"),
    (["run", "--gen-len", "0"], "--gen-len"),
    (["run", "--weight-bits", "5"], "--weight-bits: invalid choice: 5"),
    (["run", "--cache-bits", "16"], "--cache-bits"),
    (["run", "--weight-group", "0"], "--weight-group: must be an integer >= 2"),
    (["run", "--cache-group", "-4"], "--cache-group"),
    (["run", "--percent", "150", "0", "100", "0", "100", "0"], "--percent: must be a number in [0, 100], got 150"),
    (["run", "--percent", "-5", "0", "100", "0", "100", "0"], "--percent"),
    (["run", "--gpu-mem", "0"], "--gpu-mem: must be a positive size"),
    (["run", "--cpu-mem", "9" * 400], "--cpu-mem: size"),
    (["run", "--dtype", "int8"], "--dtype: unknown dtype 'int8'"),
    (["run", "--stop", ""], "--stop: must not be empty"),
    (["run", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    ([], "required: COMMAND"),
    (["search", "--model", "opt-125m", "--max-latency", "nan"], "--max-latency: must be a number > 0"),
    (["search", "--model", "opt-125m", "--num-prompts", "0"], "--num-prompts"),
    (["search", "--model", "opt-125m", "--disk-mem", "-1GB"], "--disk-mem"),
    (["batch", "--input", "x", "--output", "y", "--max-new-tokens", "0"], "--max-new-tokens"),
    (["batch", "--input", "x", "--output", "y", "--top-p", "2"], "--top-p"),
    (["bench", "--scenario", "xsum", "--max-instances", "0"], "--max-instances"),
    (["bench", "--scenario", "xsum", "--num-in-context", "-1"], "--num-in-context"),
    (["bench", "--scenario", "xsum", "--seed", "-1"], "--seed"),
    (["bench", "--scenario", "xsum", "--device", "tpu"], "--device"),
]


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("flexoff: error: "), err
    return lines[0]


@pytest.mark.parametrize("argv, words", BAD_FLAGS, ids=[" ".join(a)[:60] for a, _ in BAD_FLAGS])
def test_a_bad_flag_is_one_line_and_exit_2(capsys, argv, words):
    assert main(argv) == 2
    assert words in one_error_line(capsys)


@pytest.mark.parametrize("argv", [["--help"], ["run", "--help"], ["search", "--help"], ["batch", "--help"]])
def test_help_still_prints_and_exits_0(capsys, argv):
    assert main(argv) == 0
    assert "usage: flexoff" in capsys.readouterr().out


@pytest.mark.parametrize("percent, words", [
    ((60, 50, 100, 0, 100, 0), "--percent: weights on gpu and cpu add up to 110%, more than 100"),
    ((100, 0, 50.5, 50, 100, 0), "--percent: cache on gpu and cpu add up to 100.5%"),
    ((100, 0, 100, 0, 150, 0), "--percent: activations on gpu must be a number in [0, 100]"),
])
def test_percent_out_of_range_names_the_flag_not_a_negative_disk_share(percent, words):
    with pytest.raises(PolicyError) as info:
        placement_from_percent(percent)
    assert words in str(info.value) and "negative" not in str(info.value)


def test_percent_pairs_that_leave_the_rest_to_disk():
    placement = placement_from_percent((20, 30, 100, 0, 100, 0))
    assert placement["weights"].as_tuple() == pytest.approx((0.2, 0.3, 0.5))


def test_percent_pair_over_100_from_the_command_line(capsys):
    assert main(["run", "--quiet", "--percent", "60", "50", "100", "0", "100", "0"]) == 2
    assert "--percent: weights on gpu and cpu add up to 110%" in one_error_line(capsys)


@pytest.mark.parametrize("data, words", [
    ({"cpu_attention": "no"}, "cpu_attention must be true or false, got 'no'"),
    ({"overlap": 0}, "overlap must be true or false"),
    ({"pin_cpu_memory": None}, "pin_cpu_memory"),
    ({"gpu_batch_size": 2.0}, "gpu_batch_size must be an integer in [1, 1048576], got 2.0"),
    ({"gpu_batch_size": True}, "gpu_batch_size"),
    ({"num_gpu_batches": "2"}, "num_gpu_batches"),
    ({"weights": {"gpu": "1", "cpu": 0, "disk": 0}}, "weights: tier fraction on gpu must be a number"),
    ({"weights": {"gpu": 1.5, "cpu": -0.5, "disk": 0}}, "weights: tier fraction on cpu is negative"),
    ({"cache": {"gpu": float("nan"), "cpu": 1, "disk": 0}}, "cache: tier fraction on gpu must be a finite"),
    ({"cache": [1, 0, 0]}, "cache must be a JSON object"),
    ({"activations": {"gpu": 1, "ssd": 0}}, "activations: unknown field 'ssd'"),
    ({"compress_weight": {"bits": 4.0}}, "compress_weight: compression bits must be an integer"),
    ({"compress_cache": {"bits": 4, "group_size": False}}, "compress_cache: compression group size"),
    ({"compress_cache": {"bits": 4, "group_sise": 64}}, "compress_cache: unknown field 'group_sise'"),
    ({"gpu_batchsize": 4}, "unknown policy field 'gpu_batchsize'"),
])
def test_a_policy_file_is_checked_field_by_field(tmp_path, data, words):
    path = tmp_path / "policy.json"
    path.write_text(json.dumps(data))
    with pytest.raises(PolicyError) as info:
        Policy.load(path)
    assert str(info.value).startswith(f"{path}: ") and words in str(info.value)


def test_a_policy_file_with_a_string_switch_is_refused_from_the_command_line(tmp_path, capsys):
    path = tmp_path / "policy.json"
    path.write_text(json.dumps({"cpu_attention": "no"}))
    assert main(["run", "--quiet", "--policy", str(path)]) == 2
    assert "cpu_attention must be true or false" in one_error_line(capsys)


@pytest.mark.parametrize("name", ["prompts.JSONL", "prompts.Jsonl"])
def test_jsonl_prompts_file_in_any_case(tmp_path, name):
    path = tmp_path / name
    path.write_text(json.dumps({"id": 7, "prompt": [5, 6], "max_new_tokens": 3, "stop": "x"}) + "\n")
    (line,) = read_prompts(path)
    assert (line.prompt, line.id, line.max_new_tokens, line.stop) == ([5, 6], "7", 3, ("x",))


@pytest.mark.parametrize("name", ["prompts.json", "prompts.JSON"])
def test_json_prompts_file_holds_a_list(tmp_path, name):
    path = tmp_path / name
    path.write_text(json.dumps(["the cat", [5, 6, 7], {"id": "q", "prompt": "a dog", "max_new_tokens": 2}]))
    lines = read_prompts(path)
    assert [(line.prompt, line.id, line.max_new_tokens) for line in lines] == [
        ("the cat", None, None), ([5, 6, 7], None, None), ("a dog", "q", 2)]


@pytest.mark.parametrize("text, words", [
    ('{"prompt": "a"}', "holds one JSON list of prompts or prompt objects, not a dict"),
    ('["a", 5]', "item 2 must be text or a list of token ids"),
    ('["a", "  "]', "item 2 is empty"),
    ('[{"prompt": "a", "max_new_tokens": 0}]', "item 1: field 'max_new_tokens' must be an integer >= 1"),
    ('["a",', "is not valid JSON"),
    ("[]", "holds no prompts"),
])
def test_bad_json_prompts_file(tmp_path, text, words):
    path = tmp_path / "prompts.json"
    path.write_text(text)
    with pytest.raises(PromptError, match=words.replace("(", r"\(").replace(")", r"\)")):
        read_prompts(path)


@pytest.mark.parametrize("record, words", [
    ({"prompt": "a", "max_tokens": 3}, "unknown field 'max_tokens'"),
    ({"prompt": [1, -2]}, "field 'prompt' must be text or a list of token ids"),
    ({"prompt": "a", "id": ""}, "field 'id' must be a non-empty string or an integer"),
    ({"prompt": "a", "stop": ["\n", ""]}, "field 'stop' has an empty string"),
])
def test_run_and_batch_check_a_record_alike(tmp_path, record, words):
    path = tmp_path / "in.jsonl"
    path.write_text(json.dumps({"id": "x", **record}) + "\n")
    for read in (read_prompts, read_batch_input):
        with pytest.raises(PromptError, match=words):
            read(path)


def deny_reading(monkeypatch):
    """Make every file read through flexoff.fileio fail as an unreadable file does (the tests may run as
    root, who can read anything)."""
    def denied(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(fileio, "open", denied, raising=False)


@pytest.mark.parametrize("read, error, what", [
    (read_prompts, PromptError, "prompts file"),
    (Policy.load, PolicyError, "policy file"),
    (HardwareProfile.load, ConfigError, "hardware profile"),
    (lambda path: read_batch_input(path), PromptError, "input file"),
    (resolve_hardware, ConfigError, "hardware profile"),
])
def test_an_unreadable_file_is_not_reported_missing(tmp_path, monkeypatch, read, error, what):
    path = tmp_path / "file.json"
    path.write_text("{}")
    deny_reading(monkeypatch)
    with pytest.raises(error) as info:
        read(str(path))
    assert str(info.value) == f"cannot read {what} {path}: permission denied"


def test_a_directory_or_a_missing_file_says_so(tmp_path):
    with pytest.raises(PromptError, match="is a directory"):
        read_prompts(tmp_path)
    with pytest.raises(PolicyError, match="no such file"):
        Policy.load(tmp_path / "none.json")


def test_a_profile_that_cannot_be_looked_at_is_not_called_missing(tmp_path, monkeypatch):
    import os

    path = tmp_path / "profile.json"
    real_stat = os.stat
    monkeypatch.setattr(fileio.os, "stat", lambda p, *a, **k: (_ for _ in ()).throw(PermissionError(13, "x"))
                        if str(p) == str(path) else real_stat(p, *a, **k))
    deny_reading(monkeypatch)
    with pytest.raises(ConfigError, match="permission denied"):
        resolve_hardware(str(path))
    with pytest.raises(ConfigError, match="neither a file nor a packaged profile"):
        resolve_hardware(str(tmp_path / "none.json"))


def test_a_given_tokenizer_path_is_used_or_refused_by_name(tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("the cat\n")
    assert main(["run", "--quiet", "--tokenizer", str(tmp_path / "no"), "--prompts", str(prompts)]) == 2
    line = one_error_line(capsys)
    assert f"tokenizer '{tmp_path / 'no'}' does not exist" in line and "has no tokenizer" not in line
    with pytest.raises(TokenizerError, match="has no tokenizer files"):
        Tokenizer.for_model("opt-125m", tmp_path)



@pytest.mark.parametrize("kwargs, words", [
    (dict(dummy="maybe"), "dummy='maybe': use true or false"),
    (dict(greedy_check="nope"), "greedy_check='nope'"),
    (dict(seed="abc"), "seed='abc'"),
    (dict(seed=-1), "seed=-1: use an integer in [0, "),
    (dict(seed=1.5), "seed=1.5: use an integer"),
    (dict(policy="/no/such.json"), "cannot read policy file /no/such.json: no such file"),
    (dict(tokenizer="/no/such"), "tokenizer '/no/such' does not exist"),
])
def test_lm_eval_adapter_checks_its_model_args(kwargs, words):
    pytest.importorskip("lm_eval")
    from flexoff.errors import FlexoffError
    from flexoff.harness.lm_eval_adapter import FlexoffLM

    with pytest.raises(FlexoffError) as info:
        FlexoffLM(**{"pretrained": "opt-125m", "dummy": True, "device": "cpu", **kwargs})
    assert words in str(info.value)


def test_lm_eval_adapter_bad_path_is_one_line_and_exit_2(tmp_path):
    pytest.importorskip("lm_eval")
    import sys

    from tests import processes

    proc = processes.run([sys.executable, "-m", "flexoff.commands.lm_eval", "--model", "flexoff",
                          "--model_args", f"pretrained={tmp_path / 'none'}", "--tasks", "hellaswag",
                          "--device", "cpu"])
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(f"flexoff: error: unknown model '{tmp_path / 'none'}'")
