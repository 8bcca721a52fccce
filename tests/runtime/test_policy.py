"""Bad policies are refused with a clear message before anything large is allocated."""

import json
import os

import pytest

from flexoff import LLM, CompressionConfig, Policy, SamplingParams, TierFractions
from flexoff.errors import PolicyError


@pytest.mark.parametrize("make, message", [
    (lambda: TierFractions(-0.1, 1.1, 0).validate("weight"), "negative"),
    (lambda: Policy(weights=TierFractions(0.5, 0.4, 0)), "sum to 0.9"),
    (lambda: Policy(gpu_batch_size=0), "gpu_batch_size"),
    (lambda: Policy(num_gpu_batches=-1), "num_gpu_batches"),
])
def test_invalid_policy(make, message):
    with pytest.raises(PolicyError, match=message):
        make()


def test_policy_json_round_trip_and_unknown_field(tmp_path):
    policy = Policy(gpu_batch_size=48, num_gpu_batches=3, weights=TierFractions(0.2, 0.8, 0), cpu_attention=True)
    path = tmp_path / "p.json"
    policy.save(path)
    assert Policy.load(path) == policy
    data = json.loads(path.read_text())
    data["weigths"] = data.pop("weights")
    path.write_text(json.dumps(data))
    with pytest.raises(PolicyError, match="weigths"):
        Policy.load(path)


def test_disk_without_offload_dir_goes_in_the_temporary_folder_and_leaves_nothing(monkeypatch, tmp_path):
    import tempfile

    monkeypatch.delenv("FLEXOFF_OFFLOAD_DIR", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with LLM("opt-125m", dummy=True, policy=Policy(weights=TierFractions(0, 0.5, 0.5))) as llm:
        assert any(tmp_path.iterdir()), "the disk tier's private folder is in the temporary folder"
        out = llm.generate([[2, 100, 200]], SamplingParams(max_new_tokens=2, ignore_eos=True))
        assert len(out[0].token_ids) == 2
    assert not any(tmp_path.iterdir())


def test_unwritable_offload_dir(tmp_path):
    target = tmp_path / "file-not-dir"
    target.write_text("x")
    with pytest.raises(PolicyError, match="offload directory"):
        LLM("opt-125m", dummy=True, policy=Policy(weights=TierFractions(0, 0.5, 0.5)), offload_dir=str(target / "x"))


def test_policy_that_cannot_fit_names_tier_and_shortfall():
    with pytest.raises(PolicyError, match=r"device \(cpu\) tier.*short by"):
        LLM("opt-125m", dummy=True, gpu_mem="64MiB")
    llm = LLM("opt-125m", dummy=True, policy=Policy(weights=TierFractions(0, 1, 0), gpu_batch_size=64),
              gpu_mem="500MiB")
    with pytest.raises(PolicyError, match=r"block of 64 sequences.*device \(cpu\) tier"):
        llm.generate([[5] * 1500] * 64)


def test_failure_midway_leaves_no_offload_files(tmp_path, monkeypatch):
    policy = Policy(weights=TierFractions(0, 0.5, 0.5), cache=TierFractions(0, 0, 1), gpu_batch_size=2)
    llm = LLM("opt-125m", dummy=True, policy=policy, offload_dir=str(tmp_path))
    assert len(os.listdir(tmp_path)) == 1
    from flexoff.runtime import batch

    def explode(self, weights):
        raise RuntimeError("boom")

    monkeypatch.setattr(batch.GpuBatch, "embed", explode)
    with pytest.raises(RuntimeError):
        llm.generate([[5, 6, 7]] * 3)
    llm.close()
    assert os.listdir(tmp_path) == []


def test_block_memory_counts_the_host_workers_queue():
    from flexoff.models import REGISTRY
    from flexoff.layout import block_bytes, kv_cache_bytes
    from flexoff.runtime.tiers import HostWorker

    cfg = REGISTRY["opt-125m"]
    on_gpu = Policy(4, 2, TierFractions(1, 0, 0), TierFractions(1, 0, 0), TierFractions(1, 0, 0))
    on_cpu = Policy(4, 2, TierFractions(1, 0, 0), TierFractions(0, 1, 0), TierFractions(1, 0, 0))
    prompt, gen = 16, 8

    def beyond_cache(policy):
        return {t: block_bytes(cfg, policy, prompt, gen, 2)[t] - kv_cache_bytes(cfg, policy, prompt + gen, 2)[t]
                for t in ("gpu", "cpu")}

    # Each queued prefill job keeps one batch's new keys and values (4 rows x 16 tokens) on the GPU.
    per_job = 2 * 4 * prompt * cfg.num_kv_heads * cfg.head_dim * 2
    assert beyond_cache(on_cpu)["gpu"] - beyond_cache(on_gpu)["gpu"] == HostWorker.MAX_IN_FLIGHT * per_job
    assert beyond_cache(on_cpu)["cpu"] - beyond_cache(on_gpu)["cpu"] == 2 * HostWorker.CHUNK


@pytest.mark.parametrize("make", [lambda: Policy(gpu_batch_size=2**20 + 1), lambda: Policy(num_gpu_batches=10**20),
                                  lambda: CompressionConfig(4, 10**20)])
def test_batch_and_group_sizes_past_any_real_one_are_refused(make):
    """Sizes computed from them would overflow torch's shapes: refused as a policy error instead."""
    with pytest.raises(PolicyError, match="must be an integer in"):
        make()
