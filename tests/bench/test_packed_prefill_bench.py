"""`bench/packed_prefill.py`: both arms of each shape run in one LLM, give the same tokens, and the
packed arm's layers compute fewer positions than the padded arm's."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import packed_prefill  # noqa: E402


def test_each_shape_runs_both_arms_to_the_same_tokens(tiny_model_dir):
    path, _ = tiny_model_dir("llama-gqa")
    # Two subjects in one GPU batch of 24: each shape's rows (or, for choices, its six contexts) pad
    # past a sixteenth of their positions.
    rows = packed_prefill.main(["--model", str(path), "--device", "cpu", "--subjects", "2", "--policy", "24 1",
                                "--rounds", "1", "--scale", "0.1", "--shapes", "mmlu", "ragged", "choices"])
    assert [row["shape"] for row in rows] == ["mmlu", "ragged", "choices"]
    for row in rows:
        assert row["same_tokens"], row["shape"]
        assert len(row["prefill_s"]["packed"]) == len(row["prefill_s"]["padded"]) == 1
        assert 0 < row["positions"]["packed"] < row["positions"]["padded"], row["shape"]
        assert row["padded_over_packed"] > 0
