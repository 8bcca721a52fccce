"""Attention over two sets of keys, each with its log-sum-exp, merges into attention over both."""

import pytest
import torch

from flexoff.models.common import attention, attention_bias, attention_lse, attention_mask, merge_attention


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2)])
@pytest.mark.parametrize("as_bias", [False, True])
def test_two_partial_attentions_merge_into_one(heads, kv_heads, as_bias):
    torch.manual_seed(0)
    q = torch.randn(3, heads, 5, 8)
    k, v = torch.randn(3, kv_heads, 9, 8), torch.randn(3, kv_heads, 9, 8)
    valid = torch.ones(3, 9, dtype=torch.bool)
    valid[0, :2] = False  # left padding of row 0
    mask = attention_mask(valid, 4, 5)
    reference = attention(q, k, v, mask)
    own = mask if not as_bias else attention_bias(mask, torch.float32)
    out, lse = attention_lse(q, k, v, own)
    torch.testing.assert_close(out, reference, rtol=0, atol=1e-5)
    torch.testing.assert_close(lse[..., 0], torch.logsumexp(
        (q @ k.repeat_interleave(heads // kv_heads, 1).transpose(-1, -2) / 8 ** 0.5).masked_fill(~mask, float("-inf")),
        dim=-1), rtol=0, atol=1e-5)
    # The first three keys as a prefix, the rest as the rows' own: merged, the attention over all.
    first, rest = attention_lse(q, k[:, :, :3], v[:, :, :3], mask[..., :3]), \
        attention_lse(q, k[:, :, 3:], v[:, :, 3:], mask[..., 3:])
    torch.testing.assert_close(merge_attention(*rest, *first), reference, rtol=0, atol=1e-5)


def test_a_set_a_query_cannot_see_has_no_share():
    torch.manual_seed(1)
    q, k, v = torch.randn(2, 2, 1, 4), torch.randn(2, 2, 6, 4), torch.randn(2, 2, 6, 4)
    out, lse = attention_lse(q, k, v)
    unseen = torch.full_like(lse, float("-inf"))
    torch.testing.assert_close(merge_attention(out.clone(), lse, torch.randn_like(out), unseen), out)


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize("shape", ["prefill", "decode", "prefix"])
def test_the_fused_kernel_gives_the_attention_by_parts(device, dtype, atol, shape):
    """The one-kernel path (CUDA's memory-efficient kernel, the CPU's flash kernel) against the
    attention by parts, on the masks the runtime gives it: a prefill's boolean mask over left
    padding with GQA, a decode step's aligned bias, a shared prefix's one-row key mask."""
    from flexoff.models.common import _fuses, attention_lse_by_parts

    torch.manual_seed(2)
    batch, heads, kv_heads, head_dim = 3, 8, 2, 64
    seq, keys = {"prefill": (7, 7), "decode": (1, 20), "prefix": (12, 33)}[shape]
    q = torch.randn(batch, heads, seq, head_dim, device=device).to(dtype)
    k, v = (torch.randn(batch, kv_heads, keys, head_dim, device=device).to(dtype) for _ in range(2))
    valid = torch.ones(batch, keys, dtype=torch.bool, device=device)
    valid[0, :3] = False
    if shape == "prefix":
        mask = valid[:, None, None, :]
    else:
        mask = attention_mask(valid, keys - seq, seq)
        mask = attention_bias(mask, dtype) if shape == "decode" else mask
    assert _fuses(q)
    out, lse = attention_lse(q, k, v, mask)
    groups = heads // kv_heads
    folded = q.reshape(batch, kv_heads, groups * seq, head_dim)
    parts_mask = mask.repeat(1, 1, groups, 1) if mask.shape[2] > 1 else mask
    parts, parts_lse = attention_lse_by_parts(folded, k, v, parts_mask)
    torch.testing.assert_close(out.float(), parts.reshape(out.shape).float(), rtol=0, atol=atol)
    torch.testing.assert_close(lse, parts_lse.reshape(lse.shape), rtol=0, atol=atol)
    assert lse.dtype == torch.float32 and lse.shape == (batch, heads, seq, 1)
