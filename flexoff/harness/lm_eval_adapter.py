"""lm-evaluation-harness model ``flexoff``: evaluate any flexoff model with ``lm_eval`` tasks.

``import flexoff`` names the model in lm_eval's registry (lm_eval has no plugin discovery of its
own), so from Python ``lm_eval.simple_evaluate(model="flexoff", model_args="pretrained=DIR")``
works after it. lm_eval's own command line never imports flexoff: run it through flexoff's::

    flexoff eval --model flexoff --model_args pretrained=/models/opt-30b,policy=opt30b.json --tasks hellaswag

Needs ``pip install lm-eval``.

``--model_args``: ``pretrained`` (a checkpoint directory, or a registry name with ``dummy=True``),
``policy`` (a policy JSON file, or ``auto``: planned once per request type for its longest
request, on ``hardware``, a packaged profile's name or a profile file, by default this machine's
saved profile), ``dtype``, ``device``, ``seed``, ``tokenizer``, ``gpu_mem``, ``cpu_mem``,
``offload_dir``, ``compress`` (as the command line's flags), ``prefix_sharing`` (default true:
requests whose prompts begin alike, a context's choices among them, share that prefix's prefill
and cache; false is ``--no-prefix-sharing``), and ``greedy_check`` (default true:
loglikelihood's is-greedy flag, read off the scoring pass itself, ``ScoreOutput.greedy``; false
reports it as false). lm_eval's ``--device`` is taken where model_args names
no ``device`` (model_args' wins: lm_eval's own defaults to cuda:0, asked for or not). lm_eval's
``batch_size`` is accepted and ignored (the policy sets the batch sizes), and so is
``trust_remote_code`` (flexoff runs no checkpoint's code).

Request types: ``loglikelihood`` (scored in one prefill pass by ``LLM.score``),
``loglikelihood_rolling`` (disjoint windows of the model's context, each token predicted once)
and ``generate_until`` (``until``, ``max_gen_toks``, ``do_sample`` and the settings in
GEN_KWARGS; any other setting is refused by name rather than ignored). ``--apply_chat_template``
uses the tokenizer's chat template. Requests are handed to flexoff a few blocks at a time,
sorted by length, under a progress bar.
"""

from __future__ import annotations

import dataclasses
import sys
import warnings

from tqdm import tqdm

from ..checks import MAX_SEED, is_int
from ..errors import ConfigError, FlexoffError, PolicyError, SamplingError

try:
    import lm_eval.models  # noqa: F401  (register lm_eval's own models before ours; see get_model)
    from lm_eval.api.model import LM
    from lm_eval.api.registry import register_model
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window, simple_parse_args_string
except ImportError:  # pragma: no cover - exercised only without the optional package
    raise FlexoffError("the lm_eval adapter needs lm-evaluation-harness: pip install 'flexoff[lm-eval]'") from None

_IGNORED_ARGS = ("batch_size", "max_batch_size", "trust_remote_code")
_KNOWN_ARGS = ("pretrained", "policy", "dummy", "dtype", "device", "seed", "tokenizer", "greedy_check", "hardware",
               "gpu_mem", "cpu_mem", "offload_dir", "compress", "prefix_sharing")
# LLM's arguments at their defaults: check_llm_args is called with one model_args value at a time.
_LLM_DEFAULTS = dict(dummy=False, policy=None, dtype="auto", device="auto", seed=0, tokenizer=None, gpu_mem=None,
                     cpu_mem=None, offload_dir=None, compress="off", prefix_sharing=True)

# lm_eval's generation settings (in HF's and vLLM's spellings, as tasks write them) -> the
# SamplingParams field that means the same. A setting whose field SamplingParams lacks, or whose
# value it refuses, is refused by name; one missing here is refused too.
GEN_KWARGS = {
    "max_gen_toks": "max_new_tokens", "max_new_tokens": "max_new_tokens", "max_tokens": "max_new_tokens",
    "temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "seed": "seed",
    "repetition_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty", "min_p": "min_p",
    "min_new_tokens": "min_tokens", "min_tokens": "min_tokens", "stop_token_ids": "stop_token_ids",
}
# Settings that change nothing at the value given (HF's beam search of one beam is greedy search).
NEUTRAL_GEN_KWARGS = {"num_beams": 1}
# Settings that only apply when sampling: a greedy request ignores them, as HF's generate does.
SAMPLING_ONLY = ("temperature", "top_k", "top_p", "min_p", "seed")
DEFAULT_MAX_GEN_TOKS = 256  # lm_eval's hf model's default


def _flag(value, name: str) -> bool:
    """A model_args switch: lm_eval hands over true/false as booleans, and other spellings as text."""
    text = str(value).strip().lower()
    if text in ("1", "true", "yes"):
        return True
    if text in ("0", "false", "no"):
        return False
    raise FlexoffError(f"flexoff model_args {name}={value!r}: use true or false")


def _seed(value) -> int:
    number = int(value) if isinstance(value, str) and value.strip().lstrip("-").isdigit() else value
    if not is_int(number) or not 0 <= number <= MAX_SEED:
        raise ConfigError(f"flexoff model_args seed={value!r}: use an integer in [0, {MAX_SEED}]")
    return number


def _check_llm_values(values: dict) -> None:
    """LLM's arguments by type and range, each checked alone so that a refusal names its key."""
    from ..api.args import check_llm_args

    for key, value in values.items():
        try:
            check_llm_args(**{**_LLM_DEFAULTS, key: value})
        except FlexoffError as exc:
            raise type(exc)(f"flexoff model_args {key}={value!r}: {exc}") from None


def _check_auto_dtype(dtype, device) -> None:
    """policy=auto plans 16-bit weights and cache; say so in model_args' words, before anything loads."""
    from ..deploy.devices import resolve_device, resolve_dtype

    resolved = resolve_dtype(dtype, resolve_device(device), planned=True)  # auto: the 16-bit format it plans
    if resolved.itemsize != 2:
        raise PolicyError(f"flexoff model_args policy=auto plans 16-bit weights and cache, and dtype={dtype} computes "
                          f"in {str(resolved).removeprefix('torch.')} here: add dtype=bfloat16 or dtype=float16 to "
                          "--model_args, or give a policy file (policy=FILE)")


def sampling_fields(gen_kwargs: dict) -> tuple[dict, bool]:
    """(SamplingParams fields, whether to sample) for one request's lm_eval generation settings
    other than ``until``; a setting flexoff cannot honour raises, naming it."""
    kwargs = dict(gen_kwargs)
    sample = _flag(kwargs.pop("do_sample", False), "do_sample")
    known = {f.name for f in dataclasses.fields(_sampling_params())}
    fields = {}
    for key, value in kwargs.items():
        if value is None:  # a task's "not set"
            continue
        if key in NEUTRAL_GEN_KWARGS and value == NEUTRAL_GEN_KWARGS[key]:
            continue
        if not sample and key in SAMPLING_ONLY:
            continue
        field = GEN_KWARGS.get(key)
        if field is None or field not in known:
            raise SamplingError(f"lm_eval generation setting {key}={value!r} is not supported by flexoff; "
                                f"supported: until, do_sample, {', '.join(k for k in GEN_KWARGS if GEN_KWARGS[k] in known)}")
        try:
            # The value alone, under a budget no min_tokens exceeds: min_tokens is checked against the
            # request's own budget once that is known (generate_until's SamplingParams).
            _sampling_params()(**{"max_new_tokens": sys.maxsize, field: value})
        except FlexoffError as exc:
            raise SamplingError(f"lm_eval generation setting {key}={value!r}: {exc}") from None
        fields[field] = value
    if sample and fields.get("temperature", 1.0) == 0:
        sample = False
    if sample:
        fields.setdefault("temperature", 1.0)
    else:
        fields["temperature"] = 0.0
    return fields, sample


def _sampling_params():
    from ..runtime.sampling import SamplingParams

    return SamplingParams


@register_model("flexoff")
class FlexoffLM(LM):
    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> FlexoffLM:
        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None) -> FlexoffLM:
        """model_args with lm_eval's own --device and --batch_size, which it hands over beside them:
        model_args' value wins where both name one."""
        given = {key: value for key, value in (additional_config or {}).items() if value is not None}
        return cls(**{**given, **arg_dict})

    def __init__(self, pretrained: str | None = None, policy: str | None = None, dummy=False, dtype: str = "auto",
                 device: str | None = None, seed: int = 0, tokenizer: str | None = None, greedy_check=True,
                 hardware: str | None = None, gpu_mem: str | None = None, cpu_mem: str | None = None,
                 offload_dir: str | None = None, compress: str = "off", prefix_sharing=True, **kwargs):
        super().__init__()
        unknown = sorted(set(kwargs) - set(_IGNORED_ARGS))
        if unknown:
            raise FlexoffError(f"unknown flexoff model_args {unknown}; known: {', '.join(_KNOWN_ARGS)}")
        if pretrained is None or not str(pretrained).strip():
            raise FlexoffError("flexoff model_args need pretrained=DIR: a checkpoint directory, a Hugging Face Hub "
                               "id, or a registry name with dummy=true")
        import torch

        from ..models import resolve_model
        from ..tokenizer import Tokenizer

        if device and str(device).startswith("cuda") and not torch.cuda.is_available():
            # lm_eval's command line asks for cuda:0 unless told otherwise, even on machines without it.
            warnings.warn(f"flexoff: device {device!r} is not available here; running on the CPU", stacklevel=2)
            device = "cpu"
        seed = _seed(seed)
        dummy = _flag(dummy, "dummy")
        self.greedy_check = _flag(greedy_check, "greedy_check")
        self.auto = policy == "auto"
        self._llm_args = dict(model=str(pretrained), dummy=dummy, dtype=dtype, device=device or "auto", seed=seed,
                              tokenizer=tokenizer, gpu_mem=gpu_mem, cpu_mem=cpu_mem, offload_dir=offload_dir,
                              compress=compress, prefix_sharing=_flag(prefix_sharing, "prefix_sharing"))
        _check_llm_values({"policy": policy, **{k: v for k, v in self._llm_args.items() if k != "model"}})
        if self.auto:
            _check_auto_dtype(dtype, self._llm_args["device"])
        self._hardware = hardware
        self._planned = None  # (prompt_len, gen_len) the auto policy was planned for
        self.llm = None
        if self.auto:  # the policy waits for the requests; the model's config and tokenizer do not
            self.config, checkpoint = resolve_model(str(pretrained), dummy)
            self.tokenizer = Tokenizer.for_model(checkpoint, tokenizer)
        else:
            self.llm = self._make_llm(policy)
            self.config, self.tokenizer = self.llm.config, self.llm.tokenizer
        if self.tokenizer is None:
            self.close()
            raise FlexoffError(f"lm_eval works on text; model {pretrained!r} has no tokenizer")
        self.seed = seed
        self.max_length = self.config.max_positions
        cfg = self.config
        self.prefix_token_id = cfg.bos_token_id if cfg.bos_token_id is not None else cfg.eos_token_ids[0]

    def _make_llm(self, policy, workload=None):
        from .. import LLM

        return LLM(**self._llm_args, policy=policy, workload=workload, hardware=self._hardware)

    def _llm_for(self, prompt_len: int, gen_len: int, count: int, scored=None):
        """The LLM to run a call's requests: with policy auto, planned for the call's longest prompt
        and generation (kept while later calls fit in what it was planned for). ``scored``: a
        scoring call's (prompts, continuations), planned for the prefixes they share (a context's
        choices share it) where prefix sharing is on."""
        if self.auto and (self._planned is None or prompt_len > self._planned[0] or gen_len > self._planned[1]):
            from ..planner.cost_model import Workload
            from ..prompts import prompt_workload

            self.close()
            workload = Workload(prompt_len, max(gen_len, 1), count)
            if scored is not None and self._llm_args["prefix_sharing"]:
                prompts, continuations = scored
                workload = prompt_workload([p + c for p, c in zip(prompts, continuations)], [1] * count,
                                           self._llm_args["model"], None, keep=[len(c) + 1 for c in continuations])
            self.llm = self._make_llm("auto", workload)
            self._planned = (prompt_len, gen_len)
            if self.llm.plan is not None and self.llm.plan.message:
                warnings.warn(f"flexoff: {self.llm.plan.message}", stacklevel=3)
        return self.llm

    def close(self) -> None:
        if self.llm is not None:
            self.llm.close()

    # Tokens and chat
    def _encode(self, text: str) -> list[int]:
        ids = self.tokenizer.encode(text)
        bos = self.config.bos_token_id
        # A text that starts with the BOS (a chat template writes it) gets no second one, as lm_eval's hf model does.
        return ids[1:] if bos is not None and ids[:2] == [bos, bos] else ids

    def _without_bos(self, ids: list[int]) -> list[int]:
        bos = self.config.bos_token_id
        return ids[1:] if bos is not None and ids and ids[0] == bos else ids

    def _chat_template(self):
        template = self.tokenizer.chat_template
        if not template:
            raise FlexoffError(f"model {self._llm_args['model']!r} has no chat template (in its tokenizer_config.json "
                               "or chat_template.jinja); run without --apply_chat_template")
        return template

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tokenizer, "path", self._llm_args["model"])).replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        if chat_template is False or chat_template is None:
            return None
        template = self._chat_template()
        if isinstance(template, dict):  # named templates: the one asked for by name, else "default"
            name = chat_template if isinstance(chat_template, str) else "default"
            if name not in template:
                raise FlexoffError(f"chat template {name!r} is not among the model's: {sorted(template)}")
            return template[name]
        return template

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        self._chat_template()
        return self.tokenizer.apply_chat_template(chat_history, add_generation_prompt=add_generation_prompt,
                                                  continue_final_message=not add_generation_prompt)

    # Request types
    def _chunks(self, lengths: list[int], contexts=None) -> list[list[int]]:
        """Request indices, shortest first, in chunks of a few blocks: each chunk's blocks carry little
        padding, and the progress bar moves after each. Given ``contexts``, ordered by context length
        and then context, so that a context's choices sit together and share its prefill."""
        key = lengths.__getitem__ if contexts is None else (lambda i: (len(contexts[i]), contexts[i], lengths[i]))
        order = sorted(range(len(lengths)), key=key)
        size = 4 * (self.llm.policy.block_size if self.llm is not None else 32)
        return [order[start:start + size] for start in range(0, len(order), size)]

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        prompts, continuations = [], []
        for request in requests:
            context, continuation = request.args
            # lm_eval's convention: a context's trailing spaces belong to the continuation.
            spaces = len(context) - len(context.rstrip())
            if spaces:
                context, continuation = context[:-spaces], context[-spaces:] + continuation
            ids = self._encode(context) if context else [self.prefix_token_id]
            cont_ids = self._without_bos(self._encode(continuation))
            if len(ids) + len(cont_ids) > self.max_length:
                # Keep the continuation and as much of the context as fits, from its end.
                ids = ids[len(ids) - (self.max_length - len(cont_ids)):]
            prompts.append(ids)
            continuations.append(cont_ids)
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        if not requests:
            return []
        lengths = [len(p) + len(c) for p, c in zip(prompts, continuations)]
        # A score is one prefill pass: planned as one token generated, keeping no cache.
        llm = self._llm_for(max(lengths), 1, len(requests), (prompts, continuations))
        with tqdm(total=len(requests), desc="Running loglikelihood requests", disable=disable_tqdm) as bar:
            for chunk in self._chunks(lengths, prompts):
                for i, result in zip(chunk, self._score(llm, [prompts[i] for i in chunk],
                                                        [continuations[i] for i in chunk])):
                    results[i] = result
                    self.cache_hook.add_partial("loglikelihood", requests[i].args, result)
                bar.update(len(chunk))
        return results

    def _score(self, llm, prompts, continuations) -> list[tuple[float, bool]]:
        return [(float(sum(s.logprobs)), s.greedy and self.greedy_check) for s in llm.score(prompts, continuations)]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows = []  # per request, its (context, target) windows
        for request in requests:
            (text,) = request.args
            tokens = self._without_bos(self._encode(text))
            # A window of n inputs scores n tokens, and flexoff feeds the last one too: n + 1 positions.
            windows.append(list(map(make_disjoint_window, get_rolling_token_windows(
                tokens, self.prefix_token_id, self.max_length - 1, context_len=1))))
        totals = [0.0] * len(requests)
        spans = [max((len(c) + len(t) for c, t in w), default=0) for w in windows]
        if any(windows):
            llm = self._llm_for(max(spans), 1, sum(map(len, windows)))
        with tqdm(total=len(requests), desc="Running loglikelihood_rolling requests", disable=disable_tqdm) as bar:
            for chunk in self._chunks(spans):
                flat = [(i, w) for i in chunk for w in windows[i]]
                if flat:
                    scores = llm.score([w[0] for _, w in flat], [w[1] for _, w in flat])
                    for (i, _), score in zip(flat, scores):
                        totals[i] += float(sum(score.logprobs))
                bar.update(len(chunk))
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        prompts, params, stops = [], [], []
        for number, request in enumerate(requests):
            context, kwargs = request.args
            kwargs = dict(kwargs or {})
            until = kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            fields, sample = sampling_fields(kwargs)
            budget = min(int(fields.pop("max_new_tokens", DEFAULT_MAX_GEN_TOKS)), self.max_length - 1)
            ids = self._encode(context) if context else [self.prefix_token_id]
            if len(ids) + budget > self.max_length:
                ids = ids[len(ids) - (self.max_length - budget):]
            if sample:
                fields.setdefault("seed", self.seed + number)
            prompts.append(ids)
            stops.append(until)
            params.append(_sampling_params()(max_new_tokens=budget, stop=tuple(s for s in until if s), **fields))
        if not prompts:
            return []
        llm = self._llm_for(max(map(len, prompts)), max(p.max_new_tokens for p in params), len(prompts))
        with tqdm(total=len(requests), desc="Running generate_until requests", disable=disable_tqdm) as bar:
            outputs = llm.generate(prompts, params, on_block=lambda outs, metrics: bar.update(len(outs)))
        texts = []
        for request, out, until in zip(requests, outputs, stops):
            text = out.text or ""
            cuts = [text.find(s) for s in until if s and s in text]
            text = text[:min(cuts)] if cuts else text
            self.cache_hook.add_partial("generate_until", request.args, text)
            texts.append(text)
        return texts
