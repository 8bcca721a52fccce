"""One rule for every command's files, checked before the model loads or anything is measured: no
output may be one of the command's inputs, nor another of its outputs, so that a run never
replaces a file it was given (or its own results with its metrics).

Paths are compared as the files they reach: symbolic links and ``./x`` resolved, and hard links
of files that exist. An output folder (``bench --output-dir``) holds everything under it; an input
folder (a checkpoint or tokenizer directory) holds the files its readers take from it.
"""

from __future__ import annotations

import fnmatch
import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import OutputError

# The flags that name files or folders a command reads, as argparse stores them.
INPUT_FLAGS = (("prompts", "--prompts"), ("input", "--input"), ("data", "--data"), ("policy", "--policy"),
               ("hardware", "--hardware"), ("model", "--model"), ("tokenizer", "--tokenizer"))
# What the checkpoint, generation-config and tokenizer readers take from a model folder (its
# direct files): a file of these names written there would replace or join the model.
MODEL_FILES = ("config.json", "generation_config.json", "*.safetensors", "*.bin", "*.index.json", "tokenizer*",
               "vocab*", "merges.txt", "special_tokens_map.json", "added_tokens.json", "chat_template*", "*.model",
               "*.tiktoken")


@dataclass(frozen=True)
class Named:
    """A path as a flag names it; ``folder``: a directory standing for what it holds."""

    flag: str
    path: str
    folder: bool = False

    @property
    def real(self) -> Path:
        return Path(os.path.realpath(self.path))

    def says(self) -> str:
        return f"{self.flag} {self.path}"


def check_outputs(args, files: dict[str, str | None], folders: dict[str, str | None] | None = None) -> None:
    """Refuse, in one line naming both flags, an output (``files``: flag -> path; ``folders``: flag
    -> a folder the command writes into) that is one of the inputs ``args`` names, or that another
    output also names. Outputs not given (None) are skipped."""
    outputs = [Named(flag, str(path)) for flag, path in files.items() if path]
    outputs += [Named(flag, str(path), folder=True) for flag, path in (folders or {}).items() if path]
    for i, out in enumerate(outputs):
        for other in outputs[i + 1:]:
            if _overlap(out, other):
                raise OutputError(f"{out.says()} and {other.says()} name the same file; give each output its own path")
        for source in command_inputs(args):
            problem = _clash(out, source)
            if problem:
                raise OutputError(f"{out.says()} {problem}; give {out.flag} another path")


def command_inputs(args) -> list[Named]:
    """The files and folders that exist among those ``args`` names for reading (one that does not
    exist cannot be destroyed, and a registry name or a packaged profile is no file)."""
    found = []
    for name, flag in INPUT_FLAGS:
        value = getattr(args, name, None)
        if isinstance(value, str) and value and os.path.exists(value):
            found.append(Named(flag, value, folder=os.path.isdir(value)))
    return found


def _clash(out: Named, source: Named) -> str | None:
    """How writing ``out`` would destroy the input ``source``, in words; None if it would not."""
    if out.folder:
        return f"holds {source.says()}: its files would overwrite the input" if _within(source.real, out.real) else None
    if source.folder:
        inside = out.real.parent == source.real and any(fnmatch.fnmatch(out.real.name, p) for p in MODEL_FILES)
        return f"is a file of {source.says()}: writing it would damage the model" if inside else None
    return f"is also {source.says()}: writing it would destroy the input" if _same_file(out, source) else None


def _overlap(a: Named, b: Named) -> bool:
    """Whether two outputs may write the same file: the same path, or one in the other's folder."""
    if a.folder and b.folder:
        return _within(a.real, b.real) or _within(b.real, a.real)
    if a.folder or b.folder:
        return _within(b.real, a.real) if a.folder else _within(a.real, b.real)
    return _same_file(a, b)


def _same_file(a: Named, b: Named) -> bool:
    if a.real == b.real:
        return True
    try:  # hard links, and names a case-insensitive file system folds together
        return os.path.samefile(a.path, b.path)
    except OSError:  # either is not there yet: then the resolved paths decided
        return False


def _within(path: Path, folder: Path) -> bool:
    return path == folder or path.is_relative_to(folder)
