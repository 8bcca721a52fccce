"""The LLM's arguments, checked by type and range before anything loads: the device and dtype a
name asks for, the other arguments, and vLLM's prompt dicts and argument aliases."""

from __future__ import annotations

import os

import torch

from .checks import check_bool, check_device_name, check_optional_path, check_seed, check_size
from .errors import ArgumentTypeError, ConfigError, FlexoffError, PromptError
from .fileio import check_offload_dir
from .models import ModelConfig
from .policy import Policy, check_choice

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


def check_llm_args(*, dummy, policy, dtype, device, seed, tokenizer, offload_dir, gpu_mem, cpu_mem,
                   compress="off") -> None:
    """LLM's arguments (all but the model), by type and range, before anything is loaded."""
    check_bool(dummy, "dummy")
    check_choice(compress, "compress")
    if policy is not None and not isinstance(policy, (Policy, str, os.PathLike)):
        raise ArgumentTypeError(f"policy must be a Policy, a policy file's path or None, got {type(policy).__name__}")
    resolve_dtype(dtype, torch.device("cpu"))
    parse_device(device)
    check_seed(seed, "seed", ConfigError)
    check_optional_path(tokenizer, "tokenizer")
    check_optional_path(offload_dir, "offload_dir")
    check_offload_dir(offload_dir)
    for name, value in (("gpu_mem", gpu_mem), ("cpu_mem", cpu_mem)):
        if value is not None:
            check_size(value, name)


def unwrap_prompt(prompt: dict, index: int):
    """vLLM's prompt dicts: {"prompt": text} or {"prompt_token_ids": ids}, nothing else."""
    keys = sorted(prompt)
    if keys not in (["prompt"], ["prompt_token_ids"]):
        extra = [k for k in keys if k not in ("prompt", "prompt_token_ids")]
        why = f"field {extra[0]!r} is not supported" if extra else "it needs exactly one of them"
        raise PromptError(f"prompt {index} must be {{\"prompt\": text}} or {{\"prompt_token_ids\": [ids]}}; {why}")
    if "prompt" in prompt and not isinstance(prompt["prompt"], str):
        raise ArgumentTypeError(f"prompt {index}: field 'prompt' must be text, got {type(prompt['prompt']).__name__}")
    if "prompt_token_ids" in prompt and not isinstance(prompt["prompt_token_ids"], (list, tuple)):
        raise ArgumentTypeError(f"prompt {index}: field 'prompt_token_ids' must be a list of token ids, "
                                f"got {type(prompt['prompt_token_ids']).__name__}")
    return prompt[keys[0]]


def one_of(value, alias, name: str, alias_name: str):
    """An argument that has two names: either may be given, or both if they agree."""
    if value is not None and alias is not None and value is not alias and value != alias:
        raise ArgumentTypeError(f"{name} and {alias_name} are the same argument; give one of them")
    return alias if value is None else value
