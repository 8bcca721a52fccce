"""A step's attention bias: the boolean mask as the additive bias attention would make of it, once."""

import pytest
import torch

from flexoff.models.common import BIAS_ALIGNMENT, attention, attention_bias, attention_mask


@pytest.mark.parametrize("start, queries, kv_heads", [(0, 7, 4), (13, 1, 4), (21, 1, 2), (0, 5, 1)])
def test_attention_over_the_bias_is_attention_over_the_mask_bit_for_bit(start, queries, kv_heads):
    torch.manual_seed(0)
    batch, heads, head_dim = 3, 4, 16
    keys = start + queries
    valid = torch.ones(batch, keys, dtype=torch.bool)
    valid[1, :3] = False  # left padding
    valid[2, :5] = False
    mask = attention_mask(valid, start, queries)
    q = torch.randn(batch, heads, queries, head_dim)
    k, v = torch.randn(batch, kv_heads, keys, head_dim), torch.randn(batch, kv_heads, keys, head_dim)
    bias = attention_bias(mask, q.dtype)
    assert torch.equal(attention(q, k, v, bias), attention(q, k, v, mask))
    assert torch.equal(attention(q[1:], k[1:], v[1:], bias[1:]), attention(q[1:], k[1:], v[1:], mask[1:]))


def test_the_bias_is_zero_where_allowed_and_minus_infinity_elsewhere_with_aligned_rows():
    valid = torch.tensor([[True] * 19, [False] * 4 + [True] * 15])
    mask = attention_mask(valid, 18, 1)
    bias = attention_bias(mask, torch.float16)
    assert bias.shape == mask.shape and bias.dtype == torch.float16
    assert torch.equal(bias == 0, mask) and bool(torch.isneginf(bias[~mask]).all())
    # Every stride but the last is a whole number of aligned rows, so a kernel needs no padded copy.
    assert all(stride % BIAS_ALIGNMENT == 0 for stride in bias.stride()[:-1]) and bias.stride(-1) == 1
