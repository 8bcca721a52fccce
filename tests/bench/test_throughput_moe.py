"""bench/throughput.py on a mixture of experts: FlexGen's rows say it runs OPT only (no process is
started for it), and the decode bound and the bytes moved per token are those of the MoE model."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import throughput  # noqa: E402

POLICY = "4-bit w+c w 0/100 cache-cpu 64x2"


def test_flexgen_rows_of_a_moe_model_say_flexgen_runs_opt_only():
    args = throughput.parse_args(["--model", "qwen3-30b-a3b", "--systems", "flexgen", "--policies", POLICY])
    rows = throughput.run_all(args)
    assert [r["result"]["error"] for r in rows] == ["cannot run: it runs OPT models only, not qwen3-30b-a3b"]
    assert "- FlexGen 0.1.8 cannot run: it runs OPT models only, not qwen3-30b-a3b." in throughput.table(rows, args)


def test_the_decode_bound_moves_every_experts_bytes():
    """With all weights on the CPU, decode moves the whole model per step (every expert, as prefetch-all
    loads them): Mixtral-8x7B moves about 4.5 times Mistral-7B's bytes, its layers being 8 experts of the
    same width."""
    policy = throughput.policy_of(throughput.POLICIES[POLICY])
    moved = {model: throughput.moved_bytes_per_token(model, policy, 512, 32)
             for model in ("mistral-7b", "mixtral-8x7b")}
    assert 4 < moved["mixtral-8x7b"] / moved["mistral-7b"] < 7
    assert throughput.roofline("mixtral-8x7b", policy, 512, 32) < throughput.roofline("mistral-7b", policy, 512, 32)
