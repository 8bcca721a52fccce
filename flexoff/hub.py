"""Hugging Face Hub ids as checkpoints: the local cache first, else a download of only what flexoff reads.

``hub_checkpoint("facebook/opt-1.3b", need)`` returns a snapshot folder of the Hub cache holding
``config.json`` (with ``generation_config.json``) and, as ``need`` asks, the tokenizer files and the
weights. Every failure (no such repo, a gated one, no network, offline mode with nothing cached, no
weights flexoff can read) is one ``HubError`` line naming the repo.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

from .errors import HubError

# What a caller needs from a repo; each includes the ones before it.
NEEDS = ("config", "tokenizer", "weights")

# The files a tokenizer may be made of (transformers reads those present).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja")
# Any one of these makes a tokenizer loadable (as tokenizer.Tokenizer.available checks).
_TOKENIZER_MAIN = ("tokenizer.json", "tokenizer.model", "vocab.json")
_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")

# owner/name as the Hub spells ids: no path syntax (".", "..", leading "/" or "~" mean a local path).
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")


def is_hub_id(name: str) -> bool:
    return bool(_HUB_ID.fullmatch(name)) and ".." not in name and "--" not in name


def hub_checkpoint(repo_id: str, need: str = "weights") -> Path:
    """The cached snapshot of ``repo_id`` holding what ``need`` asks for, downloaded first if the
    cache lacks it and the Hub may be reached."""
    if need not in NEEDS:
        raise ValueError(f"need must be one of {NEEDS}, not {need!r}")
    hub = _import_hub(repo_id)
    cache = _cache_dir(hub)
    cached = _cached_snapshot(hub, repo_id, cache)
    if cached is not None and _holds(cached, need):
        return cached
    if _offline():
        if cached is None:
            raise HubError(f"{repo_id} is not a local directory, and it is not in the Hugging Face cache ({cache}) "
                           "while HF_HUB_OFFLINE is set; download it once online, or give a checkpoint directory")
        if need == "weights" and not _weights_complete(cached):
            raise HubError(f"{repo_id}: the cached snapshot {cached} has no complete weights (*.safetensors or "
                           "pytorch_model*.bin) and HF_HUB_OFFLINE is set; download it once online, or use "
                           "dummy weights")
        return cached  # without tokenizer files: text prompts then need a tokenizer given separately
    errors = _hub_errors(hub)
    try:
        # One request, not retried: an unreachable Hub fails at once. The listing names every file.
        files = [sibling.rfilename for sibling in hub.model_info(repo_id).siblings or ()]
        wanted = choose_files(repo_id, files, need)
        snapshot = Path(hub.snapshot_download(repo_id, allow_patterns=wanted, cache_dir=cache))
    except errors as exc:
        raise _explain(hub, repo_id, cache, cached, exc) from None
    if not _holds(snapshot, need, expect_tokenizer=any(f in wanted for f in _TOKENIZER_MAIN)):
        raise HubError(f"{repo_id}: the download into {snapshot} is incomplete; run again to resume it")
    return snapshot


def choose_files(repo_id: str, files: list[str], need: str) -> list[str]:
    """The files of the repo listing ``files`` that flexoff reads for ``need``: config.json, the
    tokenizer's files, and one weight format (safetensors if present, else PyTorch .bin)."""
    top = {name for name in files if "/" not in name}  # subfolders hold other formats (onnx, ...)
    if "config.json" not in top:
        raise HubError(f"{repo_id} has no config.json on the Hugging Face Hub, so it is not a transformers "
                       "checkpoint flexoff can read")
    # generation_config.json: end-of-sequence ids and sampling defaults (flexoff.generation_config).
    wanted = ["config.json"] + [name for name in ("generation_config.json",) if name in top]
    if need == "config":
        return wanted
    wanted += [name for name in TOKENIZER_FILES if name in top]
    if need == "tokenizer":
        return wanted
    weights = _weight_files(top)
    if not weights:
        raise HubError(f"{repo_id} has no weights flexoff reads on the Hugging Face Hub (*.safetensors or "
                       "pytorch_model*.bin; TF, Flax, GGUF and ONNX files are not read)")
    return wanted + weights


def _weight_files(top: set[str]) -> list[str]:
    safetensors = sorted(name for name in top if name.endswith(".safetensors"))
    # Some repos add a second copy in another layout (consolidated.safetensors): keep the transformers one.
    if any(name.startswith("model") for name in safetensors):
        safetensors = [name for name in safetensors if name.startswith("model")]
    if safetensors:
        return safetensors + [name for name in _INDEXES[:1] if name in top]
    bins = sorted(name for name in top if name.startswith("pytorch_model") and name.endswith(".bin"))
    return bins + [name for name in _INDEXES[1:] if name in top] if bins else []


def _holds(snapshot: Path, need: str, expect_tokenizer: bool = True) -> bool:
    """Whether ``snapshot`` has what ``need`` asks for; ``expect_tokenizer`` False for repos without one."""
    if not (snapshot / "config.json").is_file():
        return False
    if need != "config" and expect_tokenizer and not any((snapshot / f).is_file() for f in _TOKENIZER_MAIN):
        return False
    return need != "weights" or _weights_complete(snapshot)


def _weights_complete(snapshot: Path) -> bool:
    """Weights as CheckpointWeights reads them: every shard an index names, else some weight file."""
    for index in _INDEXES:
        if (snapshot / index).is_file():
            try:
                shards = set(json.loads((snapshot / index).read_text())["weight_map"].values())
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                return False
            return all((snapshot / shard).is_file() for shard in shards)
    return any(snapshot.glob("*.safetensors")) or any(snapshot.glob("pytorch_model*.bin"))


def _import_hub(repo_id: str):
    try:
        import huggingface_hub
        import huggingface_hub.constants  # noqa: F401  (submodules: not loaded by the package itself)
        import huggingface_hub.errors  # noqa: F401
    except ImportError:
        raise HubError(f"{repo_id} is not a local directory or a registry name; as a Hugging Face Hub id it needs "
                       "huggingface_hub 0.24 or newer: pip install 'flexoff[hf]'") from None
    return huggingface_hub


def _offline() -> bool:
    # Read at each call, not at import as huggingface_hub does, so the setting of this run counts.
    return any(os.environ.get(name, "").upper() in ("1", "ON", "YES", "TRUE")
               for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def _cache_dir(hub) -> str:
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return os.path.join(os.environ["HF_HOME"], "hub")
    return hub.constants.HF_HUB_CACHE


def _cached_snapshot(hub, repo_id: str, cache: str) -> Path | None:
    """The snapshot folder the cache's ``main`` ref points to, if it holds a config.json."""
    try:
        config = hub.try_to_load_from_cache(repo_id, "config.json", cache_dir=cache)
    except ValueError as exc:  # an id the Hub would refuse
        raise HubError(f"{repo_id} is not a local directory, a registry name or a valid Hugging Face Hub id "
                       f"({_first_line(exc)})") from None
    return Path(config).parent if isinstance(config, str) else None


def _hub_errors(hub) -> tuple[type[BaseException], ...]:
    """What the Hub client raises for a refused, missing or unreachable repo; the transport library's
    own errors differ between huggingface_hub versions (requests, httpx)."""
    transport = tuple(module.HTTPError for name in ("httpx", "httpx2")
                      if (module := sys.modules.get(name)) is not None and hasattr(module, "HTTPError"))
    return (OSError, ValueError, hub.errors.HfHubHTTPError) + transport


def _explain(hub, repo_id: str, cache: str, cached: Path | None, exc: BaseException) -> HubError:
    errors = hub.errors
    login = "log in with `hf auth login` or set HF_TOKEN"
    if isinstance(exc, errors.GatedRepoError):
        return HubError(f"{repo_id} is a gated model on the Hugging Face Hub: accept its terms at "
                        f"https://huggingface.co/{repo_id}, then {login}")
    if isinstance(exc, errors.RepositoryNotFoundError):
        return HubError(f"{repo_id} is not a local directory, and the Hugging Face Hub has no model of that name "
                        f"(if it is private, {login})")
    if isinstance(exc, errors.RevisionNotFoundError):
        return HubError(f"{repo_id}: the Hugging Face Hub has no main revision of it")
    if isinstance(exc, errors.HfHubHTTPError) and getattr(exc, "response", None) is not None \
            and exc.response.status_code in (401, 403):
        return HubError(f"the Hugging Face Hub refused access to {repo_id} ({_first_line(exc)}); {login}")
    if isinstance(exc, errors.HfHubHTTPError):
        return HubError(f"the Hugging Face Hub failed to serve {repo_id}: {_first_line(exc)}")
    if isinstance(exc, ValueError):
        return HubError(f"{repo_id} is not a local directory, a registry name or a valid Hugging Face Hub id "
                        f"({_first_line(exc)})")
    if isinstance(exc, OSError) and exc.errno is not None and exc.strerror:
        return HubError(f"cannot download {repo_id} into {cache}: {exc.strerror}")
    held = (f"and the cached snapshot {cached} lacks files it needs" if cached is not None
            else f"and it is not in the cache {cache}")
    return HubError(f"cannot reach the Hugging Face Hub for {repo_id} ({type(exc).__name__}: {_first_line(exc)}), "
                    f"{held}; check the network or give a checkpoint directory")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    line = text[0] if text else type(exc).__name__
    return line if len(line) <= 200 else line[:197] + "..."
