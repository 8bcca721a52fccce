"""bench/dummy_gguf.py: the file holds llama.cpp's layout for each architecture, in Q4_0 with finite scales;
flexoff reads the dense ones back as a model whose log-probabilities stay finite through its layers; a model
llama.cpp cannot hold is refused by name, and a write that fails leaves no file behind."""

import math
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import dummy_gguf  # noqa: E402
from flexoff.models import REGISTRY, ModelConfig  # noqa: E402

gguf = pytest.importorskip("gguf")


def tiny(**changes) -> ModelConfig:
    base = dict(name="tiny", family="llama", vocab_size=512, hidden_size=128, num_layers=2, num_heads=4,
                num_kv_heads=2, intermediate_size=256, max_positions=1024, tie_word_embeddings=False)
    return ModelConfig(**{**base, **changes})


TINY = {
    "llama": tiny(),
    "qwen3": tiny(head_dim=64, qk_norm=True),
    "mixtral": tiny(num_experts=4, experts_per_token=2),
    "qwen3moe": tiny(head_dim=64, qk_norm=True, num_experts=8, experts_per_token=2, expert_intermediate_size=64),
}


# llama.cpp's architecture of each: Mixtral is its llama with experts.
ARCHITECTURE = {"llama": "llama", "qwen3": "qwen3", "mixtral": "llama", "qwen3moe": "qwen3moe"}


@pytest.mark.parametrize("kind", list(TINY))
def test_the_file_holds_llama_cpps_layout_for_its_architecture(tmp_path, kind):
    cfg, arch = TINY[kind], ARCHITECTURE[kind]
    path = dummy_gguf.write_dummy_gguf(cfg, tmp_path / "m.gguf", context=300)
    reader = gguf.GGUFReader(path)
    meta = {field.name: field.contents() for field in reader.fields.values()}
    assert meta["general.architecture"] == arch
    assert meta[f"{arch}.block_count"] == cfg.num_layers
    assert meta[f"{arch}.context_length"] == 300
    assert meta[f"{arch}.attention.key_length"] == cfg.head_dim
    assert meta[f"{arch}.vocab_size"] == cfg.vocab_size
    assert meta["tokenizer.ggml.model"] == "none"
    assert meta.get(f"{arch}.expert_count", 0) == cfg.num_experts
    stored = {t.name: t for t in reader.tensors}
    expected = dummy_gguf.tensors(cfg)
    assert list(stored) == [t.name for t in expected]
    for t in expected:
        tensor = stored[t.name]
        # GGUF lists dimensions innermost first.
        assert tuple(int(d) for d in reversed(tensor.shape)) == t.shape, t.name
        kind = gguf.GGMLQuantizationType.Q4_0 if t.kind == "matrix" else gguf.GGMLQuantizationType.F32
        assert tensor.tensor_type == kind, t.name
    if cfg.num_experts:
        assert stored["blk.0.ffn_gate_exps.weight"].tensor_type == gguf.GGMLQuantizationType.Q4_0
        assert "blk.0.ffn_gate.weight" not in stored
    assert ("blk.1.attn_q_norm.weight" in stored) == cfg.qk_norm
    assert not list(tmp_path.glob("*.partial"))


def test_the_file_goes_into_a_folder_that_does_not_exist_yet(tmp_path):
    path = dummy_gguf.write_dummy_gguf(TINY["llama"], tmp_path / "new" / "offload" / "m.gguf")
    assert path.is_file() and gguf.GGUFReader(path).tensors


def test_matrices_are_random_small_and_finite_and_norms_are_one(tmp_path):
    path = dummy_gguf.write_dummy_gguf(TINY["llama"], tmp_path / "m.gguf")
    stored = {t.name: t for t in gguf.GGUFReader(path).tensors}
    from gguf.quants import dequantize

    q = dequantize(stored["blk.0.attn_q.weight"].data, gguf.GGMLQuantizationType.Q4_0)
    k = dequantize(stored["blk.0.attn_k.weight"].data, gguf.GGMLQuantizationType.Q4_0)
    assert np.isfinite(q).all() and 0 < np.abs(q).max() <= 8 * 1.5 * dummy_gguf.SCALE * 1.01
    assert 0.003 < q.std() < 0.03
    assert not np.array_equal(q[: k.shape[0]], k)  # matrices do not all start with the same codes
    assert (np.asarray(stored["blk.0.attn_norm.weight"].data) == 1).all()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_flexoff_reads_the_dense_files_and_their_log_probabilities_stay_finite(tmp_path, arch):
    from flexoff import LLM

    cfg = TINY[arch].replace(num_layers=12)
    path = dummy_gguf.write_dummy_gguf(cfg, tmp_path / "m.gguf")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size, 60).tolist() for _ in range(2)]
    continuations = [rng.integers(0, cfg.vocab_size, 8).tolist() for _ in range(2)]
    llm = LLM(str(path))
    try:
        scores = llm.score(prompts, continuations)
    finally:
        llm.close()
    values = [v for s in scores for v in s.logprobs]
    assert len(values) == 16 and all(math.isfinite(v) for v in values)
    # Small random weights: every token about as likely as any other, as a dummy model should be.
    assert all(abs(v + math.log(cfg.vocab_size)) < 1.5 for v in values)


def test_a_registry_model_is_planned_at_its_real_size():
    layout = dummy_gguf.tensors(REGISTRY["llama-3-70b"])
    size = sum(dummy_gguf.stored_bytes(t) for t in layout)
    assert 36 * 2**30 < size < 40 * 2**30  # 70.6B parameters at 4.5 bits each
    assert len([t for t in layout if t.name.endswith("ffn_gate_exps.weight")]) == 0
    moe = dummy_gguf.tensors(REGISTRY["qwen3-30b-a3b"])
    assert dummy_gguf.architecture(REGISTRY["qwen3-30b-a3b"]) == "qwen3moe"
    assert next(t for t in moe if t.name == "blk.0.ffn_down_exps.weight").shape == (128, 2048, 768)


def test_models_llama_cpp_cannot_hold_are_refused_by_name():
    with pytest.raises(dummy_gguf.NotConvertible, match="no architecture for the opt family"):
        dummy_gguf.tensors(REGISTRY["opt-30b"])
    with pytest.raises(dummy_gguf.NotConvertible, match="not whole Q4_0 blocks"):
        dummy_gguf.tensors(tiny(intermediate_size=200))


def test_a_failed_write_leaves_no_file(tmp_path, monkeypatch):
    calls = []

    def failing(t, chunk, rng):
        calls.append(t.name)
        if len(calls) == 3:
            raise OSError("disk full")
        return original(t, chunk, rng)

    original = dummy_gguf.data
    monkeypatch.setattr(dummy_gguf, "data", failing)
    with pytest.raises(OSError, match="disk full"):
        dummy_gguf.write_dummy_gguf(TINY["llama"], tmp_path / "m.gguf")
    assert list(tmp_path.iterdir()) == []
