"""Every allocation a policy makes for a model, per tier, in plain integers, before anything exists.

Pure arithmetic on the models' weight specs and the policy: it imports no runtime module and
allocates nothing. The runtime sizes its allocations from it, and the memory check, the cost model
and the planner read the same figures, so memory is counted once.

- :mod:`.placement`: which rows of which tensor, and which sequences of a batch, live on each tier;
- :mod:`.host`: how host memory is taken (pages, slabs, the host worker's share), offload files' rounding;
- :mod:`.weights`: the weights' pieces, assembly buffers, dequantization scratch, host requests;
- :mod:`.block`: one block's KV cache, workspace, activations and working memory;
- :mod:`.head`: the token sampler's work at a head step and its state kept for a block, and the
  positions whose log-probabilities fit in that;
- :mod:`.capacity`: a job's bytes per tier, and whether they fit a machine's capacities;
- :mod:`.experts`: the experts a block touches, and whether a block loads only those (route first);
- :mod:`.linear`: a job's bytes per tier as a constant plus a coefficient per placement fraction.
"""

from .block import (CPU_ATTENTION_ROWS, DISK_SLOT_RING, WorkspaceLayout, block_bytes, block_disk_files, block_gpu_parts, block_host_requests,
                    has_dense_mlp, keeps_cache, kv_buffer_parts, kv_cache_bytes, sparse_mlp_bytes, step_state_bytes,
                    working_bytes, workspace_layout)
from .head import SORTED_ROWS, head_step_bytes, logprob_positions, sampler_state_bytes, sampler_step_bytes
from .experts import ROUTE_FIRST_MIN_SAVING, expected_experts_touched, routes_first
from .capacity import Capacity, check_fits, job_bytes, overflow, tier_limits, tier_name
from .linear import MemoryForm, memory_form, whole_tier
from .host import (HOST_CHUNK, HOST_JOBS_IN_FLIGHT, PAGE, SlabPlan, disk_file_bytes, pages, pins_host_memory,
                   registered_bytes, slab_bytes)
from .placement import (Piece, TensorPlacement, place_layer, place_stage, realised_fractions, requested_fractions,
                        split_rows)
from .weights import (WeightLayout, buffer_copies, compressible, dequantize_scratch_numel, dequantizes_once,
                      largest_matrix_numel, largest_stage_matrix_numel, owned_layers, owned_stages, stage_placements, stored_parts, weight_buffer_bytes, weight_bytes,
                      weight_host_requests, weight_layout, weight_meta_dtype)

__all__ = [
    "CPU_ATTENTION_ROWS", "DISK_SLOT_RING", "HOST_CHUNK", "HOST_JOBS_IN_FLIGHT", "PAGE", "block_bytes", "block_disk_files",
    "block_gpu_parts", "block_host_requests", "buffer_copies", "Capacity", "check_fits", "compressible",
    "dequantize_scratch_numel", "dequantizes_once", "disk_file_bytes", "expected_experts_touched", "has_dense_mlp", "head_step_bytes", "job_bytes",
    "keeps_cache",
    "kv_buffer_parts", "kv_cache_bytes", "MemoryForm", "memory_form", "largest_matrix_numel", "largest_stage_matrix_numel", "logprob_positions", "overflow", "owned_layers", "owned_stages", "pages",
    "Piece", "sampler_state_bytes", "sampler_step_bytes", "SORTED_ROWS", "sparse_mlp_bytes", "step_state_bytes", "pins_host_memory",
    "place_layer", "place_stage", "ROUTE_FIRST_MIN_SAVING", "routes_first", "realised_fractions", "requested_fractions", "registered_bytes", "slab_bytes",
    "SlabPlan", "split_rows", "stage_placements",
    "stored_parts", "TensorPlacement", "tier_limits", "tier_name", "weight_buffer_bytes", "weight_bytes",
    "weight_host_requests", "weight_layout", "weight_meta_dtype", "WeightLayout", "whole_tier", "working_bytes", "workspace_layout", "WorkspaceLayout",
]
