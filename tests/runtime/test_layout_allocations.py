"""The layout's figures are what the runtime allocates: the tensors an engine holds, its host
allocations and its offload files, under policies that use every tier, compression and CPU
attention; and the runtime accepts exactly the jobs the layout says fit."""

import re
from collections import Counter
from pathlib import Path

import pytest
import torch

from flexoff import LLM, Policy, SamplingParams, TierFractions
from flexoff.compression import CompressedTensor
from flexoff.errors import PolicyError
from flexoff.layout import block_disk_files, job_bytes, weight_layout, workspace_layout
from flexoff.planner.cost_model import Workload
from flexoff.policy import CompressionConfig
from flexoff.runtime.kv import KVWorkspace
from flexoff.runtime.offload_dir import OWNER_FILE
from flexoff.runtime.tiers import HostMemory

FOUR_BIT = CompressionConfig(4, 4)
POLICIES = {
    "device": Policy(2, 2),
    "every tier": Policy(2, 2, TierFractions(0.3, 0.3, 0.4), TierFractions(0.5, 0.5, 0), TierFractions(0.5, 0.5, 0)),
    "compressed on disk": Policy(4, 2, TierFractions(0, 0.5, 0.5), TierFractions(0.25, 0.5, 0.25),
                                 TierFractions(0.5, 0, 0.5), compress_weight=FOUR_BIT, compress_cache=FOUR_BIT),
    "cpu attention": Policy(4, 1, TierFractions(0.5, 0, 0.5), TierFractions(0, 0.5, 0.5), TierFractions(1, 0, 0),
                            cpu_attention=True, compress_weight=FOUR_BIT),
}
PROMPT, NEW = 5, 3


def reachable(root):
    """Every object reachable from ``root`` through flexoff objects, containers and compressed
    tensors (their parts), each once; host memory pools are not entered."""
    seen, stack = set(), [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, HostMemory):
            continue
        seen.add(id(obj))
        yield obj
        if isinstance(obj, CompressedTensor):
            stack += [obj.data, obj.scale, obj.minimum]
        elif isinstance(obj, dict):
            stack += list(obj.values())
        elif isinstance(obj, (list, tuple)):
            stack += list(obj)
        elif type(obj).__module__.startswith("flexoff") and hasattr(obj, "__dict__"):
            stack += list(vars(obj).values())


def held_tensor_bytes(root, device: torch.device, views_once: bool = False) -> int:
    """Bytes of every tensor on ``device`` reachable from ``root`` through flexoff objects,
    containers and compressed tensors, each tensor object once. Host memory pools are not entered:
    their allocations are reached as the views handed out. ``views_once``: count the bytes the
    tensors span, each byte once, so that views of a buffer kept beside it (the workspace's runs
    cut from its sets) count as the buffer."""
    spans = []
    for obj in reachable(root):
        if isinstance(obj, torch.Tensor) and obj.device == device and obj.numel():
            extent = 1 + sum((size - 1) * stride for size, stride in zip(obj.shape, obj.stride()))
            spans.append((obj.data_ptr(), obj.data_ptr() + extent * obj.element_size(),
                          obj.numel() * obj.element_size()))
    if not views_once:
        return sum(nbytes for _, _, nbytes in spans)
    total, reached = 0, 0
    for start, stop, _ in sorted(spans):
        total += max(0, stop - max(start, reached))
        reached = max(reached, stop)
    return total


def offload_files(base: Path) -> dict[str, int]:
    return {path.name: path.stat().st_size for path in base.rglob("*") if path.is_file() and path.name != OWNER_FILE}


def _check_allocations(path, tmp_path, policy, device, monkeypatch, new=NEW):
    workspaces = []
    make = KVWorkspace.for_block.__func__

    def recording(cls, *args, **kwargs):
        workspaces.append(make(cls, *args, **kwargs))
        return workspaces[-1]

    monkeypatch.setattr(KVWorkspace, "for_block", classmethod(recording))
    with LLM(str(path), policy=policy, offload_dir=str(tmp_path), dtype="float32", device=device) as llm:
        cfg, dtype, weights = llm.config, llm.dtype, llm.engine.weights
        layout = weight_layout(cfg, policy, dtype)
        planned = layout.tier_bytes()
        assert weights.bytes == {tier: sum(s[tier] for s in layout.stage_tiers.values()) for tier in planned}
        assert weights.host.nbytes == planned["cpu"] == sum(layout.host_requests)
        host = held_tensor_bytes(weights, torch.device("cpu"))
        if llm.device.type == "cpu":  # one RAM: what the store holds beyond its host allocations is the device's
            assert host - weights.host.nbytes == planned["gpu"]
        else:
            assert host == planned["cpu"]
            assert held_tensor_bytes(weights, llm.device) == planned["gpu"]
        llm.generate([[7] * PROMPT] * policy.block_size, SamplingParams(max_new_tokens=new, ignore_eos=True))
        # The GPU workspace the block's batches share; none where the block keeps no cache.
        planned_workspace = workspace_layout(cfg, policy, policy.gpu_batch_size, PROMPT + new, dtype.itemsize)
        expected = ([planned_workspace.nbytes(dtype.itemsize) if planned_workspace is not None else None]
                    if new > 1 else [])
        assert [held_tensor_bytes(w, llm.device, views_once=True) if w is not None else None
                for w in workspaces] == expected
        files = offload_files(tmp_path)
        block = block_disk_files(cfg, policy, PROMPT, PROMPT + new, dtype.itemsize)
        # The stages' files keep their names; every other file is the block's cache or activations.
        assert set(layout.disk_files()) <= {"embed", "head", *(f"layer.{i}" for i in range(cfg.num_layers))}
        assert {name: files[name] for name in layout.disk_files()} == layout.disk_files()
        others = Counter(size for name, size in files.items() if name not in layout.disk_files())
        assert others == Counter(block)
        assert (planned["disk"] > 0) == bool(layout.disk_files())


@pytest.mark.parametrize("name", POLICIES)
def test_the_engine_allocates_what_the_layout_lists(tiny_model_dir, tmp_path, monkeypatch, name):
    path, _ = tiny_model_dir("opt-post-proj")
    _check_allocations(path, tmp_path, POLICIES[name], "cpu", monkeypatch)


@pytest.mark.parametrize("name", ["every tier", "compressed on disk"])
def test_a_block_generating_one_token_allocates_no_cache(tiny_model_dir, tmp_path, monkeypatch, name):
    """Its cache would never be read: the layout lists no cache files or workspace for it, and the
    engine makes none (only the disk rows' hidden states have files)."""
    path, _ = tiny_model_dir("opt-post-proj")
    policy = POLICIES[name]
    with LLM(str(path), policy=policy, offload_dir=str(tmp_path), dtype="float32", device="cpu") as probe:
        kept = block_disk_files(probe.config, policy, PROMPT, PROMPT + 2, probe.dtype.itemsize)
        one = block_disk_files(probe.config, policy, PROMPT, PROMPT + 1, probe.dtype.itemsize)
        # The cache's files are gone, the hidden states' stay.
        assert len(one) < len(kept) if policy.cache.disk else one == kept
        need = {new: job_bytes(probe.config, policy, probe.dtype, PROMPT, new) for new in (1, 2)}
        assert need[1]["cpu"] < need[2]["cpu"] and need[1]["disk"] <= need[2]["disk"]
    _check_allocations(path, tmp_path, policy, "cpu", monkeypatch, new=1)


@pytest.mark.parametrize("kind, name", [("mixtral", "every tier"), ("qwen2-moe", "compressed on disk"),
                                        ("qwen3-moe", "cpu attention")])
def test_a_mixture_of_experts_allocates_what_the_layout_lists(tiny_model_dir, tmp_path, monkeypatch, kind, name):
    path, _ = tiny_model_dir(kind)
    _check_allocations(path, tmp_path, POLICIES[name], "cpu", monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("name", POLICIES)
def test_the_engine_allocates_what_the_layout_lists_on_cuda(tiny_model_dir, tmp_path, monkeypatch, name):
    path, _ = tiny_model_dir("opt-post-proj")
    _check_allocations(path, tmp_path, POLICIES[name], "cuda", monkeypatch)


@pytest.mark.parametrize("short", [None, "device (cpu)", "cpu"])
def test_the_runtime_accepts_exactly_what_the_layout_says_fits(tiny_model_dir, tmp_path, short):
    """On the CPU the device tier takes its share of the RAM the cpu tier leaves: a byte less than
    the layout's figure for either is refused before anything loads."""
    path, _ = tiny_model_dir("opt-post-proj")
    policy = POLICIES["every tier"]
    with LLM(str(path), policy=policy, offload_dir=str(tmp_path), dtype="float32", device="cpu") as probe:
        need = job_bytes(probe.config, policy, probe.dtype, PROMPT, NEW)
    gpu_mem = need["gpu"] - (short == "device (cpu)")
    cpu_mem = need["cpu"] - 1 if short == "cpu" else need["cpu"] + need["gpu"]
    build = lambda: LLM(str(path), policy=policy, offload_dir=str(tmp_path), dtype="float32",  # noqa: E731
                        device="cpu", gpu_mem=gpu_mem, cpu_mem=cpu_mem, workload=Workload(PROMPT, NEW))
    if short is not None:
        with pytest.raises(PolicyError, match=rf"on the {re.escape(short)} tier.*short by 1 B"):
            build()
        return
    with build() as llm:
        out = llm.generate([[7] * PROMPT] * policy.block_size, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    assert len(out) == policy.block_size


def _moe_config(hidden: int, width: int, shared: int = 0):
    from flexoff.models.config import ModelConfig

    return ModelConfig(name="tiny-moe", family="llama", vocab_size=64, hidden_size=hidden, num_layers=2,
                       num_heads=4, num_kv_heads=2, intermediate_size=40, max_positions=64, num_experts=4,
                       experts_per_token=2, expert_intermediate_size=width, shared_expert_intermediate_size=shared)


def _sparse_mlp_inputs(cfg, tokens: int, dtype, device):
    from flexoff.models import moe

    generator = torch.Generator().manual_seed(0)
    weights = {spec.name: torch.randn(spec.shape, generator=generator).to(device, dtype)
               for spec in moe.mlp_specs(cfg, 0)}
    return weights, torch.randn(1, tokens, cfg.hidden_size, generator=generator).to(device, dtype)


# Shapes where each of the layout's moments is the largest: the outputs gathered back (hidden
# above the experts' width), the activation beside both gate halves (width over twice hidden),
# down's output beside its pieces (per expert only), and the shared expert (wide).
SPARSE_SHAPES = [(32, 16, 0), (16, 48, 0), (16, 24, 0), (16, 8, 96)]


@pytest.mark.parametrize("grouped", [True, False])
@pytest.mark.parametrize("hidden, width, shared", SPARSE_SHAPES)
@pytest.mark.parametrize("tokens, chunk", [(1, None), (37, None), (37, 16)])
def test_a_sparse_mlp_peaks_at_the_layouts_working_memory(monkeypatch, grouped, hidden, width, shared, tokens,
                                                          chunk):
    """The bytes live at once while a sparse layer's MLP runs, from the profiler's record of every
    allocation and free (its memory timeline), equal the layout's figure; with the grouped matmul
    kernel, or a matmul per expert whose pieces are then joined; and in chunks of tokens."""
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import Action

    from flexoff.layout import sparse_mlp_bytes
    from flexoff.models import moe

    cfg = _moe_config(hidden, width, shared)
    if not grouped:
        monkeypatch.setattr(moe, "_grouped_kernel_fits", lambda *args: False)
    if chunk:
        monkeypatch.setattr(moe, "chunk_tokens", lambda cfg: chunk)
    weights, x = _sparse_mlp_inputs(cfg, tokens, torch.float32, "cpu")
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                 with_stack=True) as prof:
        moe.sparse_mlp(cfg, weights, x)
    live = peak = 0
    for _time, action, _key, size in prof._memory_profile().timeline:
        live += size if action == Action.CREATE else -size if action == Action.DESTROY else 0
        peak = max(peak, live)
    planned = sparse_mlp_bytes(cfg, tokens, 4)
    if grouped and 3 * hidden + 3 * width > max(hidden + 4 * width, 4 * hidden + 2 * width):
        # The layout counts down's pieces, which only the per-expert path makes.
        assert peak <= planned
    else:
        assert peak == planned


@pytest.mark.gpu
@pytest.mark.parametrize("hidden, width, shared", SPARSE_SHAPES)
def test_a_sparse_mlp_on_cuda_stays_within_the_layouts_working_memory(hidden, width, shared):
    from flexoff.layout import sparse_mlp_bytes
    from flexoff.models import moe

    cfg = _moe_config(hidden * 8, width * 8, shared * 8)
    tokens = 512
    weights, x = _sparse_mlp_inputs(cfg, tokens, torch.float16, "cuda")
    moe.sparse_mlp(cfg, weights, x)  # once first: cuBLAS keeps its workspace from the first matmul on
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    moe.sparse_mlp(cfg, weights, x)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    planned = sparse_mlp_bytes(cfg, tokens, 2)
    # The caching allocator rounds each block up to 512 bytes, and the sort, top-k and scatter take
    # temporary storage of their own: together far under 1 MiB for these 1024 pairs.
    assert peak <= planned + (1 << 20)
    h, w, pairs = cfg.hidden_size, cfg.expert_intermediate_size, tokens * cfg.experts_per_token
    if moe._grouped_kernel_fits(x.reshape(-1, h), weights[moe.DOWN]) \
            and 3 * h + 3 * w > max(h + 4 * w, 3 * h + 2 * w):
        # The layout's largest moment is down's pieces, which only a matmul per expert makes; the
        # grouped kernel's largest is the rows gathered back beside down's output, rows and gate-up.
        assert peak >= 8 * pairs + (pairs * (3 * h + 2 * w) + tokens * h) * 2
    else:
        assert planned <= peak
