"""Cost model against reality: predicted vs measured throughput and peak memory.

For at least six policies of OPT-30B and OPT-66B (searched ones and hand-made ones that exercise
CPU attention, disk and compression), predict throughput and peak memory per tier with the
planner, then run each with dummy weights through ``flexoff.LLM(...).generate`` in its own
process and read ``result.metrics``. Prints predicted vs measured and the relative error.

Targets (issue 5): throughput within +-20%, peak memory within +-10%, and no searched policy runs
out of memory. Record the table, and the card it ran on, in bench/RESULTS.md.

    python bench/cost_model_accuracy.py                      # predict and measure (needs the GPU machine)
    python bench/cost_model_accuracy.py --predict-only       # predictions only, anywhere
    python bench/cost_model_accuracy.py --hardware my.json   # a profile from `flexoff profile`

CPU memory is measured as the child's peak resident set less its resident set just before the
model is built (Python, torch and the CUDA context are not the model's).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flexoff.models.config import REGISTRY  # noqa: E402
from flexoff.planner.cost_model import CostModel, Workload  # noqa: E402
from flexoff.planner.hardware import resolve_hardware  # noqa: E402
from flexoff.planner.report import policy_summary  # noqa: E402
from flexoff.planner.search import search_policy  # noqa: E402
from flexoff.policy import CompressionConfig, Policy, TierFractions  # noqa: E402

GiB = 1 << 30
FOUR_BIT = CompressionConfig(4, 64)


@dataclass(frozen=True)
class Case:
    name: str
    model: str
    policy: Policy
    searched: bool


def _policy(gbs, batches, weights, cache, activations, cpu_attention=False, compressed=False) -> Policy:
    compression = FOUR_BIT if compressed else None
    return Policy(gbs, batches, TierFractions(*weights), TierFractions(*cache), TierFractions(*activations),
                  cpu_attention=cpu_attention, compress_weight=compression, compress_cache=compression)


HAND_MADE = [
    # FlexGen's own H100 policy for OPT-30B (77.9 token/s measured with FlexGen)
    ("opt-30b", "weights 50/50, cache on gpu", _policy(48, 1, (0.5, 0.5, 0), (1, 0, 0), (1, 0, 0))),
    ("opt-30b", "all on cpu, cpu attention", _policy(32, 2, (0, 1, 0), (0, 1, 0), (1, 0, 0), cpu_attention=True)),
    ("opt-30b", "a third of the weights on disk", _policy(32, 1, (0.4, 0.3, 0.3), (1, 0, 0), (1, 0, 0))),
    ("opt-66b", "weights 50/50, cache on cpu, cpu attention",
     _policy(16, 4, (0.5, 0.5, 0), (0, 1, 0), (1, 0, 0), cpu_attention=True)),
    ("opt-66b", "4-bit, weights 60/40", _policy(64, 1, (0.6, 0.4, 0), (0.5, 0.5, 0), (1, 0, 0), compressed=True)),
]


def shrink_to_fit(model: CostModel, policy: Policy) -> Policy:
    """Halve the GPU batch size until the cost model says the policy fits."""
    from dataclasses import replace

    while not model.predict(policy).fits and policy.gpu_batch_size > 1:
        policy = replace(policy, gpu_batch_size=policy.gpu_batch_size // 2)
    return policy


def build_cases(hardware, workload: Workload) -> list[Case]:
    cases = []
    for model_name in ("opt-30b", "opt-66b"):
        for compress in ("off", "on"):
            found = search_policy(REGISTRY[model_name], workload, hardware, compress=compress)
            label = "searched" + (", 4-bit" if compress == "on" else "")
            cases.append(Case(f"{model_name} {label}", model_name, found.policy, True))
    for model_name, label, policy in HAND_MADE:
        model = CostModel(REGISTRY[model_name], workload, hardware)
        cases.append(Case(f"{model_name} {label}", model_name, shrink_to_fit(model, policy), False))
    return cases


def measure_child(model: str, policy_file: str, prompt_len: int, gen_len: int, blocks: int,
                  offload_dir: str, out_file: str, warmup: bool) -> None:
    """Runs in the child process: build the model, generate, write the metrics as JSON."""
    import psutil
    import torch

    import flexoff
    from flexoff.runtime.sampling import SamplingParams

    if torch.cuda.is_available():
        torch.cuda.init()
    baseline_rss = psutil.Process().memory_info().rss
    policy = Policy.load(policy_file)
    llm = flexoff.LLM(model, dummy=True, policy=policy, offload_dir=offload_dir)
    generator = torch.Generator().manual_seed(0)
    vocab = llm.config.vocab_size
    prompts = [torch.randint(3, vocab, (prompt_len,), generator=generator).tolist()
               for _ in range(policy.block_size * blocks)]
    if warmup:
        llm.generate(prompts[:1], SamplingParams(max_new_tokens=2, ignore_eos=True))
    started = time.perf_counter()
    result = llm.generate(prompts, SamplingParams(max_new_tokens=gen_len, ignore_eos=True))
    wall = time.perf_counter() - started
    metrics = result.metrics.to_dict()
    metrics["wall_seconds"] = wall
    metrics["baseline_rss"] = baseline_rss
    Path(out_file).write_text(json.dumps(metrics, indent=2))
    llm.close()


def measure(case: Case, args, workdir: Path) -> dict:
    policy_file = workdir / "policy.json"
    metrics_file = workdir / "metrics.json"
    case.policy.save(policy_file)
    metrics_file.unlink(missing_ok=True)
    argv = [sys.executable, __file__, "--child", case.model, str(policy_file), str(args.prompt_len),
            str(args.gen_len), str(args.blocks), args.offload_dir, str(metrics_file), str(int(args.warmup))]
    started = time.time()
    with open(workdir / "child.log", "w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        _, status, usage = os.wait4(proc.pid, 0)
    code = os.waitstatus_to_exitcode(status)
    peak_rss = usage.ru_maxrss * 1024
    if code != 0 or not metrics_file.exists():
        tail = (workdir / "child.log").read_text().strip().splitlines()[-1:] or [f"exit {code}"]
        return {"error": tail[0], "exit": code, "seconds": time.time() - started}
    metrics = json.loads(metrics_file.read_text())
    peak = metrics.get("peak_memory", {})
    return {
        "total_throughput": metrics["total_throughput"],
        "prefill_throughput": metrics["prefill_throughput"],
        "decode_throughput": metrics["decode_throughput"],
        "gpu": peak.get("gpu"),
        "cpu": max(peak_rss, peak.get("cpu_rss", 0)) - metrics["baseline_rss"],
        "disk": peak.get("disk"),
        "seconds": time.time() - started,
    }


def _error(measured, predicted) -> str:
    if measured is None or not predicted:
        return "-"
    return f"{100 * (measured / predicted - 1):+.0f}%"


def _number(value) -> str:
    return "-" if value is None else f"{value:.4g}"


def _gib(value) -> str:
    return "-" if value is None else f"{value / GiB:.1f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hardware", default="h100", help="packaged profile name or profile JSON (default h100)")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--gen-len", type=int, default=32)
    parser.add_argument("--blocks", type=int, default=1, help="blocks to generate per policy (default 1)")
    parser.add_argument("--predict-only", action="store_true", help="skip the runs (the default without CUDA)")
    parser.add_argument("--warmup", action="store_true", help="a 2-token generation before the timed one")
    parser.add_argument("--only", action="append", help="run only the case of this name, or else those whose name "
                                                        "contains it (repeatable)")
    parser.add_argument("--offload-dir", default=os.environ.get("FLEXOFF_OFFLOAD_DIR", tempfile.gettempdir()),
                        help="disk tier directory (default $FLEXOFF_OFFLOAD_DIR or the temp dir)")
    parser.add_argument("--json", default=None, metavar="FILE", help="write every prediction and measurement")
    args = parser.parse_args()

    hardware = resolve_hardware(args.hardware)
    workload = Workload(args.prompt_len, args.gen_len)
    cases = build_cases(hardware, workload)
    if args.only:
        names = {c.name for c in cases}
        cases = [c for c in cases if any(c.name == text if text in names else text in c.name for text in args.only)]
    predict_only = args.predict_only
    if not predict_only:
        import torch

        if not torch.cuda.is_available():
            print("no CUDA here: predictions only")
            predict_only = True
        else:
            print(f"card: {torch.cuda.get_device_name()}; profile: {hardware.name} ({hardware.source})")
    records = []
    header = ("| case | policy | token/s pred | meas | err | gpu GiB pred | meas | err | cpu GiB pred | meas | err "
              "| disk GiB pred | meas |")
    print(header)
    print("| --- " * (header.count("|") - 1) + "|")
    with tempfile.TemporaryDirectory() as tmp:
        for case in cases:
            config = REGISTRY[case.model]
            num_prompts = case.policy.block_size * args.blocks
            model = CostModel(config, Workload(args.prompt_len, args.gen_len, num_prompts), hardware)
            predicted = model.predict(case.policy)
            measured = {} if predict_only else measure(case, args, Path(tmp))
            peak = predicted.peak_memory
            if "error" in measured:
                row = (f"| {case.name} | {policy_summary(case.policy)} | {predicted.total_throughput:.4g} | "
                       f"failed: {measured['error'][:60]} | | | | | | | | | |")
            else:
                row = (f"| {case.name} | {policy_summary(case.policy)} | {predicted.total_throughput:.4g} | "
                       f"{_number(measured.get('total_throughput'))} | "
                       f"{_error(measured.get('total_throughput'), predicted.total_throughput)} | "
                       + "".join(f"{_gib(peak[t])} | {_gib(measured.get(t))} | {_error(measured.get(t), peak[t])} | "
                                 for t in ("gpu", "cpu")) +
                       f"{_gib(peak['disk'])} | {_gib(measured.get('disk'))} |")
            print(row, flush=True)
            records.append({
                "case": case.name, "model": case.model, "searched": case.searched, "policy": case.policy.to_dict(),
                "predicted": {"total_throughput": predicted.total_throughput,
                              "prefill_throughput": predicted.prefill_throughput,
                              "decode_throughput": predicted.decode_throughput,
                              "block_latency": predicted.block_latency, "peak_memory": peak,
                              "prefill_bound": predicted.prefill.bound, "decode_bound": predicted.decode.bound},
                "measured": measured,
            })
            if args.json:  # after every case, so a run cut short keeps what it measured
                Path(args.json).write_text(json.dumps({"hardware": hardware.to_dict(), "prompt_len": args.prompt_len,
                                                       "gen_len": args.gen_len, "records": records}, indent=2))
    oom = [r["case"] for r in records if r["searched"] and "error" in r["measured"]]
    if oom:
        print(f"searched policies that failed: {', '.join(oom)}")
        return 1
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        model_name, policy_path, prompt, gen, blocks, offload, out, warm = sys.argv[2:10]
        measure_child(model_name, policy_path, int(prompt), int(gen), int(blocks), offload, out, warm == "1")
        raise SystemExit(0)
    raise SystemExit(main())
