"""Model math: configs and one short file of pure layer functions per architecture.

A model runs as a sequence of stages: ``embed``, ``layer.0`` … ``layer.N-1``, ``head``. Each stage
has weight specs and a pure forward over a weight dict; the runtime decides where weights live.
"""

from __future__ import annotations

from types import ModuleType

from . import llama, opt
from .common import WeightSpec
from .config import (REGISTRY, ModelConfig, config_from_dir, known_model_names, model_directory, resolve_model,
                     resolve_model_config)

_ARCHITECTURES: dict[str, ModuleType] = {"opt": opt, "llama": llama}


def architecture(cfg: ModelConfig) -> ModuleType:
    """The module holding ``cfg``'s layer math (embed, layer, head, *_specs, step_context)."""
    return _ARCHITECTURES[cfg.family]


def stage_names(cfg: ModelConfig) -> list[str]:
    return ["embed", *(f"layer.{i}" for i in range(cfg.num_layers)), "head"]


def stage_specs(cfg: ModelConfig, stage: str) -> list[WeightSpec]:
    arch = architecture(cfg)
    if stage == "embed":
        return arch.embed_specs(cfg)
    if stage == "head":
        return arch.head_specs(cfg)
    return arch.layer_specs(cfg, int(stage.split(".", 1)[1]))


__all__ = [
    "REGISTRY", "ModelConfig", "WeightSpec", "architecture", "config_from_dir", "known_model_names",
    "model_directory", "resolve_model", "resolve_model_config", "stage_names", "stage_specs",
]
