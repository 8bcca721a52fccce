"""Recorded runs predicted again with some of another profile's figures in place of the recorded
profile's: which of the profile's terms would bring the predictions to the measurements. The runs
are not repeated; the runtime they measured is the one recorded."""

from __future__ import annotations

import copy

from flexoff.models import REGISTRY
from flexoff.planner.cost_model import CostModel, Workload
from flexoff.planner.hardware import HardwareProfile
from flexoff.policy import Policy

from .cases import capped

# The figures a quick profile times on the GPU, at shapes of its own.
GPU_RATES = ("compute.matmul_flop_per_s", "compute.prefill_attention_flop_per_s",
             "compute.decode_attention_flop_per_s", "compute.gpu_memory_bytes_per_s",
             "compute.gpu_dequant_elements_per_s", "compute.gpu_kv_dequant_elements_per_s",
             "compute.gpu_kv_quant_elements_per_s")


def _has(data: dict, field: str) -> bool:
    """Whether a profile's JSON form has a figure at ``field`` ("section.key")."""
    section, _, key = field.partition(".")
    return key in data.get(section, {})


def present(profile: HardwareProfile, fields) -> list[str]:
    """Of ``fields`` ("section.key"), those ``profile`` has a figure for."""
    data = profile.to_dict()
    return [field for field in fields if _has(data, field)]


def swapped(recorded: dict, other: HardwareProfile, fields: list[str]) -> HardwareProfile:
    """The recorded profile (its JSON form) with each of ``fields`` ("section.key") taken from ``other``."""
    data, source = copy.deepcopy(recorded), other.to_dict()
    for field in fields:
        if not _has(source, field):
            raise ValueError(f"--repredict-field {field}: the other profile has no such figure "
                             f"(sections.keys: {', '.join(f'{s}.{k}' for s in ('compute', 'bandwidth_bytes_per_s') for k in source[s])})")
        section, _, key = field.partition(".")
        data.setdefault(section, {})[key] = source[section][key]
    return HardwareProfile.from_dict(data, "recorded profile with swapped figures")


def _err(measured: float, predicted: float) -> str:
    return f"{(measured - predicted) / predicted:+.0%}"


HEADER = ("| run | policy | measured token/s | recorded prediction (err) | re-predicted (err) "
          "| prefill err, recorded → re-predicted | decode err, recorded → re-predicted |")


def rows(data: dict, other: HardwareProfile, fields: list[str]) -> list[str]:
    """One row per measured run of one --json file."""
    profile = swapped(data["hardware"], other, fields)
    out = []
    for record in data["records"]:
        measured = record["measured"]
        if "total_throughput" not in measured:
            continue
        workload = record["workload"]
        hardware = capped(profile, record["gpu_mem"], record["cpu_mem"])
        model = CostModel(REGISTRY[record["model"]], Workload(workload["prompt_len"], workload["gen_len"],
                                                               workload["num_prompts"]), hardware)
        again = model.predict(Policy.from_dict(record["policy"]))
        before = record["predicted"]
        phases = [f"{_err(measured[key], before[key])} → {_err(measured[key], getattr(again, key))}"
                  for key in ("prefill_throughput", "decode_throughput")]
        out.append(f"| {record.get('label') or record['name']} | {record['summary']} | "
                   f"{measured['total_throughput']:.2f} | {before['total_throughput']:.2f} "
                   f"({_err(measured['total_throughput'], before['total_throughput'])}) | "
                   f"{again.total_throughput:.2f} ({_err(measured['total_throughput'], again.total_throughput)}) | "
                   f"{phases[0]} | {phases[1]} |")
    return out
