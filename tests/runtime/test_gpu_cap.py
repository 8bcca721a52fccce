"""An LLM's gpu_mem cap is the process's allocator cap while it is open, and only then."""
import pytest
import torch

from flexoff import LLM

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_closing_an_llm_lifts_its_gpu_cap():
    past_the_cap = 2 * 2**30
    with LLM("opt-125m", dummy=True, device="cuda", gpu_mem="1GiB"):
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(past_the_cap, dtype=torch.uint8, device="cuda")
    # the next LLM of this process, or any other allocation, is not held to the closed one's cap
    held = torch.empty(past_the_cap, dtype=torch.uint8, device="cuda")
    del held


def test_memory_the_process_freed_but_kept_cached_is_not_handed_out_past_the_cap():
    past_the_cap = 2 * 2**30
    freed = torch.empty(2 * past_the_cap, dtype=torch.uint8, device="cuda")
    del freed  # the allocator keeps it reserved, ready to hand out again
    with LLM("opt-125m", dummy=True, device="cuda", gpu_mem="1GiB"):
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(past_the_cap, dtype=torch.uint8, device="cuda")
