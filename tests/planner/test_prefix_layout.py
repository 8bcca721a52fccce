"""The layout counts a GPU batch's shared prefix once (the runtime contract of flexoff.prefixes):
its rows hold their own slots, the batch one row of the prefix's slots on the tier one row of the
cache lies on, with its own workspace and, at the prefill, one more activation row of the prefix.
Each figure here is written out by hand from the model's sizes, and the form the planner weighs is
still the layout's figure at every vertex placement."""

import itertools

import pytest
import torch

from flexoff.layout import (DISK_SLOT_RING, block_bytes, block_disk_files, block_host_requests, disk_file_bytes,
                            job_bytes, kv_cache_bytes, memory_form, whole_tier)
from flexoff.layout.block import DISK_HOST_PAIRS
from flexoff.models import REGISTRY
from flexoff.policy import TIERS, CompressionConfig, Policy

PROMPT, NEW, PREFIX = 64, 8, 40
SLOTS = PROMPT + NEW
FP16 = 2
GBS, NB = 4, 3


def _policy(cache: str, activations: str = "gpu", cpu_attention: bool = False, compression=None) -> Policy:
    return Policy(GBS, NB, whole_tier("gpu"), whole_tier(cache), whole_tier(activations), cpu_attention=cpu_attention,
                  compress_cache=compression)


def _kv_row_bytes(cfg, slots: int) -> int:
    """Keys and values of one row of ``slots`` slots in one layer, fp16."""
    return 2 * slots * cfg.num_kv_heads * cfg.head_dim * FP16


@pytest.mark.parametrize("name", ("opt-125m", "llama-3-8b"))
def test_a_batch_holds_its_prefix_once_on_the_gpu(name):
    cfg = REGISTRY[name]
    held = kv_cache_bytes(cfg, _policy("gpu"), SLOTS, FP16, prefix_len=PREFIX)
    # per layer and batch: GBS rows of their own 32 + 8 slots, and one row of the 40 shared
    by_hand = cfg.num_layers * NB * (GBS * _kv_row_bytes(cfg, SLOTS - PREFIX) + _kv_row_bytes(cfg, PREFIX))
    assert held == {"gpu": by_hand, "cpu": 0, "disk": 0}
    unshared = kv_cache_bytes(cfg, _policy("gpu"), SLOTS, FP16)
    assert unshared["gpu"] - held["gpu"] == cfg.num_layers * NB * (GBS - 1) * _kv_row_bytes(cfg, PREFIX)


def test_a_travelling_prefix_has_its_own_workspace_once_per_block():
    cfg = REGISTRY["opt-125m"]
    held = kv_cache_bytes(cfg, _policy("cpu"), SLOTS, FP16, prefix_len=PREFIX)
    home = cfg.num_layers * NB * (GBS * _kv_row_bytes(cfg, SLOTS - PREFIX) + _kv_row_bytes(cfg, PREFIX))
    # a ring of two (keys, values) sets for the batches' rows, and one for the prefix's row
    workspace = 2 * GBS * _kv_row_bytes(cfg, SLOTS - PREFIX) + 2 * _kv_row_bytes(cfg, PREFIX)
    assert held == {"gpu": workspace, "cpu": home, "disk": 0}
    # with CPU attention nothing travels
    assert kv_cache_bytes(cfg, _policy("cpu", cpu_attention=True), SLOTS, FP16, prefix_len=PREFIX) == {
        "gpu": 0, "cpu": home, "disk": 0}


def test_a_prefix_on_disk_is_staged_without_a_ring_of_new_slots():
    cfg = REGISTRY["opt-125m"]
    policy = _policy("disk", cpu_attention=True)
    held = kv_cache_bytes(cfg, policy, SLOTS, FP16, prefix_len=PREFIX)
    rows, prefix = GBS * _kv_row_bytes(cfg, SLOTS - PREFIX), _kv_row_bytes(cfg, PREFIX)
    staging = NB * (DISK_HOST_PAIRS * rows + DISK_SLOT_RING * GBS * _kv_row_bytes(cfg, 1) + DISK_HOST_PAIRS * prefix)
    assert held == {"gpu": 0, "cpu": staging, "disk": cfg.num_layers * NB * (rows + prefix)}
    # two files (keys, values) a layer for the batch's rows and two for its prefix's row
    files = block_disk_files(cfg, policy, PROMPT, SLOTS, FP16, prefix_len=PREFIX)
    expected = ([disk_file_bytes(rows // 2)] * (2 * cfg.num_layers) + [disk_file_bytes(prefix // 2)] * (2 * cfg.num_layers))
    assert sorted(files) == sorted(expected * NB)


def test_the_prefill_holds_one_more_activation_row_of_the_prefix():
    cfg = REGISTRY["opt-125m"]
    hidden = cfg.hidden_size * FP16
    for tier in TIERS:
        policy = _policy("gpu", activations=tier)
        shared = block_bytes(cfg, policy, PROMPT, NEW, FP16, prefix_len=PREFIX)
        alone = block_bytes(cfg, policy, PROMPT, NEW, FP16)
        kv_saved = cfg.num_layers * NB * (GBS - 1) * _kv_row_bytes(cfg, PREFIX)
        row = NB * PREFIX * hidden  # one row of the prefix a batch, where the batch's rows are
        assert shared["gpu"] - alone["gpu"] == (row if tier == "gpu" else 0) - kv_saved, tier
        assert shared["cpu"] - alone["cpu"] == (0 if tier == "gpu" else row), tier  # disk rows staged in host memory
        assert shared["disk"] - alone["disk"] == (row if tier == "disk" else 0), tier
    requests = block_host_requests(cfg, _policy("cpu", "cpu"), PROMPT, SLOTS, FP16, prefix_len=PREFIX)
    row_pair = [_kv_row_bytes(cfg, SLOTS - PREFIX) * GBS // 2] * 2
    prefix_pair = [_kv_row_bytes(cfg, PREFIX) // 2] * 2
    per_batch = (row_pair * cfg.num_layers + prefix_pair * cfg.num_layers
                 + [GBS * PROMPT * hidden, PREFIX * hidden])
    assert requests == per_batch * NB


def _placed(policy: Policy, weights: str, cache: str, activations: str) -> Policy:
    return Policy(policy.gpu_batch_size, policy.num_gpu_batches, whole_tier(weights), whole_tier(cache),
                  whole_tier(activations), cpu_attention=policy.cpu_attention, compress_weight=policy.compress_weight,
                  compress_cache=policy.compress_cache)


@pytest.mark.parametrize("name, compressed, cpu_attention", [
    ("opt-125m", False, False), ("opt-125m", True, True), ("llama-3-8b", True, False), ("llama-3-8b", False, True)])
def test_the_form_is_job_bytes_at_every_vertex_with_a_prefix(name, compressed, cpu_attention):
    cfg = REGISTRY[name]
    compression = CompressionConfig(4, 64) if compressed else None
    policy = Policy(GBS, NB, cpu_attention=cpu_attention, compress_weight=compression, compress_cache=compression)
    form = memory_form(cfg, policy, torch.float16, PROMPT, NEW, prefix_len=PREFIX)
    assert form != memory_form(cfg, policy, torch.float16, PROMPT, NEW)
    for w, c, h in itertools.product(TIERS, TIERS, TIERS):
        fractions = dict(weights=whole_tier(w).as_tuple(), cache=whole_tier(c).as_tuple(),
                         activations=whole_tier(h).as_tuple())
        exact = job_bytes(cfg, _placed(policy, w, c, h), torch.float16, PROMPT, NEW, prefix_len=PREFIX)
        assert form.at(**fractions) == exact, (w, c, h)
