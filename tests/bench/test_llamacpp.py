"""llama.cpp as a bench system, on the CPU: its placement under a cap by hand-computed cases, its command, its
result parsed from llama-batched-bench's output as captured from real runs (tests/bench/fixtures: llama.cpp
0c1e570 built for the CPU, on bench/dummy_gguf.py's files of the tiny models in test_dummy_gguf.py), and the
bench's run of it through a stand-in binary that prints such a capture."""

import json
import stat
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import llamacpp  # noqa: E402
import throughput  # noqa: E402
import throughput_runs  # noqa: E402
from flexoff.models import REGISTRY  # noqa: E402
from tests.bench.test_dummy_gguf import tiny  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures"
MiB = 2**20


def capture(name: str) -> str:
    return (FIXTURES / name).read_text()


# A model whose bytes are worked out by hand: hidden 64, 2 heads of 32, MLP 128, 4 layers, vocabulary 256.
SMALL = tiny(hidden_size=64, num_heads=2, num_kv_heads=2, intermediate_size=128, num_layers=4, vocab_size=256)
# Q4_0 stores 32 values in 18 bytes: q, k, v and o are 4096 values each (2,304 bytes), gate, up and down
# 8192 (4,608 bytes), the two norms 64 floats each.
LAYER = 4 * 2304 + 3 * 4608 + 2 * 64 * 4
OUTPUT = 256 * 64 // 32 * 18 + 64 * 4  # the output matrix and the final norm
# Keys and values of 2 heads of 32, in f16, for 2 sequences of 24 positions, each padded to 256 as llama.cpp does.
KV = 2 * 2 * 32 * 2 * (2 * 256)


def test_dense_layers_go_on_the_gpu_from_the_last_while_they_and_their_cache_fit():
    reserve = 1000
    three = llamacpp.plan_offload(SMALL, reserve + 3 * (LAYER + KV) + 100, 2, 20, 4, reserve)
    assert (three.gpu_layers, three.cpu_moe_layers, three.context) == (3, 0, 512)
    assert three.gpu_bytes == reserve + 3 * (LAYER + KV)
    # Every layer fits, but not the output layer beside them: -ngl 4 leaves it on the CPU.
    four = llamacpp.plan_offload(SMALL, reserve + 4 * (LAYER + KV) + OUTPUT - 1, 2, 20, 4, reserve)
    assert four.gpu_layers == 4
    whole = llamacpp.plan_offload(SMALL, reserve + 4 * (LAYER + KV) + OUTPUT, 2, 20, 4, reserve)
    assert whole.gpu_layers == 5 and whole.gpu_bytes == reserve + 4 * (LAYER + KV) + OUTPUT
    assert llamacpp.plan_offload(SMALL, reserve + LAYER + KV - 1, 2, 20, 4, reserve) is None


def test_experts_leave_the_gpu_from_the_first_layer_until_the_rest_fits():
    moe = SMALL.replace(num_experts=4, experts_per_token=2, expert_intermediate_size=64)
    experts = 3 * 4 * (64 * 64 // 32 * 18)  # gate, up and down of 4 experts, 4096 values each
    router = 4 * 64 * 4
    layer = 4 * 2304 + 2 * 64 * 4 + router
    everything = OUTPUT + 4 * (layer + experts + KV)
    assert llamacpp.plan_offload(moe, everything, 2, 20, 4, 0).cpu_moe_layers == 0
    two = llamacpp.plan_offload(moe, everything - experts - 1, 2, 20, 4, 0)
    assert (two.gpu_layers, two.cpu_moe_layers) == (5, 2)
    assert two.gpu_bytes == everything - 2 * experts
    assert two.flags() == ["-ngl", "5", "-c", "512", "--n-cpu-moe", "2"]
    assert llamacpp.plan_offload(moe, OUTPUT + 4 * (layer + KV) - 1, 2, 20, 4, 0) is None


def test_the_command_runs_the_prompt_then_gen_len_minus_one_steps():
    offload = llamacpp.Offload(5, 0, 48, 0)
    argv = llamacpp.command(Path("/bin/llama-batched-bench"), Path("m.gguf"), offload, 2, 20, 4)
    flag = dict(zip(argv[1::2], argv[2::2]))
    assert flag["-npp"] == "20" and flag["-ntg"] == "3" and flag["-npl"] == "2,1" and flag["-c"] == "48"
    assert flag["-fa"] == "on" and flag["--output-format"] == "jsonl" and flag["-ngl"] == "5" and flag["-lm"] == "none"
    assert flag["-b"] == flag["-ub"] == str(llamacpp.UBATCH)
    argv = llamacpp.command(Path("/bin/llama-batched-bench"), Path("m.gguf"), offload, 2, 20, 4, ubatch=256)
    small = dict(zip(argv[1::2], argv[2::2]))
    assert small["-b"] == small["-ub"] == "256"


def test_the_reserve_grows_with_the_micro_batch_by_each_token_activations():
    dense = REGISTRY["llama-3-70b"]
    per_token = 4 * (4 * dense.hidden_size + 3 * dense.intermediate_size)
    assert llamacpp.compute_reserve(dense, 1) == llamacpp.COMPUTE_RESERVE + per_token
    assert llamacpp.compute_reserve(dense, 2048) - llamacpp.compute_reserve(dense, 1024) == 1024 * per_token
    moe = REGISTRY["qwen3-30b-a3b"]  # the routed experts' MLPs, not the dense intermediate size
    routed = moe.experts_per_token * moe.expert_intermediate_size
    assert llamacpp.compute_reserve(moe, 1) == llamacpp.COMPUTE_RESERVE + 4 * (4 * moe.hidden_size + 3 * routed)


@pytest.mark.parametrize("name", ["llamacpp-llama-cpu.txt", "llamacpp-qwen3moe-cpu.txt"])
def test_a_captured_run_is_counted_as_flexgen_counts(name):
    output = capture(name)
    lines = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
    assert [line["pl"] for line in lines] == [4, 1]  # the measured batch, then the short run after it
    line = lines[0]
    result = llamacpp.parse_result(output, 64, 4, 4)
    # Prefill and decode are llama.cpp's own speeds; the total counts generated tokens only (the first from the
    # prompt's logits, then its 3 steps), where llama.cpp's counts prompt tokens too.
    assert result["prefill"] == pytest.approx(line["speed_pp"], rel=1e-5)
    assert result["decode"] == pytest.approx(line["speed_tg"], rel=1e-5)
    assert result["total"] == pytest.approx(line["speed"] * 4 / (64 + 3), rel=1e-4)
    assert (result["batch"], result["gpu_layers"], result["flash_attn"]) == (4, 3, 1)
    with pytest.raises(ValueError, match="ran 64\\+3, not 64\\+8"):
        llamacpp.parse_result(output, 64, 9, 4)
    assert llamacpp.parse_result(output, 64, 4, 8) is None  # no line of 8 sequences


def test_a_failed_run_has_no_result_and_its_last_line_says_why():
    output = capture("llamacpp-missing-model.txt")
    assert llamacpp.parse_result(output, 64, 4, 4) is None
    assert throughput_runs.failure(1, output, False, 60) == \
        "cannot run: llama_batched_bench: error: unable to load model"


def test_a_result_line_the_logger_lost_is_run_again_once(tmp_path, monkeypatch):
    """A real run that exited 0 with its result line unwritten (llama.cpp's logger is not flushed at exit)."""
    lost = capture("llamacpp-llama-cpu-lost.txt")
    assert llamacpp.parse_result(lost, 64, 4, 4) is None
    monkeypatch.setattr(throughput_runs, "dummy_gguf_file", lambda args: tmp_path / "m.gguf")
    calls = tmp_path / "calls"
    binary = tmp_path / llamacpp.BINARY
    runs = lambda: [line for line in calls.read_text().split() if line != "--version"]  # noqa: E731
    binary.write_text(f"#!/bin/sh\necho \"$1\" >> '{calls}'\n"
                      f"if [ $(wc -l < '{calls}') -eq 1 ]; then cat '{FIXTURES / 'llamacpp-llama-cpu-lost.txt'}'; "
                      f"else cat '{FIXTURES / 'llamacpp-llama-cpu.txt'}'; fi\n")
    binary.chmod(binary.stat().st_mode | stat.S_IXUSR)
    result = throughput_runs.run_llamacpp(bench_args(tmp_path, binary), tmp_path)
    assert len(runs()) == 2 and result["batch"] == 4
    calls.unlink()
    binary.write_text(f"#!/bin/sh\necho \"$1\" >> '{calls}'\ncat '{FIXTURES / 'llamacpp-llama-cpu-lost.txt'}'\n")
    result = throughput_runs.run_llamacpp(bench_args(tmp_path, binary), tmp_path)
    assert len(runs()) == 2  # lost twice: not run a third time
    assert result["error"] == "cannot run: it exited twice without its result line"


def test_the_version_is_read_from_the_binary(tmp_path):
    binary = stand_in(tmp_path, "llamacpp-version.txt")
    assert llamacpp.version(binary) == "0.5.0-dev (build 1, commit 0c1e570)"


def test_gpu_memory_is_the_process_own_in_nvidia_smis_listing():
    listing = "4242, 20480\n1111, 9000\n4242, 512\n[N/A], [N/A]\n"
    assert llamacpp.process_gpu_bytes(listing, 4242) == (20480 + 512) * MiB
    assert llamacpp.process_gpu_bytes(listing, 7) == 0


def stand_in(tmp_path: Path, fixture: str, code: int = 0) -> Path:
    """An executable that prints a captured output and exits with ``code``, as the real binary did."""
    binary = tmp_path / llamacpp.BINARY
    binary.write_text(f"#!/bin/sh\ncat '{FIXTURES / fixture}'\nexit {code}\n")
    binary.chmod(binary.stat().st_mode | stat.S_IXUSR)
    return binary


def bench_args(tmp_path: Path, binary: Path, **changes):
    base = dict(model="llama-2-7b", prompt_len=64, gen_len=4, gpu_mem="24GiB", offload_dir=str(tmp_path),
                timeout=60, llamacpp_bin=str(binary), llamacpp_batch_sizes=[4],
                llamacpp_ubatch=llamacpp.UBATCH)
    return SimpleNamespace(**{**base, **changes})


def test_the_bench_runs_the_binary_and_keeps_the_dummy_file(tmp_path, monkeypatch):
    written = []
    monkeypatch.setattr(throughput_runs, "dummy_gguf_file", lambda args: written.append(args.model) or
                        tmp_path / "m.gguf")
    args = bench_args(tmp_path, stand_in(tmp_path, "llamacpp-llama-cpu.txt"))
    result = throughput_runs.run_llamacpp(args, tmp_path)
    assert written == ["llama-2-7b"]
    assert result["batch"] == 4 and result["prefill"] > 0 and result["tried"] == {4: round(result["total"], 1)}
    assert result["flags"].startswith("-ngl ") and result["gpu_peak"] == 0  # no nvidia-smi on this machine


def test_a_failing_binary_is_a_cannot_run_row_with_its_last_line(tmp_path, monkeypatch):
    monkeypatch.setattr(throughput_runs, "dummy_gguf_file", lambda args: tmp_path / "m.gguf")
    args = bench_args(tmp_path, stand_in(tmp_path, "llamacpp-missing-model.txt", code=1))
    result = throughput_runs.run_llamacpp(args, tmp_path)
    assert result["error"] == "cannot run: llama_batched_bench: error: unable to load model"


def test_a_run_over_the_cap_is_run_again_with_fewer_layers(tmp_path, monkeypatch):
    monkeypatch.setattr(throughput_runs, "dummy_gguf_file", lambda args: tmp_path / "m.gguf")
    peaks = iter([30 * 2**30, 20 * 2**30])
    flags = []

    class Sampler:
        def __init__(self):
            self.peak = next(peaks)

        def __call__(self, pid):
            pass

    real_command = llamacpp.command
    monkeypatch.setattr(llamacpp, "GPUSampler", Sampler)
    monkeypatch.setattr(llamacpp, "command", lambda *a, **k: flags.append(a[2].gpu_layers) or real_command(*a, **k))
    args = bench_args(tmp_path, stand_in(tmp_path, "llamacpp-llama-cpu.txt"), model="llama-3-70b")
    result = throughput_runs.run_llamacpp(args, tmp_path)
    assert len(flags) == 2 and flags[1] < flags[0]
    assert result["gpu_peak"] == 20 * 2**30


def test_opt_is_a_cannot_run_row_without_a_process(tmp_path):
    args = bench_args(tmp_path, Path("/nonexistent"), model="opt-30b")
    assert throughput_runs.run_llamacpp(args, tmp_path) == {
        "error": "cannot run: llama.cpp has no architecture for the opt family (opt-30b)", "rss": 0}


def test_a_missing_binary_is_one_line_and_exit_code_2(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv(llamacpp.BINARY_ENV, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SystemExit) as exit_:
        throughput.parse_args(["--systems", "flexoff,llamacpp"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "llama-batched-bench is not on PATH" in err and "--llamacpp-bin" in err
    with pytest.raises(SystemExit):
        throughput.parse_args(["--systems", "llamacpp", "--llamacpp-bin", str(tmp_path / "nope")])
    assert "is not an executable llama-batched-bench" in capsys.readouterr().err


def test_the_table_names_llama_cpp_and_the_ratio_to_the_best_other_system(tmp_path):
    args = throughput.parse_args(["--model", "llama-2-7b", "--systems", "flexoff", "--policy", "auto"])
    flexoff = {"system": "flexoff", "policy": "searched: 8×2", "result": {"prefill": 100.0, "decode": 20.0,
                                                                            "total": 30.0, "rss": 0}}
    ours = {"prefill": 50.0, "decode": 5.0, "total": 10.0, "rss": 0, "version": "0.5.0-dev (build 1, commit 0c1e570)"}
    other = {"system": "llamacpp", "policy": "Q4_0, -ngl 20 -c 2176, batch 4", "result": ours}
    failed = {"system": "hf", "policy": "device_map", "result": {"error": "cannot run: out of GPU memory", "rss": 0}}
    text = throughput.table([flexoff, other, failed], args)
    assert "| llama.cpp 0.5.0-dev (build 1, commit 0c1e570) | Q4_0, -ngl 20 -c 2176, batch 4 |" in text
    assert "- flexoff (searched: 8×2) / llama.cpp (Q4_0, -ngl 20 -c 2176, batch 4): prefill 2.00× · decode " \
           "4.00× · total 3.00×" in text
    assert "- flexoff / the best other system (llama.cpp 0.5.0-dev (build 1, commit 0c1e570), Q4_0, -ngl 20 " \
           "-c 2176, batch 4): total 3.00×" in text
    assert "- HF Accelerate cannot run: out of GPU memory." in text
