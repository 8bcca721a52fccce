"""Weights from a GGUF file (llama.cpp's format), read through a memory map one tensor at a time.

Each spec's Hugging Face key is mapped to llama.cpp's tensor name (``model.layers.3.self_attn.q_proj
.weight`` is ``blk.3.attn_q.weight``). llama.cpp's converter permutes the rows of a Llama model's
q and k for its rotary layout; the rows are put back as transformers' GGUF loader puts them, a row
gather applied alike to values and to a compressed tensor's codes, scales and minimums.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from ..compression import CompressedTensor
from ..errors import CheckpointError, UnsupportedModelError
from ..gguf_format import INTEGER_TYPES, TensorInfo
from ..models import WeightSpec
from ..models.gguf_config import read_gguf
from .gguf_blocks import AS_COMPRESSED, BLOCK, NATIVE, compressed_rows, decode_rows, gguf_package

_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "lm_head.weight": "output.weight",
           "model.norm.weight": "output_norm.weight"}
_LAYER = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias", "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
}
_LAYER_KEY = re.compile(r"model\.layers\.(\d+)\.(.+)")
# What each dimension of a tensor is made of, by the name's last part (see GGUFWeights._meanings).
_DIMS = {
    "token_embd.weight": ("vocab", "hidden"), "output.weight": ("vocab", "hidden"), "attn_q.weight": ("q", "hidden"),
    "attn_k.weight": ("kv", "hidden"), "attn_v.weight": ("kv", "hidden"), "attn_output.weight": ("hidden", "q"),
    "ffn_gate.weight": ("ffn", "hidden"), "ffn_up.weight": ("ffn", "hidden"), "ffn_down.weight": ("hidden", "ffn"),
    "attn_q.bias": ("q",), "attn_k.bias": ("kv",), "attn_v.bias": ("kv",), "attn_q_norm.weight": ("head",),
    "attn_k_norm.weight": ("head",),
}
# fp32 values decoded at a time, whatever the tensor's size.
_CHUNK_ELEMENTS = 1 << 20


def gguf_name(key: str) -> str | None:
    """llama.cpp's name for a Hugging Face checkpoint key; None where it has none."""
    if key in _GLOBAL:
        return _GLOBAL[key]
    found = _LAYER_KEY.fullmatch(key)
    if found is None or found[2] not in _LAYER:
        return None
    return f"blk.{found[1]}.{_LAYER[found[2]]}"


def unpermute_order(rows: int, heads: int) -> torch.Tensor:
    """The row gather that undoes llama.cpp's q/k permutation: row ``i`` of the result is row
    ``order[i]`` of the stored matrix (transformers' reverse_permute: reshape to (heads, rows /
    heads / 2, 2) and swap the last two axes)."""
    return torch.arange(rows).reshape(heads, rows // heads // 2, 2).transpose(1, 2).reshape(-1)


class GGUFWeights:
    """A GGUF file as a WeightSource. Tensors are decoded as they are asked for, in blocks of rows;
    4- and 8-bit blocks are handed over as stored where the asked compression is their format."""

    def __init__(self, path: str | Path):
        self.model = read_gguf(path)
        self.file = self.model.file
        self.path = self.file.path
        self.config = self.model.config

    def _resolve(self, stage: str, spec: WeightSpec) -> TensorInfo:
        names = [gguf_name(key) for key in spec.checkpoint_keys]
        info = next((self.file.tensors[n] for n in names if n is not None and n in self.file.tensors), None)
        if info is None:
            wanted = next((n for n in names if n is not None), None)
            if wanted is None:
                raise UnsupportedModelError(f"{self.path}: a GGUF file has no tensor for {spec.checkpoint_keys[0]!r} "
                                            f"(for {stage})")
            raise CheckpointError(f"{self.path}: tensor {wanted!r} (for {stage}) is not in the file")
        if info.shape != spec.shape:
            wrong = [i for i, (a, b) in enumerate(zip(info.shape, spec.shape)) if a != b] \
                if len(info.shape) == len(spec.shape) else range(len(spec.shape))
            meanings = self._meanings(info.name, len(spec.shape))
            why = " and ".join(dict.fromkeys(meanings[i] for i in wrong)) or "the config"
            raise CheckpointError(f"{self.path}: {info.name} has shape {list(info.shape)} but {why} needs "
                                  f"{list(spec.shape)}")
        if info.type_name in INTEGER_TYPES:
            raise CheckpointError(f"{self.path}: tensor {info.name!r} holds {info.type_name} integers, but a weight "
                                  "must be floating point or quantized")
        if info.type_name not in NATIVE and gguf_package() is None:
            raise UnsupportedModelError(f"{self.path}: tensor {info.name!r} is stored as {info.type_name}, which "
                                        "flexoff decodes through the gguf package: pip install gguf")
        return info

    def _meanings(self, name: str, ndim: int) -> list[str]:
        """Each dimension of ``name`` as the metadata makes it, e.g. "llama.attention.head_count_kv=4
        × head dim 64"."""
        cfg, keys = self.config, self.model.names
        words = {
            "vocab": f"{keys['vocab_size']}={cfg.vocab_size}", "hidden": f"{keys['hidden_size']}={cfg.hidden_size}",
            "q": f"{keys['num_heads']}={cfg.num_heads} × head dim {cfg.head_dim}",
            "kv": f"{keys['num_kv_heads']}={cfg.num_kv_heads} × head dim {cfg.head_dim}",
            "ffn": f"{keys['intermediate_size']}={cfg.intermediate_size}", "head": f"head dim {cfg.head_dim}",
        }
        dims = _DIMS.get(name.split(".", 2)[-1] if name.startswith("blk.") else name, ("hidden",) * ndim)
        return [words[d] for d in dims] if len(dims) == ndim else ["the config"] * ndim

    def _order(self, info: TensorInfo) -> torch.Tensor | None:
        """The row gather for a Llama file's q and k, None for every other tensor."""
        if not self.model.permuted or not info.name.startswith("blk."):
            return None
        part = info.name.split(".", 2)[-1]
        heads = {"attn_q.weight": self.config.num_heads, "attn_k.weight": self.config.num_kv_heads}.get(part)
        return None if heads is None else unpermute_order(info.shape[0], heads)

    def _by_rows(self, info: TensorInfo, fill) -> None:
        """``fill(start, stop, rows)`` for each block of the tensor's rows, in their unpermuted order,
        with the stored bytes of those rows."""
        raw, order = self.file.raw(info.name), self._order(info)
        step = max(1, _CHUNK_ELEMENTS // info.shape[-1])
        for start in range(0, raw.shape[0], step):
            stop = min(start + step, raw.shape[0])
            try:
                rows = raw[start:stop] if order is None else raw[order[start:stop].numpy()]
                fill(start, stop, rows)
            except (ValueError, OSError) as exc:  # a mapped page that cannot be read, a bad block
                raise CheckpointError(f"cannot read tensor {info.name!r} from {self.path}: {exc}") from None

    def check(self, stages: dict[str, list[WeightSpec]]) -> None:
        """Fail before any large allocation if a tensor is missing, of the wrong shape, or of a type
        that cannot be decoded here."""
        for stage, specs in stages.items():
            for spec in specs:
                self._resolve(stage, spec)

    def load_tensor(self, stage: str, spec: WeightSpec, device: torch.device, dtype: torch.dtype,
                    out: torch.Tensor | None = None) -> torch.Tensor:
        """The tensor's values in ``dtype`` on ``device``, written into ``out`` when given."""
        info = self._resolve(stage, spec)
        target = out if out is not None else torch.empty(spec.shape, dtype=dtype)
        flat = target.view(-1, info.shape[-1])

        def fill(start, stop, rows):
            flat[start:stop].copy_(decode_rows(rows, info.type_name, info.type_id, info.shape[-1]))

        self._by_rows(info, fill)
        return target if out is not None else target.to(device)

    def load_compressed(self, stage: str, spec: WeightSpec, compression, device: torch.device,
                        meta_dtype: torch.dtype):
        """A Q4_0/Q4_1 matrix under 4-bit groups of 32, or a Q8_0 one under 8-bit groups of 32, as a
        CompressedTensor built from its blocks (no values are decoded); None for anything else, and
        where ``meta_dtype`` cannot hold every scale and minimum exactly (bfloat16, or an fp16
        overflow of -128 * d)."""
        info = self._resolve(stage, spec)
        stored = AS_COMPRESSED.get(info.type_name)
        if stored is None or len(spec.shape) != 2 or compression is None \
                or (compression.bits, compression.group_size) != (stored[0], BLOCK):
            return None
        rows, cols = spec.shape
        groups = cols // BLOCK
        data = torch.empty((rows, cols * stored[0] // 8), dtype=torch.uint8)
        scale, minimum = (torch.empty((rows, groups), dtype=meta_dtype) for _ in range(2))
        exact = []

        def fill(start, stop, stored_rows):
            codes, d, low = compressed_rows(stored_rows, info.type_name)
            data[start:stop] = codes
            for target, values in ((scale, d), (minimum, low)):
                target[start:stop] = values
                exact.append(bool(torch.equal(target[start:stop].float(), values)))

        self._by_rows(info, fill)
        if not all(exact):
            return None
        tensor = CompressedTensor(data, scale, minimum, spec.shape, meta_dtype, -1, stored[0], BLOCK)
        return tensor if torch.device(device).type == "cpu" else tensor.to(device)

    def close(self) -> None:
        self.file.close()
