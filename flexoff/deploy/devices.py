"""The device and compute dtype a name asks for: parsed (refusing what flexoff cannot compute on)
and resolved on this machine."""

from __future__ import annotations

import torch

from ..checks import check_device_name
from ..errors import ArgumentTypeError, ConfigError, FlexoffError
from ..models import ModelConfig

_DTYPES = {
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float32": torch.float32, "fp32": torch.float32,
}


def parse_device(device: str | torch.device) -> torch.device | None:
    """``device`` as a torch.device (None for "auto"), refusing what flexoff cannot compute on."""
    if isinstance(device, torch.device):
        parsed = device
    elif isinstance(device, str):
        check_device_name(device)
        return None if device == "auto" else torch.device(device)
    else:
        raise ArgumentTypeError(f"device must be a string or a torch.device, got {type(device).__name__}")
    if parsed.type not in ("cpu", "cuda"):
        raise ConfigError(f"unknown device {str(device)!r}; use auto, cpu, cuda or cuda:N")
    return parsed


def resolve_device(device: str | torch.device) -> torch.device:
    device = parse_device(device)
    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise FlexoffError("device 'cuda' was asked for, but CUDA is not available on this machine")
    if device.type == "cuda" and device.index is None:
        # Memory caps and peak statistics need an explicit card.
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def resolve_dtype(dtype: str | torch.dtype, device: torch.device, config: ModelConfig | None = None,
                  planned: bool = False) -> torch.dtype:
    """The compute dtype a name asks for. "auto" is fp32 on the CPU, which computes it fastest and
    most exactly; on a GPU, or for a policy the planner searches (``planned``: it plans 16-bit
    weights and cache), the model's own 16-bit format (``config.native_dtype``; fp16 without a
    config)."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ConfigError(f"unsupported dtype {dtype}; use float16, bfloat16 or float32")
        return dtype
    if not isinstance(dtype, str):
        raise ArgumentTypeError(f"dtype must be a string or a torch.dtype, got {type(dtype).__name__}")
    if dtype == "auto":
        if device.type != "cuda" and not planned:
            return torch.float32
        return torch.bfloat16 if config is not None and config.native_dtype == "bfloat16" else torch.float16
    if dtype not in _DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r}; use auto, float16, bfloat16 or float32")
    return _DTYPES[dtype]
