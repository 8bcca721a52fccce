"""CPU attention handed to the host worker: a batch's decode layer waits half-done while the next
batches' GPU work is enqueued. Tokens and logprobs must still be those of the plain run, whatever
the batches' prompt lengths, cache tiers and compression, and when a batch stops early."""

import random
from functools import partial
import threading
import weakref

import pytest
import torch

from flexoff import Policy, SamplingParams, TierFractions
from flexoff.runtime.sampler import BatchSampler
from flexoff.runtime.interpreter import BlockInterpreter
from flexoff.runtime import kv as kv_module
from flexoff.runtime.kv_storage import ROW_MAJOR
from flexoff.policy import CompressionConfig
from flexoff.runtime.tiers import HostWorker, Streams
from tests.conftest import WORDS, assert_same_outputs, build_tokenizer, generate

OVERLAP_WAIT_SECONDS = 120  # a CPU attention call waits for the main thread to compute on

KINDS = ["opt-post-proj", "llama-gqa"]
PARAMS = SamplingParams(max_new_tokens=6, ignore_eos=True)
FOUR_BIT = CompressionConfig(4, 4)


def random_prompts(count: int, seed: int) -> list[str]:
    """Prompts of clearly different lengths, so that every GPU batch has its own padding and slots."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(1 + 2 * i + rng.randrange(2))) for i in range(count)]


PROMPTS = random_prompts(8, seed=11)
# Four GPU batches of two prompts; batches of three put one row on each tier of the mixed split.
CASES = {
    "cpu": {"cache": TierFractions(0, 1, 0)},
    "disk": {"cache": TierFractions(0, 0, 1)},
    "mixed": {"cache": TierFractions(0.34, 0.33, 0.33), "gpu_batch_size": 3, "num_gpu_batches": 3},
    "cpu-activations-offloaded": {"cache": TierFractions(0, 1, 0), "activations": TierFractions(0, 1, 0)},
    "mixed-weights-offloaded": {"cache": TierFractions(0.34, 0.33, 0.33), "gpu_batch_size": 3,
                                "num_gpu_batches": 3, "weights": TierFractions(0, 0.5, 0.5)},
    "cpu-no-overlap": {"cache": TierFractions(0, 1, 0), "overlap": False},
}


def cpu_attention_policy(**changes) -> Policy:
    base = {"gpu_batch_size": 2, "num_gpu_batches": 4, "cpu_attention": True}
    base.update(changes)
    return Policy(**base)


run = partial(generate, prompts=PROMPTS, params=PARAMS)
assert_same = partial(assert_same_outputs, rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def plain(tiny_model_dir, tmp_path_factory):
    """plain(kind, compression): everything on the device, one batch of all prompts; each run once."""
    cache = {}

    def reference(kind: str, compression: CompressionConfig | None = None):
        if (kind, compression) not in cache:
            path, _ = tiny_model_dir(kind)
            policy = Policy(gpu_batch_size=len(PROMPTS), compress_cache=compression)
            cache[kind, compression] = run(path, policy, tmp_path_factory.mktemp("ref"))
        return cache[kind, compression]

    return reference


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case", list(CASES))
def test_cpu_attention_matches_plain_run(tiny_model_dir, plain, tmp_path, kind, case):
    path, _ = tiny_model_dir(kind)
    assert_same(run(path, cpu_attention_policy(**CASES[case]), tmp_path), plain(kind))


@pytest.fixture(scope="module")
def four_layers(tmp_path_factory):
    """A tiny Llama of four layers: the ring of two layer buffers then holds layer j + 2 where layer
    j was, so a prefetch that overtook a pending layer j would hand it the wrong weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    directory = tmp_path_factory.mktemp("llama-4-layers")
    torch.manual_seed(5)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=4, intermediate_size=40, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=False))
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.2)
    model.save_pretrained(directory)
    build_tokenizer(directory, "<s>", "</s>", "<pad>")
    return directory


@pytest.mark.parametrize("weights", [TierFractions(0, 1, 0), TierFractions(0.2, 0.4, 0.4)], ids=["cpu", "mixed"])
def test_offloaded_weights_are_not_reloaded_under_a_pending_layer(four_layers, tmp_path, weights):
    ref = run(four_layers, Policy(gpu_batch_size=len(PROMPTS)), tmp_path)
    outs = run(four_layers, cpu_attention_policy(cache=TierFractions(0, 1, 0), weights=weights), tmp_path)
    assert_same(outs, ref)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case", ["cpu", "mixed"])
def test_compressed_cpu_attention_matches_compressed_plain_run(tiny_model_dir, plain, tmp_path, kind, case):
    path, _ = tiny_model_dir(kind)
    policy = cpu_attention_policy(compress_cache=FOUR_BIT, **CASES[case])
    assert_same(run(path, policy, tmp_path), plain(kind, FOUR_BIT))


@pytest.mark.parametrize("kind", KINDS)
def test_batches_stopping_early_leave_the_others_right(tiny_model_dir, plain, tmp_path, kind, monkeypatch):
    """Short budgets group into batches that finish, and drop out of the schedule, while the
    others go on; one batch stops at once, after its prefill."""
    path, _ = tiny_model_dir(kind)
    budgets = [1, 2, 6, 2, 6, 3, 6, 1]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in budgets]
    head_batches = []
    choose = BatchSampler.choose

    def watch(self, logits, live):  # record each batch's size at every head, to see batches drop out
        head_batches.append(len(self))
        return choose(self, logits, live)

    monkeypatch.setattr(BatchSampler, "choose", watch)
    outs = run(path, cpu_attention_policy(cache=TierFractions(0, 0.5, 0.5)), tmp_path, params=params)
    assert len(head_batches) < 4 * max(budgets)  # some batch left the schedule before the end
    ref = plain(kind)
    assert [o.token_ids for o in outs] == [r.token_ids[:n] for r, n in zip(ref, budgets)]
    for out, r, n in zip(outs, ref, budgets):
        torch.testing.assert_close(torch.tensor(out.logprobs), torch.tensor(r.logprobs[:n]), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("activations", [TierFractions(1, 0, 0), TierFractions(0, 1, 0)], ids=["gpu", "cpu"])
def test_cpu_attention_overlaps_the_next_batches_compute(tiny_model_dir, plain, tmp_path, monkeypatch, activations):
    """Each batch's CPU attention waits until the main thread has gone on to compute another
    batch: that can only happen if the main thread does not wait for it right away, not even to
    store the batch's activations on the CPU."""
    path, _ = tiny_model_dir("llama-gqa")
    progress = threading.Condition()
    computes = [0]
    job_start = threading.local()
    waits = []
    submit, attend = HostWorker.submit, kv_module.cpu_attention

    def counting(handler):  # a step that enqueues GPU work for a batch
        def count(self, step):
            with progress:
                computes[0] += 1
                progress.notify_all()
            return handler(self, step)

        return count

    def remembering_submit(self, fn, ready):
        submitted = computes[0]

        def job():
            job_start.computes = submitted
            return fn()

        return submit(self, job, ready)

    def gated_attention(*args, **kwargs):
        # With the main thread blocked, the wait ends only at its limit, which no load reaches
        # otherwise. Once one has, the test has failed, and the other calls need not wait as long.
        with progress:
            waits.append(progress.wait_for(lambda: computes[0] > job_start.computes,
                                           timeout=OVERLAP_WAIT_SECONDS if all(waits) else 0.1))
        return attend(*args, **kwargs)

    for kind in ("compute", "start_attention"):
        monkeypatch.setattr(BlockInterpreter, kind, counting(getattr(BlockInterpreter, kind)))
    monkeypatch.setattr(HostWorker, "submit", remembering_submit)
    monkeypatch.setattr(kv_module, "cpu_attention", gated_attention)
    outs = run(path, cpu_attention_policy(cache=TierFractions(0, 1, 0), activations=activations, gpu_batch_size=3,
                                          num_gpu_batches=3), tmp_path)
    # Three batches, two layers, five decode steps.
    assert len(waits) == 3 * 2 * (PARAMS.max_new_tokens - 1)
    assert all(waits), f"{waits.count(False)} of {len(waits)} CPU attention calls blocked the main thread"
    assert_same(outs, plain("llama-gqa"))


@pytest.mark.parametrize("shape, chunk", [((3, 2, 5, 8), 64), ((2, 3, 7, 4), 40), ((2, 2, 3, 4), 1 << 20)])
def test_staged_copy_fills_a_strided_target_chunk_by_chunk(shape, chunk):
    """Keys written into the slots [2, 2 + seq) of a row-major cache through two small chunks."""
    rows, heads, seq, head_dim = shape
    cache = torch.randn(rows, heads, seq + 4, head_dim)
    expected = cache.clone()
    keys = torch.randn(rows, heads, seq, head_dim)
    expected[:, :, 2:2 + seq] = keys
    worker = HostWorker(torch.device("cpu"), Streams(torch.device("cpu"), True), pin=False)
    worker.CHUNK = chunk
    target = ROW_MAJOR.arrange(cache).narrow(ROW_MAJOR.slot_dim, 2, seq)
    assert not target.is_contiguous()
    worker.staged_copy(target, ROW_MAJOR.arrange(keys))
    torch.testing.assert_close(cache, expected, rtol=0, atol=0)
    codes = torch.randint(0, 255, (rows, heads, seq + 4, 3), dtype=torch.uint8)  # a compressed part
    fresh = torch.randint(0, 255, (rows, heads, seq, 3), dtype=torch.uint8)
    worker.staged_copy(codes[:, :, 1:1 + seq], fresh)
    assert torch.equal(codes[:, :, 1:1 + seq], fresh)
    worker.close()


def test_worker_errors_reach_the_caller():
    worker = HostWorker(torch.device("cpu"), Streams(torch.device("cpu"), True), pin=False)

    def fail():
        raise ValueError("host job failed")

    worker.submit(fail, None)
    with pytest.raises(ValueError, match="host job failed"):
        worker.drain()
    worker.close()


def _job_holding_a_tensor(gate: threading.Event):
    """A job whose closure holds a tensor, and runs once ``gate`` is set; and a weak reference to
    that tensor."""
    held = torch.empty(1)
    return (lambda: gate.wait() and held.numel()), weakref.ref(held)


@pytest.mark.parametrize("how", ["submit", "read", "after"])
def test_a_done_job_holds_nothing_of_its_work(how):
    """By the time a job's future is done, the worker's threads have let go of the job's function:
    its closure holds a block's cache, which must go with the block, not when a thread next wakes."""
    worker = HostWorker(torch.device("cpu"), Streams(torch.device("cpu"), True), pin=False)
    gate = threading.Event()
    job, gone = _job_holding_a_tensor(gate)
    seen = []
    if how == "submit":
        future = worker.submit(job, None)
    elif how == "read":
        future = worker.read(job)
    else:
        future = worker.after(worker.read(gate.wait), job)  # on the reader, once the gate is set
    # A done callback runs on the thread that finishes the job, before that thread moves on.
    future.add_done_callback(lambda f: seen.append(gone() is None))
    del job  # the worker's is now the only one
    gate.set()
    assert future.result() == 1
    worker.drain()
    worker.close()
    assert seen == [True]


# The same on CUDA, where the worker copies on the store stream, through pinned chunks, while the
# main thread enqueues other batches' work.
CUDA = {"device": "cuda", "dtype": "float32"}


def needs_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("compression", [None, FOUR_BIT], ids=["plain", "compressed"])
@pytest.mark.parametrize("case", list(CASES))
def test_cpu_attention_matches_plain_run_on_cuda(tiny_model_dir, tmp_path, kind, case, compression):
    needs_cuda()
    path, _ = tiny_model_dir(kind)
    ref = run(path, Policy(gpu_batch_size=len(PROMPTS), compress_cache=compression), tmp_path, **CUDA)
    outs = run(path, cpu_attention_policy(compress_cache=compression, **CASES[case]), tmp_path, **CUDA)
    assert_same(outs, ref)


@pytest.mark.gpu
def test_offloaded_weights_are_not_reloaded_under_a_pending_layer_on_cuda(four_layers, tmp_path):
    needs_cuda()
    ref = run(four_layers, Policy(gpu_batch_size=len(PROMPTS)), tmp_path, **CUDA)
    policy = cpu_attention_policy(cache=TierFractions(0, 1, 0), weights=TierFractions(0.2, 0.4, 0.4))
    assert_same(run(four_layers, policy, tmp_path, **CUDA), ref)


@pytest.mark.gpu
@pytest.mark.parametrize("overlap", [True, False])
def test_staged_copy_from_the_gpu(overlap):
    needs_cuda()
    device = torch.device("cuda")
    worker = HostWorker(device, Streams(device, overlap), pin=True)
    worker.CHUNK = 4096
    cache = torch.randn(6, 4, 80, 16, dtype=torch.float16)
    keys = torch.randn(6, 4, 48, 16, dtype=torch.float16, device=device)
    expected = cache.clone()
    expected[:, :, 8:56] = keys.cpu()
    ready = torch.cuda.Event()
    ready.record()
    worker.submit(lambda: worker.copy_to_host(cache[:, :, 8:56], keys.transpose(0, 1).transpose(0, 1)), ready)
    worker.drain()
    worker.close()
    assert torch.equal(cache, expected)
