"""Model math: configs and one short file of pure layer functions per architecture.

A model runs as a sequence of stages: ``embed``, ``layer.0`` … ``layer.N-1``, ``head``. Each stage
has weight specs and a pure forward over a weight dict; the runtime decides where weights live.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

from . import llama, opt
from .common import WeightSpec
from .config import (REGISTRY, ModelConfig, config_from_dir, known_model_names, model_directory, resolve_model,
                     resolve_model_config)

_ARCHITECTURES: dict[str, ModuleType] = {"opt": opt, "llama": llama}


def architecture(cfg: ModelConfig) -> ModuleType:
    """The module holding ``cfg``'s layer math (embed, layer, head, *_specs, step_context)."""
    return _ARCHITECTURES[cfg.family]


@dataclass(frozen=True)
class Stage:
    """One step of the model's forward: ``kind`` "embed", "layer" or "head"; ``index`` the layer's
    number (0 for the others). ``name`` ("embed", "layer.3", "head") names its offload files and
    seeds its dummy weights."""

    kind: str
    index: int = 0

    @property
    def name(self) -> str:
        return f"layer.{self.index}" if self.kind == "layer" else self.kind

    @property
    def is_layer(self) -> bool:
        return self.kind == "layer"

    def __str__(self) -> str:
        return self.name


def stages(cfg: ModelConfig) -> list[Stage]:
    """The model's stages in forward order."""
    return [Stage("embed"), *(Stage("layer", i) for i in range(cfg.num_layers)), Stage("head")]


def stage_specs(cfg: ModelConfig, stage: Stage) -> list[WeightSpec]:
    arch = architecture(cfg)
    if stage.kind == "embed":
        return arch.embed_specs(cfg)
    if stage.kind == "head":
        return arch.head_specs(cfg)
    return arch.layer_specs(cfg, stage.index)


__all__ = [
    "REGISTRY", "ModelConfig", "WeightSpec", "architecture", "config_from_dir", "known_model_names",
    "model_directory", "resolve_model", "resolve_model_config", "Stage", "stage_specs", "stages",
]
