"""A prefill's real positions packed together, so that its matmuls skip the rows' left padding.

A GPU batch pads every row's prompt on the left to its longest (its own part, where rows share a
prefix). The projections and the MLP are per position, so they run as well on the real positions
alone, laid end to end as one row; only attention needs the rows apart, and it gets them back,
padded, for its call. A batch of few-shot questions behind shared examples pads its own parts by a
third or more, and its prefill is compute-bound, so that much of its time goes.
"""

from __future__ import annotations

import torch

# Pack where at least this share of a prefill's positions is padding. The gather and the scatter
# around a layer move its hidden state twice, about 1% of the layer's matmuls at LLM widths.
MIN_PADDING_SHARE = 1 / 16


class PackedPrefill:
    """The real positions of ``lengths`` rows, each left-padded to ``width``: rows (rows, width, ...)
    to and from one packed row (1, positions, ...)."""

    def __init__(self, lengths: list[int], width: int, device: torch.device):
        self.rows, self.width = len(lengths), width
        # Built on the host from the lengths: a nonzero over the device's mask would wait for it.
        real = torch.arange(width)[None, :] >= width - torch.tensor(lengths)[:, None]
        self.index = real.flatten().nonzero().squeeze(1).to(device)

    @staticmethod
    def pays(lengths: list[int], width: int) -> bool:
        """Whether packing ``lengths`` rows of ``width`` positions saves enough to pay for itself."""
        padded = len(lengths) * width
        return padded > 0 and padded - sum(lengths) >= MIN_PADDING_SHARE * padded

    @classmethod
    def where_it_pays(cls, lengths: list[int], width: int, device: torch.device) -> "PackedPrefill | None":
        return cls(lengths, width, device) if cls.pays(lengths, width) else None

    def layer(self, arch, cfg, weights, owner, attend) -> torch.Tensor:
        """One prefill layer of ``owner.hidden`` (its padded rows, dropped once packed) over the real
        positions, ``owner.context`` being the step context of those positions; attention over the
        rows apart. Returns the layer's output, padded. Each tensor is dropped once its other form
        exists, so that no moment holds more than the padded layer did. ``weights`` is also where a
        sparse layer's experts load once routed."""
        hidden = self.pack(owner.hidden)
        owner.hidden = None
        q, k, v = arch.attention_inputs(cfg, weights, hidden, owner.context)
        q = self.unpack_heads(q)
        k = self.unpack_heads(k)
        v = self.unpack_heads(v)
        attn = attend(q, k, v)
        del q, k, v
        attn = self.pack_heads(attn)
        out = arch.after_attention(cfg, weights, hidden, attn, weights)
        del hidden, attn
        return self.unpack(out)

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """(rows, width, *rest) -> (1, positions, *rest): the real positions, row after row."""
        flat = x.reshape(self.rows * self.width, *x.shape[2:])
        return flat.index_select(0, self.index).unsqueeze(0)

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """(1, positions, *rest) -> (rows, width, *rest), zeros at the padding. x may be a strided
        view (attention's layout transposed): it is read as it lies, not copied first."""
        rest = x.shape[2:]
        out = x.new_zeros((self.rows * self.width, *rest))
        out.index_copy_(0, self.index, x[0])
        return out.view(self.rows, self.width, *rest)

    def unpack_heads(self, x: torch.Tensor) -> torch.Tensor:
        """Attention's layout: (1, heads, positions, head_dim) -> (rows, heads, width, head_dim)."""
        return self.unpack(x.transpose(1, 2)).transpose(1, 2)

    def pack_heads(self, x: torch.Tensor) -> torch.Tensor:
        """(rows, heads, width, head_dim) -> (1, heads, positions, head_dim), stored position by
        position, so that the layer's reshape of it to (1, positions, heads * head_dim) is a view."""
        return self.pack(x.transpose(1, 2)).transpose(1, 2)
