"""A block whose GPU batches each hold several shared prefixes (a row per group of rows that begin
alike) holds the bytes the layout counts for it: its rows' caches and the prefixes' caches per
tier, both workspaces, every host allocation, the offload files, and the engine checks the block
against that very figure."""

import random
from collections import Counter

import pytest

from flexoff import LLM, Policy, SamplingParams, TierFractions
from flexoff.layout import block_disk_files, block_host_requests, job_bytes, kv_cache_bytes
from flexoff.layout.block import activation_rows
from flexoff.policy import CompressionConfig
from flexoff.prefixes import MIN_SHARED_PREFIX
from flexoff.runtime import engine as engine_module
from flexoff.runtime.batch import Sequence

GROUPS, ROWS = 3, 2  # each GPU batch: three groups of two rows sharing a prefix
PREFIX, OWN, NEW = MIN_SHARED_PREFIX + 6, 5, 3
SPREAD = TierFractions(1 / 3, 1 / 3, 1 / 3)  # six rows two a tier, three prefix rows one a tier
ON_CPU, ON_DISK = TierFractions(0, 1, 0), TierFractions(0, 0, 1)


def _policy(**changes) -> Policy:
    return Policy(**{"gpu_batch_size": GROUPS * ROWS, "num_gpu_batches": 2, **changes})


POLICIES = {
    "device": _policy(),
    "travelling": _policy(cache=SPREAD, activations=SPREAD),
    "cpu attention": _policy(cache=SPREAD, activations=ON_CPU, cpu_attention=True),
    "disk": _policy(cache=ON_DISK, activations=ON_DISK),
    "compressed": _policy(cache=SPREAD, activations=SPREAD, compress_cache=CompressionConfig(4, 4)),
}


def _sequences(batches: int) -> list[Sequence]:
    """Batch by batch, GROUPS groups of ROWS prompts: a head of PREFIX ids, then each row's own ids,
    the first of them its own (so that the group shares exactly the head), the longest OWN."""
    rng = random.Random(0)
    params = SamplingParams(max_tokens=NEW, ignore_eos=True)
    prompts = []
    for group in range(batches * GROUPS):
        head = [rng.randrange(4, 40) for _ in range(PREFIX)]
        for row in range(ROWS):
            own = [40 + (group * ROWS + row) % 20] + [rng.randrange(4, 60) for _ in range(OWN - 1 - row)]
            prompts.append(head + own)
    return [Sequence(i, p, params, seed=i) for i, p in enumerate(prompts)]


@pytest.mark.parametrize("name", POLICIES)
def test_a_block_of_several_prefixes_a_batch_holds_what_the_layout_counts(tiny_model_dir, tmp_path, monkeypatch,
                                                                          name):
    path, _ = tiny_model_dir("llama-gqa")
    policy = POLICIES[name]
    checked = []
    real_check = engine_module.check_fits
    monkeypatch.setattr(engine_module, "check_fits", lambda needed, *rest: (checked.append(needed), real_check(
        needed, *rest))[1])
    offload = tmp_path / "offload"
    with LLM(str(path), policy=policy, device="cpu", dtype="float32", offload_dir=str(offload)) as llm:
        engine, cfg, itemsize = llm.engine, llm.config, llm.dtype.itemsize
        before = Counter(entry.stat().st_size for entry in offload.rglob("*") if entry.is_file())
        batches = engine.make_batches(_sequences(policy.num_gpu_batches), NEW)
        assert [(len(b.prefix.spans), b.prefix.length, b.prompt_len) for b in batches] == \
            [(GROUPS, PREFIX, OWN)] * policy.num_gpu_batches
        shared = {"prefix_len": PREFIX, "prefix_rows": GROUPS}
        prompt, slots = PREFIX + OWN, PREFIX + OWN + NEW
        # the engine checked the block as the layout counts it
        assert checked[-1] == job_bytes(cfg, policy, llm.dtype, prompt, NEW, engine.pins_host, **shared)

        caches = [c for b in batches for c in (b.kv, b.prefix.kv)]
        held = {tier: sum(c.nbytes_by_tier()[tier] for c in caches) for tier in ("gpu", "cpu", "disk")}
        for workspace in {id(c.workspace): c.workspace for c in caches if c.workspace is not None}.values():
            held["gpu"] += workspace.nbytes
        assert held == kv_cache_bytes(cfg, policy, slots, itemsize, **shared)

        hidden = [a for b in batches for a in (b.activations, b.prefix.activations)]
        off_device = sum(t.numel() * t.element_size() for a in hidden for t in a.host.values())
        assert off_device == policy.num_gpu_batches * sum(
            rows * tokens * cfg.hidden_size * itemsize
            for tier, rows, tokens in activation_rows(policy, prompt, PREFIX, GROUPS) if tier != "gpu")
        # every host allocation of the block, and its offload files
        assert batches[0].kv.host.nbytes == sum(block_host_requests(cfg, policy, prompt, slots, itemsize, **shared))
        files = Counter(entry.stat().st_size for entry in offload.rglob("*") if entry.is_file()) - before
        assert files == Counter(block_disk_files(cfg, policy, prompt, slots, itemsize, **shared))
