"""HELM's own requests as bench data: a run's ``scenario_state.json`` read directly.

HELM writes ``scenario_state.json`` into each run's folder (``benchmark_output/runs/SUITE/RUN``): its
adapter settings (``adapter_spec``) and one request state per instance and train trial, holding the
instance (id, input, references tagged ``correct``, split) and the request HELM sent (the prompt with
its in-context examples already in it, ``max_tokens``, ``temperature``, ``stop_sequences``). flexoff
runs those prompts as they are, with the adapter's generation settings, so its scores and HELM's
are of the same prompts; only the first train trial is run.

Instances to evaluate are subsampled for ``--max-instances`` as HELM's runner does it (numpy's
generator seeded with 0, ``choice`` without replacement), so a small run evaluates the instances
HELM would. A run HELM itself capped (as many instances as its ``max_eval_instances``) already
lists its draw, in the order drawn, and a smaller draw is a prefix of a larger one: there the first
N are the N HELM picks. A file holding exactly ``max_eval_instances`` instances because the
scenario had no more reads as a capped run too; make it with a larger ``--max-eval-instances``.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np

from ..fileio import read_user_text
from .errors import ScenarioError
from .scenarios import CHOICE_LABELS, EVAL_SPLITS, Instance, Scenario

CORRECT_TAG = "correct"


def looks_like_scenario_state(path: str | Path) -> bool:
    """True for a JSON file (not JSONL) whose name or first bytes say it is HELM's scenario state."""
    path = Path(path)
    if path.name == "scenario_state.json":
        return True
    try:
        with path.open("rb") as handle:
            head = handle.read(4096).lstrip()
    except OSError:
        return False
    return head.startswith(b"{") and b'"adapter_spec"' in head


def helm_sample(instances: list[Instance], max_instances: int | None, *, drawn: bool = False) -> list[Instance]:
    """The instances to evaluate, at most ``max_instances`` of them chosen as HELM chooses: a seed-0
    draw without replacement, in the order drawn (a smaller draw is a prefix of a larger one).
    ``drawn`` says the instances already are such a draw, so the first ``max_instances`` are HELM's."""
    evaluated = [i for i in instances if i.split in EVAL_SPLITS]
    if max_instances is None or len(evaluated) <= max_instances:
        return evaluated
    if drawn:
        return evaluated[:max_instances]
    picked = np.random.RandomState(0).choice(len(evaluated), max_instances, replace=False)
    return [evaluated[int(i)] for i in picked]


def _field(obj, key: str, kind, where: str):
    if not isinstance(obj, dict) or key not in obj:
        raise ScenarioError(f"{where}: missing field {key!r}")
    value = obj[key]
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise ScenarioError(f"{where}: field {key!r} must be {getattr(kind, '__name__', kind)}, "
                            f"got {type(value).__name__}")
    return value


def _text(obj, key: str, where: str) -> str:
    return _field(_field(obj, key, dict, where), "text", str, f"{where}.{key}")


def _instance(scenario: Scenario, state: dict, where: str) -> Instance:
    raw = _field(state, "instance", dict, where)
    where = f"{where}.instance"
    text = _text(raw, "input", where)
    references = _field(raw, "references", list, where)
    outputs, correct = [], []
    for j, ref in enumerate(references):
        outputs.append(_text(ref, "output", f"{where}.references[{j}]"))
        if CORRECT_TAG in (ref.get("tags") or []):
            correct.append(j)
    if not correct:
        raise ScenarioError(f"{where}: no reference is tagged {CORRECT_TAG!r}")
    instance_id = raw.get("id", where)
    split = raw.get("split", "test")
    if split not in ("train", *EVAL_SPLITS):
        raise ScenarioError(f"{where}: field 'split' must be train, valid or test, got {split!r}")
    request = _field(state, "request", dict, where.removesuffix(".instance"))
    prompt = _field(request, "prompt", str, f"{where.removesuffix('.instance')}.request")
    num_examples = state.get("num_train_instances")
    if scenario.multiple_choice:
        if len(outputs) > len(CHOICE_LABELS):
            raise ScenarioError(f"{where}: {len(outputs)} choices, at most {len(CHOICE_LABELS)}")
        return Instance(instance_id, text, (CHOICE_LABELS[correct[0]],), split, tuple(outputs), prompt=prompt,
                        num_in_context=num_examples)
    return Instance(instance_id, text, tuple(outputs[j] for j in correct), split, prompt=prompt,
                    num_in_context=num_examples)


def _settings(scenario: Scenario, spec: dict, where: str) -> Scenario:
    """The scenario with HELM's generation settings, where its adapter gives them."""
    changes = {}
    if "max_tokens" in spec:
        changes["max_new_tokens"] = _field(spec, "max_tokens", int, where)
    if "temperature" in spec:
        changes["temperature"] = float(_field(spec, "temperature", (int, float), where))
    if "stop_sequences" in spec:
        stops = _field(spec, "stop_sequences", list, where)
        if not all(isinstance(s, str) and s for s in stops):
            raise ScenarioError(f"{where}: field 'stop_sequences' must list non-empty strings")
        changes["stop"] = tuple(stops)
    if "num_outputs" in spec:
        changes["num_outputs"] = _field(spec, "num_outputs", int, where)
        if changes["num_outputs"] < 1:
            raise ScenarioError(f"{where}: field 'num_outputs' must be >= 1")
    return replace(scenario, **changes)


def read_scenario_state(scenario: Scenario, path: str | Path) -> tuple[Scenario, list[Instance], bool]:
    """HELM's settings applied to ``scenario``, the instances of the first train trial, each
    carrying the prompt HELM built for it, and whether they are HELM's capped draw (see above)."""
    path = Path(path)
    try:
        state = json.loads(read_user_text(path, "data file", ScenarioError))
    except json.JSONDecodeError as e:
        raise ScenarioError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    where = path.name
    scenario = _settings(scenario, _field(state, "adapter_spec", dict, where), f"{where}.adapter_spec")
    states = _field(state, "request_states", list, where)
    instances, seen = [], set()
    for n, request_state in enumerate(states):
        at = f"{where}.request_states[{n}]"
        if not isinstance(request_state, dict):
            raise ScenarioError(f"{at}: expected a JSON object, got {type(request_state).__name__}")
        if request_state.get("train_trial_index", 0) != 0:
            continue
        instance = _instance(scenario, request_state, at)
        key = json.dumps(instance.id)
        if key in seen:
            raise ScenarioError(f"{at}: instance id {instance.id!r} appears twice in train trial 0")
        seen.add(key)
        instances.append(instance)
    evaluated = sum(i.split in EVAL_SPLITS for i in instances)
    if not evaluated:
        raise ScenarioError(f"{path} has no instances to evaluate")
    spec = state["adapter_spec"]
    cap = spec.get("max_eval_instances")
    # HELM keeps exactly max_eval_instances when it drew them from more, fewer only when it kept all.
    return scenario, instances, isinstance(cap, int) and not isinstance(cap, bool) and evaluated == cap
