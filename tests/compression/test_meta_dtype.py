"""Scales and minimums in another dtype than the values' (a checkpoint's fp16 scales under bf16
compute): quantize rounds the minimum down into it so every code still fits, and dequantize
computes from them in fp32 and rounds once into the output's dtype, on every path."""

import pytest
import torch
from hypothesis import given

from flexoff.compression import dequantize, quantize
from flexoff.compression.codec import CompressionError
from tests.compression.test_compression_roundtrip import SETTINGS, cases, group_stats, per_element
from tests.compression.test_cpu_kernels import bits_of, generic


@SETTINGS
@given(cases())
def test_scales_in_the_values_own_dtype_are_what_quantize_always_gave(case):
    x, bits, group_size, dim, chunk_elements = case
    plain = quantize(x, bits, group_size, dim, chunk_elements=chunk_elements)
    same = quantize(x, bits, group_size, dim, chunk_elements=chunk_elements, meta_dtype=x.dtype)
    for part in ("data", "scale", "minimum"):
        assert torch.equal(bits_of(getattr(plain, part)) if part != "data" else plain.data,
                           bits_of(getattr(same, part)) if part != "data" else same.data)


@SETTINGS
@given(cases())
def test_bf16_values_with_fp16_scales_fit_their_codes_and_come_back_within_half_a_step(case):
    x, bits, group_size, dim, chunk_elements = case
    x = x.to(torch.bfloat16)
    ct = quantize(x, bits, group_size, dim, chunk_elements=chunk_elements, meta_dtype=torch.float16)
    assert ct.scale.dtype == ct.minimum.dtype == ct.dtype == torch.float16
    low, high = (t.double().reshape(ct.minimum.shape) for t in group_stats(x, group_size, dim))
    minimum, scale = ct.minimum.double(), ct.scale.double()
    assert (minimum <= low).all()  # rounded down, never up
    # The top code reaches the group's maximum, up to the fp32 rounding of its range.
    slack = 1e-6 * (high.abs() + minimum.abs()) + 1e-30
    assert (minimum + ((1 << bits) - 1) * scale >= high - slack).all()
    y = dequantize(ct, torch.bfloat16, chunk_elements=chunk_elements)
    width = x.shape[dim]
    step = per_element(ct.scale, group_size, width, dim).double()
    exact, back = x.double(), y.double()
    eps = torch.finfo(torch.bfloat16).eps
    bound = step / 2 * (1 + 1e-3) + eps * torch.maximum(exact.abs(), back.abs()) + 1e-7
    assert ((back - exact).abs() <= bound).all()


@pytest.mark.parametrize("shape, dim, order", [((6, 70), -1, (0, 1)), ((70, 6), 0, (0, 1)), ((6, 70), -1, (1, 0)),
                                               ((3, 4, 40), -1, (2, 0, 1))])
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_fp16_scales_decode_into_bf16_as_fp32_rounded_once(monkeypatch, shape, dim, order, bits):
    """The CPU kernels (rows kept, or decoded in a transposed output's layout) and the generic
    path that CUDA takes without Triton: each is the fp32 decode rounded to bf16, bit for bit."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(bits)) * 3
    ct = quantize(x.to(torch.float16), bits, 32, dim)
    wanted = bits_of(dequantize(ct, torch.float32).to(torch.bfloat16))
    out = torch.empty([shape[d] for d in order], dtype=torch.bfloat16).permute([order.index(d) for d in range(len(order))])
    assert torch.equal(bits_of(dequantize(ct, out=out)), wanted)
    assert torch.equal(bits_of(generic(monkeypatch, ct, torch.bfloat16, None, None)), wanted)
    assert torch.equal(bits_of(generic(monkeypatch, ct, None, out, 40)), wanted)


def test_the_triton_kernel_is_not_asked_for_other_scales():
    with pytest.raises(CompressionError, match="scales in the tensor's dtype"):
        quantize(torch.zeros(2, 64, dtype=torch.bfloat16), 4, 32, use_triton=True, meta_dtype=torch.float16)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_a_minimum_fp16_cannot_hold_is_rounded_down(sign):
    """bf16 keeps 8 bits where fp16's subnormals keep fewer: a group minimum there has no fp16 of its
    own, and the nearest one above it would leave the value below code 0."""
    values = (sign * torch.logspace(-9, -5, 400)).to(torch.bfloat16)
    rounded_up = values.float() < values.to(torch.float16).float()
    assert rounded_up.any()
    groups = torch.stack([values, torch.ones_like(values)], dim=1)  # each row one group: [minimum, 1]
    ct = quantize(groups, 4, 2, meta_dtype=torch.float16)
    assert (ct.minimum[:, 0].double() <= values.double()).all()
    assert (ct.minimum[:, 0].double() + 15 * ct.scale[:, 0].double() >= 1.0).all()
