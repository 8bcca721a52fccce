"""The expert-touch curve: how many of a sparse layer's experts a block of N tokens routes to, and what a
route-first load (copy only the experts the router picked) would skip, for N = 1, 2, 4, ... 1024.

Each sparse layer's own router (seeded dummy weights, or a local checkpoint's) routes N tokens as the
runtime does (flexoff.models.moe.route: softmax and top-k in fp32). Which tokens, the output says:
- ``--hidden random`` (default, seconds on a CPU): independent random hidden states, N(0, 1) per element
  (the unit RMS the post-attention norm gives) times the layer's post-attention norm weight; NOT the
  model's activations. Real tokens are correlated, so a real model's curve may lie below this one.
- ``--hidden model``: the model's own hidden states, the last token of each of N random prompts (a
  decode block's tokens) run through flexoff's model math, one layer's weights at a time (all of them
  are loaded: use --device cuda for the large models).

Per block size: the touched fraction of a layer's experts (mean, min and max over sparse layers and
trials), the estimate for uniform routing, E * (1 - ((E - k) / E) ** N) / E, and the expert bytes a
route-first load would skip per pass over the model, alone and as a share of the layers' weight bytes.

    python bench/expert_touch.py --model mixtral-8x7b
    python bench/expert_touch.py --model qwen3-30b-a3b --hidden model --device cuda --json /tmp/touch.json
    python bench/expert_touch.py --model /models/Qwen3-30B-A3B --hidden model --device cuda --bits 4
"""

from __future__ import annotations

import argparse
import json
import sys
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flexoff.errors import FlexoffError, error_line  # noqa: E402
from flexoff.layout import ROUTE_FIRST_MIN_SAVING as WORTHWHILE  # noqa: E402
from flexoff.layout import compressible, expected_experts_touched  # noqa: E402
from flexoff.models import Stage, architecture, moe, resolve_model, stage_specs  # noqa: E402
from flexoff.models.common import attention, attention_mask  # noqa: E402
from flexoff.planner.sizes import FP16_BYTES, bytes_per_element  # noqa: E402
from flexoff.policy import CompressionConfig  # noqa: E402
from flexoff.weights import DummyWeights, checkpoint_weights  # noqa: E402

BLOCK_SIZES = tuple(2**i for i in range(11))  # 1 ... 1024 tokens
HIDDEN = "independent random tokens: N(0, 1) times the layer's post-attention norm weight, not the model's activations"
NORM = "post_attention_layernorm.weight"


def touched_counts(chosen: torch.Tensor, experts: int, block_sizes) -> torch.Tensor:
    """(len(block_sizes),) distinct experts among the picks of the first N tokens, chosen (tokens, k).

    Blocks are prefixes of one draw, so the counts never fall as N grows."""
    picked = torch.zeros(chosen.shape[0], experts, dtype=torch.bool, device=chosen.device)
    picked.scatter_(1, chosen, True)
    seen = picked.cumsum(0) > 0  # seen[t, e]: expert e is among the first t + 1 tokens' picks
    return seen[[n - 1 for n in block_sizes]].sum(dim=1).cpu()


def random_routes(cfg, weights, index: int, args, generator: torch.Generator) -> list[torch.Tensor]:
    """Per trial, the experts (tokens, k) layer ``index``'s router picks for random hidden states."""
    stage = Stage("layer", index)
    specs = {spec.name: spec for spec in stage_specs(cfg, stage)}
    router, norm = (weights.load_tensor(stage.name, specs[name], args.device, torch.float32)
                    for name in (moe.ROUTER, NORM))
    tokens = max(args.block_sizes)
    return [moe.route(cfg, router, torch.randn(tokens, cfg.hidden_size, generator=generator).to(router.device)
                      * norm)[1] for _ in range(args.trials)]


@contextmanager
def recording_routes(sink: list):
    """Note every routing the model math does (the layer functions return only hidden states)."""
    route = moe.route

    def recorded(cfg, router, x):
        weights, chosen = route(cfg, router, x)
        sink.append(chosen)
        return weights, chosen

    moe.route = recorded
    try:
        yield
    finally:
        moe.route = route


def model_routes(cfg, weights, args, generator: torch.Generator) -> dict[int, list[torch.Tensor]]:
    """Per sparse layer and trial, the experts (sequences, k) picked for the last token of each of
    max(block_sizes) random prompts of --prompt-len tokens, run through flexoff's own model math on
    the model's weights, one layer's weights loaded at a time: a decode block's tokens."""
    device = torch.device(args.device)
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    arch, sequences, length = architecture(cfg), max(args.block_sizes), args.prompt_len
    positions = torch.arange(length, device=device).expand(sequences, -1)
    mask = attention_mask(torch.ones(sequences, length, dtype=torch.bool, device=device), 0, length)
    context = arch.step_context(cfg, positions, dtype)

    def stage_weights(stage: Stage) -> dict:
        return {spec.name: weights.load_tensor(stage.name, spec, device, dtype) for spec in stage_specs(cfg, stage)}

    embedding = stage_weights(Stage("embed"))
    hidden = [arch.embed(cfg, embedding, torch.randint(cfg.vocab_size, (sequences, length), generator=generator)
                         .to(device), positions) for _ in range(args.trials)]
    del embedding
    routes = {}
    for index in range(cfg.num_layers):
        w, picks = stage_weights(Stage("layer", index)), []
        with recording_routes(picks):
            hidden = [arch.layer(cfg, w, h, context, lambda q, k, v: attention(q, k, v, mask)) for h in hidden]
        if picks:
            routes[index] = [chosen.view(sequences, length, -1)[:, -1] for chosen in picks]
        progress(f"layer {index + 1} of {cfg.num_layers}")
    return routes


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def layer_bytes(cfg, index: int, compression) -> tuple[int, int]:
    """(bytes of the layer's experts, bytes of all its weights) as stored: matrices at the compression's
    size, the rest (router, norms) fp16."""
    experts = whole = 0
    for spec in stage_specs(cfg, Stage("layer", index)):
        size = spec.numel * (bytes_per_element(compression) if compressible(spec) else FP16_BYTES)
        whole += size
        experts += size if spec.experts else 0
    return int(experts), int(whole)


def measure(args) -> dict:
    cfg, directory = resolve_model(args.model, dummy=True)
    if not cfg.num_experts:
        raise FlexoffError(f"{cfg.name} has no experts: the expert-touch curve needs a mixture of experts")
    weights = DummyWeights(args.seed) if directory is None or args.dummy else checkpoint_weights(directory)
    source = "dummy" if isinstance(weights, DummyWeights) else str(directory)
    generator = torch.Generator().manual_seed(args.seed)
    compression = CompressionConfig(4, 64) if args.bits == 4 else None
    sparse = [i for i in range(cfg.num_layers) if cfg.sparse_layer(i)]
    with torch.inference_mode():
        if args.hidden == "model":
            routes = model_routes(cfg, weights, args, generator)
        else:
            routes = {index: random_routes(cfg, weights, index, args, generator) for index in sparse}
    weights.close()
    counts = torch.stack([torch.stack([touched_counts(chosen, cfg.num_experts, args.block_sizes)
                                       for chosen in routes[index]]) for index in sparse])
    expert_bytes = weight_bytes = 0
    for index in sparse:
        experts, whole = layer_bytes(cfg, index, compression)
        expert_bytes, weight_bytes = expert_bytes + experts, weight_bytes + whole
    fractions = counts.double() / cfg.num_experts  # (layers, trials, block sizes)
    rows = []
    for column, tokens in enumerate(args.block_sizes):
        touched = fractions[:, :, column]
        skipped = float((1 - touched.mean(dim=1)).mul(expert_bytes / len(sparse)).sum())
        rows.append({"tokens": tokens, "touched_mean": float(touched.mean()), "touched_min": float(touched.min()),
                     "touched_max": float(touched.max()),
                     "uniform": expected_experts_touched(cfg.num_experts, cfg.experts_per_token, tokens) / cfg.num_experts,
                     "skipped_bytes": skipped, "skipped_share_of_layers": skipped / weight_bytes})
    hidden = (HIDDEN if args.hidden == "random" else
              f"the model's own: the last token of each of N random prompts of {args.prompt_len} tokens, "
              f"through flexoff's model math on these weights")
    return {"model": cfg.name, "weights": source, "hidden": hidden, "experts": cfg.num_experts,
            "top_k": cfg.experts_per_token, "sparse_layers": len(sparse), "trials": args.trials, "bits": args.bits,
            "device": args.device, "expert_bytes": expert_bytes, "layer_bytes": weight_bytes, "rows": rows}


def table(result: dict) -> str:
    lines = [f"{result['model']} ({result['weights']} weights): {result['experts']} experts, top-{result['top_k']}, "
             f"{result['sparse_layers']} sparse layers, {result['trials']} trials each; experts "
             f"{result['expert_bytes'] / 1e9:.2f} GB of the layers' {result['layer_bytes'] / 1e9:.2f} GB "
             f"at {result['bits']} bits",
             f"hidden states: {result['hidden']}", "",
             "| tokens | touched mean | min | max | uniform estimate | route-first skips, GB per pass "
             "| of the layers' bytes |", "|" + "---|" * 7]
    worth = [row["tokens"] for row in result["rows"] if row["skipped_share_of_layers"] >= WORTHWHILE]
    for row in result["rows"]:
        lines.append(f"| {row['tokens']} | {row['touched_mean']:.3f} | {row['touched_min']:.3f} | "
                     f"{row['touched_max']:.3f} | {row['uniform']:.3f} | {row['skipped_bytes'] / 1e9:.2f} | "
                     f"{row['skipped_share_of_layers']:.1%} |")
    lines.append("")
    lines.append(f"Route-first skips at least {WORTHWHILE:.0%} of the layers' bytes at blocks of "
                 + (", ".join(map(str, worth)) + " tokens" if worth else "no block size measured"))
    return "\n".join(lines)


def block_sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(sorted({int(part) for part in text.split(",") if part.strip()}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"block sizes must be positive integers, got {text!r}") from None
    if not sizes or sizes[0] < 1:
        raise argparse.ArgumentTypeError(f"block sizes must be positive integers, got {text!r}")
    return sizes


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a MoE registry name (dummy weights) or checkpoint directory")
    parser.add_argument("--dummy", action="store_true", help="seeded dummy weights even for a checkpoint")
    parser.add_argument("--block-sizes", type=block_sizes, default=BLOCK_SIZES,
                        help="comma-separated tokens per block (default 1,2,4,...,1024)")
    parser.add_argument("--trials", type=int, default=8, help="random draws of tokens per layer (default 8)")
    parser.add_argument("--bits", type=int, choices=[16, 4], default=16,
                        help="stored size of the expert matrices: fp16, or 4-bit groups of 64")
    parser.add_argument("--hidden", choices=["random", "model"], default="random",
                        help="random: random hidden states into each router (default); model: the model's own "
                             "hidden states of random prompts (every layer's weights are loaded and run)")
    parser.add_argument("--prompt-len", type=int, default=16, help="tokens per prompt for --hidden model")
    parser.add_argument("--device", default="cpu", help="where to route: cpu (default) or cuda")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args(argv)
    if args.trials < 1:
        parser.error("--trials must be at least 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        result = measure(args)
    except FlexoffError as error:
        print(error_line(error), file=sys.stderr)
        return 2
    print(table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
