"""Stop strings matched one token at a time stop exactly where searching the whole decoded text would."""

import random

import pytest

from flexoff import SamplingParams
from flexoff.runtime.stopping import StopCondition, StopStrings

TEXT = ("the cat sat on the mat. Le café était déjà fermé; naïve coöperation — 東京 and 北京 are cities. "
        "emoji 🙂🙃 end. the cat, the hat; the bat!") * 4


def byte_level(text: str):
    """A byte-level BPE (multi-byte characters split across tokens), trained on ``text``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([text], trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                        special_tokens=["</s>"]))
    return tok


def metaspace(text: str):
    """A sentencepiece-like vocabulary: words carry a leading "▁" that decoding drops at the start."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator([text], trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "</s>"]))
    return tok


def whole_text_stop(decode, ids, stops) -> int | None:
    """The rule stop strings replace: decode everything after each token and search it."""
    for n in range(1, len(ids) + 1):
        text = decode(ids[:n])
        if any(stop in text for stop in stops):
            return n
    return None


def incremental_stop(decode, ids, stops) -> int | None:
    strings = StopStrings(stops, decode)
    for n, token in enumerate(ids, 1):
        if strings.add(token):
            return n
    return None


@pytest.mark.parametrize("build", [byte_level, metaspace])
def test_stop_strings_across_token_boundaries_match_the_whole_text_rule(build):
    tok = build(TEXT)

    def decode(ids):
        return tok.decode(ids, skip_special_tokens=True)

    rng = random.Random(3)
    special = tok.token_to_id("</s>")
    found = spanning = 0
    for trial in range(300):
        if trial % 2:  # a passage of the text, so that stop strings occur...
            start = rng.randrange(len(TEXT) // 2)
            ids = tok.encode(TEXT[start:start + 60]).ids
        else:  # ...or random tokens, special ones among them
            ids = [rng.randrange(tok.get_vocab_size()) for _ in range(30)]
            ids[rng.randrange(30)] = special
        text = decode(ids)
        a, b = sorted(rng.sample(range(len(text) + 1), 2))
        stops = [text[a:a + rng.randint(1, 6)] or "x", rng.choice(["é", "東京", "🙃", "the", "; n", "zz"])]
        stops = [s for s in stops if s]
        expected = whole_text_stop(decode, ids, stops)
        assert incremental_stop(decode, ids, stops) == expected, (ids, stops)
        if expected is not None:
            found += 1
            last = decode(ids[expected - 1:expected])
            spanning += not any(stop in last for stop in stops)
    assert found > 50 and spanning > 20  # stops were hit, many across token boundaries


def test_stop_condition_order():
    """An end-of-sequence id stops before the budget; ignored, it counts as any token."""
    words = {1: "a", 2: "b", 3: "c"}

    def text(ids):
        return " ".join(words[i] for i in ids)

    stop = StopCondition(SamplingParams(max_new_tokens=3, stop=("b c",)), [9], text)
    assert [stop.add(t) for t in (1, 2, 3)] == [None, None, "stop"]
    stop = StopCondition(SamplingParams(max_new_tokens=2), [9], text)
    assert [stop.add(t) for t in (9,)] == ["stop"]
    stop = StopCondition(SamplingParams(max_new_tokens=2, ignore_eos=True), [9], None)
    assert [stop.add(t) for t in (9, 9)] == [None, "length"]
