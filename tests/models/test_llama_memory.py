"""The Llama family's attention inputs stay within the working memory the layout counts for them."""

import pytest
import torch

from flexoff.layout.block import attention_bytes_per_token
from flexoff.models import llama
from flexoff.models.common import attention, attention_mask
from flexoff.models.config import ModelConfig


def peak_bytes(fn) -> int:
    """The most bytes live at once while ``fn`` runs, from the profiler's memory timeline."""
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import Action

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        fn()
    live = peak = 0
    for _time, action, _key, size in prof._memory_profile().timeline:
        live += size if action == Action.CREATE else -size if action == Action.DESTROY else 0
        peak = max(peak, live)
    return peak


# (kv heads, head_dim, q/k norms): grouped queries as Mixtral's, Qwen3's queries twice the hidden width.
SHAPES = [(1, 16, False), (4, 16, False), (2, 32, True)]


@pytest.mark.parametrize("kv_heads, head_dim, qk_norm", SHAPES)
def test_attention_inputs_peak_within_the_layouts_count(kv_heads, head_dim, qk_norm):
    cfg = ModelConfig(name="t", family="llama", vocab_size=64, hidden_size=64, num_layers=1, num_heads=4,
                      num_kv_heads=kv_heads, head_dim=head_dim, intermediate_size=40, max_positions=64,
                      qk_norm=qk_norm)
    generator = torch.Generator().manual_seed(0)
    weights = {spec.name: torch.randn(spec.shape, generator=generator) for spec in llama.layer_specs(cfg, 0)}
    batch, seq = 3, 32
    hidden = torch.randn(batch, seq, 64, generator=generator)
    context = llama.step_context(cfg, torch.arange(seq)[None].expand(batch, seq), torch.float32)
    q, k, v = llama.attention_inputs(cfg, weights, hidden, context)
    assert q.is_contiguous()  # attention folds query heads into rows as a view, not a copy
    q.reshape(batch, kv_heads, -1, head_dim).view(-1)
    counted = batch * seq * attention_bytes_per_token(cfg, 4) - hidden.numel() * 4  # the input is not made here
    assert peak_bytes(lambda: llama.attention_inputs(cfg, weights, hidden, context)) <= counted
    mask = attention_mask(torch.ones(batch, seq, dtype=torch.bool), 0, seq)
    scores = batch * cfg.num_heads * seq * seq * 4  # the CPU's attention kernel keeps them; CUDA's does not
    assert peak_bytes(lambda: attention(q, k, v, mask)) <= counted + scores + mask.numel() * cfg.num_heads
