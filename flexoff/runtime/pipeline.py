"""A pipeline stage's links to its peers. Each device of a pipeline runs a contiguous range of the
model's stages (``schedule.BlockShape.first_stage``/``stop_stage``): the device with the embedding
is the first, the one with the head the last. Between neighbours go each GPU batch's hidden state
(or, once the batch has finished, a mark saying so); from the last to the first go the tokens each
head step sampled, and at the end of a block the sequences' results. Messages are point to point
over torch.distributed and tagged by GPU batch, so that each batch's stream stays in order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .batch import Sequence

ALIVE, FINISHED = 1, 0


@dataclass(frozen=True)
class PipelinePlace:
    """Where this device sits: its index in the pipeline, every device's range of stage indices
    (in pipeline order, together covering the model's stages) and their ranks in the process group."""

    index: int
    ranges: tuple[range, ...]
    ranks: tuple[int, ...] | None = None  # None: 0, 1, ... in pipeline order

    def __post_init__(self):
        edges = [r.start for r in self.ranges] + [self.ranges[-1].stop]
        if edges[0] != 0 or any(r.stop != s.start or len(r) == 0 for r, s in zip(self.ranges, self.ranges[1:])):
            raise ValueError(f"the pipeline's stage ranges must follow one another from 0: {self.ranges}")

    @property
    def owned(self) -> range:
        return self.ranges[self.index]

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == len(self.ranges) - 1

    def rank(self, index: int) -> int:
        return index if self.ranks is None else self.ranks[index]


class PipelineLink:
    """Sends and receives one device's messages. Tensors cross as they are on gloo's CPU; others
    (NCCL) send them from the device."""

    def __init__(self, place: PipelinePlace, device: torch.device, dtype: torch.dtype, group=None):
        self.place = place
        self.device = device
        self.dtype = dtype
        self.group = group
        self._host = dist.get_backend(group) == "gloo"
        # Sends in flight, each with its tensor: a device never waits for its peer to receive (in
        # rotation the last device's tokens go to the first, so waiting could close a circle).
        self._sending: list[tuple[object, torch.Tensor]] = []

    def _wire(self, tensor: torch.Tensor) -> torch.Tensor:
        """Where a message crosses: host memory for gloo, the device for NCCL (marks and tokens
        are made on the host)."""
        return tensor.cpu() if self._host else tensor.to(self.device, non_blocking=True)

    def _send(self, tensor: torch.Tensor, index: int, tag: int) -> None:
        self._sending = [(work, t) for work, t in self._sending if not work.is_completed()]
        tensor = self._wire(tensor.contiguous())
        self._sending.append((dist.isend(tensor, self.place.rank(index), group=self.group, tag=tag), tensor))

    def flush(self) -> None:
        """Wait until every message sent has been received."""
        for work, _ in self._sending:
            work.wait()
        self._sending.clear()

    def _recv(self, shape, dtype, index: int, tag: int) -> torch.Tensor:
        out = torch.empty(shape, dtype=dtype, device="cpu" if self._host else self.device)
        dist.recv(out, self.place.rank(index), group=self.group, tag=tag)
        return out.to(self.device)

    # Hidden states, between neighbours
    def forwards_marks(self) -> bool:
        """Whether a finished batch's mark goes on to the next device: not to the last, whose head
        decided it."""
        return self.place.index + 1 < len(self.place.ranges) - 1

    def send_hidden(self, batch: int, hidden: torch.Tensor | None) -> None:
        """The batch's hidden state to the next device; None: the batch has finished."""
        self._send(torch.tensor([FINISHED if hidden is None else ALIVE]), self.place.index + 1, batch)
        if hidden is not None:
            self._send(hidden, self.place.index + 1, batch)

    def recv_hidden(self, batch: int, shape: tuple[int, ...]) -> torch.Tensor | None:
        """The batch's hidden state from the previous device, or None if the batch has finished."""
        if self._recv((1,), torch.int64, self.place.index - 1, batch).item() == FINISHED:
            return None
        return self._recv(shape, self.dtype, self.place.index - 1, batch)

    # Tokens and results, from the last device to the first
    def send_tokens(self, batch: int, seqs: list[Sequence], pad: int) -> None:
        tokens = [s.token_ids[-1] if s.token_ids and not s.error else pad for s in seqs]
        finished = [int(s.finished) for s in seqs]
        self._send(torch.tensor([tokens, finished], dtype=torch.int64), 0, batch)

    def recv_tokens(self, batch: int, seqs: list[Sequence]) -> int:
        """Append each sequence's new token, and mark those the head finished (their results come
        with ``recv_results``); returns how many tokens came."""
        tokens, finished = self._recv((2, len(seqs)), torch.int64, len(self.place.ranges) - 1, batch).tolist()
        came = 0
        for seq, token, done in zip(seqs, tokens, finished):
            if seq.finished:
                continue
            seq.token_ids.append(token)
            came += 1
            if done:
                seq.finish_reason = "length"  # a placeholder until the results arrive
        return came

    def send_results(self, seqs: list[Sequence], timing: dict) -> None:
        """The sequences' results, with ``timing``: what only the head's device measured (its
        prefill and decode times), for the block's metrics."""
        dist.send_object_list([[s.outcome() for s in seqs], timing], self.place.rank(0), group=self.group)

    def recv_results(self, seqs: list[Sequence]) -> dict:
        """Fills the sequences with their results; returns the head's timing."""
        received = [None, None]
        dist.recv_object_list(received, self.place.rank(len(self.place.ranges) - 1), group=self.group)
        for seq, outcome in zip(seqs, received[0], strict=True):
            seq.take_outcome(outcome)
        return received[1]
