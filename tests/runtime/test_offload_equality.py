"""Every placement, schedule and switch gives exactly the greedy tokens of the all-on-device run."""

import os

import pytest
import torch

from flexoff import LLM, Policy, SamplingParams, TierFractions
from tests.conftest import PROMPTS, assert_same_outputs, generate

ON_GPU = TierFractions(1, 0, 0)
ON_CPU = TierFractions(0, 1, 0)
ON_DISK = TierFractions(0, 0, 1)
MIXED = TierFractions(0.3, 0.5, 0.2)


def policy(**changes) -> Policy:
    base = dict(gpu_batch_size=2, num_gpu_batches=3)
    base.update(changes)
    return Policy(**base)


POLICIES = {
    "weights-gpu": policy(),
    "weights-cpu": policy(weights=ON_CPU),
    "weights-disk": policy(weights=ON_DISK),
    "weights-mixed": policy(weights=MIXED),
    "cache-cpu": policy(cache=ON_CPU),
    "cache-disk": policy(cache=ON_DISK),
    "cache-mixed": policy(cache=TierFractions(0.34, 0.33, 0.33), gpu_batch_size=3, num_gpu_batches=2),
    "cache-cpu-attention": policy(cache=ON_CPU, cpu_attention=True),
    "cache-mixed-cpu-attention": policy(cache=TierFractions(0.34, 0.33, 0.33), gpu_batch_size=3,
                                        num_gpu_batches=2, cpu_attention=True),
    "activations-cpu": policy(activations=ON_CPU),
    "activations-disk": policy(activations=ON_DISK),
    "activations-mixed": policy(activations=TierFractions(0.5, 0.5, 0), gpu_batch_size=4, num_gpu_batches=1),
    "one-gpu-batch": policy(weights=MIXED, cache=ON_CPU, num_gpu_batches=1, gpu_batch_size=5),
    "no-overlap": policy(weights=MIXED, cache=ON_CPU, activations=ON_CPU, overlap=False),
    "everything-off-gpu": policy(weights=TierFractions(0, 0.5, 0.5), cache=TierFractions(0, 0.5, 0.5),
                                 activations=TierFractions(0, 0.5, 0.5), cpu_attention=True),
}

KINDS = ["opt-post-proj", "llama-gqa", "qwen3-qk-norm", "mixtral", "qwen3-moe", "qwen2-moe"]


@pytest.fixture(scope="module")
def references(tiny_model_dir):
    """The plain run: everything on the device, one block holding every prompt."""
    refs = {}
    for kind in KINDS:
        path, _ = tiny_model_dir(kind)
        refs[kind] = generate(path, Policy(gpu_batch_size=8), params=PARAMS)
    return refs


PARAMS = SamplingParams(max_new_tokens=7, ignore_eos=True)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", list(POLICIES))
def test_policy_matches_plain_run(tiny_model_dir, references, tmp_path, kind, name):
    path, _ = tiny_model_dir(kind)
    outs = generate(path, POLICIES[name], tmp_path, params=PARAMS)
    assert_same_outputs(outs, references[kind], rtol=1e-4, atol=1e-5)
    assert os.listdir(tmp_path) == []  # offload files are gone once the model is closed


# A mixture of experts' experts placed apart from its other weights (four experts a layer here).
EXPERT_POLICIES = {
    "experts-cpu-rest-gpu": policy(experts=ON_CPU),
    "experts-spread-rest-cpu": policy(weights=ON_CPU, experts=TierFractions(0.25, 0.5, 0.25), cache=ON_CPU,
                                      cpu_attention=True),
    "experts-gpu-rest-disk": policy(weights=ON_DISK, experts=TierFractions(0.5, 0, 0.5), num_gpu_batches=1,
                                    gpu_batch_size=5),
}


@pytest.mark.parametrize("kind", ["mixtral", "qwen3-moe", "qwen2-moe"])
@pytest.mark.parametrize("name", list(EXPERT_POLICIES))
def test_expert_placement_matches_plain_run(tiny_model_dir, references, tmp_path, kind, name):
    path, _ = tiny_model_dir(kind)
    outs = generate(path, EXPERT_POLICIES[name], tmp_path, params=PARAMS)
    assert_same_outputs(outs, references[kind], rtol=1e-4, atol=1e-5)
    assert os.listdir(tmp_path) == []


# Blocks of one GPU batch of up to 2 sequences route first (four experts a layer, two a token).
ROUTE_FIRST_POLICIES = {
    "experts-cpu": policy(experts=ON_CPU, gpu_batch_size=1, num_gpu_batches=1),
    "experts-spread-rest-cpu": policy(weights=ON_CPU, experts=TierFractions(0.25, 0.5, 0.25), gpu_batch_size=2,
                                      num_gpu_batches=1),
    "experts-disk-cpu-attention": policy(weights=TierFractions(0, 0.5, 0.5), experts=ON_DISK, cache=ON_CPU,
                                         cpu_attention=True, gpu_batch_size=2, num_gpu_batches=1),
}


@pytest.mark.parametrize("kind", ["mixtral", "qwen3-moe", "qwen2-moe"])
@pytest.mark.parametrize("name", list(ROUTE_FIRST_POLICIES))
@pytest.mark.parametrize("compress", [False, True])
def test_route_first_loading_matches_the_plain_run(tiny_model_dir, references, tmp_path, monkeypatch, kind, name,
                                                    compress):
    """Loading a sparse layer's experts after its router, only those its tokens chose, gives the
    tokens of loading them all (compressed weights: of the compressed plain run); and a decode
    step of one sequence copies in at most its k experts of a layer (none that its buffers
    still hold)."""
    from dataclasses import replace

    from flexoff.policy import CompressionConfig
    from flexoff.runtime.weight_store import TieredWeights

    copied = []
    fetch = TieredWeights._fetch_experts

    def counting(self, pieces, buffer, experts):
        before = len(buffer.experts)
        fetch(self, pieces, buffer, experts)
        copied.append((experts.shape[0], len(buffer.experts) - before))

    monkeypatch.setattr(TieredWeights, "_fetch_experts", counting)
    path, _ = tiny_model_dir(kind)
    chosen = ROUTE_FIRST_POLICIES[name]
    reference = references[kind]
    if compress:
        four_bit = CompressionConfig(4, 4)
        chosen = replace(chosen, compress_weight=four_bit)
        reference = generate(path, Policy(gpu_batch_size=8, compress_weight=four_bit), params=PARAMS)
    outs = generate(path, chosen, tmp_path, params=PARAMS)
    assert_same_outputs(outs, reference, rtol=1e-4, atol=1e-5)
    assert copied, "route-first loading was not used"
    assert all(count <= 2 for tokens, count in copied if tokens == 1)
    assert os.listdir(tmp_path) == []


def test_blocks_of_several_batches_or_many_sequences_load_every_expert_ahead(tiny_model_dir, references, tmp_path,
                                                                             monkeypatch):
    """Each block decides for itself: under a policy of 4-sequence blocks, five prompts make a
    smaller block too, which routes first, and the tokens are still the plain run's."""
    from flexoff.runtime.weight_store import TieredWeights

    path, _ = tiny_model_dir("mixtral")
    fetched = []
    fetch = TieredWeights._fetch_experts
    monkeypatch.setattr(TieredWeights, "_fetch_experts", lambda self, *args: pytest.fail("routed first"))
    for chosen in (policy(experts=ON_CPU, gpu_batch_size=1, num_gpu_batches=2),
                   policy(experts=ON_CPU, gpu_batch_size=4, num_gpu_batches=1)):
        generate(path, chosen, tmp_path, params=PARAMS, prompts=PROMPTS[:4])

    def recording(self, pieces, buffer, experts):
        fetched.append(experts.shape[0])
        fetch(self, pieces, buffer, experts)

    monkeypatch.setattr(TieredWeights, "_fetch_experts", recording)
    outs = generate(path, policy(experts=ON_CPU, gpu_batch_size=4, num_gpu_batches=1), tmp_path, params=PARAMS)
    assert_same_outputs(outs, references["mixtral"], rtol=1e-4, atol=1e-5)
    assert fetched and min(fetched) <= 3  # decode steps of a block smaller than the policy's


def test_score_matches_under_offloading(tiny_model_dir, tmp_path):
    path, _ = tiny_model_dir("llama-gqa")
    plain = LLM(str(path)).score(PROMPTS[:3], ["the cat", "sat", "on the mat"])
    offloaded = LLM(str(path), policy=POLICIES["everything-off-gpu"], offload_dir=str(tmp_path)).score(
        PROMPTS[:3], ["the cat", "sat", "on the mat"])
    for a, b in zip(plain, offloaded):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=1e-4, atol=1e-5)


def test_offloaded_activations_keep_only_their_gpu_rows_on_the_gpu():
    """Between stages a batch's GPU share of its hidden state is all that stays in device memory:
    the rows sent to the host do not stay behind in the same storage."""
    from flexoff.runtime.activations import BatchActivations
    from flexoff.runtime.tiers import HostMemory

    host = HostMemory(False)
    store = BatchActivations(8, 5 * 4, TierFractions(0.25, 0.75, 0), torch.device("cpu"), torch.float32, host, None,
                             "batch")
    hidden = torch.randn(8, 5, 4)
    store.put(hidden)
    kept = store._hidden
    assert kept.shape[0] == 2 and kept.untyped_storage().nbytes() == 2 * 5 * 4 * 4
    torch.testing.assert_close(store.get(), hidden)
    host.close()


def test_no_batch_holds_its_hidden_state_past_its_head_step(tiny_model_dir, monkeypatch):
    """After a batch's head step at most the next batch, whose input is loaded a batch ahead, holds a
    hidden state: the block's batches do not each keep their prefill's last one on the GPU."""
    from flexoff.runtime.block_run import BlockRun

    path, _ = tiny_model_dir("llama-gqa")
    held = []
    real = BlockRun.sample

    def sample(self, k, weights):
        real(self, k, weights)
        held.append(sum(b.hidden is not None for b in self.batches))

    monkeypatch.setattr(BlockRun, "sample", sample)
    generate(path, policy(activations=ON_CPU), params=PARAMS)
    assert held and max(held) <= 1


@pytest.mark.parametrize("compress", [False, True])
def test_a_travelling_caches_disk_rows_are_read_and_written_off_the_main_thread(tiny_model_dir, references,
                                                                                 tmp_path, monkeypatch, compress):
    """A file read or write on the main thread (or a copy from the GPU it waits for) would stall
    the enqueuing of every batch behind it: disk rows are written by the host worker and read in by
    its reader, and the tokens stay the plain run's."""
    import threading

    from flexoff.policy import CompressionConfig
    from flexoff.runtime.tiers import DiskRegion

    threads = []
    for name in ("read_into", "write"):
        original = getattr(DiskRegion, name)

        def recording(self, *args, _original=original, **kwargs):
            threads.append(threading.current_thread().name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(DiskRegion, name, recording)
    four_bit = {"compress_cache": CompressionConfig(4, 4)} if compress else {}
    outs = generate(tiny_model_dir("llama-gqa")[0], policy(cache=TierFractions(0.34, 0.33, 0.33), gpu_batch_size=3,
                                                           num_gpu_batches=2, **four_bit), tmp_path, params=PARAMS)
    assert threads and all(name.startswith("flexoff-host") for name in threads), set(threads)
    if not compress:
        assert_same_outputs(outs, references["llama-gqa"])
