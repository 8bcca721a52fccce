"""The Job: built once from the flags, refused when a value is wrong, and run by the harness silently."""

import json

import pytest

from flexoff.commands.args import job_from_args
from flexoff.commands.main import build_parser
from flexoff.errors import ConfigError, PolicyError
from flexoff.job import Job, PolicySource
from flexoff.policy import CompressionConfig, TierFractions
from tests.conftest import PROMPTS


@pytest.mark.parametrize("fields, words", [
    ({"dtype": "float64"}, "unknown dtype 'float64'"),
    ({"device": "tpu"}, "unknown device 'tpu'"),
    ({"seed": -1}, "seed must be an integer in [0,"),
    ({"top_p": 0.0}, "top_p must be a number in (0, 1]"),
    ({"temperature": -0.5}, "temperature must be a number >= 0"),
    ({"stop": ("",)}, "stop strings must be non-empty"),
    ({"gpu_mem": "0GiB"}, "gpu_mem must be a positive size"),
    ({"model": ""}, "model must be"),
])
def test_a_job_with_a_wrong_value_is_refused_when_built(fields, words):
    with pytest.raises(ConfigError) as info:
        Job(**fields)
    assert words in str(info.value)


def test_percent_past_100_is_refused_when_the_policy_source_is_built():
    with pytest.raises(PolicyError, match="add up to 120%"):
        PolicySource.build(percent=(60, 60, 100, 0, 100, 0))


def test_the_flags_become_one_job():
    args = build_parser().parse_args([
        "run", "--model", "opt-1.3b", "--dummy", "--dtype", "bfloat16", "--seed", "7", "--top-p", "0.5",
        "--stop", "\n", "--percent", "20", "30", "100", "0", "100", "0", "--gpu-batch-size", "2",
        "--compress-cache", "--cache-bits", "8", "--gpu-mem", "1GiB", "--policy", "auto", "--hardware", "t4"])
    job = job_from_args(args)
    assert (job.model, job.dummy, job.dtype, job.seed, job.top_p, job.stop, job.gpu_mem) == (
        "opt-1.3b", True, "bfloat16", 7, 0.5, ("\n",), "1GiB")
    assert job.policy.searched and job.policy.hardware == "t4"
    overrides = dict(job.policy.overrides)
    assert overrides["gpu_batch_size"] == 2 and "num_gpu_batches" not in overrides
    assert overrides["weights"] == TierFractions(0.2, 0.3, 0.5)
    assert overrides["compress_cache"] == CompressionConfig(8, 64) and "compress_weight" not in overrides
    params = job.sampling(4, stop=("x",), seed=3)
    assert (params.max_new_tokens, params.top_p, params.stop, params.seed) == (4, 0.5, ("\n", "x"), 3)


def test_a_parallel_timeout_is_the_flags_or_else_the_parallel_default(monkeypatch):
    from flexoff.commands import llm
    from flexoff.deploy.parallel import DEFAULT_TIMEOUT_S

    given = job_from_args(build_parser().parse_args(["run", "--parallel-timeout", "5"]))
    assert given.parallel_timeout == 5.0
    assert job_from_args(build_parser().parse_args(["run"])).parallel_timeout is None
    with pytest.raises(ConfigError, match="parallel_timeout"):
        Job(parallel_timeout=0)
    # A parallel job's processes wait for their peers that long.
    seen = []
    monkeypatch.setattr("flexoff.deploy.deployment.parallel_ranks",
                        lambda parallel, config, device: seen.append(parallel))
    for timeout in (5.0, None):
        llm.job_deployment(Job(pipeline_parallel=2, parallel_timeout=timeout))
    assert [parallel.timeout_s for parallel in seen] == [5.0, DEFAULT_TIMEOUT_S]


def test_without_a_model_the_job_is_the_default_one_with_dummy_weights():
    job = job_from_args(build_parser().parse_args(["run"]))
    assert job == Job()


def test_the_batch_harness_runs_a_job_and_prints_nothing(tiny_model_dir, tmp_path, capsys):
    from flexoff import LLM
    from flexoff.commands.llm import job_deployment
    from flexoff.harness.batch import open_batch

    path, _ = tiny_model_dir("opt-pre")
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps({"id": f"p{i}", "prompt": p}) + "\n" for i, p in enumerate(PROMPTS[:3])))
    job = Job(model=str(path), dummy=False, device="cpu", ignore_eos=True)
    capsys.readouterr()  # building the checkpoint shows transformers' own bar
    deployment = job_deployment(job)
    batch = open_batch(job, deployment, source, tmp_path / "out.jsonl", max_new_tokens=3)
    try:
        assert batch.already == 0 and len(batch.pending) == 3 and batch.workload().gen_len == 3
        with LLM.from_deployment(deployment, batch.workload) as llm:
            metrics = batch.run(llm)
        assert metrics.generated_tokens == 9 and batch.done == 3 and batch.failures() is None
    finally:
        batch.close()
    assert capsys.readouterr() == ("", "")
    records = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert sorted(r["id"] for r in records) == ["p0", "p1", "p2"]


def test_one_prompt_check_for_every_caller():
    from flexoff.errors import PromptError, TokenizerError
    from flexoff.models import REGISTRY
    from flexoff.prompts import check_room, prompt_ids

    cfg = REGISTRY["opt-125m"]
    assert prompt_ids([5, 6], "prompt 0", cfg, None) == [5, 6]
    with pytest.raises(TokenizerError, match="^in.jsonl line 2: the prompt is text, but model 'opt-125m' has no"):
        prompt_ids("hello", "in.jsonl line 2: the prompt", cfg, None)
    with pytest.raises(PromptError, match="outside the vocabulary"):
        prompt_ids([cfg.vocab_size], "prompt 0", cfg, None)
    room = cfg.max_positions - 1000
    check_room([1] * 1000, room, "prompt 0", cfg)  # exactly the model's positions
    with pytest.raises(PromptError, match=f"prompt 0 has 1000 tokens; with max_new_tokens={room + 1} it needs "
                                          f"{cfg.max_positions + 1} positions, but opt-125m has {cfg.max_positions}"):
        check_room([1] * 1000, room + 1, "prompt 0", cfg)
