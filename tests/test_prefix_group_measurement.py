"""How many prompts share each prefix, measured from their token ids (prefixes.job_prefix_group),
the workload `run` and `batch` plan with, and `search --prefix-group`."""

import random

import pytest

from flexoff.commands import main as cli
from flexoff.prefixes import MIN_SHARED_PREFIX, job_prefix_group
from flexoff.prompts import prompt_workload


def _subjects(rng, sizes, head=()):
    """Few-shot prompts: per subject, 480 tokens of examples (after a ``head`` common to all) and a
    question of its own per prompt."""
    prompts = []
    for size in sizes:
        examples = list(head) + [rng.randrange(100, 1000) for _ in range(480)]
        prompts += [examples + [rng.randrange(100, 1000) for _ in range(rng.randrange(40, 120))] for _ in range(size)]
    rng.shuffle(prompts)
    return prompts


def test_a_few_shot_job_shares_each_prefix_by_its_subjects_questions():
    rng = random.Random(0)
    assert job_prefix_group(_subjects(rng, [12] * 5)) == 12
    # a prompt that shares nothing is in no group
    assert job_prefix_group(_subjects(rng, [12] * 5) + [[7] * 300]) == 12
    # a mean over the prompts: 2 prompts in a pair, 6 in a group of 6
    assert job_prefix_group(_subjects(rng, [2, 6])) == (2 * 2 + 6 * 6) // 8


def test_subjects_beginning_with_one_preamble_stay_apart():
    rng = random.Random(1)
    preamble = list(range(10, 10 + 2 * MIN_SHARED_PREFIX))  # long enough to share, far shorter than the examples
    assert job_prefix_group(_subjects(rng, [12] * 4, preamble)) == 12


def test_one_system_prompt_is_one_group():
    rng = random.Random(2)
    system = [rng.randrange(100, 1000) for _ in range(300)]
    prompts = [system + [rng.randrange(100, 1000) for _ in range(rng.randrange(20, 200))] for _ in range(40)]
    assert job_prefix_group(prompts) == 40


def test_nothing_shared_is_no_group():
    rng = random.Random(3)
    assert job_prefix_group([]) == 0
    assert job_prefix_group([[1, 2, 3] * 10]) == 0
    assert job_prefix_group([[rng.randrange(50_000) for _ in range(64)] for _ in range(20)]) == 0
    assert job_prefix_group([[9] * (MIN_SHARED_PREFIX - 1) + [i, i] for i in range(4)]) == 0
    # identical prompts leave the head their last token, and past it share too little
    assert job_prefix_group([[5] * MIN_SHARED_PREFIX] * 3) == 0
    assert job_prefix_group([[5] * (MIN_SHARED_PREFIX + 1)] * 3) == 3


def test_the_workload_carries_the_prefix_group():
    rng = random.Random(4)
    prompts = _subjects(rng, [6] * 3)
    workload = prompt_workload(prompts, [4] * len(prompts), "opt-125m", None)
    assert (workload.shared_prefix, workload.prefix_group) == (480, 6)
    assert prompt_workload(prompts, [4] * len(prompts), "opt-125m", None, share=False).prefix_group == 0
    unshared = prompt_workload([[i] * 20 for i in range(1, 4)], [4] * 3, "opt-125m", None)
    assert (unshared.shared_prefix, unshared.prefix_group) == (0, 0)


SEARCH = ["search", "--model", "opt-30b", "--hardware", "h200", "--gpu-mem", "16GiB", "--compress", "off",
          "--prompt-len", "600", "--gen-len", "4", "--num-prompts", "684", "--shared-prefix", "480"]


def test_search_plans_for_groups_of_prompts(capsys):
    assert cli.main(SEARCH + ["--prefix-group", "12"]) == 0
    grouped = capsys.readouterr().out
    assert "prompt 600 (480 shared by groups of 12), generate 4" in grouped
    assert cli.main(SEARCH) == 0
    whole = capsys.readouterr().out
    assert "prompt 600 (480 shared), generate 4" in whole and grouped != whole


@pytest.mark.parametrize("extra, message", [
    (["--prefix-group", "0"], "must be an integer >= 1"), (["--prefix-group", "x"], "expected an integer"),
    (["--shared-prefix", "0", "--prefix-group", "12"], "--prefix-group 12 needs --shared-prefix N")])
def test_search_refuses_a_bad_prefix_group_in_one_line(extra, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        raise SystemExit(cli.main(SEARCH + extra))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
