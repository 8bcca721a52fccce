"""Seeded random weights, made per stage on the target device, for benchmarks without a download."""

from __future__ import annotations

import zlib

import torch

from ..models import WeightSpec

# A prime pool length keeps rows of large matrices from repeating in step with their width.
_POOL_SIZE = 1_048_573
_INIT = {"normal": (0.0, 0.02), "norm": (1.0, 0.1), "bias": (0.0, 0.02)}


class DummyWeights:
    """Every tensor is a seeded window into a random pool, so OPT-30B's 60 GB appear at copy speed.

    Values differ between tensors and layers (never all-ones, which hides indexing bugs), and the
    same seed always gives the same weights.
    """

    def __init__(self, seed: int = 0):
        self.seed = seed
        self._pools: dict[tuple, torch.Tensor] = {}

    def _pool(self, init: str, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        key = (init, str(device), dtype)
        if key not in self._pools:
            generator = torch.Generator().manual_seed(self.seed)
            mean, std = _INIT[init]
            base = torch.randn(2 * _POOL_SIZE, generator=generator) * std + mean
            self._pools[key] = base.to(device=device, dtype=dtype)
        return self._pools[key]

    def make(self, stage: str, spec: WeightSpec, device: torch.device, dtype: torch.dtype,
             out: torch.Tensor | None = None) -> torch.Tensor:
        pool = self._pool(spec.init, device, dtype)
        offset = zlib.crc32(f"{self.seed}:{stage}:{spec.name}".encode()) % _POOL_SIZE
        window = pool[offset:offset + _POOL_SIZE]
        if out is None:
            out = torch.empty(spec.shape, device=device, dtype=dtype)
        flat = out.view(-1)
        for start in range(0, flat.numel(), _POOL_SIZE):
            length = min(_POOL_SIZE, flat.numel() - start)
            flat[start:start + length].copy_(window[:length])
        return out

    def load_tensor(self, stage: str, spec: WeightSpec, device: torch.device, dtype: torch.dtype,
                    out: torch.Tensor | None = None) -> torch.Tensor:
        """The tensor on ``device``, written into ``out`` (e.g. pinned memory) when given."""
        return self.make(stage, spec, out.device if out is not None else device, dtype, out)

    def load_compressed(self, stage: str, spec: WeightSpec, compression, device: torch.device,
                        meta_dtype: torch.dtype) -> None:
        """Floating-point weights: none is stored compressed."""
        return None

    def check(self, stages: dict[str, list[WeightSpec]]) -> None:
        """Dummy weights always match their specs."""

    def close(self) -> None:
        self._pools.clear()
