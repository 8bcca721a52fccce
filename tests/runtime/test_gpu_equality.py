"""The same equalities on CUDA, where copies run on their own streams ordered by events."""

import pytest
import torch

from flexoff import LLM, Policy, SamplingParams
from tests.conftest import PROMPTS
from tests.models.test_hf_equality import assert_last_logits_match
from tests.runtime.test_offload_equality import KINDS, POLICIES, ROUTE_FIRST_POLICIES

pytestmark = pytest.mark.gpu

PARAMS = SamplingParams(max_new_tokens=7, ignore_eos=True)
# With route-first loading, the experts' copies are enqueued once the host has read the routing
# back; they must land before the grouped matmuls read them.
CUDA_POLICIES = {**POLICIES, **{f"route-first-{name}": p for name, p in ROUTE_FIRST_POLICIES.items()}}


@pytest.fixture(scope="module")
def cuda_reference(tiny_model_dir):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    refs = {}
    for kind in KINDS:
        path, _ = tiny_model_dir(kind)
        refs[kind] = LLM(str(path), policy=Policy(gpu_batch_size=8), device="cuda", dtype="float32").generate(
            PROMPTS, PARAMS)
    return refs


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", list(CUDA_POLICIES))
def test_policy_matches_plain_run_on_cuda(tiny_model_dir, cuda_reference, tmp_path, kind, name):
    path, _ = tiny_model_dir(kind)
    with LLM(str(path), policy=CUDA_POLICIES[name], device="cuda", dtype="float32", offload_dir=str(tmp_path)) as llm:
        outs = llm.generate(PROMPTS, PARAMS)
    ref = cuda_reference[kind]
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    torch.testing.assert_close(torch.tensor([o.logprobs for o in outs]), torch.tensor([o.logprobs for o in ref]),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["opt-pre", "llama-gqa", "qwen3-qk-norm"])
def test_cuda_fp32_matches_transformers(tiny_model_dir, kind):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    path, hf = tiny_model_dir(kind)
    assert_last_logits_match(LLM(str(path), device="cuda", dtype="float32"), hf, 1e-3)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_read_pinned_copies_every_bit_pattern(dtype):
    """The kernel read of pinned host memory (CPU attention's output) gives the same bytes as a copy,
    for sources carved at an offset out of a pinned slab, as the host memory allocator hands them out."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from flexoff.runtime.tiers import HostMemory, read_pinned

    integer = {2: torch.int16, 4: torch.int32}[dtype.itemsize]
    info = torch.iinfo(integer)
    bits = torch.randint(info.min, info.max, (3, 5, 7), dtype=integer)
    bits.view(-1)[:4] = torch.tensor([0, 1, -1, info.min], dtype=integer)  # +0, a subnormal, a NaN, -0
    host = HostMemory(pin=True)
    host.empty((13,), torch.uint8)  # the source starts past the slab's first bytes
    source = host.empty(bits.shape, dtype)
    source.view(integer).copy_(bits)
    target = torch.full(bits.shape, 7, dtype=dtype, device="cuda")
    assert source.is_pinned()
    read_pinned(target, source)
    assert torch.equal(target.cpu().view(integer), bits)
    host.close()


def test_registered_host_memory_copies_and_is_unregistered_on_close():
    """torch's is_pinned() does not report registered memory (it is not the CUDA host allocator's),
    so this checks what the weights need: copies to the GPU from it, and unregistering on close."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from flexoff.runtime.tiers import HostMemory

    host = HostMemory(pin=True, exact=True)
    small, large = host.empty((3,), torch.float16), host.empty((5000, 7), torch.float32)
    assert small.data_ptr() % 4096 == 0 and large.data_ptr() % 4096 == 0 and large.data_ptr() != small.data_ptr()
    large.copy_(torch.randn(5000, 7))
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        on_gpu = large.to("cuda", non_blocking=True)
        back = torch.empty_like(large)
        back.copy_(on_gpu * 2)  # through pageable memory: synchronous
    assert torch.equal(back, large * 2)
    host.close()
    assert torch.equal(large * 2, back)  # still valid memory after close
    # Unregistered, the same pages can be registered again.
    assert int(torch.cuda.cudart().cudaHostRegister(large.data_ptr(), 4096, 0)) == 0
    assert int(torch.cuda.cudart().cudaHostUnregister(large.data_ptr())) == 0
