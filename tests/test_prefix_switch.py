"""The prefix-sharing switch: ``LLM(prefix_sharing=...)``, ``--no-prefix-sharing`` on run, batch and
bench, and lm-eval's ``prefix_sharing`` model_arg reach the engine and block forming; a bad value is
one line; and the summary counts the prompt tokens shared only where some were."""

import re
from types import SimpleNamespace

import pytest
import torch

import flexoff.api.llm as api_llm
from flexoff import LLM, Policy
from flexoff.commands.args import job_from_args
from flexoff.commands.main import build_parser, main
from flexoff.commands.report import format_summary
from flexoff.errors import FlexoffError
from flexoff.job import Job
from flexoff.runtime.decode_graphs import DecodeGraphs
from flexoff.runtime.metrics import Metrics
from flexoff.runtime.sampling import SamplingParams


@pytest.fixture
def engines(monkeypatch):
    """Each engine built, as its share_prefixes."""
    made = []

    class Recorded(api_llm.Engine):
        def __init__(self, *args, share_prefixes=True, **kwargs):
            made.append(share_prefixes)
            super().__init__(*args, share_prefixes=share_prefixes, **kwargs)

    monkeypatch.setattr(api_llm, "Engine", Recorded)
    return made


@pytest.fixture
def formed(monkeypatch):
    """Each form_blocks call's keyword arguments."""
    calls = []
    real = api_llm.form_blocks

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(api_llm, "form_blocks", spy)
    return calls


@pytest.mark.parametrize("flags, sharing", [([], True), (["--no-prefix-sharing"], False)])
def test_no_prefix_sharing_reaches_the_engine(flags, sharing, tiny_model_dir, engines, capsys):
    path, _ = tiny_model_dir("opt-pre")
    assert main(["run", "--model", str(path), "--quiet", "--prompt-len", "20", "--gen-len", "2", "--num-prompts", "3",
                 *flags]) == 0
    assert engines == [sharing]


@pytest.mark.parametrize("command", [["run"], ["batch", "--input", "in.jsonl", "--output", "out.jsonl"],
                                     ["bench", "--scenario", "synthetic_reasoning"]])
def test_every_generating_command_takes_the_flag(command):
    parser = build_parser()
    assert job_from_args(parser.parse_args([*command, "--model", "m"])).prefix_sharing is True
    assert job_from_args(parser.parse_args([*command, "--model", "m", "--no-prefix-sharing"])).prefix_sharing is False


@pytest.mark.parametrize("sharing", [True, False])
def test_the_api_forms_blocks_by_prefix_only_when_sharing(sharing, tiny_model_dir, engines, formed):
    path, _ = tiny_model_dir("opt-pre")
    head = list(range(5, 25))
    prompts = [head + [30 + i] for i in range(3)]
    with LLM(str(path), policy=Policy(gpu_batch_size=2, num_gpu_batches=2), device="cpu", dtype="float32",
             prefix_sharing=sharing) as llm:
        llm.generate(prompts, [SamplingParams(max_new_tokens=2), SamplingParams(max_new_tokens=2, prompt_logprobs=1),
                               SamplingParams(max_new_tokens=2, n=2)])
        llm.next_token_logits(prompts)
        llm.score(prompts, [[40], [41, 42], [43]])
    assert engines == [sharing]
    generate, logits, score = formed
    if not sharing:  # as before the switch existed
        assert [c.get("prompts") for c in formed] == [None] * 3 and [c.get("keep") for c in formed] == [None] * 3
        assert generate["gpu_batch_size"] == 2 and logits["gpu_batch_size"] is None and score["gpu_batch_size"] is None
        return
    # Rows: prompt 0, prompt 1 (with prompt logprobs: the head reads its whole prompt), prompt 2 twice.
    assert generate["prompts"] == [prompts[0], prompts[1], prompts[2], prompts[2]]
    assert generate["keep"] == [1, 21, 1, 1]
    assert logits["prompts"] == prompts and logits["keep"] == [1, 1, 1]
    assert score["prompts"] == [prompts[0] + [40], prompts[1] + [41, 42], prompts[2] + [43]]
    assert score["keep"] == [2, 3, 2]
    assert all(c["gpu_batch_size"] == 2 for c in formed)


@pytest.mark.parametrize("value", ["no", 0, None])
def test_a_bad_prefix_sharing_value_is_one_line(value):
    with pytest.raises(FlexoffError) as caught:
        LLM("opt-125m", dummy=True, prefix_sharing=value)
    assert str(caught.value) == f"prefix_sharing must be true or false, got {value!r}"
    with pytest.raises(FlexoffError, match="prefix_sharing must be true or false"):
        Job(prefix_sharing=value)


def test_lm_eval_model_args_take_prefix_sharing(tiny_model_dir, engines):
    pytest.importorskip("lm_eval")
    from flexoff.harness.lm_eval_adapter import FlexoffLM

    path, _ = tiny_model_dir("opt-pre")
    model = FlexoffLM.create_from_arg_string(f"pretrained={path},device=cpu,prefix_sharing=false")
    try:
        assert model.llm.prefix_sharing is False and engines == [False]
    finally:
        model.close()
    with pytest.raises(FlexoffError, match=r"^flexoff model_args prefix_sharing='maybe': use true or false$"):
        FlexoffLM.create_from_arg_string(f"pretrained={path},device=cpu,prefix_sharing=maybe")


def fake_llm():
    """What format_summary reads of an LLM, for a one-process run on the CPU."""
    tiers = {"gpu": 1.0, "cpu": 0.0, "disk": 0.0}
    return SimpleNamespace(policy=Policy(), ranks=None, dtype=torch.float32, device=torch.device("cpu"),
                           config=SimpleNamespace(name="tiny", stored_compression=None, num_layers=2),
                           engine=SimpleNamespace(placement_report={"requested": tiers, "realised": tiers,
                                                                    "bytes": {"gpu": 100, "cpu": 0, "disk": 0}},
                                                  graphs=DecodeGraphs(torch.device("cpu"))))


def tokens_line(metrics: Metrics) -> str:
    (line,) = [line for line in format_summary(fake_llm(), metrics).splitlines() if line.startswith("tokens")]
    return line


def test_the_summary_counts_shared_prompt_tokens_beside_the_padding():
    figures = dict(num_sequences=8, prompt_tokens=900, padded_prompt_tokens=960, generated_tokens=16,
                   padded_generated_tokens=24, peak_memory={"cpu_rss": 1 << 20})
    shared = tokens_line(Metrics(**figures, shared_prompt_tokens=700))
    assert shared.startswith("tokens     prompt 900 actual / 960 padded · 700 shared · generated 16 actual / 24 padded")
    plain = tokens_line(Metrics(**figures))
    assert "shared" not in plain
    # Nothing shared: the line as it always was.
    assert re.fullmatch(r"tokens +prompt 900 actual / 960 padded · generated 16 actual / 24 padded · "
                        r"efficiency [0-9.]+%", plain)
    assert plain == shared.replace("700 shared · ", "")

