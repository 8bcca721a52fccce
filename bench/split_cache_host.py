"""The host's time per layer when a GPU batch's cache is split between GPU rows and travelling rows.

Without CPU attention such a batch attends twice a layer: its GPU rows in place, the others in the
workspace the travelling rows are loaded into, each with its own slot write, dequantization and
attention. On models too narrow (hidden 128, two sequences) to keep the device busy, the decode time
per layer is the host's: this prints it with the cache all on the device, all travelling, and split
half and half, for a Llama-family layer with 8 experts (2 a token) and a 4-bit cache.

    python bench/split_cache_host.py                  # on CUDA where there is one, else the CPU
    python bench/split_cache_host.py --device cpu
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flexoff.profiler.host_overhead import SPARSE_FIELDS, decode_seconds_per_layer  # noqa: E402
from flexoff.policy import CompressionConfig, Policy, TierFractions  # noqa: E402

CACHES = {"on the device": TierFractions(1, 0, 0), "travelling": TierFractions(0, 1, 0),
          "split half and half": TierFractions(0.5, 0.5, 0)}


def seconds_per_layer(device: torch.device, cache: TierFractions) -> float:
    """Decode seconds per layer of two sequences with this cache placement (the profiler's measure)."""
    policy = Policy(2, 1, TierFractions(1, 0, 0), cache, TierFractions(1, 0, 0), compress_cache=CompressionConfig(4, 64))
    return decode_seconds_per_layer(device, torch.float32, policy, SPARSE_FIELDS, sequences=2)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(parser.parse_args().device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"decode ms per layer, 2 sequences, {name}")
    times = {label: seconds_per_layer(device, cache) for label, cache in CACHES.items()}
    for label, seconds in times.items():
        print(f"  {label:<20} {seconds * 1e3:7.3f}")
    print(f"split over travelling: {times['split half and half'] / times['travelling']:.2f}x")


if __name__ == "__main__":
    main()
