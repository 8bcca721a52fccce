"""Progress you can trust: the time left counts the prefills to come, and bars move with tokens."""

import pytest

from flexoff.progress import TokenProgress


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_time_left_counts_the_prefills_still_to_come():
    # Two blocks of 100 prompt tokens and 10 new tokens each: prefill takes 20 s, each token 1 s.
    clock = Clock()
    progress = TokenProgress(200, 20, clock)
    assert progress.remaining() is None  # nothing timed yet
    progress.block_started(100)
    clock.now += 20
    progress.generated(1)  # the prefill's first token comes before its end is signalled
    progress.prefilled()
    for _ in range(9):
        clock.now += 1
        progress.generated(1)
    progress.block_done(0)
    # Left: one prefill (20 s) and 10 tokens (10 s). The token rate alone (10 tokens in 29 s) says 29 s;
    # decode's rate alone says 10 s.
    assert progress.remaining() == pytest.approx(30.0)
    progress.block_started(100)
    clock.now += 20
    progress.generated(1)
    progress.prefilled()
    assert progress.remaining() == pytest.approx(9.0)


def test_unused_budget_counts_as_done():
    clock = Clock()
    progress = TokenProgress(10, 8, clock)
    progress.block_started(10)
    clock.now += 2
    progress.generated(2)
    progress.prefilled()
    clock.now += 1
    progress.generated(2)
    progress.block_done(4)  # the sequences stopped early
    assert progress.remaining() == pytest.approx(0.0)
    assert progress.new_done == 8


class Recorder:
    def __init__(self):
        self.events = []

    def start(self, prompt_tokens, new_tokens):
        self.events.append(("start", prompt_tokens, new_tokens))

    def block_started(self, prompt_tokens):
        self.events.append(("block", prompt_tokens))

    def prefilled(self):
        self.events.append(("prefilled",))

    def generated(self, count):
        self.events.append(("tokens", count))

    def block_done(self, unused):
        self.events.append(("done", unused))

    def close(self):
        self.events.append(("close",))


def test_generate_tells_its_tracker_each_blocks_prefill_and_tokens():
    from flexoff import LLM, Policy, SamplingParams

    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]
    recorder = Recorder()
    with LLM("opt-125m", dummy=True, device="cpu", policy=Policy(gpu_batch_size=1, num_gpu_batches=2)) as llm:
        result = llm.generate(prompts, SamplingParams(max_new_tokens=3, ignore_eos=True), tracker=recorder)
    events = recorder.events
    assert events[0] == ("start", 10, 12) and events[-1] == ("close",)
    blocks = [i for i, e in enumerate(events) if e[0] == "block"]
    assert len(blocks) == 2
    for start in blocks:
        block = events[start:events.index(("done", 0), start) + 1]
        # Two GPU batches: each one's first token, then the prefill's end, then decode's tokens.
        assert block[1:4] == [("tokens", 1), ("tokens", 1), ("prefilled",)]
        assert block.count(("prefilled",)) == 1 and sum(e[1] for e in block if e[0] == "tokens") == 6
    assert sum(e[1] for e in events if e[0] == "block") == 10
    assert result.metrics.generated_tokens == 12


class _Stream:
    def __init__(self, tty: bool):
        self.tty, self.text = tty, ""

    def isatty(self) -> bool:
        return self.tty

    def write(self, text: str) -> None:
        self.text += text

    def flush(self) -> None:
        pass


def test_a_progress_line_is_rewritten_on_a_terminal_and_a_line_each_elsewhere():
    from flexoff.commands.report import ProgressLine

    for tty, expected in ((False, "measuring   0%  copies\nmeasuring  40%  host time\nmeasuring 100%\n"),
                          (True, "\r\x1b[Kmeasuring   0%  copies\r\x1b[Kmeasuring  40%  host time"
                                 "\r\x1b[Kmeasuring 100%\n")):
        stream = _Stream(tty)
        line = ProgressLine("measuring", stream)
        line(0.0, "copies")
        line(0.4, "host time")
        line(1.0, None)
        assert stream.text == expected
