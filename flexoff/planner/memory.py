"""The cost model's peak memory per tier, at the prefill and at a decode step, affine in the
placement fractions (FlexGen's Appendix A.3, extended as ``cost_model`` says): the weights, the
cache and the activations where the placement puts them, the GPU's weight buffers and cache
workspace, the transients of the largest step, and the host's staging of what moves between disk
and GPU. ``MemoryTerms`` is the part of :class:`~.cost_model.CostModel` that counts bytes; it
reads the sizes the cost model sets up for a model, workload and machine.

This is a count of its own beside the layout's (``layout.memory_form``, which is ``job_bytes`` at
every vertex placement), and the two differ: here each phase has its peak, the transient is the
largest of attention, the MLP and the head step (the layout adds them), offloaded activations keep
two batches' buffers on the GPU, disk rows are staged in host memory as two of one batch's layers
(the layout: three, and a ring of one-slot pairs, for every batch), new cache waits for one batch
more than the host worker's queue, CPU attention has an fp32 host workspace the layout does not
list, and a split weight tensor is priced as the GPU share times two of the largest matrices. The reference policies in
``policies/`` were searched and calibrated with these figures; the layout's change them.

A shared prefix (``Workload.shared_prefix``) is held once per group of a GPU batch's rows that
share it (``Workload.prefix_rows``: G per batch), as the layout holds it: its cache, workspace and
waiting stores are smaller by the other gbs - G rows' copies of it, and its prefill adds G
activation rows of the prefix per batch. Each term is today's less (or plus) the
prefix's share, so that with no prefix every figure is today's to the bit.
"""

from __future__ import annotations

import torch

from ..layout import (HOST_JOBS_IN_FLIGHT, block_host_requests, dequantize_scratch_numel, dequantizes_once,
                      head_step_bytes, registered_bytes, sampler_state_bytes, slab_bytes, sparse_mlp_bytes,
                      step_state_bytes, weight_buffer_bytes, weight_host_requests, working_bytes)
from ..policy import Policy, TierFractions
from .frame import Placement, PolicyFrame
from .sizes import FP16_BYTES, bytes_per_element

FP32_BYTES = 4


class MemoryTerms:
    """Bytes per tier of a policy's frame and placement (a mixin of CostModel, whose sizes it reads)."""

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
                listed = requests()  # none where the block keeps no cache
                self._pinned_factors[key] = reserved(listed) / sum(listed) if listed else 1.0
            return self._pinned_factors[key]

        return (factor(("weights", frame.compress_weight),
                       lambda: weight_host_requests(self.config, on_cpu, torch.float16), registered_bytes),
                factor(("cache", frame.gpu_batch_size, frame.compress_cache),
                       lambda: block_host_requests(self.config, on_cpu, w.prompt_len, w.prompt_len + w.gen_len,
                                                   FP16_BYTES), slab_bytes))


    def batch_shared_tokens(self, frame: PolicyFrame) -> int:
        """Token positions of one GPU batch that its shared prefixes save: the gbs - G copies of
        them it does not hold, G being its prefix rows."""
        return self.workload.batch_saved_tokens(frame.gpu_batch_size)

    def batch_prefix_tokens(self, frame: PolicyFrame) -> int:
        """Tokens of one GPU batch's prefix rows: G of the prefix."""
        gbs = frame.gpu_batch_size
        return self.workload.prefix_rows(gbs) * self.workload.batch_prefix(gbs)

    def prefix_rows_tokens(self, frame: PolicyFrame) -> int:
        """Tokens of the prefix rows a block's prefill adds to its activations: G per GPU batch."""
        return frame.num_gpu_batches * self.batch_prefix_tokens(frame)

    def memory_terms(self, frame: PolicyFrame, p: Placement) -> dict:
        """{(tier, phase): peak bytes}, affine in ``p``."""
        s, n, layers = self.workload.prompt_len, self.workload.gen_len, self.num_layers
        act = FP16_BYTES * self.hidden
        s_max = s + n  # the cache is sized for the whole sequence (A.3)
        weights_total = self.weight_bytes_per_layer(frame) * layers
        kv = self.kv_bytes_per_token(frame)
        kv_total = kv * s_max * frame.block_size * layers - kv * self.shared_tokens(frame) * layers
        gpu_prefill, gpu_decode = self._gpu_memory(frame, p, weights_total, kv_total)
        cpu_prefill, cpu_decode = self._cpu_memory(frame, p, weights_total, kv_total)
        disk = (p.wd * weights_total + p.hd * act * s * frame.block_size + p.cd * kv_total
                + p.hd * act * self.prefix_rows_tokens(frame))
        return {
            ("gpu", "prefill"): gpu_prefill, ("gpu", "decode"): gpu_decode,
            ("cpu", "prefill"): cpu_prefill, ("cpu", "decode"): cpu_decode,
            ("disk", "prefill"): disk, ("disk", "decode"): disk,
        }

    def _gpu_workspace(self, frame: PolicyFrame, p: Placement):
        """The block's cache workspace (layout.workspace_layout): a ring of two for travelling cache,
        and with a compressed cache one batch's decompressed keys and values."""
        s_max, gbs = self.workload.prompt_len + self.workload.gen_len, frame.gpu_batch_size
        c_off = p.cc + p.cd
        gpu_att = p.cg + (0.0 if frame.cpu_attention else c_off)
        # The batches' rows and their prefix's own workspace hold a prefix once.
        shared = self.batch_shared_tokens(frame)
        kv = self.kv_bytes_per_token(frame)
        travelling = 0.0 if frame.cpu_attention else 2 * c_off * kv * s_max * gbs - 2 * c_off * kv * shared
        kv16 = self.kept_kv_numel * FP16_BYTES
        return travelling + (gpu_att * kv16 * s_max * gbs - gpu_att * kv16 * shared
                             if frame.compress_cache is not None else 0.0)

    def _gpu_memory(self, frame: PolicyFrame, p: Placement, weights_total, kv_total) -> tuple:
        """The GPU's peak bytes at the prefill and at a decode step."""
        c, s, n = self.config, self.workload.prompt_len, self.workload.gen_len
        gbs, bls, nb = frame.gpu_batch_size, frame.block_size, frame.num_gpu_batches
        act, kv16 = FP16_BYTES * self.hidden, self.kept_kv_numel * FP16_BYTES
        # Held through both phases: the weight buffers and the block's token samplers' state.
        buffers = self.weight_buffer_bytes(frame, p.wg) + sampler_state_bytes(bls, c.vocab_size)
        workspace = self._gpu_workspace(frame, p)
        # Buffers of off-GPU data come in pairs: the batch computed now and the one being loaded.
        # The workspace is the block's, allocated before its prefill; a dense model's prefill
        # figure leaves it out, as its policies were searched and calibrated with (the MLP's
        # three buffers cover it), a MoE model's counts it.
        prefill_workspace = workspace if c.num_experts else 0.0
        waiting = (1 + HOST_JOBS_IN_FLIGHT) * (1 - p.cg) * kv16
        prefill = (p.wg * weights_total + p.hg * act * s * bls + p.cg * kv_total
                   + buffers
                   + 2 * (1 - p.hg) * act * s * gbs
                   # new cache waiting to be stored, in the compute dtype whatever the stored
                   # format: this batch's, and the host worker's queue
                   + (waiting * s * gbs - waiting * self.batch_shared_tokens(frame))
                   + p.hg * act * self.prefix_rows_tokens(frame)
                   + prefill_workspace
                   + nb * step_state_bytes(c, gbs, s, s, FP16_BYTES)
                   + self._intermediates(gbs * s, s, gbs))
        decode = (p.wg * weights_total + p.hg * act * bls + p.cg * kv_total
                  + buffers
                  + 2 * (1 - p.hg) * act * gbs
                  + workspace
                  + nb * step_state_bytes(c, gbs, 1, s + n, FP16_BYTES, decode=True)
                  + self._intermediates(gbs, s + n, gbs))
        return prefill, decode

    def _intermediates(self, rows: int, keys: int, gbs: int) -> float:
        """Largest transient of one GPU batch: attention, the MLP's working memory or the head step (the
        last position's logits and the sampler's work on them, as the layout counts it)."""
        c = self.config
        # The memory-efficient kernel keeps no scores: q, k, v and the output, the boolean mask
        # and its fp16 bias over the keys, and a float32 log-sum-exp per query and head.
        attention = rows * ((2 * self.query_width + 2 * self.kv_width) * FP16_BYTES
                            + keys * (1 + FP16_BYTES) + c.num_heads * FP32_BYTES)
        # A MoE model's sparse layers (experts, routing) and its dense ones, if any, differ.
        dense = self.mlp_buffers * rows * c.intermediate_size * FP16_BYTES if self.dense_mlp else 0
        mlp = max(dense, sparse_mlp_bytes(c, rows, FP16_BYTES))
        logits = head_step_bytes(gbs, c.vocab_size, FP16_BYTES)
        hidden_copies = 2 * rows * FP16_BYTES * self.hidden  # normalized input and residual
        transient = max(attention, mlp, logits) + hidden_copies
        if not c.num_experts:
            return transient
        # A MoE model's figure has no dense MLP's three buffers to spare: it never goes below
        # the layout's working memory, by which the runtime checks a job.
        return max(transient, working_bytes(c, rows, gbs, FP16_BYTES))

    def _cpu_memory(self, frame: PolicyFrame, p: Placement, weights_total, kv_total) -> tuple:
        """The CPU's peak bytes at the prefill and at a decode step: the homes of what it holds,
        and the staging of what moves between disk and GPU."""
        c, s = self.config, self.workload.prompt_len
        s_max, gbs, bls = s + self.workload.gen_len, frame.gpu_batch_size, frame.block_size
        W, kv, act = self.weight_bytes_per_layer(frame), self.kv_bytes_per_token(frame), FP16_BYTES * self.hidden
        weight_factor, cache_factor = self.pinned_host_factors(frame)
        shared = self.batch_shared_tokens(frame)  # a batch's cache staged holds its prefix once
        home = p.wc * weights_total * weight_factor + p.cc * kv_total * cache_factor
        prefill = (home + p.hc * act * s * bls + 2 * p.wd * W
                   + 2 * p.hd * act * s * gbs + (2 * p.cd * kv * s * gbs - 2 * p.cd * kv * shared)
                   + p.hc * act * self.prefix_rows_tokens(frame)
                   + 2 * p.hd * act * self.batch_prefix_tokens(frame))
        workspace = 0.0
        if frame.cpu_attention:
            # fp32 copy of one batch's keys and values, and its scores
            c_off = p.cc + p.cd
            workspace = ((c_off * gbs * s_max - c_off * shared)
                         * (self.kept_kv_numel * FP32_BYTES + 2 * c.num_heads * FP32_BYTES))
        decode = (home + p.hc * act * bls + 2 * p.wd * W
                  + 2 * p.hd * act * gbs + (2 * p.cd * kv * s_max * gbs - 2 * p.cd * kv * shared) + workspace)
        return prefill, decode
