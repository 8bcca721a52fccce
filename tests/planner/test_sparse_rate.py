"""The measured speed of routed experts by shape: a profile's field, its interpolation, and the cost
model pricing a sparse layer's routed matmuls by it (the dense curve where the shape is missing)."""

import json

import pytest
import torch

from flexoff.errors import ConfigError
from flexoff.models import REGISTRY
from flexoff.planner.cost_model import CostModel, Workload
from flexoff.planner.hardware import HardwareProfile, packaged_profile
from flexoff.planner.sizes import layer_routed_matmul_numel
from flexoff.planner.sparse_rate import SparseRate, active_flops_per_token, expert_shape
from flexoff.profiler.sparse_kernel import measure_sparse_rates

MIXTRAL = REGISTRY["mixtral-8x7b"]
SHAPE = (4096, 14336, 8, 2)


def test_between_measured_points_the_rate_is_log_log_and_below_it_follows_the_dense_curve():
    rate = SparseRate(SHAPE, ((100.0, 10.0), (400.0, 40.0)))

    def dense(rows):  # FLOP/s of a dense matmul of ``rows`` rows: proportional below 1000 rows
        return 3.0 * min(rows, 1000.0)

    assert rate.flops_at(200.0, dense) == pytest.approx(20.0)  # halfway in log between 100 and 400
    assert rate.flops_at(1000.0, dense) == 40.0  # flat past the last point
    # 50 tokens give each expert 50 x 2 / 8 rows, half of 100 tokens': the dense curve halves too
    assert rate.flops_at(50.0, dense) == pytest.approx(5.0)


def test_the_profile_keeps_its_measured_shapes_through_json(make_hardware):
    rate = SparseRate(SHAPE, ((512.0, 2e14), (4096.0, 5e14)))
    hardware = make_hardware(sparse_mlp_flops=(rate,))
    again = HardwareProfile.from_dict(json.loads(json.dumps(hardware.to_dict())))
    assert again.sparse_mlp_flops == (rate,)
    assert again.sparse_mlp_flops_at(SHAPE, 4096) == 5e14
    assert again.sparse_mlp_flops_at((4096, 14336, 8, 1), 4096) is None
    assert "sparse_mlp_flop_per_s" not in make_hardware().to_dict()["compute"]


@pytest.mark.parametrize("entry, field", [
    ({"hidden": 4096, "width": 14336, "experts": 8, "points": [[1, 1]]}, "sparse_mlp_flop_per_s[0]'"),
    ({"hidden": 4096, "width": 14336, "experts": 0, "per_token": 2, "points": [[1, 1]]}, "[0].experts'"),
    ({"hidden": 4096, "width": 14336, "experts": 8, "per_token": 2, "points": []}, "[0].points'"),
    ({"hidden": 4096, "width": 14336, "experts": 8, "per_token": 2, "points": [[1, -5]]}, "[0].points[0][1]'"),
    ({"hidden": 4096, "width": 14336, "experts": 8, "per_token": 2, "points": [[8, 1], [4, 1]]}, "[0].points'"),
])
def test_a_malformed_shape_names_its_field(make_hardware, entry, field):
    data = make_hardware().to_dict()
    data["compute"]["sparse_mlp_flop_per_s"] = [entry]
    with pytest.raises(ConfigError, match=field.replace("[", r"\[").replace("]", r"\]")):
        HardwareProfile.from_dict(data, "p.json")


def test_routed_matmuls_run_at_the_measured_rate_of_their_shape_and_chunk(make_hardware):
    """Prefill of a batch of 32 x 512 tokens routes a chunk of 4096 (Mixtral's) at a time: at the
    rate measured for 4096 tokens; without the shape, at the dense rate of an expert's rows."""
    dense = ((1.0, 1e12), (1e6, 1e12))  # flat: every row count 1e12 FLOP/s
    measured = make_hardware(matmul_flops=dense, sparse_mlp_flops=(SparseRate(SHAPE, ((4096.0, 5e11),)),))
    plain = make_hardware(matmul_flops=dense)
    tokens = rows = 32 * 512
    routed = 2 * layer_routed_matmul_numel(MIXTRAL) * tokens
    with_rate = CostModel(MIXTRAL, Workload(512, 32), measured).matmul_seconds(tokens, 0, rows)
    without = CostModel(MIXTRAL, Workload(512, 32), plain).matmul_seconds(tokens, 0, rows)
    assert with_rate - without == pytest.approx(routed / 5e11 - routed / 1e12)
    # The rate's FLOPs are the cost model's: a token's routed experts, gate, up and down of k.
    assert 2 * layer_routed_matmul_numel(MIXTRAL) == pytest.approx(active_flops_per_token(SHAPE))


def test_the_packaged_h100_profile_prices_mixtral_and_qwen3_experts_by_their_own_rates():
    h100 = packaged_profile("h100")
    for name in ("mixtral-8x7b", "qwen3-30b-a3b"):
        assert h100.sparse_mlp_flops_at(expert_shape(REGISTRY[name]), 2048) is not None


def test_the_profiler_rates_a_shape_by_the_flops_of_the_experts_each_token_is_routed_to():
    """With a clock that says every call takes 2 s, each point's rate is its tokens' active FLOPs
    over 2 s; the points are the decode and prefill sizes up to the shape's chunk."""
    from flexoff.models import moe

    cfg = MIXTRAL.replace(hidden_size=32, expert_intermediate_size=16, num_experts=4, experts_per_token=2)
    calls = []

    def two_seconds(fn):
        calls.append(fn())
        return 2.0

    (rate,), raw = measure_sparse_rates(torch.device("cpu"), torch.float32, two_seconds, configs=[cfg])
    assert rate.shape == (32, 16, 4, 2)
    chunk = moe.chunk_tokens(cfg)
    assert [t for t, _ in rate.points] == [64.0, 256.0, 1024.0, float(chunk)]
    assert [f for _, f in rate.points] == [6 * 32 * 16 * 2 * t / 2.0 for t, _ in rate.points]
    assert [out.shape for out in calls] == [(int(t), 32) for t, _ in rate.points]
    assert raw["32x16x4x2"]["tokens"] == [t for t, _ in rate.points]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_a_gpu_the_profiler_times_routed_experts_in_bfloat16_by_the_grouped_kernel():
    """What `flexoff profile` measures on a GPU: a rate for every point, rising from a decode-sized
    call (64 tokens) to the shape's prefill chunk, where every expert gets many rows."""
    from flexoff.profiler.kernels import best_seconds

    cfg = REGISTRY["qwen3-30b-a3b"].replace(hidden_size=512, expert_intermediate_size=256)
    device = torch.device("cuda")
    (rate,), _ = measure_sparse_rates(device, torch.bfloat16, lambda fn: best_seconds(fn, device, 0.05), configs=[cfg])
    flops = [f for _, f in rate.points]
    assert all(f > 0 for f in flops) and flops[-1] > flops[0]
