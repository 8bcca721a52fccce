"""Sequences in flight and the GPU batches that carry them through the stages."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..models import ModelConfig, Stage, architecture
from ..models.common import attention_mask
from .activations import BatchActivations
from .kv import BatchKV
from .sampling import SamplingParams, SequenceSampler


@dataclass
class Sequence:
    """One prompt in flight: its inputs, what it has produced, and why it stopped."""

    index: int
    prompt_ids: list[int]
    params: SamplingParams
    sampler: SequenceSampler
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None  # why it failed (finish_reason "error"); its tokens are then dropped

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def fail(self, error: str) -> None:
        self.finish_reason, self.error = "error", error
        self.token_ids.clear()
        self.logprobs.clear()


class GpuBatch:
    """One GPU batch of a block: left-padded inputs, its cache and activations, and step state.

    The cache has a slot per prompt position (padding included) and per generated token.

    With CPU attention, a decode step's layer is left *pending* half way: attention runs on the
    host worker while the engine enqueues other batches' GPU work, and ``resolve`` enqueues the
    rest of the layer once something needs this batch's hidden state.
    """

    def __init__(self, cfg: ModelConfig, seqs: list[Sequence], device: torch.device, dtype: torch.dtype,
                 extra_slots: int, make_kv, make_activations):
        self.cfg = cfg
        self.seqs = seqs
        self.device = device
        self.dtype = dtype
        self.prompt_len = max(len(s.prompt_ids) for s in seqs)
        self.slots = self.prompt_len + extra_slots
        pad = self.pad = cfg.pad_token_id if cfg.pad_token_id is not None else 0
        rows = [[pad] * (self.prompt_len - len(s.prompt_ids)) + s.prompt_ids for s in seqs]
        self.prompt_ids = torch.tensor(rows, device=device)  # (batch, prompt_len)
        self.lengths = torch.tensor([len(s.prompt_ids) for s in seqs], device=device)
        slot = torch.arange(self.slots, device=device)
        # (batch, slots): False on left padding; every generated slot is real.
        self.valid = slot[None, :] >= (self.prompt_len - self.lengths)[:, None]
        self.kv: BatchKV = make_kv(len(seqs), self.slots)
        self.activations: BatchActivations = make_activations(len(seqs), self.prompt_len)
        self.hidden: torch.Tensor | None = None
        self.active = True
        self.pending: tuple[Stage, Callable[[], torch.Tensor]] | None = None  # (stage, finish) of a half-run layer
        self._store_on_resolve = False

    def slot_start(self, token: int) -> int:
        """First cache slot written at ``token`` (0 is the prefill)."""
        return 0 if token == 0 else self.prompt_len + token - 1

    def begin_token(self, token: int) -> None:
        """Set the token's input ids, positions, slot range and attention mask."""
        if token == 0:
            self.input_ids = self.prompt_ids
            self.positions = (torch.cumsum(self.valid[:, :self.prompt_len].long(), dim=1) - 1).clamp(min=0)
        else:
            # A failed sequence has no tokens; its row, isolated from the others, is fed padding.
            last = [s.token_ids[-1] if s.token_ids else self.pad for s in self.seqs]
            self.input_ids = torch.tensor(last, device=self.device)[:, None]
            self.positions = (self.lengths + token - 1)[:, None]
        self.start = self.slot_start(token)
        self.mask = attention_mask(self.valid, self.start, self.input_ids.shape[1])
        self.context = architecture(self.cfg).step_context(self.cfg, self.positions, self.dtype)

    def run_stage(self, stage: Stage, weights: dict) -> None:
        """Compute one stage for this batch; the head is left to the caller (it samples or scores)."""
        arch = architecture(self.cfg)
        if stage.kind == "embed":
            self.hidden = arch.embed(self.cfg, weights, self.input_ids, self.positions)
        elif stage.is_layer:
            layer = stage.index
            if not self.kv.attends_on_cpu(self.start):
                attend = self.kv.attender(layer, self.start, self.mask)
                self.hidden = arch.layer(self.cfg, weights, self.hidden, self.context, attend)
                return
            hidden, self.hidden = self.hidden, None
            q, k, v = arch.attention_inputs(self.cfg, weights, hidden, self.context)
            attended = self.kv.attend_later(layer, self.start, self.mask, q, k, v)
            self.pending = (stage, lambda: arch.after_attention(self.cfg, weights, hidden, attended()))

    def resolve(self) -> Stage | None:
        """Finish a pending layer (waiting for its CPU attention); returns its stage, or None if none was pending."""
        if self.pending is None:
            return None
        stage, finish = self.pending
        self.pending = None
        self.hidden = finish()
        if self._store_on_resolve:
            self._store_on_resolve = False
            self.store_activation()
        return stage

    def store_activation(self) -> None:
        """Send the hidden state to its tiers. A pending layer's is sent once it resolves: waiting
        for its CPU attention here would keep the next batch's GPU work from being enqueued while
        that attention runs."""
        if self.pending is not None:
            self._store_on_resolve = True
            return
        self.activations.put(self.hidden)
        self.hidden = None

    def load_activation(self) -> None:
        """Bring the hidden state back to the compute device; the caller has resolved the batch."""
        self.hidden = self.activations.get()
