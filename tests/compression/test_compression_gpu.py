"""CUDA and Triton paths of the codec: the same bytes and values as the CPU path, bit for bit.

The ``gpu`` tests run with ``pytest -m gpu`` on a CUDA machine. The interpreter test runs the
Triton kernel on the CPU through Triton's interpreter where Triton is installed.
"""

import os
import sys
import textwrap

import pytest
import torch

from flexoff.compression import CompressedTensor, dequantize, dequantize_chunks, quantize, triton_available
from flexoff.compression.tensor import CompressionError
from flexoff.policy import CompressionConfig
from flexoff.runtime.kv_storage import SLOT_MAJOR, kv_format
from tests import processes

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# (shape, dim, group_size): KV-like, weight-like along either dimension, ragged groups, 1-D.
LAYOUTS = [
    ((4, 8, 33, 128), -1, 64),
    ((512, 384), 0, 64),
    ((384, 512), 1, 64),
    ((3, 5, 100), 2, 7),
    ((3, 5, 100), 0, 64),
    ((1, 257), 1, 16),
    ((1000,), 0, 128),
]

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
needs_triton = pytest.mark.skipif(not triton_available(), reason="needs Triton")


def random(shape, dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=generator) * 3 + 0.5).to(dtype)


def assert_same_compressed(a: CompressedTensor, b: CompressedTensor):
    for x, y in ((a.data, b.data), (a.scale, b.scale), (a.minimum, b.minimum)):
        assert torch.equal(x.cpu(), y.cpu())


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_cuda_quantize_gives_the_cpu_bytes(bits, dtype, layout):
    shape, dim, group_size = layout
    x = random(shape, dtype, seed=bits)
    on_cpu = quantize(x, bits, group_size, dim)
    on_cuda = quantize(x.cuda(), bits, group_size, dim)
    assert on_cuda.device.type == "cuda"
    assert_same_compressed(on_cpu, on_cuda)
    assert torch.equal(dequantize(on_cuda, use_triton=False).cpu(), dequantize(on_cpu))


@pytest.mark.gpu
@needs_cuda
@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_triton_dequantize_equals_torch_dequantize(dtype, layout):
    shape, dim, group_size = layout
    ct = quantize(random(shape, dtype, seed=1).cuda(), 4, group_size, dim)
    by_torch = dequantize(ct, use_triton=False)
    by_triton = dequantize(ct, use_triton=True)
    assert torch.equal(by_triton, by_torch)
    assert torch.equal(dequantize(ct), by_triton)  # CUDA + 4-bit picks Triton by default
    assert torch.equal(by_triton.cpu(), dequantize(ct.to("cpu")))


@pytest.mark.gpu
@needs_cuda
@needs_triton
def test_triton_on_slices_and_into_strided_outputs():
    kv = random((4, 8, 40, 128), torch.float16, seed=2).cuda()  # (batch, kv_heads, seq, head_dim)
    ct = quantize(kv, 4, 64, -1)
    for chunk_dim in (0, 2):
        pieces = list(dequantize_chunks(ct, 3, chunk_dim, use_triton=True))
        assert torch.equal(torch.cat(pieces, chunk_dim), dequantize(ct, use_triton=False))
    weight = quantize(random((256, 192), torch.bfloat16, seed=3).cuda(), 4, 64, dim=0)
    out = torch.empty(192, 256, dtype=torch.bfloat16, device="cuda").t()
    dequantize(weight, out=out, use_triton=True)
    assert torch.equal(out, dequantize(weight, use_triton=False))


@pytest.mark.gpu
@needs_cuda
@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,group_size", [((4, 8, 33, 128), 64), ((384, 512), 64), ((5, 7168), 64),
                                              ((3, 5, 96), 32), ((2, 3, 4, 5, 64), 16), ((1000, 1024), 1024)])
def test_triton_quantize_gives_the_torch_bytes(dtype, shape, group_size):
    x = random(shape, dtype, seed=5).cuda()
    x[0, ..., :group_size] = 1.25  # constant groups: zero scale
    x[-1, ..., -group_size:] = x[-1, ..., -group_size:] * 1e-3  # tiny ranges
    by_torch = quantize(x, 4, group_size, -1, use_triton=False)
    assert_same_compressed(quantize(x, 4, group_size, -1, use_triton=True), by_torch)
    assert_same_compressed(quantize(x, 4, group_size, -1), by_torch)  # CUDA + 4-bit picks Triton
    assert_same_compressed(quantize(x.cpu(), 4, group_size, -1), by_torch)


@pytest.mark.gpu
@needs_cuda
@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_quantize_reads_permuted_keys_into_a_narrowed_cache(dtype):
    # A prefill's keys (rows, heads, seq, head_dim), a transposed projection, stored at slots
    # [3, 3 + seq) and rows [1, 1 + rows) of a larger slot-major cache.
    projected = random((3, 40, 8 * 128), dtype, seed=6).cuda()  # (rows, seq, heads * head_dim)
    keys = projected.view(3, 40, 8, 128).transpose(1, 2)
    caches = [CompressedTensor.empty(SLOT_MAJOR.shape(48, 5, 8, 128), dtype, 4, 64, -1, "cuda") for _ in range(2)]
    for cache, use_triton in zip(caches, (False, True)):
        for part in (cache.data, cache.scale, cache.minimum):
            part.zero_()
        target = cache.narrow(0, 3, 40).narrow(1, 1, 3)
        quantize(SLOT_MAJOR.arrange(keys), 4, 64, -1, out=target, use_triton=use_triton)
    assert_same_compressed(*caches)
    assert caches[1].scale[0].abs().sum() == 0 and caches[1].scale[3:43, 1:4].abs().min() > 0


@pytest.mark.gpu
@needs_cuda
@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_cache_pair_written_in_one_call_holds_what_two_calls_write(dtype):
    # A travelling cache's workspace set: keys and values halves of one allocation, a tier's run
    # carved out of each, a decode slot written into both at once: the bytes of separate calls,
    # which read back as the torch path reads them.
    fmt = kv_format(CompressionConfig(4, 64), dtype)
    shape = SLOT_MAJOR.shape(48, 6, 8, 128)
    allocate = lambda shape, dtype: torch.zeros(shape, dtype=dtype, device="cuda")  # noqa: E731
    pair, separate = fmt.empty_pair(shape, allocate), (fmt.empty(shape, allocate), fmt.empty(shape, allocate))
    k, v = (random((4, 8, 5, 128), dtype, seed=seed).cuda() for seed in (8, 9))
    carved = [tuple(fmt.carve(buffer, 2, 4) for buffer in buffers) for buffers in (pair, separate)]
    SLOT_MAJOR.write_pair(fmt, carved[0], 3, k, v)
    for buffer, x in zip(carved[1], (k, v)):
        SLOT_MAJOR.write(fmt, buffer, 3, x)
    for a, b in zip(pair, separate):
        assert_same_compressed(a, b)
    for buffer in carved[0]:
        assert torch.equal(SLOT_MAJOR.read(fmt, buffer, 8).cpu(), SLOT_MAJOR.read(fmt, buffer.to("cpu"), 8))


@needs_triton
def test_triton_quantize_refuses_layouts_it_does_not_handle():
    x = random((3, 5, 100), torch.float16, seed=7)
    with pytest.raises(CompressionError, match="does not handle"):
        quantize(x, 4, 7, -1, use_triton=True)  # groups of 7
    with pytest.raises(CompressionError, match="4-bit"):
        quantize(x, 8, 64, -1, use_triton=True)


@pytest.mark.gpu
@needs_cuda
def test_pinned_host_copy_round_trips_through_the_gpu():
    x = random((64, 256), torch.float16, seed=4)
    ct = quantize(x, 4, 64).pin_memory()
    assert ct.is_pinned()
    on_gpu = ct.to("cuda", non_blocking=True)
    torch.cuda.current_stream().synchronize()
    assert torch.equal(dequantize(on_gpu).cpu(), dequantize(ct))


@pytest.mark.gpu
@needs_cuda
@needs_triton
def test_weight_sized_tensor_round_trips_on_cuda():
    weight = torch.randn(7168, 28672, device="cuda", dtype=torch.float16)
    ct = quantize(weight, 4, 64, dim=0)
    assert ct.nbytes * 8 / weight.numel() == 4.5
    by_triton = dequantize(ct)
    assert torch.equal(by_triton, dequantize(ct, use_triton=False))
    step = ct.scale.float().repeat_interleave(64, -1).t()
    assert ((by_triton.float() - weight.float()).abs() <= step / 2 + 1e-3 * weight.float().abs() + 1e-7).all()


_INTERPRETER_CHECK = textwrap.dedent(
    """
    import torch
    from flexoff.compression import CompressedTensor, dequantize, quantize
    from flexoff.runtime.kv_storage import SLOT_MAJOR
    cases = [((3, 5, 100), 2, 7), ((64, 96), 0, 64), ((2, 3, 40, 128), -1, 64), ((300,), 0, 64)]
    # bf16 is left out: the interpreter truncates fp32 -> bf16 instead of rounding to nearest.
    for dtype in (torch.float16, torch.float32):
        for shape, dim, group_size in cases:
            x = (torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
            ct = quantize(x, 4, group_size, dim)
            assert torch.equal(dequantize(ct, use_triton=True), dequantize(ct, use_triton=False)), (dtype, shape)
            if dim != 0:
                part = ct.narrow(0, 1, 1)
                assert torch.equal(dequantize(part, use_triton=True), dequantize(part, use_triton=False))
        for shape, group_size in (((2, 3, 33, 128), 64), ((64, 96), 32), ((7, 640), 64)):
            x = (torch.randn(shape, generator=torch.Generator().manual_seed(1)) * 3).to(dtype)
            x[0, ..., :group_size] = 1.25
            a, b = (quantize(x, 4, group_size, -1, use_triton=t) for t in (True, False))
            assert all(torch.equal(p, q) for p, q in zip((a.data, a.scale, a.minimum), (b.data, b.scale, b.minimum)))
        keys = (torch.randn(3, 4, 10, 128, generator=torch.Generator().manual_seed(2))).to(dtype)
        parts = []
        for use_triton in (True, False):
            cache = CompressedTensor.empty(SLOT_MAJOR.shape(16, 5, 4, 128), dtype, 4, 64, -1, "cpu")
            for part in (cache.data, cache.scale, cache.minimum):
                part.zero_()
            quantize(SLOT_MAJOR.arrange(keys), 4, 64, -1, out=cache.narrow(0, 2, 10).narrow(1, 1, 3),
                     use_triton=use_triton)
            parts.append((cache.data, cache.scale, cache.minimum))
        assert all(torch.equal(p, q) for p, q in zip(*parts)), dtype
    print("interpreter ok")
    """
)


@needs_triton
def test_triton_kernel_logic_under_the_interpreter():
    environment = dict(os.environ, TRITON_INTERPRET="1")
    result = processes.run([sys.executable, "-c", _INTERPRETER_CHECK], env=environment)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "interpreter ok" in result.stdout
