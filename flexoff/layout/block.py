"""One block's memory under a policy, in bytes: each GPU batch's KV cache per tier (disk rows with
their host staging), the GPU workspace the batches share, offloaded activations, the host worker's
share, the working memory of the largest step, and the token samplers' state."""

from __future__ import annotations

from dataclasses import dataclass

from ..models import ModelConfig, moe
from ..models.common import bias_row_entries
from ..policy import TIERS, CompressionConfig, Policy
from .head import head_step_bytes, sampler_state_bytes
from .host import HOST_CHUNK, HOST_JOBS_IN_FLIGHT, disk_file_bytes, slab_bytes
from .placement import split_rows
from .weights import owned_layers, stored_parts

CPU_ATTENTION_ROWS = 32  # sequences per CPU attention call: bounds its temporary memory
INDEX_BYTES = 8  # int64: a token's chosen experts, and the order that sorts them
FP32_BYTES = 4


def has_dense_mlp(cfg: ModelConfig) -> bool:
    """Whether some layer has a dense MLP (every layer of a dense model, ``dense_layers`` of a MoE)."""
    return any(not cfg.sparse_layer(i) for i in range(cfg.num_layers))


def sparse_mlp_bytes(cfg: ModelConfig, tokens: int, itemsize: int) -> int:
    """The largest transient of a sparse layer's MLP over ``tokens`` tokens (0 for a dense model),
    as ``models.moe.sparse_mlp`` allocates it: one chunk's (see _chunk_bytes), and past one chunk
    the output the chunks are written into."""
    if not cfg.num_experts:
        return 0
    chunk = moe.chunk_tokens(cfg)
    if tokens <= chunk:
        return _chunk_bytes(cfg, tokens, itemsize)
    return _chunk_bytes(cfg, chunk, itemsize) + tokens * cfg.hidden_size * itemsize


def _chunk_bytes(cfg: ModelConfig, tokens: int, itemsize: int) -> int:
    """The largest transient of a sparse layer's MLP over one chunk of ``tokens`` tokens. Each
    token makes k (token, expert) pairs, sorted by
    expert; per pair, the gathered row (hidden), gate-up's output (2 x width) and its activation
    (width) and down's output (hidden) are live together at the largest moment, which is one of:
    the activation beside both gate halves, gate-up's or down's output beside the per-expert
    pieces it is assembled from, or the outputs gathered back into token order and summed."""
    if not cfg.num_experts:
        return 0
    h, width, k = cfg.hidden_size, cfg.expert_intermediate_size, cfg.experts_per_token
    pairs = tokens * k
    # The router's logits, their fp32 copy and softmax over every expert; the top k's fp32
    # values, int64 indices, renormalised values and their copy in the compute dtype.
    routing = tokens * cfg.num_experts * (itemsize + 2 * FP32_BYTES) + pairs * (2 * FP32_BYTES + INDEX_BYTES + itemsize)
    # Each pair's weight, expert and place in the order, and each expert's end in it (int32).
    kept = pairs * (itemsize + 2 * INDEX_BYTES) + cfg.num_experts * FP32_BYTES
    experts = kept + max(pairs * (INDEX_BYTES + h * itemsize),  # the gather, by token indices
                         pairs * (h + 4 * width) * itemsize,
                         pairs * (3 * h + 3 * width) * itemsize,
                         # the inverse order made beside down's output (rows and gate-up kept)
                         2 * pairs * INDEX_BYTES + pairs * (2 * h + 2 * width) * itemsize,
                         # the rows gathered back by it, and their weighted sums
                         pairs * INDEX_BYTES + (pairs * (3 * h + 2 * width) + tokens * h) * itemsize)
    peak = max(routing, experts)
    shared = cfg.shared_expert_intermediate_size
    if shared:
        # After the routed experts (their output and the routing kept): the shared expert's gate,
        # its activation and up, then its output gated and added.
        peak = max(peak, pairs * (itemsize + INDEX_BYTES)
                   + tokens * max(h + 3 * shared, 2 * h + shared, 4 * h) * itemsize)
    return peak


def attention_bytes_per_token(cfg: ModelConfig, itemsize: int) -> int:
    """A token's share of the layer's largest moment up to and through attention, with its hidden
    state: OPT's q/k/v and hidden states; for the Llama family, ``models.llama.attention_inputs``'
    largest moment (its input norm's fp32 copy and result, the projections beside the normalised
    input, the q/k norms' fp32 copies, a rotation's output and half-width temporary) or attention's
    q, k, v and output."""
    h = cfg.hidden_size
    if cfg.family == "opt":
        return 4 * h * itemsize
    q, kv, fp32 = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, 4
    moments = [h * (fp32 + itemsize), (h + q + 2 * kv) * itemsize, (2 * q + 2 * kv) * itemsize + q * itemsize // 2]
    if cfg.qk_norm:
        moments.append((2 * q + 2 * kv) * itemsize + q * fp32)
    return h * itemsize + max(moments)


def step_state_bytes(cfg: ModelConfig, rows: int, queries: int, keys: int, itemsize: int,
                     decode: bool = False) -> int:
    """A GPU batch's state for one token step, kept from its first stage to its last: the attention
    mask (one bool per query and key; at a decode step, the additive bias attention takes, its
    keys stored padded as ``models.common.bias_row_entries`` says) and, for rotary models, the cos
    and sin of each query's position. At the prefill every batch of the block holds its own at once."""
    rotary = 2 * cfg.head_dim * itemsize if cfg.family == "llama" else 0
    mask = bias_row_entries(keys) * itemsize if decode else keys
    return rows * queries * (mask + rotary)


def working_bytes(cfg: ModelConfig, tokens: int, rows: int, itemsize: int) -> int:
    """Working memory of a GPU batch of ``rows`` sequences over ``tokens`` tokens (the prefill's
    rows x prompt length): attention's (see attention_bytes_per_token), the MLP's intermediates (a
    MoE model's sparse layers take their own, see sparse_mlp_bytes; its dense layers, if any, the
    dense one), and the head step's logits of the last position and the sampler's work on them."""
    dense_mlp = tokens * cfg.intermediate_size * itemsize if has_dense_mlp(cfg) else 0
    return (tokens * attention_bytes_per_token(cfg, itemsize)
            + max(dense_mlp, sparse_mlp_bytes(cfg, tokens, itemsize)) + head_step_bytes(rows, cfg.vocab_size, itemsize))


def kv_buffer_parts(cfg: ModelConfig, slots: int, rows: int, compression: CompressionConfig | None,
                    itemsize: int) -> list[int]:
    """Bytes of each tensor one layer's keys (or values) of ``rows`` sequences are stored as; the
    same in every storage order, head_dim always last."""
    return stored_parts((slots, rows, cfg.num_kv_heads, cfg.head_dim), compression, itemsize)


@dataclass(frozen=True)
class WorkspaceLayout:
    """The GPU workspace a block's batches share (see runtime.kv.KVWorkspace): a ring of two
    (keys, values) sets for the ``travelling`` off-GPU rows GPU attention loads, in the cache's
    format, and with a compressed cache one flat (keys, values) pair of ``dequantized`` rows that
    one attention call's slots are decompressed into."""

    slots: int
    travelling: int
    dequantized: int
    ring_sets: int
    set_parts: tuple[int, ...]  # bytes of one buffer's parts in a ring set
    dequantized_numel: int  # elements of each buffer of the flat pair

    def nbytes(self, itemsize: int) -> int:
        return self.ring_sets * 2 * sum(self.set_parts) + 2 * self.dequantized_numel * itemsize


def workspace_layout(cfg: ModelConfig, policy: Policy, rows: int, slots: int, itemsize: int) -> WorkspaceLayout | None:
    """The workspace for batches of up to ``rows`` sequences, or None where none is needed."""
    on_gpu = sum(p.stop - p.start for p in split_rows(rows, policy.cache) if p.tier == "gpu")
    travelling = 0 if policy.cpu_attention else rows - on_gpu
    # GPU rows and travelling rows attend one after the other, so they share the buffer.
    dequantized = max(on_gpu, travelling) if policy.compress_cache is not None else 0
    if not travelling and not dequantized:
        return None
    parts = kv_buffer_parts(cfg, slots, travelling, policy.compress_cache, itemsize)
    return WorkspaceLayout(slots, travelling, dequantized, 2 if travelling > 0 else 0, tuple(parts),
                           slots * dequantized * cfg.num_kv_heads * cfg.head_dim)


# Host pairs (keys, values) of one layer that a batch's disk rows go through: two staging pairs, for
# even and odd layers (a layer is read in ahead while the layer before is copied out of the other),
# and one for a prefill's slots written out.
DISK_HOST_PAIRS = 3
# One-slot host pairs a decode step's new slot of disk rows goes home through: copied there on the
# store stream, written to the files by the host worker. A pair is reused once its write is done;
# with the worker's jobs bounded (HOST_JOBS_IN_FLIGHT), a ring one longer rarely waits.
DISK_SLOT_RING = HOST_JOBS_IN_FLIGHT + 1


def keeps_cache(gen_len: int) -> bool:
    """Whether a block generating ``gen_len`` tokens keeps its keys and values. One that generates
    at most one (a scoring pass, a prompt's logits, a one-token answer) never reads them again: its
    prefill attends on the fresh keys and values and its head samples the only token. It stores no
    cache, so its size is bounded by its activations and working memory alone."""
    return gen_len > 1


def kv_cache_bytes(cfg: ModelConfig, policy: Policy, slots: int, itemsize: int,
                   owned: range | None = None, *, prefix_len: int = 0, prefix_rows: int = 1) -> dict[str, int]:
    """One block's KV cache per tier: every batch's storage (compressed bytes where the policy
    compresses the cache) for the layers held here, disk rows' host staging (reads and writes), and
    the GPU workspace the batches share. ``prefix_len``: the longest prefix each GPU batch's groups
    of rows share (``flexoff.prefixes``), and ``prefix_rows`` how many groups a batch has; its rows
    then hold ``slots - prefix_len`` slots of their own, and the batch ``prefix_rows`` more rows of
    ``prefix_len`` slots (see runtime.prefix_kv), with a workspace of their own."""
    layers = len(owned_layers(cfg, owned))
    sizes = _rows_cache_bytes(cfg, policy, policy.gpu_batch_size, slots - prefix_len, itemsize, layers)
    if prefix_len:
        for tier, size in _rows_cache_bytes(cfg, policy, prefix_rows, prefix_len, itemsize, layers).items():
            sizes[tier] += size
    return sizes


def _rows_cache_bytes(cfg: ModelConfig, policy: Policy, rows: int, slots: int, itemsize: int,
                      layers: int) -> dict[str, int]:
    """Every batch's ``rows`` cache rows of ``slots`` slots per tier, as ``split_rows`` places them
    (disk rows with DISK_HOST_PAIRS staging pairs and DISK_SLOT_RING one-slot pairs in host memory),
    and the workspace they travel through, once per block. A batch's own rows and its prefixes'
    rows are each such a set (runtime.kv.BatchKV, runtime.prefix_kv.PrefixKV)."""
    sizes = dict.fromkeys(TIERS, 0)
    for piece in split_rows(rows, policy.cache):
        count = piece.stop - piece.start
        layer_bytes = 2 * sum(kv_buffer_parts(cfg, slots, count, policy.compress_cache, itemsize))
        sizes[piece.tier] += layers * layer_bytes * policy.num_gpu_batches
        if piece.tier == "disk":
            slot_bytes = 2 * sum(kv_buffer_parts(cfg, 1, count, policy.compress_cache, itemsize))
            sizes["cpu"] += (DISK_HOST_PAIRS * layer_bytes + DISK_SLOT_RING * slot_bytes) * policy.num_gpu_batches
    workspace = workspace_layout(cfg, policy, rows, slots, itemsize)
    if workspace is not None:
        sizes["gpu"] += workspace.nbytes(itemsize)
    return sizes


def block_host_requests(cfg: ModelConfig, policy: Policy, prompt_len: int, slots: int, itemsize: int,
                        owned: range | None = None, *, prefix_len: int = 0, prefix_rows: int = 1) -> list[int]:
    """Host allocations of one block in the order the engine makes them: batch by batch, its shared
    prefixes' cache and hidden states (where ``prefix_len``: ``prefix_rows`` rows), then its own
    rows' cache and hidden states. A cache (where the block keeps one, ``keeps_cache``) is each
    tier's rows for every layer, keys then values; for disk rows, DISK_HOST_PAIRS pairs and
    DISK_SLOT_RING one-slot pairs."""
    layers = len(owned_layers(cfg, owned))
    sets = [(prefix_rows, prefix_len, prefix_len)] if prefix_len else []
    sets.append((policy.gpu_batch_size, slots - prefix_len, prompt_len - prefix_len))
    batch: list[int] = []
    kept = keeps_cache(slots - prompt_len)
    for rows, length, tokens in sets:
        if kept:
            batch += _cache_host_requests(cfg, policy, rows, length, itemsize, layers)
        batch += [count * length * cfg.hidden_size * itemsize
                  for tier, count, length in _hidden_rows(policy, rows, tokens) if tier != "gpu"]
    return batch * policy.num_gpu_batches


def _cache_host_requests(cfg: ModelConfig, policy: Policy, rows: int, slots: int, itemsize: int,
                         layers: int) -> list[int]:
    """Host allocations of one batch's ``rows`` cache rows of ``slots`` slots, in order."""
    requests: list[int] = []
    for piece in split_rows(rows, policy.cache):
        if piece.tier == "gpu":
            continue
        count = piece.stop - piece.start
        pair = kv_buffer_parts(cfg, slots, count, policy.compress_cache, itemsize) * 2
        if piece.tier == "cpu":
            requests += pair * layers
        else:
            slot = kv_buffer_parts(cfg, 1, count, policy.compress_cache, itemsize) * 2
            requests += pair * DISK_HOST_PAIRS + slot * DISK_SLOT_RING
    return requests


def _hidden_rows(policy: Policy, rows: int, tokens: int) -> list[tuple[str, int, int]]:
    return [(p.tier, p.stop - p.start, tokens) for p in split_rows(rows, policy.activations)]


def activation_rows(policy: Policy, prompt_len: int, prefix_len: int = 0,
                    prefix_rows: int = 1) -> list[tuple[str, int, int]]:
    """(tier, rows, tokens) of one GPU batch's hidden states at the prefill: its rows of their own
    ``prompt_len - prefix_len`` tokens as the policy places them, and with shared prefixes
    ``prefix_rows`` more rows of ``prefix_len`` tokens, placed as that many rows are."""
    rows = _hidden_rows(policy, policy.gpu_batch_size, prompt_len - prefix_len)
    if prefix_len:
        rows += _hidden_rows(policy, prefix_rows, prefix_len)
    return rows


def block_disk_files(cfg: ModelConfig, policy: Policy, prompt_len: int, slots: int, itemsize: int,
                     owned: range | None = None, *, prefix_len: int = 0, prefix_rows: int = 1) -> list[int]:
    """Sizes of one block's offload files: per batch, two (keys, values) for each layer of its disk
    rows (and of its shared prefixes' rows, where on disk) where it keeps a cache, and one for each
    of its disk rows' hidden states (and its prefixes')."""
    files: list[int] = []
    layers = len(owned_layers(cfg, owned))
    pieces = []
    if keeps_cache(slots - prompt_len):
        pieces = [(piece, slots - prefix_len) for piece in split_rows(policy.gpu_batch_size, policy.cache)]
        if prefix_len:
            pieces += [(piece, prefix_len) for piece in split_rows(prefix_rows, policy.cache)]
    for piece, length in pieces:
        if piece.tier == "disk":
            size = sum(kv_buffer_parts(cfg, length, piece.stop - piece.start, policy.compress_cache, itemsize))
            files += [disk_file_bytes(size)] * (2 * layers)
    for tier, rows, tokens in activation_rows(policy, prompt_len, prefix_len, prefix_rows):
        if tier == "disk":
            files.append(disk_file_bytes(rows * tokens * cfg.hidden_size * itemsize))
    return files * policy.num_gpu_batches


def block_gpu_parts(cfg: ModelConfig, policy: Policy, prompt_len: int, gen_len: int, itemsize: int,
                    owned: range | None = None, *, prefix_len: int = 0, prefix_rows: int = 1) -> dict[str, int]:
    """One block's GPU memory by what holds it; ``block_bytes`` counts their sum on the GPU. A
    pipeline stage (``owned``) holds the caches of its layers; the rest is counted as for the whole
    model. ``prefix_len``, ``prefix_rows``: each GPU batch's shared prefixes (see kv_cache_bytes);
    the working memory, step state and stores in flight stay those of whole prompts, a bound on
    the prefixes' and the rows' own (a batch's groups are no more than its rows)."""
    rows = policy.gpu_batch_size
    held = activation_rows(policy, prompt_len, prefix_len, prefix_rows)
    activation_bytes = sum(count * tokens for tier, count, tokens in held if tier == "gpu") * cfg.hidden_size * itemsize
    # The host worker's queued prefill jobs (and the store stream's copies) each keep one batch's
    # new keys and values of the rows stored in host memory on the GPU until copied.
    kept = keeps_cache(gen_len)
    off_gpu = sum(p.stop - p.start for p in split_rows(rows, policy.cache) if p.tier != "gpu") if kept else 0
    per_job = 2 * off_gpu * prompt_len * cfg.num_kv_heads * cfg.head_dim * itemsize
    return {
        "kv cache and workspace": kv_cache_bytes(cfg, policy, prompt_len + gen_len, itemsize, owned,
                                                 prefix_len=prefix_len, prefix_rows=prefix_rows)["gpu"] if kept else 0,
        "activations": activation_bytes * policy.num_gpu_batches,
        # the largest step, one batch at a time
        "working memory": working_bytes(cfg, rows * prompt_len, rows, itemsize),
        "step state": policy.num_gpu_batches * step_state_bytes(cfg, rows, prompt_len, prompt_len, itemsize),
        # kept for every sequence of the block
        "samplers": sampler_state_bytes(policy.block_size, cfg.vocab_size),
        "stores in flight": HOST_JOBS_IN_FLIGHT * per_job,
    }


def block_bytes(cfg: ModelConfig, policy: Policy, prompt_len: int, gen_len: int, itemsize: int,
                pinned: bool = False, owned: range | None = None, *, prefix_len: int = 0,
                prefix_rows: int = 1) -> dict[str, int]:
    """KV cache, activations and working memory of one full block, per tier. ``pinned``: host
    memory is pinned, so its figure is the slabs the block's allocations take. ``owned``: a
    pipeline stage's range of stages (see block_gpu_parts). ``prefix_len``: the longest prefix a
    GPU batch's groups of rows share, ``prefix_rows`` its number of groups; each group's prefix is
    counted once per batch (see kv_cache_bytes and activation_rows)."""
    slots = prompt_len + gen_len
    shared = {"prefix_len": prefix_len, "prefix_rows": prefix_rows}
    sizes = kv_cache_bytes(cfg, policy, slots, itemsize, owned, **shared) if keeps_cache(gen_len) \
        else dict.fromkeys(TIERS, 0)
    for tier, rows, tokens in activation_rows(policy, prompt_len, prefix_len, prefix_rows):
        if tier == "gpu":
            continue  # among the GPU parts
        hidden = rows * tokens * cfg.hidden_size * itemsize * policy.num_gpu_batches
        sizes["cpu"] += hidden  # disk rows are staged through host memory
        if tier == "disk":
            sizes["disk"] += hidden
    if pinned:
        sizes["cpu"] = slab_bytes(block_host_requests(cfg, policy, prompt_len, slots, itemsize, owned, **shared))
    parts = block_gpu_parts(cfg, policy, prompt_len, gen_len, itemsize, owned, **shared)
    sizes["gpu"] = sum(parts.values())
    if parts["stores in flight"]:
        sizes["cpu"] += 2 * HOST_CHUNK  # the host worker's pinned chunks
    return sizes
