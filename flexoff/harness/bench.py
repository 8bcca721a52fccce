"""``flexoff bench``: run a scenario, score it, and write per-instance results and a summary.

Files in the output directory:

- ``results.jsonl``: raw generations (one record per sample, id ``[instance id, sample]``) and
  reference scores (``kind`` "score", id ``[instance id, "ref"]``), appended as blocks finish, in
  the record layout of :mod:`flexoff.records`; ``index`` sorts them by instance. It is resumable
  exactly like a ``flexoff batch`` output, and ``results.jsonl.job.json`` names its job (model,
  scenario, data, settings).
- ``instances.jsonl``: per instance: references, predictions, metric values, the reference's
  log-probability, in-context examples used, and whether the prompt was truncated.
- ``summary.json``: mean of each metric, throughput, padding efficiency, wall time.

``--max-instances`` is not part of the job's identity: raising it later reuses every result
already written and runs only the new instances.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import FlexoffError, OutputError, TokenizerError
from ..fileio import check_destination, check_folder, json_text, write_or_keep
from ..job import Job
from ..records import failure_line
from ..runtime.sampling import SamplingParams
from .batch import model_identity
from .helm_state import helm_sample, looks_like_scenario_state, read_scenario_state
from .accuracy import best_score
from .runner import GenerationItem, Progress, ScoreItem, request_seed, run_generation, run_scoring
from .scenarios import (SYNTHETIC_EVAL_DEFAULT, Scenario, choose_examples, default_subject, fit_prompt, get_scenario,
                        load_instances, reference_continuation)
from .store import ResultStore, id_key, make_header


def bench_identity(scenario: Scenario, job: Job, data_digest: str | None, dtype: str, subject: str, k: int) -> dict:
    return {
        "scenario": scenario.name,
        # The definition itself: a changed template or setting must not mix with old results.
        "definition_sha256": hashlib.sha256(repr(scenario).encode()).hexdigest(),
        "data_sha256": data_digest, "model": model_identity(job.model, job.dummy, job.seed), "dtype": dtype,
        "settings": {"num_in_context": k, "seed": job.seed, "subject": subject},
    }


def _score_prompt(prepared, continuation: str, tokenizer, bos_token_id, max_positions: int):
    """The prompt for scoring the reference and its length in tokens, cut from the left if prompt
    plus reference overflow; None if no room is left."""
    cont_ids = tokenizer.encode(continuation)
    if bos_token_id is not None and cont_ids and cont_ids[0] == bos_token_id:
        cont_ids = cont_ids[1:]
    room = max_positions - len(cont_ids)
    if prepared.prompt_tokens <= room:
        return prepared.prompt, prepared.prompt_tokens
    if room < 2:
        return None
    ids = prepared.prompt if isinstance(prepared.prompt, list) else tokenizer.encode(prepared.prompt)
    head = ids[:1] if bos_token_id is not None and ids[0] == bos_token_id else []
    return head + ids[len(ids) - (room - len(head)):], room


def evaluate(scenario: Scenario, prepared: list, done: dict) -> list[dict]:
    """Per-instance rows from the records in ``done``."""
    rows = []
    for item in prepared:
        inst = item.instance
        samples = [done[id_key([inst.id, j])] for j in range(scenario.num_outputs)]
        predictions = [s.get("text") or "" for s in samples]
        row = {"id": inst.id, "references": list(inst.references), "predictions": predictions,
               "num_in_context": item.num_in_context, "truncated": item.truncated,
               "prompt_tokens": item.prompt_tokens}
        for metric in scenario.metrics:
            row[metric] = best_score(metric, inst.references, predictions)
        scored = done.get(id_key([inst.id, "ref"]))
        # A log-probability that was not finite is stored as null: then the sum is unknown too.
        known = scored is not None and None not in scored["logprobs"]
        row["ref_logprob"] = sum(scored["logprobs"]) if known else None
        row["ref_tokens"] = len(scored["logprobs"]) if known else 0
        rows.append(row)
    return rows


def summarize(scenario: Scenario, rows: list[dict], metrics, wall: float, model: str) -> dict:
    def mean(values):
        values = [v for v in values if v is not None]
        return sum(values) / len(values) if values else None

    scored = [r for r in rows if r["ref_logprob"] is not None]
    return {
        "scenario": scenario.name, "model": model, "instances": len(rows),
        "metrics": {m: mean(r[m] for r in rows) for m in scenario.metrics},
        "ref_logprob": mean(r["ref_logprob"] for r in scored),
        "ref_logprob_per_token": (sum(r["ref_logprob"] for r in scored) / sum(r["ref_tokens"] for r in scored)
                                  if scored and sum(r["ref_tokens"] for r in scored) else None),
        "in_context_examples": {"min": min(r["num_in_context"] for r in rows),
                                "max": max(r["num_in_context"] for r in rows)},
        "truncated_prompts": sum(r["truncated"] for r in rows),
        "generation": metrics.to_dict() if metrics is not None else None,
        "wall_seconds": wall, "flexgen_workload": scenario.flexgen_workload,
    }


@dataclass
class BenchRun:
    """A bench run with its output open. The caller makes the LLM, calls :meth:`run`, closes the LLM,
    then calls :meth:`finish`; nothing here prints."""

    job: Job
    scenario: Scenario
    output_dir: Path
    evaluated: list
    examples: list
    subject: str
    store: ResultStore
    started: float
    prepared: list = field(default_factory=list)
    gen_items: list = field(default_factory=list)

    def _prepare(self, tokenizer, cfg) -> list:
        """Every evaluated instance's prompt, fitted to the model's context."""
        if tokenizer is None:
            raise TokenizerError(f"scenarios are text; model {cfg.name!r} has no tokenizer")
        return [fit_prompt(self.scenario, self.examples, inst, tokenizer, cfg.max_positions, self.subject,
                           cfg.bos_token_id) for inst in self.evaluated]

    def workload(self, cfg):
        """The planner's workload of the samples still to generate (all of them once none is left),
        their prompts fitted to ``cfg``'s context as :meth:`run` fits them: for a policy searched
        for them, the in-context examples the prompts share measured as the prompts' shared prefix."""
        from ..prompts import prompt_workload
        from ..tokenizer import Tokenizer

        prepared = self._prepare(Tokenizer.for_model(self.job.model, self.job.tokenizer), cfg)
        samples = [(item.prompt, [item.instance.id, j]) for item in prepared for j in range(self.scenario.num_outputs)]
        pending = [prompt for prompt, sample_id in samples if id_key(sample_id) not in self.store.done]
        prompts = pending or [prompt for prompt, _ in samples]
        return prompt_workload(prompts, [self.scenario.max_new_tokens] * len(prompts), self.job.model,
                               self.job.tokenizer, self.job.prefix_sharing)

    def run(self, llm, progress: Progress | None = None):
        """Generate the samples and score the references not yet in the output; the Metrics of the
        generation, or None if none was left."""
        scenario = self.scenario
        cfg = llm.config
        self.prepared = self._prepare(llm.tokenizer, cfg)
        gen_items, score_items = [], []
        stride = scenario.num_outputs + 1  # an instance's samples, then its reference score
        for position, item in enumerate(self.prepared):
            for j in range(scenario.num_outputs):
                sample_id = [item.instance.id, j]
                seed = request_seed(self.job.seed, sample_id) if scenario.temperature > 0 else None
                params = SamplingParams(max_new_tokens=scenario.max_new_tokens, temperature=scenario.temperature,
                                        stop=scenario.stop, seed=seed)
                gen_items.append(GenerationItem(sample_id, item.prompt, params, index=position * stride + j))
            continuation = reference_continuation(scenario, item.instance.references[0])
            fitted = _score_prompt(item, continuation, llm.tokenizer, cfg.bos_token_id, cfg.max_positions)
            if fitted is not None:
                score_items.append(ScoreItem([item.instance.id, "ref"], fitted[0], continuation, fitted[1],
                                             index=position * stride + scenario.num_outputs))
        self.gen_items = gen_items
        metrics = run_generation(llm, self.store, gen_items, progress=progress, desc=scenario.name)
        run_scoring(llm, self.store, score_items, chunk_size=4 * llm.policy.block_size, progress=progress)
        return metrics

    def finish(self, metrics, model_name: str) -> "BenchResult":
        """Score every instance, close the output, and write instances.jsonl and summary.json."""
        try:
            rows = evaluate(self.scenario, self.prepared, self.store.done)
            samples = [self.store.done[id_key(item.id)] for item in self.gen_items]
        finally:
            self.store.close()
        summary = summarize(self.scenario, rows, metrics, time.perf_counter() - self.started, model_name)
        problems = [write_or_keep(self.output_dir / "instances.jsonl", "".join(json_text(r) + "\n" for r in rows),
                                  "the per-instance results"),
                    write_or_keep(self.output_dir / "summary.json", json_text(summary, indent=2) + "\n",
                                  "the summary")]
        return BenchResult(rows, summary, [p for p in problems if p], failure_line(samples))

    def close(self) -> None:
        self.store.close()


@dataclass(frozen=True)
class BenchResult:
    rows: list[dict]  # per instance, as written to instances.jsonl
    summary: dict  # as written to summary.json
    problems: list[str]  # writes that failed, and where their text was kept instead
    failures: str | None  # 'N of M sequences failed', or None


def open_bench(job: Job, deployment, scenario_name: str, data: str | None, output_dir: str | Path | None, *,
               max_instances: int | None = None, num_in_context: int | None = None,
               subject: str | None = None) -> BenchRun:
    """Check the output directory, load the instances and open (or resume) the results.
    ``deployment``: the job's, resolved (``flexoff.deploy.Deployment``), whose dtype the results'
    identity names."""
    started = time.perf_counter()
    scenario = get_scenario(scenario_name)
    output_dir = _check_output_dir(bench_output_dir(scenario_name, output_dir))
    if max_instances is not None and max_instances < 1:
        raise FlexoffError(f"--max-instances must be >= 1, got {max_instances}")
    drawn = False
    if data is not None and looks_like_scenario_state(data):
        scenario, instances, drawn = read_scenario_state(scenario, data)
    else:
        instances = load_instances(scenario, data, seed=job.seed)
        if data is None and max_instances is None:
            max_instances = SYNTHETIC_EVAL_DEFAULT  # HELM's generated scenario holds 10000
    evaluated = helm_sample(instances, max_instances, drawn=drawn)
    k = scenario.num_in_context if num_in_context is None else num_in_context
    if k < 0:
        raise FlexoffError(f"--num-in-context must be >= 0, got {k}")
    examples = choose_examples([i for i in instances if i.split == "train"], k, job.seed)
    subject = subject or (default_subject(data) if scenario.multiple_choice else "")
    digest = hashlib.sha256(Path(data).read_bytes()).hexdigest() if data else None
    dtype = str(deployment.dtype).removeprefix("torch.")
    header = make_header("bench", bench_identity(scenario, job, digest, dtype, subject, k))
    store = ResultStore.open(output_dir / "results.jsonl", header, fresh_hint="choose another --output-dir",
                             flag="--output-dir")
    return BenchRun(job, scenario, output_dir, evaluated, examples, subject, store, started)


def bench_output_dir(scenario_name: str, output_dir: str | Path | None) -> Path:
    """The folder a bench run writes into: ``output_dir``, else flexoff-bench/SCENARIO."""
    return Path(output_dir) if output_dir else Path("flexoff-bench") / get_scenario(scenario_name).name


def _check_output_dir(output_dir: Path) -> Path:
    """Refuse, before any work, an output directory that is a file or cannot hold the results."""
    if output_dir.exists() and not output_dir.is_dir():
        raise OutputError(f"--output-dir {output_dir} is a file, not a directory")
    check_folder(output_dir, "--output-dir")
    for name in ("results.jsonl", "instances.jsonl", "summary.json"):
        check_destination(output_dir / name, "--output-dir")
    return output_dir
