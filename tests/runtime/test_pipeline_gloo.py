"""Pipeline stages in separate processes (gloo on the CPU): two and three devices, each holding its
range of the model's stages with weights and cache offloaded, generate the tokens one process
does, greedy and seeded, with batches finishing at different tokens."""

import json
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from flexoff.models.registry import resolve_model
from flexoff.policy import Policy, TierFractions
from flexoff.runtime.batch import Sequence
from flexoff.runtime.engine import Engine
from flexoff.runtime.pipeline import PipelineLink, PipelinePlace
from flexoff.runtime.sampling import SamplingParams
from flexoff.weights.checkpoint import CheckpointWeights
from tests import processes

POLICY = Policy(2, 2, weights=TierFractions(0.3, 0.5, 0.2), cache=TierFractions(0.5, 0, 0.5),
                activations=TierFractions(0.5, 0.5, 0))
PROMPTS = [[5, 9, 11, 3], [7, 7, 21, 30, 4, 8], [12, 4, 6], [40, 41, 42, 43, 44]]
# Batch 0 (sequences 0 and 1) ends after two tokens, batch 1 goes on: its devices hear of it.
LENGTHS = [2, 2, 5, 3]


def _sequences(sampled: bool) -> list[Sequence]:
    def params(n):
        return SamplingParams(max_new_tokens=n, ignore_eos=True, temperature=0.8 if sampled else 0.0)
    return [Sequence(i, prompt, params(n), seed=100 + i) for i, (prompt, n) in enumerate(zip(PROMPTS, LENGTHS))]


def _engine(directory, offload_dir, link=None) -> Engine:
    cfg, _ = resolve_model(str(directory))
    return Engine(cfg, CheckpointWeights(directory), POLICY, torch.device("cpu"), torch.float32, seed=0,
                  offload_dir=str(offload_dir), link=link)


def _outputs(engine: Engine) -> list:
    results = []
    for sampled in (False, True):
        seqs = _sequences(sampled)
        engine.generate_block(seqs)
        results.append([[s.token_ids, s.finish_reason, [round(p, 4) for p in s.logprobs]] for s in seqs])
    return results


def _device(rank, ranges, directory, tmp, world, rotate=False):
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world,
                            timeout=timedelta(seconds=processes.LIMIT_SECONDS))
    try:
        link = PipelineLink(PipelinePlace(rank, ranges), torch.device("cpu"), torch.float32)
        engine = _engine(directory, tmp / f"offload{rank}", link)
        try:
            outputs = _rotation_outputs(engine, world) if rotate else _outputs(engine)
        finally:
            engine.close()
        if rank == 0:
            (tmp / "outputs.json").write_text(json.dumps(outputs))
    finally:
        dist.destroy_process_group()


def _single_then_devices(directory, tmp_path, ranges, rotate: bool, *runs) -> list:
    """Each of ``runs`` on one process's engine, then the pipeline's devices (rank 0 writes outputs.json)."""
    (tmp_path / "single").mkdir()
    for rank in range(len(ranges)):
        (tmp_path / f"offload{rank}").mkdir()
    single = _engine(directory, tmp_path / "single")
    try:
        results = [run(single) for run in runs]
    finally:
        single.close()
    mp.spawn(_device, args=(ranges, directory, tmp_path, len(ranges), rotate), nprocs=len(ranges), join=True)
    return results


@pytest.mark.parametrize("kind", ["opt-pre", "llama-gqa"])
@pytest.mark.parametrize("ranges", [(range(0, 2), range(2, 4)), (range(0, 1), range(1, 3), range(3, 4)),
                                    (range(0, 2), range(2, 3), range(3, 4))], ids=["2", "3", "3-late"])
def test_a_pipeline_generates_what_one_process_does(tiny_model_dir, tmp_path, kind, ranges):
    directory, _ = tiny_model_dir(kind)
    [expected] = _single_then_devices(directory, tmp_path, ranges, False, _outputs)
    assert json.loads((tmp_path / "outputs.json").read_text()) == json.loads(json.dumps(expected))
    assert [len(t) for t, _, _ in expected[0]] == LENGTHS


BLOCKS = [[0, 1], [2, 3], [1, 3]]  # sequences of each block in rotation (by PROMPTS index)


def _rotation_outputs(engine: Engine, count: int) -> list:
    """Blocks in rotation, seeded sampling: each sequence's tokens, reason and log-probabilities."""
    blocks = [[s for s in _sequences(True) if s.index in BLOCKS[b]] for b in range(count)]
    engine.generate_blocks(blocks)
    return [[[s.token_ids, s.finish_reason, [round(p, 4) for p in s.logprobs]] for s in seqs] for seqs in blocks]


@pytest.mark.parametrize("kind", ["opt-pre", "llama-gqa"])
@pytest.mark.parametrize("ranges", [(range(0, 2), range(2, 4)), (range(0, 1), range(1, 3), range(3, 4))],
                         ids=["2", "3"])
def test_as_many_blocks_as_devices_rotate_through_the_pipeline(tiny_model_dir, tmp_path, kind, ranges):
    """Each device runs one block's token over its stages while the others run the other blocks'."""
    directory, _ = tiny_model_dir(kind)
    alone, together = _single_then_devices(directory, tmp_path, ranges, True,
                                           lambda engine: [_rotation_outputs_one(engine, b) for b in range(len(ranges))],
                                           lambda engine: _rotation_outputs(engine, len(ranges)))
    assert together == alone  # rotation in one process changes nothing
    assert json.loads((tmp_path / "outputs.json").read_text()) == json.loads(json.dumps(alone))


def _rotation_outputs_one(engine: Engine, b: int) -> list:
    seqs = [s for s in _sequences(True) if s.index in BLOCKS[b]]
    engine.generate_block(seqs)
    return [[s.token_ids, s.finish_reason, [round(p, 4) for p in s.logprobs]] for s in seqs]
