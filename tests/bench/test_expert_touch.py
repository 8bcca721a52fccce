"""bench/expert_touch.py on the CPU, through its main(): counts of touched experts lie between top-k and
all of them, never fall as the block grows, and random routers follow the uniform estimate."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import expert_touch  # noqa: E402

SIZES = "1,2,4,8,16"


def run(tmp_path, *argv) -> dict:
    out = tmp_path / "touch.json"
    assert expert_touch.main([*argv, "--block-sizes", SIZES, "--trials", "4", "--json", str(out)]) == 0
    return json.loads(out.read_text())


def check_curve(result: dict) -> None:
    experts, top_k = result["experts"], result["top_k"]
    rows = result["rows"]
    assert [row["tokens"] for row in rows] == [1, 2, 4, 8, 16]
    assert rows[0]["touched_min"] == rows[0]["touched_max"] == top_k / experts  # one token: exactly k experts
    for row in rows:
        assert top_k / experts <= row["touched_min"] <= row["touched_mean"] <= row["touched_max"] <= 1
        assert 0 <= row["skipped_bytes"] <= result["expert_bytes"]
    means = [row["touched_mean"] for row in rows]
    assert means == sorted(means)
    skipped = [row["skipped_bytes"] for row in rows]
    assert skipped == sorted(skipped, reverse=True)


def test_a_tiny_checkpoints_routers(tiny_model_dir, tmp_path, capsys):
    path, _ = tiny_model_dir("qwen3-moe")  # 4 experts, top-2, layer 1 dense
    result = run(tmp_path, "--model", str(path))
    assert (result["weights"], result["experts"], result["top_k"], result["sparse_layers"]) == (str(path), 4, 2, 1)
    check_curve(result)
    out = capsys.readouterr().out
    assert "| 16 |" in out
    assert "Route-first skips at least 10% of the layers' bytes at blocks of 1" in out  # 2 of 4 experts skipped


def test_dummy_routers_touch_experts_as_uniform_routing_would(tmp_path):
    result = run(tmp_path, "--model", "qwen1.5-moe-a2.7b")  # 60 experts, top-4, 24 sparse layers
    assert result["weights"] == "dummy"
    check_curve(result)
    for row in result["rows"]:
        assert abs(row["touched_mean"] - row["uniform"]) < 0.05, row


def test_a_dense_model_is_refused_in_one_line(capsys):
    assert expert_touch.main(["--model", "llama-2-7b"]) == 2
    assert capsys.readouterr().err.strip() == ("flexoff: error: llama-2-7b has no experts: the expert-touch "
                                               "curve needs a mixture of experts")


def test_the_models_own_hidden_states_route_as_transformers_does(tiny_model_dir):
    """--hidden model runs flexoff's model math over random prompts: each sparse layer's picks for the
    prompts' last tokens are the ones transformers' router makes on the same prompts."""
    import torch

    from flexoff.models import resolve_model
    from flexoff.weights import CheckpointWeights

    path, hf_model = tiny_model_dir("qwen3-moe")
    cfg, _ = resolve_model(str(path))
    args = expert_touch.parse_args(["--model", str(path), "--hidden", "model", "--prompt-len", "5",
                                    "--block-sizes", "1,6", "--trials", "2"])
    routes = expert_touch.model_routes(cfg, CheckpointWeights(path), args, torch.Generator().manual_seed(3))
    assert list(routes) == [0] and len(routes[0]) == 2  # layer 1 is dense
    generator = torch.Generator().manual_seed(3)
    for trial in range(2):
        ids = torch.randint(cfg.vocab_size, (6, 5), generator=generator)
        with torch.no_grad():
            logits = hf_model(ids, output_router_logits=True).router_logits[0].view(6, 5, -1)[:, -1]
        expected = logits.topk(cfg.experts_per_token, dim=-1).indices
        assert torch.equal(routes[0][trial].sort(dim=-1).values, expected.sort(dim=-1).values)
