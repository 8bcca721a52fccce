"""bench/gpu_memory_timeline.py: the run's peak is its highest step's, named with the step, against
the layout's parts; on a GPU, a real run's steps each peak at or above what they began with."""

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import gpu_memory_timeline as timeline  # noqa: E402
from tests import processes  # noqa: E402

GiB = 1 << 30


def _step(kind, token, stage, batch, before, peak):
    return {"kind": kind, "token": token, "stage": stage, "batch": batch, "before": before, "peak": peak,
            "after": before}


def test_the_peak_is_the_highest_steps_and_each_phase_keeps_its_own(capsys):
    steps = [_step("compute", 0, 1, 0, 5 * GiB, 9 * GiB), _step("compute", 0, 1, 1, 6 * GiB, 8 * GiB),
             _step("compute", 1, 1, 0, 5 * GiB, 6 * GiB), _step("load_cache", 1, 1, 1, 5 * GiB, 7 * GiB)]
    parts = {"working memory": 3 * GiB, "stores in flight": 1 * GiB}
    summary = timeline.report(steps, parts, 6 * GiB, 4 * GiB, top=2)
    assert summary["peak"] is steps[0]
    assert summary["predicted"] == 10 * GiB
    assert summary["phases"]["prefill"] is steps[0] and summary["phases"]["decode"] is steps[3]
    out = capsys.readouterr().out
    assert "run peak: 9.00 GiB at compute token 0 stage 1 batch 0: 5.00 GiB allocated as it began, +4.00 GiB" in out
    assert "(-10.0% measured against it)" in out
    highest = out.split("| highest steps")[1].split("prefill:")[0]
    assert "| compute token 0 stage 1 batch 0 | 9.00 |" in highest and "| compute token 0 stage 1 batch 1 | 8.00 |" in highest
    assert "load_cache" not in highest  # only the two highest are listed


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_run_on_cuda_reports_every_step_of_both_phases(tmp_path):
    policy = {"gpu_batch_size": 4, "num_gpu_batches": 2, "weights": {"gpu": 0.5, "cpu": 0.5, "disk": 0},
              "cache": {"gpu": 0, "cpu": 1, "disk": 0}, "activations": {"gpu": 1, "cpu": 0, "disk": 0}}
    (tmp_path / "p.json").write_text(json.dumps(policy))
    out = tmp_path / "steps.json"
    done = processes.run([sys.executable, str(ROOT / "bench" / "gpu_memory_timeline.py"), "--model", "opt-125m",
                          "--policy-file", str(tmp_path / "p.json"), "--prompt-len", "32", "--gen-len", "3",
                          "--offload-dir", str(tmp_path), "--json", str(out)])
    assert done.returncode == 0, done.stderr
    data = json.loads(out.read_text())
    assert all(s["peak"] >= max(s["before"], s["after"]) for s in data["steps"])
    assert {s["token"] for s in data["steps"]} == {0, 1, 2}
    assert data["peak"]["peak"] == max(s["peak"] for s in data["steps"])
    assert data["peak"]["peak"] > data["before_run"]
