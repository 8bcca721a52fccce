"""The layout's memory as a constant plus a coefficient per placement fraction (layout.memory_form)
is the layout's own figure, job_bytes, at every vertex placement: each group of fractions wholly on
one tier, where every tensor and every batch lies whole on a tier, so the figures are integers and
must agree exactly."""

import itertools

import pytest
import torch

from flexoff.layout import job_bytes, memory_form, whole_tier
from flexoff.layout.host import SlabPlan
from flexoff.models import REGISTRY
from flexoff.policy import TIERS, CompressionConfig, Policy

FOUR_BIT = CompressionConfig(4, 64)
PROMPT, NEW = 64, 8
MODELS = ("opt-125m", "llama-3-8b", "mixtral-8x7b", "qwen1.5-moe-a2.7b")
# (gpu batch size, batches): one batch, and several sharing a dequantization and a workspace; the
# MoE model with 60 experts a layer (and a shared expert) at the second only, to keep the test quick
BATCHES = ((1, 1), (12, 3))


def frames():
    for name, compressed, cpu_attention, (gbs, nb) in itertools.product(MODELS, (False, True), (False, True), BATCHES):
        if name == "qwen1.5-moe-a2.7b" and nb == 1:
            continue
        compression = FOUR_BIT if compressed else None
        policy = Policy(gbs, nb, cpu_attention=cpu_attention, compress_weight=compression, compress_cache=compression)
        yield pytest.param(name, policy, id=f"{name}-{'4bit' if compressed else 'fp16'}-"
                                            f"{'cpu' if cpu_attention else 'gpu'}-attention-{gbs}x{nb}")


def vertices(cfg):
    """Every combination of whole tiers for the weights, the cache, the activations and (a MoE
    model's) experts."""
    experts = TIERS if cfg.num_experts else (None,)
    for w, c, h, e in itertools.product(TIERS, TIERS, TIERS, experts):
        yield dict(weights=w, cache=c, activations=h, experts=e)


def _placed(policy, vertex):
    return Policy(policy.gpu_batch_size, policy.num_gpu_batches, whole_tier(vertex["weights"]),
                  whole_tier(vertex["cache"]), whole_tier(vertex["activations"]), cpu_attention=policy.cpu_attention,
                  compress_weight=policy.compress_weight, compress_cache=policy.compress_cache,
                  experts=None if vertex["experts"] is None else whole_tier(vertex["experts"]))


def _fractions(vertex):
    return {group: whole_tier(tier).as_tuple() for group, tier in vertex.items() if tier is not None}


@pytest.mark.parametrize("name, policy", list(frames()))
def test_the_form_is_job_bytes_at_every_vertex(name, policy):
    cfg = REGISTRY[name]
    form = memory_form(cfg, policy, torch.float16, PROMPT, NEW)
    # the form reads the frame only: the placement it is given does not matter
    assert memory_form(cfg, _placed(policy, dict(weights="disk", cache="cpu", activations="cpu", experts=None)),
                       torch.float16, PROMPT, NEW) == form
    for vertex in vertices(cfg):
        placed = _placed(policy, vertex)
        assert form.at(**_fractions(vertex)) == job_bytes(cfg, placed, torch.float16, PROMPT, NEW), vertex


def test_experts_follow_the_weights_where_not_given():
    cfg = REGISTRY["mixtral-8x7b"]
    form = memory_form(cfg, Policy(4, 2), torch.float16, PROMPT, NEW)
    cpu, gpu = whole_tier("cpu").as_tuple(), whole_tier("gpu").as_tuple()
    assert form.at(weights=cpu, cache=gpu, activations=gpu) == form.at(weights=cpu, experts=cpu, cache=gpu,
                                                                       activations=gpu)
    assert (job_bytes(cfg, Policy(4, 2, whole_tier("cpu")), torch.float16, PROMPT, NEW)
            == form.at(weights=cpu, cache=gpu, activations=gpu))


@pytest.mark.parametrize("name", ("opt-30b", "llama-3-8b"))
def test_with_pinned_host_memory_only_shared_slabs_differ(name):
    """Pinned, the weights' pages are exact at every vertex; the block's cache and activations share
    slabs where both are in host memory, which the form counts apart: never below the layout's
    figure, and above it by at most the activations' own slabs."""
    cfg = REGISTRY[name]
    policy = Policy(16, 3)
    form = memory_form(cfg, policy, torch.float16, 512, 32, pinned=True)
    for vertex in vertices(cfg):
        placed = _placed(policy, vertex)
        exact = job_bytes(cfg, placed, torch.float16, 512, 32, pinned=True)
        planned = form.at(**_fractions(vertex))
        assert {t: planned[t] for t in ("gpu", "disk")} == {t: exact[t] for t in ("gpu", "disk")}, vertex
        if vertex["cache"] == "gpu" or vertex["activations"] == "gpu":
            assert planned["cpu"] == exact["cpu"], vertex
        else:
            # three batches' hidden states of 16 rows x 512 tokens, fp16, in slabs of their own
            alone = SlabPlan.SLAB * -(-3 * 16 * 512 * cfg.hidden_size * 2 // SlabPlan.SLAB)
            assert exact["cpu"] <= planned["cpu"] <= exact["cpu"] + alone, vertex
