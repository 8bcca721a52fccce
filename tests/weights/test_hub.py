"""Hugging Face Hub ids: the local cache first (laid out as huggingface_hub lays it out), a download
of only what flexoff reads through a stubbed transport, and one-line errors naming the repo."""

from __future__ import annotations

import errno
import fnmatch
import hashlib
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import huggingface_hub
from huggingface_hub import errors as hub_errors

from flexoff import LLM, SamplingParams
from flexoff.commands.main import main
from flexoff.errors import HubError, UnknownModelError
from flexoff.models import resolve_model
from flexoff.tokenizer import Tokenizer
from tests.conftest import PROMPTS, assert_same_outputs, generate

REPO = "tiny-org/tiny-opt"
REVISION = "0123456789abcdef0123456789abcdef01234567"
PARAMS = SamplingParams(max_new_tokens=4, ignore_eos=True)
# Files a real repo carries beside the ones flexoff reads; none of them may be fetched.
EXTRAS = ["README.md", "tf_model.h5", "flax_model.msgpack", "onnx/model.onnx", "training_args.bin"]


def lay_out(cache: Path, repo_id: str, files: dict[str, Path], revision: str = REVISION) -> Path:
    """Put ``files`` (name -> source) in ``cache`` as huggingface_hub does: content-addressed blobs,
    a snapshot folder of relative symlinks to them, and refs/main naming the snapshot."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / revision
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    for name, source in files.items():
        data = source.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.is_symlink():
            link.unlink()
        link.symlink_to(Path("../" * (len(Path(name).parts) + 1)) / "blobs" / blob.name)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(revision)
    return snapshot


def no_network(*args, **kwargs):
    raise AssertionError("the Hub was contacted")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty Hub cache for the test, online, and no real network call possible."""
    path = tmp_path / "hf-cache"
    path.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(path))
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(huggingface_hub, "model_info", no_network)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_network)
    return path


class FakeHub:
    """Serves a repo from a local folder through stubs of the two huggingface_hub calls flexoff makes,
    writing into the cache as the real snapshot_download does, and records what was asked."""

    def __init__(self, monkeypatch, source: Path, extras=EXTRAS):
        self.remote = {p.name: p for p in source.iterdir() if p.is_file()}
        filler = source.parent / f"{source.name}-extras"
        for name in extras:
            path = filler / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(b"not read by flexoff " + name.encode())
            self.remote.setdefault(name, path)
        self.requested: list[list[str]] = []
        monkeypatch.setattr(huggingface_hub, "model_info", self.model_info)
        monkeypatch.setattr(huggingface_hub, "snapshot_download", self.snapshot_download)

    def model_info(self, repo_id, **kwargs):
        assert repo_id == REPO
        return SimpleNamespace(sha=REVISION, siblings=[SimpleNamespace(rfilename=n) for n in sorted(self.remote)])

    def snapshot_download(self, repo_id, *, allow_patterns=None, cache_dir=None, **kwargs):
        assert repo_id == REPO and cache_dir is not None
        self.requested.append(sorted(allow_patterns))
        chosen = {name: path for name, path in self.remote.items()
                  if any(fnmatch.fnmatch(name, pattern) for pattern in allow_patterns)}
        return str(lay_out(Path(cache_dir), repo_id, chosen))


def one_line_exit_2(argv, capsys) -> str:
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    return err


# The cache, offline

def test_a_cached_hub_id_runs_offline_as_its_local_directory(tiny_model_dir, cache, monkeypatch):
    path, _ = tiny_model_dir("opt-pre")
    lay_out(cache, REPO, {p.name: p for p in path.iterdir()})
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    outs = generate(REPO, None, params=PARAMS)
    assert_same_outputs(outs, generate(path, None, params=PARAMS))
    assert [o.text for o in outs] == [o.text for o in generate(path, None, params=PARAMS)]
    config, directory = resolve_model(REPO)
    assert config.name == REPO and directory.parent.parent.name == "models--tiny-org--tiny-opt"


def test_hf_home_locates_the_cache(tiny_model_dir, cache, tmp_path, monkeypatch):
    path, _ = tiny_model_dir("opt-pre")
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    lay_out(tmp_path / "home" / "hub", REPO, {p.name: p for p in path.iterdir()})
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_model(REPO)[1].is_dir()


def test_offline_with_nothing_cached_is_one_line(cache, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    err = one_line_exit_2(["run", "--model", REPO, "--dummy", "--quiet"], capsys)
    assert REPO in err and "HF_HUB_OFFLINE" in err and str(cache) in err


def test_dummy_weights_need_only_the_cached_config(tiny_model_dir, cache, monkeypatch, capsys):
    path, _ = tiny_model_dir("opt-pre")
    lay_out(cache, REPO, {"config.json": path / "config.json"})
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["run", "--model", REPO, "--dummy", "--quiet", "--num-prompts", "2", "--prompt-len", "4",
                 "--gen-len", "2"]) == 0
    assert f"model      {REPO} " in capsys.readouterr().out
    assert main(["search", "--model", REPO, "--hardware", "t4", "--prompt-len", "8", "--gen-len", "2"]) == 0
    err = one_line_exit_2(["run", "--model", REPO, "--quiet"], capsys)
    assert REPO in err and "no complete weights" in err and "HF_HUB_OFFLINE" in err


def test_registry_names_and_local_directories_win_over_the_hub(tiny_model_dir, cache, tmp_path, monkeypatch):
    path, _ = tiny_model_dir("opt-pre")
    config, directory = resolve_model("OPT-125m", dummy=True)
    assert config.name == "opt-125m" and directory is None
    local = tmp_path / "work" / REPO
    shutil.copytree(path, local)
    monkeypatch.chdir(tmp_path / "work")
    config, directory = resolve_model(REPO)  # a relative directory that looks like a Hub id
    assert directory == Path(REPO) and config.name == "tiny-opt"


def test_an_owner_slash_name_is_a_hub_id_not_a_registry_name(cache, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(HubError, match="facebook/opt-125m is not a local directory"):
        resolve_model("facebook/opt-125m", dummy=True)


# Downloads, through a stubbed transport

@pytest.mark.parametrize("safetensors", [True, False], ids=["safetensors", "bin"])
def test_a_download_fetches_only_what_flexoff_reads_then_the_cache_serves(tiny_model_dir, cache, monkeypatch,
                                                                          safetensors):
    path, _ = tiny_model_dir("opt-pre", safetensors)
    extras = EXTRAS + (["pytorch_model.bin", "consolidated.safetensors"] if safetensors else [])
    hub = FakeHub(monkeypatch, path, extras)
    outs = generate(REPO, None, params=PARAMS)
    weights = ["model.safetensors"] if safetensors else ["pytorch_model.bin"]
    assert hub.requested == [sorted(["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                                     *weights])]
    assert_same_outputs(outs, generate(path, None, params=PARAMS))
    assert [o.text for o in outs] == [o.text for o in generate(path, None, params=PARAMS)]
    generate(REPO, None, params=PARAMS)
    assert len(hub.requested) == 1  # the second run found everything in the cache


def test_a_dummy_download_fetches_only_the_config(tiny_model_dir, cache, monkeypatch):
    hub = FakeHub(monkeypatch, tiny_model_dir("opt-pre")[0])
    with LLM(REPO, dummy=True) as llm:
        assert llm.config.name == REPO
    assert hub.requested == [["config.json", "generation_config.json"]]


def test_the_tokenizer_alone_fetches_no_weights(tiny_model_dir, cache, monkeypatch):
    path, _ = tiny_model_dir("opt-pre")
    hub = FakeHub(monkeypatch, path)
    tokenizer = Tokenizer.for_model(REPO)
    assert hub.requested == [["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"]]
    assert tokenizer.encode(PROMPTS[0]) == Tokenizer(path).encode(PROMPTS[0])


def test_a_partial_cache_is_completed_by_a_download(tiny_model_dir, cache, monkeypatch):
    path, _ = tiny_model_dir("opt-pre")
    lay_out(cache, REPO, {"config.json": path / "config.json"})  # left by a dummy run
    hub = FakeHub(monkeypatch, path)
    resolve_model(REPO)
    assert len(hub.requested) == 1 and "model.safetensors" in hub.requested[0]


# One-line errors

def _http_error(cls, status: int):
    """An instance of a huggingface_hub HTTP error as the client raises it, with a response."""
    import httpx2

    url = f"https://huggingface.co/api/models/{REPO}"
    return cls(f"{status} Client Error for url: {url}\nmore detail",
               response=httpx2.Response(status, request=httpx2.Request("GET", url)))


def _connect_error():
    import httpx2

    return httpx2.ConnectError("[Errno -2] Name or service not known")


@pytest.mark.parametrize("raised, message", [
    (lambda: _http_error(hub_errors.RepositoryNotFoundError, 404), "has no model of that name"),
    (lambda: _http_error(hub_errors.GatedRepoError, 403), "gated model"),
    (lambda: _http_error(hub_errors.HfHubHTTPError, 401), "refused access"),
    (lambda: _http_error(hub_errors.HfHubHTTPError, 503), "failed to serve"),
    (_connect_error, "cannot reach the Hugging Face Hub"),
    (lambda: OSError(errno.ENOSPC, "No space left on device"), "No space left on device"),
], ids=["not-found", "gated", "unauthorized", "server-error", "no-network", "disk-full"])
@pytest.mark.parametrize("call", ["model_info", "snapshot_download"])
def test_hub_failures_are_one_line_naming_the_repo(tiny_model_dir, cache, monkeypatch, capsys, raised, message,
                                                    call):
    FakeHub(monkeypatch, tiny_model_dir("opt-pre")[0])

    def fail(*args, **kwargs):
        raise raised()

    monkeypatch.setattr(huggingface_hub, call, fail)
    err = one_line_exit_2(["run", "--model", REPO, "--quiet"], capsys)
    assert REPO in err and message in err and "more detail" not in err


@pytest.mark.parametrize("extras, removed, message", [
    (["tf_model.h5", "flax_model.msgpack"], "model.safetensors", "has no weights flexoff reads"),
    ([], "config.json", "has no config.json"),
])
def test_a_repo_without_what_flexoff_reads_is_refused(tiny_model_dir, cache, monkeypatch, capsys, extras, removed,
                                                      message):
    hub = FakeHub(monkeypatch, tiny_model_dir("opt-pre")[0], extras)
    del hub.remote[removed]
    err = one_line_exit_2(["run", "--model", REPO, "--quiet"], capsys)
    assert REPO in err and message in err and hub.requested == []


def test_without_huggingface_hub_a_hub_id_says_what_to_install(cache, monkeypatch):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    with pytest.raises(HubError, match=r"pip install 'flexoff\[hf\]'"):
        resolve_model(REPO, dummy=True)


def test_a_path_that_is_no_directory_is_an_unknown_model(cache):
    with pytest.raises(UnknownModelError, match="not a checkpoint directory"):
        resolve_model("./no/such/dir")


# A registry name without weights: the message fits both the command line and Python

def test_a_registry_name_without_dummy_names_every_way_out(cache, capsys):
    err = one_line_exit_2(["run", "--model", "opt-1.3b", "--quiet"], capsys)
    with pytest.raises(UnknownModelError) as raised:
        LLM("opt-1.3b")
    for message in (err, str(raised.value)):
        assert "--dummy" in message and "dummy=True in Python" in message and "pass dummy=True" not in message
        assert "Hugging Face Hub id such as facebook/opt-1.3b" in message


def test_a_batch_output_of_one_hub_repo_does_not_resume_for_another_of_the_same_name(tiny_model_dir, cache,
                                                                                     monkeypatch, tmp_path, capsys):
    path, _ = tiny_model_dir("opt-pre")
    for repo in ("org-a/tiny", "org-b/tiny"):
        lay_out(cache, repo, {p.name: p for p in path.iterdir()})
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    prompts = tmp_path / "in.jsonl"
    prompts.write_text('{"id": 1, "prompt": "the cat sat"}\n')
    out = str(tmp_path / "out.jsonl")
    common = ["--input", str(prompts), "--output", out, "--max-new-tokens", "2", "--no-progress"]
    assert main(["batch", "--model", "org-a/tiny", *common]) == 0
    capsys.readouterr()
    err = one_line_exit_2(["batch", "--model", "org-b/tiny", *common], capsys)
    assert out in err
