"""Runs the published flexgen package's benchmark entry point on dummy weights, offline.

FlexGen asks the Hub for OPT's tokenizer even with dummy weights; a stand-in that pads the same
fixed prompt to the requested length replaces it, so nothing is downloaded.
"""

import argparse
import sys
from pathlib import Path
from types import SimpleNamespace

import flexgen.flex_opt as flex_opt

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # flexoff, for its size parser


class StandInTokenizer:
    def __call__(self, prompts, padding=None, max_length=None, **_):
        ids = [2] + [100 + i % 997 for i in range(max_length - 1)]  # BOS, then ordinary tokens
        return SimpleNamespace(input_ids=[list(ids) for _ in prompts])

    def batch_decode(self, ids, skip_special_tokens=True):
        return ["" for _ in ids]


def main():
    flex_opt.AutoTokenizer = SimpleNamespace(from_pretrained=lambda *a, **k: StandInTokenizer())
    parser = argparse.ArgumentParser()
    flex_opt.add_parser_arguments(parser)
    parser.add_argument("--gpu-mem-cap", help="cap the CUDA allocator, e.g. 16GiB, as flexoff's --gpu-mem does")
    args = parser.parse_args()
    if args.gpu_mem_cap:
        import torch

        from flexoff.units import parse_size

        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, parse_size(args.gpu_mem_cap) / total), 0)
    flex_opt.run_flexgen(args)


if __name__ == "__main__":
    main()
