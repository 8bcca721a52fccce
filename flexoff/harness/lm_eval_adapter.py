"""lm-evaluation-harness model ``flexoff``: evaluate any flexoff model with ``lm_eval`` tasks.

lm_eval finds models in its registry, and this module registers ``flexoff`` when imported.
lm_eval has no plugin discovery of its own, so run its command line through flexoff's::

    python -m flexoff.commands.lm_eval --model flexoff \\
        --model_args pretrained=/models/opt-30b,policy=opt30b.json --tasks hellaswag

or, from Python, ``import flexoff.harness.lm_eval_adapter`` before ``lm_eval.simple_evaluate(
model="flexoff", model_args="pretrained=DIR")``. Needs ``pip install lm-eval``.

``--model_args``: ``pretrained`` (a checkpoint directory, or a registry name with ``dummy=True``),
``policy`` (a policy JSON file), ``dtype``, ``device``, ``seed``, ``tokenizer``, and
``greedy_check`` (default true: loglikelihood's is-greedy flag costs one greedy generation of
the continuation's length; false reports it as false and skips that work). lm_eval's
``batch_size`` is accepted and ignored: the policy sets the batch sizes.

Request types: ``loglikelihood`` (scored in one prefill pass by ``LLM.score``),
``loglikelihood_rolling`` (disjoint windows of the model's context, each token predicted once)
and ``generate_until`` (``until``, ``max_gen_toks``, ``do_sample``, ``temperature``, ``top_k``,
``top_p``). Requests are handed to flexoff all at once, which sorts them into blocks by length.
"""

from __future__ import annotations

import warnings

from ..checks import MAX_SEED, is_int
from ..errors import ConfigError, FlexoffError

try:
    import lm_eval.models  # noqa: F401  (register lm_eval's own models before ours; see get_model)
    from lm_eval.api.model import LM
    from lm_eval.api.registry import register_model
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
except ImportError:  # pragma: no cover - exercised only without the optional package
    raise FlexoffError("the lm_eval adapter needs lm-evaluation-harness: pip install 'flexoff[lm-eval]'") from None

_IGNORED_ARGS = ("batch_size", "max_batch_size")


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


@register_model("flexoff")
class FlexoffLM(LM):
    def __init__(self, pretrained: str, policy: str | None = None, dummy=False, dtype: str = "auto",
                 device: str | None = None, seed: int = 0, tokenizer: str | None = None, greedy_check=True,
                 **kwargs):
        super().__init__()
        unknown = sorted(set(kwargs) - set(_IGNORED_ARGS))
        if unknown:
            raise FlexoffError(f"unknown flexoff model_args {unknown}; known: pretrained, policy, dummy, dtype, "
                               "device, seed, tokenizer, greedy_check")
        import torch

        from .. import LLM

        if device and str(device).startswith("cuda") and not torch.cuda.is_available():
            # lm_eval's command line asks for cuda:0 unless told otherwise, even on machines without it.
            warnings.warn(f"flexoff: device {device!r} is not available here; running on the CPU", stacklevel=2)
            device = "cpu"
        seed = _seed(seed)
        self.greedy_check = _flag(greedy_check, "greedy_check")
        self.llm = LLM(str(pretrained), dummy=_flag(dummy, "dummy"), policy=policy, dtype=dtype,
                       device=device or "auto", seed=seed, tokenizer=tokenizer)
        if self.llm.tokenizer is None:
            self.llm.close()
            raise FlexoffError(f"lm_eval works on text; model {pretrained!r} has no tokenizer")
        self.seed = seed
        self.max_length = self.llm.config.max_positions
        cfg = self.llm.config
        self.prefix_token_id = cfg.bos_token_id if cfg.bos_token_id is not None else cfg.eos_token_ids[0]

    # Tokens
    def _encode(self, text: str) -> list[int]:
        return self.llm.tokenizer.encode(text)

    def _without_bos(self, ids: list[int]) -> list[int]:
        bos = self.llm.config.bos_token_id
        return ids[1:] if bos is not None and ids and ids[0] == bos else ids

    # Request types
    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        from .. import SamplingParams

        prompts, continuations = [], []
        for request in requests:
            context, continuation = request.args
            # lm_eval's convention: a context's trailing spaces belong to the continuation.
            spaces = len(context) - len(context.rstrip())
            if spaces:
                context, continuation = context[:-spaces], context[-spaces:] + continuation
            prompt = context if context else [self.prefix_token_id]
            cont_ids = self._without_bos(self._encode(continuation))
            prompt_len = len(self._encode(prompt)) if isinstance(prompt, str) else len(prompt)
            if prompt_len + len(cont_ids) > self.max_length:
                # Keep the continuation and as much of the context as fits, from its end.
                ids = self._encode(context) if context else prompt
                prompt, continuation = ids[len(ids) - (self.max_length - len(cont_ids)):], cont_ids
            prompts.append(prompt)
            continuations.append(continuation)
        scores = self.llm.score(prompts, continuations)
        greedy = [False] * len(scores)
        if self.greedy_check:
            lengths = [len(s.token_ids) for s in scores]
            params = [SamplingParams(max_new_tokens=max(n, 1), ignore_eos=True) for n in lengths]
            outputs = self.llm.generate(prompts, params)
            greedy = [out.token_ids[:n] == s.token_ids for out, s, n in zip(outputs, scores, lengths)]
        results = [(float(sum(s.logprobs)), bool(g)) for s, g in zip(scores, greedy)]
        for request, result in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood", request.args, result)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owners = [], []
        for number, request in enumerate(requests):
            (text,) = request.args
            tokens = self._without_bos(self._encode(text))
            # A window of n inputs scores n tokens, and flexoff feeds the last one too: n + 1 positions.
            for context, target in map(make_disjoint_window, get_rolling_token_windows(
                    tokens, self.prefix_token_id, self.max_length - 1, context_len=1)):
                windows.append((context, target))
                owners.append(number)
        totals = [0.0] * len(requests)
        if windows:
            scores = self.llm.score([w[0] for w in windows], [w[1] for w in windows])
            for owner, score in zip(owners, scores):
                totals[owner] += float(sum(score.logprobs))
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        from .. import SamplingParams

        prompts, params, stops = [], [], []
        for number, request in enumerate(requests):
            context, kwargs = request.args
            kwargs = dict(kwargs or {})
            until = kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            budget = min(int(kwargs.pop("max_gen_toks", 256)), self.max_length - 1)
            sample = _flag(kwargs.pop("do_sample", False), "do_sample")
            temperature = float(kwargs.pop("temperature", 1.0 if sample else 0.0))
            if not sample:
                temperature = 0.0
            ids = self._encode(context) if context else [self.prefix_token_id]
            if len(ids) + budget > self.max_length:
                ids = ids[len(ids) - (self.max_length - budget):]
            prompts.append(ids)
            stops.append(until)
            params.append(SamplingParams(
                max_new_tokens=budget, temperature=temperature, top_k=int(kwargs.pop("top_k", 0) or 0),
                top_p=float(kwargs.pop("top_p", 1.0) or 1.0), stop=tuple(s for s in until if s),
                seed=self.seed + number if temperature > 0 else None))
        outputs = self.llm.generate(prompts, params) if prompts else []
        texts = []
        for request, out, until in zip(requests, outputs, stops):
            text = out.text or ""
            cuts = [text.find(s) for s in until if s and s in text]
            text = text[:min(cuts)] if cuts else text
            self.cache_hook.add_partial("generate_until", request.args, text)
            texts.append(text)
        return texts

