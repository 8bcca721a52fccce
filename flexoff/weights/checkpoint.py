"""Weights from a local Hugging Face checkpoint directory: safetensors (mmap) or pytorch_model*.bin."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..errors import CheckpointError, UnsupportedModelError
from ..models import WeightSpec

# Tensor names that mark GPTQ/AWQ-style packed checkpoints, which would be misread as plain weights.
_QUANTIZED_SUFFIXES = (".qweight", ".qzeros", ".g_idx", ".scales", ".weight_packed")


class CheckpointWeights:
    """Reads tensors lazily: safetensors files are memory-mapped and .bin files are loaded with
    ``mmap=True``, so a tensor is only read when a stage asks for it and never held twice."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._key_file: dict[str, Path] = {}
        self._handles: dict[Path, object] = {}
        files = self._find_files()
        for file in files:
            for key in self._keys_of(file):
                self._key_file.setdefault(key, file)
        quantized = next((k for k in self._key_file if k.endswith(_QUANTIZED_SUFFIXES)), None)
        if quantized is not None:
            raise UnsupportedModelError(
                f"{self.path} holds pre-quantized tensors (e.g. {quantized!r}, GPTQ/AWQ style); "
                "load an fp16/bf16 checkpoint and use flexoff's own compression instead"
            )

    def _find_files(self) -> list[Path]:
        for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
            index = self.path / index_name
            if index.exists():
                try:
                    weight_map = json.loads(index.read_text())["weight_map"]
                except (OSError, ValueError, KeyError, TypeError) as exc:
                    raise CheckpointError(f"{index}: not a valid checkpoint index ({exc})") from None
                files = sorted({self.path / name for name in weight_map.values()})
                missing = [f for f in files if not f.exists()]
                if missing:
                    raise CheckpointError(f"{index} names the shard {missing[0].name}, which is missing")
                return files
        files = sorted(self.path.glob("*.safetensors")) or sorted(self.path.glob("pytorch_model*.bin"))
        if not files:
            raise CheckpointError(f"{self.path} has no *.safetensors or pytorch_model*.bin weight files")
        return files

    def _open(self, file: Path):
        if file not in self._handles:
            try:
                if file.suffix == ".safetensors":
                    from safetensors import safe_open

                    self._handles[file] = safe_open(str(file), framework="pt", device="cpu")
                else:
                    self._handles[file] = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
            except Exception as exc:  # safetensors and torch raise many types for a corrupt file
                raise CheckpointError(f"cannot read checkpoint file {file}: {exc}") from None
        return self._handles[file]

    def _keys_of(self, file: Path) -> list[str]:
        handle = self._open(file)
        return list(handle.keys())

    def _shape_of(self, key: str) -> tuple[int, ...]:
        handle = self._open(self._key_file[key])
        if isinstance(handle, dict):
            return tuple(handle[key].shape)
        return tuple(handle.get_slice(key).get_shape())

    def _dtype_of(self, key: str) -> tuple[str, bool]:
        """(the stored dtype's name, whether it is floating point), without reading the tensor."""
        handle = self._open(self._key_file[key])
        if isinstance(handle, dict):
            dtype = handle[key].dtype
            return str(dtype).removeprefix("torch."), dtype.is_floating_point
        name = handle.get_slice(key).get_dtype()  # safetensors' names: F16, BF16, F32, F8_E4M3, I32, BOOL, ...
        return name, name.startswith(("F", "BF"))

    def _resolve(self, stage: str, spec: WeightSpec) -> str | tuple[tuple[str, ...], ...]:
        """The key holding the tensor, or the keys of its rows where the checkpoint stores it in
        pieces (see WeightSpec.stacked), each checked for shape."""
        key = next((k for k in spec.checkpoint_keys if k in self._key_file), None)
        if key is not None:
            self._check_tensor(key, spec.shape)
            return key
        # The stored layout is the one whose first piece is present; a later piece missing is named.
        pieces = next((rows for rows in spec.stacked if rows[0][0] in self._key_file), None)
        if pieces is None:
            raise CheckpointError(
                f"{self.path}: tensor {spec.checkpoint_keys[0]!r} (for {stage}) is not in the checkpoint"
            )
        for parts in pieces:
            part_shape = (spec.shape[1] // len(parts), *spec.shape[2:])
            for part in parts:
                if part not in self._key_file:
                    raise CheckpointError(f"{self.path}: tensor {part!r} (for {stage}) is not in the checkpoint")
                self._check_tensor(part, part_shape)
        return pieces

    def _check_tensor(self, key: str, shape: tuple[int, ...]) -> None:
        """A weight's shape, and that it holds floating-point values: integers would be cast and run
        as if they were weights. (Only the tensors read as weights are checked: a checkpoint's
        integer buffers, such as position_ids, are never read.)"""
        found = self._shape_of(key)
        if found != shape:
            raise CheckpointError(
                f"{self._key_file[key]}: tensor {key!r} has shape {list(found)}, but the config needs {list(shape)}"
            )
        dtype, floating = self._dtype_of(key)
        if not floating:
            raise CheckpointError(f"{self._key_file[key]}: tensor {key!r} holds {dtype} values, but a weight must be "
                                  "floating point (float16, bfloat16 or float32)")

    def check(self, stages: dict[str, list[WeightSpec]]) -> None:
        """Fail before any large allocation if a tensor is missing or of the wrong shape."""
        for stage, specs in stages.items():
            for spec in specs:
                self._resolve(stage, spec)

    def read(self, stage: str, spec: WeightSpec) -> torch.Tensor:
        where = self._resolve(stage, spec)
        if isinstance(where, str):
            return self._read_key(where)
        return torch.stack([torch.cat([self._read_key(key) for key in parts]) for parts in where])

    def _read_key(self, key: str) -> torch.Tensor:
        file = self._key_file[key]
        handle = self._open(file)
        try:
            return handle[key] if isinstance(handle, dict) else handle.get_tensor(key)
        except Exception as exc:
            raise CheckpointError(f"cannot read tensor {key!r} from {file}: {exc}") from None

    def load_tensor(self, stage: str, spec: WeightSpec, device: torch.device, dtype: torch.dtype,
                    out: torch.Tensor | None = None) -> torch.Tensor:
        """The tensor on ``device``, written into ``out`` (e.g. pinned memory) when given."""
        tensor = self.read(stage, spec)
        if out is not None:
            return out.copy_(tensor)
        return tensor.to(device=device, dtype=dtype)

    def load_compressed(self, stage: str, spec: WeightSpec, compression, device: torch.device,
                        meta_dtype: torch.dtype) -> None:
        """Floating-point weights: none is stored compressed."""
        return None

    def close(self) -> None:
        self._handles.clear()
