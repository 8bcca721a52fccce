"""A block's memory (its batches, caches and host buffers) is freed as soon as its generation
returns, without waiting for a garbage collection: a block of a large job holds tens of GiB of
pinned host memory, and the next block allocates its own beside it."""

import gc

import pytest
import torch

from flexoff.policy import Policy, TierFractions
from flexoff.runtime.batch import GpuBatch, Running, Sequence
from flexoff.runtime.block_run import BlockRun
from flexoff.runtime.engine import Engine
from flexoff.runtime.interpreter import BlockInterpreter
from flexoff.runtime.kv import BatchKV, BlockKV
from flexoff.runtime.sampling import SamplingParams
from flexoff.models.registry import resolve_model
from flexoff.weights.checkpoint import CheckpointWeights

BLOCK_TYPES = (BlockRun, BlockInterpreter, Running, GpuBatch, BatchKV, BlockKV)


def _alive() -> list[str]:
    return sorted(type(o).__name__ for o in gc.get_objects() if isinstance(o, BLOCK_TYPES))


@pytest.mark.parametrize("policy", [
    Policy(2, 2),
    Policy(2, 2, weights=TierFractions(0.3, 0.5, 0.2), cache=TierFractions(0.4, 0.3, 0.3),
           activations=TierFractions(0.5, 0.5, 0)),
    Policy(2, 1, cache=TierFractions(0, 1, 0), cpu_attention=True),
], ids=["device", "offloaded", "cpu-attention"])
def test_nothing_of_a_block_outlives_its_generation(tiny_model_dir, tmp_path, policy):
    directory, _ = tiny_model_dir("opt-pre")
    cfg, _ = resolve_model(str(directory))
    engine = Engine(cfg, CheckpointWeights(directory), policy, torch.device("cpu"), torch.float32,
                    offload_dir=str(tmp_path))
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()  # what a collection would free does not count
    try:
        params = SamplingParams(max_new_tokens=3, ignore_eos=True)
        blocks = [[Sequence(i, [5, 6, 7 + i], params, 0) for i in range(b, b + 4)] for b in (0, 4)]
        engine.generate_block(blocks[0])
        assert _alive() == []
        engine.generate_blocks(blocks)  # two in rotation
        assert _alive() == []
        assert all(len(s.token_ids) == 3 for block in blocks for s in block)
    finally:
        if enabled:
            gc.enable()
        engine.close()
