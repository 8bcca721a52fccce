"""Tokenizers from a checkpoint directory, through transformers when present, else tokenizers; a
GGUF file's tokenizer and chat template from its metadata, as transformers reads them."""

from __future__ import annotations

from pathlib import Path

from .errors import PromptError, TokenizerError
from .fileio import nothing_at
from .gguf_format import GGUFFile
from .models import config_from_dir, gguf_path, model_directory

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


class Tokenizer:
    """encode/decode over a checkpoint's tokenizer files, with the special tokens it declares."""

    def __init__(self, path: str | Path):
        path = Path(path)
        self.path = path
        self._hf = None
        self._raw = None
        gguf = gguf_path(path)
        if gguf is not None:
            self._hf = _gguf_tokenizer(gguf)
            return
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
        whose tokenizer files are fetched); None if the model has none (a registry name has none). A
        ``tokenizer`` given that is not a folder with tokenizer files is an error naming it.

        A checkpoint's config.json is checked first: transformers reads it too while loading a
        tokenizer, and would report a malformed value in it as a broken tokenizer.
        """
        if tokenizer is not None:
            directory = Path(tokenizer)
            if not directory.is_dir():
                reason = "does not exist" if nothing_at(directory) else "is not a directory"
                raise TokenizerError(f"tokenizer {str(tokenizer)!r} {reason}; give the folder that holds "
                                     f"{' or '.join(TOKENIZER_FILES)}")
            if not cls.available(directory):
                raise TokenizerError(f"tokenizer folder {str(tokenizer)!r} has no tokenizer files "
                                     f"({', '.join(TOKENIZER_FILES)})")
            return cls(directory)
        directory = model_directory(model, "tokenizer") if model is not None else None
        if directory is None:
            return None
        config_from_dir(directory)
        return cls(directory) if cls.available(directory) else None

    @staticmethod
    def available(path: str | Path) -> bool:
        path = Path(path)
        gguf = gguf_path(path)
        if gguf is not None:  # a GGUF file may leave its tokenizer out, as a checkpoint may its files
            file = GGUFFile(gguf)
            file.close()
            return "tokenizer.ggml.tokens" in file.metadata
        return any((path / name).exists() for name in TOKENIZER_FILES)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """``add_special_tokens`` False for text that already holds them (a chat template's output)."""
        if self._hf is not None:
            return list(self._hf(text, add_special_tokens=add_special_tokens)["input_ids"])
        return self._raw.encode(text, add_special_tokens=add_special_tokens).ids

    @property
    def hf(self):
        """The transformers tokenizer in use; None where only the tokenizers library is installed."""
        return self._hf

    @property
    def chat_template(self) -> str | None:
        return getattr(self._hf, "chat_template", None) if self._hf is not None else None

    def apply_chat_template(self, conversation: list[dict], *, add_generation_prompt: bool = True,
                            chat_template: str | None = None, **kwargs) -> str:
        """The conversation as the prompt text its template makes (special tokens included)."""
        if self._hf is None:
            raise TokenizerError("chat templates need transformers: pip install 'flexoff[hf]'")
        if chat_template is None and not self.chat_template:
            raise TokenizerError(f"the tokenizer in {self.path} has no chat template; give one (chat_template= "
                                 "in Python), or use plain prompts")
        try:
            return self._hf.apply_chat_template(conversation, chat_template=chat_template, tokenize=False,
                                                add_generation_prompt=add_generation_prompt, **kwargs)
        except Exception as exc:  # jinja2 and transformers raise many types for a template that refuses
            raise PromptError(f"the chat template failed on it: {type(exc).__name__}: {exc}") from None

    def decode(self, ids: list[int]) -> str:
        if self._hf is not None:
            return self._hf.decode(ids, skip_special_tokens=True)
        return self._raw.decode(ids, skip_special_tokens=True)

    def tokens(self, ids: list[int]) -> list[str]:
        """Each id's token as the vocabulary spells it ("" for an unknown id), as vLLM's decoded_token."""
        if self._hf is not None:
            return [t or "" for t in self._hf.convert_ids_to_tokens(ids)]
        return [self._raw.id_to_token(i) or "" for i in ids]


def _gguf_tokenizer(file: Path):
    """transformers' tokenizer of a GGUF file, built from its metadata (it needs the gguf package)."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise TokenizerError(f"the tokenizer of {file} needs transformers: pip install 'flexoff[hf]'") from None
    try:
        import gguf  # noqa: F401  (transformers reads the file's tokenizer through it)
    except ImportError:
        raise TokenizerError(f"the tokenizer of {file} is read through the gguf package: pip install gguf") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name, local_files_only=True)
    except Exception as exc:  # transformers raises many types for metadata it cannot use
        raise TokenizerError(f"cannot load the tokenizer of {file}: {exc}") from None
    _mark_specials_as_stored(tokenizer, GGUFFile(file).metadata)
    return tokenizer


def _mark_specials_as_stored(tokenizer, metadata: dict) -> None:
    """Whether encoding adds BOS and EOS, as the file says: transformers 5.0 adds BOS to SmolLM2's
    tokenizer, whose file says add_bos_token false (later releases read the key)."""
    changed = False
    for name in ("add_bos_token", "add_eos_token"):
        stored = metadata.get(f"tokenizer.ggml.{name}")
        if isinstance(stored, bool) and getattr(tokenizer, name, stored) != stored:
            setattr(tokenizer, name, stored)
            changed = True
    if changed and hasattr(tokenizer, "update_post_processor"):
        tokenizer.update_post_processor()
