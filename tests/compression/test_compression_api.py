"""Packing layout, errors, slicing, chunked decompression and block sizes of the codec."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flexoff.compression import (
    CompressedTensor,
    CompressionError,
    codec,
    compressed_nbytes,
    dequantize,
    dequantize_chunks,
    quantize,
)
from flexoff.compression.packing import pack_codes, packed_row_bytes, unpack_codes
from flexoff.errors import FlexoffError
from flexoff.policy import CompressionConfig


def random(shape, dtype=torch.float16, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


# ----------------------------------------------------------------------------- packing


@settings(max_examples=40, deadline=None)
@given(bits=st.sampled_from([2, 3, 4, 8]), rows=st.integers(1, 4), width=st.integers(1, 40), seed=st.integers(0, 999))
def test_pack_then_unpack_returns_the_codes(bits, rows, width, seed):
    codes = torch.randint(0, 2**bits, (rows, width), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
    packed = pack_codes(codes, bits)
    assert packed.shape == (rows, packed_row_bytes(width, bits))
    assert torch.equal(unpack_codes(packed, bits)[:, :width], codes)


def test_pack_layouts_are_little_endian_and_dense():
    four = pack_codes(torch.tensor([[0x1, 0x2, 0xF, 0x0, 0x7]], dtype=torch.uint8), 4)
    assert four.tolist() == [[0x21, 0x0F, 0x07]]
    two = pack_codes(torch.tensor([[1, 2, 3, 0, 3]], dtype=torch.uint8), 2)
    assert two.tolist() == [[1 | 2 << 2 | 3 << 4, 3]]
    three = pack_codes(torch.arange(8, dtype=torch.uint8).unsqueeze(0), 3)
    word = sum(i << (3 * i) for i in range(8))
    assert three.tolist() == [[word & 0xFF, (word >> 8) & 0xFF, word >> 16]]
    assert packed_row_bytes(64, 3) == 24 and packed_row_bytes(9, 3) == 6
    assert packed_row_bytes(64, 4) == 32 and packed_row_bytes(63, 4) == 32 and packed_row_bytes(5, 2) == 2


def test_known_codes_and_half_to_even_rounding():
    # Group [0 .. 15] at 4 bits: minimum 0, scale 1, so x/scale is exact and rounding is visible.
    x = torch.tensor([[0.0, 0.5, 1.5, 2.5, 3.49, 3.5, 15.0] + [7.0] * 9], dtype=torch.float32)
    ct = quantize(x, bits=4, group_size=16)
    assert ct.scale.tolist() == [[1.0]] and ct.minimum.tolist() == [[0.0]]
    codes = unpack_codes(ct.data, 4)[0, :7].tolist()
    assert codes == [0, 0, 2, 2, 3, 4, 15]


def test_storage_formula_example_is_four_and_a_half_bits_per_value():
    nbytes = compressed_nbytes((4096, 4096), bits=4, group_size=64, dim=-1, dtype=torch.float16)
    assert nbytes == 4096 * (2048 + 64 * 4)
    assert nbytes * 8 / (4096 * 4096) == 4.5
    assert compressed_nbytes((10, 100), 3, 64, 0, torch.float32) == 100 * (3 * 2 + 2 * 1 * 4)


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize("bits", [0, 1, 5, 16, True, 4.0, "4"])
def test_unsupported_bits_raise_a_clear_error(bits):
    x = random((4, 64))
    with pytest.raises(CompressionError, match="bit compression is not supported"):
        quantize(x, bits=bits)
    with pytest.raises(CompressionError):
        compressed_nbytes((4, 64), bits, 64)


@pytest.mark.parametrize("group_size", [1, 0, -64, 2.5, True, None])
def test_bad_group_size_raises_a_clear_error(group_size):
    with pytest.raises(CompressionError, match="group size must be an integer >= 2"):
        quantize(random((4, 64)), bits=4, group_size=group_size)


def test_errors_are_flexoff_errors_and_agree_with_the_policy():
    assert issubclass(CompressionError, FlexoffError)
    config = CompressionConfig(bits=4, group_size=32)
    ct = quantize(random((2, 64)), config.bits, config.group_size)
    assert ct.config == config


def test_other_bad_inputs_raise_compression_errors():
    with pytest.raises(CompressionError, match="cannot compress a int32"):
        quantize(torch.arange(10, dtype=torch.int32))
    with pytest.raises(CompressionError, match="float64"):
        quantize(torch.randn(10, dtype=torch.float64))
    with pytest.raises(CompressionError, match="0-dimensional"):
        quantize(torch.tensor(1.0))
    with pytest.raises(CompressionError, match="out of range"):
        quantize(random((4, 8)), dim=2)
    ct = quantize(random((2, 3, 8)), group_size=4)
    with pytest.raises(CompressionError, match="grouped dimension"):
        ct.narrow(-1, 0, 4)
    with pytest.raises(CompressionError, match="grouped dimension"):
        next(dequantize_chunks(ct, 2, dim=2))
    with pytest.raises(CompressionError, match="chunk size"):
        next(dequantize_chunks(ct, 0, dim=0))
    with pytest.raises(CompressionError, match="out of range"):
        ct.narrow(1, 2, 2)
    with pytest.raises(CompressionError, match="shape"):
        dequantize(ct, out=torch.empty(2, 3, 9, dtype=torch.float16))
    with pytest.raises(CompressionError, match="does not match"):
        quantize(random((2, 3, 8)), bits=2, group_size=4, out=ct)
    with pytest.raises(CompressionError, match="packed data"):
        CompressedTensor(ct.data[..., :-1], ct.scale, ct.minimum, ct.shape, ct.dtype, ct.dim, ct.bits, ct.group_size)


# ----------------------------------------------------------------------------- slices and chunks


@pytest.mark.parametrize("chunk_dim, chunk_size", [(0, 2), (2, 5), (2, 64), (1, 1)])
def test_dequantize_chunks_concatenate_to_the_whole(chunk_dim, chunk_size):
    kv = random((3, 2, 23, 40), seed=3)  # (batch, kv_heads, seq, head_dim)
    ct = quantize(kv, 4, 16, dim=-1)
    pieces = list(dequantize_chunks(ct, chunk_size, dim=chunk_dim))
    assert len(pieces) == math.ceil(kv.shape[chunk_dim] / chunk_size)
    assert all(p.shape[chunk_dim] <= chunk_size for p in pieces)
    assert torch.equal(torch.cat(pieces, dim=chunk_dim), dequantize(ct))


def test_kv_cache_filled_token_by_token_equals_compressing_it_whole():
    kv = random((2, 3, 9, 24), dtype=torch.bfloat16, seed=4)  # (batch, kv_heads, seq, head_dim)
    cache = CompressedTensor.empty(kv.shape, kv.dtype, bits=4, group_size=16, dim=-1)
    for position in range(kv.shape[2]):
        quantize(kv[:, :, position : position + 1], 4, 16, -1, out=cache.narrow(2, position, 1))
    whole = quantize(kv, 4, 16, -1)
    assert torch.equal(cache.data, whole.data) and torch.equal(cache.scale, whole.scale)
    assert torch.equal(dequantize(cache.narrow(2, 3, 4)), dequantize(whole)[:, :, 3:7])


def test_dequantize_into_a_transposed_out():
    weight = random((96, 80), seed=5)  # (out_features, in_features), grouped along outputs
    ct = quantize(weight, 4, 64, dim=0)
    out = torch.empty(80, 96, dtype=torch.float16).t()
    assert dequantize(ct, out=out) is out
    assert torch.equal(out, dequantize(ct))


def test_to_copy_and_pin_keep_the_contents():
    ct = quantize(random((5, 70), seed=6), 3, 32)
    moved = ct.to("cpu").pin_memory()
    assert torch.equal(dequantize(moved), dequantize(ct))
    target = CompressedTensor.empty(ct.shape, ct.dtype, ct.bits, ct.group_size, ct.dim)
    target.copy_(ct)
    assert torch.equal(dequantize(target), dequantize(ct))
    assert moved.nbytes == ct.nbytes == compressed_nbytes(ct.shape, 3, 32, -1, torch.float16)
    assert "bits=3" in repr(ct)


def test_empty_dimensions_are_fine():
    for shape, dim in (((0, 64), -1), ((4, 0), -1), ((3, 0, 5), 0)):
        x = torch.empty(shape, dtype=torch.float16)
        ct = quantize(x, 4, 64, dim)
        assert dequantize(ct).shape == x.shape
        assert ct.nbytes == compressed_nbytes(shape, 4, 64, dim)


# ----------------------------------------------------------------------------- bounded work


@pytest.mark.parametrize(
    "shape, dim, chunk_elements",
    [((40, 300), -1, 1000), ((300, 40), 0, 1000), ((7, 5, 90), 1, 256), ((5000,), 0, 512)],
)
def test_blocks_stay_within_the_chunk_budget(monkeypatch, shape, dim, chunk_elements):
    # Quantize and dequantize must never widen more than one block to fp32 at a time.
    seen = []
    quantize_block, dequantize_block = codec._quantize_block, codec._dequantize_block

    def spy_quantize(x, *args):
        seen.append(x.numel())
        return quantize_block(x, *args)

    def spy_dequantize(packed, scale, minimum, width, *args):
        seen.append(packed.numel() // packed.shape[-1] * width)  # packed is (*rows, bytes)
        return dequantize_block(packed, scale, minimum, width, *args)

    monkeypatch.setattr(codec, "_quantize_block", spy_quantize)
    monkeypatch.setattr(codec, "_dequantize_block", spy_dequantize)
    x = random(shape, seed=8)
    ct = quantize(x, 4, 64, dim, chunk_elements=chunk_elements)
    y = dequantize(ct, chunk_elements=chunk_elements)
    assert len(seen) > 2 and max(seen) <= chunk_elements
    assert sum(seen) == 2 * x.numel()
    assert torch.equal(y, dequantize(quantize(x, 4, 64, dim)))


def test_non_contiguous_input_is_read_block_by_block():
    x = random((64, 48), seed=9).t()  # a transposed view: (48, 64)
    ct = quantize(x, 4, 16, dim=0, chunk_elements=100)
    assert torch.equal(dequantize(ct), dequantize(quantize(x.contiguous(), 4, 16, dim=0)))
