"""LLM.score against transformers, and the lm-evaluation-harness adapter against LLM.score."""

from types import SimpleNamespace

import pytest
import torch

from flexoff import SamplingParams

from .conftest import write_lm_eval_tasks

pytestmark = pytest.mark.usefixtures("lm_eval_index_once")

PAIRS = [
    ("The cat sat on the", " mat"),
    ("Question: what is 2 + 2?\nAnswer:", " 4"),
    ("Rain fell on the city", " and the river rose over the road."),
    ("A", " new species of frog"),
]


def hf_logprobs(model, tok, prompt: str, continuation: str) -> tuple[list[float], bool]:
    """Each continuation token's log-probability, and whether transformers' greedy generation from
    the prompt gives the continuation."""
    prompt_ids = tok(prompt)["input_ids"]
    cont_ids = tok(continuation)["input_ids"][1:]  # without the BOS the tokenizer adds
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + cont_ids])).logits[0].double()
        generated = model.generate(torch.tensor([prompt_ids]), max_new_tokens=len(cont_ids), do_sample=False,
                                   min_new_tokens=len(cont_ids))[0, len(prompt_ids):].tolist()
    logprobs = torch.log_softmax(logits, dim=-1)
    return [float(logprobs[len(prompt_ids) - 1 + j, t]) for j, t in enumerate(cont_ids)], generated == cont_ids


def test_score_matches_transformers(tiny_opt, tiny_llm):
    _, model, tok = tiny_opt
    # The PAIRS, and each with its continuation replaced by what greedy decoding generates from it.
    greedy = [(prompt, tok.decode(tiny_llm.generate([prompt], SamplingParams(max_new_tokens=3, ignore_eos=True))[0]
                                  .token_ids)) for prompt, _ in PAIRS]
    pairs = PAIRS + greedy
    scores = tiny_llm.score([p for p, _ in pairs], [c for _, c in pairs])
    flags = []
    for (prompt, continuation), score in zip(pairs, scores):
        expected, is_greedy = hf_logprobs(model, tok, prompt, continuation)
        assert len(score.logprobs) == len(expected)
        assert score.logprobs == pytest.approx(expected, abs=1e-4)
        assert score.greedy == is_greedy
        flags.append(score.greedy)
    assert any(flags) and not all(flags)  # both answers occur


# lm-evaluation-harness

TASKS = {
    "flexoff_tiny_mc": {
        "output_type": "multiple_choice", "doc_to_text": "{{question}}", "doc_to_choice": "{{choices}}",
        "doc_to_target": "{{answer}}", "metric_list": [{"metric": "acc"}],
    },
    "flexoff_tiny_gen": {
        "output_type": "generate_until", "doc_to_text": "{{question}}", "doc_to_target": "{{choices[answer]}}",
        "generation_kwargs": {"until": ["\n"], "max_gen_toks": 5, "do_sample": False},
        "metric_list": [{"metric": "exact_match"}],
    },
    "flexoff_tiny_ppl": {
        "output_type": "loglikelihood_rolling", "doc_to_text": "", "doc_to_target": "{{question}}",
        "metric_list": [{"metric": "word_perplexity"}],
    },
}
DOCS = [
    {"question": "The cat sat on the", "choices": ["mat", "dog", "river"], "answer": 0},
    {"question": "Question: what is 2 + 2?\nAnswer:", "choices": ["4", "5"], "answer": 0},
    {"question": "Rain fell on the city and", "choices": ["the river rose", "a frog sang"], "answer": 1},
]


@pytest.fixture(scope="module")
def lm_eval_results(tiny_opt, tmp_path_factory):
    pytest.importorskip("lm_eval")
    pytest.importorskip("yaml")
    import lm_eval
    from lm_eval.tasks import TaskManager

    import flexoff.harness.lm_eval_adapter  # noqa: F401  (registers the model)

    tasks_dir = write_lm_eval_tasks(tmp_path_factory.mktemp("lm-eval-tasks"), TASKS, DOCS)
    return lm_eval.simple_evaluate(
        model="flexoff", model_args=f"pretrained={tiny_opt[0]}", tasks=list(TASKS),
        task_manager=TaskManager(include_path=str(tasks_dir)), log_samples=True, num_fewshot=0,
    )


def test_lm_eval_loglikelihood_equals_score(lm_eval_results, tiny_llm):
    samples = sorted(lm_eval_results["samples"]["flexoff_tiny_mc"], key=lambda s: s["doc_id"])
    for sample, doc in zip(samples, DOCS):
        scores = tiny_llm.score([doc["question"]] * len(doc["choices"]), [" " + c for c in doc["choices"]])
        got = [resp[0] for resp in sample["resps"]]  # one (logprob, is_greedy) per choice
        assert [float(r[0]) for r in got] == pytest.approx([sum(s.logprobs) for s in scores], abs=1e-5)
        for (_, is_greedy), score, choice in zip(got, scores, doc["choices"]):
            greedy = tiny_llm.generate([doc["question"]], SamplingParams(
                max_new_tokens=len(score.token_ids), ignore_eos=True))[0].token_ids
            assert is_greedy == (greedy == score.token_ids)
    assert 0.0 <= lm_eval_results["results"]["flexoff_tiny_mc"]["acc,none"] <= 1.0


def test_lm_eval_generate_until_equals_generate(lm_eval_results, tiny_llm):
    samples = sorted(lm_eval_results["samples"]["flexoff_tiny_gen"], key=lambda s: s["doc_id"])
    outputs = tiny_llm.generate([d["question"] for d in DOCS], SamplingParams(max_new_tokens=5, stop=("\n",)))
    assert [s["resps"][0][0] for s in samples] == [o.text for o in outputs]


def test_lm_eval_rolling_loglikelihood_equals_score(lm_eval_results, tiny_llm):
    samples = sorted(lm_eval_results["samples"]["flexoff_tiny_ppl"], key=lambda s: s["doc_id"])
    bos = tiny_llm.config.bos_token_id
    for sample, doc in zip(samples, DOCS):
        tokens = tiny_llm.tokenizer.encode(doc["question"])[1:]
        expected = sum(tiny_llm.score([[bos]], [tokens])[0].logprobs)
        assert float(sample["resps"][0][0]) == pytest.approx(expected, abs=1e-5)


def test_rolling_windows_cover_each_token_once(tiny_opt):
    pytest.importorskip("lm_eval")
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    from flexoff.harness.lm_eval_adapter import FlexoffLM

    _, model, tok = tiny_opt
    lm = FlexoffLM(pretrained=str(tiny_opt[0]))
    lm.max_length = 8  # force several windows over a short text
    text = "the cat sat on the mat and the dog ran to the house"
    got = lm.loglikelihood_rolling([SimpleNamespace(args=(text,))])[0]
    tokens = tok(text)["input_ids"][1:]
    # Reference: lm_eval's own windows (7 tokens of input each, as the adapter asks), scored by transformers.
    windows = list(map(make_disjoint_window, get_rolling_token_windows(tokens, tok.bos_token_id, 7, 1)))
    assert len(windows) > 1 and sum(len(target) for _, target in windows) == len(tokens)
    expected = 0.0
    for context, target in windows:
        with torch.no_grad():
            logprobs = torch.log_softmax(model(torch.tensor([context + target])).logits[0].double(), dim=-1)
        expected += sum(float(logprobs[len(context) - 1 + j, t]) for j, t in enumerate(target))
    assert got == pytest.approx(expected, abs=1e-4)
    lm.llm.close()


def test_unknown_model_args_are_refused(tiny_opt):
    pytest.importorskip("lm_eval")
    from flexoff.errors import FlexoffError
    from flexoff.harness.lm_eval_adapter import FlexoffLM

    with pytest.raises(FlexoffError, match="unknown flexoff model_args"):
        FlexoffLM(pretrained=str(tiny_opt[0]), polcy="x.json")


CONTEXT = "Rain fell on the city all night, and by morning the river had risen over the old stone road"


@pytest.mark.parametrize("greedy_check", [False, True])
def test_auto_plans_a_contexts_choices_for_the_prefix_they_share(tiny_opt, monkeypatch, greedy_check):
    """policy auto plans a scoring call from its prompts: the choices of a context share it (the
    workload's shared prefix), and a score generates one token, the greedy check included (it is
    read off the scoring pass)."""
    pytest.importorskip("lm_eval")
    from flexoff.harness.lm_eval_adapter import FlexoffLM

    lm = FlexoffLM(pretrained=str(tiny_opt[0]), device="cpu", policy="auto", greedy_check=greedy_check)
    planned = []
    make = lm._make_llm
    monkeypatch.setattr(lm, "_make_llm",
                        lambda policy, workload=None: planned.append(workload) or make(policy, workload))
    choices = [" and the boats", " so the town", " which no one", " yet the farmers of the valley"]
    requests = [SimpleNamespace(args=(CONTEXT, c)) for c in choices]
    try:
        results = lm.loglikelihood(requests)
        dtype = str(lm.llm.dtype).removeprefix("torch.")
    finally:
        lm.close()
    (workload,) = planned
    context = len(tiny_opt[2](CONTEXT)["input_ids"])
    longest = max(len(tiny_opt[2](c)["input_ids"]) - 1 for c in choices)
    assert workload.num_prompts == 4 and workload.gen_len == 1
    # The context less its last token (each choice's head reads the position before it) is shared.
    assert workload.shared_prefix == context - 1 and workload.prompt_len == context + longest
    assert workload.prefix_group == 4
    # The scores as a fixed policy's in the same 16-bit dtype auto plans.
    plain = FlexoffLM(pretrained=str(tiny_opt[0]), device="cpu", greedy_check=greedy_check, dtype=dtype)
    try:
        expected = plain.loglikelihood(requests)
    finally:
        plain.close()
    assert [g for _, g in results] == [g for _, g in expected]
    assert [s for s, _ in results] == pytest.approx([s for s, _ in expected], abs=1e-3)


def test_a_contexts_choices_are_ordered_together(tiny_opt):
    """Requests ordered by context, not by total length: a context's choices of different lengths
    sit together, where another context's requests of lengths between them would split them."""
    pytest.importorskip("lm_eval")
    from flexoff.harness.lm_eval_adapter import FlexoffLM

    lm = FlexoffLM(pretrained=str(tiny_opt[0]), device="cpu")
    try:
        contexts = [[5] * 30, [7] * 31] * 200
        lengths = [len(c) + (1 if i < 2 else 40) for i, c in enumerate(contexts)]
        chunks = lm._chunks(lengths, contexts)
        size = 4 * lm.llm.policy.block_size
        assert sorted(i for chunk in chunks for i in chunk) == list(range(len(contexts)))
        first = [i for i, c in enumerate(contexts) if c == contexts[0]]
        assert all(len(chunk) <= size for chunk in chunks)
        # Each context's requests are one run of the order, whatever their total lengths.
        order = [i for chunk in chunks for i in chunk]
        positions = sorted(order.index(i) for i in first)
        assert positions == list(range(positions[0], positions[0] + len(first)))
    finally:
        lm.close()
