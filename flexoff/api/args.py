"""The LLM's arguments, checked by type and range before anything loads (the device and dtype
through :mod:`flexoff.deploy.devices`), and vLLM's prompt dicts and argument aliases."""

from __future__ import annotations

import os

import torch

from ..checks import check_bool, check_optional_path, check_seed, check_size
from ..deploy.devices import parse_device, resolve_dtype
from ..errors import ArgumentTypeError, ConfigError, PromptError
from ..fileio import check_offload_dir
from ..policy import Policy, check_choice


def check_llm_args(*, dummy, policy, dtype, device, seed, tokenizer, offload_dir, gpu_mem, cpu_mem,
                   compress="off", prefix_sharing=True, cuda_graphs=True) -> None:
    """LLM's arguments (all but the model), by type and range, before anything is loaded."""
    check_bool(dummy, "dummy")
    check_bool(prefix_sharing, "prefix_sharing")
    check_bool(cuda_graphs, "cuda_graphs")
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
