"""The cache's steps under the real host worker and its reader threads, over many layers and tokens:
disk rows read a layer ahead (READ_CACHE) for a travelling cache, or read in by CPU attention, with
batches finishing at different tokens. The tokens are the plain run's, and every read made ahead is
the one its layer's load uses."""

import time

import pytest
import torch

from flexoff import LLM, Policy, SamplingParams, TierFractions
from flexoff.runtime import kv
from flexoff.runtime.kv_groups import DiskRows
from flexoff.runtime.tiers import HostWorker
from tests.conftest import build_model

LAYERS = 9  # odd: the two staging pairs (even and odd layers) wrap from the last layer to the first
PROMPTS = [[5 + n % 7] * (1 + n % 4) + [9, 11][:n % 3] for n in range(9)]
# Different lengths, so that the batches finish at different tokens, some while reads are ahead.
PARAMS = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (3, 18, 9, 1, 20, 14, 6, 20, 11)]
SPLIT = TierFractions(0.25, 0.25, 0.5)
POLICIES = {
    "travelling": Policy(gpu_batch_size=3, num_gpu_batches=3, cache=SPLIT),
    "cpu-attention": Policy(gpu_batch_size=3, num_gpu_batches=3, cache=SPLIT, cpu_attention=True,
                            activations=TierFractions(0, 1, 0)),
    "one-batch-disk": Policy(gpu_batch_size=9, num_gpu_batches=1, cache=TierFractions(0, 0, 1)),
}


def slow_drive(monkeypatch, seconds=0.002):
    """Disk rows' reads and writes take a while, as on a drive, and the main thread may run far
    ahead of the worker: a read or load that did not wait for the write or read before it would
    find stale slots, and the tokens would differ."""
    monkeypatch.setattr(HostWorker, "MAX_IN_FLIGHT", 10_000)
    for name in ("load", "put", "write_slot"):
        original = getattr(DiskRows, name)

        def slow(*args, _original=original, **kwargs):
            time.sleep(seconds)
            return _original(*args, **kwargs)

        monkeypatch.setattr(DiskRows, name, slow)


@pytest.fixture(scope="module")
def deep_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama-deep")
    build_model(path, "llama-gqa", layers=LAYERS)
    with LLM(str(path), policy=Policy(gpu_batch_size=9)) as llm:
        return path, llm.generate(PROMPTS, PARAMS)


@pytest.mark.parametrize("name", list(POLICIES))
def test_many_layers_and_tokens_through_the_threads_give_the_plain_runs_tokens(deep_model, tmp_path, monkeypatch,
                                                                                name):
    path, plain = deep_model
    made, reads = [], []  # the reads made ahead; per disk read, (its slots, the read made ahead it took)
    read_ahead, disk_read = kv.BatchKV.read_ahead, kv.BatchKV._disk_read

    def reading_ahead(self, layer, start):
        made.append((layer, start))
        return read_ahead(self, layer, start)

    def reading(self, disk, state, start, ahead):
        reads.append((start, ahead))
        return disk_read(self, disk, state, start, ahead)

    monkeypatch.setattr(kv.BatchKV, "read_ahead", reading_ahead)
    monkeypatch.setattr(kv.BatchKV, "_disk_read", reading)
    slow_drive(monkeypatch)
    with LLM(str(path), policy=POLICIES[name], offload_dir=str(tmp_path)) as llm:
        outs = llm.generate(PROMPTS, PARAMS)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    for out, ref in zip(outs, plain):
        torch.testing.assert_close(torch.tensor(out.logprobs), torch.tensor(ref.logprobs), rtol=0, atol=1e-4)
    if POLICIES[name].cpu_attention:
        assert not reads  # its worker reads disk rows in itself, just before it attends
        return
    used = [(start, ahead) for start, ahead in reads if ahead is not None]
    assert made and len(used) == len(made)  # every read made ahead is taken by its layer's load...
    assert all(ahead[0] == start for start, ahead in used)  # ...for the slots it was made for
    # The loads of the first decode layer, which nothing reads ahead for, read their own.
    first_loads = len(reads) - len(made) - len(used)
    assert first_loads * (LAYERS - 1) == len(made)
