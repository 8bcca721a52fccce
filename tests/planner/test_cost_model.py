"""Hand-computed cases of the cost model on a tiny OPT (hidden 4, 2 layers) and round hardware.

Sizes used below (see test_sizes): per layer 188 matrix elements (128 own + 120/2 share of the
embedding, positions and head) and 48 vector elements, so W = 472 fp16 bytes; KV is 16 bytes per
token per layer; a hidden state is 8 bytes per token. Workload: prompt 4, generate 3, so the mean
decode cache length is 5.5.
"""

import dataclasses

import pytest

from flexoff.errors import ConfigError
from flexoff.planner.cost_model import CostModel, PolicyFrame, Workload
from flexoff.policy import CompressionConfig, Policy, TierFractions

GPU, CPU, DISK = TierFractions(1, 0, 0), TierFractions(0, 1, 0), TierFractions(0, 0, 1)
FOUR_BIT = CompressionConfig(4, 64)
GiB = 1 << 30


@pytest.fixture
def model(tiny_opt, round_hardware):
    return CostModel(tiny_opt, Workload(prompt_len=4, gen_len=3), round_hardware)


def model_frame(prediction) -> PolicyFrame:
    return PolicyFrame.of(prediction.policy)


def offloaded(**changes) -> Policy:
    values = dict(gpu_batch_size=2, num_gpu_batches=1, weights=CPU, cache=CPU, activations=GPU)
    values.update(changes)
    return Policy(**values)


def test_weights_and_cache_on_cpu_by_hand(model):
    p = model.predict(offloaded())
    assert model.weight_bytes_per_layer(model_frame(p)) == 472
    # prefill: the layer's weights cross PCIe; the new cache (16 B x 4 tokens x 2 sequences) goes back
    assert p.prefill.io["cpu_to_gpu"] == pytest.approx(472 / 100)
    assert p.prefill.io["gpu_to_cpu"] == pytest.approx(128 / 50)
    assert p.prefill.io["disk_to_cpu"] == 0 and p.prefill.io["cpu_to_disk"] == 0
    # 2 FLOPs x (128 x 4 tokens + 40/2 head share) x 2 sequences at 1000 FLOP/s
    assert p.prefill.compute["gpu_matmul"] == pytest.approx(2128 / 1000)
    # 4 s^2 x (2 heads x 2) x 2 sequences at 500 FLOP/s
    assert p.prefill.compute["gpu_attention"] == pytest.approx(512 / 500)
    # element-wise, per token: 2 LayerNorms (4 B x 4 wide) + 2 residual adds (6 B x 4) + ReLU (4 B x 8)
    # = 112 B, x 4 tokens x 2 sequences at 40 B/s of GPU memory
    assert p.prefill.compute["gpu_elementwise"] == pytest.approx(896 / 40)
    assert p.prefill.seconds_per_layer == pytest.approx(2.128 + 1.024 + 22.4)
    assert p.prefill.bound == "compute (gpu_elementwise)"
    # decode: weights plus the cache (16 B x 5.5 tokens x 2 sequences) cross PCIe each step
    assert p.decode.io["cpu_to_gpu"] == pytest.approx((472 + 176) / 100)
    assert p.decode.io["gpu_to_cpu"] == pytest.approx(32 / 50)  # the new token's keys and values
    assert p.decode.compute["gpu_matmul"] == pytest.approx(592 / 1000)
    # per sequence max(88 FLOPs / 20, 88 bytes / 40) = 4.4 s, for 2 sequences
    assert p.decode.compute["gpu_attention"] == pytest.approx(8.8)
    assert p.decode.seconds_per_layer == pytest.approx(9.392)
    assert p.decode.bound == "compute (gpu_attention)"
    # 2 layers x (25.552 + 2 decode steps x 9.392)
    assert p.block_latency == pytest.approx(2 * 25.552 + 2 * 2 * 9.392)
    assert p.total_throughput == pytest.approx(2 * 3 / p.block_latency)
    assert p.prefill_throughput == pytest.approx(2 * 4 / (2 * 25.552))
    assert p.decode_throughput == pytest.approx(2 * 2 / (2 * 2 * 9.392))


def test_a_block_generating_one_token_keeps_no_cache(tiny_opt, round_hardware):
    """A scoring pass never reads its cache again: the prefill sends none of it to the CPU or the
    disk, quantizes none, and no tier holds it."""
    kept, one = (CostModel(tiny_opt, Workload(prompt_len=4, gen_len=n), round_hardware) for n in (2, 1))
    # with 2 new tokens, the new cache (16 B x 4 tokens x 2 sequences) goes to the CPU as above
    assert kept.predict(offloaded()).prefill.io["gpu_to_cpu"] == pytest.approx(128 / 50)
    p = one.predict(offloaded())
    assert p.prefill.io["gpu_to_cpu"] == 0 and p.prefill.io["cpu_to_disk"] == 0
    assert p.prefill.compute == kept.predict(offloaded()).prefill.compute  # the prefill computes the same
    q = one.predict(offloaded(weights=GPU, cache=DISK, compress_cache=FOUR_BIT))
    assert q.prefill.io["cpu_to_disk"] == 0 and q.prefill.compute["dequantize"] == 0
    assert q.peak_memory["disk"] == 0  # the cache's share of the disk is nothing
    # the CPU holds the weights alone: none of the cache's 16 B x 6 slots x 2 sequences x 2 layers
    assert p.peak_memory["cpu"] == kept.predict(offloaded()).peak_memory["cpu"] - 16 * 6 * 2 * 2 == 472 * 2


def test_cpu_attention_moves_queries_instead_of_cache(model):
    p = model.predict(offloaded(cpu_attention=True))
    # 8-byte attention output per sequence comes back instead of 176 bytes of cache
    assert p.decode.io["cpu_to_gpu"] == pytest.approx((472 + 16) / 100)
    # new keys and values (32 B) plus the queries (16 B) go to the CPU
    assert p.decode.io["gpu_to_cpu"] == pytest.approx(0.64 + 0.32)
    assert p.decode.compute["gpu_attention"] == 0
    assert p.decode.compute["cpu_attention"] == pytest.approx(2 * 88 / 4)
    assert p.decode.bound == "compute (cpu_attention)"
    # prefill attention stays on the GPU
    assert p.prefill.compute == model.predict(offloaded()).prefill.compute


def test_cpu_attention_slows_down_while_weights_stream(tiny_opt, make_hardware):
    # At half speed under copies, CPU attention ends (1 - 0.5) x the 4.72 s weight copy later.
    contended = make_hardware(cpu_attention_share_under_copy=0.5)
    p = CostModel(tiny_opt, Workload(4, 3), contended).predict(offloaded(cpu_attention=True))
    assert p.decode.compute["cpu_attention"] == pytest.approx(2 * 88 / 4 + 0.5 * 4.72)
    # With the weights on the GPU no copy runs, and nothing slows CPU attention down.
    resident = CostModel(tiny_opt, Workload(4, 3), contended).predict(offloaded(weights=GPU, cpu_attention=True))
    assert resident.decode.compute["cpu_attention"] == pytest.approx(2 * 88 / 4)
    # GPU attention does not share host memory with the copies.
    gpu = CostModel(tiny_opt, Workload(4, 3), contended).predict(offloaded())
    assert gpu.decode.compute == CostModel(tiny_opt, Workload(4, 3), make_hardware()).predict(offloaded()).decode.compute


def test_cpu_attention_pays_a_fixed_cost_per_call(tiny_opt, make_hardware):
    # 0.25 s per call of up to CPU_ATTENTION_ROWS (32) sequences, beside the FLOPs (88 per sequence at 4 FLOP/s).
    per_call = make_hardware(cpu_attention_seconds_per_call=0.25)
    for gbs, batches, calls in ((2, 1, 1), (2, 3, 3), (40, 1, 2), (40, 2, 4)):
        policy = offloaded(gpu_batch_size=gbs, num_gpu_batches=batches, cpu_attention=True, weights=GPU)
        p = CostModel(tiny_opt, Workload(4, 3), per_call).predict(policy)
        assert p.decode.compute["cpu_attention"] == pytest.approx(gbs * batches * 88 / 4 + calls * 0.25)
    # Only the share of the cache off the GPU is attended on the CPU.
    half = offloaded(gpu_batch_size=2, num_gpu_batches=3, cpu_attention=True, weights=GPU,
                     cache=TierFractions(0.5, 0.5, 0))
    p = CostModel(tiny_opt, Workload(4, 3), per_call).predict(half)
    assert p.decode.compute["cpu_attention"] == pytest.approx(0.5 * (6 * 88 / 4 + 3 * 0.25))


def test_pinned_host_memory_reserves_pages_and_slabs(tiny_opt, make_hardware):
    # The runtime pins each weight tensor in pages of its own: the tiny model's 944 bytes of
    # weights are 37 tensors (2 embeddings, 16 per layer, the final norm's 2 and the head), so 37
    # pages. The cache comes in slabs of 1 GiB: its 448 bytes (2 layers x 2 sequences x 7 slots
    # x 16 B) take one.
    plain = make_hardware(cpu_memory=1 << 40)
    pinned = make_hardware(cpu_memory=1 << 40, pinned_host_memory=True)
    policy = offloaded()
    before = CostModel(tiny_opt, Workload(4, 3), plain).predict(policy)
    after = CostModel(tiny_opt, Workload(4, 3), pinned).predict(policy)
    assert after.peak_memory["cpu"] - before.peak_memory["cpu"] == pytest.approx((37 * 4096 - 944) + (GiB - 448))
    # Only what is on the CPU takes pages and slabs; nothing else changes.
    assert after.peak_memory["gpu"] == before.peak_memory["gpu"]
    on_gpu = offloaded(weights=GPU, cache=GPU)
    assert (CostModel(tiny_opt, Workload(4, 3), pinned).predict(on_gpu).peak_memory
            == CostModel(tiny_opt, Workload(4, 3), plain).predict(on_gpu).peak_memory)


def test_host_time_per_layer_bounds_small_batches(tiny_opt, make_hardware):
    # 0.5 s per layer and 3 s per step (spread over the 2 layers) for each of 2 GPU batches.
    slow_host = make_hardware(host_seconds_per_layer=0.5, host_seconds_per_step=3.0)
    policy = offloaded(weights=GPU, cache=GPU, num_gpu_batches=2, gpu_batch_size=1)
    p = CostModel(tiny_opt, Workload(4, 3), slow_host).predict(policy)
    assert p.decode.io["host"] == p.prefill.io["host"] == pytest.approx(2 * (0.5 + 3.0 / 2))
    # Everything on the GPU: the device computes while the host issues, so the slower one bounds.
    assert p.decode.compute_seconds > 4.0
    assert p.decode.bound == "compute (gpu_attention)"
    assert p.decode.seconds_per_layer == pytest.approx(p.decode.compute_seconds)
    slower = make_hardware(host_seconds_per_layer=5.0, host_seconds_per_step=3.0)
    q = CostModel(tiny_opt, Workload(4, 3), slower).predict(policy)
    assert q.decode.compute_seconds < 13.0
    assert q.decode.bound == "host" and q.decode.seconds_per_layer == pytest.approx(2 * (5.0 + 1.5))
    # A profile without the measurement has no host term.
    assert CostModel(tiny_opt, Workload(4, 3), make_hardware()).predict(policy).decode.io["host"] == 0


def test_host_issues_more_for_a_travelling_compressed_cache_and_compressed_weights(tiny_opt, make_hardware):
    hardware = make_hardware(host_seconds_per_layer=0.5, host_seconds_per_step=3.0,
                             host_seconds_per_travelling_layer=0.25, host_seconds_per_compressed_cache_layer=0.125,
                             host_seconds_per_compressed_weight_layer=2.0)
    model = CostModel(tiny_opt, Workload(4, 3), hardware)
    base = 2 * (0.5 + 3.0 / 2)  # two GPU batches

    def host(**changes):
        p = model.predict(offloaded(num_gpu_batches=2, gpu_batch_size=1, **changes))
        assert p.prefill.io["host"] == pytest.approx(base)  # the extras are decode's
        return p.decode.io["host"]

    assert host(cache=GPU) == pytest.approx(base)
    # Each batch's cache travels, whole or a quarter of its rows.
    assert host(cache=CPU) == pytest.approx(base + 2 * 0.25)
    assert host(cache=TierFractions(0.75, 0.25, 0)) == pytest.approx(base + 2 * 0.25 / 4)
    # A compressed cache costs the host wherever the GPU attends it, travelling or not.
    assert host(cache=CPU, compress_cache=FOUR_BIT) == pytest.approx(base + 2 * (0.25 + 0.125))
    assert host(cache=GPU, compress_cache=FOUR_BIT) == pytest.approx(base + 2 * 0.125)
    # Compressed weights: one pass a layer for the two batches, with CPU attention too; one each
    # where a block has one batch.
    assert host(cache=GPU, compress_weight=FOUR_BIT) == pytest.approx(base + 2.0)
    assert host(cache=CPU, cpu_attention=True, compress_weight=FOUR_BIT) == pytest.approx(base + 2.0)


def test_disk_rows_cost_the_host_per_batch_however_few_they_are_and_their_bytes_in_series(tiny_opt, make_hardware):
    hardware = make_hardware(host_seconds_per_layer=0.5, host_seconds_per_travelling_layer=0.25,
                             host_seconds_per_disk_rows_layer=0.75)
    model = CostModel(tiny_opt, Workload(4, 3), hardware)

    def host(cache, cpu_attention=False):
        p = model.predict(offloaded(num_gpu_batches=2, gpu_batch_size=8, cache=cache, cpu_attention=cpu_attention))
        assert p.prefill.io["host"] == pytest.approx(2 * 0.5)  # decode's reads and writes only
        return p.decode

    travelling = 2 * (0.5 + 0.25)
    # All 16 rows' cache on disk: 16 bytes a token (keys and values of hidden 4 in fp16) over the
    # mean 5.5 slots of a decode step, read at the disk's 10 bytes/s.
    all_rows_read = 16 * 16 * 5.5 / 10
    assert host(CPU).io["host"] == pytest.approx(travelling)
    # One row of eight on disk costs each batch the whole charge, as do two rows or all of them; the
    # rows' reads add in proportion.
    for cache in (TierFractions(0, 7 / 8, 1 / 8), TierFractions(0, 6 / 8, 2 / 8), DISK):
        assert host(cache).io["host"] == pytest.approx(travelling + 2 * 0.75 + cache.disk * all_rows_read), cache
    # With CPU attention the host time joins the attention, charge and reads included.
    assert (host(TierFractions(0, 7 / 8, 1 / 8), True).compute["cpu_attention"]
            - host(CPU, True).compute["cpu_attention"]) == pytest.approx(2 * 0.75 + all_rows_read / 8)


def test_disk_reads_come_from_the_page_cache_only_while_free_memory_holds_them(tiny_opt, make_hardware):
    policy = offloaded(weights=DISK, cache=GPU)
    cold = CostModel(tiny_opt, Workload(4, 3), make_hardware()).predict(policy)
    assert cold.prefill.io["disk_to_cpu"] == pytest.approx(472 / 10) and not cold.disk_reads_cached
    # 944 bytes on disk; the CPU holds 944 bytes of staging at its peak.
    roomy = make_hardware(disk_to_cpu_cached_bandwidth=40.0, cpu_memory=944 + 944)
    warm = CostModel(tiny_opt, Workload(4, 3), roomy).predict(policy)
    assert warm.disk_reads_cached
    assert warm.prefill.io["disk_to_cpu"] == pytest.approx(472 / 40)
    assert warm.total_throughput > cold.total_throughput
    assert warm.peak_memory == cold.peak_memory
    # One byte short of room for the file's pages: every read goes to the disk.
    tight = make_hardware(disk_to_cpu_cached_bandwidth=40.0, cpu_memory=944 + 943)
    assert not CostModel(tiny_opt, Workload(4, 3), tight).predict(policy).disk_reads_cached


def test_cache_quantization_and_dequantization_have_their_own_rates(tiny_opt, make_hardware):
    policy = offloaded(weights=GPU, cache=GPU, compress_cache=FOUR_BIT)
    p = CostModel(tiny_opt, Workload(4, 3), make_hardware(gpu_kv_dequant_throughput=50.0)).predict(policy)
    # quantizing 2 x 4 tokens x 8 new elements, then dequantizing 2 x 5.5 x 8 per step, at 50/s
    assert p.prefill.compute["dequantize"] == pytest.approx(64 / 50)
    assert p.decode.compute["dequantize"] == pytest.approx(88 / 50)
    slow = make_hardware(gpu_kv_dequant_throughput=50.0, gpu_kv_quant_throughput=8.0)
    p = CostModel(tiny_opt, Workload(4, 3), slow).predict(policy)
    assert p.prefill.compute["dequantize"] == pytest.approx(64 / 8)
    assert p.decode.compute["dequantize"] == pytest.approx(88 / 50)


def test_compression_shrinks_bytes_and_costs_dequantization(model):
    policy = offloaded(weights=DISK, cache=GPU, compress_weight=FOUR_BIT, compress_cache=FOUR_BIT)
    p = model.predict(policy)
    weight_bytes = 188 * (0.5 + 4 / 64) + 48 * 2  # vectors stay fp16
    assert p.prefill.io["disk_to_cpu"] == pytest.approx(weight_bytes / 10)
    assert p.prefill.io["cpu_to_gpu"] == pytest.approx(weight_bytes / 100)
    # weights once per GPU batch, plus quantizing the 2 x 4 tokens x 8 new cache elements
    assert p.prefill.compute["dequantize"] == pytest.approx((188 + 64) / 200)
    # decode: weights, plus the whole cache for GPU attention (2 x 5.5 x 8 elements)
    assert p.decode.compute["dequantize"] == pytest.approx(188 / 200 + 88 / 200)
    assert p.decode.bound == "disk_to_cpu"


def test_gpu_batches_share_a_dequantization_with_or_without_cpu_attention(model):
    one = model.predict(offloaded(compress_weight=FOUR_BIT))
    four = model.predict(offloaded(gpu_batch_size=2, num_gpu_batches=4, compress_weight=FOUR_BIT))
    assert four.decode.compute["dequantize"] == pytest.approx(one.decode.compute["dequantize"])
    split = model.predict(offloaded(gpu_batch_size=2, num_gpu_batches=4, compress_weight=FOUR_BIT,
                                    cpu_attention=True))
    single = model.predict(offloaded(compress_weight=FOUR_BIT, cpu_attention=True))
    assert split.decode.compute["dequantize"] == pytest.approx(single.decode.compute["dequantize"])
    # The shared pass needs a buffer for the whole stage, not one matrix's.
    frames = [PolicyFrame.of(offloaded(gpu_batch_size=2, num_gpu_batches=n, compress_weight=FOUR_BIT,
                                       cpu_attention=True)) for n in (1, 4)]
    assert model.weight_buffer_bytes(frames[1], 0.0) > model.weight_buffer_bytes(frames[0], 0.0)


def test_without_overlap_the_terms_add_up(model):
    p = model.predict(offloaded(overlap=False))
    for phase in (p.prefill, p.decode):
        assert phase.seconds_per_layer == pytest.approx(sum(phase.io.values()) + phase.compute_seconds)
    assert p.decode.seconds_per_layer > model.predict(offloaded()).decode.seconds_per_layer


def test_everything_on_gpu_memory_by_hand(model):
    p = model.predict(offloaded(weights=GPU, cache=GPU))
    # prefill: weights 2 x 472, hidden 8 x 4 tokens x 2, cache 16 x 7 tokens x 2 x 2 layers, the
    # largest transient plus two hidden copies (128), and the buffer terms: room for a tensor split
    # across tiers (two of the largest matrix, 40 x 2 B) and the sampler's state for the block's 2
    # rows x 10 tokens (int32 counts and a seen mask: 5 B each, 100). The largest transient is the
    # head step's, not the memory-efficient kernel's for 8 query rows over 4 keys (q,k,v and output
    # 16 x 2 B, mask and bias 4 x 3 B, log-sum-exp 2 x 4 B: 8 x 52 = 416): fp16 logits 2 x 10 x 2 B
    # and the sampler's 20 entries x 14 B of work, and x 44 B of sort (2 rows sorted at once): 1200.
    # The batch's attention mask for the step, 2 rows x 4 queries x 4 keys of one byte: 32.
    assert p.memory_by_phase[("gpu", "prefill")] == pytest.approx(944 + 64 + 448 + 1200 + 128 + 160 + 100 + 32)
    # decode: hidden 8 x 2; attention's 2 rows x (32 + 7 keys x 3 + 8) = 122 is below the head
    # step's 1200 too; two hidden copies 32; the step's attention bias, 2 rows x 7 keys padded to
    # 16, of 2 B: 64
    assert p.memory_by_phase[("gpu", "decode")] == pytest.approx(944 + 16 + 448 + 1200 + 32 + 160 + 100 + 64)
    assert p.peak_memory == {"gpu": pytest.approx(3076), "cpu": 0, "disk": 0}


def test_a_long_prompt_makes_attention_the_prefills_largest_transient(tiny_llama, round_hardware):
    p = CostModel(tiny_llama, Workload(32, 3), round_hardware).predict(offloaded(weights=GPU, cache=GPU))
    # Weights, cache and buffers are the same in both phases: the difference is the hidden states
    # (16 B x 2 sequences x 31 more tokens = 992) and the transients. Prefill: attention for 64
    # query rows over 32 keys (q,k,v and output 24 x 2 B, mask and bias 32 x 3 B, log-sum-exp 4 x
    # 4 B: 64 x 160 = 10240) over the MLP's 3 x 64 x 12 x 2 B = 4608 and the head step's 1200, and
    # two hidden copies 2048. Decode: the head step's 1200 (attention takes 2 x (48 + 35 x 3 + 16)
    # = 338), two hidden copies 64. The step's mask and rotary cos and sin (head_dim 2, fp16):
    # 2 x 32 x (32 + 8) = 2560 at the prefill; at the decode the bias, 35 keys padded to 48 of 2 B,
    # and the rotary tables: 2 x (96 + 8) = 208.
    difference = p.memory_by_phase[("gpu", "prefill")] - p.memory_by_phase[("gpu", "decode")]
    assert difference == pytest.approx(992 + 10240 + 2048 - 1200 - 64 + 2560 - 208)


def test_offloaded_activations_add_their_copies_to_the_compute(model):
    # Hidden states leave the GPU after each layer and come back before the next, on the compute
    # stream: half the rows through the CPU only, half on through the disk too.
    half_on_disk = offloaded(activations=TierFractions(0, 0.5, 0.5))
    p = model.predict(half_on_disk)
    # prefill: 8 B x 4 tokens x 2 sequences = 64 B out at 50 B/s and back at 100 B/s, and the disk
    # half (32 B) written at 5 B/s and read at 10 B/s
    assert p.prefill.compute["activation_copies"] == pytest.approx(64 * (1 / 50 + 1 / 100) + 32 * (1 / 5 + 1 / 10))
    # decode: one token, 16 B
    assert p.decode.compute["activation_copies"] == pytest.approx(16 * (1 / 50 + 1 / 100) + 8 * (1 / 5 + 1 / 10))
    plain = model.predict(offloaded())
    assert plain.prefill.compute["activation_copies"] == plain.decode.compute["activation_copies"] == 0
    assert p.prefill.compute_seconds == pytest.approx(plain.prefill.compute_seconds + 11.52)


def test_offloaded_memory_counts_double_buffers(model):
    p = model.predict(offloaded(activations=CPU))
    # weight buffers as the runtime counts them (a ring of two layers, the embedding's and the head's:
    # 944; no tensor is split with nothing on the GPU), two batches of hidden (8 x 4 x 2 each), and the new
    # cache (16 x 4 x 2) of this batch and of the three the host worker may still be copying, the
    # transients (1200 + 128), the sampler's state (100) and the step's mask (32), as with everything
    # on the GPU
    assert p.memory_by_phase[("gpu", "prefill")] == pytest.approx(944 + 128 + 4 * 128 + 1328 + 100 + 32)
    # decode: two hidden buffers (8 x 2 each), two batches of cache (16 x 7 x 2 each), transients
    # 1200 + 32, state 100, the step's bias 64 (2 rows x 7 keys padded to 16, of 2 B)
    assert p.memory_by_phase[("gpu", "decode")] == pytest.approx(944 + 32 + 448 + 1232 + 100 + 64)
    assert p.memory_by_phase[("cpu", "prefill")] == pytest.approx(944 + 448 + 64)
    assert p.peak_memory["cpu"] == pytest.approx(1456)


def test_llama_cache_is_sized_by_kv_heads_and_attention_by_query_heads(tiny_llama, round_hardware):
    model = CostModel(tiny_llama, Workload(4, 3), round_hardware)
    p = model.predict(offloaded())
    # 2 KV heads x 2 dims x (k, v) = 8 elements = 16 bytes, half of what 4 heads would need
    assert model.kv_bytes_per_token(model_frame(p)) == 16
    # attention FLOPs count all 4 query heads: 4 x 5.5 x 8 per sequence at 20 FLOP/s
    assert p.decode.compute["gpu_attention"] == pytest.approx(2 * max(176 / 20, 5.5 * 16 / 40))


def test_a_partial_last_block_wastes_its_empty_slots(tiny_opt, round_hardware):
    full = CostModel(tiny_opt, Workload(4, 3), round_hardware).predict(offloaded())
    partial = CostModel(tiny_opt, Workload(4, 3, num_prompts=3), round_hardware).predict(offloaded())
    assert partial.block_latency == pytest.approx(full.block_latency)
    assert partial.total_throughput == pytest.approx(full.total_throughput * 3 / 4)


def test_more_bandwidth_or_compute_never_slows_a_policy(tiny_opt, round_hardware):
    policy = offloaded(weights=TierFractions(0.2, 0.3, 0.5), cache=TierFractions(0.1, 0.5, 0.4),
                       activations=TierFractions(0.3, 0.3, 0.4), cpu_attention=True)
    base = CostModel(tiny_opt, Workload(4, 3), round_hardware).predict(policy).block_latency
    for name in ("cpu_to_gpu_bandwidth", "gpu_to_cpu_bandwidth", "disk_to_cpu_bandwidth",
                 "cpu_to_disk_bandwidth", "prefill_attention_flops", "decode_attention_flops",
                 "gpu_memory_bandwidth", "cpu_attention_flops"):
        faster = dataclasses.replace(round_hardware, **{name: getattr(round_hardware, name) * 3})
        assert CostModel(tiny_opt, Workload(4, 3), faster).predict(policy).block_latency <= base
    slower_host = dataclasses.replace(round_hardware, host_seconds_per_layer=1.0, host_seconds_per_step=1.0)
    assert CostModel(tiny_opt, Workload(4, 3), slower_host).predict(policy).block_latency >= base
    costly_calls = dataclasses.replace(round_hardware, cpu_attention_seconds_per_call=1.0)
    assert CostModel(tiny_opt, Workload(4, 3), costly_calls).predict(policy).block_latency >= base
    # Less contention for host memory, or a page cache, or more memory for it, never hurt either.
    calmer = dataclasses.replace(round_hardware, cpu_attention_share_under_copy=0.9)
    contended = dataclasses.replace(round_hardware, cpu_attention_share_under_copy=0.3)
    assert (CostModel(tiny_opt, Workload(4, 3), calmer).predict(policy).block_latency
            <= CostModel(tiny_opt, Workload(4, 3), contended).predict(policy).block_latency)
    previous = base
    for cpu_memory in (100, 3_000, 30_000, 300_000):
        cached = dataclasses.replace(round_hardware, disk_to_cpu_cached_bandwidth=30.0, cpu_memory=cpu_memory)
        latency = CostModel(tiny_opt, Workload(4, 3), cached).predict(policy).block_latency
        assert latency <= previous
        previous = latency
    assert previous < base


def test_bad_workload_is_a_user_error(tiny_opt, round_hardware):
    with pytest.raises(ConfigError, match="prompt len"):
        Workload(0, 3)
    with pytest.raises(ConfigError, match="prompts"):
        Workload(4, 3, num_prompts=0)
    with pytest.raises(ConfigError, match="needs 9 positions, but tiny-opt has 8"):
        CostModel(tiny_opt, Workload(6, 3), round_hardware)


# Budgets that differ: the prediction retires each GPU batch once its budgets are spent.

def test_one_budget_for_every_prompt_predicts_as_without_budgets(tiny_opt, round_hardware):
    flat = CostModel(tiny_opt, Workload(2, 6, 8), round_hardware)
    listed = CostModel(tiny_opt, Workload(2, 6, 8, gen_lens=(6,) * 8), round_hardware)
    for policy in (offloaded(num_gpu_batches=2), offloaded(gpu_batch_size=4, weights=GPU, cache=GPU)):
        assert listed.predict(policy).total_throughput == pytest.approx(flat.predict(policy).total_throughput)


def test_one_batch_a_block_runs_each_block_to_its_longest_budget(tiny_opt, round_hardware):
    """With one GPU batch a block, each block (the budgets in order) takes its prefill and a step
    for each token of its longest budget after the first, a step priced at the job's largest
    budget; the job's throughput counts the tokens the budgets generate."""
    budgets = (6, 2, 4, 3, 6, 5)  # blocks of 2 in order: (2, 3), (4, 5), (6, 6)
    policy = offloaded()
    got = CostModel(tiny_opt, Workload(2, 6, 6, gen_lens=budgets), round_hardware).predict(policy)
    top = CostModel(tiny_opt, Workload(2, 6, 6), round_hardware).predict(policy)
    step = top.decode_seconds / 5
    seconds = sum(top.prefill_seconds + (longest - 1) * step for longest in (3, 5, 6))
    assert got.total_throughput == pytest.approx(sum(budgets) / seconds)
    # Memory and one block's figures stay the largest budget's.
    assert got.peak_memory == top.peak_memory and got.block_latency == top.block_latency


def test_batches_that_finish_early_stop_costing_steps(tiny_opt, round_hardware):
    """Two GPU batches a block, one of budgets 2 and one of 6: after the first's last token a step
    costs one batch's, not two."""
    policy = offloaded(num_gpu_batches=2)
    budgets = (2, 2, 6, 6)
    got = CostModel(tiny_opt, Workload(2, 6, 4, gen_lens=budgets), round_hardware).predict(policy)
    both = CostModel(tiny_opt, Workload(2, 6, 4), round_hardware).predict(policy)
    one = CostModel(tiny_opt, Workload(2, 6, 2), round_hardware).predict(offloaded())
    step_both, step_one = (p.decode_seconds / 5 for p in (both, one))
    assert step_one < step_both
    seconds = both.prefill_seconds + 1 * step_both + 4 * step_one
    assert got.total_throughput == pytest.approx(sum(budgets) / seconds)
    assert got.total_throughput > sum(budgets) / both.block_latency  # faster than padding to 6


@pytest.mark.parametrize("budgets, says", [((3, 0), "integers >= 1"), ((3, 2, 1), "one per prompt"),
                                           ((4, 2), "none past the generation length"), ([3, 2], "a tuple")])
def test_bad_budgets_are_refused(budgets, says):
    with pytest.raises(ConfigError, match=f"generation budgets must be .*{says}"):
        Workload(4, 3, 2, gen_lens=budgets)
