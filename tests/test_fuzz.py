"""Fuzzing every entry point with bad input: whatever a user feeds the command line (config.json, policy and
profile files, prompt files, flags), flexoff ends with exit code 0 or 2, never a traceback, at most one line
on stderr when it refuses, and no file left in the offload directory.

The commands run in-process through ``flexoff.commands.main.main``, so that hypothesis can try many inputs in CI time.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from flexoff.commands.main import main

# Deterministic, so that CI runs the same inputs every time; a failure prints the input that caused it.
FUZZ = settings(max_examples=int(os.environ.get("FLEXOFF_FUZZ_EXAMPLES", "100")), deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

# Values a hand-edited or generated file may hold where flexoff expects something else.
ODD_NUMBERS = [0, -1, 1, 2, 3, 7, 63, 64, 65, 2**31, 2**63, 10**30, 0.5, -0.25, 1e-12, 1e300,
               math.nan, math.inf, -math.inf]
JSON_VALUES = st.one_of(
    st.sampled_from(ODD_NUMBERS), st.none(), st.booleans(), st.integers(-5, 100),
    st.text(max_size=6), st.sampled_from(["4", "no", "yes", "true", "1e3", "", "auto", "gpu"]),
    st.lists(st.integers(-2, 70), max_size=3), st.dictionaries(st.sampled_from(["a", "type", "factor"]),
                                                               st.integers(-1, 9), max_size=2),
)


def run_cli(argv: list[str], offload_dir: Path) -> tuple[int, str]:
    """The exit code and stderr of one in-process command; an exception escaping main() fails the test,
    since a user would have seen it as a traceback."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(argv)
        except SystemExit as exit_:  # argparse's way of refusing a flag
            code = exit_.code
    stderr = err.getvalue()
    assert code in (0, 2), f"exit code {code} for {argv}: {stderr}"
    assert "Traceback" not in stderr, stderr
    if code == 2:
        lines = [line for line in stderr.splitlines() if line.strip()]
        assert len(lines) == 1, f"{argv} printed {len(lines)} lines on stderr:\n{stderr}"
        assert lines[0].startswith("flexoff: "), lines[0]
    left = sorted(str(p.relative_to(offload_dir)) for p in offload_dir.rglob("*"))
    assert not left, f"{argv} left {left} in the offload directory"
    return code, stderr


@contextlib.contextmanager
def workdir():
    with tempfile.TemporaryDirectory() as name:
        root = Path(name)
        (root / "offload").mkdir()
        yield root, root / "offload"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Two tiny checkpoints, one per family, whose config.json the tests corrupt in copies."""
    from tests.conftest import build_model

    made = {}
    for kind in ("opt-pre", "llama-gqa"):
        directory = tmp_path_factory.mktemp(kind)
        build_model(directory, kind)
        made[kind] = directory
    return made


def copy_checkpoint(source: Path, target: Path, config: dict) -> Path:
    target.mkdir()
    for file in source.iterdir():
        if file.name != "config.json":
            (target / file.name).symlink_to(file)
    (target / "config.json").write_text(json.dumps(config))  # NaN and inf written as JSON5-ish literals
    return target


@st.composite
def mutated_dict(draw, base: dict, extra_keys=()):
    """``base`` with some fields replaced by odd values, deleted, or added."""
    data = json.loads(json.dumps(base))
    keys = sorted(data) + list(extra_keys) or ["added"]
    for key in draw(st.lists(st.sampled_from(keys), min_size=1, max_size=3, unique=True)):
        if draw(st.booleans()) and key in data and len(data) > 1:
            del data[key]
        else:
            data[key] = draw(JSON_VALUES)
    return data


@FUZZ
@given(data=st.data(), kind=st.sampled_from(["opt-pre", "llama-gqa"]),
       command=st.sampled_from(["run", "search", "batch"]))
def test_corrupt_config_json(checkpoints, data, kind, command):
    base = json.loads((checkpoints[kind] / "config.json").read_text())
    config = data.draw(mutated_dict(base, extra_keys=("rope_scaling", "head_dim", "eos_token_id")))
    with workdir() as (root, offload):
        model = copy_checkpoint(checkpoints[kind], root / "model", config)
        if command == "search":
            argv = ["search", "--model", str(model), "--hardware", "t4", "--prompt-len", "8", "--gen-len", "2"]
        elif command == "batch":
            prompts = root / "in.jsonl"
            prompts.write_text('{"id": 1, "prompt": "the cat sat"}\n{"id": 2, "prompt": [5, 6, 7]}\n')
            argv = ["batch", "--model", str(model), "--input", str(prompts), "--output", str(root / "out.jsonl"),
                    "--max-new-tokens", "2", "--no-progress", "--offload-dir", str(offload)]
        else:
            argv = ["run", "--model", str(model), "--prompt-len", "4", "--num-prompts", "2", "--gen-len", "2",
                    "--quiet", "--offload-dir", str(offload)]
        run_cli(argv, offload)


POLICY = {
    "gpu_batch_size": 2, "num_gpu_batches": 2,
    "weights": {"gpu": 0.4, "cpu": 0.3, "disk": 0.3}, "cache": {"gpu": 0.5, "cpu": 0.0, "disk": 0.5},
    "activations": {"gpu": 1.0, "cpu": 0.0, "disk": 0.0}, "cpu_attention": False, "overlap": True,
    "pin_cpu_memory": False, "compress_weight": None, "compress_cache": {"bits": 4, "group_size": 8},
}


@FUZZ
@given(data=st.data())
def test_corrupt_policy_file(checkpoints, data):
    policy = data.draw(mutated_dict(POLICY))
    for section in ("weights", "cache", "activations", "compress_cache"):
        if isinstance(policy.get(section), dict) and data.draw(st.booleans()):
            policy[section] = data.draw(mutated_dict(policy[section]))
    with workdir() as (root, offload):
        path = root / "policy.json"
        path.write_text(json.dumps(policy))
        run_cli(["run", "--model", str(checkpoints["opt-pre"]), "--policy", str(path), "--prompt-len", "4",
                 "--num-prompts", "3", "--gen-len", "2", "--quiet", "--offload-dir", str(offload)], offload)


def _profile() -> dict:
    from flexoff.planner.hardware import resolve_hardware

    return resolve_hardware("t4").to_dict()


@FUZZ
@given(data=st.data())
def test_corrupt_profile_file(data):
    profile = _profile()
    sections = [key for key, value in profile.items() if isinstance(value, dict)]
    mutated = data.draw(mutated_dict(profile))
    for section in sections:
        if isinstance(mutated.get(section), dict) and data.draw(st.booleans()):
            mutated[section] = data.draw(mutated_dict(mutated[section]))
    with workdir() as (root, offload):
        path = root / "profile.json"
        path.write_text(json.dumps(mutated))
        run_cli(["search", "--model", "opt-1.3b", "--hardware", str(path), "--prompt-len", "32", "--gen-len", "8"],
                offload)


PROMPT_VALUES = st.one_of(JSON_VALUES, st.sampled_from(["the cat sat", "  ", "dog ran\nover", "é ☃ 中"]))


@st.composite
def prompt_line(draw) -> str:
    if draw(st.integers(0, 4)) == 0:
        return draw(st.text(max_size=12).map(lambda text: text.replace("\n", " ")))
    record = {"prompt": draw(PROMPT_VALUES)}
    for key in draw(st.lists(st.sampled_from(["id", "max_new_tokens", "stop", "prompt", "extra"]), max_size=3)):
        record[key] = draw(PROMPT_VALUES)
    return json.dumps(record)


@FUZZ
@given(lines=st.lists(prompt_line(), max_size=4), suffix=st.sampled_from([".jsonl", ".txt", ".json", ".JSONL"]),
       command=st.sampled_from(["run", "batch"]))
def test_corrupt_prompt_file(checkpoints, lines, suffix, command):
    with workdir() as (root, offload):
        path = root / f"prompts{suffix}"
        path.write_text("\n".join(lines) + ("\n" if lines else ""))
        source = (["--prompts", str(path), "--gen-len", "2", "--quiet"] if command == "run"
                  else ["--input", str(path), "--max-new-tokens", "2", "--no-progress"])
        run_cli([command, "--model", str(checkpoints["llama-gqa"]), *source,
                 "--output", str(root / "out.jsonl"), "--offload-dir", str(offload)], offload)


FLAG_VALUES = st.sampled_from(["0", "-1", "1", "2", "3", "64", "1e3", "nan", "inf", "x", "", "0.5", "1.5",
                               "99999999999999999999", "-0"])
FLAGS = {
    "--gen-len": FLAG_VALUES, "--prompt-len": FLAG_VALUES, "--num-prompts": st.sampled_from(["0", "-1", "1", "3", "x"]),
    "--temperature": FLAG_VALUES, "--top-p": FLAG_VALUES, "--top-k": FLAG_VALUES, "--seed": FLAG_VALUES,
    "--gpu-batch-size": FLAG_VALUES, "--num-gpu-batches": FLAG_VALUES, "--weight-bits": FLAG_VALUES,
    "--weight-group": FLAG_VALUES, "--cache-bits": FLAG_VALUES, "--cache-group": FLAG_VALUES,
    "--device": st.sampled_from(["cpu", "tpu", "cuda", "cuda:7", "auto", ""]),
    "--dtype": st.sampled_from(["float16", "bfloat16", "float32", "int8", "auto", "fp64"]),
    "--gpu-mem": st.sampled_from(["1KB", "x", "-5GiB", "0", "64MiB", "1e400B"]),
    "--cpu-mem": st.sampled_from(["1KB", "x", "0", "8GiB"]),
    "--stop": st.sampled_from(["", "the", "\n"]),
    "--tokenizer": st.sampled_from(["/no/such", "."]),
    "--hardware": st.sampled_from(["t4", "h100", "nope", "/no/such.json"]),
    "--policy": st.sampled_from(["auto", "/no/such.json", "."]),
}
SWITCHES = ["--cpu-attention", "--no-overlap", "--no-pin", "--compress-weight", "--compress-cache", "--ignore-eos",
            "--dummy", "--warmup"]


@FUZZ
@given(flags=st.dictionaries(st.sampled_from(sorted(FLAGS)), st.just(None), max_size=4), data=st.data(),
       switches=st.lists(st.sampled_from(SWITCHES), max_size=3, unique=True),
       percent=st.one_of(st.none(), st.lists(FLAG_VALUES, min_size=6, max_size=6)))
def test_odd_flags(checkpoints, flags, data, switches, percent):
    argv = ["run", "--model", str(checkpoints["opt-pre"]), "--quiet", "--prompt-len", "4", "--num-prompts", "2",
            "--gen-len", "2"]
    for flag in flags:
        argv += [flag, data.draw(FLAGS[flag])]
    argv += switches
    if percent is not None:
        argv += ["--percent", *percent]
    with workdir() as (_, offload):
        run_cli([*argv, "--offload-dir", str(offload)], offload)
