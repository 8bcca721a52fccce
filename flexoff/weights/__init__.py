"""Weight sources: where a stage's tensors come from (seeded dummy values or a local checkpoint)."""

from .checkpoint import CheckpointWeights
from .dummy import DummyWeights

__all__ = ["CheckpointWeights", "DummyWeights"]
