"""A job over several processes on the CPU (gloo): `flexoff run --pipeline-parallel N
--data-parallel M` starts its processes itself, and they give the tokens one process gives, for
OPT and Llama, greedy and sampled, with weights and cache offloaded on every stage; bad shapes are
refused in one line before any weight loads; a rank that dies ends the job, naming it."""

import json
import os
import re
import signal
import subprocess
import sys

import psutil
import pytest
import torch

from flexoff.commands.main import main
from flexoff.errors import ConfigError, FlexoffError
from flexoff.layout.stage_split import range_layers, stage_ranges
from flexoff.deploy.parallel import Launch, Parallel, check_parallel, rounds
from tests import processes
from tests.conftest import build_model

LAYERS = 4
# Several blocks (4 prompts each), prompts of several lengths and budgets: rotation and replicas
# both have work, and batches finish at different tokens.
PROMPTS = [{"prompt": [5 + i % 7, 9, 11 + i, 3] * (1 + i % 3), "max_new_tokens": 3 + i % 4} for i in range(14)]
OFFLOADED = ["--gpu-batch-size", "2", "--num-gpu-batches", "2", "--percent", "30", "50", "50", "0", "100", "0"]


@pytest.fixture(scope="module")
def deep_model(tmp_path_factory):
    """Tiny OPT and Llama models of four decoder layers (enough for three stages)."""
    made = {}

    def make(kind):
        if kind not in made:
            directory = tmp_path_factory.mktemp(f"{kind}-{LAYERS}")
            build_model(directory, kind, layers=LAYERS)
            made[kind] = directory
        return made[kind]

    return make


def _records(path) -> list:
    return sorted(([r["index"], r["token_ids"], r["finish_reason"], [round(p, 4) for p in r["logprobs"]]]
                   for r in map(json.loads, open(path, encoding="utf-8"))), key=lambda r: r[0])


def _flexoff(*argv):
    proc = processes.run([sys.executable, "-m", "flexoff", *argv])
    return proc.returncode, proc.stdout, proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("kind, sampling, stages, replicas", [
    ("opt-pre", [], 2, 1),
    ("opt-pre", ["--temperature", "0.8", "--seed", "7"], 3, 1),
    ("opt-pre", ["--temperature", "0.8", "--seed", "7"], 2, 2),
    ("llama-gqa", ["--temperature", "0.8", "--seed", "7"], 2, 1),
    ("llama-gqa", [], 3, 1),
    ("llama-gqa", [], 2, 2),
], ids=["opt-2-greedy", "opt-3-sampled", "opt-2x2-sampled", "llama-2-sampled", "llama-3-greedy", "llama-2x2-greedy"])
def test_a_parallel_run_generates_what_one_process_does(deep_model, tmp_path, capsys, kind, sampling, stages, replicas):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    common = ["run", "--model", str(deep_model(kind)), "--prompts", str(prompts), "--device", "cpu", "--quiet",
              "--offload-dir", str(tmp_path), *OFFLOADED, *sampling]
    assert main([*common, "--output", str(tmp_path / "one.jsonl")]) == 0
    code, out, err = _flexoff(*common, "--output", str(tmp_path / "many.jsonl"), "--pipeline-parallel", str(stages),
                              "--data-parallel", str(replicas))
    assert code == 0, err
    assert _records(tmp_path / "many.jsonl") == _records(tmp_path / "one.jsonl")
    # One summary, from rank 0, which says what it speaks of.
    assert out.count("wrote 14 results") == 1
    assert f"parallel   {stages} pipeline stages × {replicas} replica" in out
    # Every process's layers, weights and peaks: the stages of each replica cover the model.
    ranks = re.findall(r"^  rank (\d+) +layers (\d+)–(\d+) · weights device \(cpu\) ", out, re.M)
    assert [int(r) for r, _, _ in ranks] == list(range(stages * replicas))
    covered = [(int(a), int(b)) for _, a, b in ranks[:stages]]
    assert covered[0][0] == 0 and covered[-1][1] == LAYERS - 1
    assert all(b + 1 == a for (_, b), (a, _) in zip(covered, covered[1:]))
    assert not [p for p in tmp_path.iterdir() if p.is_dir()]  # every process removed its offload folder


@pytest.mark.parametrize("argv, message", [
    (["--pipeline-parallel", "13"], "--pipeline-parallel 13 is more than the 12 layers of opt-125m"),
    (["--pipeline-parallel", "2", "--device", "cuda"], "CUDA is not available"),
    (["--pipeline-parallel", "0"], "--pipeline-parallel: must be an integer >= 1"),
    (["--pipeline-parallel", "3", "--gpu-mem", "1GiB,2GiB", "--device", "cpu"],
     "--gpu-mem gives 2 sizes for 3 pipeline stages"),
])
def test_a_job_that_cannot_be_split_is_refused_before_anything_starts(capsys, argv, message):
    assert main(["run", "--quiet", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_a_launch_of_another_size_than_stages_times_replicas_is_refused(monkeypatch, capsys):
    """Under torchrun: three processes cannot be two stages, in one line, before joining them."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    assert main(["run", "--quiet", "--device", "cpu", "--pipeline-parallel", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "flexoff: error: the job has 3 processes, but 2 pipeline stages x 1 replicas make 2"


def _workers(proc) -> list:
    return [p for p in psutil.Process(proc.pid).children(recursive=True) if "flexoff" in " ".join(p.cmdline())]


@pytest.mark.slow
def test_a_rank_that_dies_ends_the_job_naming_it(tmp_path):
    """Kill one process mid-run: the others stop, the launcher names the rank in one line and exits
    non-zero, and no offload folder is left behind, the killed rank's included."""
    proc = processes.start([sys.executable, "-m", "flexoff", "run", "--device", "cpu", "--quiet",
                            "--num-prompts", "64", "--gen-len", "400", "--offload-dir", str(tmp_path),
                            "--percent", "50", "30", "100", "0", "100", "0", "--pipeline-parallel", "2"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def rank_1_once_both_placed_their_weights():  # their offload folders are there then
        workers = _workers(proc)
        if len(workers) == 2 and len([p for p in tmp_path.iterdir() if p.is_dir()]) == 2:
            return next(p for p in workers if p.environ().get("RANK") == "1")

    try:
        victim = processes.wait_until(rank_1_once_both_placed_their_weights, "both ranks to place their weights", proc)
        victim.send_signal(signal.SIGKILL)
        _, err = processes.communicate(proc, what="the job to stop")
    finally:
        processes.kill(proc)
    assert proc.returncode != 0
    assert "flexoff: rank 1 of 2 was killed by signal 9; the job stopped on every rank" in err
    assert "Traceback" not in err
    assert not [p for p in tmp_path.iterdir() if p.is_dir()]


def test_layers_are_split_evenly_with_the_embedding_first_and_the_head_last():
    assert stage_ranges(4, 2) == (range(0, 3), range(3, 6))
    assert stage_ranges(4, 3) == (range(0, 2), range(2, 3), range(3, 6))
    assert stage_ranges(96, 4) == (range(0, 25), range(25, 49), range(49, 73), range(73, 98))
    for layers, stages in [(5, 5), (7, 3), (12, 1)]:
        ranges = stage_ranges(layers, stages)
        assert ranges[0].start == 0 and ranges[-1].stop == layers + 2
        sizes = [len(range_layers(r, layers)) for r in ranges]
        assert [i for r in ranges for i in range_layers(r, layers)] == list(range(layers))
        assert sum(sizes) == layers and max(sizes) - min(sizes) <= 1


def test_rounds_give_each_replica_consecutive_blocks_one_per_stage():
    assert rounds(7, 2, 2) == [[[0, 1], [2, 3]], [[4, 5], [6]]]
    assert rounds(3, 1, 1) == [[[0]], [[1]], [[2]]]
    assert rounds(2, 3, 2) == [[[0, 1]]]  # the second replica has nothing to do
    done = [b for r in rounds(23, 3, 2) for g in r for b in g]
    assert done == list(range(23))


def test_the_launch_and_the_sizes():
    assert Launch.from_env({}) is None
    assert Launch.from_env({"RANK": "3", "WORLD_SIZE": "4"}) == Launch(3, 4, 3, 4)
    with pytest.raises(ConfigError, match="must be integers"):
        Launch.from_env({"RANK": "x", "WORLD_SIZE": "4"})
    with pytest.raises(ConfigError, match="not a place in the job"):
        Launch.from_env({"RANK": "4", "WORLD_SIZE": "4"})
    four = Launch(0, 4, 0, 4)
    assert Parallel().resolved(four) == Parallel(4, 1)
    assert Parallel(data=2).resolved(four) == Parallel(2, 2)
    assert Parallel(pipeline=2).resolved(four) == Parallel(2, 2)
    assert Parallel(2, 1).resolved(None) == Parallel(2, 1)


def test_more_processes_on_a_host_than_its_gpus_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ConfigError, match="4 processes on this host, but only 2 GPUs are visible"):
        check_parallel(Parallel(4, 1), 12, "opt-125m", Launch(0, 4, 0, 4), torch.device("cuda"))
    with pytest.raises(ConfigError, match="names one GPU"):
        check_parallel(Parallel(2, 1), 12, "opt-125m", Launch(0, 2, 0, 2), torch.device("cuda", 1))
    with pytest.raises(FlexoffError, match="torchrun --nproc-per-node 2"):
        check_parallel(Parallel(2, 1), 12, "opt-125m", None, torch.device("cpu"))
    assert os.environ.get("RANK") is None


@pytest.mark.slow
def test_a_batch_job_of_two_replicas_resumes_after_a_rank_is_killed(deep_model, tmp_path):
    """Rank 0 owns the output; kill rank 1 once some blocks are in it, rerun: the file then holds
    every prompt once, with the tokens of an uninterrupted single-process job."""
    lines = tmp_path / "in.jsonl"
    lines.write_text("".join(json.dumps({"id": f"q{i}", "prompt": [5 + i % 7, 9, 11 + i % 20, 3] * (1 + i % 3),
                                         "max_new_tokens": 24}) + "\n" for i in range(160)))
    common = ["batch", "--model", str(deep_model("opt-pre")), "--input", str(lines), "--device", "cpu",
              "--no-progress", "--gpu-batch-size", "2", "--num-gpu-batches", "1", "--temperature", "0.8"]
    assert main([*common, "--output", str(tmp_path / "one.jsonl")]) == 0
    out = tmp_path / "two.jsonl"
    argv = [sys.executable, "-m", "flexoff", *common, "--output", str(out), "--data-parallel", "2"]
    proc = processes.start(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        processes.wait_until(lambda: out.exists() and out.read_text().count("\n") >= 4, f"{out} to hold 4 lines", proc)
        victim = next(p for p in _workers(proc) if p.environ().get("RANK") == "1")
        victim.send_signal(signal.SIGKILL)
        _, err = processes.communicate(proc, what="the job to stop")
    finally:
        processes.kill(proc)
    assert proc.returncode != 0 and "rank 1 of 2 was killed by signal 9" in err
    written = out.read_text().count("\n")
    assert 4 <= written < 160, "the job was not cut in the middle"
    code, _, err = _flexoff(*common, "--output", str(out), "--data-parallel", "2")
    assert code == 0, err
    ids = [json.loads(line)["id"] for line in out.read_text().splitlines()]
    assert sorted(ids) == sorted(set(ids)) and len(ids) == 160
    tokens = lambda path: {r["id"]: r["token_ids"] for r in map(json.loads, open(path))}  # noqa: E731
    assert tokens(out) == tokens(tmp_path / "one.jsonl")


@pytest.mark.slow
def test_two_launchers_make_one_job_as_two_hosts_would(deep_model, tmp_path, capsys):
    """torchrun --nnodes 2 twice on one machine (gloo): one pipeline over the two 'hosts'."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    common = ["run", "--model", str(deep_model("llama-gqa")), "--prompts", str(prompts), "--device", "cpu", "--quiet",
              *OFFLOADED, "--temperature", "0.8", "--offload-dir", str(tmp_path)]
    assert main([*common, "--output", str(tmp_path / "one.jsonl")]) == 0
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "two-hosts",
                "-m", "flexoff", *common, "--output", str(tmp_path / "many.jsonl"), "--pipeline-parallel", "2"]
    hosts = [processes.start(launcher, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        ended = [processes.communicate(host) for host in hosts]
    finally:
        for host in hosts:
            processes.kill(host)
    assert [host.returncode for host in hosts] == [0, 0], [err for _, err in ended]
    assert _records(tmp_path / "many.jsonl") == _records(tmp_path / "one.jsonl")
    assert sum(out.count("wrote 14 results") for out, _ in ended) == 1


@pytest.mark.slow
def test_each_stage_runs_the_policy_planned_for_its_own_gpu(tmp_path):
    """--policy auto with one GPU cap per stage: the stages run different placements of one batch
    shape over layers split by their speed, and the tokens are one process's. A cap too small for any plan is refused once, by rank 0."""
    common = ["run", "--model", "opt-125m", "--dummy", "--device", "cpu", "--dtype", "bfloat16", "--num-prompts", "24",
              "--gen-len", "6", "--quiet", "--offload-dir", str(tmp_path)]
    auto = ["--pipeline-parallel", "2", "--policy", "auto", "--hardware", "t4", "--cpu-mem", "4GiB"]
    code, out, err = _flexoff(*common, *auto, "--gpu-mem", "60MiB,120MiB")
    assert code == 2 and err.strip().splitlines() == [
        "flexoff: error: a pipeline stage of opt-125m fits no policy: opt-125m cannot run on this machine even with "
        "everything offloaded: the GPU needs at least 181.48 MiB for working buffers (gpu batch size 1, no "
        "compression), but only 48.00 MiB is usable"]
    code, out, err = _flexoff(*common, *auto, "--gpu-mem", "420MiB,800MiB", "--output", str(tmp_path / "many.jsonl"))
    assert code == 0, err
    searched = re.findall(r"^searched   stage (\d) \(layers (\d+)-(\d+)\): (\S+) w (\S+)", err, re.M)
    (_, first, cut, _, _), (_, after, last, _, _) = searched
    # The layers split by the stages' speed: the smaller GPU's stage takes fewer, the two cover all 12.
    assert (int(first), int(cut) + 1, int(last)) == (0, int(after), 11) and int(cut) + 1 < 6
    assert f"  rank 0   layers 0–{cut} · " in out
    assert searched[0][3] == searched[1][3]  # one batch shape
    assert searched[0][4] != searched[1][4]  # each its own placement of the weights
    assert main([*common, "--output", str(tmp_path / "one.jsonl")]) == 0
    many, one = _records(tmp_path / "many.jsonl"), _records(tmp_path / "one.jsonl")
    assert [r[:3] for r in many] == [r[:3] for r in one]
    # bfloat16 log-probabilities differ in their last bits where attention ran on another device.
    assert [r[3] for r in many] == [pytest.approx(r[3], rel=5e-3) for r in one]


def test_a_process_that_lost_its_peers_says_so_in_one_line(monkeypatch, capsys):
    import torch.distributed as dist

    from flexoff.commands import main as main_module

    def timed_out(args):
        raise dist.DistBackendError("[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7)\nmore")

    monkeypatch.setattr(main_module, "cmd_run", timed_out)
    monkeypatch.setenv("RANK", "1")
    assert main(["run", "--quiet"]) == 1
    assert capsys.readouterr().err == (
        "flexoff: error: rank 1 lost its peers ([Rank 1] Watchdog caught collective operation timeout: "
        "WorkNCCL(SeqNum=7)); a process of the job ended or stopped answering\n")


def test_layers_given_per_stage_must_cover_the_model():
    assert stage_ranges(12, 2, [4, 8]) == (range(0, 5), range(5, 14))
    for counts in ([5, 5], [0, 12], [4, 4, 4], [6.0, 6]):
        with pytest.raises(ConfigError, match="positive counts adding up to the model's 12 layers"):
            check_parallel(Parallel(2, 1, layers=tuple(counts)), 12, "opt-125m", Launch(0, 2, 0, 2),
                           torch.device("cpu"))


SCORING = """
import json, os, sys
from flexoff import LLM
from flexoff.policy import Policy, TierFractions
policy = Policy(2, 2, weights=TierFractions(0.3, 0.5, 0.2), cache=TierFractions(0.5, 0, 0.5),
                activations=TierFractions(0.5, 0.5, 0))
model, output, offload = sys.argv[1:4]
sizes = {} if len(sys.argv) == 4 else {"pipeline_parallel_size": int(sys.argv[4])}
with LLM(model, policy=policy, device="cpu", offload_dir=offload, **sizes) as llm:
    prompts = [[5 + i, 9, 11, 3 + i] * (1 + i % 3) for i in range(7)]
    logits = llm.next_token_logits(prompts)
    scores = llm.score(prompts, [[7, 8, 9 + i] for i in range(7)])
if os.environ.get("RANK", "0") == "0":
    json.dump({"logits": [[round(x, 4) for x in row] for row in logits.tolist()],
               "scores": [[round(v, 4) for v in s.logprobs] for s in scores]}, open(output, "w"))
"""


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["opt-pre", "llama-gqa"])
def test_logits_and_scores_over_pipeline_stages_are_one_process_s(deep_model, tmp_path, kind):
    """The API's next_token_logits and score in a script torchrun starts: three stages, each with
    weights and cache offloaded, give one process's figures on every process."""
    script = tmp_path / "scoring.py"
    script.write_text(SCORING)
    model = str(deep_model(kind))
    alone = processes.run([sys.executable, str(script), model, str(tmp_path / "one.json"), str(tmp_path)])
    assert alone.returncode == 0, alone.stderr
    staged = processes.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
                            str(script), model, str(tmp_path / "three.json"), str(tmp_path), "3"])
    assert staged.returncode == 0, staged.stderr
    assert json.loads((tmp_path / "three.json").read_text()) == json.loads((tmp_path / "one.json").read_text())


PROGRESS = """
import json, os, sys
from flexoff import LLM, SamplingParams
from flexoff.policy import Policy, TierFractions

class Calls:
    def __init__(self):
        self.calls = []
    def __getattr__(self, name):
        return lambda *args: self.calls.append([name, *args])

policy = Policy(2, 3, weights=TierFractions(0.5, 0.5, 0), cache=TierFractions(0.5, 0.5, 0),
                activations=TierFractions(1, 0, 0))
model, output, offload = sys.argv[1:4]
tracker = Calls()
with LLM(model, policy=policy, device="cpu", offload_dir=offload, pipeline_parallel_size=2) as llm:
    llm.generate([[5 + i, 9, 11] for i in range(6)], SamplingParams(max_new_tokens=5, ignore_eos=True),
                 tracker=tracker)
json.dump(tracker.calls, open(f"{output}.{os.environ['RANK']}", "w"))
"""


@pytest.mark.slow
def test_the_bar_of_a_pipeline_moves_token_by_token_on_rank_0(deep_model, tmp_path):
    """Rank 0, the pipeline's first process, takes each batch's tokens from the last: its bar
    follows them as the head's would (one prefill, then every step); the last token of each
    sequence comes with the results, at the round's end."""
    script = tmp_path / "progress.py"
    script.write_text(PROGRESS)
    output = tmp_path / "calls.json"
    proc = processes.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(script), str(deep_model("opt-pre")), str(output), str(tmp_path)])
    assert proc.returncode == 0, proc.stderr
    calls = json.loads((tmp_path / "calls.json.0").read_text())
    kinds = [call[0] for call in calls]
    assert kinds[:2] == ["start", "block_started"] and kinds[-2:] == ["block_done", "close"]
    steps = [call[1] for call in calls if call[0] == "generated"]
    # 3 GPU batches of 2 rows, 5 tokens each: a step per batch and token but the last (the first
    # process embeds no token after it), the prefill once its last batch's is done.
    assert steps == [2] * 12
    assert kinds.index("prefilled") == kinds.index("generated") + 3
    assert [call[1] for call in calls if call[0] == "block_done"] == [6]
    # The last process runs the heads but shows no bar.
    assert not [call for call in json.loads((tmp_path / "calls.json.1").read_text()) if call[0] == "generated"]


@pytest.mark.slow
def test_under_torchrun_caps_that_do_not_fit_the_stages_are_refused_once():
    """Every process would refuse them; rank 0 says so, the others end without a word."""
    proc = processes.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "-m", "flexoff", "run", "--device", "cpu", "--quiet", "--gpu-mem", "1GiB,2GiB,3GiB"])
    assert proc.returncode != 0
    said = [line for line in proc.stderr.splitlines() if line.startswith("flexoff: error:")]
    assert said == ["flexoff: error: --gpu-mem gives 3 sizes for 2 pipeline stages: give one size for every GPU, "
                    "or one per stage"]


def test_rank_0s_bar_takes_the_other_replicas_to_keep_its_pace_up_to_the_rounds_budget():
    from types import SimpleNamespace

    from flexoff.api import LLM

    calls = []
    tracker = SimpleNamespace(generated=lambda n: calls.append(("generated", n)),
                              prefilled=lambda: calls.append(("prefilled",)))
    ranks = SimpleNamespace(rank=0, parallel=SimpleNamespace(data=3))
    step, prefilled, counted = LLM._tracking(tracker, 10, 2, ranks)
    step(2), prefilled(), step(2), prefilled(), step(-1)
    assert calls == [("generated", 6), ("generated", 4), ("prefilled",), ("generated", 0)] and counted() == 10
    others = LLM._tracking(tracker, 10, 2, SimpleNamespace(rank=1, parallel=SimpleNamespace(data=3)))
    assert others[:2] == (None, None) and others[2]() == 0
