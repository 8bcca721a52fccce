"""Planning mixtures of experts: FLOPs of the experts a token is routed to, bytes of all of them (the
runtime loads every expert of a layer), the sorted rows' working memory, and searched policies for
registry sizes that the layout (what the runtime allocates) says fit."""

import json

import pytest
import torch

from flexoff.commands import main as cli
from flexoff.layout import Capacity, check_fits, job_bytes, sparse_mlp_bytes, weight_layout
from flexoff.models import REGISTRY
from flexoff.planner.cost_model import CostModel, Placement, PolicyFrame, Workload
from flexoff.layout import expected_experts_touched
from flexoff.planner.experts import expert_bytes_per_layer
from flexoff.planner.hardware import packaged_profile
from flexoff.planner.search import search_policy
from flexoff.policy import CompressionConfig, Policy

GiB = 1 << 30
WORKLOAD = Workload(512, 32)
CPU_WEIGHTS = Placement(0, 1, 0, 0, 1, 0, 1, 0, 0)
CACHE_ON_GPU = Placement(0, 1, 0, 1, 0, 0, 1, 0, 0)
FOUR_BIT = CompressionConfig(4, 64)


def dense_twin(name: str):
    """A dense model with the MoE's bytes: one MLP as wide as all its experts together."""
    moe = REGISTRY[name]
    return moe.replace(name=f"{name}-dense", num_experts=0, experts_per_token=0,
                       intermediate_size=moe.num_experts * moe.expert_intermediate_size)


@pytest.mark.parametrize("name", ["mixtral-8x7b", "qwen3-30b-a3b"])
def test_a_moes_matmuls_are_far_below_a_dense_model_of_the_same_bytes(name, make_hardware):
    """Same weight bytes to load, but each token multiplies through k of E experts: a quarter of
    Mixtral's MLP, a sixteenth of Qwen3-30B-A3B's. On a machine whose matmuls run at one rate
    whatever their rows, the time is the FLOPs."""
    hardware = make_hardware(matmul_flops=((1.0, 1e12),))
    frame = PolicyFrame(64, 2)
    moe, dense = (CostModel(config, WORKLOAD, hardware) for config in (REGISTRY[name], dense_twin(name)))
    assert moe.weight_bytes_per_layer(frame) == pytest.approx(dense.weight_bytes_per_layer(frame), rel=1e-3)
    for phase in ("prefill", "decode"):
        moe_io, moe_compute = moe.phase_terms(frame, CPU_WEIGHTS)[phase]
        dense_io, dense_compute = dense.phase_terms(frame, CPU_WEIGHTS)[phase]
        assert moe_io["cpu_to_gpu"] == pytest.approx(dense_io["cpu_to_gpu"], rel=1e-3)
        assert moe_compute["gpu_matmul"] < 0.35 * dense_compute["gpu_matmul"]


def test_an_experts_matmul_runs_at_the_rate_of_its_share_of_the_rows(make_hardware):
    """Decode at 64 rows: each of Mixtral's experts gets 16 of them on average, so on a machine whose
    matmuls slow down below 64 rows the experts' part takes longer than at the batch's rate."""
    flat = make_hardware(matmul_flops=((1.0, 1e12),))
    steep = make_hardware(matmul_flops=((16.0, 0.25e12), (64.0, 1e12)))
    frame = PolicyFrame(64, 1)
    config = REGISTRY["mixtral-8x7b"]
    at = {hw.name + str(i): CostModel(config, WORKLOAD, hw).phase_terms(frame, CPU_WEIGHTS)["decode"][1]["gpu_matmul"]
          for i, hw in enumerate((flat, steep))}
    assert at["round1"] > 1.5 * at["round0"]


def test_weight_loads_are_the_touched_experts_where_the_runtime_routes_first(make_hardware):
    """A block of one sequence routes first (as the runtime does for it): a decode step loads the
    experts its token touches, k of E; a block of two GPU batches, or one of 64 sequences, loads
    every expert. A prefill of 512 tokens touches them all either way."""
    hardware = make_hardware()
    config = REGISTRY["mixtral-8x7b"]
    model = CostModel(config, WORKLOAD, hardware)
    all_experts = CostModel(config, WORKLOAD, hardware, route_first=False)
    experts = expert_bytes_per_layer(config, FOUR_BIT)

    def loads(m, frame, phase="decode"):
        return m.phase_terms(frame, CACHE_ON_GPU)[phase][0]["cpu_to_gpu"] * hardware.cpu_to_gpu_bandwidth

    one = PolicyFrame(1, 1, FOUR_BIT)
    stored = model.weight_bytes_per_layer(one)
    assert loads(all_experts, one) == pytest.approx(stored)
    untouched = experts * (1 - expected_experts_touched(8, 2, 1) / 8)
    assert loads(model, one) == pytest.approx(stored - untouched)
    for frame in (PolicyFrame(1, 2, FOUR_BIT), PolicyFrame(64, 1, FOUR_BIT)):
        assert loads(model, frame) == pytest.approx(loads(all_experts, frame))
    assert loads(model, one, "prefill") == pytest.approx(loads(all_experts, one, "prefill"))


def test_the_sorted_rows_bound_a_moes_prefill_batch(make_hardware, monkeypatch):
    """Mixtral's prefill sorts its tokens' rows through experts 14336 wide, 4096 tokens at a time
    (models.moe.chunk_tokens): a batch of 16384 prompt tokens in one chunk would hold every routed
    pair's gathered row, gate-up and activation in fp16 at once; in chunks it holds a chunk's, and
    the chunks' output for the whole batch."""
    from flexoff.models import moe

    hardware = make_hardware(gpu_memory=1 << 50, cpu_memory=1 << 50)
    frame = PolicyFrame(32, 1, FOUR_BIT, FOUR_BIT)
    mixtral = REGISTRY["mixtral-8x7b"]

    def peak():
        return CostModel(mixtral, WORKLOAD, hardware).memory_terms(frame, CPU_WEIGHTS)[("gpu", "prefill")]

    assert moe.chunk_tokens(mixtral) == 4096
    chunked = peak()
    monkeypatch.setattr(moe, "CHUNK_ELEMENTS", 1 << 40)  # every token in one chunk
    whole = peak()
    pairs, output = (16384 - 4096) * 2, 16384 * 4096 * 2
    assert whole - chunked >= pairs * (4096 + 3 * 14336) * 2 - output
    assert whole - chunked < pairs * (4 * 4096 + 3 * 14336) * 2


@pytest.mark.parametrize("name", ["mixtral-8x7b", "qwen3-30b-a3b", "qwen1.5-moe-a2.7b"])
def test_a_searched_moe_policy_fits_what_the_runtime_allocates(name):
    """Under 16 GiB on the H100 profile, 4-bit allowed: the planned weights are the layout's stored
    bytes, and the job's bytes per tier as the runtime allocates them (layout.job_bytes, pinned host
    memory) pass the runtime's check under `--gpu-mem 16GiB`. For the two the issue measures they
    also fit within the planner's own usable share of each tier (the headroom kept for the CUDA
    context and fragmentation stays free); Qwen1.5-MoE's GPU cut rounds to whole experts, up to
    half an expert of a layer more on the GPU than its share, which the headroom takes."""
    hardware = packaged_profile("h100").with_memory(gpu=16 * GiB)
    config = REGISTRY[name]
    result = search_policy(config, WORKLOAD, hardware, compress="auto")
    policy = result.policy
    assert result.prediction.fits
    model = CostModel(config, WORKLOAD, hardware)
    planned = model.weight_bytes_per_layer(PolicyFrame.of(policy)) * config.num_layers
    stored = sum(sum(tiers.values()) for tiers in weight_layout(config, policy, torch.float16).stage_tiers.values())
    assert planned == pytest.approx(stored, rel=1e-3)
    needed = job_bytes(config, policy, torch.float16, WORKLOAD.prompt_len, WORKLOAD.gen_len,
                       pinned=hardware.pinned_host_memory)
    check_fits(needed, Capacity(16 * GiB, hardware.cpu_memory, hardware.disk_memory), f"{name} under {policy}")
    if name != "qwen1.5-moe-a2.7b":
        usable = Capacity(*(int(hardware.capacity(tier)) for tier in ("gpu", "cpu", "disk")))
        check_fits(needed, usable, f"{name} under {policy}")


@pytest.mark.parametrize("name", ["mixtral-8x7b", "qwen1.5-moe-a2.7b"])
def test_flexoff_search_plans_a_moe_under_16_gib(capsys, tmp_path, name):
    output = tmp_path / "policy.json"
    code = cli.main(["search", "--model", name, "--gpu-mem", "16GiB", "--compress", "auto",
                     "--hardware", "h100", "--output", str(output)])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert f"{name} on h100" in out and "token/s generated" in out
    policy = Policy.load(output)
    # The sorted rows of a GPU batch's prefill (512 tokens a sequence, k rows each) fit the cap.
    assert sparse_mlp_bytes(REGISTRY[name], policy.gpu_batch_size * 512, 2) < 16 * GiB * 0.9


def test_policy_auto_runs_a_tiny_mixture_of_experts(tiny_model_dir, tmp_path, capsys):
    """`flexoff run --policy auto` on a checkpoint whose experts do not fit the capped device: the
    planned policy offloads and the run generates every prompt."""
    path, _ = tiny_model_dir("mixtral")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("the cat sat\na dog ran to the house\n")
    out = tmp_path / "out.jsonl"
    code = cli.main(["run", "--model", str(path), "--prompts", str(prompts), "--hardware", "t4", "--dtype",
                     "bfloat16", "--gpu-mem", "100KB", "--gen-len", "3", "--quiet", "--ignore-eos",
                     "--policy", "auto", "--output", str(out)])
    err = capsys.readouterr().err
    assert code == 0, err
    assert "searched" in err
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [len(r["token_ids"]) for r in rows] == [3, 3]


def test_experts_placed_apart_are_priced_at_their_own_fractions():
    """A policy with the attention on the GPU and the experts in host memory moves the experts'
    bytes each step: its weight share on the GPU is the non-expert elements', as the layout
    places them, not the weights' fraction alone."""
    from flexoff.layout import requested_fractions
    from flexoff.models import stage_specs, stages
    from flexoff.policy import TierFractions

    config = REGISTRY["mixtral-8x7b"]
    on_gpu, on_cpu = TierFractions(1, 0, 0), TierFractions(0, 1, 0)
    apart = Policy(16, 2, weights=on_gpu, experts=on_cpu, cache=on_cpu, compress_weight=CompressionConfig(4, 64))
    placement = Placement.of(apart, config)
    specs = [spec for stage in stages(config) for spec in stage_specs(config, stage)]
    expected = requested_fractions(specs, on_gpu, on_cpu)
    assert (placement.wg, placement.wc, placement.wd) == pytest.approx((expected["gpu"], expected["cpu"], 0))
    assert 0.03 < placement.wg < 0.1  # Mixtral's attention, router, embedding and head: a few percent
    model = CostModel(config, WORKLOAD, packaged_profile("h100"))
    moved = model.predict(apart).decode.io["cpu_to_gpu"]
    together = Policy(16, 2, weights=TierFractions(placement.wg, placement.wc, 0), cache=on_cpu,
                      compress_weight=CompressionConfig(4, 64))
    assert moved == pytest.approx(model.predict(together).decode.io["cpu_to_gpu"])
    assert moved > model.predict(Policy(16, 2, weights=on_gpu, cache=on_cpu,
                                        compress_weight=CompressionConfig(4, 64))).decode.io["cpu_to_gpu"]


def test_the_host_issues_more_for_a_llama_layer_and_more_again_for_a_sparse_one(make_hardware):
    """Each GPU batch's layer costs the host the OPT figure, plus the Llama family's extra, plus
    the sparse MLP's extra on the share of layers that route."""
    hardware = make_hardware(host_seconds_per_layer=1.0, host_seconds_per_llama_layer=0.5,
                             host_seconds_per_sparse_layer=0.25)
    frame = PolicyFrame(64, 2)

    def host_per_layer(config):
        io, _ = CostModel(config, WORKLOAD, hardware).phase_terms(frame, CACHE_ON_GPU)["prefill"]
        return io["host"] / frame.num_gpu_batches

    mixtral = REGISTRY["mixtral-8x7b"]
    half_dense = mixtral.replace(name="half-dense", dense_layers=tuple(range(0, mixtral.num_layers, 2)))
    assert host_per_layer(REGISTRY["opt-30b"]) == pytest.approx(1.0)
    assert host_per_layer(dense_twin("mixtral-8x7b")) == pytest.approx(1.5)
    assert host_per_layer(mixtral) == pytest.approx(1.75)
    assert host_per_layer(half_dense) == pytest.approx(1.625)
    # A profile that did not measure the extras charges every family the OPT figure.
    assert CostModel(mixtral, WORKLOAD, make_hardware(host_seconds_per_layer=1.0)).host_seconds_per_layer == 1.0
