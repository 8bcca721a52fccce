"""Weights a checkpoint stores compressed run as stored: the weight store holds the source's own
bytes on every tier (it quantizes only what the source does not hand over compressed), they
generate what the same compression done by flexoff generates, bfloat16 compute keeps their fp16
scales, and the layout counts what is allocated.

The checkpoint here is a tiny Hugging Face model whose source hands its matrices over 4-bit in
groups of 32, quantized by flexoff's codec (as a GGUF's Q4_1 would be read), but the second MLP
matrix of each layer, which it leaves to the store."""

import pytest
import torch

from flexoff import LLM, CompressionConfig, Policy, SamplingParams, TierFractions
from flexoff.compression import CompressedTensor, dequantize, quantize
from flexoff.layout import compressible, weight_layout
from flexoff.runtime import weight_store
from flexoff.weights import CheckpointWeights
from tests.conftest import PROMPTS, assert_same_outputs
from tests.runtime.test_layout_allocations import held_tensor_bytes, reachable

STORED = CompressionConfig(4, 32)
PARAMS = SamplingParams(max_new_tokens=4, ignore_eos=True)
KINDS = ["opt-pre", "llama-gqa"]
PLACEMENTS = {
    "gpu": TierFractions(1, 0, 0),
    "cpu": TierFractions(0, 1, 0),
    "disk": TierFractions(0, 0, 1),
    "mixed": TierFractions(0.3, 0.4, 0.3),
}


def left_to_the_store(name: str) -> bool:
    return "fc2" in name or "down_proj" in name


class StoredSource:
    """A checkpoint whose matrices are stored in STORED: each handed over as quantized here from
    the checkpoint's values in the scales' dtype. ``handed``: what it gave, by (stage, name)."""

    def __init__(self, path):
        self.inner = CheckpointWeights(path)
        self.handed: dict[tuple[str, str], CompressedTensor] = {}

    def check(self, stages):
        self.inner.check(stages)

    def load_tensor(self, stage, spec, device, dtype, out=None):
        return self.inner.load_tensor(stage, spec, device, dtype, out=out)

    def stored(self, stage, spec, meta_dtype) -> CompressedTensor:
        values = self.inner.load_tensor(stage, spec, torch.device("cpu"), meta_dtype)
        return quantize(values, STORED.bits, STORED.group_size, dim=-1)

    def load_compressed(self, stage, spec, compression, device, meta_dtype):
        assert compression == STORED
        if left_to_the_store(spec.name):
            return None
        tensor = self.stored(stage, spec, meta_dtype).to(device)
        self.handed[(stage, spec.name)] = tensor
        return tensor

    def close(self):
        self.inner.close()


class FloatSource(StoredSource):
    """The same checkpoint handing nothing over compressed."""

    def load_compressed(self, stage, spec, compression, device, meta_dtype):
        return None


@pytest.fixture
def stored_model(monkeypatch):
    """stored_model(source, stored): LLM(path) then reads the checkpoint through ``source`` (a class
    over the checkpoint's path), its config saying it stores its matrices in ``stored``; returns
    the sources made. Called again, it patches anew."""
    import flexoff.api.llm as api
    import flexoff.deploy.deployment as deployment

    resolve = deployment.resolve_model

    def patch(source=None, stored=STORED):
        sources = []

        def as_stored(model, dummy=False):
            config, checkpoint = resolve(model, dummy)
            return config.replace(stored_compression=stored), checkpoint

        monkeypatch.setattr(deployment, "resolve_model", as_stored)
        monkeypatch.setattr(api, "checkpoint_weights", lambda path: sources.append((source or StoredSource)(path))
                            or sources[-1])
        return sources

    return patch


def held(weights, stage_name: str, name: str) -> CompressedTensor | torch.Tensor:
    """A weight as the store holds it, its pieces on every tier (disk ones read back) put together."""
    stage = next(stage for stage in weights._stages if stage.name == stage_name)
    pieces = weights._stages[stage]
    if name in pieces.resident:
        return pieces.resident[name]
    staging = pieces.region.read_into(torch.empty(pieces.disk_bytes, dtype=torch.uint8)) if pieces.disk_bytes else None
    rows = [storage.view(staging) if isinstance(storage, weight_store._OnDisk) else storage
            for _, _, storage in pieces.parts[name]]
    if not isinstance(rows[0], CompressedTensor):
        return torch.cat(rows)
    first = rows[0]
    return CompressedTensor(*(torch.cat([getattr(r, part).cpu() for r in rows]) for part in ("data", "scale", "minimum")),
                            (sum(r.shape[0] for r in rows), *first.shape[1:]), first.dtype, first.dim, first.bits,
                            first.group_size)


def assert_same_compressed(a: CompressedTensor, b: CompressedTensor) -> None:
    assert (a.shape, a.dtype, a.bits, a.group_size) == (b.shape, b.dtype, b.bits, b.group_size)
    for part in ("data", "scale", "minimum"):
        assert torch.equal(getattr(a, part).cpu(), getattr(b, part).cpu()), part


def compressed_specs(llm):
    return [(stage.name, placement.spec) for stage, placements in llm.engine.weights.placements.items()
            for placement in placements if compressible(placement.spec)]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_the_store_holds_the_sources_bytes_and_generates_as_flexoffs_own_compression(
        tiny_model_dir, stored_model, monkeypatch, tmp_path, kind, placement):
    path, _ = tiny_model_dir(kind)
    policy = Policy(gpu_batch_size=2, num_gpu_batches=2, weights=PLACEMENTS[placement])
    # The same compression done by flexoff from the same values, under the same placement: a source
    # that hands nothing over compressed leaves every matrix to the store.
    stored_model(FloatSource)
    with LLM(str(path), policy=policy, dtype="float32", offload_dir=str(tmp_path)) as reference:
        ref = reference.generate(PROMPTS, PARAMS)

    quantized = []
    real = weight_store.quantize
    monkeypatch.setattr(weight_store, "quantize", lambda tensor, *a, **k: quantized.append(tensor.shape) or
                        real(tensor, *a, **k))
    sources = stored_model()
    with LLM(str(path), policy=policy, dtype="float32", offload_dir=str(tmp_path)) as llm:
        source = sources[0]
        assert llm.policy.compress_weight == STORED  # no weight compression asked: the stored format
        specs = compressed_specs(llm)
        assert len(source.handed) == sum(not left_to_the_store(spec.name) for _, spec in specs) > 0
        for (stage, name), handed in source.handed.items():
            assert_same_compressed(held(llm.engine.weights, stage, name), handed)
        # The store quantized only what the source left to it.
        assert sorted(quantized) == sorted(spec.shape for _, spec in specs if left_to_the_store(spec.name))
        outs = llm.generate(PROMPTS, PARAMS)
    assert_same_outputs(outs, ref, atol=0.0)


def test_a_stored_matrix_is_read_as_the_source_lays_it_out_or_refused(tiny_model_dir, stored_model, monkeypatch):
    """A source handing over a matrix in another layout than its spec's is a broken checkpoint,
    named in one line, not a crash in the middle of a copy."""
    from flexoff.errors import CheckpointError

    path, _ = tiny_model_dir("opt-pre")
    stored_model()
    monkeypatch.setattr(StoredSource, "stored", lambda self, stage, spec, meta: quantize(
        torch.zeros(spec.shape, dtype=meta), STORED.bits, 16, dim=-1))
    with pytest.raises(CheckpointError, match=r"is stored as CompressedTensor\(.*group_size=16.*, not as "):
        LLM(str(path), dtype="float32")


class DequantizedSource(StoredSource):
    """The float weights the stored ones stand for: each matrix dequantized in fp32 and rounded once
    to the dtype asked for; those left to the store quantized as the store does, to fp16 scales."""

    def load_tensor(self, stage, spec, device, dtype, out=None):
        if not compressible(spec) or not stage.startswith("layer."):  # a stored model's embedding and head are exact
            return self.inner.load_tensor(stage, spec, device, dtype, out=out)
        if left_to_the_store(spec.name):
            values = self.inner.load_tensor(stage, spec, torch.device("cpu"), dtype)
            compressed = quantize(values, STORED.bits, STORED.group_size, meta_dtype=torch.float16)
        else:
            compressed = self.stored(stage, spec, torch.float16)
        values = dequantize(compressed, torch.float32).to(dtype).to(device)
        return values if out is None else out.copy_(values)

    def load_compressed(self, stage, spec, compression, device, meta_dtype):
        return None


@pytest.mark.parametrize("placement", ["gpu", "mixed"])
def test_bfloat16_keeps_the_stored_fp16_scales_and_computes_from_them(tiny_model_dir, stored_model, tmp_path,
                                                                      placement):
    """bf16 would round a stored fp16 scale: every compressed weight of the store keeps fp16 scales
    and minimums, those it quantizes itself too, and each matrix reads back as dequantized in fp32
    then rounded to bf16, which is what a float run of those values generates."""
    path, _ = tiny_model_dir("llama-gqa")
    policy = Policy(gpu_batch_size=2, num_gpu_batches=2, weights=PLACEMENTS[placement])
    sources = stored_model()
    with LLM(str(path), policy=policy, dtype="bfloat16", offload_dir=str(tmp_path)) as llm:
        weights = llm.engine.weights
        # Every compressed tensor the store holds: pieces and assembly buffers.
        compressed = [obj for obj in reachable((weights._stages, weights._buffers))
                      if isinstance(obj, CompressedTensor)]
        assert len(compressed) > len(sources[0].handed) and {t.dtype for t in compressed} == {torch.float16}
        assert weights._scratch.dtype == torch.bfloat16
        stage = next(s for s in weights._stages if s.name == "layer.0")
        weights.prefetch(stage)
        read = weights.get(stage)
        handed = {name: t for (s, name), t in sources[0].handed.items() if s == "layer.0"}
        assert handed
        for name, tensor in handed.items():
            assert torch.equal(read[name].cpu(), dequantize(tensor.to("cpu"), torch.float32).to(torch.bfloat16)), name
        weights.release(stage)
        outs = llm.generate(PROMPTS, PARAMS)
    # The float weights those stand for, uncompressed: a checkpoint stored in bf16 as it were.
    stored_model(DequantizedSource, stored=None)
    with LLM(str(path), policy=policy, dtype="bfloat16", offload_dir=str(tmp_path)) as float_run:
        assert float_run.policy.compress_weight is None
        ref = float_run.generate(PROMPTS, PARAMS)
    assert_same_outputs(outs, ref, atol=0.0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_layout_counts_what_the_store_allocates(tiny_model_dir, stored_model, tmp_path, dtype):
    path, _ = tiny_model_dir("opt-pre")
    policy = Policy(2, 2, TierFractions(0.3, 0.3, 0.4), TierFractions(0.5, 0.5, 0), TierFractions(0.5, 0.5, 0))
    stored_model()
    # On the CPU, where the "gpu" tier's tensors are host tensors beside the pinned ones, counted apart.
    with LLM(str(path), policy=policy, dtype=dtype, device="cpu", offload_dir=str(tmp_path)) as llm:
        weights = llm.engine.weights
        layout = weight_layout(llm.config, llm.policy, llm.dtype)
        planned = layout.tier_bytes()
        assert weights.bytes == {tier: sum(s[tier] for s in layout.stage_tiers.values()) for tier in planned}
        assert weights.host.nbytes == planned["cpu"] == sum(layout.host_requests)
        assert held_tensor_bytes(weights, torch.device("cpu")) - weights.host.nbytes == planned["gpu"]
        # The decoder layers compressed, as stored: a fraction of their float bytes (the embedding
        # and the head of a stored model stay exact).
        floats = weight_layout(llm.config, Policy(2, 2, TierFractions(0.3, 0.3, 0.4)), llm.dtype)

        def layers(of):
            return sum(sum(tiers.values()) for stage, tiers in of.stage_tiers.items() if stage.is_layer)

        assert layers(layout) < layers(floats) / 2
