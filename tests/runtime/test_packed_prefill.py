"""A prefill whose rows pad enough runs its matmuls over the real positions alone
(``runtime.packed_prefill``): the outputs are those of the padded prefill under every placement,
compression, CPU attention, prefix sharing, ``n``, stop tokens and family, and the layers see no padding."""

import random

import pytest
import torch

from flexoff import LLM, Policy, SamplingParams, TierFractions
from flexoff.policy import CompressionConfig
from flexoff.prefixes import MIN_SHARED_PREFIX
from flexoff.runtime import packed_prefill
from flexoff.runtime.packed_prefill import PackedPrefill
from tests.conftest import assert_same_outputs

ON_CPU, SPREAD = TierFractions(0, 1, 0), TierFractions(0.25, 0.5, 0.25)
FOUR_BIT = CompressionConfig(4, 4)


def policy(**changes) -> Policy:
    return Policy(**{"gpu_batch_size": 4, "num_gpu_batches": 2, **changes})


POLICIES = {
    "on-device": policy(),
    "cache-spread": policy(cache=SPREAD),
    "cache-cpu-attention": policy(cache=ON_CPU, cpu_attention=True),
    "compressed": policy(cache=SPREAD, compress_cache=FOUR_BIT, compress_weight=FOUR_BIT),
    "activations-spread": policy(activations=SPREAD),
    "everything-off-gpu": policy(weights=TierFractions(0, 0.5, 0.5), cache=TierFractions(0, 0.5, 0.5),
                                 activations=TierFractions(0, 0.5, 0.5), cpu_attention=True),
}
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def ragged(seed: int = 0, count: int = 8) -> list[list[int]]:
    """Prompts of 2 to 24 ids: every GPU batch pads a good share of its positions."""
    rng = random.Random(seed)
    return [[rng.randrange(4, 60) for _ in range(rng.randrange(2, 25))] for _ in range(count)]


def few_shot(seed: int = 1) -> list[list[int]]:
    """Two subjects of four questions behind a shared head, the questions 1 to 12 ids long."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(2):
        head = [rng.randrange(4, 60) for _ in range(MIN_SHARED_PREFIX + 3)]
        prompts += [head + [rng.randrange(4, 60) for _ in range(rng.randrange(1, 13))] for _ in range(4)]
    return prompts


@pytest.fixture
def packs(monkeypatch):
    """Every prefill's packings, as the runtime makes them (its positions count)."""
    made = []
    real_init = PackedPrefill.__init__

    def spy(self, lengths, width, device):
        real_init(self, lengths, width, device)
        made.append((list(lengths), width))

    monkeypatch.setattr(PackedPrefill, "__init__", spy)
    return made


def run(path, name, device, tmp_path, prompts, params, **llm_args):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    with LLM(str(path), policy=POLICIES[name], device=device, dtype="float32", offload_dir=str(tmp_path),
             **llm_args) as llm:
        return llm.generate([{"prompt_token_ids": p} for p in prompts], params)


def padded_and_packed(monkeypatch, packs, *args, **kwargs):
    """(packed outputs, padded outputs): the padded run with packing never paying."""
    packed = run(*args, **kwargs)
    assert packs, "no prefill was packed"
    with monkeypatch.context() as patch:
        patch.setattr(packed_prefill, "MIN_PADDING_SHARE", 2.0)
        count = len(packs)
        padded = run(*args, **kwargs)
        assert len(packs) == count, "the padded run packed"
    return packed, padded


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["opt-pre", "opt-post-proj", "llama-gqa", "qwen3-qk-norm", "qwen3-moe"])
@pytest.mark.parametrize("name", list(POLICIES))
def test_packed_prefill_gives_the_padded_outputs(tiny_model_dir, tmp_path, monkeypatch, packs, device, kind, name):
    path, _ = tiny_model_dir(kind)
    params = SamplingParams(max_tokens=5, ignore_eos=True, logprobs=1)
    packed, padded = padded_and_packed(monkeypatch, packs, path, name, device, tmp_path, ragged(), params)
    assert_same_outputs(packed, padded)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["opt-post-proj", "llama-gqa"])
def test_packed_prefill_under_shared_prefixes_samples_and_stops(tiny_model_dir, tmp_path, monkeypatch, packs,
                                                                device, kind):
    """The rows' own parts packed behind their shared prefixes; seeded samples, n > 1 and a stop
    token alike."""
    path, _ = tiny_model_dir(kind)
    params = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.9, seed=3, n=2, logprobs=1)
    packed, padded = padded_and_packed(monkeypatch, packs, path, "cache-spread", device, tmp_path, few_shot(),
                                       params, prefix_sharing=True)
    for a, b in zip(packed, padded, strict=True):
        assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
        for x, y in zip(a.outputs, b.outputs, strict=True):
            torch.testing.assert_close(torch.tensor(x.cumulative_logprob), torch.tensor(y.cumulative_logprob),
                                       rtol=0, atol=1e-4)
    assert packed.metrics.shared_prompt_tokens > 0
    stop = SamplingParams(max_tokens=8, ignore_eos=True, stop_token_ids=[packed[0].token_ids[2]])
    packed, padded = padded_and_packed(monkeypatch, packs, path, "on-device", device, tmp_path, few_shot(), stop,
                                       prefix_sharing=True)
    assert_same_outputs(packed, padded)


def choices(seed: int = 2) -> list[list[int]]:
    """Contexts of MIN_SHARED_PREFIX to 3 x MIN_SHARED_PREFIX ids, each with two continuations of 1
    to 4 ids: a multiple-choice job, whose prefixes differ in length (two to a GPU batch of four)."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(4):
        context = [rng.randrange(4, 60) for _ in range(rng.randrange(MIN_SHARED_PREFIX, 3 * MIN_SHARED_PREFIX))]
        prompts += [context + [rng.randrange(4, 60) for _ in range(rng.randrange(1, 5))] for _ in range(2)]
    return prompts


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["opt-pre", "llama-gqa", "qwen3-moe"])
@pytest.mark.parametrize("name", ["on-device", "cache-cpu-attention", "compressed"])
def test_prefixes_of_different_lengths_pack_too(tiny_model_dir, tmp_path, monkeypatch, packs, device, kind, name):
    path, _ = tiny_model_dir(kind)
    prompts = choices()
    params = SamplingParams(max_tokens=3, ignore_eos=True, logprobs=1)
    packed, padded = padded_and_packed(monkeypatch, packs, path, name, device, tmp_path, prompts, params,
                                       prefix_sharing=True)
    assert_same_outputs(packed, padded)
    assert packed.metrics.shared_prompt_tokens > 0
    # A packing of the prefixes themselves: two rows of a batch's two contexts' lengths.
    assert any(len(lengths) == 2 and min(lengths) >= MIN_SHARED_PREFIX and len(set(lengths)) == 2
               for lengths, _ in packs[:len(packs) // 2]), packs


@pytest.mark.parametrize("device", DEVICES)
def test_packed_prefill_of_a_prompts_samples(tiny_model_dir, tmp_path, monkeypatch, packs, device):
    """n samples of ragged prompts: the prefill packs each distinct prompt once, and every sample's
    cache is filled from its prompt's."""
    path, _ = tiny_model_dir("llama-gqa")
    params = SamplingParams(max_tokens=5, ignore_eos=True, temperature=1.0, seed=5, n=3, logprobs=1)
    # Under MIN_SHARED_PREFIX ids: no prefix groups, only a prompt's samples sharing its prefill.
    prompts = [p[:n] for p, n in zip(ragged(count=3), (3, 9, 15))]
    packed, padded = padded_and_packed(monkeypatch, packs, path, "cache-spread", device, tmp_path, prompts, params)
    assert sum(len(lengths) for lengths, _ in packs[:len(packs) // 2]) < 3 * len(prompts)  # samples prefilled once
    for a, b in zip(packed, padded, strict=True):
        assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
        assert len({tuple(o.token_ids) for o in a.outputs}) > 1  # the samples differ
        torch.testing.assert_close(torch.tensor([o.cumulative_logprob for o in a.outputs]),
                                   torch.tensor([o.cumulative_logprob for o in b.outputs]), rtol=0, atol=1e-4)


def test_the_layers_see_only_real_positions(tiny_model_dir, tmp_path, monkeypatch, packs):
    """Each prefill layer's MLP multiplies as many positions as the packed prompts hold."""
    from flexoff.models import moe

    path, _ = tiny_model_dir("llama-gqa")
    rows = []
    real_swiglu = moe.swiglu

    def counting(w, x, prefix):
        rows.append(x.shape[:-1].numel())
        return real_swiglu(w, x, prefix)

    monkeypatch.setattr(moe, "swiglu", counting)
    prompts = ragged(count=4)
    run(path, "on-device", "cpu", tmp_path, prompts, SamplingParams(max_tokens=1, ignore_eos=True))
    (lengths, width), = packs
    assert sorted(lengths) == sorted(len(p) for p in prompts)
    layers = 2
    assert rows[:layers] == [sum(lengths)] * layers  # the prefill's; no padded position among them
    assert sum(lengths) < len(prompts) * width


def test_packing_round_trips_and_pays_only_past_its_share():
    packing = PackedPrefill([3, 1, 4], 4, torch.device("cpu"))
    x = torch.arange(3 * 4 * 2, dtype=torch.float32).view(3, 4, 2)
    packed = packing.pack(x)
    assert packed.shape == (1, 8, 2)
    assert packed[0, :3].tolist() == x[0, 1:].tolist() and packed[0, 3].tolist() == x[1, 3].tolist()
    back = packing.unpack(packed)
    real = torch.tensor([[0, 1, 1, 1], [0, 0, 0, 1], [1, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(back[real], x[real]) and not back[~real].any()
    heads = torch.randn(3, 2, 4, 5)  # (rows, heads, width, head_dim)
    assert torch.equal(packing.unpack_heads(packing.pack_heads(heads))[real[:, None].expand(3, 2, 4)],
                       heads[real[:, None].expand(3, 2, 4)])
    assert PackedPrefill.pays([3, 1, 4], 4)
    assert not PackedPrefill.pays([16, 16, 15], 16)  # 1 of 48 positions padding: under a sixteenth
    assert PackedPrefill.pays([16, 16, 13], 16)  # 3 of 48
    assert not PackedPrefill.pays([], 0)
