"""`flexoff eval` (lm-evaluation-harness's own command line with the flexoff model) against lm_eval's
`hf` model on the same tiny checkpoint: a multiple-choice and a generate_until task, plain and
through a chat template."""

import json
import shutil
import sys
import types
from importlib.util import find_spec

import pytest

pytest.importorskip("lm_eval")
pytest.importorskip("yaml")

from flexoff.commands.main import main  # noqa: E402

from .conftest import write_lm_eval_tasks  # noqa: E402

pytestmark = pytest.mark.usefixtures("lm_eval_index_once")

DOCS = [
    {"question": "The cat sat on the", "choices": ["mat", "dog", "river"], "answer": 0},
    {"question": "Question: what is 2 + 2?\nAnswer:", "choices": ["4", "5"], "answer": 0},
    {"question": "Rain fell on the city and", "choices": ["the river rose", "a frog sang"], "answer": 1},
    {"question": "Fact: the dog ran to the", "choices": ["house", "mat"], "answer": 0},
]
TASKS = {
    "flexoff_eval_mc": {
        "output_type": "multiple_choice", "doc_to_text": "{{question}}", "doc_to_choice": "{{choices}}",
        "doc_to_target": "{{answer}}", "metric_list": [{"metric": "acc"}],
    },
    "flexoff_eval_gen": {
        "output_type": "generate_until", "doc_to_text": "{{question}}", "doc_to_target": "{{choices[answer]}}",
        "generation_kwargs": {"until": ["\n"], "max_gen_toks": 6, "do_sample": False, "repetition_penalty": 1.0,
                              "num_beams": 1},
        "metric_list": [{"metric": "exact_match"}],
    },
    "flexoff_eval_beams": {  # a setting flexoff cannot honour
        "output_type": "generate_until", "doc_to_text": "{{question}}", "doc_to_target": "{{choices[answer]}}",
        "generation_kwargs": {"until": ["\n"], "max_gen_toks": 4, "num_beams": 3},
        "metric_list": [{"metric": "exact_match"}],
    },
}
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


@pytest.fixture(scope="module")
def tasks_dir(tmp_path_factory):
    return write_lm_eval_tasks(tmp_path_factory.mktemp("eval-tasks"), TASKS, DOCS)


@pytest.fixture(scope="module")
def chat_model(tiny_opt, tmp_path_factory):
    """The tiny checkpoint with a chat template in its tokenizer config."""
    directory = tmp_path_factory.mktemp("tiny-chat")
    for file in tiny_opt[0].iterdir():
        shutil.copy(file, directory / file.name)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    return directory


def run_eval(argv):
    """``flexoff eval ARGV`` in this process. lm_eval's command line adds a log handler on the
    stderr of the moment; it goes again afterwards, so that no later test logs to a closed capture."""
    import logging

    import lm_eval.utils

    logger = logging.getLogger("lm_eval")
    before = list(logger.handlers)
    lm_eval.utils._LOGGING_CONFIGURED = False
    try:
        return main(["eval", *argv])
    finally:
        for handler in [h for h in logger.handlers if h not in before]:
            logger.removeHandler(handler)


def flexoff_eval(model_dir, tasks, tasks_dir, out, *extra):
    code = run_eval(["--model", "flexoff", "--model_args", f"pretrained={model_dir}", "--tasks", ",".join(tasks),
                 "--include_path", str(tasks_dir), "--output_path", str(out), "--log_samples", "--device", "cpu",
                 *extra])
    assert code == 0
    samples = {}
    for task in tasks:
        (file,) = out.rglob(f"samples_{task}_*.jsonl")
        samples[task] = sorted((json.loads(line) for line in file.read_text().splitlines()),
                               key=lambda s: s["doc_id"])
    return samples


@pytest.fixture(scope="module", autouse=True)
def single_process_accelerate():
    """lm_eval's hf model imports accelerate, which it needs only for several processes; where it is
    missing, a single-process stand-in with the names it imports."""
    if find_spec("accelerate") is not None:
        yield
        return
    import torch

    class Accelerator:
        num_processes = 1
        device = torch.device("cpu")

        def __init__(self, **kwargs):
            pass

    stub = types.ModuleType("accelerate")
    stub.Accelerator = Accelerator
    stub.InitProcessGroupKwargs = lambda **kwargs: None
    stub.find_executable_batch_size = lambda starting_batch_size: (lambda function: function)
    stub.utils = types.ModuleType("accelerate.utils")
    stub.utils.get_max_memory = dict
    sys.modules.update({"accelerate": stub, "accelerate.utils": stub.utils})
    yield
    for name in ("accelerate", "accelerate.utils", "lm_eval.models.huggingface"):
        sys.modules.pop(name, None)


def hf_eval(model_dir, tasks, tasks_dir, **kwargs):
    import lm_eval
    import torch
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # The model is loaded here (as HFLM would, in float32 on the CPU) so that no device map needs accelerate.
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    hf = HFLM(pretrained=model, tokenizer=AutoTokenizer.from_pretrained(model_dir), device="cpu")
    results = lm_eval.simple_evaluate(model=hf, tasks=tasks, task_manager=TaskManager(include_path=str(tasks_dir)),
                                      log_samples=True, num_fewshot=0, **kwargs)
    return {task: sorted(results["samples"][task], key=lambda s: s["doc_id"]) for task in tasks}


def contexts(samples):
    """Each request's context, from samples as lm_eval keeps them in memory or writes them."""
    args = [s["arguments"] for s in samples]
    return [a["arg_0"] if isinstance(a, dict) else a[0] for sample in args
            for a in (sample.values() if isinstance(sample, dict) else sample)]


def loglikelihoods(samples):
    return [float(resp[0][0]) for sample in samples for resp in sample["resps"]]


def generations(samples):
    return [sample["resps"][0][0] for sample in samples]


def test_flexoff_eval_agrees_with_lm_evals_hf_model(tiny_opt, tasks_dir, tmp_path, capsys):
    tasks = ["flexoff_eval_mc", "flexoff_eval_gen"]
    ours = flexoff_eval(tiny_opt[0], tasks, tasks_dir, tmp_path / "out")
    bars = capsys.readouterr().err
    assert "Running loglikelihood requests" in bars and "Running generate_until requests" in bars
    theirs = hf_eval(tiny_opt[0], tasks, tasks_dir)
    assert len(loglikelihoods(ours["flexoff_eval_mc"])) == sum(len(d["choices"]) for d in DOCS)
    assert loglikelihoods(ours["flexoff_eval_mc"]) == pytest.approx(loglikelihoods(theirs["flexoff_eval_mc"]),
                                                                    abs=1e-4)
    got = generations(ours["flexoff_eval_gen"])
    assert got == generations(theirs["flexoff_eval_gen"]) and any(got)


def test_flexoff_eval_applies_the_chat_template_as_lm_evals_hf_model_does(chat_model, tasks_dir, tmp_path):
    tasks = ["flexoff_eval_mc", "flexoff_eval_gen"]
    ours = flexoff_eval(chat_model, tasks, tasks_dir, tmp_path / "out", "--apply_chat_template")
    theirs = hf_eval(chat_model, tasks, tasks_dir, apply_chat_template=True)
    for task in tasks:  # the prompts went through the template
        assert contexts(ours[task]) == contexts(theirs[task])
        assert all(c.startswith("user: ") and c.endswith("assistant:") for c in contexts(ours[task]))
    assert loglikelihoods(ours["flexoff_eval_mc"]) == pytest.approx(loglikelihoods(theirs["flexoff_eval_mc"]),
                                                                    abs=1e-4)
    assert generations(ours["flexoff_eval_gen"]) == generations(theirs["flexoff_eval_gen"])


def test_generation_settings_map_to_sampling_params_by_name_or_are_refused():
    from flexoff.errors import SamplingError
    from flexoff.harness.lm_eval_adapter import sampling_fields

    fields, sample = sampling_fields({"max_gen_toks": 7, "do_sample": False, "temperature": 0.7, "num_beams": 1,
                                      "repetition_penalty": 1.0, "top_p": None})
    assert (fields, sample) == ({"max_new_tokens": 7, "repetition_penalty": 1.0, "temperature": 0.0}, False)
    fields, sample = sampling_fields({"do_sample": True, "top_k": 5, "seed": 3})
    assert (fields, sample) == ({"top_k": 5, "seed": 3, "temperature": 1.0}, True)
    for key in ("num_beams", "length_penalty", "typical_p"):
        with pytest.raises(SamplingError, match=f"lm_eval generation setting {key}=3 is not supported by flexoff"):
            sampling_fields({key: 3})
    # HF's spellings of settings SamplingParams knows by vLLM's names are handed over under those;
    # a value SamplingParams refuses is refused by the name lm-eval gave.
    fields, _ = sampling_fields({"min_new_tokens": 3, "max_gen_toks": 5, "repetition_penalty": 1.2})
    assert fields == {"min_tokens": 3, "max_new_tokens": 5, "repetition_penalty": 1.2, "temperature": 0.0}
    with pytest.raises(SamplingError, match="lm_eval generation setting repetition_penalty=0: "):
        sampling_fields({"repetition_penalty": 0})
    # A minimum past flexoff's default budget of 32 is checked against the request's own budget, not that one.
    fields, _ = sampling_fields({"min_new_tokens": 50, "max_gen_toks": 100})
    assert fields == {"min_tokens": 50, "max_new_tokens": 100, "temperature": 0.0}
    with pytest.raises(SamplingError, match="lm_eval generation setting min_new_tokens=-1: "):
        sampling_fields({"min_new_tokens": -1})


def test_a_generation_setting_flexoff_cannot_honour_ends_flexoff_eval_with_one_line(tiny_opt, tasks_dir, capsys):
    code = run_eval(["--model", "flexoff", "--model_args", f"pretrained={tiny_opt[0]}", "--tasks",
                     "flexoff_eval_beams", "--include_path", str(tasks_dir), "--device", "cpu"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "Traceback" not in "\n".join(err)
    assert err[-1].startswith("flexoff: error: lm_eval generation setting num_beams=3 is not supported by flexoff")


def test_a_model_without_a_chat_template_is_refused_by_name(tiny_opt):
    from flexoff.errors import FlexoffError
    from flexoff.harness.lm_eval_adapter import FlexoffLM

    lm = FlexoffLM(pretrained=str(tiny_opt[0]), device="cpu")
    try:
        with pytest.raises(FlexoffError, match="has no chat template"):
            lm.apply_chat_template([{"role": "user", "content": "hi"}])
    finally:
        lm.close()


def test_policy_auto_plans_once_for_the_calls_longest_request(tiny_opt, tmp_path):
    from types import SimpleNamespace

    from flexoff.harness.lm_eval_adapter import FlexoffLM

    requests = [SimpleNamespace(args=(doc["question"], {"until": ["\n"], "max_gen_toks": 2 + i}))
                for i, doc in enumerate(DOCS)]
    common = dict(pretrained=str(tiny_opt[0]), device="cpu", dtype="bfloat16")
    auto = FlexoffLM(policy="auto", hardware="t4", **common)
    assert auto.llm is None  # nothing is loaded before the requests are known
    with pytest.warns(UserWarning, match="planned .* on ") as planned:
        texts = auto.generate_until(requests, disable_tqdm=True)
    longest = max(len(tiny_opt[2](doc["question"])["input_ids"]) for doc in DOCS)
    assert f"policy auto for prompt {longest}, generate {1 + len(DOCS)}" in str(planned[0].message)
    policy = tmp_path / "planned.json"
    auto.llm.policy.save(policy)
    first = auto.llm
    auto.generate_until(requests[:2], disable_tqdm=True)
    assert auto.llm is first  # shorter requests: no second plan
    auto.close()
    fixed = FlexoffLM(policy=str(policy), **common)
    assert fixed.generate_until(requests, disable_tqdm=True) == texts
    fixed.close()


def test_import_flexoff_registers_the_model_by_path_without_loading_it():
    from tests import processes

    from .conftest import REPO

    code = ("import sys, flexoff\n"
            "from lm_eval.api.registry import get_model\n"
            "print('flexoff.harness.lm_eval_adapter' in sys.modules, 'torch' in sys.modules)\n"
            "print(get_model('flexoff').__module__)\n")
    proc = processes.run([sys.executable, "-c", code], cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[:2] == ["False False", "flexoff.harness.lm_eval_adapter"]
