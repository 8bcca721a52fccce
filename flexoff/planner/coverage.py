"""Where a prediction leaves what its profile measured: the attention rates of `flexoff profile` come from one
shape (a prompt of 512 and a decode over 544 keys, its ``measurements``), and a job of longer prompts or a
longer context is priced by carrying those rates over. That is planned as usual, with a note that says so. A
profile without measurements (the packaged T4 one holds published constants) gets no note: it never
claimed a shape."""

from __future__ import annotations

from .frame import Workload
from .hardware import HardwareProfile


def extrapolated(hardware: HardwareProfile, workload: Workload) -> list[str]:
    """What ``workload`` asks of ``hardware``'s attention beyond the shapes it measured, one phrase each."""
    measured = hardware.measurements.get("attention")
    if not isinstance(measured, dict):
        return []
    out = []
    prompt, keys = measured.get("prompt"), measured.get("keys")
    if isinstance(prompt, int) and workload.prompt_len > prompt:
        out.append(f"prefill attention over prompts of {workload.prompt_len} tokens (measured at {prompt})")
    context = workload.prompt_len + workload.gen_len
    if isinstance(keys, int) and context > keys:
        out.append(f"decode attention over up to {context} keys (measured at {keys})")
    return out


def extrapolation_note(hardware: HardwareProfile, workload: Workload) -> str | None:
    """A line for the user where the prediction is extrapolated, else None."""
    parts = extrapolated(hardware, workload)
    if not parts:
        return None
    return f"note: the prediction extrapolates the {hardware.name} profile's {'; '.join(parts)}"
