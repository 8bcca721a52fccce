"""A tiny OPT checkpoint with a byte-level BPE tokenizer, built here so nothing is downloaded.

The tokenizer is trained on the fixture data and a few sentences, so scenario prompts encode
to few tokens and decode back to the same text.
"""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import pytest
import torch

from tests import processes

DATA = Path(__file__).parent / "data"
REPO = Path(__file__).resolve().parents[2]
SPECIALS = ["<unk>", "<pad>", "</s>"]  # ids 0, 1, 2: OPT's pad is 1, its BOS and EOS are 2
CORPUS = [
    "The following are multiple choice questions (with answers) about abstract algebra.",
    "Please solve the following problem. Rules: Target: Result: Fact: Summarize the above article.",
    "Question: Answer: A. B. C. D. ###\nArticle: The cat sat on the mat and the dog ran to the house.",
    "0 1 2 3 4 5 6 7 8 9 + - * = | \" , . : ; ? ! ( ) { } [ ]",
]


def build_tokenizer(directory: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = list(CORPUS)
    for file in sorted(DATA.glob("*.jsonl")):
        corpus.extend(file.read_text().splitlines())
    raw = Tokenizer(models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    raw.train_from_iterator(corpus, trainer)
    raw.post_processor = processors.TemplateProcessing(single="</s> $A", special_tokens=[("</s>", 2)])
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="</s>", eos_token="</s>", pad_token="<pad>",
                                  unk_token="<unk>")
    tok.save_pretrained(directory)
    return tok


def build_tiny_opt(directory: Path, max_positions: int = 1024, seed: int = 0):
    from transformers import OPTConfig, OPTForCausalLM

    tok = build_tokenizer(directory)
    torch.manual_seed(seed)
    config = OPTConfig(
        vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, ffn_dim=64, num_attention_heads=4,
        max_position_embeddings=max_positions, pad_token_id=1, bos_token_id=2, eos_token_id=2,
        dropout=0.0, attention_dropout=0.0, word_embed_proj_dim=32,
    )
    model = OPTForCausalLM(config)
    with torch.no_grad():  # wide weights make greedy choices decisive rather than near-ties
        for param in model.parameters():
            param.normal_(0.0, 0.2)
    model.eval()
    model.save_pretrained(directory)
    return model, tok


@pytest.fixture(scope="session")
def tiny_opt(tmp_path_factory):
    """(checkpoint directory, HF model, HF tokenizer), built once per session."""
    directory = tmp_path_factory.mktemp("tiny-opt")
    model, tok = build_tiny_opt(directory)
    return directory, model, tok


@pytest.fixture(scope="session")
def tiny_llm(tiny_opt):
    from flexoff import LLM, Policy

    # On the CPU in fp32 wherever the tests run: they compare with transformers' fp32 figures.
    llm = LLM(str(tiny_opt[0]), policy=Policy(gpu_batch_size=4), device="cpu", dtype="float32")
    yield llm
    llm.close()


CHAT_TEMPLATE = ("{% for m in messages %}### {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}### assistant:{% endif %}")


@pytest.fixture(scope="session")
def chat_opt(tiny_opt, tmp_path_factory):
    """(a copy of the tiny checkpoint whose tokenizer has a chat template, its LLM)."""
    import shutil

    from transformers import AutoTokenizer

    from flexoff import LLM, Policy

    path = tmp_path_factory.mktemp("chat") / "opt"
    shutil.copytree(tiny_opt[0], path)
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(path)
    llm = LLM(str(path), policy=Policy(gpu_batch_size=4))
    yield path, llm
    llm.close()


@pytest.fixture(scope="session")
def lm_eval_index_once():
    """lm_eval indexes its own thousands of task files whenever a TaskManager is made (7 s of CPU,
    and many reads); here that index is made once a session and copied, include paths still read
    each time. Where lm_eval has no such index (other releases), nothing changes."""
    try:
        from lm_eval.tasks import _index
    except ImportError:
        yield
        return
    import copy

    build, own, made = _index.TaskIndex.build, Path(_index.__file__).parent, {}

    def build_own_once(paths, **kwargs):
        index = {}
        for root in paths:  # later paths override earlier ones, as in one build
            if Path(root) != own:
                index.update(build([root], **kwargs))
                continue
            key = tuple(sorted(kwargs.items()))
            if key not in made:
                made[key] = build([root], **kwargs)
            index.update(copy.deepcopy(made[key]))
        return index

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_index.TaskIndex, "build", staticmethod(build_own_once))
        yield


def run_cli(*args: str, timeout: float = processes.LIMIT_SECONDS, **popen) -> subprocess.CompletedProcess:
    """``python -m flexoff ARGS`` in a subprocess, from the repository root."""
    return processes.run_flexoff(*args, timeout=timeout, **popen)


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return path


def write_lm_eval_tasks(directory: Path, tasks: dict, docs: list) -> Path:
    """lm_eval task files in ``directory``, one per entry of ``tasks`` (name -> the task's fields),
    each with ``docs`` as its test split."""
    import yaml

    data = write_jsonl(directory / "docs.json", docs)
    for name, spec in tasks.items():
        config = {"task": name, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data)}},
                  "test_split": "test", **spec}
        (directory / f"{name}.yaml").write_text(yaml.safe_dump(config))
    return directory


def failing(monkeypatch, bad_prompt: str | list[int], reason: str = "logits turned non-finite at decode step 1"):
    """Make ``LLM.generate`` report the sequence of ``bad_prompt`` as failed, as the runtime does for
    non-finite logits: no tokens, finish reason "error", and the reason."""
    from dataclasses import replace

    from flexoff.api import LLM, GenerationResult

    original = LLM.generate

    def broken(out):
        if out.prompt != bad_prompt and out.prompt_token_ids != bad_prompt:
            return out
        return replace(out, text=None, token_ids=[], logprobs=[], finish_reason="error", error=reason)

    def generate(self, prompts, params=None, *, progress=False, on_block=None, **kwargs):
        hook = None if on_block is None else (lambda outs, metrics: on_block([broken(o) for o in outs], metrics))
        result = original(self, prompts, params, progress=progress, on_block=hook, **kwargs)
        return GenerationResult([broken(o) for o in result], result.metrics)

    monkeypatch.setattr(LLM, "generate", generate)


# ``python -m flexoff ARGS`` that kills itself with SIGKILL right after the write that brings its
# results file to LINES lines: the job is cut in the middle, however fast or loaded the machine.
KILLED_AFTER_LINES = """
import os, runpy, signal, sys
from flexoff.harness.store import ResultStore

lines, path = int(sys.argv[1]), sys.argv[2]
append = ResultStore.append


def append_then_die(self, records):
    append(self, records)
    with open(path, "rb") as written:
        if written.read().count(b"\\n") >= lines:
            os.kill(os.getpid(), signal.SIGKILL)


ResultStore.append = append_then_die
sys.argv = ["flexoff", *sys.argv[3:]]
runpy.run_module("flexoff", run_name="__main__", alter_sys=True)
"""


def kill_after_lines(argv: list[str], output: Path, lines: int, env: dict) -> int:
    """Run ``argv`` (``python -m flexoff ...``) in a child killed with SIGKILL once ``output``
    holds ``lines`` lines, and return how many it held then."""
    assert list(argv[1:3]) == ["-m", "flexoff"], argv
    job = processes.start([argv[0], "-c", KILLED_AFTER_LINES, str(lines), str(output), *argv[3:]], env=env,
                          cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _, err = processes.communicate(job, what=f"the job to be killed at {lines} lines of {output}")
    assert job.returncode == -signal.SIGKILL, f"the job ended with code {job.returncode} before it was killed: {err}"
    return output.read_bytes().count(b"\n")
