"""The mixture-of-experts pieces on their own: grouped matmuls, the expert fractions of a policy."""

import json

import pytest
import torch

from flexoff import Policy, TierFractions
from flexoff.commands.main import main
from flexoff.errors import PolicyError
from flexoff.models import REGISTRY, moe


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [32, 24])  # 24 bf16 values are 48 bytes: the kernel's 16-byte rule holds
def test_grouped_linear_is_each_experts_matmul(dtype, width):
    """Every expert's rows times its own matrix, experts with no rows included, by the grouped
    kernel where it applies and by the loop where it does not."""
    generator = torch.Generator().manual_seed(0)
    counts = [3, 0, 5, 1, 0, 7]
    rows = torch.randn(sum(counts), 32, generator=generator).to(dtype)
    weight = torch.randn(len(counts), width, 32, generator=generator).to(dtype)
    ends = torch.tensor(counts).cumsum(0).to(torch.int32)
    expected, start = [], 0
    for expert, count in enumerate(counts):
        expected.append(rows[start:start + count].float() @ weight[expert].float().T)
        start += count
    expected = torch.cat(expected)
    tolerance = 1e-5 if dtype == torch.float32 else 0.1
    assert moe._grouped_kernel_fits(rows, weight)
    torch.testing.assert_close(moe.grouped_linear(rows, weight, ends).float(), expected, rtol=tolerance, atol=tolerance)
    odd = weight[:, :width - 1]  # rows the kernel cannot take: the loop answers the same
    assert not moe._grouped_kernel_fits(rows, odd.contiguous())
    torch.testing.assert_close(moe.grouped_linear(rows, odd.contiguous(), ends).float(), expected[:, :width - 1],
                               rtol=tolerance, atol=tolerance)


def test_routing_picks_the_largest_probabilities_in_fp32():
    """Router logits that differ only below fp16's resolution still order the experts as fp32 does."""
    cfg = REGISTRY["mixtral-8x7b"].replace(hidden_size=8, num_heads=1, num_kv_heads=1, head_dim=8)
    router = torch.eye(8)
    x = torch.tensor([[0.0, 1.0, 0.5, 0.0, 3.0, 0.0, 0.0, 0.0]])
    weights, experts = moe.route(cfg, router, x)
    assert experts.tolist() == [[4, 1]]
    p = torch.softmax(x, -1)[0]
    torch.testing.assert_close(weights[0], torch.stack([p[4], p[1]]) / (p[4] + p[1]))
    unnormalised = cfg.replace(norm_topk_prob=False)
    torch.testing.assert_close(moe.route(unnormalised, router, x)[0][0], torch.stack([p[4], p[1]]))


def test_expert_fractions_round_trip_and_default_to_the_weights(tmp_path):
    apart = Policy(weights=TierFractions(1, 0, 0), experts=TierFractions(0.25, 0.5, 0.25))
    path = tmp_path / "p.json"
    apart.save(path)
    assert Policy.load(path) == apart
    assert apart.uses_disk
    assert Policy(weights=TierFractions(0, 1, 0)).expert_fractions == TierFractions(0, 1, 0)
    data = json.loads(path.read_text())
    data["experts"] = {"gpu": 0.5, "cpu": 0.6, "disk": 0}
    path.write_text(json.dumps(data))
    with pytest.raises(PolicyError, match="p.json: experts: tier fractions gpu/cpu/disk = 0.5/0.6/0 sum to 1.1"):
        Policy.load(path)


@pytest.mark.parametrize("flag,message", [
    (["60", "50"], "--expert-percent: experts on gpu and cpu add up to 110%"),
    (["-1", "50"], "--expert-percent"),
])
def test_bad_expert_percent_is_one_line(flag, message, capsys):
    code = main(["run", "--model", "mixtral-8x7b", "--dummy", "--gen-len", "2", "--expert-percent", *flag])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and message in err[0], err


def test_long_prefills_route_in_chunks_with_the_same_result(monkeypatch):
    """Chunking the tokens (to bound the layer's transient memory) changes no output, but for the
    float32 rounding of a matmul library blocking other row counts otherwise: within a millionth
    of the output's scale."""
    cfg = REGISTRY["mixtral-8x7b"].replace(hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8, num_experts=4,
                                           expert_intermediate_size=16)
    generator = torch.Generator().manual_seed(1)
    w = {moe.ROUTER: torch.randn(4, 32, generator=generator), moe.GATE_UP: torch.randn(4, 32, 32, generator=generator),
         moe.DOWN: torch.randn(4, 32, 16, generator=generator)}
    x = torch.randn(3, 7, 32, generator=generator)
    whole = moe.sparse_mlp(cfg, w, x)
    monkeypatch.setattr(moe, "chunk_tokens", lambda cfg: 4)
    scale = whole.abs().max().item()
    torch.testing.assert_close(moe.sparse_mlp(cfg, w, x), whole, rtol=1e-5, atol=1e-6 * scale)


def test_a_sparse_layer_hands_each_chunks_choice_to_its_fetch_before_it_reads_the_experts(monkeypatch):
    """Route-first loading is a collaborator the layer is given: each chunk's chosen experts go to it
    after the router is read and before the expert stacks are, and the output is the plain one."""
    cfg = REGISTRY["mixtral-8x7b"].replace(hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8, num_experts=4,
                                           expert_intermediate_size=16)
    generator = torch.Generator().manual_seed(3)
    plain = {moe.ROUTER: torch.randn(4, 32, generator=generator), moe.GATE_UP: torch.randn(4, 32, 32, generator=generator),
             moe.DOWN: torch.randn(4, 32, 16, generator=generator)}
    log = []

    class Reads(dict):
        def __getitem__(self, name):
            log.append(name)
            return super().__getitem__(name)

    class Fetch:
        def fetch_experts(self, experts):
            log.append(experts.clone())

    assert isinstance(Fetch(), moe.ExpertFetch)
    monkeypatch.setattr(moe, "chunk_tokens", lambda cfg: 8)
    x = torch.randn(3, 7, 32, generator=generator)
    out = moe.sparse_mlp(cfg, Reads(plain), x, Fetch())
    fetched = [n for n, entry in enumerate(log) if isinstance(entry, torch.Tensor)]
    assert len(fetched) == 3  # 21 tokens, 8 at a time
    assert all(log[n - 1] == moe.ROUTER and log[n + 1] == moe.GATE_UP for n in fetched)
    flat = x.reshape(-1, 32)
    for chunk, n in enumerate(fetched):
        assert torch.equal(log[n], moe.route(cfg, plain[moe.ROUTER], flat[8 * chunk:8 * chunk + 8])[1])
    torch.testing.assert_close(out, moe.sparse_mlp(cfg, plain, x), rtol=0, atol=0)


def test_the_runtimes_stage_weights_are_an_expert_fetch():
    """A stage's weights fetch the chosen experts where the block routes first, and do nothing else."""
    from flexoff.runtime.weight_store import StageWeights

    chosen, calls = torch.tensor([[1, 3]]), []
    routed, ahead = StageWeights({}, None, fetch=calls.append), StageWeights({}, None)
    assert isinstance(routed, moe.ExpertFetch) and isinstance(ahead, moe.ExpertFetch)
    routed.fetch_experts(chosen)
    ahead.fetch_experts(chosen)
    assert calls == [chosen]


def test_auto_dtype_is_the_models_own_on_cuda(tiny_model_dir, tmp_path):
    """bfloat16 checkpoints run in bfloat16 on a GPU (fp16 may overflow them), float16 and float32
    ones in fp16; the CPU computes fp32 whatever the model."""
    from flexoff.deploy.devices import resolve_dtype
    from flexoff.models import config_from_dir

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert resolve_dtype("auto", cuda, REGISTRY["mixtral-8x7b"]) == torch.bfloat16
    assert resolve_dtype("auto", cuda, REGISTRY["opt-30b"]) == torch.float16
    assert resolve_dtype("auto", cuda, REGISTRY["llama-2-7b"]) == torch.float16
    assert resolve_dtype("auto", cpu, REGISTRY["mixtral-8x7b"]) == torch.float32
    assert resolve_dtype("float16", cuda, REGISTRY["mixtral-8x7b"]) == torch.float16
    path, hf = tiny_model_dir("qwen3-moe")  # saved in float32: runs in fp16
    assert resolve_dtype("auto", cuda, config_from_dir(path)) == torch.float16
    raw = json.loads((path / "config.json").read_text())
    assert raw.get("dtype", raw.get("torch_dtype")) == "float32"
    for key in ("torch_dtype", "dtype"):  # as transformers 4 and 5 write it
        (tmp_path / "config.json").write_text(json.dumps({**{k: v for k, v in raw.items() if k != "dtype"},
                                                           key: "bfloat16"}))
        assert resolve_dtype("auto", cuda, config_from_dir(tmp_path)) == torch.bfloat16


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [5, 300])
def test_a_sparse_layer_never_waits_for_the_gpu(tokens):
    """Routing, sorting and the grouped matmuls enqueue everything without reading a value back:
    a synchronisation in every sparse layer of every GPU batch would stop the host from running
    ahead of the device (in torch's sync debug mode, one raises)."""
    cfg = REGISTRY["mixtral-8x7b"].replace(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, num_experts=8,
                                           expert_intermediate_size=128)
    generator = torch.Generator().manual_seed(2)
    w = {moe.ROUTER: torch.randn(8, 64, generator=generator), moe.GATE_UP: torch.randn(8, 256, 64, generator=generator),
         moe.DOWN: torch.randn(8, 64, 128, generator=generator)}
    w = {name: tensor.to("cuda", torch.bfloat16) for name, tensor in w.items()}
    x = torch.randn(1, tokens, 64, generator=generator).to("cuda", torch.bfloat16)
    expected = moe.sparse_mlp(cfg, w, x)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = moe.sparse_mlp(cfg, w, x)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
