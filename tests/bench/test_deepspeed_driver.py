"""DeepSpeed ZeRO-Inference as a bench system, on the CPU and without DeepSpeed installed: the configuration it
runs, the bench's handling of the driver's output as captured from a real run (tests/bench/fixtures: DeepSpeed
0.19.8's CPU accelerator, OPT-125M at 32+4, batch 2), and a missing package refused in one line."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import deepspeed_driver  # noqa: E402
import throughput  # noqa: E402
import throughput_runs  # noqa: E402

CAPTURED = (Path(__file__).parent / "fixtures" / "deepspeed-opt-125m-cpu.txt").read_text()


def test_the_configuration_is_zero_3_with_parameters_on_pinned_host_memory_and_4_bit_weights():
    config = deepspeed_driver.ds_config(7168, 4, "fp16")
    zero = config["zero_optimization"]
    assert zero["stage"] == 3 and zero["offload_param"] == {"device": "cpu", "pin_memory": True}
    assert zero["stage3_prefetch_bucket_size"] == zero["stage3_max_live_parameters"] == 2 * 7168 * 7168
    assert zero["stage3_param_persistence_threshold"] == 7168
    assert config["fp16"] == {"enabled": True} and "bf16" not in config
    assert config["weight_quantization"]["quantized_initialization"] == {
        "num_bits": 4, "group_size": 64, "group_dim": 1, "symmetric": False}
    plain = deepspeed_driver.ds_config(4096, None, "bf16")
    assert "weight_quantization" not in plain and plain["bf16"] == {"enabled": True}


def test_what_could_not_be_enabled_is_named():
    from flexoff.models import REGISTRY

    dense = deepspeed_driver.not_enabled(REGISTRY["llama-3-70b"], 4, 561, "fp16")
    assert list(dense) == ["kv_cache_offload"]
    moe = deepspeed_driver.not_enabled(REGISTRY["mixtral-8x7b"], 4, 129, "bf16")
    assert "3-D parameters, which stay bf16" in moe["expert_quantization"]
    assert "weight_quantization" in deepspeed_driver.not_enabled(REGISTRY["opt-30b"], 4, 0, "fp16")
    assert list(deepspeed_driver.not_enabled(REGISTRY["mixtral-8x7b"], 0, 0, "bf16")) == ["kv_cache_offload"]


def run_with(monkeypatch, tmp_path, output: str, code: int = 0, **flags):
    seen = {}

    def fake(argv, timeout, log, sample=None):
        seen["argv"] = argv
        return code, output, 3 * 2**30, False

    monkeypatch.setattr(throughput_runs, "run_process", fake)
    argv = ["--model", "opt-125m", "--prompt-len", "32", "--gen-len", "4", "--gpu-mem", "16GiB"]
    for flag, value in flags.items():
        argv += [f"--{flag.replace('_', '-')}", value]
    monkeypatch.setattr(throughput.importlib.util, "find_spec", lambda name: object())
    args = throughput.parse_args(argv + ["--systems", "deepspeed"])
    return throughput_runs.run_deepspeed(args, tmp_path), seen["argv"]


def test_the_driver_runs_with_the_benchs_workload_cap_and_bits(monkeypatch, tmp_path):
    result, argv = run_with(monkeypatch, tmp_path, CAPTURED, deepspeed_quant_bits="4", deepspeed_batch_sizes="8,4")
    assert argv[1].endswith("deepspeed_driver.py")
    flag = dict(zip(argv[2::2], argv[3::2]))
    assert flag == {"--model": "opt-125m", "--prompt-len": "32", "--gen-len": "4", "--quant-bits": "4",
                    "--batch-sizes": "8,4", "--gpu-mem": "16GiB"}
    # The captured run's own figures, with the resident memory the bench measured of its process.
    assert result["batch"] == 2 and result["version"] == "0.19.8" and result["rss"] == 3 * 2**30
    assert result["prefill"] > result["decode"] > 0 and result["total"] > 0
    assert result["weights"].startswith("int4 in groups of 64 (73 matrices)")
    assert "kv_cache_offload" in result["not_enabled"]


def test_a_driver_that_printed_no_result_is_a_cannot_run_row(monkeypatch, tmp_path):
    broken = "\n".join(CAPTURED.splitlines()[:3] + ["RuntimeError: CUDA error: an illegal memory access"])
    result, _ = run_with(monkeypatch, tmp_path, broken, code=1)
    assert result == {"error": "cannot run: RuntimeError: CUDA error: an illegal memory access", "rss": 3 * 2**30}


def test_the_row_and_its_ratio_name_deepspeed(monkeypatch, tmp_path):
    result, _ = run_with(monkeypatch, tmp_path, CAPTURED)
    args = throughput.parse_args(["--model", "opt-125m", "--systems", "flexoff", "--policy", "auto"])
    ours = {"system": "flexoff", "policy": "searched: 2×1",
            "result": {"prefill": 2 * result["prefill"], "decode": 2 * result["decode"],
                       "total": 2 * result["total"], "rss": 0}}
    label = f"ZeRO-3 offload, {result['weights']}, batch {result['batch']}"
    text = throughput.table([ours, {"system": "deepspeed", "policy": label, "result": result}], args)
    assert f"| DeepSpeed 0.19.8 | {label} |" in text
    assert f"- flexoff (searched: 2×1) / DeepSpeed ({label}): prefill 2.00× · decode 2.00× · total 2.00×" in text


def test_a_missing_deepspeed_is_one_line_and_exit_code_2(monkeypatch, capsys):
    monkeypatch.setattr(throughput.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(SystemExit) as exit_:
        throughput.parse_args(["--systems", "flexoff,deepspeed"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the deepspeed package is not installed" in err[0] and "pip install deepspeed" in err[0]


def test_an_unknown_system_is_one_line_naming_the_known_ones(capsys):
    with pytest.raises(SystemExit) as exit_:
        throughput.parse_args(["--systems", "flexoff,vllm"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["throughput.py: error: --systems: unknown vllm; choose from flexoff, flexgen, hf, deepspeed, "
                   "llamacpp"]


def test_a_failure_is_named_by_its_error_line_not_by_a_warning_printed_at_exit():
    output = "\n".join([
        "[2026-12-02 18:47:31,102] [INFO] [config.py:1003:print] zero_optimization ...",
        "Traceback (most recent call last):",
        '  File "bench/deepspeed_driver.py", line 120, in main',
        "RuntimeError: CUDA error: an illegal memory access was encountered",
        "[rank0]:[W1202 18:48:00.784666846 ProcessGroupNCCL.cpp:1575] Warning: WARNING: destroy_process_group() "
        "was not called before program exit, which can leak resources.",
        ""])
    assert throughput_runs.failure(1, output, False, 60) == \
        "cannot run: RuntimeError: CUDA error: an illegal memory access was encountered"
    # Without an error line, the last line that is not a warning.
    assert throughput_runs.failure(1, "loading\nstopped at layer 3\nUserWarning: x\n", False, 60) == \
        "cannot run: stopped at layer 3"


def test_the_arch_list_deepspeed_compiles_for_has_no_suffixes_it_cannot_read():
    assert deepspeed_driver.plain_arch_list("9.0a") == "9.0"
    assert deepspeed_driver.plain_arch_list("8.0;9.0a;10.0f+PTX") == "8.0;9.0;10.0+PTX"
    assert deepspeed_driver.plain_arch_list("9.0 9.0a") == "9.0"
