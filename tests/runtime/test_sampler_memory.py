"""The sampler's memory against the layout's figures, on the CPU: what ``choose`` allocates at its
peak (from the profiler's allocation events) stays within ``sampler_step_bytes``, the state it
keeps is ``sampler_state_bytes``; and sorting a few rows at a time changes no row's result."""

from types import SimpleNamespace

import pytest
import torch

from flexoff import SamplingParams
from flexoff.layout import SORTED_ROWS, sampler_state_bytes, sampler_step_bytes
from flexoff.runtime.sampler import BatchSampler

ROWS, VOCAB = 2 * SORTED_ROWS + 3, 3000  # a last, partial group of sorted rows
EVERYTHING = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05, repetition_penalty=1.2,
                            frequency_penalty=0.3, presence_penalty=0.5, logprobs=5, min_tokens=4,
                            stop_token_ids=[7, 9])
SETTINGS = {
    "greedy": SamplingParams(),
    "greedy with penalties": SamplingParams(repetition_penalty=1.2, frequency_penalty=0.3, presence_penalty=0.5),
    "top-k alone": SamplingParams(temperature=0.8, top_k=50),
    "top-k and top-p": SamplingParams(temperature=0.8, top_k=50, top_p=0.9),
    "everything": EVERYTHING,
}


def rows(params: SamplingParams, count: int = ROWS):
    return [SimpleNamespace(params=params, seed=i, prompt_ids=list(range(i, i + 20))) for i in range(count)]


def peak_allocated(step) -> int:
    """Bytes ``step()`` holds at its peak beyond what it started with, on the CPU."""
    profiler = pytest.importorskip("torch._C._profiler")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    sizes = []

    def walk(event):
        if event.tag == profiler._EventType.Allocation:
            sizes.append((event.start_time_ns, event.extra_fields.alloc_size))
        for child in event.children:
            walk(child)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root)
    held = peak = 0
    for _, size in sorted(sizes):
        held += size
        peak = max(peak, held)
    return peak


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("name", SETTINGS)
def test_a_step_stays_within_the_layouts_figure(name, dtype):
    sampler = BatchSampler(rows(SETTINGS[name]), [2], VOCAB, torch.device("cpu"))
    logits = (torch.randn(ROWS, VOCAB, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
    sampler.choose(logits, [True] * ROWS)  # counts and seen tokens are filled from now on
    peak = peak_allocated(lambda: sampler.choose(logits, [True] * ROWS))
    assert 0 < peak <= sampler_step_bytes(ROWS, VOCAB)
    if name == "greedy":
        assert peak < 9 * ROWS * VOCAB  # an fp32 copy and the logprobs, and per-row columns


def test_the_state_kept_is_the_layouts_figure():
    def state(params):
        sampler = BatchSampler(rows(params), [2], VOCAB, torch.device("cpu"))
        tensors = [t for t in vars(sampler).values() if isinstance(t, torch.Tensor)]
        return sum(t.nbytes for t in tensors if t.numel() >= VOCAB)  # the (rows, vocab) ones

    assert state(EVERYTHING) == sampler_state_bytes(ROWS, VOCAB)
    assert state(SamplingParams(temperature=0.8, top_p=0.9, min_tokens=3)) == 0


def test_choose_leaves_the_callers_logits_as_they_are():
    logits = torch.randn(ROWS, VOCAB, generator=torch.Generator().manual_seed(1))
    before = logits.clone()
    sampler = BatchSampler(rows(EVERYTHING), [2], VOCAB, torch.device("cpu"))
    for _ in range(2):
        sampler.choose(logits, [True] * ROWS)
        sampler.warped(logits)
    assert torch.equal(logits, before)


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.9, top_k=40), EVERYTHING], ids=["top-k", "top-p"])
def test_rows_sorted_in_groups_match_each_row_alone(params):
    """Rows past the first sorted group, and the last partial group, warp exactly as alone."""
    logits = torch.randn(ROWS, VOCAB, generator=torch.Generator().manual_seed(2)).half().float()  # ties
    together = BatchSampler(rows(params), [2], VOCAB, torch.device("cpu")).warped(logits)
    for row in (0, SORTED_ROWS - 1, SORTED_ROWS, ROWS - 1):
        alone = BatchSampler(rows(params, 1), [2], VOCAB, torch.device("cpu")).warped(logits[row:row + 1])
        assert torch.equal(together[row], alone[0])


def test_a_blocks_gpu_memory_counts_the_head_step_and_the_samplers_state_by_hand():
    from flexoff.layout import block_bytes, kv_cache_bytes
    from flexoff.models.config import ModelConfig
    from flexoff.policy import Policy

    cfg = ModelConfig(name="tiny-opt", family="opt", vocab_size=10, hidden_size=4, num_layers=2, num_heads=2,
                      intermediate_size=8, max_positions=8)
    policy = Policy(gpu_batch_size=2, num_gpu_batches=3)  # everything on the GPU, 6 sequences a block
    beyond_cache = block_bytes(cfg, policy, 4, 3, 2)["gpu"] - kv_cache_bytes(cfg, policy, 7, 2)["gpu"]
    # hidden states 6 rows x 4 tokens x 4 x 2 B = 192; the prefill's MLP and q/k/v 2 x 4 x (8 + 16) x 2 B
    # = 384; the head step of a batch: fp16 logits 2 x 10 x 2 B = 40, the sampler's work 20 entries x
    # 14 B and its sort of both rows 20 x 44 B = 1160; the block's samplers' state 6 x 10 x 5 B = 300;
    # each batch's prefill attention mask, 3 batches x 2 rows x 4 queries x 4 keys of one byte = 96
    assert beyond_cache == 192 + 384 + 40 + 1160 + 300 + 96
