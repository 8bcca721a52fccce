"""A job whose generation budgets differ: the workload carries them, memory is planned for the
largest, and the search reports the throughput of the tokens they generate."""

from flexoff.planner.cost_model import CostModel, Workload
from flexoff.planner.hardware import resolve_hardware
from flexoff.planner.search import search_policy
from flexoff.models.registry import resolve_model_config
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
