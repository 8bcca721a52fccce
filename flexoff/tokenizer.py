"""Tokenizers from a checkpoint directory, through transformers when present, else tokenizers."""

from __future__ import annotations

from pathlib import Path

from .errors import TokenizerError
from .models.config import config_from_dir, model_directory


class Tokenizer:
    """encode/decode over a checkpoint's tokenizer files, with the special tokens it declares."""

    def __init__(self, path: str | Path):
        path = Path(path)
        self.path = path
        self._hf = None
        self._raw = None
        try:
            from transformers import AutoTokenizer
        except ImportError:
            AutoTokenizer = None
        if AutoTokenizer is not None:
            try:
                self._hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
            except Exception as exc:  # transformers raises many types for missing or broken files
                raise TokenizerError(f"cannot load the tokenizer in {path}: {exc}") from None
            return
        try:
            from tokenizers import Tokenizer as RawTokenizer
        except ImportError:
            raise TokenizerError(
                "text prompts need the tokenizer libraries: pip install 'flexoff[hf]'"
            ) from None
        file = path / "tokenizer.json"
        if not file.exists():
            raise TokenizerError(f"{path} has no tokenizer.json")
        try:
            self._raw = RawTokenizer.from_file(str(file))
        except Exception as exc:
            raise TokenizerError(f"cannot load {file}: {exc}") from None

    @classmethod
    def for_model(cls, model: str | Path | None, tokenizer: str | Path | None = None) -> "Tokenizer | None":
        """The tokenizer in ``tokenizer``, else in the checkpoint of ``model`` (a directory, or a Hub id
        whose tokenizer files are fetched); None if neither has one (a registry name has none).

        A checkpoint's config.json is checked first: transformers reads it too while loading a
        tokenizer, and would report a malformed value in it as a broken tokenizer.
        """
        if tokenizer:
            directory = Path(tokenizer)
        else:
            directory = model_directory(model, "tokenizer") if model is not None else None
            if directory is not None:
                config_from_dir(directory)
        return cls(directory) if directory is not None and cls.available(directory) else None

    @staticmethod
    def available(path: str | Path) -> bool:
        path = Path(path)
        return any((path / name).exists() for name in ("tokenizer.json", "tokenizer.model", "vocab.json"))

    def encode(self, text: str) -> list[int]:
        if self._hf is not None:
            return list(self._hf(text)["input_ids"])
        return self._raw.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        if self._hf is not None:
            return self._hf.decode(ids, skip_special_tokens=True)
        return self._raw.decode(ids, skip_special_tokens=True)
