"""The policy a bench script runs: a policy file, or the one the planner searches under the caps."""

from __future__ import annotations

import argparse
import sys

import torch

from flexoff.models import resolve_model_config
from flexoff.planner.cost_model import Workload
from flexoff.planner.hardware import resolve_hardware
from flexoff.planner.search import search_policy
from flexoff.policy import Policy
from flexoff.units import parse_size


def add_policy_args(parser: argparse.ArgumentParser, model: str = "opt-30b") -> None:
    parser.add_argument("--model", default=model)
    parser.add_argument("--policy", choices=["auto"], help="search the policy (with --hardware and the caps)")
    parser.add_argument("--policy-file", help="a policy JSON (flexoff search --output)")
    parser.add_argument("--compress", default="off", choices=["off", "auto", "on"])
    parser.add_argument("--hardware", default="h100")
    parser.add_argument("--gpu-mem")
    parser.add_argument("--cpu-mem")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--num-prompts", type=int, help="default: one block of the policy")
    parser.add_argument("--plan-gen-len", type=int, default=32, help="tokens generated in the searched workload")
    parser.add_argument("--offload-dir", default="/tmp")


def policy_from_args(args) -> tuple:
    """(model config, the planner's profile under the caps, the policy)."""
    config = resolve_model_config(args.model)
    caps = [parse_size(v) if v else None for v in (args.gpu_mem, args.cpu_mem)]
    hardware = resolve_hardware(args.hardware).with_memory(*caps)
    if args.policy_file:
        policy = Policy.load(args.policy_file)
    else:
        workload = Workload(args.prompt_len, args.plan_gen_len, args.num_prompts)
        policy = search_policy(config, workload, hardware, compress=args.compress).policy
    return config, hardware, policy


def cuda_job(args, why: str) -> tuple:
    """(model config, profile, policy, prompts: one block unless given) for a script that needs CUDA,
    which exits with ``why`` without it."""
    if not torch.cuda.is_available():
        sys.exit(why)
    config, hardware, policy = policy_from_args(args)
    return config, hardware, policy, args.num_prompts or policy.block_size
