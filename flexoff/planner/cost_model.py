"""The analytical cost model: time per layer and peak memory per tier for a policy.

It follows FlexGen's Appendix A.3 (``shared`` notation: l layers, s prompt, n generated, bls block
size, gbs GPU batch size; wg..hd the nine placement fractions) and extends it to:
- compression: stored bytes shrink to bits/8 plus per-group metadata, dequantization costs time;
- CPU attention: decode attention over the non-GPU cache runs on the CPU, so only the query and the
  attention output cross PCIe instead of the cache; each call pays a fixed cost besides its FLOPs
  (the profile's ``cpu_attention_seconds_per_call``);
- grouped-query attention and SwiGLU, through the element counts in ``sizes``;
- the prefill's element-wise kernels (norms, residual adds, activations), at the GPU's memory
  bandwidth over the bytes they move (``sizes.layer_elementwise_bytes_per_token``);
- host-memory contention: CPU attention slows down while the copy engine streams weights out of
  the same memory (the profile's ``cpu_attention_share_under_copy``);
- pinned host memory: the cache comes in slabs, and is priced at the slabs the runtime's own
  allocations take (``pinned_host_factors``), 2-4% over the bytes for OPT; the weights are pinned
  exactly, at whole pages;
- the page cache: disk data that fits in the host memory left free is read back at the cached
  rate, when the profile has one. The search plans with the cold rate, so that a policy it picks
  never relies on memory that other processes may take;
- the host: the runtime spends a fixed time issuing each layer of each GPU batch (launches and
  bookkeeping, measured by the profiler). The device works while the host issues the next layer,
  so this is one more stream in the max; it bounds small batches. With CPU attention it adds to
  the attention instead: the host finishes each batch's layer only once its attention is back.
  A GPU batch with cache rows on disk costs the host more per layer, however few the rows.

Every time and memory term is affine in the placement fractions but two, which are affine once the
cache's split is fixed: that last one, a step in the cache's disk share, and with CPU attention the
host's time for a batch's GPU rows, which joins the attention in proportion to its off-GPU share. The formulas take the fractions as
floats or as numpy arrays, so the search reads the LP's coefficients off the same code that
predicts a policy, and the two cannot drift apart.

Embedding and head weights are spread evenly over the layers: they are placed with the weight
fractions and streamed once per token like a layer's weights.
"""

from __future__ import annotations

import math

import numpy as np

import torch

from ..errors import ConfigError
from ..layout import (CPU_ATTENTION_ROWS, HOST_JOBS_IN_FLIGHT, block_host_requests, compressible,
                      dequantize_scratch_numel,
                      dequantizes_once, has_dense_mlp, head_step_bytes, largest_matrix_numel,
                      largest_stage_matrix_numel, registered_bytes, routes_first,
                      sampler_state_bytes, slab_bytes, sparse_mlp_bytes, step_state_bytes, weight_buffer_bytes,
                      weight_host_requests, working_bytes)
from ..models import stage_specs, stages
from ..models.moe import chunk_tokens
from .sparse_rate import expert_shape
from ..models.config import ModelConfig
from ..policy import TIERS, Policy, TierFractions
# The frame types are named here too: code plans and predicts through this module.
from .frame import Placement, PhaseBreakdown, PolicyFrame, Prediction, Workload  # noqa: F401
from .hardware import HardwareProfile
from .experts import expected_expert_bytes, expert_bytes_per_layer
from .sizes import (
    FP16_BYTES, bytes_per_element, embedding_matrix_numel, embedding_vector_numel, head_matmul_numel,
    layer_active_matmul_numel, layer_elementwise_bytes_per_token, layer_matrix_numel, layer_routed_matmul_numel,
    layer_vector_numel,
)

IO_TERMS = ("cpu_to_gpu", "gpu_to_cpu", "disk_to_cpu", "cpu_to_disk")
# Streams that run beside the compute: the four links, and the host issuing the work.
STREAM_TERMS = IO_TERMS + ("host",)
COMPUTE_TERMS = ("gpu_matmul", "gpu_attention", "gpu_elementwise", "dequantize", "cpu_attention")
PHASES = ("prefill", "decode")
FP32_BYTES = 4


class CostModel:
    """Predicts time and memory of policies for one model, workload and machine."""

    def __init__(self, config: ModelConfig, workload: Workload, hardware: HardwareProfile,
                 route_first: bool | None = None):
        """``route_first``: a sparse layer's experts are loaded after its router ran, only those its
        block's tokens chose (expected under uniform routing), or all of them a stage ahead; None:
        as the runtime does for the frame (``layout.routes_first``)."""
        positions = workload.prompt_len + workload.gen_len
        if positions > config.max_positions:
            raise ConfigError(f"prompt {workload.prompt_len} + generate {workload.gen_len} needs {positions} "
                              f"positions, but {config.name} has {config.max_positions}")
        self.config, self.workload, self.hardware, self.route_first = config, workload, hardware, route_first
        c, layers = config, config.num_layers
        self.num_layers = layers
        self.hidden = c.hidden_size
        self.matrix_numel = layer_matrix_numel(c) + embedding_matrix_numel(c) / layers
        self.vector_numel = layer_vector_numel(c) + embedding_vector_numel(c) / layers
        # A token multiplies through its own experts only; each expert's matmul has the rows routed
        # to it, a k / E share of the batch's on average (1 for a dense model).
        self.layer_matmul_numel = layer_active_matmul_numel(c)
        self.routed_matmul_numel = layer_routed_matmul_numel(c)
        self.rows_per_expert = c.experts_per_token / c.num_experts if c.num_experts else 1.0
        self.chunk_tokens = chunk_tokens(c) if c.num_experts else 0
        self.expert_shape = expert_shape(c)
        self.head_matmul_numel_per_layer = head_matmul_numel(c) / layers
        # The tensor a weight fraction splits is assembled whole (see weight_buffer_bytes). A MoE
        # layer's stacked experts are most of it, so at a small GPU share the cut falls inside them
        # with nearly all the layer's GPU share in front: bounded by the largest stage's matrices.
        self.split_numel = largest_stage_matrix_numel(c) if c.num_experts else largest_matrix_numel(c)
        # A split exact matrix (a stored model's embedding and head stay uncompressed) is assembled
        # whole too, at 16 bits.
        self.exact_split_numel = max((spec.numel for stage in stages(c) if not stage.is_layer
                                      for spec in stage_specs(c, stage)
                                      if len(spec.shape) >= 2 and not compressible(spec)), default=0)
        self.kv_numel = c.kv_elements_per_token_per_layer
        self.elementwise_bytes = layer_elementwise_bytes_per_token(c)
        self.query_width = c.num_heads * c.head_dim
        self.kv_width = c.num_kv_heads * c.head_dim
        self.mlp_buffers = 2 if c.family == "opt" else 3  # fc1 out; or gate, up and their product
        self.dense_mlp = has_dense_mlp(c)
        # The host's time to issue one GPU batch's layer: a Llama-family layer and a sparse MLP
        # issue more than an OPT layer.
        sparse_share = sum(map(c.sparse_layer, range(layers))) / layers
        self.host_seconds_per_layer = (hardware.host_seconds_per_layer
                                       + (hardware.host_seconds_per_llama_layer if c.family == "llama" else 0.0)
                                       + sparse_share * hardware.host_seconds_per_sparse_layer)
        self._buffer_bytes: dict = {}
        self._pinned_factors: dict = {}

    # ---- sizes under a frame

    def weight_bytes_per_layer(self, frame: PolicyFrame) -> float:
        return self.matrix_numel * bytes_per_element(frame.compress_weight) + self.vector_numel * FP16_BYTES

    def moved_weight_bytes(self, frame: PolicyFrame, tokens: int) -> float:
        """Bytes of a layer's weights loaded for a pass of ``tokens`` tokens: all of them, or with
        route-first loading all but the experts the tokens are expected to leave untouched."""
        weights = self.weight_bytes_per_layer(frame)
        route_first = self.route_first
        if route_first is None:
            route_first = routes_first(self.config, frame.gpu_batch_size, frame.num_gpu_batches)
        if not route_first:
            return weights
        return (weights - expert_bytes_per_layer(self.config, frame.compress_weight)
                + expected_expert_bytes(self.config, frame.compress_weight, tokens))

    def matmul_seconds(self, tokens: int, head_tokens: int, rows: int) -> float:
        """Seconds of one layer's matmuls over ``tokens`` tokens, and of its share of the head's over
        ``head_tokens``, in GPU batches of ``rows`` rows; a routed expert's matmul has its share of
        the rows of one chunk of tokens (models.moe.chunk_tokens), and runs at the rate the profile
        measured for the experts' shape at that chunk, or else at the dense rate of those rows."""
        shared = self.layer_matmul_numel - self.routed_matmul_numel
        hw = self.hardware
        seconds = 2 * (shared * tokens + self.head_matmul_numel_per_layer * head_tokens) / hw.matmul_flops_at(rows)
        if self.routed_matmul_numel:
            together = min(rows, self.chunk_tokens)
            rate = (hw.sparse_mlp_flops_at(self.expert_shape, together)
                    or hw.matmul_flops_at(together * self.rows_per_expert))
            seconds += 2 * self.routed_matmul_numel * tokens / rate
        return seconds

    def kv_bytes_per_token(self, frame: PolicyFrame) -> float:
        """Stored KV bytes of one token in one layer."""
        return self.kv_numel * bytes_per_element(frame.compress_cache)

    def weight_buffer_bytes(self, frame: PolicyFrame, wg):
        """GPU bytes of the buffers the runtime assembles streamed weights in, affine in ``wg``.

        The layout's figure with every weight off the GPU (a layer's ring of two, plus the
        embedding's and head's buffers, at stored size) scales with the share off the GPU.
        The one tensor a fraction splits is assembled whole: up to two of the largest matrix more
        (of a MoE model, the largest stage's), priced as ``wg`` x that, which is exact with nothing
        on the GPU, close for a small share off it (where it matters), and two matrices too many
        with everything on it. Compressed
        weights add their dequantization scratch: one matrix, or one stage where the batches share
        its dequantization (in the layout's figure)."""
        key = (frame.compress_weight, dequantizes_once(frame))
        if key not in self._buffer_bytes:
            off_gpu = Policy(1, 1, TierFractions(0, 1, 0), TierFractions(1, 0, 0), TierFractions(1, 0, 0),
                             compress_weight=frame.compress_weight)
            streamed = float(weight_buffer_bytes(self.config, off_gpu, torch.float16)
                             - dequantize_scratch_numel(self.config, frame.compress_weight) * FP16_BYTES)
            scratch = float(dequantize_scratch_numel(self.config, *key) * FP16_BYTES)
            split = max(self.split_numel * bytes_per_element(frame.compress_weight),
                        self.exact_split_numel * FP16_BYTES)
            self._buffer_bytes[key] = (streamed, scratch, 2 * split)
        streamed, scratch, split = self._buffer_bytes[key]
        return (1 - wg) * streamed + wg * split + scratch

    def pinned_host_factors(self, frame: PolicyFrame) -> tuple[float, float]:
        """Host bytes reserved per byte stored, for the weights and for the cache, as the runtime
        pins its own allocations with everything of the kind on the CPU: the weights in whole pages
        (a factor of 1 but for the smallest models), the cache in slabs whose unused ends are taken
        all the same. 1 where host memory is not pinned."""
        if not self.hardware.pinned_host_memory:
            return 1.0, 1.0
        on_cpu = Policy(frame.gpu_batch_size, 1, TierFractions(0, 1, 0), TierFractions(0, 1, 0),
                        TierFractions(1, 0, 0), compress_weight=frame.compress_weight,
                        compress_cache=frame.compress_cache)
        w = self.workload

        def factor(key, requests, reserved) -> float:
            # The weights' factor depends on their compression alone, the cache's on the batch too.
            if key not in self._pinned_factors:
                listed = requests()
                self._pinned_factors[key] = reserved(listed) / sum(listed)
            return self._pinned_factors[key]

        return (factor(("weights", frame.compress_weight),
                       lambda: weight_host_requests(self.config, on_cpu, torch.float16), registered_bytes),
                factor(("cache", frame.gpu_batch_size, frame.compress_cache),
                       lambda: block_host_requests(self.config, on_cpu, w.prompt_len, w.prompt_len + w.gen_len,
                                                   FP16_BYTES), slab_bytes))

    # ---- time

    def disk_rows_host_seconds(self, frame: PolicyFrame) -> float:
        """The host's extra seconds per decode layer where each GPU batch has cache rows on disk: a
        cost per batch, whatever the rows' share (their files' reads and writes, and the helper
        threads' turns at the interpreter), so not affine in the placement. ``phase_terms`` charges
        it where the disk share is above zero; the search's LP reads it exactly once the cache's
        split is fixed."""
        return frame.num_gpu_batches * self.hardware.host_seconds_per_disk_rows_layer

    def phase_terms(self, frame: PolicyFrame, p: Placement, disk_read_bandwidth: float | None = None) -> dict:
        """{phase: (streams, compute sub-terms)}, each in seconds per layer, affine in ``p``.

        ``disk_read_bandwidth`` overrides the profile's cold disk read rate (page-cache hits).
        """
        hw, w = self.hardware, self.workload
        disk_read = disk_read_bandwidth or hw.disk_to_cpu_bandwidth
        s, n = w.prompt_len, w.gen_len
        gbs, nb, bls = frame.gpu_batch_size, frame.num_gpu_batches, frame.block_size
        # Weight bytes loaded per layer: a prefill pass sees the block's s x bls tokens, a decode step bls.
        W_prefill, W_decode = self.moved_weight_bytes(frame, s * bls), self.moved_weight_bytes(frame, bls)
        kv = self.kv_bytes_per_token(frame)
        kv16 = self.kv_numel * FP16_BYTES
        act = FP16_BYTES * self.hidden  # one token's hidden state
        s_avg = s + n / 2  # mean cache length over the decode steps (A.3)
        w_off, c_off, h_off = p.wc + p.wd, p.cc + p.cd, p.hc + p.hd
        cw, cc, cpu_att = frame.compress_weight is not None, frame.compress_cache is not None, frame.cpu_attention
        dequantized = 1 if dequantizes_once(frame) else nb  # passes over a stage's compressed weights
        # Per layer: every GPU batch's layer, and its share of the step's embedding, head and sampling.
        host = nb * (self.host_seconds_per_layer + hw.host_seconds_per_step / self.num_layers) + 0.0 * w_off

        def activation_copies(tokens: int):
            """Seconds per layer of moving offloaded hidden states out and back. The runtime does it on
            the compute stream, between one batch's layer and the next (disk rows through the host,
            waiting), so it adds to the compute instead of overlapping it."""
            size = act * tokens * bls
            return (h_off * size * (1 / hw.gpu_to_cpu_bandwidth + 1 / hw.cpu_to_gpu_bandwidth)
                    + p.hd * size * (1 / hw.cpu_to_disk_bandwidth + 1 / disk_read))

        prefill_io = {
            "cpu_to_gpu": (w_off * W_prefill + h_off * act * s * bls) / hw.cpu_to_gpu_bandwidth,
            "gpu_to_cpu": c_off * kv * s * bls / hw.gtoc_cache_bandwidth
            + h_off * act * s * bls / hw.gpu_to_cpu_bandwidth,
            "disk_to_cpu": (p.wd * W_prefill + p.hd * act * s * bls) / disk_read,
            "cpu_to_disk": p.cd * kv * s * bls / hw.ctod_cache_bandwidth
            + p.hd * act * s * bls / hw.cpu_to_disk_bandwidth,
            "host": host,
        }
        # Prefill attention always runs on the GPU: the cache is produced there.
        prefill_compute = {
            "gpu_matmul": self.matmul_seconds(s * bls, bls, gbs * s),
            "gpu_attention": 4 * s * s * self.query_width * bls / hw.prefill_attention_flops,
            # Norms, residual adds and activations stream every prompt token through GPU memory
            # (about 4% of an OPT-30B prefill layer on an H200); a decode step's are launches.
            "gpu_elementwise": s * bls * self.elementwise_bytes / hw.gpu_memory_bandwidth,
            # Weights are dequantized once or for every GPU batch; the new cache is quantized once.
            "dequantize": (dequantized * self.matrix_numel / hw.gpu_dequant_throughput if cw else 0.0)
            + (bls * s * self.kv_numel / hw.kv_quant_throughput if cc else 0.0),
            "cpu_attention": 0.0 * c_off,
            "activation_copies": activation_copies(s),
        }

        shipped = 0.0 * c_off if cpu_att else c_off  # off-GPU cache that travels to be attended on the GPU
        gpu_att = p.cg + shipped  # share of decode attention on the GPU
        cpu_share = c_off if cpu_att else 0.0 * c_off
        disk_cache_read = p.cd * kv * s_avg * bls  # bytes of the cache's disk rows a decode layer reads
        # The host issues more per batch where the cache travels or attention reads a compressed
        # one, and per pass over compressed weights (as measured: rows off the GPU in proportion).
        decode_host = (host + nb * (shipped * hw.host_seconds_per_travelling_layer
                                    + (gpu_att * hw.host_seconds_per_compressed_cache_layer if cc else 0.0 * gpu_att))
                       + (dequantized * hw.host_seconds_per_compressed_weight_layer if cw else 0.0)
                       + self.disk_rows_host_seconds(frame) * has_any(p.cd)
                       # Disk rows' reads hold up the batches they feed, a layer ahead at most: measured
                       # in series with the host's work, at about the disk's cold read rate although the
                       # page cache serves them, not beside it as another stream.
                       + disk_cache_read / hw.disk_to_cpu_bandwidth)
        decode_io = {
            "cpu_to_gpu": (w_off * W_decode + h_off * act * bls
                           + (c_off * act * bls if cpu_att else c_off * kv * s_avg * bls))
            / hw.cpu_to_gpu_bandwidth,
            # New keys and values go to the cache's home; with CPU attention the query goes too.
            "gpu_to_cpu": c_off * kv * bls / hw.gtoc_cache_bandwidth
            + (h_off * act * bls + (c_off * act * bls if cpu_att else 0.0)) / hw.gpu_to_cpu_bandwidth,
            "disk_to_cpu": (p.wd * W_decode + p.hd * act * bls + disk_cache_read) / disk_read,
            "cpu_to_disk": p.cd * kv * bls / hw.ctod_cache_bandwidth + p.hd * act * bls / hw.cpu_to_disk_bandwidth,
            "host": decode_host,
        }
        attention_flops = 4 * s_avg * self.query_width  # per sequence: q.K^T and p.V
        gpu_attention_seconds = max(attention_flops / hw.decode_attention_flops, s_avg * kv16 / hw.gpu_memory_bandwidth)
        cpu_attention_seconds = attention_flops / hw.cpu_attention_flops
        if cc:
            cpu_attention_seconds += s_avg * self.kv_numel / hw.cpu_dequant_throughput
        # Each GPU batch attends in calls of up to CPU_ATTENTION_ROWS sequences, each with a fixed cost.
        cpu_attention_calls = nb * math.ceil(gbs / CPU_ATTENTION_ROWS) * hw.cpu_attention_seconds_per_call
        decode_compute = {
            "gpu_matmul": self.matmul_seconds(bls, bls, gbs),
            "gpu_attention": gpu_att * bls * gpu_attention_seconds,
            "dequantize": ((dequantized * self.matrix_numel / hw.gpu_dequant_throughput) if cw else 0.0)
            + ((gpu_att * bls * s_avg * self.kv_numel / hw.kv_dequant_throughput) if cc else 0.0 * gpu_att),
            # The host joins CPU attention's time instead of running beside it: it finishes each
            # batch's layer only once that batch's attention is back, and the worker thread waits for
            # the interpreter while the host issues work.
            "cpu_attention": cpu_share * (bls * cpu_attention_seconds + cpu_attention_calls + decode_host),
            "activation_copies": activation_copies(1),
        }
        if cpu_att:
            # While the weights stream, CPU attention runs at a share f of its speed: it finishes
            # (1 - f) x the copy time later than alone, unless the copy is the longer anyway (the
            # phase's max over the I/O terms covers that case).
            weight_copy = w_off * W_decode / hw.cpu_to_gpu_bandwidth
            decode_compute["cpu_attention"] = (decode_compute["cpu_attention"]
                                               + (1 - hw.cpu_attention_share_under_copy) * weight_copy)
        return {"prefill": (prefill_io, prefill_compute), "decode": (decode_io, decode_compute)}

    @staticmethod
    def phase_seconds(io: dict, compute: dict, overlap: bool):
        """A phase's seconds per layer: the slowest stream with overlap, all of them without."""
        compute_total = sum(compute.values())
        if overlap:
            result = compute_total
            for value in io.values():
                result = _maximum(result, value)
            return result
        return compute_total + sum(io.values())

    # ---- memory

    def memory_terms(self, frame: PolicyFrame, p: Placement) -> dict:
        """{(tier, phase): peak bytes}, affine in ``p``."""
        w, c = self.workload, self.config
        s, n, layers = w.prompt_len, w.gen_len, self.num_layers
        gbs, bls = frame.gpu_batch_size, frame.block_size
        W = self.weight_bytes_per_layer(frame)
        kv = self.kv_bytes_per_token(frame)
        kv16 = self.kv_numel * FP16_BYTES
        act = FP16_BYTES * self.hidden
        s_max = s + n  # the cache is sized for the whole sequence (A.3)
        weights_total = W * layers
        kv_total = kv * s_max * bls * layers
        c_off = p.cc + p.cd
        gpu_att = p.cg + (0.0 if frame.cpu_attention else c_off)
        # Held through both phases: the weight buffers and the block's token samplers' state.
        buffers = self.weight_buffer_bytes(frame, p.wg) + sampler_state_bytes(bls, c.vocab_size)
        # The block's cache workspace (layout.workspace_layout): a ring of two for travelling cache,
        # and with a compressed cache one batch's decompressed keys and values.
        workspace = ((0.0 * c_off if frame.cpu_attention else 2 * c_off * kv * s_max * gbs)
                     + (gpu_att * kv16 * s_max * gbs if frame.compress_cache is not None else 0.0 * gpu_att))

        def intermediates(rows: int, keys: int) -> float:
            """Largest transient of one GPU batch: attention, the MLP's working memory or the head step (the
            last position's logits and the sampler's work on them, as the layout counts it)."""
            # The memory-efficient kernel keeps no scores: q, k, v and the output, the boolean mask
            # and its fp16 bias over the keys, and a float32 log-sum-exp per query and head.
            attention = rows * ((2 * self.query_width + 2 * self.kv_width) * FP16_BYTES
                                + keys * (1 + FP16_BYTES) + c.num_heads * FP32_BYTES)
            # A MoE model's sparse layers (experts, routing) and its dense ones, if any, differ.
            dense = self.mlp_buffers * rows * c.intermediate_size * FP16_BYTES if self.dense_mlp else 0
            mlp = max(dense, sparse_mlp_bytes(c, rows, FP16_BYTES))
            logits = head_step_bytes(gbs, c.vocab_size, FP16_BYTES)
            hidden_copies = 2 * rows * act  # normalized input and residual
            transient = max(attention, mlp, logits) + hidden_copies
            if not c.num_experts:
                return transient
            # A MoE model's figure has no dense MLP's three buffers to spare: it never goes below
            # the layout's working memory, by which the runtime checks a job.
            return max(transient, working_bytes(c, rows, gbs, FP16_BYTES))

        # Buffers of off-GPU data come in pairs: the batch computed now and the one being loaded.
        # The workspace is the block's, allocated before its prefill; a dense model's prefill
        # figure leaves it out, as its policies were searched and calibrated with (the MLP's
        # three buffers cover it), a MoE model's counts it.
        prefill_workspace = workspace if c.num_experts else 0.0 * c_off
        gpu_prefill = (p.wg * weights_total + p.hg * act * s * bls + p.cg * kv_total
                       + buffers
                       + 2 * (1 - p.hg) * act * s * gbs
                       # new cache waiting to be stored, in the compute dtype whatever the stored
                       # format: this batch's, and the host worker's queue
                       + (1 + HOST_JOBS_IN_FLIGHT) * (1 - p.cg) * kv16 * s * gbs
                       + prefill_workspace
                       + frame.num_gpu_batches * step_state_bytes(c, gbs, s, s, FP16_BYTES)
                       + intermediates(gbs * s, s))
        gpu_decode = (p.wg * weights_total + p.hg * act * bls + p.cg * kv_total
                      + buffers
                      + 2 * (1 - p.hg) * act * gbs
                      + workspace
                      + frame.num_gpu_batches * step_state_bytes(c, gbs, 1, s_max, FP16_BYTES, decode=True)
                      + intermediates(gbs, s_max))
        # The CPU stages what moves between disk and GPU.
        weight_factor, cache_factor = self.pinned_host_factors(frame)
        cpu_home = p.wc * weights_total * weight_factor + p.cc * kv_total * cache_factor
        cpu_prefill = (cpu_home + p.hc * act * s * bls + 2 * p.wd * W
                       + 2 * p.hd * act * s * gbs + 2 * p.cd * kv * s * gbs)
        cpu_workspace = 0.0 * c_off
        if frame.cpu_attention:
            # fp32 copy of one batch's keys and values, and its scores
            cpu_workspace = c_off * gbs * s_max * (self.kv_numel * FP32_BYTES + 2 * c.num_heads * FP32_BYTES)
        cpu_decode = (cpu_home + p.hc * act * bls + 2 * p.wd * W
                      + 2 * p.hd * act * gbs + 2 * p.cd * kv * s_max * gbs + cpu_workspace)
        disk = p.wd * weights_total + p.hd * act * s * bls + p.cd * kv_total
        return {
            ("gpu", "prefill"): gpu_prefill, ("gpu", "decode"): gpu_decode,
            ("cpu", "prefill"): cpu_prefill, ("cpu", "decode"): cpu_decode,
            ("disk", "prefill"): disk, ("disk", "decode"): disk,
        }

    def capacities(self) -> dict:
        return {t: self.hardware.capacity(t) for t in TIERS}

    # ---- the whole prediction

    def block_seconds(self, prefill_per_layer, decode_per_layer):
        """Latency of one block: prefill every layer once, then gen_len - 1 decode steps (A.3)."""
        layers, n = self.num_layers, self.workload.gen_len
        return layers * prefill_per_layer + layers * (n - 1) * decode_per_layer

    def useful_share(self, block_size: int) -> float:
        """Share of a block's sequences that are real prompts, averaged over the whole job."""
        total = self.workload.num_prompts
        if total is None:
            return 1.0
        blocks = math.ceil(total / block_size)
        return total / (blocks * block_size)

    def predict(self, policy: Policy) -> Prediction:
        frame, p = PolicyFrame.of(policy), Placement.of(policy, self.config)
        memory = {k: float(v) for k, v in self.memory_terms(frame, p).items()}
        peak = {t: max(memory[(t, ph)] for ph in PHASES) for t in TIERS}
        disk_cached = self.disk_reads_cached(peak)
        terms = self.phase_terms(frame, p, self.hardware.disk_to_cpu_cached_bandwidth if disk_cached else None)
        phases = {}
        for phase in PHASES:
            io, compute = terms[phase]
            seconds = float(self.phase_seconds(io, compute, frame.overlap))
            phases[phase] = PhaseBreakdown(phase, {k: float(v) for k, v in io.items()},
                                           {k: float(v) for k, v in compute.items()}, seconds,
                                           _bounding_term(io, compute, frame.overlap))
        layers, w = self.num_layers, self.workload
        bls = frame.block_size
        prefill_seconds = layers * phases["prefill"].seconds_per_layer
        decode_seconds = layers * (w.gen_len - 1) * phases["decode"].seconds_per_layer
        latency = prefill_seconds + decode_seconds
        share = self.useful_share(bls)
        return Prediction(
            policy=policy, workload=w, prefill=phases["prefill"], decode=phases["decode"],
            prefill_seconds=prefill_seconds, decode_seconds=decode_seconds, block_latency=latency,
            total_throughput=share * bls * w.gen_len / latency,
            prefill_throughput=share * bls * w.prompt_len / prefill_seconds,
            decode_throughput=(share * bls * (w.gen_len - 1) / decode_seconds) if w.gen_len > 1 else 0.0,
            peak_memory=peak,
            capacity=self.capacities(),
            memory_by_phase=memory,
            disk_reads_cached=disk_cached,
        )

    def disk_reads_cached(self, peak: dict) -> bool:
        """Whether the page cache can hold everything on disk: the host memory flexoff leaves free
        (all of RAM less its own peak, without the planning headroom) holds the disk's bytes."""
        hw = self.hardware
        if hw.disk_to_cpu_cached_bandwidth is None or peak["disk"] <= 0:
            return False
        return peak["disk"] <= hw.cpu_memory - peak["cpu"]


def has_any(share):
    """1 where a share of a placement is above zero, else 0 (elementwise over arrays of placements)."""
    return np.where(np.asarray(share) > 0, 1.0, 0.0) if isinstance(share, np.ndarray) else float(share > 0)


def _maximum(a, b):
    """max() that also works elementwise on numpy arrays."""
    if isinstance(a, float) and isinstance(b, float):
        return max(a, b)
    import numpy as np

    return np.maximum(a, b)


def _bounding_term(io: dict, compute: dict, overlap: bool) -> str:
    compute_total = sum(compute.values())
    largest_compute = max(compute, key=compute.get)
    if not overlap:
        return "no overlap (sum of all terms)"
    largest_io = max(io, key=io.get)
    if io[largest_io] > compute_total:
        return largest_io
    return f"compute ({largest_compute})"
