"""The GGUF file format (llama.cpp's, versions 2 and 3), read with numpy over a memory map.

Layout, all little-endian: the magic ``GGUF``, a uint32 version, uint64 tensor and key/value
counts; the key/values (a string key, a uint32 value type, the value: numbers, a bool, a string as
a uint64 length and UTF-8 bytes, or an array: its element type, a uint64 count, the elements); the
tensor infos (a string name, a uint32 count of dimensions, uint64 dimensions innermost first, a
uint32 ggml type, a uint64 offset into the data section); then padding to ``general.alignment``
(32 by default) and the data section, each tensor at an aligned offset.

Everything read is checked against the file: a truncated or corrupt file, or a tensor of a type
this table does not know, is one :class:`CheckpointError` naming the file and what was being read.
Tensor shapes are given in torch's order (outermost first, the reverse of the file's), so a
matrix's quantization blocks run along its last dimension. Nothing here decodes tensor values.
"""

from __future__ import annotations

import math

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import CheckpointError, UnsupportedModelError

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
_MAX_NESTING = 8  # arrays of arrays: real files nest at most once

# ggml type id -> (name, values per block, bytes per block), as ggml.h numbers them. Ids 4 and 5
# (Q4_2, Q4_3) and 31-33 (Q4_0_4_4 ...) were removed from ggml, and 9 (Q8_1) is only ever made
# while llama.cpp computes, never stored: all are refused as unknown.
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98), 19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110), 22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1), 25: ("I16", 1, 2), 26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56), 30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17), 40: ("NVFP4", 64, 36), 41: ("Q1_0", 128, 18),
}
INTEGER_TYPES = ("I8", "I16", "I32", "I64")

# GGUF value type id -> (name, struct format of a scalar; None for strings and arrays).
_VALUE_TYPES: dict[int, tuple[str, str | None]] = {
    0: ("UINT8", "<B"), 1: ("INT8", "<b"), 2: ("UINT16", "<H"), 3: ("INT16", "<h"), 4: ("UINT32", "<I"),
    5: ("INT32", "<i"), 6: ("FLOAT32", "<f"), 7: ("BOOL", "<B"), 8: ("STRING", None), 9: ("ARRAY", None),
    10: ("UINT64", "<Q"), 11: ("INT64", "<q"), 12: ("FLOAT64", "<d"),
}
_STRING, _ARRAY, _BOOL = 8, 9, 7


class _Short(Exception):
    """Raised by the cursor where a read runs past the end of the file."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # torch's order: outermost first
    type_id: int
    offset: int  # absolute, in the file
    nbytes: int

    @property
    def type_name(self) -> str:
        return GGML_TYPES[self.type_id][0]

    @property
    def block_size(self) -> int:
        return GGML_TYPES[self.type_id][1]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class _Cursor:
    def __init__(self, buffer, start: int = 0):
        self.buffer, self.pos, self.size = buffer, start, len(buffer)

    def take(self, count: int) -> memoryview:
        if count < 0 or self.pos + count > self.size:
            raise _Short
        view = memoryview(self.buffer)[self.pos:self.pos + count]
        self.pos += count
        return view

    def scalar(self, fmt: str):
        size = struct.calcsize(fmt)
        if self.pos + size > self.size:
            raise _Short
        value = struct.unpack_from(fmt, self.buffer, self.pos)[0]
        self.pos += size
        return value

    def string(self) -> str:
        data = self.take(self.scalar("<Q"))
        return bytes(data).decode("utf-8")

    def strings(self, count: int) -> list[str]:
        """``count`` strings in a row: string() unrolled, as a tokenizer's vocabulary needs."""
        buffer, pos, size, unpack, out = self.buffer, self.pos, self.size, struct.unpack_from, []
        for _ in range(count):
            if pos + 8 > size:
                raise _Short
            length = unpack("<Q", buffer, pos)[0]
            pos += 8
            if pos + length > size:
                raise _Short
            out.append(buffer[pos:pos + length].decode("utf-8"))
            pos += length
        self.pos = pos
        return out


class GGUFFile:
    """A GGUF file's metadata and tensor table; ``raw(name)`` is a tensor's bytes, mapped, not read."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as handle:
                size = handle.seek(0, 2)
                if size < 24:
                    raise CheckpointError(f"{self.path}: not a GGUF file: only {size} bytes")
                self._map = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as exc:
            raise CheckpointError(f"cannot read GGUF file {self.path}: {exc.strerror or exc}") from None
        self.size = size
        self.metadata: dict[str, object] = {}
        self.value_types: dict[str, str] = {}  # key -> its GGUF type ("UINT32", "ARRAY[STRING]", ...)
        self.tensors: dict[str, TensorInfo] = {}
        self._parse()

    def fail(self, message: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: {message}")

    def _parse(self) -> None:
        cursor = _Cursor(self._map)
        if bytes(cursor.take(4)) != MAGIC:
            raise self.fail(f"not a GGUF file: it starts with {bytes(self._map[:4])!r}, not {MAGIC!r}")
        version = cursor.scalar("<I")
        if version not in VERSIONS:
            swapped = struct.unpack("<I", struct.pack(">I", version))[0]
            detail = "a big-endian GGUF file, which flexoff does not read" if swapped in VERSIONS else \
                f"GGUF version {version}; flexoff reads versions {VERSIONS[0]} and {VERSIONS[1]}"
            raise UnsupportedModelError(f"{self.path}: {detail}")
        self.version = version
        tensor_count, kv_count = cursor.scalar("<Q"), cursor.scalar("<Q")
        # Each key/value takes at least 12 bytes and each tensor info 24: larger counts are corrupt.
        for what, count, least in (("key/value", kv_count, 12), ("tensor", tensor_count, 24)):
            if count * least > self.size:
                raise self.fail(f"corrupt header: {count} {what} entries cannot fit in {self.size} bytes")
        for index in range(kv_count):
            key = self._read(cursor, lambda: cursor.string(), f"the name of metadata entry {index}")
            if key in self.metadata:
                raise self.fail(f"metadata key {key!r} appears twice")
            type_id = self._read(cursor, lambda: cursor.scalar("<I"), f"metadata key {key!r}")
            self.metadata[key], self.value_types[key] = self._read(
                cursor, lambda: self._value(cursor, type_id, key, 0), f"metadata key {key!r}")
        alignment = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if self.value_types.get("general.alignment", "UINT32") != "UINT32" or alignment < 1 \
                or alignment & (alignment - 1):
            raise self.fail(f"general.alignment must be a power of two (uint32), got {alignment!r}")
        self.alignment = alignment
        infos = []
        for index in range(tensor_count):
            name = self._read(cursor, lambda: cursor.string(), f"the name of tensor {index}")
            infos.append((name, *self._read(cursor, lambda: self._tensor_info(cursor, name), f"tensor {name!r}")))
        self.data_start = -(-cursor.pos // alignment) * alignment
        for name, dims, type_id, offset in infos:
            self._add_tensor(name, dims, type_id, offset)

    def _read(self, cursor: _Cursor, read, what: str):
        try:
            return read()
        except _Short:
            raise self.fail(f"truncated: {what} runs past the end of the file ({self.size} bytes)") from None
        except UnicodeDecodeError:
            raise self.fail(f"corrupt: {what} holds a string that is not UTF-8") from None

    def _value(self, cursor: _Cursor, type_id: int, key: str, depth: int) -> tuple[object, str]:
        if type_id not in _VALUE_TYPES:
            raise self.fail(f"corrupt: metadata key {key!r} has unknown value type {type_id}")
        name, fmt = _VALUE_TYPES[type_id]
        if type_id == _STRING:
            return cursor.string(), name
        if type_id == _ARRAY:
            if depth >= _MAX_NESTING:
                raise self.fail(f"corrupt: metadata key {key!r} nests arrays more than {_MAX_NESTING} deep")
            item_type, count = cursor.scalar("<I"), cursor.scalar("<Q")
            if item_type not in _VALUE_TYPES:
                raise self.fail(f"corrupt: metadata key {key!r} is an array of unknown value type {item_type}")
            item_name, item_fmt = _VALUE_TYPES[item_type]
            if item_fmt is not None:  # numbers: one numpy read
                width = struct.calcsize(item_fmt)
                items = np.frombuffer(cursor.take(count * width), dtype=np.dtype(item_fmt)).tolist()
                if item_type == _BOOL:
                    items = [bool(i) for i in items]
                return items, f"ARRAY[{item_name}]"
            if count * 8 > cursor.size - cursor.pos:  # each string or array takes 8 bytes at least
                raise _Short
            if item_type == _STRING:  # a vocabulary: 100k strings or more
                return cursor.strings(count), f"ARRAY[{item_name}]"
            items = [self._value(cursor, item_type, key, depth + 1)[0] for _ in range(count)]
            return items, f"ARRAY[{item_name}]"
        value = cursor.scalar(fmt)
        return (bool(value) if type_id == _BOOL else value), name

    def _tensor_info(self, cursor: _Cursor, name: str) -> tuple[tuple[int, ...], int, int]:
        ndims = cursor.scalar("<I")
        if not 1 <= ndims <= MAX_DIMS:
            raise self.fail(f"corrupt: tensor {name!r} has {ndims} dimensions (1 to {MAX_DIMS} allowed)")
        dims = tuple(cursor.scalar("<Q") for _ in range(ndims))
        return dims, cursor.scalar("<I"), cursor.scalar("<Q")

    def _add_tensor(self, name: str, dims: tuple[int, ...], type_id: int, offset: int) -> None:
        if name in self.tensors:
            raise self.fail(f"tensor {name!r} appears twice")
        if type_id not in GGML_TYPES:
            raise UnsupportedModelError(f"{self.path}: tensor {name!r} has ggml type {type_id}, which flexoff "
                                        "does not know")
        type_name, block, block_bytes = GGML_TYPES[type_id]
        if any(d < 1 for d in dims) or dims[0] % block:
            raise self.fail(f"corrupt: tensor {name!r} has dimensions {list(dims)}, but {type_name} needs its "
                            f"first dimension a positive multiple of {block}")
        count = 1
        for size in dims:
            count *= size
        nbytes = count // block * block_bytes
        start = self.data_start + offset
        if offset % self.alignment:
            raise self.fail(f"corrupt: tensor {name!r} starts at data offset {offset}, not a multiple of the "
                            f"alignment {self.alignment}")
        if start + nbytes > self.size:
            raise self.fail(f"truncated: tensor {name!r} ({type_name}, {nbytes} bytes at offset {start}) runs "
                            f"past the end of the file ({self.size} bytes)")
        self.tensors[name] = TensorInfo(name, tuple(reversed(dims)), type_id, start, nbytes)

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as a read-only uint8 array over the map: (rows, bytes per row), where
        a row runs along the last (innermost) dimension."""
        info = self.tensors[name]
        flat = np.frombuffer(self._map, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        return flat.reshape(-1, info.nbytes // (info.numel // info.shape[-1]))

    def header_bytes(self) -> bytes:
        """The file up to its data section: metadata and tensor table (what identifies a model's layout)."""
        return bytes(self._map[:self.data_start])

    def close(self) -> None:
        try:
            self._map.close()
        except BufferError:  # arrays over the map are still alive: it closes when they are gone
            pass
