"""HELM-style scenarios: data, prompt template, generation settings and metrics.

The five scenarios of FlexGen's HELM run (its Table 9) ship here: ``wikifact``, ``mmlu``,
``synthetic_reasoning`` (pattern_match), ``synthetic_reasoning_natural`` and ``xsum``. Their
templates and settings follow HELM's run specs. ``synthetic_reasoning`` generates its own data,
HELM's instances with HELM's ids (``--seed`` 0) or another seeded set; the others read a local
JSONL file (nothing is downloaded), one instance a line::

    {"id": "q17", "input": "Roe v. Wade's plaintiff is", "references": ["Norma McCorvey", "Jane Roe"]}
    {"input": "What is 2 + 2?", "choices": ["3", "4", "5", "22"], "answer": "B", "split": "train"}

- ``input`` (required): the instance's text (for xsum the article; for wikifact the subject and
  relation to complete; for synthetic_reasoning_natural the rules, the fact and the question).
- ``references`` (generation scenarios; or ``reference`` for one): the correct answers.
- ``choices`` and ``answer`` (mmlu): the options, and the correct one as an index from 0 or a
  letter.
- ``split`` (optional): ``train`` marks an in-context example; ``test`` (the default) or
  ``valid`` marks an instance to evaluate.
- ``id`` (optional, default ``line-N``): a string or an integer, unique in the file.
- ``meta`` (optional): any JSON value, ignored.

Prompts are built as HELM builds them: instructions, then ``k`` in-context examples chosen once
per run with a seed (cycling through the answers so common ones come first), then the
instance, ending in the output prefix. Examples are dropped from the end until the prompt and
the generation budget fit the model's context; if the bare instance still does not fit, its
prompt keeps only its last tokens and the instance is marked truncated.
"""

from __future__ import annotations

import json
import random
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from ..fileio import jsonl_objects, read_user_text
from .errors import ScenarioError
from .synthetic import pattern_match_problems

CHOICE_LABELS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
EVAL_SPLITS = ("test", "valid")
FIELDS = ("id", "input", "references", "reference", "choices", "answer", "split", "meta")


@dataclass(frozen=True)
class Template:
    """HELM's adapter text: ``instructions``, then blocks of
    ``input_prefix input input_suffix [choices] output_prefix output output_suffix``."""

    instructions: str = ""
    input_prefix: str = ""
    input_suffix: str = ""
    output_prefix: str = ""
    output_suffix: str = ""
    separator: str = "\n"  # between the instructions and each example


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    template: Template
    num_in_context: int
    max_new_tokens: int
    temperature: float
    stop: tuple[str, ...]
    metrics: tuple[str, ...]
    multiple_choice: bool = False
    num_outputs: int = 1  # samples per instance; the score is the best of them
    generated: bool = False  # data comes from a seeded generator, not a file
    flexgen_workload: str = ""  # FlexGen's Table 9 setting, for reference


@dataclass(frozen=True)
class Instance:
    id: str | int
    input: str
    references: tuple[str, ...]
    split: str = "test"
    choices: tuple[str, ...] = ()
    prompt: str | None = None  # a prompt built elsewhere (HELM's), run as it is
    num_in_context: int | None = None  # the examples in that prompt


def _generation(input_noun=None, output_noun=None, newline_after_input_noun=False, **kwargs) -> Template:
    """HELM's generation adapter: ``Noun: input`` and ``Noun: output`` lines."""
    def prefix(noun, newline):
        return "" if noun is None else f"{noun}:" + ("\n" if newline else " ")
    return Template(input_prefix=prefix(input_noun, newline_after_input_noun), input_suffix="\n",
                    output_prefix=prefix(output_noun, False), output_suffix="\n", **kwargs)


SCENARIOS: dict[str, Scenario] = {s.name: s for s in (
    Scenario(
        name="wikifact", description="complete a Wikidata fact (subject and relation) with its object",
        template=Template(output_prefix=" ", output_suffix="\n"),
        num_in_context=5, max_new_tokens=8, temperature=1.0, stop=("\n",), num_outputs=5,
        metrics=("exact_match", "quasi_exact_match"),
        flexgen_workload="k=5, prompt 256 / gen 8 tokens, 288–2592 sequences",
    ),
    Scenario(
        name="mmlu", description="multiple-choice questions, answered with the letter of the choice",
        template=Template(instructions="The following are multiple choice questions (with answers) about {subject}.",
                          input_prefix="Question: ", input_suffix="\n", output_prefix="Answer: ",
                          output_suffix="\n"),
        num_in_context=5, max_new_tokens=1, temperature=0.0, stop=("\n",), multiple_choice=True,
        metrics=("exact_match", "quasi_exact_match"),
        flexgen_workload="prompt 512 / gen 1 tokens, 864–1008 sequences",
    ),
    Scenario(
        name="synthetic_reasoning", description="pattern_match: name the rule pattern that produced a result",
        template=_generation(output_noun="Target", instructions="Please solve the following problem."),
        num_in_context=5, max_new_tokens=50, temperature=0.0, stop=("\n",), generated=True,
        metrics=("exact_match", "quasi_exact_match"),
        flexgen_workload="mode=pattern_match, prompt 256 / gen 50 tokens, 1584 sequences",
    ),
    Scenario(
        name="synthetic_reasoning_natural", description="deduce what follows from rules and a fact (easy)",
        template=_generation(input_noun="Rules", newline_after_input_noun=True,
                             instructions="Please solve the following problem."),
        num_in_context=3, max_new_tokens=20, temperature=0.0, stop=("\n",),
        metrics=("f1_set_match", "iou_set_match", "exact_set_match"),
        flexgen_workload="difficulty=easy, prompt 512 / gen 20 tokens, 1584 sequences",
    ),
    Scenario(
        name="xsum", description="summarise a news article in one sentence",
        template=Template(input_prefix="###\nArticle: ", input_suffix="\n\n",
                          output_prefix="Summarize the above article in 1 sentence.\n", output_suffix="\n"),
        num_in_context=5, max_new_tokens=64, temperature=0.3, stop=("###",),
        metrics=("rouge_l", "f1"),
        flexgen_workload="temperature=0.3, prompt 1984 / gen 64 tokens, 1568 sequences",
    ),
)}

# synthetic_reasoning's instances as HELM's scenario makes them (its seed 42, these splits, ids id0,
# id1, ...), so that a run's --max-instances draw is HELM's own -m draw of the same instances.
SYNTHETIC_SPLITS = (("train", 1000), ("valid", 5000), ("test", 5000))
HELM_DATA_SEED = 42
SYNTHETIC_EVAL_DEFAULT = 1000  # instances evaluated when --max-instances is not given


def get_scenario(name: str) -> Scenario:
    if name not in SCENARIOS:
        raise ScenarioError(f"unknown scenario {name!r}; known scenarios: {', '.join(SCENARIOS)}")
    return SCENARIOS[name]


# Data

def _answer_index(value, choices: list, where: str) -> int:
    if isinstance(value, bool):
        value = None
    if isinstance(value, str) and len(value) == 1 and value.upper() in CHOICE_LABELS:
        value = CHOICE_LABELS.index(value.upper())
    if not isinstance(value, int) or not 0 <= value < len(choices):
        raise ScenarioError(f"{where}: field 'answer' must be a choice index (0–{len(choices) - 1}) "
                            f"or letter (A–{CHOICE_LABELS[len(choices) - 1]}), got {value!r}")
    return value


def _instance(scenario: Scenario, obj, number: int, where: str) -> Instance:
    if not isinstance(obj, dict):
        raise ScenarioError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - set(FIELDS))
    if unknown:
        raise ScenarioError(f"{where}: unknown field {unknown[0]!r}; known fields: {', '.join(FIELDS)}")
    instance_id = obj.get("id", f"line-{number}")
    if isinstance(instance_id, bool) or not isinstance(instance_id, (str, int)) or instance_id == "":
        raise ScenarioError(f"{where}: field 'id' must be a non-empty string or an integer, got {instance_id!r}")
    text = obj.get("input")
    if not isinstance(text, str) or not text.strip():
        raise ScenarioError(f"{where}: missing or empty field 'input'")
    split = obj.get("split", "test")
    if split not in ("train", *EVAL_SPLITS):
        raise ScenarioError(f"{where}: field 'split' must be train, valid or test, got {split!r}")
    if scenario.multiple_choice:
        choices = obj.get("choices")
        if not (isinstance(choices, list) and 2 <= len(choices) <= len(CHOICE_LABELS)
                and all(isinstance(c, str) and c.strip() for c in choices)):
            raise ScenarioError(f"{where}: field 'choices' must list 2 to 26 non-empty strings")
        if "answer" not in obj:
            raise ScenarioError(f"{where}: missing field 'answer'")
        answer = _answer_index(obj["answer"], choices, where)
        return Instance(instance_id, text, (CHOICE_LABELS[answer],), split, tuple(choices))
    references = obj.get("references", [obj["reference"]] if "reference" in obj else None)
    if not (isinstance(references, list) and references
            and all(isinstance(r, str) and r.strip() for r in references)):
        raise ScenarioError(f"{where}: field 'references' must list at least one non-empty string "
                            "(or give one as 'reference')")
    return Instance(instance_id, text, tuple(references), split)


def load_instances(scenario: Scenario, path: str | Path | None, *, seed: int = 0) -> list[Instance]:
    """All in-context candidates and instances to evaluate, checked field by field. Generated
    data is HELM's own for ``seed`` 0; another seed shifts HELM's seed by as much."""
    if path is None:
        if not scenario.generated:
            raise ScenarioError(f"scenario {scenario.name} reads its data from a local JSONL file: pass --data FILE "
                                "(format: `python -m pydoc flexoff.harness.scenarios`)")
        splits = [split for split, count in SYNTHETIC_SPLITS for _ in range(count)]
        problems = pattern_match_problems((HELM_DATA_SEED + seed) % 2**32, len(splits))
        return [Instance(f"id{i}", text, (target,), split)
                for i, ((text, target), split) in enumerate(zip(problems, splits))]
    path = Path(path)
    text = read_user_text(path, "data file", ScenarioError)
    instances, seen = [], {}
    for number, where, obj in jsonl_objects(path, text, ScenarioError):
        instance = _instance(scenario, obj, number, where)
        key = json.dumps(instance.id)
        if key in seen:
            raise ScenarioError(f"{where}: duplicate id {instance.id!r} (first on line {seen[key]})")
        seen[key] = number
        instances.append(instance)
    if not any(i.split in EVAL_SPLITS for i in instances):
        raise ScenarioError(f"{path} has no instances to evaluate (every line has split 'train')")
    return instances


# Prompts

def choose_examples(train: list[Instance], k: int, seed: int) -> list[Instance]:
    """k in-context examples, the same for every instance of a run: answers are visited from the
    most to the least common (ties in random order), taking a random unused example of each in
    turn, so that an example set covers the common answers."""
    rng = random.Random(seed)
    by_answer: dict[str, list[Instance]] = defaultdict(list)
    for instance in train:
        by_answer[instance.references[0]].append(instance)
    by_count: dict[int, list[str]] = defaultdict(list)
    for answer, members in sorted(by_answer.items()):
        by_count[len(members)].append(answer)
    order: list[str] = []
    for count in sorted(by_count, reverse=True):
        answers = by_count[count]
        rng.shuffle(answers)
        order.extend(answers)
    chosen: list[Instance] = []
    while len(chosen) < min(k, len(train)):
        for answer in order:
            pool = by_answer[answer]
            if pool and len(chosen) < k:
                chosen.append(pool.pop(rng.randrange(len(pool))))
    return chosen


def example_block(scenario: Scenario, instance: Instance, with_output: bool) -> str:
    t = scenario.template
    text = t.input_prefix + instance.input + t.input_suffix
    if scenario.multiple_choice:
        text += "".join(f"{CHOICE_LABELS[i]}. {choice}\n" for i, choice in enumerate(instance.choices))
    if with_output:
        return text + t.output_prefix + instance.references[0] + t.output_suffix
    # The model writes the rest of the output prefix (e.g. the space after "Answer:") itself.
    return text + t.output_prefix.rstrip()


def reference_continuation(scenario: Scenario, reference: str) -> str:
    """The text that, appended to an instance's prompt, spells out ``reference``."""
    prefix = scenario.template.output_prefix
    return prefix[len(prefix.rstrip()):] + reference


def build_prompt(scenario: Scenario, examples: list[Instance], instance: Instance, subject: str = "") -> str:
    t = scenario.template
    blocks = [t.instructions.format(subject=subject) + "\n"] if t.instructions else []
    blocks += [example_block(scenario, example, True) for example in examples]
    blocks.append(example_block(scenario, instance, False))
    return t.separator.join(blocks)


@dataclass
class PreparedInstance:
    instance: Instance
    prompt: str | list[int]  # text, or token ids when it had to be truncated
    prompt_tokens: int
    num_in_context: int
    truncated: bool = False
    extra: dict = field(default_factory=dict)


def fit_prompt(scenario: Scenario, examples: list[Instance], instance: Instance, tokenizer, max_positions: int,
               subject: str = "", bos_token_id: int | None = None) -> PreparedInstance:
    """Drop in-context examples from the end until prompt plus generation fit the context. An
    instance with its own prompt keeps it whole if it fits."""
    limit = max_positions - scenario.max_new_tokens
    if instance.prompt is not None:
        ids = tokenizer.encode(instance.prompt)
        if len(ids) <= limit:
            return PreparedInstance(instance, instance.prompt, len(ids), instance.num_in_context or 0)
    for k in range(len(examples), -1, -1) if instance.prompt is None else ():
        text = build_prompt(scenario, examples[:k], instance, subject)
        ids = tokenizer.encode(text)
        if len(ids) <= limit:
            return PreparedInstance(instance, text, len(ids), k)
    # Keep the end, where the question and the output prefix are, and the BOS token if any.
    head = ids[:1] if bos_token_id is not None and ids and ids[0] == bos_token_id else []
    ids = head + ids[len(ids) - (limit - len(head)):]
    return PreparedInstance(instance, ids, len(ids), 0, truncated=True)


def default_subject(data: str | Path | None) -> str:
    """mmlu names its files after the subject (``abstract_algebra_test.jsonl``)."""
    if data is None:
        return "general knowledge"
    stem = Path(data).stem
    for suffix in ("_test", "_dev", "_val", "_valid", "_train"):
        stem = stem.removesuffix(suffix)
    return stem.replace("_", " ")
