"""A pipeline's split of a model between its devices: each holds a contiguous range of the model's
stages (0 the embedding, then the decoder layers, then the head)."""

from __future__ import annotations

from ..errors import ConfigError
from ..models import ModelConfig


def stage_ranges(num_layers: int, pipeline: int, counts: list[int] | tuple[int, ...] | None = None) -> tuple[range, ...]:
    """Each device's range of stage indices: ``counts`` decoder layers each, or the layers split
    evenly (the later devices take one more where they do not divide); the embedding with the
    first, the head with the last."""
    if counts is None:
        cuts = [1 + k * num_layers // pipeline for k in range(pipeline + 1)]
    else:
        check_counts(counts, num_layers, pipeline)
        cuts = [1 + sum(counts[:k]) for k in range(pipeline + 1)]
    cuts[0], cuts[-1] = 0, num_layers + 2
    return tuple(range(a, b) for a, b in zip(cuts, cuts[1:]))


def range_layers(owned: range, num_layers: int) -> range:
    """The decoder layers of a range of stage indices."""
    return range(max(owned.start, 1) - 1, min(owned.stop, num_layers + 1) - 1)


def stage_view(config: ModelConfig, layers: int) -> ModelConfig:
    """The model as a device holding ``layers`` of its decoder layers is planned: those layers, with
    the embedding and the head counted too (which the first and last devices hold)."""
    return config.replace(num_layers=layers, dense_layers=tuple(i for i in config.dense_layers if i < layers))


def check_counts(counts, num_layers: int, pipeline: int) -> None:
    """Layers per stage must be ``pipeline`` positive counts that add up to the model's layers."""
    if (len(counts) != pipeline or any(not isinstance(c, int) or isinstance(c, bool) or c < 1 for c in counts)
            or sum(counts) != num_layers):
        raise ConfigError(f"layers per pipeline stage must be {pipeline} positive counts adding up to the model's "
                          f"{num_layers} layers, got {list(counts)}")
