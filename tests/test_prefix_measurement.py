"""A job's shared prefix measured from its prompts' token ids (prefixes.prompt_shares and
job_shared_prefix), the workload that `run` and `batch` plan with, and `search --shared-prefix`."""

import random

import pytest

from flexoff.commands import main as cli
from flexoff.prefixes import MIN_SHARED_PREFIX, common_prefix, job_shared_prefix, prompt_shares
from flexoff.prompts import prompt_workload


def _plain_shares(prompts, minimum):
    """Each prompt against every other, by the plain count."""
    shares = []
    for i, p in enumerate(prompts):
        best = max((common_prefix(p, q) for j, q in enumerate(prompts) if j != i), default=0)
        best = min(best, len(p) - 1)
        shares.append(best if best >= minimum else 0)
    return shares


def test_each_prompt_shares_what_it_has_in_common_with_its_closest_prompt():
    rng = random.Random(0)
    for _ in range(200):
        heads = [[rng.randrange(3) for _ in range(rng.randrange(12))] for _ in range(3)]
        prompts = [rng.choice(heads) + [rng.randrange(3) for _ in range(rng.randrange(1, 6))]
                   for _ in range(rng.randrange(1, 8))]
        assert prompt_shares(prompts, minimum=4) == _plain_shares(prompts, 4)


def test_a_few_shot_job_plans_with_the_mean_of_what_its_prompts_share():
    rng = random.Random(1)
    subjects = [[rng.randrange(100, 1000) for _ in range(480)] for _ in range(3)]
    prompts = [subject + [rng.randrange(100, 1000) for _ in range(rng.randrange(40, 120))]
               for subject in subjects for _ in range(4)]
    loner = [7] * 200  # shares nothing
    assert job_shared_prefix(prompts) == 480
    assert job_shared_prefix(prompts + [loner]) == 480 * 12 // 13
    # identical prompts share all but the last token, which the head reads
    assert job_shared_prefix([[5] * 40, [5] * 40]) == 39


def test_nothing_shared_plans_exactly_as_before():
    assert job_shared_prefix([[1, 2, 3] * 10]) == 0  # one prompt
    rng = random.Random(2)
    assert job_shared_prefix([[rng.randrange(50_000) for _ in range(64)] for _ in range(20)]) == 0
    # prefixes shorter than the minimum are not shared, and a mean below it is 0
    short = [[9] * (MIN_SHARED_PREFIX - 1) + [i, i] for i in range(4)]
    assert job_shared_prefix(short) == 0
    sharing = [[3] * 40 + [1], [3] * 40 + [2]]
    alone = [[i + 10] * 30 for i in range(8)]
    assert job_shared_prefix(sharing + alone) == 0  # a mean of 8


def test_the_workload_of_token_id_prompts_carries_their_shared_prefix():
    head = list(range(100, 150))
    prompts = [head + [i, i + 1, i + 2] for i in range(6)]
    workload = prompt_workload(prompts, [4] * 6, "opt-125m", None)
    assert (workload.prompt_len, workload.gen_len, workload.num_prompts, workload.shared_prefix) == (53, 4, 6, 50)
    assert prompt_workload([[i] * 20 for i in range(1, 4)], [4] * 3, "opt-125m", None).shared_prefix == 0


def test_search_plans_for_a_shared_prefix(capsys):
    args = ["search", "--model", "opt-30b", "--hardware", "h200", "--gpu-mem", "16GiB", "--compress", "off",
            "--prompt-len", "600", "--gen-len", "4", "--num-prompts", "684"]
    assert cli.main(args + ["--shared-prefix", "480"]) == 0
    shared = capsys.readouterr().out
    assert "prompt 600 (480 shared), generate 4" in shared
    assert cli.main(args) == 0
    alone = capsys.readouterr().out
    assert "shared" not in alone.splitlines()[0] and shared != alone


@pytest.mark.parametrize("value, message", [("600", "--shared-prefix 600 must be below --prompt-len 600"),
                                            ("-1", "must be an integer >= 0"), ("x", "expected an integer")])
def test_search_refuses_a_bad_shared_prefix_in_one_line(value, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        code = cli.main(["search", "--model", "opt-30b", "--hardware", "h200", "--prompt-len", "600",
                         "--shared-prefix", value])
        raise SystemExit(code)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_contexts_of_many_lengths_plan_as_long_prefixes_and_short_rows():
    """Four short choices behind each context: the runtime pads the batch's prefix rows to the
    longest context and its rows to the longest choice, so the plan's prefix is what the longest
    prompt leaves beside the longest choice, not the contexts' mean length."""
    rng = random.Random(3)
    prompts = []
    for length in (100, 200, 300):
        context = [rng.randrange(100, 1000) for _ in range(length)]
        prompts += [context + [1000 + 10 * c + j for j in range(c)] for c in (2, 3, 4, 5)]
    assert max(map(len, prompts)) == 305
    assert job_shared_prefix(prompts) == 305 - 5
    # A prompt sharing nothing, as long as the longest, dilutes the plan by its share of the prompts.
    assert job_shared_prefix(prompts + [[7] * 305]) == 300 * 12 // 13
