"""The block interpreter hands its owner what happened, as events in the schedule's order: a head
ready for each HEAD step, tokens taken at each RECV_TOKENS, a batch finished once its sequences
have; and whether a batch still runs is one record, which the schedule, the interpreter and the
batch all read."""

import pytest
import torch

from flexoff.models.registry import resolve_model
from flexoff.policy import Policy
from flexoff.runtime.batch import Sequence
from flexoff.runtime.engine import Engine
from flexoff.runtime.interpreter import BatchFinished, HeadReady, TokensTaken
from flexoff.runtime.pipeline import PipelineLink, PipelinePlace
from flexoff.runtime.sampling import SamplingParams
from flexoff.runtime.schedule import COMPUTE, HEAD, RECV_TOKENS
from flexoff.weights.checkpoint import CheckpointWeights

PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]
BUDGETS = [2, 2, 3, 3]  # batch 0 (the first two sequences) ends a token before batch 1


@pytest.fixture
def engine(tiny_model_dir, request):
    directory, _ = tiny_model_dir("opt-pre")
    cfg, _ = resolve_model(str(directory))
    link = request.param() if hasattr(request, "param") else None  # a pipeline device's link, made here
    engine = Engine(cfg, CheckpointWeights(directory), Policy(2, 2), torch.device("cpu"), torch.float32, link=link)
    yield engine
    engine.close()


def _sequences() -> list[Sequence]:
    return [Sequence(i, ids, SamplingParams(max_new_tokens=n, ignore_eos=True), 0)
            for i, (ids, n) in enumerate(zip(PROMPTS, BUDGETS))]


def _take_token(seq: Sequence) -> None:
    """What a head step does to a sequence, without the head's math: one token, and its end at its budget."""
    seq.token_ids.append(3)
    if len(seq.token_ids) == seq.params.max_new_tokens:
        seq.finish_reason = "length"


def _timeline(engine: Engine, on_event=None):
    """Run a block over the interpreter alone: its steps and events in the order they came, and its batches."""
    seqs = _sequences()
    batches = engine.make_batches(seqs, max(BUDGETS))
    timeline = []
    engine.observer = timeline.append
    interpreter = engine.interpreter(batches)
    for event in interpreter.run(max(BUDGETS)):
        timeline.append(event)
        if on_event is not None:
            on_event(event, batches, interpreter)
    return timeline, batches, interpreter


def _sample(event, batches, interpreter) -> None:
    if isinstance(event, HeadReady):
        for seq in batches[event.batch].seqs:
            if not seq.finished:
                _take_token(seq)


def test_a_block_yields_a_head_per_head_step_and_finishes_its_batches(engine):
    timeline, batches, interpreter = _timeline(engine, _sample)
    events = [entry for entry in timeline if not hasattr(entry, "kind")]
    assert [type(e).__name__[0] + str(e.batch) for e in events] == [
        "H0", "H1",  # the prefill
        "H0", "B0", "H1",  # batch 0's sequences reach their budget
        "H1", "B1",
    ]
    for position, entry in enumerate(timeline):  # each head comes right after its step
        if isinstance(entry, HeadReady):
            step = timeline[position - 1]
            assert (step.kind, step.batch) == (HEAD, entry.batch)
            assert "lm_head.weight" in entry.weights
    finished = timeline.index(BatchFinished(0))
    assert all(getattr(entry, "batch", None) != 0 for entry in timeline[finished + 1:])
    assert [b.active for b in batches] == list(interpreter.running) == [False, False]
    assert [len(s.token_ids) for b in batches for s in b.seqs] == BUDGETS


def test_a_batch_retired_by_its_owner_leaves_the_schedule_and_the_interpreter(engine):
    """The batch's own record is what the schedule and the interpreter read: retired at its first
    head step, batch 1 takes no further step, though none of its sequences has finished."""

    def retire_batch_one(event, batches, interpreter):
        _sample(event, batches, interpreter)
        if isinstance(event, HeadReady) and event.batch == 1:
            batches[1].retire()
            assert list(interpreter.running) == [True, False] and interpreter.running[1] is False

    timeline, batches, _ = _timeline(engine, retire_batch_one)
    retired = next(n for n, e in enumerate(timeline) if isinstance(e, HeadReady) and e.batch == 1)
    assert all(getattr(entry, "batch", None) != 1 for entry in timeline[retired + 1:])
    assert not any(isinstance(e, BatchFinished) and e.batch == 1 for e in timeline)
    assert [len(s.token_ids) for s in batches[1].seqs] == [1, 1]
    assert [len(s.token_ids) for s in batches[0].seqs] == BUDGETS[:2]


class FirstDevice:
    """The link of a pipeline's first device (the embedding's) of three, its peers played here: hidden
    states and marks are recorded, and each batch's tokens come back as a head step makes them."""

    forwards_marks = PipelineLink.forwards_marks

    def __init__(self):
        self.place = PipelinePlace(0, (range(0, 2), range(2, 3), range(3, 4)))  # the tiny OPT's 4 stages
        self.sent: list[tuple[int, bool]] = []  # (batch, is a mark)

    def send_hidden(self, batch: int, hidden) -> None:
        self.sent.append((batch, hidden is None))

    def recv_tokens(self, batch: int, seqs: list[Sequence]) -> int:
        live = [s for s in seqs if not s.finished]
        for seq in live:
            _take_token(seq)
        return len(live)

    def flush(self) -> None:
        pass


@pytest.mark.parametrize("engine", [FirstDevice], indirect=True, ids=["first-of-three"])
def test_a_first_device_takes_tokens_and_passes_on_a_finished_batchs_mark(engine):
    """Token i's receive brings the tokens of head step i - 1: batch 0 reaches its budget at token 2's,
    and its mark goes on to the middle device; batch 1's last token comes with the block's results."""
    timeline, batches, interpreter = _timeline(engine)
    assert [entry for entry in timeline if not hasattr(entry, "kind")] == [
        TokensTaken(0, 2), TokensTaken(1, 2), TokensTaken(0, 2), BatchFinished(0), TokensTaken(1, 2)]
    for position, entry in enumerate(timeline):
        if isinstance(entry, TokensTaken):
            step = timeline[position - 1]
            assert (step.kind, step.batch) == (RECV_TOKENS, entry.batch)
    finished = timeline.index(BatchFinished(0))
    assert not any(getattr(e, "kind", None) == COMPUTE and e.batch == 0 for e in timeline[finished:])
    sent = engine.link.sent
    assert sent.count((0, True)) == 1 and all(batch != 0 for batch, _ in sent[sent.index((0, True)) + 1:])
    assert (1, True) not in sent
    assert [b.active for b in batches] == list(interpreter.running) == [False, True]
