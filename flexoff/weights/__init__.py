"""Weight sources: where a stage's tensors come from (seeded dummy values, a local checkpoint, or a
GGUF file)."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from pathlib import Path

from ..models import WeightSpec
from ..models.gguf_config import gguf_path
from .checkpoint import CheckpointWeights
from .dummy import DummyWeights
from .gguf import GGUFWeights


@runtime_checkable
class WeightSource(Protocol):
    """What the runtime reads weights through, one tensor at a time."""

    def check(self, stages: dict[str, list[WeightSpec]]) -> None:
        """Refuse, before anything is loaded, a source whose tensors do not match the stages' specs."""

    def load_tensor(self, stage: str, spec: WeightSpec, device: torch.device, dtype: torch.dtype,
                    out: torch.Tensor | None = None) -> torch.Tensor:
        """The tensor on ``device``, written into ``out`` (e.g. pinned memory) when given."""

    def load_compressed(self, stage: str, spec: WeightSpec, compression, device: torch.device,
                        meta_dtype: torch.dtype):
        """The matrix as the source stores it, a ``CompressedTensor`` in ``compression``'s format
        with its scales and minimums in ``meta_dtype``, or None where it is not stored so (the
        store then quantizes ``load_tensor``'s values). Sources of floating-point weights return None."""

    def close(self) -> None:
        """Let go of open files and caches."""


def checkpoint_weights(path: str | Path) -> WeightSource:
    """The source of a model path as resolve_model gives it: a GGUF file (or the one a directory
    holds), else a Hugging Face checkpoint directory."""
    gguf = gguf_path(path)
    return GGUFWeights(gguf) if gguf is not None else CheckpointWeights(path)


__all__ = ["CheckpointWeights", "DummyWeights", "GGUFWeights", "WeightSource", "checkpoint_weights"]
