"""A checkpoint's ``generation_config.json``: its end-of-sequence ids and its sampling defaults.

- ``eos_token_id`` (one id or a list) joins the ids of config.json that end a sequence; instruct
  models end their turn with a token that config.json often leaves out (Llama 3's ``<|eot_id|>``).
- The sampling fields are the defaults of a call given no sampling parameters at all, as vLLM's
  ``generation_config="auto"`` does. ``do_sample`` keeps the meaning transformers gives it: false or
  absent means greedy (its temperature, top_p, top_k and min_p then do not apply); true means
  sampling with the file's values. ``max_new_tokens`` and ``repetition_penalty`` apply either way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .checks import is_int
from .errors import ConfigError
from .fileio import read_user_json

FILE = "generation_config.json"
_SAMPLED = ("temperature", "top_p", "top_k", "min_p")  # meaningful only with do_sample
_ALWAYS = ("max_new_tokens", "repetition_penalty")


@dataclass(frozen=True)
class GenerationDefaults:
    path: Path | None = None  # the file read; None when the checkpoint has none
    eos_token_ids: tuple[int, ...] = ()
    sampling: dict = field(default_factory=dict)  # SamplingParams keyword arguments


def read_generation_config(directory: str | Path | None) -> GenerationDefaults:
    """The defaults in ``directory``'s generation_config.json; none when there is no such file, or
    for a GGUF file (its end-of-sequence ids are in its metadata, which the model's config reads)."""
    if directory is None or not (Path(directory) / FILE).is_file():
        return GenerationDefaults()
    path = Path(directory) / FILE
    raw = read_user_json(path, "generation config", ConfigError)
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must hold a JSON object, not {type(raw).__name__}")
    eos = raw.get("eos_token_id")
    eos = () if eos is None else (eos,) if is_int(eos) else eos
    if not isinstance(eos, list | tuple) or not all(is_int(i) and i >= 0 for i in eos):
        raise ConfigError(f"{path}: eos_token_id must be a token id or a list of them, got {raw['eos_token_id']!r}")
    do_sample = raw.get("do_sample", False)
    if not isinstance(do_sample, bool):
        raise ConfigError(f"{path}: do_sample must be true or false, got {do_sample!r}")
    sampling = {key: raw[key] for key in _ALWAYS if raw.get(key) is not None}
    if do_sample:
        sampling["temperature"] = 1.0  # transformers' default when the file names none
        sampling.update({key: raw[key] for key in _SAMPLED if raw.get(key) is not None})
    return GenerationDefaults(path, tuple(eos), sampling)
