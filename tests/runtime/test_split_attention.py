"""CPU attention over part of the CPU cache while the rest travels to the GPU: the same tokens as
the plain run, row groups where the layout says, and memory counting only the travelling rows."""

from dataclasses import replace

import pytest
import torch

from flexoff import LLM, CompressionConfig, Policy, SamplingParams, TierFractions
from flexoff.layout import cache_rows, kv_cache_bytes, workspace_layout
from flexoff.runtime.interpreter import block_shape
from flexoff.runtime.tiers import DiskTier
from tests.conftest import PROMPTS, assert_same_outputs, generate
from tests.runtime.test_compressed_cache import BIG_HEADS, batch_caches

KINDS = ["opt-post-proj", "llama-gqa"]
PARAMS = SamplingParams(max_new_tokens=7, ignore_eos=True)
FOUR_BIT = CompressionConfig(4, 4)
ON_CPU = TierFractions(0, 1, 0)


def split(split: float, gpu_batch_size: int = 4, num_gpu_batches: int = 2, cache=ON_CPU, **changes) -> Policy:
    return Policy(gpu_batch_size=gpu_batch_size, num_gpu_batches=num_gpu_batches, cache=cache, cpu_attention=True,
                  cpu_attention_split=split, **changes)


# Batches of four: 0.5 attends two CPU rows on the host and ships two; 0.1 rounds to no row on the
# host, 0.9 to all of them.
SPLITS = {
    "half": split(0.5),
    "three-batches": split(0.5, gpu_batch_size=3, num_gpu_batches=3),
    "one-batch": split(0.5, num_gpu_batches=1),
    "gpu-rows-too": split(0.5, cache=TierFractions(0.25, 0.75, 0)),
    "weights-and-activations-off": split(0.25, weights=TierFractions(0, 0.5, 0.5), activations=ON_CPU),
    "rounds-to-none": split(0.1),
    "rounds-to-all": split(0.9),
    "none-with-disk": split(0.0, cache=TierFractions(0.25, 0.5, 0.25)),
}


@pytest.fixture(scope="module")
def references(tiny_model_dir, tmp_path_factory):
    """The plain run, everything on the device in one batch, plain and with a compressed cache."""
    refs = {}
    for kind in KINDS:
        path, _ = tiny_model_dir(kind)
        for compression in (None, FOUR_BIT):
            refs[kind, compression] = generate(path, Policy(gpu_batch_size=8, compress_cache=compression),
                                               params=PARAMS)
    return refs


@pytest.mark.parametrize("compression", [None, FOUR_BIT], ids=["plain", "compressed"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", list(SPLITS))
def test_split_matches_plain_run(tiny_model_dir, references, tmp_path, kind, name, compression):
    path, _ = tiny_model_dir(kind)
    policy = replace(SPLITS[name], compress_cache=compression)
    outs = generate(path, policy, tmp_path, params=PARAMS)
    assert_same_outputs(outs, references[kind, compression], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", ["half", "gpu-rows-too"])
def test_split_matches_plain_run_in_float16(tiny_model_dir, tmp_path, kind, name):
    path, _ = tiny_model_dir(kind)
    ref = generate(path, Policy(gpu_batch_size=8), params=PARAMS, dtype="float16")
    outs = generate(path, SPLITS[name], tmp_path, params=PARAMS, dtype="float16")
    assert_same_outputs(outs, ref, rtol=1e-2, atol=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("compression", [None, FOUR_BIT], ids=["plain", "compressed"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", list(SPLITS))
def test_split_matches_plain_run_on_cuda(tiny_model_dir, tmp_path, kind, name, compression):
    """On CUDA the travelling rows load on their stream while the worker attends the others."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    path, _ = tiny_model_dir(kind)
    policy = replace(SPLITS[name], compress_cache=compression)
    with LLM(str(path), policy=Policy(gpu_batch_size=8, compress_cache=compression), device="cuda",
             dtype="float32") as llm:
        ref = llm.generate(PROMPTS, PARAMS)
    with LLM(str(path), policy=policy, device="cuda", dtype="float32", offload_dir=str(tmp_path)) as llm:
        outs = llm.generate(PROMPTS, PARAMS)
    assert_same_outputs(outs, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("rows, cache, share, expected", [
    # gpu rows, then cpu rows that travel, then cpu rows on the host, then disk rows
    (4, ON_CPU, 0.5, [("cpu", 0, 2, False), ("cpu", 2, 4, True)]),
    (4, TierFractions(0.25, 0.75, 0), 0.5, [("gpu", 0, 1, False), ("cpu", 1, 2, False), ("cpu", 2, 4, True)]),
    (4, ON_CPU, 0.1, [("cpu", 0, 4, False)]),
    (4, ON_CPU, 0.9, [("cpu", 0, 4, True)]),
    (4, TierFractions(0.25, 0.5, 0.25), 0.0, [("gpu", 0, 1, False), ("cpu", 1, 3, False), ("disk", 3, 4, True)]),
    (8, ON_CPU, 0.3, [("cpu", 0, 6, False), ("cpu", 6, 8, True)]),
])
def test_cache_rows_split_the_cpu_rows(rows, cache, share, expected):
    policy = split(share, gpu_batch_size=rows, cache=cache)
    assert [(g.tier, g.start, g.stop, g.on_host) for g in cache_rows(rows, policy)] == expected


def test_without_cpu_attention_every_off_gpu_row_travels():
    policy = Policy(gpu_batch_size=4, cache=TierFractions(0.25, 0.5, 0.25))
    assert [(g.tier, g.travels) for g in cache_rows(4, policy)] == [("gpu", False), ("cpu", True), ("disk", True)]


@pytest.mark.parametrize("compression", [None, CompressionConfig(4, 64)], ids=["plain", "compressed"])
@pytest.mark.parametrize("share", [0.0, 0.5, 1.0])
def test_the_workspace_holds_only_the_travelling_rows(compression, share):
    slots = 40
    rows = 6
    layout = workspace_layout(BIG_HEADS, split(share, gpu_batch_size=rows, compress_cache=compression), rows, slots, 2)
    travelling = {0.0: 6, 0.5: 3, 1.0: 0}[share]
    if travelling == 0:
        assert layout is None  # nothing travels and no GPU row needs decompressing
        return
    assert layout.travelling == travelling
    shipped = Policy(gpu_batch_size=travelling, cache=ON_CPU, compress_cache=compression)
    assert layout == workspace_layout(BIG_HEADS, shipped, travelling, slots, 2)


@pytest.mark.parametrize("compression", [None, CompressionConfig(4, 64)], ids=["plain", "compressed"])
@pytest.mark.parametrize("cache, share", [
    (ON_CPU, 0.0), (ON_CPU, 0.5), (ON_CPU, 1.0), (TierFractions(0.34, 0.66, 0), 0.5),
    (TierFractions(0.17, 0.5, 0.33), 0.0),  # cpu rows travel, disk rows attend on the host
], ids=["cpu-0", "cpu-0.5", "cpu-1", "gpu-and-cpu-0.5", "all-tiers-0"])
def test_estimate_is_what_a_split_cache_allocates(tmp_path, compression, share, cache):
    policy = split(share, gpu_batch_size=6, cache=cache, compress_cache=compression)
    disk = DiskTier(tmp_path)
    try:
        caches = batch_caches(policy, disk)
        allocated = dict.fromkeys(("gpu", "cpu", "disk"), 0)
        for kv in caches:
            for tier, size in kv.nbytes_by_tier().items():
                allocated[tier] += size
        if caches[0].workspace is not None:
            allocated["gpu"] += caches[0].workspace.nbytes
        # Host-attended rows are stored row-major, travelling ones slot-major.
        layouts = {g.on_host: g.layout.order for g in caches[0].groups if g.tier == "cpu"}
    finally:
        disk.close()
    assert kv_cache_bytes(BIG_HEADS, policy, 40, 2) == allocated
    if share == 0.5:
        assert layouts == {True: (0, 1, 2, 3), False: (2, 0, 1, 3)}


def test_a_split_batch_both_attends_on_the_host_and_travels(tmp_path):
    disk = DiskTier(tmp_path)
    try:
        caches = batch_caches(split(0.5, gpu_batch_size=6), disk)
    finally:
        disk.close()

    class Batch:  # what block_shape reads of a GPU batch
        def __init__(self, kv):
            self.kv = kv
            self.activations = type("Activations", (), {"offloaded": False})()

    shape = block_shape([Batch(kv) for kv in caches], 3, 5)
    assert shape.cpu_attention == shape.travelling_cache == frozenset({0, 1})


def test_a_run_from_a_policy_file_says_how_cpu_attention_is_split(tmp_path, capsys):
    from flexoff.commands.main import main

    path = tmp_path / "policy.json"
    split(0.5, weights=TierFractions(0.5, 0.5, 0)).save(path)
    assert main(["run", "--quiet", "--policy", str(path), "--num-prompts", "8", "--prompt-len", "6",
                 "--gen-len", "3", "--ignore-eos"]) == 0
    out = capsys.readouterr().out
    assert "cpu attention on for 50% of the cpu cache's sequences; the rest travel to the GPU" in out
