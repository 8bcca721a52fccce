"""No command destroys a file it was given: an output that is also an input, or one output named
twice, is refused in one line naming both flags, before the model loads or anything is measured,
and the file's bytes stay as they were."""

import argparse
import os

import pytest

from flexoff.commands import main as main_module
from flexoff.commands import search as search_module
from flexoff.commands.llm import make_llm
from flexoff.commands.main import main
from flexoff.commands.paths import check_outputs
from flexoff.errors import OutputError

PROMPTS = b'{"id": 1, "prompt": [5, 6, 7]}\n{"id": 2, "prompt": [8, 9]}\n'


@pytest.fixture(autouse=True)
def nothing_loads(monkeypatch):
    """A refused run must stop before the model loads, the profile is measured or a search runs."""
    def never(*args, **kwargs):
        raise AssertionError("the command went on past its file check")

    monkeypatch.setattr(main_module, "make_llm", never)
    monkeypatch.setattr("flexoff.commands.harness.make_llm", never)
    monkeypatch.setattr("flexoff.profiler.machine.profile_machine", never)
    monkeypatch.setattr(search_module, "search_policy", never)


def refused(argv, capsys, *flags) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("flexoff: error: ") and "Traceback" not in err, err
    for flag in flags:
        assert flag in err, (flag, err)
    return err


def test_run_refuses_the_same_file_for_results_and_metrics(tmp_path, capsys):
    target = tmp_path / "out.jsonl"
    target.write_bytes(b"earlier results\n")
    err = refused(["run", "--output", str(target), "--metrics-json", str(target)], capsys,
                  "--output", "--metrics-json")
    assert "same file" in err
    assert target.read_bytes() == b"earlier results\n"


def test_run_refuses_results_over_its_prompts(tmp_path, capsys, monkeypatch):
    prompts = tmp_path / "p.jsonl"
    prompts.write_bytes(PROMPTS)
    monkeypatch.chdir(tmp_path)
    # The same file by another spelling, through a symbolic link, and through a hard link.
    (tmp_path / "link.jsonl").symlink_to(prompts)
    os.link(prompts, tmp_path / "hard.jsonl")
    for output in ("p.jsonl", "./p.jsonl", str(prompts), "link.jsonl", "hard.jsonl", "sub/../p.jsonl"):
        (tmp_path / "sub").mkdir(exist_ok=True)
        err = refused(["run", "--prompts", "p.jsonl", "--output", output], capsys, "--output", "--prompts")
        assert "destroy" in err
        assert prompts.read_bytes() == PROMPTS, output
    refused(["run", "--prompts", "p.jsonl", "--metrics-json", "./p.jsonl"], capsys, "--metrics-json", "--prompts")
    assert prompts.read_bytes() == PROMPTS


def test_run_refuses_outputs_over_its_policy_profile_or_model_files(tmp_path, capsys):
    policy = tmp_path / "policy.json"
    policy.write_text('{"gpu_batch_size": 2}')
    refused(["run", "--policy", str(policy), "--metrics-json", str(policy)], capsys, "--metrics-json", "--policy")
    refused(["run", "--policy", "auto", "--hardware", str(policy), "--output", str(policy)], capsys,
            "--output", "--hardware")
    assert policy.read_text() == '{"gpu_batch_size": 2}'
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text("{}")
    err = refused(["run", "--model", str(checkpoint), "--output", str(checkpoint / "config.json")], capsys,
                  "--output", "--model")
    assert "model" in err and (checkpoint / "config.json").read_text() == "{}"
    refused(["run", "--model", str(checkpoint), "--tokenizer", str(checkpoint),
             "--metrics-json", str(checkpoint / "tokenizer.json")], capsys, "--metrics-json")
    assert not (checkpoint / "tokenizer.json").exists()


def test_batch_refuses_results_over_its_input_naming_both_flags(tmp_path, capsys):
    for name, text in (("in.jsonl", PROMPTS),
                       ("openai.jsonl", b'{"custom_id": "a", "method": "POST", "url": "/v1/completions", '
                                        b'"body": {"prompt": [5, 6]}}\n')):
        source = tmp_path / name
        source.write_bytes(text)
        refused(["batch", "--model", "opt-125m", "--dummy", "--input", str(source), "--output", f"{tmp_path}/./{name}"],
                capsys, "--output", "--input")
        assert source.read_bytes() == text
        assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no lock left


def test_bench_refuses_an_output_folder_that_holds_an_input(tmp_path, capsys):
    data = tmp_path / "out" / "data.jsonl"
    data.parent.mkdir()
    data.write_bytes(b'{"id": "q1", "input": "2 + 2", "references": ["4"]}\n')
    refused(["bench", "--model", "m", "--scenario", "synthetic_reasoning", "--data", str(data),
             "--output-dir", str(data.parent)], capsys, "--output-dir", "--data")
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    refused(["bench", "--model", str(checkpoint), "--scenario", "synthetic_reasoning", "--output-dir",
             str(checkpoint)], capsys, "--output-dir", "--model")
    assert sorted(p.name for p in data.parent.iterdir()) == ["data.jsonl"]
    assert list(checkpoint.iterdir()) == []


def test_search_refuses_an_output_twice_or_over_its_profile(tmp_path, capsys):
    profile = tmp_path / "h.json"
    profile.write_text("{}")
    refused(["search", "--model", "opt-125m", "--hardware", str(profile), "--output", str(profile)], capsys,
            "--output", "--hardware")
    table = tmp_path / "frontier.csv"
    table.write_text("kept\n")
    refused(["search", "--model", "opt-125m", "--hardware", "h200", "--output", str(table), "--pareto-csv",
             str(table)], capsys, "--output", "--pareto-csv")
    assert profile.read_text() == "{}" and table.read_text() == "kept\n"


def test_profile_checks_its_output_before_measuring(tmp_path, capsys):
    refused(["profile", "--quick", "--output", str(tmp_path)], capsys, "--output")  # a directory
    (tmp_path / "file").write_text("x")
    refused(["profile", "--quick", "--output", str(tmp_path / "file" / "p.json")], capsys, "--output")


def namespace(**flags) -> argparse.Namespace:
    return argparse.Namespace(**flags)


def test_outputs_beside_inputs_and_new_files_in_a_model_folder_are_fine(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_bytes(PROMPTS)
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text("{}")
    args = namespace(prompts=str(prompts), model=str(checkpoint), tokenizer=None, policy="auto", hardware="h200")
    check_outputs(args, {"--output": str(tmp_path / "out.jsonl"), "--metrics-json": str(tmp_path / "m.json")})
    check_outputs(args, {"--output": str(checkpoint / "results.jsonl"), "--metrics-json": None})
    check_outputs(args, {}, {"--output-dir": str(tmp_path / "bench")})
    # A registry name or a packaged profile is no file, even where a file of that name is missing.
    check_outputs(namespace(model="opt-125m", hardware="h200"), {"--output": "opt-125m"})
    assert prompts.read_bytes() == PROMPTS


def test_outputs_that_overlap_are_refused(tmp_path):
    args = namespace()
    folder = tmp_path / "bench"
    with pytest.raises(OutputError, match="--output .* and --output-dir .* name the same file"):
        check_outputs(args, {"--output": str(folder / "summary.json")}, {"--output-dir": str(folder)})
    nested = namespace(data=str(tmp_path))  # an input folder that holds the output folder is read, not written
    check_outputs(nested, {}, {"--output-dir": str(folder)})
    with pytest.raises(OutputError, match="--output-dir .* holds --data"):
        check_outputs(namespace(data=str(folder.parent)), {}, {"--output-dir": str(tmp_path)})


DEAD_PID = 2 ** 22 + 7  # above Linux's largest pid_max: no process ever has it


def dead_owners_folder(base):
    """An offload folder as a disk run killed outright leaves it: marked by an owner that is gone."""
    import json

    from flexoff.runtime.offload_dir import OWNER_FILE, PREFIX, owner_of

    folder = base / (PREFIX + "killed")
    folder.mkdir(parents=True)
    (folder / "weights").write_bytes(b"x" * 4096)
    (folder / OWNER_FILE).write_text(json.dumps({**owner_of(os.getpid()), "pid": DEAD_PID}))
    return folder


def test_a_run_that_puts_nothing_on_disk_removes_dead_owners_offload_folders(tiny_model_dir, tmp_path):
    from flexoff import LLM
    from flexoff.runtime.offload_dir import PREFIX

    path, _ = tiny_model_dir("opt-pre")
    base = tmp_path / "offload"
    killed = dead_owners_folder(base)
    live = base / (PREFIX + "live")  # unmarked: maybe being made right now, so kept
    live.mkdir()
    with LLM(str(path), device="cpu", dtype="float32", offload_dir=str(base)) as llm:
        assert not llm.policy.uses_disk
        assert not killed.exists() and live.is_dir()


def test_the_run_command_sweeps_its_offload_dir(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(main_module, "make_llm", make_llm)  # this run goes on: the model loads
    base = tmp_path / "offload"
    killed = dead_owners_folder(base)
    assert main(["run", "--quiet", "--num-prompts", "1", "--prompt-len", "4", "--gen-len", "1",
                 "--offload-dir", str(base)]) == 0
    assert not killed.exists() and list(base.iterdir()) == []
