"""`flexoff eval`'s model_args, as the README lists them, beside lm-eval's own arguments; and a bad
one, a missing one or an unknown task is one line and exit code 2."""

import json
import warnings

import pytest

pytest.importorskip("lm_eval")
pytest.importorskip("yaml")

from .conftest import write_lm_eval_tasks  # noqa: E402
from .test_lm_eval_cli import run_eval  # noqa: E402

DOCS = [{"question": "The cat sat on the", "choices": ["mat", "dog"], "answer": 0}]
TASKS = {"flexoff_args_mc": {"output_type": "multiple_choice", "doc_to_text": "{{question}}",
                             "doc_to_choice": "{{choices}}", "doc_to_target": "{{answer}}",
                             "metric_list": [{"metric": "acc"}]}}


@pytest.fixture(scope="module")
def tasks_dir(tmp_path_factory):
    return write_lm_eval_tasks(tmp_path_factory.mktemp("args-tasks"), TASKS, DOCS)


def eval_with(model_args: str, tasks_dir, *extra: str) -> int:
    return run_eval(["--model", "flexoff", "--model_args", model_args, "--tasks", "flexoff_args_mc",
                     "--include_path", str(tasks_dir), *extra])


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


def test_model_args_device_is_taken_beside_lm_evals_own_device(tiny_opt, tasks_dir, tmp_path, capsys):
    # lm-eval hands its --device (cuda:0 unless told) to the model beside model_args; model_args' wins.
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "cuda:0 is not available" fallback: the model_args device is used
        assert eval_with(f"pretrained={tiny_opt[0]},device=cpu", tasks_dir, "--device", "cuda:0") == 0
    assert "flexoff_args_mc" in capsys.readouterr().out


def test_every_model_args_key_the_readme_lists_is_accepted(tiny_opt, tasks_dir, tmp_path):
    from flexoff import Policy

    policy = tmp_path / "policy.json"
    Policy(gpu_batch_size=2).save(policy)
    keys = {"pretrained": tiny_opt[0], "policy": policy, "dtype": "float32", "device": "cpu", "seed": 3,
            "tokenizer": tiny_opt[0], "gpu_mem": "1GiB", "cpu_mem": "4GiB", "offload_dir": tmp_path / "offload",
            "compress": "off", "greedy_check": "false", "hardware": "t4"}
    out = tmp_path / "out"
    code = eval_with(",".join(f"{k}={v}" for k, v in keys.items()), tasks_dir, "--device", "cpu",
                     "--batch_size", "4", "--output_path", str(out), "--log_samples")
    assert code == 0
    (samples,) = out.rglob("samples_flexoff_args_mc_*.jsonl")
    (sample,) = map(json.loads, samples.read_text().splitlines())
    assert len(sample["resps"]) == len(DOCS[0]["choices"])


def test_policy_auto_without_a_16_bit_dtype_names_the_model_args_key(tiny_opt):
    from flexoff.errors import FlexoffError
    from flexoff.harness.lm_eval_adapter import FlexoffLM

    with pytest.raises(FlexoffError, match="^flexoff model_args policy=auto plans 16-bit weights") as refused:
        FlexoffLM(pretrained=str(tiny_opt[0]), device="cpu", policy="auto", dtype="float32")
    assert "dtype=bfloat16" in str(refused.value) and "--dtype" not in str(refused.value)
    # dtype auto is the 16-bit format the planner plans for, on a CPU too
    FlexoffLM(pretrained=str(tiny_opt[0]), device="cpu", policy="auto").close()


def test_a_missing_pretrained_is_refused_by_name():
    from flexoff.errors import FlexoffError
    from flexoff.harness.lm_eval_adapter import FlexoffLM

    with pytest.raises(FlexoffError, match="^flexoff model_args need pretrained=DIR"):
        FlexoffLM.create_from_arg_obj({"device": "cpu"}, {"device": "cuda:0", "batch_size": 1})


def test_a_bad_model_args_value_ends_flexoff_eval_with_one_line_naming_its_key(tiny_opt, tasks_dir, capsys):
    assert eval_with(f"pretrained={tiny_opt[0]},dtype=float7", tasks_dir, "--device", "cpu") == 2
    assert one_error_line(capsys) == ("flexoff: error: flexoff model_args dtype='float7': unknown dtype 'float7'; "
                                      "use auto, float16, bfloat16 or float32")


@pytest.mark.parametrize("key, value, says", [
    ("gpu_mem", "lots", "cannot parse size 'lots'"),
    ("cpu_mem", "-1", "cpu_mem must be a number > 0"),
    ("device", "tpu", "unknown device 'tpu'"),
    ("compress", "maybe", "compress must be one of"),
    ("seed", "-1", "use an integer in"),
])
def test_a_bad_model_args_value_is_refused_naming_its_key(tiny_opt, key, value, says):
    from flexoff.errors import FlexoffError
    from flexoff.harness.lm_eval_adapter import FlexoffLM

    with pytest.raises(FlexoffError, match=f"^flexoff model_args {key}=.*{says}"):
        FlexoffLM.create_from_arg_string(f"pretrained={tiny_opt[0]},{key}={value}", {"device": "cpu"})


def test_an_unknown_task_is_one_line(tiny_opt, tasks_dir, capsys):
    code = run_eval(["--model", "flexoff", "--model_args", f"pretrained={tiny_opt[0]}", "--tasks", "no_such_task",
                     "--include_path", str(tasks_dir), "--device", "cpu"])
    assert code == 2
    assert one_error_line(capsys) == "flexoff: error: lm_eval: Tasks not found: no_such_task"


def test_lm_evals_python_entry_points_merge_device_the_same_way(tiny_opt):
    from flexoff.harness.lm_eval_adapter import FlexoffLM

    given = {"device": "cuda:0", "batch_size": 8, "max_batch_size": None}
    for lm in (FlexoffLM.create_from_arg_string(f"pretrained={tiny_opt[0]},device=cpu", given),
               FlexoffLM.create_from_arg_obj({"pretrained": str(tiny_opt[0]), "device": "cpu"}, given)):
        assert lm.llm.device.type == "cpu"
        lm.close()


def test_a_policy_files_compression_reaches_flexoff_eval(tiny_opt, tasks_dir, tmp_path):
    # bench/accuracy.py hands each compression setting to flexoff eval this way: as a policy file.
    from flexoff import CompressionConfig, Policy

    scores = {}
    for name, compression in (("plain", None), ("2-bit", CompressionConfig(2, 64))):
        policy = tmp_path / f"{name}.json"
        Policy(gpu_batch_size=2, compress_weight=compression).save(policy)
        out = tmp_path / name
        assert eval_with(f"pretrained={tiny_opt[0]},policy={policy},dtype=float32,device=cpu,greedy_check=false",
                         tasks_dir, "--output_path", str(out), "--log_samples") == 0
        (samples,) = out.rglob("samples_flexoff_args_mc_*.jsonl")
        (sample,) = map(json.loads, samples.read_text().splitlines())
        scores[name] = [float(resp[0][0]) for resp in sample["resps"]]
    assert scores["2-bit"] != scores["plain"]
