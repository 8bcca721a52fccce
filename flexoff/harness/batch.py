"""``flexoff batch``: a resumable generation job over a JSONL file of prompts.

Input, one JSON object per line (blank lines are skipped)::

    {"id": "q1", "prompt": "Translate to French: cheese", "max_new_tokens": 16, "stop": ["\\n"]}
    {"id": 2, "prompt": [2, 133, 812, 9], "meta": {"source": "set-b"}}

- ``id`` (required): a string or an integer, unique in the file.
- ``prompt`` (required, unless ``messages``): non-empty text, or a list of token ids (for models
  without a tokenizer).
- ``messages`` (instead of ``prompt``): a chat conversation, ``[{"role": "user", "content": "..."}]``,
  put through the tokenizer's chat template as ``LLM.chat`` does; its record's ``prompt`` is the
  templated text.
- ``max_new_tokens`` (optional): this line's budget instead of ``--max-new-tokens``.
- ``stop`` (optional): a string or a list of strings, added to the ``--stop`` strings.
- ``meta`` (optional): any JSON value, copied to the line's result untouched.

A file in the OpenAI Batch API's format (its first line has a ``custom_id``) is read and answered
in that format instead: see :mod:`flexoff.harness.openai_batch`.

Output: one record per line (the fields of :mod:`flexoff.records`, plus ``meta`` if the line gave
one), in the order blocks finish; ``index`` is the line's place among the input's prompts, so
sorting by it gives input order. The job's identity is in ``OUTPUT.job.json`` beside it (see
:mod:`flexoff.harness.store`), and one job at a time may write an output. A sequence that could
not be generated gets a record with ``finish_reason`` "error" and its ``error``; it counts as done,
and the command then exits with 1 after a one-line count on stderr.

Resuming: rerun the same command. Ids already in the output are skipped; a torn last line from
a crash is dropped. The job's fingerprint covers the model, the input file's bytes, the
resolved dtype and the sampling flags, but not the policy: a job may resume under another
lossless policy, since every such policy yields the same tokens; a compressed one must compress as
the first run did (the job file records the policy). Each line's sample is seeded from ``--seed``
and the line's id, so a resumed job draws what an uninterrupted one would have drawn.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from pathlib import Path

from ..errors import FlexoffError, PromptError, TokenizerError
from ..fileio import decode_utf8, jsonl_objects, read_user_bytes
from ..job import Job
from ..generation_config import read_generation_config
from ..gguf_format import GGUFFile
from ..models import config_from_dir, gguf_path, model_directory
from ..prompts import PromptLine, check_room, line_prompt, prompt_record
from ..records import failure_line
from ..runtime.sampling import SamplingParams
from .openai_batch import OpenAIRequest, Responses, is_openai_line, read_request, response_failures
from .runner import GenerationItem, Progress, request_seed, run_generation
from .store import PeerStore, ResultStore, id_key, make_header


def read_batch_input(path: str | Path) -> tuple[list[PromptLine], str]:
    """Parse and check every line; returns the lines and the sha256 of the file's bytes."""
    lines, digest, _ = read_batch_requests(path)
    return lines, digest


def read_batch_requests(path: str | Path) -> tuple[list[PromptLine], str, dict[str, OpenAIRequest] | None]:
    """As read_batch_input, with the OpenAI batch requests by their lines' id keys when the file is
    in that format (its first line has a ``custom_id``; see flexoff.harness.openai_batch), else None."""
    path = Path(path)
    data = read_user_bytes(path, "input file", PromptError)
    text = decode_utf8(data, path, PromptError)
    objects = list(jsonl_objects(path, text, PromptError))
    requests = {} if objects and is_openai_line(objects[0][2]) else None
    lines: list[PromptLine] = []
    seen: dict[str, int] = {}
    for number, where, obj in objects:
        if requests is None:
            line, named = prompt_record(obj, where, number, id_required=True), "id"
        else:
            request = read_request(obj, where, number)
            line, named = request.line, "custom_id"
            requests[id_key(line.id)] = request
        key = id_key(line.id)
        if key in seen:
            raise PromptError(f"{where}: duplicate {named} {obj[named]!r} (first on line {seen[key]})")
        seen[key] = number
        lines.append(line)
    if not lines:
        raise PromptError(f"{path} has no prompts")
    return lines, hashlib.sha256(data).hexdigest(), requests


def model_identity(model: str, dummy: bool, seed: int) -> dict:
    """What makes two runs the same model: the checkpoint (its folder, which for a Hub id names the
    repo and its revision, and its config; a GGUF file and its header) or the registry name, plus the
    seed when weights are dummy."""
    directory = model_directory(model, "config" if dummy else "weights")
    identity: dict = {}
    gguf = gguf_path(directory) if directory is not None else None
    if gguf is not None:  # its metadata and tensor table are its config; the whole file may be gigabytes
        file = GGUFFile(gguf)
        identity["path"] = str(gguf.resolve())
        identity["gguf_header_sha256"] = hashlib.sha256(file.header_bytes()).hexdigest()
        file.close()
    elif directory is not None:
        config = directory / "config.json"
        identity["path"] = str(directory.resolve())
        identity["config_sha256"] = hashlib.sha256(config.read_bytes()).hexdigest() if config.is_file() else None
        # End-of-sequence ids that generation_config.json adds change the outputs; named only when it
        # adds some, so that outputs of jobs whose file adds none still resume.
        added = read_generation_config(directory).eos_token_ids
        if added and config.is_file():
            known = config_from_dir(directory).eos_token_ids  # read once, not per id
            more_eos = [i for i in added if i not in known]
            if more_eos:
                identity["generation_eos_token_ids"] = more_eos
    else:
        identity["name"] = model.lower().rsplit("/", 1)[-1]
    if dummy:
        identity["dummy_seed"] = seed
    return identity


def sampling_identity(params: SamplingParams, seed: int) -> dict:
    return {"max_new_tokens": params.max_new_tokens, "temperature": params.temperature, "top_k": params.top_k,
            "top_p": params.top_p, "stop": list(params.stop), "ignore_eos": params.ignore_eos, "seed": seed}


def generation_items(llm, lines: list[PromptLine], defaults: SamplingParams, seed: int, source: str,
                     requests: dict[str, OpenAIRequest] | None = None) -> list[GenerationItem]:
    """Tokenize and check every line against the model before anything runs; an OpenAI request's
    sampling fields override the job's."""
    items = []
    for line in lines:
        request = requests[id_key(line.id)] if requests is not None else None
        # An OpenAI request is named by its custom_id; its line's id is derived from that.
        named = f"id {line.id!r}" if request is None else f"custom_id {request.custom_id!r}"
        where = f"{source} line {line.line} ({named})"
        params = _line_params(line, request, defaults, where, llm)
        # A request's prompts, where it lists several, run as sequences of their own under its id.
        several = request.prompts if request is not None else ()
        parts = [replace(line, prompt=prompt) for prompt in several] or [line]
        for part, prompt_line in enumerate(parts):
            what = f"{where}: the prompt" + (f" {part}" if len(parts) > 1 else "")
            ids, text = line_prompt(prompt_line, what, llm.config, llm.tokenizer)
            check_room(ids, params.max_new_tokens, what, llm.config)
            if request is None or "seed" not in request.sampling:
                params = replace(params, seed=request_seed(seed, line.id, part) if not params.greedy else None)
            items.append(GenerationItem(line.id, ids, params, {"meta": line.meta} if line.meta is not None else {},
                                        text=text, request=request, part=part))
    return items


def _line_params(line: PromptLine, request: OpenAIRequest | None, defaults: SamplingParams, where: str,
                 llm) -> SamplingParams:
    """A line's sampling parameters: the job's, with the line's budget and stop strings and an
    OpenAI request's sampling fields over them."""
    stop = tuple(dict.fromkeys(defaults.stop + line.stop))
    if stop and llm.tokenizer is None:
        raise TokenizerError(f"{where}: stop strings need a tokenizer, and model {llm.config.name!r} has none")
    try:
        return replace(defaults, max_new_tokens=line.max_new_tokens or defaults.max_new_tokens, stop=stop,
                       **(request.sampling if request is not None else {}))
    except FlexoffError as exc:  # a request's field against the job's flags (min_tokens past --max-new-tokens)
        raise PromptError(f"{where}: {exc}") from None


@dataclass
class BatchJob:
    """A batch job with its output open: what is done, what is left, and how to run the rest.

    The caller makes the LLM (its planner may want :meth:`workload` first), calls :meth:`run`, and
    closes the job; nothing here prints."""

    job: Job
    source: str
    lines: list[PromptLine]
    defaults: SamplingParams
    store: ResultStore
    already: int  # prompts already in the output when it was opened
    requests: dict[str, OpenAIRequest] | None = None  # an OpenAI batch file's requests, by id key

    @property
    def pending(self) -> list[PromptLine]:
        return [line for line in self.lines if id_key(line.id) not in self.store.done]

    @property
    def done(self) -> int:
        return sum(id_key(line.id) in self.store.done for line in self.lines)

    def workload(self):
        """The planner's workload of the prompts still to run (for a policy searched for them)."""
        from ..prompts import prompt_workload

        prompts, budgets = [], []
        for line in self.pending:
            request = self.requests[id_key(line.id)] if self.requests is not None else None
            parts = request.prompts if request is not None and request.prompts else [
                line.prompt if line.messages is None else line.messages]
            prompts.extend(parts)
            budgets.extend([line.max_new_tokens or self.defaults.max_new_tokens] * len(parts))
        return prompt_workload(prompts, budgets, self.job.model, self.job.tokenizer, self.job.prefix_sharing)

    def run(self, llm, progress: Progress | None = None):
        """Generate every prompt not yet in the output; the run's Metrics, or None if none was left."""
        items = generation_items(llm, self.lines, self.defaults, self.job.seed, self.source, self.requests)
        self.store.record_policy(llm.policy.to_dict())
        if self.requests is None:
            return run_generation(llm, self.store, items, progress=progress)
        decode = llm.tokenizer.decode if llm.tokenizer is not None else None

        responses = Responses(self.job.model, decode)  # OpenAI's output format
        return run_generation(llm, self.store, items, progress=progress, make_record=responses.record)

    def failures(self) -> str | None:
        """'N of M sequences failed', or None when no result is an error."""
        records = [self.store.done[id_key(line.id)] for line in self.lines]
        return response_failures(records) if self.requests is not None else failure_line(records)

    def close(self) -> None:
        self.store.close()


def open_batch(job: Job, deployment, source: str | Path, output: str | Path, max_new_tokens: int) -> BatchJob:
    """Read and check the input, and open (or resume) the output; the model is not loaded yet.
    ``deployment``: the job's, resolved (``flexoff.deploy.Deployment``), whose dtype the job's
    identity names; in a parallel job (its ``ranks``) rank 0 owns the output and its lock, and the
    others learn which ids it holds."""
    lines, digest, requests = read_batch_requests(source)
    defaults = job.sampling(max_new_tokens)
    ranks = deployment.ranks
    identity = {
        "model": model_identity(job.model, job.dummy, job.seed), "dtype": str(deployment.dtype).removeprefix("torch."),
        "input_sha256": digest, "sampling": sampling_identity(defaults, job.seed),
    }
    # Check the output before loading the model: a mismatch should fail in a second, not a minute.
    def open_store():
        return ResultStore.open(output, make_header("batch", identity), fresh_hint="choose another --output",
                                flag="--output")

    if ranks is None:
        store = open_store()
    else:
        opened: list[ResultStore] = []

        def open_here() -> set[str]:
            opened.append(open_store())
            return set(opened[0].done)

        done_ids = ranks.on_rank0(open_here)
        store = opened[0] if opened else PeerStore(output, done_ids)
    already = sum(id_key(line.id) in store.done for line in lines)
    return BatchJob(job, str(source), lines, defaults, store, already, requests)
