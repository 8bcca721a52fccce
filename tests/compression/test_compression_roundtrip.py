"""Round-trip properties of the group-wise codec, over drawn shapes, dims, bit widths and groups."""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flexoff.compression import compressed_nbytes, dequantize, quantize

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
BITS = (2, 3, 4, 8)

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def cases(draw):
    ndim = draw(st.integers(1, 4))
    dim = draw(st.integers(-ndim, ndim - 1))
    shape = [draw(st.integers(1, 5)) for _ in range(ndim)]
    # The grouped dimension is longer, so several groups and ragged last groups both occur.
    shape[dim] = draw(st.integers(1, 150))
    group_size = draw(st.one_of(st.sampled_from([2, 3, 7, 16, 64, 128]), st.integers(2, 160)))
    bits = draw(st.sampled_from(BITS))
    dtype = draw(st.sampled_from(DTYPES))
    seed = draw(st.integers(0, 2**31 - 1))
    magnitude = draw(st.sampled_from([1e-3, 1.0, 30.0, 1000.0]))
    offset = draw(st.sampled_from([0.0, 1.0, -50.0]))
    chunk_elements = draw(st.sampled_from([50, 700, 1 << 22]))
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(shape, generator=generator) * magnitude + offset * magnitude
    return values.to(dtype), bits, group_size, dim, chunk_elements


def group_stats(x: torch.Tensor, group_size: int, dim: int):
    """Reference min and max of every group, from the real values only: (*rows, groups)."""
    moved = x.movedim(dim, -1).to(torch.float32)
    width = moved.shape[-1]
    groups = math.ceil(width / group_size)
    pad = groups * group_size - width
    low = torch.nn.functional.pad(moved, (0, pad), value=math.inf).unflatten(-1, (groups, group_size)).amin(-1)
    high = torch.nn.functional.pad(moved, (0, pad), value=-math.inf).unflatten(-1, (groups, group_size)).amax(-1)
    return low, high


def per_element(meta: torch.Tensor, group_size: int, width: int, dim: int) -> torch.Tensor:
    """Spread a (*rows, groups) tensor back to the original layout, one entry per element."""
    return meta.to(torch.float32).repeat_interleave(group_size, dim=-1)[..., :width].movedim(-1, dim)


def allowed_error(step: torch.Tensor, bits: int, dtype: torch.dtype, exact: torch.Tensor,
                  back: torch.Tensor) -> torch.Tensor:
    """Half a step from the code's rounding, plus the arithmetic's own rounding.

    The codec computes (x - minimum) / scale and minimum + code * scale. The two inner terms are
    as large as the group's range (levels steps), whatever |x| is: a value near zero in a group
    far from zero rounds at the range's precision, not its own. The outer ones are relative to
    the value, and the last term is the spacing of subnormals.
    """
    finfo = torch.finfo(dtype)
    step = step.double()
    group_range = step * (2**bits - 1)
    return (step / 2 * (1 + 1e-6) + finfo.eps * (torch.maximum(exact.abs(), back.abs()) + group_range)
            + finfo.smallest_normal * finfo.eps)


@SETTINGS
@given(cases())
def test_every_value_comes_back_within_half_a_step(case):
    x, bits, group_size, dim, chunk_elements = case
    ct = quantize(x, bits, group_size, dim, chunk_elements=chunk_elements)
    y = dequantize(ct, chunk_elements=chunk_elements)

    assert y.dtype == x.dtype and y.shape == x.shape
    width = x.shape[dim]
    step = per_element(ct.scale, group_size, width, dim)
    exact, back = x.to(torch.float64), y.to(torch.float64)
    bound = allowed_error(step, bits, x.dtype, exact, back)
    error = (back - exact).abs()
    assert (error <= bound).all(), f"worst excess {(error - bound).max().item():.3g}"


@SETTINGS
@given(cases())
def test_scale_and_minimum_are_the_tight_group_range(case):
    x, bits, group_size, dim, chunk_elements = case
    ct = quantize(x, bits, group_size, dim, chunk_elements=chunk_elements)
    low, high = group_stats(x, group_size, dim)
    levels = 2**bits - 1
    assert torch.equal(ct.minimum.to(torch.float32), low)
    needed = ((high.double() - low.double()) / levels)
    scale = ct.scale.double()
    # Never below the range beyond fp32 rounding (no clipping); at most one rounding of the
    # stored dtype above it.
    assert (scale >= needed * (1 - 2**-22)).all()
    finfo = torch.finfo(x.dtype)
    assert (scale <= needed * (1 + 2 * finfo.eps) + finfo.smallest_normal * finfo.eps).all()


@SETTINGS
@given(cases())
def test_packed_size_matches_the_formula(case):
    x, bits, group_size, dim, _ = case
    ct = quantize(x, bits, group_size, dim)
    width = x.shape[dim]
    rows = x.numel() // width
    groups = math.ceil(width / group_size)
    packed_row = 3 * math.ceil(width / 8) if bits == 3 else math.ceil(width * bits / 8)
    expected = rows * (packed_row + 2 * groups * x.element_size())
    assert ct.nbytes == expected == compressed_nbytes(x.shape, bits, group_size, dim, x.dtype)
    assert ct.data.dtype == torch.uint8 and ct.data.numel() == rows * packed_row


@SETTINGS
@given(cases())
def test_quantize_is_deterministic_and_independent_of_chunking(case):
    x, bits, group_size, dim, chunk_elements = case
    first = quantize(x, bits, group_size, dim, chunk_elements=chunk_elements)
    second = quantize(x.clone(), bits, group_size, dim)
    for a, b in ((first.data, second.data), (first.scale, second.scale), (first.minimum, second.minimum)):
        assert torch.equal(a, b)
    assert torch.equal(dequantize(first), dequantize(second, chunk_elements=chunk_elements))


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_constant_groups_round_trip_exactly(bits, dtype):
    generator = torch.Generator().manual_seed(bits)
    group_size = 16
    # (rows, groups, group_size): half the groups constant, the others random.
    x = torch.randn(6, 5, group_size, generator=generator) * 40
    constant = torch.rand(6, 5, generator=generator) < 0.5
    x = torch.where(constant.unsqueeze(-1), x[..., :1], x).reshape(6, 5 * group_size).to(dtype)
    y = dequantize(quantize(x, bits, group_size))
    mask = constant.repeat_interleave(group_size, dim=1)
    assert torch.equal(y[mask], x[mask])
    assert constant.any() and (~constant).any()


def test_ragged_last_group_matches_quantizing_it_alone():
    # The padding of a short last group must not change it: the same result as a full group of
    # exactly its real values.
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(3, 70, generator=generator).half() * 5 + 20
    whole = dequantize(quantize(x, 4, 64))
    tail = dequantize(quantize(x[:, 64:].contiguous(), 4, 6))
    assert torch.equal(whole[:, 64:], tail)
    head = dequantize(quantize(x[:, :64].contiguous(), 4, 64))
    assert torch.equal(whole[:, :64], head)


@pytest.mark.parametrize("dtype", DTYPES)
def test_output_dtype_follows_input_or_request(dtype):
    x = torch.randn(4, 100, generator=torch.Generator().manual_seed(1)).to(dtype)
    ct = quantize(x, 4, 64)
    assert ct.dtype == dtype and ct.scale.dtype == dtype and ct.minimum.dtype == dtype
    assert dequantize(ct).dtype == dtype
    wide = dequantize(ct, torch.float32)
    assert wide.dtype == torch.float32
    assert torch.equal(wide.to(dtype), dequantize(ct))


@pytest.mark.parametrize(
    "dtype, magnitude",
    [
        (torch.float16, 60000.0),  # the range of a group is twice fp16's largest value
        (torch.float16, 1e-6),  # subnormal values and scales
        (torch.bfloat16, 1e30),
        (torch.bfloat16, 1e-30),
        (torch.float32, 1e30),
        (torch.float32, 1e-30),
    ],
)
@pytest.mark.parametrize("bits", BITS)
def test_extreme_magnitudes_stay_within_half_a_step(dtype, magnitude, bits):
    generator = torch.Generator().manual_seed(bits)
    x = (torch.rand(8, 96, generator=generator) * 2 - 1) * magnitude
    x[0, 0], x[0, 1] = magnitude, -magnitude
    x = x.to(dtype)
    assert torch.isfinite(x).all()
    ct = quantize(x, bits, 32)
    y = dequantize(ct)
    assert torch.isfinite(ct.scale).all() and torch.isfinite(y).all()
    step = per_element(ct.scale, 32, 96, -1).double()
    exact, back = x.double(), y.double()
    bound = allowed_error(step, bits, dtype, exact, back)
    assert ((back - exact).abs() <= bound).all()
