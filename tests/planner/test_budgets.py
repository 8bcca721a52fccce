"""A job whose generation budgets differ: the workload carries them, memory is planned for the
largest, and the search reports the throughput of the tokens they generate."""

import json
import random

import pytest
import torch

from flexoff.commands import main as cli
from flexoff.layout import Capacity
from flexoff.models.registry import resolve_model_config
from flexoff.planner.cost_model import CostModel, Workload
from flexoff.planner.default import fit_job
from flexoff.planner.hardware import resolve_hardware
from flexoff.planner.pipeline import plan_pipeline
from flexoff.planner.search import search_policy
from flexoff.policy import Policy
from flexoff.prompts import prompt_workload


def test_budgets_reach_the_workload_where_they_differ():
    prompts = [[5, 6, 7, i] for i in range(4)]
    varied = prompt_workload(prompts, [8, 3, 8, 5], "opt-125m", None)
    assert varied.gen_len == 8 and varied.gen_lens == (8, 3, 8, 5)
    assert prompt_workload(prompts, [8] * 4, "opt-125m", None).gen_lens == ()


def test_the_search_plans_memory_for_the_largest_budget_and_predicts_the_budgets_tokens():
    cfg = resolve_model_config("opt-30b")
    hardware = resolve_hardware("h200").with_memory(gpu=16 << 30)
    budgets = tuple(32 + (i * 37) % 97 for i in range(240))
    varied = Workload(500, max(budgets), 240, gen_lens=budgets)
    flat = Workload(500, max(budgets), 240)
    got, padded = (search_policy(cfg, w, hardware, compress="auto") for w in (varied, flat))
    # The same policy: memory and the search's ranking are the largest budget's.
    assert got.policy == padded.policy
    assert got.prediction.peak_memory == padded.prediction.peak_memory
    assert got.throughput == CostModel(cfg, varied, hardware).predict(got.policy).total_throughput
    # Fewer tokens than every row at the largest budget, in less time than that job: batches whose
    # budgets are spent stop running.
    whole = padded.throughput * sum(budgets) / (240 * max(budgets))
    assert whole < got.throughput < padded.throughput


def test_a_share_of_the_job_keeps_its_budgets_spread():
    job = Workload(8, 9, 6, gen_lens=(9, 1, 5, 3, 7, 2))
    half = job.with_prompts(3)  # every other budget in order: 1, 3, 7
    assert (half.num_prompts, half.gen_len, half.gen_lens) == (3, 9, (1, 3, 7))
    assert job.with_prompts(6).gen_lens == (1, 2, 3, 5, 7, 9)
    assert Workload(8, 9, 4, gen_lens=(9, 9, 9, 1)).with_prompts(1).gen_lens == ()  # one budget: none listed
    assert Workload(8, 9, 6).with_prompts(2) == Workload(8, 9, 2)


def test_budgets_past_the_models_positions_are_cut_to_them():
    job = Workload(8, 9, 4, gen_lens=(9, 2, 6, 3))
    cut = job.with_generation(8, 5)
    assert (cut.prompt_len, cut.gen_len, cut.gen_lens) == (8, 5, (5, 2, 5, 3))
    assert job.with_generation(8, 2).gen_lens == ()  # all 2 now
    assert job.with_generation(4, 20) == Workload(4, 9, 4, gen_lens=(9, 2, 6, 3))


def test_policy_auto_and_a_pipeline_plan_a_job_whose_budgets_differ():
    """The budgets survive the job's cut to the model's positions (fit_job) and its share per
    pipeline stage (plan_pipeline): both plan it, where a budget list that no longer matched its
    job would be refused."""
    cfg = resolve_model_config("opt-125m")
    hardware = resolve_hardware("h200").with_memory(gpu=1 << 30)
    long = Workload(cfg.max_positions, cfg.max_positions, 6, gen_lens=(cfg.max_positions, 5, 9, 2, 7, 3))
    plan = fit_job(cfg, long, None, torch.float16, Capacity(gpu=1 << 30, cpu=8 << 30, disk=0), hardware,
                   Policy(), None, search=True)
    assert plan.policy is not None
    job = Workload(64, 40, 48, gen_lens=tuple(8 + i % 33 for i in range(48)))
    staged = plan_pipeline(cfg, job, [hardware, hardware])
    assert staged.throughput > 0


def _job_file(path, count=60):
    """A batch file of token-id prompts behind one 40-token head, each with a budget of its own."""
    rng = random.Random(5)
    head = [rng.randrange(4, 50000) for _ in range(40)]
    lines = [{"prompt": head + [rng.randrange(4, 50000) for _ in range(rng.randint(5, 30))],
              "max_new_tokens": rng.randint(4, 40)} for _ in range(count)]
    lines[0].pop("max_new_tokens")  # --gen-len's
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return lines


def test_search_measures_the_job_of_a_prompts_file_as_policy_auto_does(tmp_path, capsys):
    lines = _job_file(tmp_path / "job.jsonl")
    out = tmp_path / "policy.json"
    assert cli.main(["search", "--model", "opt-30b", "--hardware", "h200", "--gpu-mem", "16GiB", "--compress", "auto",
                     "--prompts", str(tmp_path / "job.jsonl"), "--gen-len", "7", "--output", str(out)]) == 0
    title = capsys.readouterr().out.splitlines()[0]
    budgets = [line.get("max_new_tokens", 7) for line in lines]
    workload = prompt_workload([line["prompt"] for line in lines], budgets, "opt-30b", None)
    assert workload.shared_prefix >= 16 and workload.gen_lens == tuple(budgets)
    assert workload.mean_prompt_len  # the file's prompts differ in length; the title names their mean
    assert (f"prompt {workload.prompt_len} ({workload.mean_prompt_len:.1f} on average, {workload.shared_prefix} shared"
            in title
            and f"generate up to {max(budgets)} ({sum(budgets) / len(budgets):.1f} on average), 60 prompts" in title)
    expected = search_policy(resolve_model_config("opt-30b"), workload,
                             resolve_hardware("h200").with_memory(gpu=16 << 30), compress="auto")
    assert Policy.load(out) == expected.policy


@pytest.mark.parametrize("flags, says", [
    (["--prompt-len", "100"], "--prompt-len describes the prompts that --prompts"),
    (["--shared-prefix", "20"], "--shared-prefix describes the prompts that --prompts"),
    (["--num-prompts", "5"], "--num-prompts describes the prompts that --prompts"),
])
def test_search_refuses_a_shape_beside_a_prompts_file_in_one_line(tmp_path, capsys, flags, says):
    _job_file(tmp_path / "job.jsonl", 3)
    assert cli.main(["search", "--model", "opt-30b", "--hardware", "h200", "--prompts", str(tmp_path / "job.jsonl"),
                     *flags]) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1


def test_search_refuses_a_tokenizer_without_prompts_in_one_line(capsys):
    assert cli.main(["search", "--model", "opt-30b", "--hardware", "h200", "--tokenizer", "/tmp"]) == 2
    said = "flexoff: error: --tokenizer reads a --prompts file's text: give --prompts FILE too\n"
    assert capsys.readouterr().err == said
