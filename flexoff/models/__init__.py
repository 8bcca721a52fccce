"""Model math: configs and one short file of pure layer functions per architecture.

A model runs as a sequence of stages: ``embed``, ``layer.0`` … ``layer.N-1``, ``head``. Each stage
has weight specs and a pure forward over a weight dict; the runtime decides where weights live.
"""

from __future__ import annotations

import dataclasses

from dataclasses import dataclass
from typing import Any, Protocol, cast

import torch

from . import llama, opt
from .common import Attend, WeightSpec
from .config import ModelConfig
from .gguf_config import gguf_path
from .hf_config import config_from_dir
from .moe import ExpertFetch
from .registry import REGISTRY, known_model_names, model_directory, resolve_model, resolve_model_config

class Architecture(Protocol):
    """A model family's math, as the runtime calls it: one module of pure functions (``opt``,
    ``llama``). ``w`` is a stage's weights by spec name; ``context`` is what ``step_context`` made
    for this step (positions' rotary tables, or None)."""

    def embed_specs(self, cfg: ModelConfig) -> list[WeightSpec]: ...

    def layer_specs(self, cfg: ModelConfig, index: int) -> list[WeightSpec]: ...

    def head_specs(self, cfg: ModelConfig) -> list[WeightSpec]: ...

    def step_context(self, cfg: ModelConfig, positions: torch.Tensor, dtype: torch.dtype) -> Any: ...

    def embed(self, cfg: ModelConfig, w: dict, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor: ...

    # ``fetch``: where a sparse layer's experts load once it has routed (route-first loading).
    def layer(self, cfg: ModelConfig, w: dict, hidden: torch.Tensor, context: Any, attend: Attend,
              fetch: ExpertFetch | None = None) -> torch.Tensor: ...

    # A layer in two halves, for attention that runs elsewhere (on the CPU) between them.
    def attention_inputs(self, cfg: ModelConfig, w: dict, hidden: torch.Tensor, context: Any
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...

    def after_attention(self, cfg: ModelConfig, w: dict, hidden: torch.Tensor, attn: torch.Tensor,
                        fetch: ExpertFetch | None = None) -> torch.Tensor: ...

    def head(self, cfg: ModelConfig, w: dict, hidden: torch.Tensor) -> torch.Tensor: ...


# A module satisfies the protocol by its functions; tests check that both do.
_ARCHITECTURES: dict[str, Architecture] = {"opt": cast(Architecture, opt), "llama": cast(Architecture, llama)}


def architecture(cfg: ModelConfig) -> Architecture:
    """The module holding ``cfg``'s layer math."""
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
    if stage.is_layer:
        return arch.layer_specs(cfg, stage.index)
    specs = arch.embed_specs(cfg) if stage.kind == "embed" else arch.head_specs(cfg)
    if cfg.stored_compression is not None:
        # A checkpoint stores its decoder layers' matrices in the format; its embedding and head
        # are often of another (SmolLM2's GGUF: Q8_0 beside Q4_1 layers), which the format would
        # quantize again. They stay exact, in the compute dtype.
        specs = [dataclasses.replace(spec, quantizable=False) for spec in specs]
    return specs


__all__ = [
    "REGISTRY", "Architecture", "ExpertFetch", "ModelConfig", "WeightSpec", "architecture", "config_from_dir", "gguf_path",
    "known_model_names",    "model_directory", "resolve_model", "resolve_model_config", "Stage", "stage_specs", "stages",
]
