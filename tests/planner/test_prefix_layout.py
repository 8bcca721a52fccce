"""The layout counts a GPU batch's shared prefixes once each, as runtime.prefix_kv holds them: its
rows hold their own slots, the batch one row of the longest prefix's slots per group of rows
sharing one (G rows, placed as G rows of the cache are), with their own workspace and, at the
prefill, G more activation rows of the prefix beside the rows' own prompt tokens.
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
GROUPS = (1, 3)  # prefix rows a batch of four holds: one group of rows, or three


def _policy(cache: str, activations: str = "gpu", cpu_attention: bool = False, compression=None) -> Policy:
    return Policy(GBS, NB, whole_tier("gpu"), whole_tier(cache), whole_tier(activations), cpu_attention=cpu_attention,
                  compress_cache=compression)


def _kv_row_bytes(cfg, slots: int) -> int:
    """Keys and values of one row of ``slots`` slots in one layer, fp16."""
    return 2 * slots * cfg.num_kv_heads * cfg.head_dim * FP16


@pytest.mark.parametrize("groups", GROUPS)
@pytest.mark.parametrize("name", ("opt-125m", "llama-3-8b"))
def test_a_batch_holds_each_prefix_once_on_the_gpu(name, groups):
    cfg = REGISTRY[name]
    held = kv_cache_bytes(cfg, _policy("gpu"), SLOTS, FP16, prefix_len=PREFIX, prefix_rows=groups)
    # per layer and batch: GBS rows of their own 24 + 8 slots, and a row of the 40 shared per group
    by_hand = cfg.num_layers * NB * (GBS * _kv_row_bytes(cfg, SLOTS - PREFIX) + groups * _kv_row_bytes(cfg, PREFIX))
    assert held == {"gpu": by_hand, "cpu": 0, "disk": 0}
    unshared = kv_cache_bytes(cfg, _policy("gpu"), SLOTS, FP16)
    assert unshared["gpu"] - held["gpu"] == cfg.num_layers * NB * (GBS - groups) * _kv_row_bytes(cfg, PREFIX)


@pytest.mark.parametrize("groups", GROUPS)
def test_travelling_prefixes_have_their_own_workspace_once_per_block(groups):
    cfg = REGISTRY["opt-125m"]
    held = kv_cache_bytes(cfg, _policy("cpu"), SLOTS, FP16, prefix_len=PREFIX, prefix_rows=groups)
    home = cfg.num_layers * NB * (GBS * _kv_row_bytes(cfg, SLOTS - PREFIX) + groups * _kv_row_bytes(cfg, PREFIX))
    # a ring of two (keys, values) sets for the batches' rows, and one for the prefixes' rows
    workspace = 2 * GBS * _kv_row_bytes(cfg, SLOTS - PREFIX) + 2 * groups * _kv_row_bytes(cfg, PREFIX)
    assert held == {"gpu": workspace, "cpu": home, "disk": 0}
    # with CPU attention nothing travels
    assert kv_cache_bytes(cfg, _policy("cpu", cpu_attention=True), SLOTS, FP16, prefix_len=PREFIX,
                          prefix_rows=groups) == {"gpu": 0, "cpu": home, "disk": 0}


@pytest.mark.parametrize("groups", GROUPS)
def test_a_compressed_travelling_cache_decompresses_the_most_rows_of_either(groups):
    cfg = REGISTRY["llama-3-8b"]
    compression = CompressionConfig(4, 64)
    policy = _policy("cpu", compression=compression)
    held = kv_cache_bytes(cfg, policy, SLOTS, FP16, prefix_len=PREFIX, prefix_rows=groups)
    plain = kv_cache_bytes(cfg, _policy("cpu"), SLOTS, FP16, prefix_len=PREFIX, prefix_rows=groups)
    # each workspace's flat fp16 (keys, values) pair for all its travelling rows, beside the ring
    width = cfg.num_kv_heads * cfg.head_dim
    flat = 2 * (GBS * (SLOTS - PREFIX) + groups * PREFIX) * width * FP16
    ring = held["gpu"] - flat
    assert 0 < ring < plain["gpu"]  # the ring holds the compressed format
    assert ring == plain["gpu"] * held["cpu"] // plain["cpu"]  # as compressed as the homes are


@pytest.mark.parametrize("groups", GROUPS)
def test_prefixes_on_disk_are_staged_like_any_disk_rows(groups):
    cfg = REGISTRY["opt-125m"]
    policy = _policy("disk", cpu_attention=True)
    held = kv_cache_bytes(cfg, policy, SLOTS, FP16, prefix_len=PREFIX, prefix_rows=groups)
    rows, prefixes = GBS * _kv_row_bytes(cfg, SLOTS - PREFIX), groups * _kv_row_bytes(cfg, PREFIX)
    # three pairs of a layer and a ring of one-slot pairs, for the rows and for the prefixes
    staging = NB * (DISK_HOST_PAIRS * (rows + prefixes) + DISK_SLOT_RING * (GBS + groups) * _kv_row_bytes(cfg, 1))
    assert held == {"gpu": 0, "cpu": staging, "disk": cfg.num_layers * NB * (rows + prefixes)}
    # two files (keys, values) a layer for the batch's rows and two for its prefixes' rows
    files = block_disk_files(cfg, policy, PROMPT, SLOTS, FP16, prefix_len=PREFIX, prefix_rows=groups)
    expected = ([disk_file_bytes(rows // 2)] * (2 * cfg.num_layers)
                + [disk_file_bytes(prefixes // 2)] * (2 * cfg.num_layers))
    assert sorted(files) == sorted(expected * NB)


@pytest.mark.parametrize("groups", GROUPS)
def test_the_prefill_holds_the_prefixes_rows_beside_the_rows_own_tokens(groups):
    cfg = REGISTRY["opt-125m"]
    hidden = cfg.hidden_size * FP16
    for tier in TIERS:
        policy = _policy("gpu", activations=tier)
        shared = block_bytes(cfg, policy, PROMPT, NEW, FP16, prefix_len=PREFIX, prefix_rows=groups)
        alone = block_bytes(cfg, policy, PROMPT, NEW, FP16)
        kv_saved = cfg.num_layers * NB * (GBS - groups) * _kv_row_bytes(cfg, PREFIX)
        # the rows' own tokens are PROMPT - PREFIX each, and each group's prefix is a row of PREFIX
        rows = NB * (groups - GBS) * PREFIX * hidden
        assert shared["gpu"] - alone["gpu"] == (rows if tier == "gpu" else 0) - kv_saved, tier
        assert shared["cpu"] - alone["cpu"] == (0 if tier == "gpu" else rows), tier  # disk rows staged in host memory
        assert shared["disk"] - alone["disk"] == (rows if tier == "disk" else 0), tier
    requests = block_host_requests(cfg, _policy("cpu", "cpu"), PROMPT, SLOTS, FP16, prefix_len=PREFIX,
                                   prefix_rows=groups)
    # in the engine's order: the prefixes' cache and hidden states, then the rows'
    row_pair = [_kv_row_bytes(cfg, SLOTS - PREFIX) * GBS // 2] * 2
    prefix_pair = [_kv_row_bytes(cfg, PREFIX) * groups // 2] * 2
    per_batch = (prefix_pair * cfg.num_layers + [groups * PREFIX * hidden]
                 + row_pair * cfg.num_layers + [GBS * (PROMPT - PREFIX) * hidden])
    assert requests == per_batch * NB


def test_without_a_prefix_its_rows_change_nothing():
    cfg = REGISTRY["opt-125m"]
    for cache, activations in itertools.product(TIERS, TIERS):
        policy = _policy(cache, activations)
        assert block_bytes(cfg, policy, PROMPT, NEW, FP16, prefix_rows=3) == block_bytes(cfg, policy, PROMPT, NEW, FP16)
        assert block_host_requests(cfg, policy, PROMPT, SLOTS, FP16, prefix_rows=3) == \
            block_host_requests(cfg, policy, PROMPT, SLOTS, FP16)


def _placed(policy: Policy, weights: str, cache: str, activations: str) -> Policy:
    return Policy(policy.gpu_batch_size, policy.num_gpu_batches, whole_tier(weights), whole_tier(cache),
                  whole_tier(activations), cpu_attention=policy.cpu_attention, compress_weight=policy.compress_weight,
                  compress_cache=policy.compress_cache)


@pytest.mark.parametrize("groups", GROUPS)
@pytest.mark.parametrize("name, compressed, cpu_attention", [
    ("opt-125m", False, False), ("opt-125m", True, True), ("llama-3-8b", True, False), ("llama-3-8b", False, True)])
def test_the_form_is_job_bytes_at_every_vertex_with_prefixes(name, compressed, cpu_attention, groups):
    cfg = REGISTRY[name]
    compression = CompressionConfig(4, 64) if compressed else None
    policy = Policy(GBS, NB, cpu_attention=cpu_attention, compress_weight=compression, compress_cache=compression)
    form = memory_form(cfg, policy, torch.float16, PROMPT, NEW, prefix_len=PREFIX, prefix_rows=groups)
    assert form != memory_form(cfg, policy, torch.float16, PROMPT, NEW)
    if groups > 1:
        assert form != memory_form(cfg, policy, torch.float16, PROMPT, NEW, prefix_len=PREFIX)
    for w, c, h in itertools.product(TIERS, TIERS, TIERS):
        fractions = dict(weights=whole_tier(w).as_tuple(), cache=whole_tier(c).as_tuple(),
                         activations=whole_tier(h).as_tuple())
        exact = job_bytes(cfg, _placed(policy, w, c, h), torch.float16, PROMPT, NEW, prefix_len=PREFIX,
                          prefix_rows=groups)
        assert form.at(**fractions) == exact, (w, c, h)
