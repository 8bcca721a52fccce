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
- shared prompt prefixes (``Workload.shared_prefix``, P tokens, each shared by ``prefix_group``
  prompts): each GPU batch prefills, stores and moves each of its G prefixes once, as one row
  (``flexoff.prefixes``), so the prefill's tokens, its cache's and activations' bytes and a decode
  step's cache bytes are each smaller by the P tokens of the other gbs - G rows (``shared_tokens``),
  and prefill attention by those rows' P queries. Decode attention is
  bound by its scan of the cache, whose measured rate is a scan's, so a prefix scanned once per
  batch counts once there too. Each such term is written as today's less the share, so that with no
  prefix every figure is today's to the bit;
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
from dataclasses import replace
from typing import NamedTuple

import numpy as np

from ..errors import ConfigError
from ..layout import (CPU_ATTENTION_ROWS, compressible, dequantizes_once, has_dense_mlp, keeps_cache,
                      largest_matrix_numel, largest_stage_matrix_numel, routes_first)
from ..models import stage_specs, stages
from ..models.moe import chunk_tokens
from .sparse_rate import expert_shape
from ..models.config import ModelConfig
from ..policy import TIERS, Policy
# The frame types are named here too: code plans and predicts through this module.
from .frame import Placement, PhaseBreakdown, PolicyFrame, Prediction, Workload  # noqa: F401
from .hardware import HardwareProfile
from .experts import expected_expert_bytes, expert_bytes_per_layer
from .memory import MemoryTerms
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


class _Shares(NamedTuple):
    """What both phases' time terms of one frame and placement read."""

    frame: PolicyFrame
    p: Placement
    disk_read: float  # bytes per second read back from disk
    kv: float  # stored KV bytes of one token in one layer
    act: int  # bytes of one token's hidden state
    w_off: object  # the weights' share off the GPU
    c_off: object  # the cache's
    h_off: object  # the activations'
    dequantized: int  # passes over a stage's compressed weights
    host: float  # the host's seconds per layer issuing the block's GPU batches
    shared: int  # token positions of a block its shared prefixes save (CostModel.shared_tokens)


class CostModel(MemoryTerms):
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
        # A block that generates one token keeps no cache (layout.keeps_cache): none of it is
        # stored, moved, quantized or held, which every cache term reads through this count.
        self.kept_kv_numel = self.kv_numel if keeps_cache(workload.gen_len) else 0
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

    def caches_per_batch(self, frame: PolicyFrame) -> int:
        """The caches a GPU batch's decode layer attends over: its rows', and its prefixes' where
        its rows share any."""
        return 2 if self.workload.batch_prefix(frame.gpu_batch_size) else 1

    def shared_tokens(self, frame: PolicyFrame) -> int:
        """Token positions of one block that its GPU batches' shared prefixes save: each batch holds
        each of its G prefixes once instead of in every row, so gbs - G copies of it per batch."""
        return frame.num_gpu_batches * self.workload.batch_saved_tokens(frame.gpu_batch_size)

    def prefill_tokens(self, frame: PolicyFrame) -> int:
        """Tokens one block's prefill runs its matmuls over (``Workload.block_prefill_tokens``)."""
        return self.workload.block_prefill_tokens(frame.gpu_batch_size, frame.num_gpu_batches)

    def kv_bytes_per_token(self, frame: PolicyFrame) -> float:
        """Stored KV bytes of one token in one layer (0 where the block keeps no cache)."""
        return self.kept_kv_numel * bytes_per_element(frame.compress_cache)

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
        hw, nb = self.hardware, frame.num_gpu_batches
        # Per layer: every GPU batch's layer, and its share of the step's embedding, head and sampling.
        host = nb * (self.host_seconds_per_layer + hw.host_seconds_per_step / self.num_layers)
        q = _Shares(frame, p, disk_read_bandwidth or hw.disk_to_cpu_bandwidth, self.kv_bytes_per_token(frame),
                    FP16_BYTES * self.hidden, p.wc + p.wd, p.cc + p.cd, p.hc + p.hd,
                    1 if dequantizes_once(frame) else nb, host, self.shared_tokens(frame))
        return {"prefill": (self._prefill_io(q), self._prefill_compute(q)), "decode": self._decode_terms(q)}

    def _activation_copies(self, q: _Shares, tokens: int):
        """Seconds per layer of moving offloaded hidden states out and back, ``tokens`` of them in a
        block. The runtime does it on the compute stream, between one batch's layer and the next
        (disk rows through the host, waiting), so it adds to the compute instead of overlapping it."""
        hw, size = self.hardware, q.act * tokens
        return (q.h_off * size * (1 / hw.gpu_to_cpu_bandwidth + 1 / hw.cpu_to_gpu_bandwidth)
                + q.p.hd * size * (1 / hw.cpu_to_disk_bandwidth + 1 / q.disk_read))

    def _prefill_io(self, q: _Shares) -> dict:
        hw, p, act, kv = self.hardware, q.p, q.act, q.kv
        s, bls = self.workload.prompt_len, q.frame.block_size

        def prompts(share):
            # ``share`` per token of the block's s x bls, less the tokens shared prefixes save
            return share * s * bls - share * q.shared

        # Weight bytes loaded per layer: a prefill pass sees the tokens the block computes.
        weights = self.moved_weight_bytes(q.frame, self.prefill_tokens(q.frame))
        return {
            "cpu_to_gpu": (q.w_off * weights + prompts(q.h_off * act)) / hw.cpu_to_gpu_bandwidth,
            "gpu_to_cpu": prompts(q.c_off * kv) / hw.gtoc_cache_bandwidth
            + prompts(q.h_off * act) / hw.gpu_to_cpu_bandwidth,
            "disk_to_cpu": (p.wd * weights + prompts(p.hd * act)) / q.disk_read,
            "cpu_to_disk": prompts(p.cd * kv) / hw.ctod_cache_bandwidth
            + prompts(p.hd * act) / hw.cpu_to_disk_bandwidth,
            "host": q.host,
        }

    def _prefill_compute(self, q: _Shares) -> dict:
        """Prefill attention always runs on the GPU: the cache is produced there."""
        hw, frame = self.hardware, q.frame
        s, gbs, bls, nb = self.workload.prompt_len, frame.gpu_batch_size, frame.block_size, frame.num_gpu_batches
        prefix, groups = self.workload.batch_prefix(gbs), self.workload.prefix_rows(gbs)
        tokens = self.prefill_tokens(frame)
        # The cache's new slots and the activations stay padded (``runtime.packed_prefill``).
        positions = self.workload.block_prefill_positions(gbs, nb)
        # Every query attends over s keys (A.3); a batch's G shared prefixes are G rows' P queries
        # over their P keys instead of every row's P queries over s.
        queries_saved = nb * prefix * (gbs * s - groups * prefix)
        return {
            "gpu_matmul": self.matmul_seconds(tokens, bls, tokens // nb),
            "gpu_attention": (4 * s * s * self.query_width * bls - 4 * self.query_width * queries_saved)
            / hw.prefill_attention_flops,
            # Norms, residual adds and activations stream every prompt token through GPU memory
            # (about 4% of an OPT-30B prefill layer on an H200); a decode step's are launches.
            "gpu_elementwise": tokens * self.elementwise_bytes / hw.gpu_memory_bandwidth,
            # Weights are dequantized once or for every GPU batch; the new cache is quantized once.
            "dequantize": (q.dequantized * self.matrix_numel / hw.gpu_dequant_throughput
                           if frame.compress_weight is not None else 0.0)
            + (positions * self.kept_kv_numel / hw.kv_quant_throughput if frame.compress_cache is not None else 0.0),
            "cpu_attention": 0.0,
            "activation_copies": self._activation_copies(q, positions),
        }

    def _decode_terms(self, q: _Shares) -> tuple[dict, dict]:
        hw, p, frame, act, kv, c_off = self.hardware, q.p, q.frame, q.act, q.kv, q.c_off
        bls, cpu_att = frame.block_size, frame.cpu_attention
        s_avg = self.workload.prompt_len + self.workload.gen_len / 2  # mean cache length over the decode steps (A.3)
        weights = self.moved_weight_bytes(frame, bls)  # a decode step sees the block's bls tokens
        shipped = 0.0 if cpu_att else c_off  # off-GPU cache that travels to be attended on the GPU
        gpu_att = p.cg + shipped  # share of decode attention on the GPU
        # bytes of the cache's disk rows a decode layer reads, each batch's prefix once
        disk_cache_read = p.cd * kv * s_avg * bls - p.cd * kv * q.shared
        host = self._decode_host(q, shipped, gpu_att, disk_cache_read)
        io = {
            "cpu_to_gpu": (q.w_off * weights + q.h_off * act * bls
                           + (c_off * act * bls if cpu_att else c_off * kv * s_avg * bls - c_off * kv * q.shared))
            / hw.cpu_to_gpu_bandwidth,
            # New keys and values go to the cache's home; with CPU attention the query goes too.
            "gpu_to_cpu": c_off * kv * bls / hw.gtoc_cache_bandwidth
            + (q.h_off * act * bls + (c_off * act * bls if cpu_att else 0.0)) / hw.gpu_to_cpu_bandwidth,
            "disk_to_cpu": (p.wd * weights + p.hd * act * bls + disk_cache_read) / q.disk_read,
            "cpu_to_disk": p.cd * kv * bls / hw.ctod_cache_bandwidth + p.hd * act * bls / hw.cpu_to_disk_bandwidth,
            "host": host,
        }
        return io, self._decode_compute(q, gpu_att, host, q.w_off * weights / hw.cpu_to_gpu_bandwidth)

    def _decode_host(self, q: _Shares, shipped, gpu_att, disk_cache_read):
        """The host's seconds per decode layer. It issues more per batch where the cache travels or
        attention reads a compressed one, and per pass over compressed weights (as measured: rows
        off the GPU in proportion). A batch's shared prefixes are a second cache of its own, which
        the host issues the same work for."""
        hw, frame = self.hardware, q.frame
        compressed_cache = (gpu_att * hw.host_seconds_per_compressed_cache_layer
                            if frame.compress_cache is not None else 0.0)
        caches = self.caches_per_batch(frame)
        return (q.host + frame.num_gpu_batches * caches * (shipped * hw.host_seconds_per_travelling_layer
                                                           + compressed_cache)
                + (q.dequantized * hw.host_seconds_per_compressed_weight_layer
                   if frame.compress_weight is not None else 0.0)
                + self.disk_rows_host_seconds(frame) * has_any(q.p.cd)
                # Disk rows' reads hold up the batches they feed, a layer ahead at most: measured
                # in series with the host's work, at about the disk's cold read rate although the
                # page cache serves them, not beside it as another stream.
                + disk_cache_read / hw.disk_to_cpu_bandwidth)

    def _decode_compute(self, q: _Shares, gpu_att, host, weight_copy) -> dict:
        hw, frame = self.hardware, q.frame
        gbs, bls, cc = frame.gpu_batch_size, frame.block_size, frame.compress_cache is not None
        s_avg = self.workload.prompt_len + self.workload.gen_len / 2
        attention_flops = 4 * s_avg * self.query_width  # per sequence: q.K^T and p.V
        gpu_attention_seconds = max(attention_flops / hw.decode_attention_flops,
                                    s_avg * (self.kv_numel * FP16_BYTES) / hw.gpu_memory_bandwidth)
        cpu_attention_seconds = attention_flops / hw.cpu_attention_flops
        if cc:
            cpu_attention_seconds += s_avg * self.kv_numel / hw.cpu_dequant_throughput
        # Both attentions are bound by their scan of the cache, whose measured rate is a scan's:
        # a batch's prefix is scanned (and dequantized) once for all its rows.
        scanned = q.shared / s_avg  # sequences' worth of cache a block does not scan
        # Each GPU batch attends in calls of up to CPU_ATTENTION_ROWS sequences, each with a fixed cost.
        # A batch's prefixes are attended in calls of their own, a prefix row standing for its group.
        calls = math.ceil(gbs / CPU_ATTENTION_ROWS)
        if self.caches_per_batch(frame) > 1:
            calls += math.ceil(self.workload.prefix_rows(gbs) / CPU_ATTENTION_ROWS)
        cpu_attention_calls = frame.num_gpu_batches * calls * hw.cpu_attention_seconds_per_call
        cpu_share = q.c_off if frame.cpu_attention else 0.0
        compute = {
            "gpu_matmul": self.matmul_seconds(bls, bls, gbs),
            "gpu_attention": gpu_att * bls * gpu_attention_seconds - gpu_att * scanned * gpu_attention_seconds,
            "dequantize": ((q.dequantized * self.matrix_numel / hw.gpu_dequant_throughput)
                           if frame.compress_weight is not None else 0.0)
            + (((gpu_att * bls * s_avg - gpu_att * q.shared) * self.kv_numel / hw.kv_dequant_throughput) if cc else 0.0),
            # The host joins CPU attention's time instead of running beside it: it finishes each
            # batch's layer only once that batch's attention is back, and the worker thread waits for
            # the interpreter while the host issues work.
            "cpu_attention": cpu_share * (bls * cpu_attention_seconds - scanned * cpu_attention_seconds
                                          + cpu_attention_calls + host),
            "activation_copies": self._activation_copies(q, bls),
        }
        if frame.cpu_attention:
            # While the weights stream, CPU attention runs at a share f of its speed: it finishes
            # (1 - f) x the copy time later than alone, unless the copy is the longer anyway (the
            # phase's max over the I/O terms covers that case).
            compute["cpu_attention"] = (compute["cpu_attention"]
                                        + (1 - hw.cpu_attention_share_under_copy) * weight_copy)
        return compute

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
        disk_rate = self.hardware.disk_to_cpu_cached_bandwidth if disk_cached else None
        terms = self.phase_terms(frame, p, disk_rate)
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
        throughput = share * bls * w.gen_len / latency
        if w.gen_lens:
            throughput = self.retiring_throughput(frame, p, disk_rate)
        return Prediction(
            policy=policy, workload=w, prefill=phases["prefill"], decode=phases["decode"],
            prefill_seconds=prefill_seconds, decode_seconds=decode_seconds, block_latency=latency,
            total_throughput=throughput,
            prefill_throughput=share * bls * w.prompt_len / prefill_seconds,
            decode_throughput=(share * bls * (w.gen_len - 1) / decode_seconds) if w.gen_len > 1 else 0.0,
            peak_memory=peak,
            capacity=self.capacities(),
            memory_by_phase=memory,
            disk_reads_cached=disk_cached,
        )

    def retiring_throughput(self, frame: PolicyFrame, p: Placement, disk_read_bandwidth: float | None) -> float:
        """Generated tokens per second over a job whose budgets differ (``Workload.gen_lens``): the
        budgets in order, a block of them at a time, and each GPU batch in a block retired once the
        longest of its budgets is spent, as the runtime forms blocks and batches by budget and stops
        a batch whose rows have all finished. A step while r of a block's batches still run costs
        what a step of r batches costs; weights still stream once per step."""
        budgets = sorted(self.workload.gen_lens)
        gbs, bls = frame.gpu_batch_size, frame.block_size
        per_layer: dict = {}

        def seconds(phase: str, running: int) -> float:
            if (phase, running) not in per_layer:
                io, compute = self.phase_terms(replace(frame, num_gpu_batches=running), p, disk_read_bandwidth)[phase]
                per_layer[phase, running] = float(self.phase_seconds(io, compute, frame.overlap))
            return self.num_layers * per_layer[phase, running]

        total = 0.0
        for start in range(0, len(budgets), bls):
            block = budgets[start:start + bls]
            ends = [max(block[i:i + gbs]) for i in range(0, len(block), gbs)]  # ascending
            total += seconds("prefill", len(ends))
            done = 1  # the prefill gives each row its first token
            for k, end in enumerate(ends):
                total += (end - done) * seconds("decode", len(ends) - k)
                done = end
        return sum(budgets) / total

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
