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
import sys
import time
from pathlib import Path

from ..errors import OutputError, TokenizerError
from ..fileio import check_destination, check_folder, json_text, write_or_keep
from ..records import failure_line
from ..runtime.sampling import SamplingParams
from .batch import model_identity
from .metrics import best_score
from .runner import GenerationItem, ScoreItem, request_seed, run_generation, run_scoring
from .scenarios import (EVAL_SPLITS, Scenario, choose_examples, default_subject, fit_prompt, get_scenario,
                        load_instances, reference_continuation)
from .store import ResultStore, id_key, make_header


def bench_identity(scenario: Scenario, args, data_digest: str | None, dtype: str, subject: str, k: int) -> dict:
    return {
        "scenario": scenario.name,
        # The definition itself: a changed template or setting must not mix with old results.
        "definition_sha256": hashlib.sha256(repr(scenario).encode()).hexdigest(),
        "data_sha256": data_digest, "model": model_identity(args.model, args.dummy, args.seed), "dtype": dtype,
        "settings": {"num_in_context": k, "seed": args.seed, "subject": subject},
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


def format_table(summary: dict) -> str:
    fmt = lambda v: "n/a" if v is None else f"{v:.4f}"  # noqa: E731
    k = summary["in_context_examples"]
    lines = [f"scenario   {summary['scenario']} · {summary['instances']} instances · model {summary['model']} · "
             f"in-context examples {k['min']}" + (f"–{k['max']}" if k["max"] != k["min"] else ""),
             f"{'metric':<24}{'mean':>12}"]
    lines += [f"{name:<24}{fmt(value):>12}" for name, value in summary["metrics"].items()]
    lines.append(f"{'ref_logprob':<24}{fmt(summary['ref_logprob']):>12}   (sum over the reference's tokens)")
    if summary["truncated_prompts"]:
        lines.append(f"truncated prompts       {summary['truncated_prompts']:>12}")
    gen = summary["generation"]
    if gen is None:
        lines.append("throughput: nothing was generated in this run (every result was already written)")
    else:
        lines.append(f"throughput  actual {gen['actual_throughput']:.1f} token/s · padded "
                     f"{gen['padded_throughput']:.1f} token/s · efficiency {100 * gen['efficiency']:.1f}% · "
                     f"generated {gen['total_throughput']:.1f} token/s")
    lines.append(f"wall time   {summary['wall_seconds']:.1f} s")
    return "\n".join(lines)


def run_bench(args, make_llm, out=None) -> int:
    out = out or sys.stdout
    from ..api import resolve_device, resolve_dtype
    from ..errors import FlexoffError

    started = time.perf_counter()
    scenario = get_scenario(args.scenario)
    output_dir = _check_output_dir(Path(args.output_dir or Path("flexoff-bench") / scenario.name))
    if not args.model:
        raise FlexoffError("bench needs --model (a checkpoint directory with a tokenizer)")
    if args.max_instances is not None and args.max_instances < 1:
        raise FlexoffError(f"--max-instances must be >= 1, got {args.max_instances}")
    instances = load_instances(scenario, args.data, seed=args.seed, max_instances=args.max_instances)
    evaluated = [i for i in instances if i.split in EVAL_SPLITS][:args.max_instances]
    k = scenario.num_in_context if args.num_in_context is None else args.num_in_context
    if k < 0:
        raise FlexoffError(f"--num-in-context must be >= 0, got {k}")
    examples = choose_examples([i for i in instances if i.split == "train"], k, args.seed)
    subject = args.subject or (default_subject(args.data) if scenario.multiple_choice else "")
    digest = hashlib.sha256(Path(args.data).read_bytes()).hexdigest() if args.data else None
    dtype = str(resolve_dtype(args.dtype, resolve_device(args.device))).removeprefix("torch.")
    header = make_header("bench", bench_identity(scenario, args, digest, dtype, subject, k))
    store = ResultStore.open(output_dir / "results.jsonl", header, fresh_hint="choose another --output-dir",
                             flag="--output-dir")
    try:
        if store.dropped_bytes:
            print(f"dropped a torn last line ({store.dropped_bytes} bytes) left by an interrupted run", file=sys.stderr)
        llm = make_llm(args)
        try:
            if llm.tokenizer is None:
                raise TokenizerError(f"scenarios are text; model {llm.config.name!r} has no tokenizer")
            cfg = llm.config
            prepared = [fit_prompt(scenario, examples, inst, llm.tokenizer, cfg.max_positions, subject,
                                   cfg.bos_token_id) for inst in evaluated]
            gen_items, score_items = [], []
            stride = scenario.num_outputs + 1  # an instance's samples, then its reference score
            for position, item in enumerate(prepared):
                for j in range(scenario.num_outputs):
                    sample_id = [item.instance.id, j]
                    seed = request_seed(args.seed, sample_id) if scenario.temperature > 0 else None
                    params = SamplingParams(max_new_tokens=scenario.max_new_tokens, temperature=scenario.temperature,
                                            stop=scenario.stop, seed=seed)
                    gen_items.append(GenerationItem(sample_id, item.prompt, params, index=position * stride + j))
                continuation = reference_continuation(scenario, item.instance.references[0])
                fitted = _score_prompt(item, continuation, llm.tokenizer, cfg.bos_token_id, cfg.max_positions)
                if fitted is not None:
                    score_items.append(ScoreItem([item.instance.id, "ref"], fitted[0], continuation, fitted[1],
                                                 index=position * stride + scenario.num_outputs))
            progress = not args.no_progress
            try:
                metrics = run_generation(llm, store, gen_items, progress=progress, desc=scenario.name)
                run_scoring(llm, store, score_items, chunk_size=4 * llm.policy.block_size, progress=progress)
            except KeyboardInterrupt:
                print(f"interrupted: results so far are in {store.path}; rerun the same command to finish",
                      file=sys.stderr)
                return 130
        finally:
            llm.close()
        rows = evaluate(scenario, prepared, store.done)
        samples = [store.done[id_key(item.id)] for item in gen_items]
    finally:
        store.close()
    summary = summarize(scenario, rows, metrics, time.perf_counter() - started, cfg.name)
    problems = [write_or_keep(output_dir / "instances.jsonl", "".join(json_text(r) + "\n" for r in rows),
                              "the per-instance results"),
                write_or_keep(output_dir / "summary.json", json_text(summary, indent=2) + "\n", "the summary")]
    print(format_table(summary), file=out)
    problems = [p for p in problems if p]
    if problems:
        raise OutputError("; ".join(problems))
    print(f"wrote {output_dir / 'instances.jsonl'} and {output_dir / 'summary.json'}", file=out)
    failures = failure_line(samples)
    if failures:
        print(f"flexoff: {failures} (their records in {output_dir / 'results.jsonl'} say why)", file=sys.stderr)
        return 1
    return 0


def _check_output_dir(output_dir: Path) -> Path:
    """Refuse, before any work, an output directory that is a file or cannot hold the results."""
    if output_dir.exists() and not output_dir.is_dir():
        raise OutputError(f"--output-dir {output_dir} is a file, not a directory")
    check_folder(output_dir, "--output-dir")
    for name in ("results.jsonl", "instances.jsonl", "summary.json"):
        check_destination(output_dir / name, "--output-dir")
    return output_dir
