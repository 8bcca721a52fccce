"""The HF baseline's model building, on the CPU: the meta model is refused where transformers would run
another model than flexoff's, and filling it leaves no parameter empty, ties kept, routers not constant."""

import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import hf_accelerate_driver as driver  # noqa: E402
from hf_models import Unmapped  # noqa: E402
from tests.bench.test_hf_models import TINY  # noqa: E402

pytest.importorskip("transformers")


def on_meta():
    return torch.device("meta")


@pytest.mark.parametrize("kind", ["opt", "qwen3-moe", "qwen2-moe", "mixtral"])
def test_materialise_fills_every_parameter_on_its_device(kind):
    model = driver.meta_model(TINY[kind], empty_weights=on_meta)
    driver.materialise(model, lambda name: "cpu", report=lambda message: None)
    params = dict(model.named_parameters(remove_duplicate=False))
    assert all(p.device.type == "cpu" and p.dtype == torch.float16 for p in params.values())
    if kind == "opt":  # the tied head is the embedding itself, not a copy
        assert params["lm_head.weight"].data_ptr() == params["model.decoder.embed_tokens.weight"].data_ptr()
    else:  # a constant router would send every token to the same experts, and each layer routes its own way
        routers = [p for name, p in params.items()
                   if name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight"))]
        assert len(routers) == TINY[kind].num_layers and routers[0].float().std() > 0
        assert not torch.equal(routers[0], routers[1])


def test_a_model_transformers_builds_otherwise_is_refused(monkeypatch):
    """An older transformers without a field (a Qwen2 always biased, a Llama without head_dim) would
    build other weights: the baseline says so rather than time another model."""
    monkeypatch.setattr(driver, "parameter_count", lambda cfg: 1)
    with pytest.raises(Unmapped, match="parameters where flexoff"):
        driver.meta_model(TINY["qwen3-moe"], empty_weights=on_meta)


@contextmanager
def parameters_on_meta():
    """Accelerate's init_empty_weights, in short: new parameters on meta, buffers (RoPE's) computed."""
    register = torch.nn.Module.register_parameter

    def on_meta(module, name, param):
        register(module, name, param)
        if param is not None:
            module._parameters[name] = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    torch.nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


@pytest.mark.parametrize("kind", ["mixtral", "qwen2-moe"])
def test_a_filled_mixture_generates_and_times_its_phases(kind):
    cfg = TINY[kind]
    model = driver.meta_model(cfg, empty_weights=parameters_on_meta)
    driver.materialise(model, lambda name: "cpu", report=lambda message: None)
    prefill, decode = driver.generate(model, 2, 8, 3, cfg.pad_token_id, device="cpu")
    assert prefill > 0 and decode > 0
