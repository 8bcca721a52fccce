"""A job of another shape than the profile measured is planned as usual, with one note naming what the prediction
carries over: the packaged H200 profile measured attention at a prompt of 512 and 544 keys; a profile of
published constants (T4) never claimed a shape."""

import dataclasses
import json

from flexoff.commands.main import main
from flexoff.planner.cost_model import Workload
from flexoff.planner.coverage import extrapolated, extrapolation_note
from flexoff.planner.hardware import packaged_profile
from tests.conftest import PROMPTS


def test_the_measured_shape_needs_no_note_and_a_longer_one_names_both_sizes():
    h200 = packaged_profile("h200")
    assert extrapolated(h200, Workload(512, 32)) == []
    assert extrapolated(h200, Workload(300, 200)) == []
    assert extrapolated(h200, Workload(512, 256)) == ["decode attention over up to 768 keys (measured at 544)"]
    assert extrapolated(h200, Workload(1024, 32)) == [
        "prefill attention over prompts of 1024 tokens (measured at 512)",
        "decode attention over up to 1056 keys (measured at 544)"]
    assert extrapolation_note(h200, Workload(512, 256)) == (
        "note: the prediction extrapolates the h200 profile's decode attention over up to 768 keys (measured at 544)")


def test_the_bound_is_the_profiles_own_measurement():
    small = dataclasses.replace(packaged_profile("h200"), measurements={"attention": {"prompt": 64, "keys": 80}})
    assert extrapolated(small, Workload(64, 16)) == []
    assert extrapolated(small, Workload(64, 17)) == ["decode attention over up to 81 keys (measured at 80)"]


def test_published_constants_get_no_note():
    t4 = packaged_profile("t4")
    assert extrapolated(t4, Workload(2048, 512)) == [] and extrapolation_note(t4, Workload(2048, 512)) is None


def test_search_prints_the_note_only_for_a_shape_it_extrapolates(capsys):
    common = ["search", "--model", "opt-1.3b", "--hardware", "h200", "--gpu-mem", "1GiB", "--prompt-len", "512"]
    assert main([*common, "--gen-len", "32"]) == 0
    assert "extrapolates" not in capsys.readouterr().out
    assert main([*common, "--gen-len", "256"]) == 0
    out = capsys.readouterr().out
    assert "note: the prediction extrapolates the h200 profile's decode attention over up to 768 keys" in out
    assert "throughput" in out  # still planned


def test_policy_auto_plans_and_says_so(tiny_model_dir, tmp_path, capsys):
    path, _ = tiny_model_dir("opt-pre")
    profile = packaged_profile("h200").to_dict()
    profile["measurements"]["attention"].update(prompt=4, keys=8)
    file = tmp_path / "profile.json"
    file.write_text(json.dumps(profile))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    assert main(["run", "--model", str(path), "--prompts", str(prompts), "--hardware", str(file), "--dtype",
                 "bfloat16", "--gpu-mem", "50KB", "--gen-len", "4", "--quiet", "--ignore-eos", "--policy", "auto",
                 "--compress", "auto", "--output", str(tmp_path / "out.jsonl")]) == 0
    err = capsys.readouterr().err
    assert "searched   " in err
    note = next(line.strip() for line in err.splitlines() if "extrapolates" in line)
    assert note.startswith("note: the prediction extrapolates the h200 profile's prefill attention over prompts of ")
    assert "tokens (measured at 4); decode attention over up to " in note and note.endswith("keys (measured at 8)")
    assert (tmp_path / "out.jsonl").exists()
