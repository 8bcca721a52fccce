"""The compressed KV cache: every placement gives the tokens of the same compression kept on the
device, compression really changes (a little) what the model computes, and the cache's bytes
shrink on every tier."""

import os
from functools import partial

import pytest
import torch

from flexoff import LLM, Policy, SamplingParams, TierFractions
from flexoff.models import ModelConfig
from flexoff.runtime.sampler import BatchSampler
from flexoff.runtime.kv import BatchKV, BlockKV, KVWorkspace
from flexoff.layout import kv_cache_bytes
from flexoff.policy import CompressionConfig
from flexoff.runtime.tiers import DiskTier, HostMemory, HostWorker, Streams
from tests.conftest import PROMPTS, assert_same_outputs, generate

KINDS = ["opt-post-proj", "llama-gqa"]  # both have head_dim 8
FOUR_BIT = CompressionConfig(4, 4)  # two groups per head
PARAMS = SamplingParams(max_new_tokens=7, ignore_eos=True)
PLACEMENTS = {
    "gpu": TierFractions(1, 0, 0),
    "cpu": TierFractions(0, 1, 0),
    "disk": TierFractions(0, 0, 1),
    "mixed": TierFractions(0.34, 0.33, 0.33),
}
# Beyond the main setting: a group spanning the whole head, and groups that do not divide it.
OTHER_SETTINGS = {"2bit-group8": CompressionConfig(2, 8), "3bit-group3": CompressionConfig(3, 3)}


def compressed_policy(compression: CompressionConfig, placement: str, cpu_attention: bool,
                      num_gpu_batches: int) -> Policy:
    # Batches of three put one row on each tier of the mixed placement.
    return Policy(gpu_batch_size=3, num_gpu_batches=num_gpu_batches, cache=PLACEMENTS[placement],
                  cpu_attention=cpu_attention, compress_cache=compression)


generate = partial(generate, params=PARAMS)


def references(tiny_model_dir, offload_dirs, **llm_args):
    """reference(kind, compression): the same compression with the cache and everything else on
    the device, one batch of all prompts; each run once."""
    cache = {}

    def reference(kind: str, compression: CompressionConfig):
        if (kind, compression) not in cache:
            path, _ = tiny_model_dir(kind)
            policy = Policy(gpu_batch_size=8, compress_cache=compression)
            cache[kind, compression] = generate(path, policy, offload_dirs.mktemp("ref"), **llm_args)
        return cache[kind, compression]

    return reference


@pytest.fixture(scope="module")
def on_device(tiny_model_dir, tmp_path_factory):
    return references(tiny_model_dir, tmp_path_factory)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("num_gpu_batches", [1, 3])
@pytest.mark.parametrize("cpu_attention", [False, True], ids=["gpu-attention", "cpu-attention"])
@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_every_placement_matches_compressed_on_device(tiny_model_dir, on_device, tmp_path, kind, placement,
                                                      cpu_attention, num_gpu_batches):
    path, _ = tiny_model_dir(kind)
    outs = generate(path, compressed_policy(FOUR_BIT, placement, cpu_attention, num_gpu_batches), tmp_path)
    assert_same_outputs(outs, on_device(kind, FOUR_BIT))
    assert os.listdir(tmp_path) == []  # offload files are gone once the model is closed


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cpu_attention", [False, True], ids=["gpu-attention", "cpu-attention"])
@pytest.mark.parametrize("setting", list(OTHER_SETTINGS))
def test_other_bits_and_groups_match_on_mixed_tiers(tiny_model_dir, on_device, tmp_path, kind, setting,
                                                    cpu_attention):
    path, _ = tiny_model_dir(kind)
    compression = OTHER_SETTINGS[setting]
    outs = generate(path, compressed_policy(compression, "mixed", cpu_attention, 3), tmp_path)
    assert_same_outputs(outs, on_device(kind, compression))


def step_logits(path, policy: Policy, monkeypatch) -> list[torch.Tensor]:
    """The logits each step samples from (prefill, then one decode step), for all prompts in one batch."""
    captured = []
    choose = BatchSampler.choose

    def capture(self, logits, live):
        captured.append(logits.float().cpu())
        return choose(self, logits, live)

    monkeypatch.setattr(BatchSampler, "choose", capture)
    with LLM(str(path), policy=policy) as llm:
        llm.generate(PROMPTS, SamplingParams(max_new_tokens=2, ignore_eos=True))
    return captured


@pytest.mark.parametrize("kind", KINDS)
def test_compression_changes_decode_logits_a_little(tiny_model_dir, monkeypatch, kind):
    path, _ = tiny_model_dir(kind)
    plain = step_logits(path, Policy(gpu_batch_size=8), monkeypatch)
    eight = step_logits(path, Policy(gpu_batch_size=8, compress_cache=CompressionConfig(8, 4)), monkeypatch)
    four = step_logits(path, Policy(gpu_batch_size=8, compress_cache=FOUR_BIT), monkeypatch)
    # The prefill attends on the fresh keys, so it is untouched, and the first decode step sees the
    # same input token: its logits differ only through the cache.
    torch.testing.assert_close(eight[0], plain[0], rtol=0, atol=0)
    torch.testing.assert_close(four[0], plain[0], rtol=0, atol=0)
    error_eight = (eight[1] - plain[1]).abs().max().item()
    error_four = (four[1] - plain[1]).abs().max().item()
    assert error_eight > 1e-5, "8-bit compression left the decode logits untouched: is it active?"
    assert error_four > 4 * error_eight, "4 bits should cost more accuracy than 8"
    for compressed in (eight, four):
        correlation = torch.corrcoef(torch.stack((compressed[1].flatten(), plain[1].flatten())))[0, 1].item()
        assert correlation > 0.99
    assert torch.equal(eight[1].argmax(-1), plain[1].argmax(-1))


# head_dim 64 at fp16: a 4-bit row of 64 values is 32 bytes of codes + 2 bytes of scale + 2 of
# minimum, 36 bytes against 128, i.e. 4.5 bits per value.
BIG_HEADS = ModelConfig(name="kv-test", family="llama", vocab_size=64, hidden_size=256, num_layers=3, num_heads=4,
                        num_kv_heads=2, intermediate_size=64, max_positions=128)
COMPRESSED_RATIO = 4.5 / 16


def batch_caches(policy: Policy, disk: DiskTier, rows: int = 6, slots: int = 40) -> list[BatchKV]:
    device, dtype = torch.device("cpu"), torch.float16
    streams = Streams(device, policy.overlap)
    workspace = KVWorkspace.for_block(BIG_HEADS, policy, rows, slots, device, dtype, streams)
    host = HostMemory(pin=False)
    worker = HostWorker(device, streams, pin=False)  # never used here, so it starts no thread
    block = BlockKV(BIG_HEADS, policy, device, dtype, streams, host, disk, worker, workspace)
    return [BatchKV(block, rows, slots, f"b{n}") for n in range(policy.num_gpu_batches)]


@pytest.mark.parametrize("placement", list(PLACEMENTS))
@pytest.mark.parametrize("cpu_attention", [False, True], ids=["gpu-attention", "cpu-attention"])
def test_compressed_cache_takes_4_5_bits_per_value_on_every_tier(tmp_path, placement, cpu_attention):
    disk = DiskTier(tmp_path)
    try:
        sizes = {}
        for name, compression in (("plain", None), ("compressed", CompressionConfig(4, 64))):
            policy = Policy(gpu_batch_size=6, cache=PLACEMENTS[placement], cpu_attention=cpu_attention,
                            compress_cache=compression)
            [cache] = batch_caches(policy, disk)
            sizes[name] = cache.nbytes_by_tier()
            # The files are just large enough for the compressed bytes (rounded up to whole pages).
            for region in (r for g in cache.groups if g.tier == "disk" for pair in g.files.values() for r in pair):
                assert region.num_bytes <= os.fstat(region.fd).st_size < region.num_bytes + 4096
    finally:
        disk.close()
    used = [tier for tier, size in sizes["plain"].items() if size]
    assert used, "the placement put no cache anywhere"
    for tier in used:
        assert sizes["compressed"][tier] == sizes["plain"][tier] * COMPRESSED_RATIO, tier


@pytest.mark.parametrize("compression", [None, CompressionConfig(4, 64)], ids=["plain", "compressed"])
@pytest.mark.parametrize("placement", ["gpu", "cpu", "mixed"])
@pytest.mark.parametrize("cpu_attention", [False, True], ids=["gpu-attention", "cpu-attention"])
def test_estimate_is_what_the_cache_allocates(tmp_path, compression, placement, cpu_attention):
    policy = Policy(gpu_batch_size=6, num_gpu_batches=2, cache=PLACEMENTS[placement], cpu_attention=cpu_attention,
                    compress_cache=compression)
    disk = DiskTier(tmp_path)
    try:
        caches = batch_caches(policy, disk)
        allocated = dict.fromkeys(("gpu", "cpu", "disk"), 0)
        for cache in caches:
            for tier, size in cache.nbytes_by_tier().items():
                allocated[tier] += size
        workspace = caches[0].workspace
        if workspace is not None:
            allocated["gpu"] += workspace.nbytes
    finally:
        disk.close()
    assert kv_cache_bytes(BIG_HEADS, policy, 40, 2) == allocated


def test_compressed_rows_travel_compressed_with_a_shared_dequantization_buffer():
    device, dtype, slots, rows = torch.device("cpu"), torch.float16, 40, 6
    plain, compressed = (
        KVWorkspace.for_block(BIG_HEADS, Policy(gpu_batch_size=rows, cache=PLACEMENTS["mixed"], compress_cache=c),
                              rows, slots, device, dtype, Streams(device, True))
        for c in (None, CompressionConfig(4, 64)))
    ring = sum(plain.fmt.size_of(buffer) for pair in plain.sets for buffer in pair)
    compressed_ring = sum(compressed.fmt.size_of(buffer) for pair in compressed.sets for buffer in pair)
    assert compressed_ring == ring * COMPRESSED_RATIO
    # 2 of 6 rows stay on the GPU and 4 travel: one pair of buffers decompresses the larger share.
    travelling = 4 * slots * BIG_HEADS.num_kv_heads * BIG_HEADS.head_dim
    assert [t.numel() for t in compressed.dequantized] == [travelling, travelling]
    assert plain.dequantized == (None, None)
    # A compressed cache kept on the GPU needs the buffer even with nothing offloaded.
    on_gpu = Policy(gpu_batch_size=rows, compress_cache=CompressionConfig(4, 64))
    assert KVWorkspace.for_block(BIG_HEADS, on_gpu, rows, slots, device, dtype, Streams(device, True)).sets == []
    assert KVWorkspace.for_block(BIG_HEADS, Policy(gpu_batch_size=rows), rows, slots, device, dtype,
                                 Streams(device, True)) is None


@pytest.mark.parametrize("kind", KINDS)
def test_disk_traffic_shrinks_by_the_compression_ratio(tiny_model_dir, tmp_path, kind):
    path, _ = tiny_model_dir(kind)
    written = {}
    for name, compression in (("plain", None), ("compressed", FOUR_BIT)):
        policy = Policy(gpu_batch_size=3, num_gpu_batches=2, cache=PLACEMENTS["disk"], compress_cache=compression)
        with LLM(str(path), policy=policy, offload_dir=str(tmp_path)) as llm:
            llm.generate(PROMPTS, PARAMS)
            written[name] = llm.engine.disk.bytes_written
    # Every write is a run of whole slots; on the CPU the cache is fp32, so a head of 8 values takes
    # 32 bytes plain and 4 bytes of codes + 2 groups x (scale + minimum) x 4 bytes = 20 compressed.
    assert written["compressed"] * 32 == written["plain"] * 20


# The same equalities on CUDA: quantization on the GPU, compressed bytes crossing PCIe, and CPU
# attention decompressing on the host.
CUDA = dict(device="cuda", dtype="float32")


@pytest.fixture(scope="module")
def on_cuda(tiny_model_dir, tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    return references(tiny_model_dir, tmp_path_factory, **CUDA)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("num_gpu_batches", [1, 3])
@pytest.mark.parametrize("cpu_attention", [False, True], ids=["gpu-attention", "cpu-attention"])
@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_every_placement_matches_compressed_on_device_cuda(tiny_model_dir, on_cuda, tmp_path, kind, placement,
                                                           cpu_attention, num_gpu_batches):
    path, _ = tiny_model_dir(kind)
    outs = generate(path, compressed_policy(FOUR_BIT, placement, cpu_attention, num_gpu_batches), tmp_path, **CUDA)
    assert_same_outputs(outs, on_cuda(kind, FOUR_BIT), rtol=1e-4)  # CPU and GPU attention round differently


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cpu_attention", [False, True], ids=["gpu-attention", "cpu-attention"])
@pytest.mark.parametrize("setting", list(OTHER_SETTINGS))
def test_other_bits_and_groups_match_on_mixed_tiers_cuda(tiny_model_dir, on_cuda, tmp_path, kind, setting,
                                                         cpu_attention):
    path, _ = tiny_model_dir(kind)
    compression = OTHER_SETTINGS[setting]
    outs = generate(path, compressed_policy(compression, "mixed", cpu_attention, 3), tmp_path, **CUDA)
    assert_same_outputs(outs, on_cuda(kind, compression), rtol=1e-4)
