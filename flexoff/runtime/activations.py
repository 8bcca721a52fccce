"""Hidden states between stages, for one GPU batch, split by rows across gpu, cpu and disk."""

from __future__ import annotations

import torch

from ..layout import Piece, split_rows
from ..policy import TierFractions
from .tiers import DiskTier, HostMemory, read_pinned


class BatchActivations:
    """Holds a batch's hidden state (batch, seq, hidden) between stages on the policy's tiers.

    Rows on the GPU stay in place; the others are copied out after a stage and back before the
    next, which lowers the GPU's peak during long prefills at the price of the copies.

    Both copies of host rows are enqueued on the current stream without waiting: the host would
    otherwise stall until the GPU drained its queue, and no other batch's work could be enqueued
    meanwhile. They stay ordered by that stream, and the read back is a kernel, so it does not wait
    behind the weight loads that the copy engine serves first (see ``read_pinned``). Disk rows must
    reach the host before the file write, so their copy out waits.
    """

    def __init__(self, rows: int, max_numel_per_row: int, fractions: TierFractions, device: torch.device,
                 dtype: torch.dtype, host: HostMemory, disk: DiskTier | None, name: str):
        self.pieces = split_rows(rows, fractions)
        self.device = device
        self.offloaded = any(p.tier != "gpu" for p in self.pieces)
        self.host: dict[str, torch.Tensor] = {}
        self.region = None
        for piece in self.pieces:
            numel = (piece.stop - piece.start) * max_numel_per_row
            if piece.tier != "gpu":
                self.host[piece.tier] = host.empty((numel,), dtype)
            if piece.tier == "disk":
                self.region = disk.allocate(f"{name}.hidden", numel * dtype.itemsize)
        self._hidden: torch.Tensor | None = None
        self._shape = None

    def _pieces(self, rows: int) -> list:
        """The pieces of a hidden state of ``rows`` rows: a shared prefill holds fewer rows than the
        batch, and they take the first pieces' places (each piece then holds no more than its buffer)."""
        return [Piece(p.tier, p.start, min(p.stop, rows)) for p in self.pieces if p.start < rows]

    def put(self, hidden: torch.Tensor) -> None:
        """Keep ``hidden`` (batch, seq, hidden) after a stage, sending off-GPU rows to their tier."""
        if not self.offloaded:
            self._hidden = hidden
            return
        self._shape = hidden.shape
        pieces = self._pieces(hidden.shape[0])
        # A copy of the GPU rows, not a view: a view would keep every row's storage on the GPU.
        self._hidden = hidden[pieces[0].start:pieces[0].stop].clone() if pieces[0].tier == "gpu" else None
        for piece in pieces:
            if piece.tier == "gpu":
                continue
            rows = hidden[piece.start:piece.stop]
            host = self.host[piece.tier][:rows.numel()].view(rows.shape)
            host.copy_(rows, non_blocking=piece.tier == "cpu")
            if piece.tier == "disk":
                self.region.write(host)

    def get(self) -> torch.Tensor:
        """The hidden state on the compute device, rows reassembled in order."""
        if not self.offloaded:
            return self._hidden
        parts = []
        for piece in self._pieces(self._shape[0]):
            if piece.tier == "gpu":
                parts.append(self._hidden)
                continue
            shape = (piece.stop - piece.start, *self._shape[1:])
            host = self.host[piece.tier][:shape[0] * self._shape[1] * self._shape[2]].view(shape)
            if piece.tier == "disk":
                self.region.read_into(host)
            rows = torch.empty(shape, device=self.device, dtype=host.dtype)
            read_pinned(rows, host)
            parts.append(rows)
        return torch.cat(parts) if len(parts) > 1 else parts[0]
