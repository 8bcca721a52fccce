"""flexoff: high-throughput batch LLM inference on one GPU with too little memory.

The names below load on first use (PEP 562), so ``import flexoff`` (and the command line's flag
parsing) does not import torch.
"""

from __future__ import annotations

from importlib import import_module
from importlib.util import find_spec
from typing import TYPE_CHECKING

# name -> the module that defines it
_EXPORTS = {
    "LLM": ".api", "GenerationResult": ".api", "RequestOutput": ".api", "ScoreOutput": ".api",
    "CompletionOutput": ".outputs", "Logprob": ".outputs",
    "FlexoffError": ".errors", "Metrics": ".runtime.metrics",
    "CompressionConfig": ".policy", "Policy": ".policy", "TierFractions": ".policy",
    "SamplingParams": ".runtime.sampling",
}

__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"

if TYPE_CHECKING:
    from .api import LLM, GenerationResult, RequestOutput, ScoreOutput
    from .errors import FlexoffError
    from .outputs import CompletionOutput, Logprob
    from .policy import CompressionConfig, Policy, TierFractions
    from .runtime.metrics import Metrics
    from .runtime.sampling import SamplingParams


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'flexoff' has no attribute {name!r}")
    value = getattr(import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


def _register_with_lm_eval() -> None:
    """Name the ``flexoff`` model in lm-evaluation-harness's registry, so that
    ``lm_eval.simple_evaluate(model="flexoff")`` finds it after ``import flexoff``: lm_eval has no
    plugin discovery of its own. Only the model's import path is registered (lm_eval loads the
    adapter when asked for it), and only where lm_eval is installed and its registry imports."""
    if find_spec("lm_eval") is None:
        return
    try:
        from lm_eval.api.registry import model_registry
    except Exception:  # an lm_eval too old for lazy entries, or a broken install: flexoff works without it
        return
    if "flexoff" not in model_registry:
        model_registry.register("flexoff", target="flexoff.harness.lm_eval_adapter:FlexoffLM")


_register_with_lm_eval()
