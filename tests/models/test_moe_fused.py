"""The fused steps around the grouped expert matmuls: on CUDA the same outputs as each expert's own
matmuls in fp32 and as the unfused path; elsewhere the unfused path, named in the summary."""

import pytest
import torch
import torch.nn.functional as F

from flexoff.models import REGISTRY, moe


def test_the_cpu_runs_the_grouped_matmuls_and_says_so():
    x = torch.zeros(2, 8)
    assert moe.fused_kernels(x) is None
    assert moe.expert_kernels(torch.device("cpu"), torch.float32) == "grouped matmuls, unfused steps (no gpu)"


def _reference(x, gate_up, down, weights, experts):
    """Each token's chosen experts in fp32, one at a time."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for t in range(len(x)):
        for j in range(experts.shape[1]):
            e = int(experts[t, j])
            gate, up = (gate_up[e].float() @ x[t].float()).chunk(2)
            out[t] += weights[t, j].float() * (down[e].float() @ (F.silu(gate) * up))
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("tokens", "hidden", "width", "experts", "k"), [
    (1, 64, 128, 8, 2),  # one token: six experts without rows
    (37, 64, 40, 8, 2),
    (20, 1040, 1100, 4, 2),  # rows wider than a program's block, the width not 16-byte aligned
    (300, 128, 96, 16, 4),
    (1200, 64, 64, 4, 2),  # hundreds of rows an expert
    (200, 64, 32, 128, 8),  # Qwen3's 128 experts, most with few rows
])
@pytest.mark.gpu
def test_fused_steps_give_each_experts_matmuls(fused_moe_kernels, dtype, tokens, hidden, width, experts, k):
    assert moe.expert_kernels(torch.device("cuda"), dtype) == "grouped matmuls, fused triton steps"
    generator = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=generator).to("cuda", dtype)
    gate_up = (torch.randn(experts, 2 * width, hidden, generator=generator) / hidden ** 0.5).to("cuda", dtype)
    down = (torch.randn(experts, hidden, width, generator=generator) / width ** 0.5).to("cuda", dtype)
    chosen = torch.stack([torch.randperm(experts, generator=generator)[:k] for _ in range(tokens)]).to("cuda")
    weights = torch.softmax(torch.randn(tokens, k, generator=generator), -1).to("cuda", dtype)
    cfg = REGISTRY["mixtral-8x7b"].replace(num_experts=experts, experts_per_token=k)
    w = {moe.GATE_UP: gate_up, moe.DOWN: down}
    fused = moe.expert_mlp(cfg, w, x, weights, chosen)
    expected = _reference(x, gate_up, down, weights, chosen)
    torch.testing.assert_close(fused.float(), expected, rtol=2e-2, atol=2e-2)
    grouped = moe.expert_mlp(cfg, w, x, weights, chosen, fused=False)
    # Never further from the fp32 sums than the unfused path, which rounds gate, up and the
    # product to 16 bits on the way.
    assert (fused.float() - expected).abs().max() <= (grouped.float() - expected).abs().max() * 1.5 + 1e-3


@pytest.mark.gpu
def test_a_chunked_sparse_layer_by_the_fused_kernels_matches_the_grouped_one(fused_moe_kernels, monkeypatch):
    """The whole sparse layer, routed in chunks, with shared experts (Qwen2-MoE's): the fused
    kernels give the grouped path's outputs."""
    cfg = REGISTRY["qwen1.5-moe-a2.7b"].replace(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                                              num_experts=16, experts_per_token=4, expert_intermediate_size=48,
                                              shared_expert_intermediate_size=96)
    generator = torch.Generator().manual_seed(3)
    shapes = {spec.name: spec.shape for spec in moe.mlp_specs(cfg, 0)}
    w = {name: (torch.randn(*shape, generator=generator) / shape[-1] ** 0.5).to("cuda", torch.bfloat16)
         for name, shape in shapes.items()}
    x = torch.randn(2, 300, 64, generator=generator).to("cuda", torch.bfloat16)
    monkeypatch.setattr(moe, "chunk_tokens", lambda _cfg: 128)
    fused = moe.sparse_mlp(cfg, w, x)
    grouped = moe.sparse_mlp(cfg, w, x, fused=False)
    torch.testing.assert_close(fused, grouped, rtol=3e-2, atol=3e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["mixtral", "qwen3-moe", "qwen2-moe"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_model_by_the_fused_kernels_scores_as_transformers_does(fused_moe_kernels, monkeypatch, tiny_model_dir,
                                                                  kind, dtype):
    """A whole tiny model in 16 bits on CUDA, its experts by the fused kernels: teacher-forced
    log-probabilities within 16-bit error of transformers' fp32 ones, and no further from them than
    the grouped path's in the same dtype."""
    from flexoff import LLM, Policy
    path, hf = tiny_model_dir(kind)
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 60, (n,), generator=generator).tolist() for n in (5, 12, 9, 30)]
    continuations = [torch.randint(3, 60, (n,), generator=generator).tolist() for n in (7, 3, 10, 6)]
    expected = []
    with torch.no_grad():
        for p, c in zip(prompts, continuations, strict=True):
            logits = hf.float()(torch.tensor([p + c])).logits[0].log_softmax(-1)
            expected += [logits[len(p) - 1 + i, t].item() for i, t in enumerate(c)]
    policy = Policy(gpu_batch_size=2, num_gpu_batches=2)

    def scores():
        with LLM(str(path), policy=policy, device="cuda", dtype=dtype) as llm:
            return [x for out in llm.score(prompts, continuations) for x in out.logprobs]

    fused = torch.tensor(scores())
    monkeypatch.setattr(moe, "fused_kernels", lambda _x: None)  # the whole model by the unfused steps
    grouped = torch.tensor(scores())
    reference = torch.tensor(expected)
    tolerance = 0.4 if dtype == "bfloat16" else 0.1  # as tests/models/test_smollm2_dtypes.py allows
    torch.testing.assert_close(fused, reference, rtol=0, atol=tolerance)
    assert (fused - reference).abs().mean() <= (grouped - reference).abs().mean() * 1.5 + 1e-3


@pytest.mark.parametrize(("kind", "named"), [("qwen3-moe", True), ("llama-gqa", False)])
def test_the_summary_names_how_a_mixtures_experts_ran(tiny_model_dir, tmp_path, capsys, kind, named):
    from flexoff.commands.main import main
    path, _ = tiny_model_dir(kind)
    assert main(["run", "--model", str(path), "--quiet", "--prompt-len", "8", "--gen-len", "2", "--num-prompts", "2",
                 "--offload-dir", str(tmp_path)]) == 0
    policy = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("policy "))
    assert ("· experts by grouped matmuls, unfused steps (no gpu)" in policy) == named
    assert ("experts by" in policy) == named
