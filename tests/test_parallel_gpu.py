"""A job over two GPUs (NCCL): a 2-stage pipeline and two replicas give one GPU's tokens."""

import json
import sys

import pytest
import torch

from flexoff.commands.main import main
from tests import processes
from tests.conftest import build_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                                  reason="needs two GPUs")]

PROMPTS = [{"prompt": [5 + i % 7, 9, 11 + i, 3] * (1 + i % 3), "max_new_tokens": 3 + i % 4} for i in range(14)]


def _records(path) -> list:
    return sorted(([r["index"], r["token_ids"], r["finish_reason"], [round(p, 3) for p in r["logprobs"]]]
                   for r in map(json.loads, open(path, encoding="utf-8"))), key=lambda r: r[0])


@pytest.mark.parametrize("kind", ["opt-pre", "llama-gqa"])
@pytest.mark.parametrize("shape", [["--pipeline-parallel", "2"], ["--data-parallel", "2"]], ids=["2-stages", "2-replicas"])
def test_two_gpus_generate_what_one_does(tmp_path, kind, shape):
    build_model(tmp_path / "model", kind, layers=4)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    common = ["run", "--model", str(tmp_path / "model"), "--prompts", str(prompts), "--device", "cuda", "--dtype",
              "float32", "--quiet", "--gpu-batch-size", "2", "--num-gpu-batches", "2", "--percent", "30", "50", "50",
              "0", "100", "0", "--offload-dir", str(tmp_path), "--temperature", "0.8"]
    assert main([*common, "--output", str(tmp_path / "one.jsonl")]) == 0
    proc = processes.run([sys.executable, "-m", "flexoff", *common, "--output", str(tmp_path / "two.jsonl"), *shape])
    assert proc.returncode == 0, proc.stderr
    assert _records(tmp_path / "two.jsonl") == _records(tmp_path / "one.jsonl")


def test_copies_to_every_gpu_at_once_are_measured():
    from flexoff.profiler.machine import all_gpus_bandwidth

    together = all_gpus_bandwidth(torch.cuda.device_count(), 256 << 20)
    host = torch.empty(256 << 20, dtype=torch.uint8, pin_memory=True)
    target = torch.empty_like(host, device="cuda:0")
    target.copy_(host)
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    target.copy_(host, non_blocking=True)
    end.record()
    end.synchronize()
    alone = host.numel() / (start.elapsed_time(end) / 1000)
    # At least one link's worth, at most every link's, allowing for timing noise.
    assert 0.8 * alone < together < 1.2 * torch.cuda.device_count() * alone
