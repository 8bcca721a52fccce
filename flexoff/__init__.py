"""flexoff: high-throughput batch LLM inference on one GPU with too little memory.

The names below load on first use, so that importing a part (the planner, the layout) does not
load the runtime and its torch state.
"""

from importlib import import_module

_EXPORTS = {
    "LLM": "api", "GenerationResult": "api", "RequestOutput": "api", "ScoreOutput": "api",
    "FlexoffError": "errors", "Metrics": "runtime.metrics", "CompressionConfig": "policy", "Policy": "policy",
    "TierFractions": "policy", "SamplingParams": "runtime.sampling",
}

__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'flexoff' has no attribute {name!r}")
    value = getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
