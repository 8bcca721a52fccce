"""``LLM``: a model ready to generate, score and chat, over one resolved deployment."""

from __future__ import annotations

from collections.abc import Callable, Sequence as SequenceOf
from dataclasses import replace
import math

import torch

from ..chat import chat_prompt, check_template_args, conversation_list
from ..checks import check_bool
from ..deploy.deployment import Deployment, Request, resolve_deployment
from ..deploy.parallel import Parallel, rounds
from ..deploy.planning import plan_deployment
from ..errors import (ArgumentTypeError, ClosedError, FlexoffError, NonFiniteError, PromptError, SamplingError,
                      TokenizerError)
from ..generation_config import read_generation_config
from ..models import ModelConfig, stage_specs, stages
from ..outputs import RequestOutput
from ..policy import Policy
from ..progress import TokenBar
from ..prompts import check_room, prompt_ids
from ..runtime.batch import Sequence
from ..runtime.block_forming import form_blocks
from ..runtime.engine import Engine
from ..runtime.memory import DeviceMemoryCap
from ..runtime.metrics import Metrics
from ..runtime.sampling import SamplingParams
from ..tokenizer import Tokenizer
from ..weights import DummyWeights, checkpoint_weights
from .args import check_llm_args, one_of, unwrap_prompt
from .results import GenerationResult, ScoreOutput, request_output


class LLM:
    """A model ready to generate: weights from a checkpoint directory, or seeded dummy weights."""

    _closed = False  # set by close()
    _cap: DeviceMemoryCap | None = None  # the process's GPU allocator cap at gpu_mem, lifted by close()
    ranks = None  # this process's place in a parallel job (flexoff.deploy.parallel)
    engine = None

    def __init__(self, model: str, *, dummy: bool = False, policy: Policy | str | None = None,
                 dtype: str | torch.dtype = "auto", device: str | torch.device = "auto", seed: int = 0,
                 tokenizer: str | None = None, offload_dir: str | None = None,
                 gpu_mem: str | int | None = None, cpu_mem: str | int | None = None,
                 workload=None, hardware=None, compress: str = "off", pipeline_parallel_size: int | None = None,
                 data_parallel_size: int | None = None, pipeline_layers: SequenceOf[int] | None = None,
                 prefix_sharing: bool = True, cuda_graphs: bool = True):
        """``workload`` (a planner Workload, or a callable giving one or None): the job this LLM will run.
        With it, a job that cannot fit the machine is refused before anything is allocated, and with
        no ``policy``, a job the compute device cannot hold under DEFAULT_POLICY runs a policy
        planned on ``hardware`` (a HardwareProfile, a packaged profile's name or a profile file, or
        a callable giving a profile; default: this machine's saved profile, measured quickly and
        saved the first time, which is told to the ``flexoff`` logger); ``self.plan`` tells.
        ``policy="auto"`` always runs the planned policy.
        ``compress`` is what that planning may do with lossy 4-bit compression: "off" (lossless),
        "auto" (try both) or "on"; of the cache alone for a model stored compressed, read as stored.
        ``pipeline_parallel_size`` and ``data_parallel_size``: this process is one of a parallel
        job's, started by torchrun (see ``flexoff.deploy.parallel``); None takes them from the launch
        (all its processes one pipeline); ``pipeline_layers``, the decoder layers of each stage
        (default: split evenly). Every process calls the same methods with the same prompts, and
        every one returns the same outputs. ``prefix_sharing``: rows whose prompts begin alike run
        in one GPU batch, which prefills that prefix once and keeps one copy of its cache
        (``flexoff.prefixes``); the outputs are those of False, which runs every row whole.
        ``cuda_graphs``: on CUDA, each decode layer's halves around attention replay as CUDA graphs
        (``flexoff.runtime.decode_graphs``); the outputs are those of False."""
        check_llm_args(dummy=dummy, policy=policy, dtype=dtype, device=device, seed=seed, tokenizer=tokenizer,
                       offload_dir=offload_dir, gpu_mem=gpu_mem, cpu_mem=cpu_mem, compress=compress,
                       prefix_sharing=prefix_sharing, cuda_graphs=cuda_graphs)
        layers = tuple(pipeline_layers) if pipeline_layers is not None else None
        request = Request(model, dummy, policy, dtype=dtype, device=device, seed=seed, tokenizer=tokenizer,
                          offload_dir=offload_dir, gpu_mem=gpu_mem, cpu_mem=cpu_mem, compress=compress,
                          hardware=hardware, parallel=Parallel(pipeline_parallel_size, data_parallel_size,
                                                               layers=layers))
        self._start(resolve_deployment(request), workload, prefix_sharing, cuda_graphs)

    @classmethod
    def from_deployment(cls, deployment: Deployment, workload=None, prefix_sharing: bool = True,
                        cuda_graphs: bool = True) -> "LLM":
        """The LLM of a deployment resolved already (``flexoff.deploy.resolve_deployment``), planned
        here for ``workload`` as ``LLM(...)`` plans it."""
        check_bool(prefix_sharing, "prefix_sharing")
        check_bool(cuda_graphs, "cuda_graphs")
        llm = cls.__new__(cls)
        llm._start(deployment, workload, prefix_sharing, cuda_graphs)
        return llm

    def _start(self, deployment: Deployment, workload, prefix_sharing: bool, cuda_graphs: bool = True) -> None:
        """Load the tokenizer, check the weights, plan the deployment for ``workload`` and build the engine."""
        request = deployment.request
        self.prefix_sharing = prefix_sharing
        self.seed, self.device, self.dtype = request.seed, deployment.device, deployment.dtype
        self.tokenizer = Tokenizer.for_model(deployment.checkpoint, request.tokenizer)
        self.generation_config = read_generation_config(deployment.checkpoint)
        self.config: ModelConfig = deployment.config
        more_eos = tuple(i for i in self.generation_config.eos_token_ids if i not in self.config.eos_token_ids)
        if more_eos:
            self.config = self.config.replace(eos_token_ids=self.config.eos_token_ids + more_eos)
        source = DummyWeights(request.seed) if request.dummy else checkpoint_weights(deployment.checkpoint)
        source.check({stage.name: stage_specs(self.config, stage) for stage in stages(self.config)})
        deployment = plan_deployment(deployment, workload)
        self.deployment = deployment
        self.ranks, self.policy, self.plan = deployment.ranks, deployment.policy, deployment.plan
        capacity = deployment.capacity
        self._cap = DeviceMemoryCap.for_device(self.device, capacity.gpu if request.gpu_mem else None)
        link = None
        if self.ranks is not None and self.ranks.parallel.pipeline > 1:
            from ..runtime.pipeline import PipelineLink

            link = PipelineLink(self.ranks.place, self.device, self.dtype)
        self.engine = Engine(self.config, source, self.policy, self.device, self.dtype, request.seed,
                             offload_dir=deployment.offload_dir, capacity=capacity, link=link,
                             share_prefixes=prefix_sharing, cuda_graphs=cuda_graphs)

    def close(self) -> None:
        """Free the model's memory and offload files; later calls raise ClosedError. Closing twice is fine."""
        self._closed = True
        if self.engine is not None:
            self.engine.close()
        if self._cap is not None:
            self._cap.lift()

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("this LLM is closed; make a new one")

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # Input checks
    def _encode(self, prompts: SequenceOf, what: str = "prompt") -> list[list[int]]:
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, (list, tuple)):
            raise ArgumentTypeError(f"{what}s must be a list of strings or of token-id lists, "
                                    f"got {type(prompts).__name__}")
        if len(prompts) == 0:
            raise PromptError(f"the {what} list is empty")
        return [prompt_ids(prompt, f"{what} {i}", self.config, self.tokenizer, type_error=ArgumentTypeError)
                for i, prompt in enumerate(prompts)]

    @staticmethod
    def _prompt_list(prompts) -> list:
        """generate()'s prompts as a list of text or token-id lists: one prompt (text, or vLLM's
        {"prompt": text} or {"prompt_token_ids": ids}) or a list of them."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            return prompts  # refused, with the type named, by _encode
        return [unwrap_prompt(p, i) if isinstance(p, dict) else p for i, p in enumerate(prompts)]

    def get_tokenizer(self):
        """The Hugging Face tokenizer this model encodes and decodes with (vLLM's name)."""
        if self.tokenizer is None:
            raise TokenizerError(f"model {self.config.name!r} has no tokenizer; give a checkpoint directory with "
                                 "tokenizer files, or tokenizer=DIR")
        if self.tokenizer.hf is None:
            raise TokenizerError("get_tokenizer() returns a transformers tokenizer: pip install 'flexoff[hf]'")
        return self.tokenizer.hf

    def get_default_sampling_params(self) -> SamplingParams:
        """What a call given no sampling parameters runs: flexoff's defaults (greedy, 32 tokens) under
        the sampling defaults of the checkpoint's generation_config.json, if it has any."""
        defaults = self.generation_config
        try:
            return SamplingParams(**defaults.sampling)
        except FlexoffError as exc:
            raise type(exc)(f"the sampling defaults of {defaults.path}: {exc}; pass sampling parameters "
                            "to override them") from None

    def _params(self, params, count: int) -> list[SamplingParams]:
        if params is None:
            return [self.get_default_sampling_params()] * count
        if isinstance(params, SamplingParams):
            return [params] * count
        if not isinstance(params, (list, tuple)) or not all(isinstance(p, SamplingParams) for p in params):
            raise ArgumentTypeError("params must be a SamplingParams, a list of them (one per prompt) or None")
        if len(params) != count:
            raise SamplingError(f"{len(params)} sampling parameter sets for {count} prompts")
        return list(params)

    def _check_lengths(self, ids: list[list[int]], params: list[SamplingParams]) -> None:
        vocab = self.config.vocab_size
        for i, (prompt, p) in enumerate(zip(ids, params)):
            check_room(prompt, p.max_new_tokens, f"prompt {i}", self.config)
            for name in ("logprobs", "prompt_logprobs"):
                if (getattr(p, name) or 0) > vocab:
                    raise SamplingError(f"{name}={getattr(p, name)} is more than the {vocab} tokens of "
                                        f"{self.config.name}'s vocabulary")
        if self.tokenizer is None and any(p.stop for p in params):
            raise TokenizerError("stop strings need a tokenizer, and this model has none")

    def _form_blocks(self, prompts: list[list[int]], budgets: list[int], keep: list[int], *,
                     by_gpu_batch: bool = False) -> list[list[int]]:
        """The job's blocks (``runtime.block_forming``): with prefix sharing, the rows sharing a long
        prefix in one GPU batch, ``keep[r]`` of row r's last positions its own; without, by length,
        and by GPU batch inside a block where ``by_gpu_batch`` asks. Under a searched policy a
        generated token weighs what the plan predicts it costs."""
        sharing = self.prefix_sharing
        predicted = self.plan.prediction if self.plan is not None else None
        return form_blocks([len(p) for p in prompts], budgets, self.policy.block_size,
                           gpu_batch_size=self.policy.gpu_batch_size if sharing or by_gpu_batch else None,
                           prompts=prompts if sharing else None, keep=keep if sharing else None,
                           budget_weight=predicted.generated_token_weight if predicted else 1)

    def generate(self, prompts, params: SamplingParams | SequenceOf[SamplingParams] | None = None,
                 *, progress: bool | None = None,
                 on_block: Callable[[list[RequestOutput], Metrics], None] | None = None,
                 sampling_params: SamplingParams | SequenceOf[SamplingParams] | None = None,
                 use_tqdm: bool | None = None, tracker=None) -> GenerationResult:
        """Generate a continuation of every prompt. Outputs come back in input order.

        ``prompts``: one prompt or a list; each is text, a list of token ids, or vLLM's
        ``{"prompt": text}`` or ``{"prompt_token_ids": ids}``. ``sampling_params`` and ``use_tqdm``
        are vLLM's names for ``params`` and ``progress`` (the progress bar, off by default; its
        time left counts the prefills to come). ``tracker``: instead of that bar, an object told
        of the job's work, each block's start and prefill, and its tokens, as
        ``flexoff.progress.TokenBar`` is."""
        self._check_open()
        params = one_of(params, sampling_params, "params", "sampling_params")
        progress = one_of(progress, use_tqdm, "progress", "use_tqdm")
        progress = False if progress is None else progress
        check_bool(progress, "progress" if use_tqdm is None else "use_tqdm")
        progress = progress and (self.ranks is None or self.ranks.rank == 0)  # one bar for a parallel job
        if on_block is not None and not callable(on_block):
            raise ArgumentTypeError(f"on_block must be callable or None, got {type(on_block).__name__}")
        prompts = self._prompt_list(prompts)
        ids = self._encode(prompts)
        params = self._params(params, len(ids))
        self._check_lengths(ids, params)
        # n samples of a prompt are n rows, side by side in their block; rows of one prompt in a
        # GPU batch share its prefill (GpuBatch). Row r's default seed is the LLM's seed + r (the
        # prompt's index when n = 1); a seeded prompt's sample j draws from seed + j.
        rows = [(i, j) for i, p in enumerate(params) for j in range(p.n)]
        seeds = [self.seed + r if params[i].seed is None else params[i].seed + j for r, (i, j) in enumerate(rows)]
        # The prompt's logprobs come from its first sample's row only.
        row_params = [params[i] if j == 0 or params[i].prompt_logprobs is None
                      else replace(params[i], prompt_logprobs=None) for i, j in rows]
        # A row with prompt logprobs reads its whole prompt at the head: it shares none of it.
        blocks = self._form_blocks([ids[i] for i, _ in rows], [params[i].max_new_tokens for i, _ in rows],
                                   [len(ids[i]) if p.prompt_logprobs is not None else 1
                                    for (i, _), p in zip(rows, row_params)], by_gpu_batch=True)
        outputs: list[RequestOutput | None] = [None] * len(ids)
        done: dict[int, list[Sequence]] = {}  # a prompt's finished samples, until all n are
        total = Metrics()
        tracker = TokenBar(enabled=progress) if tracker is None else tracker
        tracker.start(sum(len(prompt) for prompt in ids), sum(p.max_new_tokens * p.n for p in params))
        try:
            for seqs, metrics, counted in self._generated(blocks, lambda block: [
                    Sequence(r, ids[rows[r][0]], row_params[r], seeds[r]) for r in block], tracker):
                block_outputs = []
                for seq in seqs:
                    i = rows[seq.index][0]
                    done.setdefault(i, []).append(seq)
                    if len(done[i]) == params[i].n:
                        samples = sorted(done.pop(i), key=lambda s: s.index)
                        outputs[i] = request_output(samples, i, prompts[i], self.tokenizer)
                        block_outputs.append(outputs[i])
                total.add(counted)
                if on_block is not None:  # a block may finish no prompt when its samples span blocks
                    on_block(block_outputs, metrics)
        finally:
            tracker.close()
        return GenerationResult(outputs, total)

    def _generated(self, blocks: list[list[int]], make_seqs, tracker):
        """Each block's sequences, generated, with its metrics and those the job's total counts, in
        block order. Alone, one block at a time; in a parallel job, by rounds (``parallel.rounds``:
        each replica runs its blocks in rotation through its pipeline), after which every process
        takes every block's results. A round's blocks run at once: the total counts the round as
        one span, with its last block."""
        decode = self.tokenizer.decode if self.tokenizer is not None else None
        ranks = self.ranks
        if ranks is None:
            groups = [[[b]] for b in range(len(blocks))]
        else:
            groups = rounds(len(blocks), ranks.parallel.pipeline, ranks.parallel.data)
        for group in groups:
            order = [b for blocks_of_replica in group for b in blocks_of_replica]
            seqs = {b: make_seqs(blocks[b]) for b in order}
            mine = group[0] if ranks is None else ranks.my_blocks(group)
            budget = sum(s.params.max_new_tokens for b in order for s in seqs[b])
            # A prompt shared by rows is prefilled once.
            tracker.block_started(sum(len(p) for b in order for p in {tuple(s.prompt_ids) for s in seqs[b]}))
            alone = ranks is None
            step, prefilled, counted = self._tracking(tracker, budget, len(mine), ranks)
            ran = self.engine.generate_blocks([seqs[b] for b in mine], decode, on_step=step,
                                              on_prefill=prefilled) if mine else []
            metrics = dict(zip(mine, ran))
            if ranks is not None:
                held = {b: ([s.outcome() for s in seqs[b]], metrics[b]) for b in mine} if ranks.reports else {}
                for shared in ranks.gather(held):
                    for b, (outcomes, block_metrics) in shared.items():
                        for seq, outcome in zip(seqs[b], outcomes, strict=True):
                            seq.take_outcome(outcome)
                        metrics[b] = block_metrics
            # Sequences that stopped early leave part of their budget unused; count it as done.
            generated = sum(metrics[b].generated_tokens for b in order) if alone else counted()
            tracker.block_done(budget - generated)
            if alone:
                yield seqs[order[0]], metrics[order[0]], metrics[order[0]]
                continue
            span = Metrics.concurrent([metrics[b] for b in order])
            for b in order:
                yield seqs[b], metrics[b], span if b == order[-1] else Metrics()

    @staticmethod
    def _tracking(tracker, budget: int, blocks: int, ranks):
        """(on_step, on_prefill, counted) for a round's blocks. Alone, the tracker follows the head
        token by token. In a parallel job the bar is rank 0's: the first process of the first
        replica, which takes each token from its pipeline's head; the other replicas are taken to
        keep its pace (its count times the replicas, up to the round's budget), and the round's
        end settles the rest. Its prefill counts once, when its last block's is done."""
        if ranks is None:
            return tracker.generated, tracker.prefilled, lambda: 0
        if ranks.rank != 0:
            return None, None, lambda: 0
        state = {"counted": 0, "prefills": 0}

        def step(count: int) -> None:
            count = max(0, min(count * ranks.parallel.data, budget - state["counted"]))
            state["counted"] += count
            tracker.generated(count)

        def prefilled() -> None:
            state["prefills"] += 1
            if state["prefills"] == blocks:
                tracker.prefilled()

        return step, prefilled, lambda: state["counted"]

    def chat(self, messages, sampling_params: SamplingParams | SequenceOf[SamplingParams] | None = None,
             use_tqdm: bool | None = None, *, add_generation_prompt: bool = True, chat_template: str | None = None,
             chat_template_kwargs: dict | None = None) -> GenerationResult:
        """Generate the next turn of each conversation, as vLLM's ``LLM.chat``: ``messages`` is one
        conversation (a list of {"role", "content"} dicts) or a list of them. Each goes through the
        tokenizer's chat template (or ``chat_template``, a Jinja string), then through ``generate``;
        an output's ``prompt`` is the templated text."""
        self._check_open()
        check_bool(add_generation_prompt, "add_generation_prompt")
        check_template_args(chat_template, chat_template_kwargs)
        conversations = conversation_list(messages)
        prompts = []
        for i, conversation in enumerate(conversations):
            try:
                prompts.append(chat_prompt(self.tokenizer, conversation, add_generation_prompt=add_generation_prompt,
                                           chat_template=chat_template, chat_template_kwargs=chat_template_kwargs))
            except PromptError as exc:  # a template's refusal names the conversation; no template is not one's
                raise PromptError(f"conversation {i}: {exc}") from None
        result = self.generate([{"prompt_token_ids": ids} for _, ids in prompts], sampling_params=sampling_params,
                               use_tqdm=use_tqdm)
        return GenerationResult([replace(out, prompt=prompts[i][0]) for i, out in enumerate(result)], result.metrics)

    def next_token_logits(self, prompts: SequenceOf) -> torch.Tensor:
        """Logits for the token after each prompt: (len(prompts), vocab), fp32 on the CPU."""
        self._check_open()
        ids = self._encode(prompts)
        self._check_lengths(ids, [SamplingParams(max_new_tokens=1)] * len(ids))
        out = torch.empty(len(ids), self.config.vocab_size)
        for block in self._form_blocks(ids, [1] * len(ids), [1] * len(ids)):
            out[block] = self.engine.last_logits([ids[i] for i in block])
        out = self._from_head(out)
        self._check_finite(torch.isfinite(out).all(dim=-1).tolist(), "logits")
        return out

    def ranks_memory(self) -> list[dict] | None:
        """In a parallel job, each process's range of stages, weights by tier and peak memory, in
        rank order; every process must call it (it gathers them). None alone."""
        if self.ranks is None:
            return None
        owned = self.ranks.place.owned
        return self.ranks.gather({"stages": (owned.start, owned.stop),
                                  "weights": dict(self.engine.placement_report["bytes"]),
                                  "peaks": self.engine.peak_memory()})

    def _from_head(self, value):
        """What the head computed (logits, scores), on every process: in a pipeline only its last
        process has it. Replicas each compute it all: the first's is taken."""
        if self.ranks is None or self.ranks.parallel.pipeline == 1:
            return value
        return next(v for v in self.ranks.gather(value if self.ranks.place.last else None) if v is not None)

    def _check_finite(self, finite: list[bool], what: str) -> None:
        """Refuse NaN or infinite results, naming the first prompt and the weight at fault."""
        bad = next((i for i, ok in enumerate(finite) if not ok), None)
        if bad is not None:
            raise NonFiniteError(f"prompt {bad}: the model's {what} are not finite: {self.engine.non_finite_cause()}")

    def score(self, prompts: SequenceOf, continuations: SequenceOf) -> list[ScoreOutput]:
        """Per-token log-probabilities of each continuation given its prompt, and whether greedy
        decoding generates it (``ScoreOutput.greedy``), in one prefill pass."""
        self._check_open()
        prompt_ids = self._encode(prompts)
        cont_ids = self._encode(continuations, "continuation")
        if len(cont_ids) != len(prompt_ids):
            raise PromptError(f"score() needs one continuation per prompt ({len(prompt_ids)}), "
                              f"got {len(cont_ids)}")
        for i, (p, c) in enumerate(zip(prompt_ids, cont_ids)):
            if len(p) + len(c) > self.config.max_positions:
                raise PromptError(f"prompt {i} plus its continuation has {len(p) + len(c)} tokens, "
                                  f"more than the {self.config.max_positions} positions of {self.config.name}")
        # Scored continuations are not new prompts: drop the BOS a tokenizer adds to text.
        for i, cont in enumerate(continuations):
            if isinstance(cont, str) and self.config.bos_token_id is not None and len(cont_ids[i]) > 1 \
                    and cont_ids[i][0] == self.config.bos_token_id:
                cont_ids[i] = cont_ids[i][1:]
        # The head reads each continuation's positions and the one before them.
        blocks = self._form_blocks([p + c for p, c in zip(prompt_ids, cont_ids)], [1] * len(prompt_ids),
                                   [len(c) + 1 for c in cont_ids])
        results: list[ScoreOutput | None] = [None] * len(prompt_ids)
        for block in blocks:
            scored = self.engine.score_block([prompt_ids[i] for i in block], [cont_ids[i] for i in block])
            for i, (values, greedy) in zip(block, scored):
                results[i] = ScoreOutput(cont_ids[i], values, greedy)
        results = self._from_head(results)
        self._check_finite([all(math.isfinite(v) for v in r.logprobs) for r in results], "log-probabilities")
        return results
