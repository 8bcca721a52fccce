"""Flags that cannot apply are named, the commands share their flag names, and `--policy auto` and a
searched policy with data on disk run as the README gives them (no --dtype, no --offload-dir)."""

import json
from types import SimpleNamespace

import pytest

from flexoff.commands.args import unused_flags
from flexoff.commands.main import build_parser, main

TINY_RUN = ["--num-prompts", "1", "--prompt-len", "4", "--gen-len", "1", "--quiet"]


def warnings_in(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("flexoff: warning: ")]


@pytest.mark.parametrize("extra, needle", [
    (["--expert-percent", "0", "100"], "--expert-percent has no effect"),
    (["--compress", "on"], "--compress on has no effect"),
    (["--compress", "auto", "--gpu-batch-size", "1"], "the policy flags set the policy"),
    (["--weight-bits", "3"], "--weight-bits has no effect without --compress-weight"),
    (["--cache-bits", "8", "--cache-group", "32"], "--cache-bits and --cache-group have no effect"),
    (["--parallel-timeout", "5"], "--parallel-timeout has no effect"),
])
def test_a_flag_without_effect_is_one_warning_and_the_job_still_runs(tiny_model_dir, capsys, extra, needle):
    path, _ = tiny_model_dir("opt-pre")
    assert main(["run", "--model", str(path), *TINY_RUN, *extra]) == 0
    found = warnings_in(capsys.readouterr().err)
    assert len(found) == 1 and needle in found[0], found


def test_flags_that_apply_give_no_warning(tiny_model_dir, capsys):
    path, _ = tiny_model_dir("opt-pre")
    assert main(["run", "--model", str(path), *TINY_RUN, "--compress-weight", "--weight-bits", "8",
                 "--compress", "auto", "--policy", "auto", "--hardware", "t4", "--gpu-mem", "50KB"]) == 0
    assert warnings_in(capsys.readouterr().err) == []


def test_expert_placement_of_a_mixture_of_experts_is_no_warning():
    args = build_parser().parse_args(["run", "--expert-percent", "0", "100"])
    moe = SimpleNamespace(config=SimpleNamespace(num_experts=8, name="mixtral"), plan=None, ranks=None)
    assert unused_flags(args, moe) == []
    dense = SimpleNamespace(config=SimpleNamespace(num_experts=0, name="opt"), plan=None, ranks=None)
    assert len(unused_flags(args, dense)) == 1


def test_a_file_given_as_offload_dir_is_refused_before_the_model_loads(tmp_path, capsys, monkeypatch):
    import flexoff.commands.main as commands
    from flexoff import LLM
    from flexoff.errors import PolicyError

    file = tmp_path / "notes.txt"
    file.write_text("keep")
    monkeypatch.setattr(commands, "make_llm", lambda *a, **k: pytest.fail("the model was loaded"))
    assert main(["run", *TINY_RUN, "--offload-dir", str(file)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and f"offload directory {file} is a file" in err
    with pytest.raises(PolicyError, match="is a file"):
        LLM("opt-125m", dummy=True, offload_dir=str(file))
    assert file.read_text() == "keep"


@pytest.mark.parametrize("command", [
    ["run"], ["batch", "--input", "i.jsonl", "--output", "o.jsonl"], ["bench", "--scenario", "xsum"]])
@pytest.mark.parametrize("spelling", ["--quiet", "--no-progress"])
def test_every_command_with_a_progress_bar_takes_both_spellings_of_quiet(command, spelling):
    assert build_parser().parse_args([*command, spelling]).quiet is True
    assert build_parser().parse_args(command).quiet is False


def test_policy_auto_on_the_cpu_runs_in_the_16_bit_dtype_it_plans_for(tiny_model_dir, capsys):
    path, _ = tiny_model_dir("opt-pre")
    assert main(["run", "--model", str(path), *TINY_RUN, "--device", "cpu", "--policy", "auto",
                 "--hardware", "t4"]) == 0
    out = capsys.readouterr().out
    assert "float16 on cpu" in out


def test_the_python_api_plans_policy_auto_in_16_bits_on_the_cpu(tiny_model_dir):
    from flexoff import LLM
    from flexoff.planner import Workload

    path, _ = tiny_model_dir("opt-pre")
    with LLM(str(path), device="cpu", policy="auto", workload=Workload(4, 1, 1), hardware="t4") as llm:
        assert llm.dtype.itemsize == 2
    with LLM(str(path), device="cpu") as llm:  # without planning, auto stays float32 on the CPU
        assert llm.dtype.itemsize == 4


def test_a_policy_with_data_on_disk_runs_without_an_offload_dir(tiny_model_dir, tmp_path, capsys, monkeypatch):
    """As `flexoff search --output policy.json` writes one; the disk tier then goes in the system's
    temporary folder, in a private folder removed on exit."""
    import tempfile

    path, _ = tiny_model_dir("opt-pre")
    policy = tmp_path / "policy.json"
    policy.write_text(json.dumps({"gpu_batch_size": 1, "num_gpu_batches": 1,
                                  "weights": {"gpu": 0.0, "cpu": 0.5, "disk": 0.5},
                                  "cache": {"gpu": 0.0, "cpu": 0.0, "disk": 1.0}}))
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.delenv("FLEXOFF_OFFLOAD_DIR", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    assert main(["run", "--model", str(path), *TINY_RUN, "--policy", str(policy)]) == 0
    assert " disk 0 B" not in capsys.readouterr().out  # the disk tier held weights
    assert list(temp.iterdir()) == []  # and its folder is gone
