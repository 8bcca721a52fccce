"""Decode layers replayed from CUDA graphs give exactly the tokens and log-probabilities of the
same run enqueued kernel by kernel; where graphs cannot run, the summary says why."""

import pytest
import torch

from flexoff import LLM, CompressionConfig, Policy, SamplingParams, TierFractions
from flexoff.commands.args import job_from_args
from flexoff.commands.main import build_parser
from flexoff.compression import quantize
from flexoff.models import moe
from flexoff.runtime.decode_graphs import DecodeGraphs
from flexoff.runtime.weight_store import StageWeights
from tests.conftest import PROMPTS

FOUR_BIT = CompressionConfig(bits=4, group_size=16)
ON_CPU = TierFractions(0, 1, 0)
PARAMS = SamplingParams(max_new_tokens=7, ignore_eos=True)

# name -> (policy, whether its decode layers take graphs): CPU attention runs each layer's halves
# apart, around the host's attention, and never takes them.
GRAPH_POLICIES = {
    "all-gpu": (Policy(gpu_batch_size=2, num_gpu_batches=3), True),
    "travelling-4bit": (Policy(gpu_batch_size=2, num_gpu_batches=3, weights=TierFractions(0.3, 0.7, 0),
                               cache=ON_CPU, compress_weight=FOUR_BIT, compress_cache=FOUR_BIT), True),
    "cache-disk": (Policy(gpu_batch_size=3, num_gpu_batches=2, cache=TierFractions(0, 0.5, 0.5)), True),
    "one-batch-4bit": (Policy(gpu_batch_size=5, num_gpu_batches=1, weights=TierFractions(0.5, 0.5, 0),
                              compress_weight=FOUR_BIT), True),
    "cpu-attention": (Policy(gpu_batch_size=2, num_gpu_batches=3, cache=ON_CPU, cpu_attention=True), False),
}
KINDS = ["opt-post-proj", "llama-gqa", "qwen3-qk-norm", "mixtral", "qwen3-moe"]


def test_graphs_are_off_on_the_cpu_and_when_turned_off():
    assert DecodeGraphs(torch.device("cpu")).describe() == "off (the device is cpu)"
    assert DecodeGraphs(torch.device("cuda"), enabled=False).describe() == "off (turned off)"
    assert not DecodeGraphs(torch.device("cpu")).enabled


def test_no_cuda_graphs_reaches_the_job():
    parser = build_parser()
    assert job_from_args(parser.parse_args(["run", "--model", "opt-125m"])).cuda_graphs
    assert not job_from_args(parser.parse_args(["run", "--model", "opt-125m", "--no-cuda-graphs"])).cuda_graphs


def test_a_graph_copies_vectors_reads_matrices_in_place_and_dequantizes_per_read_ones_itself():
    matrix, vector = torch.randn(4, 32), torch.randn(32)
    packed = quantize(torch.randn(8, 32), FOUR_BIT.bits, FOUR_BIT.group_size)
    scratch = torch.empty(8 * 32)
    tensors = {"norm": vector, "w": matrix, "q": packed}
    per_read = StageWeights(tensors, scratch)
    copied, in_place, dequantized = DecodeGraphs._split(per_read, ("norm", "w", "q"))
    assert [n for n, _ in copied] == ["norm"] and [n for n, _ in in_place] == ["w"] and dequantized == ["q"]
    assert per_read.read_tensors("q")[-1] is scratch and per_read.read_tensors("w") == [matrix]
    # Dequantized once for the stage's batches: the result stays valid, so the graph reads it in place.
    once = StageWeights(tensors, scratch, dequantized={})
    copied, in_place, dequantized = DecodeGraphs._split(once, ("norm", "w", "q"))
    assert [n for n, _ in in_place] == ["w", "q"] and dequantized == []
    assert in_place[1][1].data_ptr() == scratch.data_ptr()


@pytest.fixture(scope="module")
def eager_runs(tiny_model_dir, tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    runs = {}
    for kind in KINDS:
        path, _ = tiny_model_dir(kind)
        for name, (policy, _) in GRAPH_POLICIES.items():
            with LLM(str(path), policy=policy, device="cuda", dtype="float32", cuda_graphs=False,
                     offload_dir=str(tmp_path_factory.mktemp("eager"))) as llm:
                runs[kind, name] = llm.generate(PROMPTS, PARAMS)
    return runs


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", list(GRAPH_POLICIES))
def test_graphs_give_the_eager_run_exactly(tiny_model_dir, eager_runs, tmp_path, kind, name):
    path, _ = tiny_model_dir(kind)
    policy, takes_graphs = GRAPH_POLICIES[name]
    with LLM(str(path), policy=policy, device="cuda", dtype="float32", offload_dir=str(tmp_path)) as llm:
        outs = llm.generate(PROMPTS, PARAMS)
        graphs = llm.engine.graphs
        assert graphs.enabled, graphs.describe()
        assert (graphs.replays > 0) == takes_graphs, graphs.describe()
    ref = eager_runs[kind, name]
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert [o.logprobs for o in outs] == [o.logprobs for o in ref]


@pytest.mark.gpu
def test_bfloat16_graphs_give_the_eager_run(tiny_model_dir):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    path, _ = tiny_model_dir("llama-gqa")
    policy = Policy(gpu_batch_size=2, num_gpu_batches=3, weights=TierFractions(0.5, 0.5, 0), compress_weight=FOUR_BIT)
    outs = {}
    for graphs in (False, True):
        with LLM(str(path), policy=policy, device="cuda", dtype="bfloat16", cuda_graphs=graphs) as llm:
            outs[graphs] = llm.generate(PROMPTS, PARAMS)
            assert (llm.engine.graphs.replays > 0) == graphs
    assert [o.token_ids for o in outs[True]] == [o.token_ids for o in outs[False]]
    assert [o.logprobs for o in outs[True]] == [o.logprobs for o in outs[False]]


@pytest.mark.gpu
def test_a_capture_without_room_runs_eagerly_and_says_so(tiny_model_dir, eager_runs, monkeypatch):
    import flexoff.runtime.decode_graphs as decode_graphs

    monkeypatch.setattr(decode_graphs, "CAPTURE_ROOM", 1 << 50)
    path, _ = tiny_model_dir("llama-gqa")
    policy, _ = GRAPH_POLICIES["all-gpu"]
    with LLM(str(path), policy=policy, device="cuda", dtype="float32") as llm:
        outs = llm.generate(PROMPTS, PARAMS)
        graphs = llm.engine.graphs
        assert graphs.replays == 0 and graphs.short_of_memory > 0
        assert "not captured for want of GPU memory" in graphs.describe()
    assert [o.logprobs for o in outs] == [o.logprobs for o in eager_runs["llama-gqa", "all-gpu"]]


def _sparse_halves(graphs: DecodeGraphs) -> int:
    """Graphs of a sparse layer's second half: keys of kind "after" whose weights hold a router."""
    return sum(1 for key in graphs._graphs if key[0][0][0] == "after" and moe.ROUTER in key[0][0][1])


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["mixtral", "qwen3-moe"])
@pytest.mark.parametrize(("policy", "replays_sparse"), [
    (Policy(gpu_batch_size=2, num_gpu_batches=3, weights=TierFractions(0.5, 0.5, 0), compress_weight=FOUR_BIT), True),
    # One GPU batch of one sequence loads its experts once routed: that half stays eager.
    (Policy(gpu_batch_size=1, num_gpu_batches=1, weights=ON_CPU), False),
], ids=["all-experts", "route-first"])
def test_a_sparse_layers_second_half_replays_where_the_fused_kernels_run(fused_moe_kernels, tiny_model_dir, kind,
                                                                         policy, replays_sparse):
    path, _ = tiny_model_dir(kind)
    outs = {}
    for graphs in (False, True):
        with LLM(str(path), policy=policy, device="cuda", dtype="bfloat16", cuda_graphs=graphs) as llm:
            outs[graphs] = llm.generate(PROMPTS, PARAMS)
            if graphs:
                assert llm.engine.graphs.replays > 0, llm.engine.graphs.describe()
                assert (_sparse_halves(llm.engine.graphs) > 0) == replays_sparse
    assert [o.token_ids for o in outs[True]] == [o.token_ids for o in outs[False]]
    assert [o.logprobs for o in outs[True]] == [o.logprobs for o in outs[False]]
