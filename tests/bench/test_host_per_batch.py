"""`bench/host_per_batch.py --cprofile`: a case's profile names the runtime's functions and counts
the calls per decode layer and batch of the case it ran."""

import re
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import host_per_batch  # noqa: E402
from flexoff.profiler import host_overhead  # noqa: E402
from flexoff.policy import CompressionConfig, Policy, TierFractions  # noqa: E402


@pytest.mark.parametrize("family", sorted(host_per_batch.FAMILIES))
def test_a_cases_profile_counts_its_calls_per_layer_and_batch(tmp_path, monkeypatch, family):
    # A shallower model over fewer steps than the script's: the counts hold for any.
    for module in (host_per_batch, host_overhead):
        monkeypatch.setattr(module, "STEPS", 4)
        monkeypatch.setattr(module, "DEPTHS", (2, 3))
    policy = Policy(2, 3, TierFractions(1, 0, 0), TierFractions(0, 1, 0), TierFractions(1, 0, 0),
                    compress_cache=CompressionConfig(4, 64))
    path = tmp_path / "case.txt"
    fields = host_per_batch.FAMILIES[family]
    host_per_batch.profile_calls(torch.device("cpu"), torch.float32, policy, fields, str(tmp_path), path)
    text = path.read_text()
    calls, per, layer_batches = re.search(r"(\d+) calls, (\d+) per layer and batch \((\d+) layer-batches", text).groups()
    assert int(layer_batches) == (4 + 1) * 3 * 3
    assert int(per) == round(int(calls) / int(layer_batches))
    # The travelling, compressed cache's work is in it: the rows' attention and the codec.
    assert "_attend_loaded" in text and "quantize" in text
    # The family's own layer ran: a Llama layer rotates its queries and keys, an OPT layer does not.
    assert ("llama.py" in text) == (family == "llama") and ("opt.py" in text) == (family == "opt")
