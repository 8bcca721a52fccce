"""The CPU dequantize path gives the generic (fp32 temporaries, also used on CUDA) path's bits."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flexoff.compression import codec, dequantize, quantize
from flexoff.compression.cpu_kernels import Scratch, _unpack_rows
from flexoff.compression.packing import pack_codes, unpack_codes

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def bits_of(x: torch.Tensor) -> torch.Tensor:
    """Raw bit patterns, so that -0.0 and 0.0 (equal under torch.equal) are told apart."""
    return x.contiguous().view(torch.int16 if x.element_size() == 2 else torch.int32)


def generic(monkeypatch, ct, dtype, out, chunk_elements):
    with monkeypatch.context() as patch:
        patch.setattr(codec.cpu_kernels, "dequantize_block",
                      lambda *args: codec._dequantize_block_generic(*args[:-1]))
        return dequantize(ct, dtype, out=out, chunk_elements=chunk_elements)


@st.composite
def cases(draw):
    ndim = draw(st.integers(1, 4))
    dim = draw(st.integers(0, ndim - 1))
    shape = [draw(st.integers(1, 6)) for _ in range(ndim)]
    shape[dim] = draw(st.integers(1, 200))
    group_size = draw(st.one_of(st.sampled_from([2, 3, 7, 16, 64, 128]), st.integers(2, 160)))
    bits = draw(st.sampled_from((2, 3, 4, 8)))
    dtype = draw(st.sampled_from(DTYPES))
    out_dtype = draw(st.sampled_from((None, *DTYPES)))
    magnitude = draw(st.sampled_from([1e-6, 1e-3, 1.0, 1000.0]))
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1))))
         * magnitude).to(dtype)
    # A slice along another dim (a strided view, like a KV cache's first slots) and an output
    # stored in any dimension order (a transposed weight).
    others = [d for d in range(ndim) if d != dim and shape[d] > 1]
    narrow = None
    if others and draw(st.booleans()):
        d = draw(st.sampled_from(others))
        start = draw(st.integers(0, shape[d] - 1))
        narrow = (d, start, draw(st.integers(1, shape[d] - start)))
    order = draw(st.permutations(range(ndim)))
    chunk_elements = draw(st.sampled_from([40, 700, 1 << 20]))
    return x, bits, group_size, dim, out_dtype, narrow, order, chunk_elements


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(cases())
def test_cpu_path_is_bit_identical_to_the_generic_path(monkeypatch, case):
    x, bits, group_size, dim, out_dtype, narrow, order, chunk_elements = case
    ct = quantize(x, bits, group_size, dim)
    if narrow is not None:
        ct = ct.narrow(*narrow)
    reference = generic(monkeypatch, ct, out_dtype, None, chunk_elements)
    assert torch.equal(bits_of(dequantize(ct, out_dtype, chunk_elements=chunk_elements)), bits_of(reference))
    out = torch.empty([ct.shape[d] for d in order], dtype=reference.dtype).permute(
        [list(order).index(d) for d in range(len(order))])
    assert dequantize(ct, out=out, chunk_elements=chunk_elements) is out
    assert torch.equal(bits_of(out), bits_of(reference))


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_spread_unpacking_matches_unpack_codes(bits):
    generator = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 1 << bits, (5, 7, 48), generator=generator, dtype=torch.uint8)
    packed = pack_codes(codes.reshape(35, 48), bits).reshape(5, 7, -1)
    strided = packed.transpose(0, 1)  # rows not in memory order
    expected = unpack_codes(strided.reshape(35, -1), bits)
    assert torch.equal(_unpack_rows(strided, 35, bits, Scratch()), expected)


def test_all_codes_and_extreme_metadata_decode_like_the_generic_path(monkeypatch):
    # Every code value against scales and minimums from subnormal to near the dtype's top.
    for dtype in DTYPES:
        finfo = torch.finfo(dtype)
        rows, groups, group_size = 6, 4, 16
        ct = quantize(torch.zeros(rows, groups * group_size, dtype=dtype), 4, group_size)
        ct.data.copy_(torch.randint(0, 256, ct.data.shape, dtype=torch.uint8,
                                    generator=torch.Generator().manual_seed(3)))
        values = torch.tensor([finfo.tiny * finfo.eps, finfo.tiny, 1e-3, 0.5, 3.0, finfo.max / 32], dtype=dtype)
        ct.scale.copy_(values[:, None].expand(rows, groups))
        ct.minimum.copy_(torch.tensor([-0.0, 0.0, -1.0, 7.5], dtype=dtype).expand(rows, groups))
        reference = generic(monkeypatch, ct, None, None, None)
        assert torch.equal(bits_of(dequantize(ct)), bits_of(reference))
