"""Each architecture module and each weight source offers what its Protocol names, with the same
parameters, so the runtime can call any of them the same way."""

import inspect

import pytest

from flexoff.models import REGISTRY, Architecture, architecture, llama, opt
from flexoff.weights import CheckpointWeights, DummyWeights, WeightSource


def protocol_members(protocol) -> dict[str, list[str]]:
    """Method name -> parameter names (without self)."""
    members = {}
    for name, member in vars(protocol).items():
        if inspect.isfunction(member) and not name.startswith("_"):
            members[name] = list(inspect.signature(member).parameters)[1:]
    return members


def parameters(function, bound: bool) -> list[str]:
    names = list(inspect.signature(function).parameters)
    return names[1:] if bound else names


@pytest.mark.parametrize("module", [opt, llama], ids=["opt", "llama"])
def test_architecture_modules_have_every_protocol_function(module):
    wanted = protocol_members(Architecture)
    assert {"embed", "layer", "head", "attention_inputs", "after_attention", "step_context"} <= set(wanted)
    for name, params in wanted.items():
        assert callable(getattr(module, name, None)), f"{module.__name__} lacks {name}"
        assert parameters(getattr(module, name), bound=False) == ["cfg", *params[1:]], name


@pytest.mark.parametrize("source", [DummyWeights, CheckpointWeights])
def test_weight_sources_have_every_protocol_method(source):
    for name, params in protocol_members(WeightSource).items():
        assert parameters(getattr(source, name), bound=True) == params, name


def test_the_registry_gives_each_family_its_module():
    assert isinstance(DummyWeights(0), WeightSource)
    assert architecture(REGISTRY["opt-125m"]) is opt
    assert architecture(REGISTRY["llama-3-8b"]) is llama
