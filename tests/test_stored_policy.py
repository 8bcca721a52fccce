"""Where a policy meets a model whose checkpoint stores its matrices compressed: a policy without
weight compression reads them as stored, the stored format is kept, another is refused in one line,
through the API and the command line; --compress then governs the cache alone."""

import json

import pytest

from flexoff import LLM, CompressionConfig, Policy
from flexoff.commands.main import main
from flexoff.errors import PolicyError
from flexoff.models import REGISTRY
from flexoff.planner.default import weights_as_stored
from tests.conftest import PROMPTS
from tests.test_compress import TIGHT, one_error_line

STORED = CompressionConfig(4, 32)
REFUSED = ("stores its matrices as 4-bit groups of 32; a policy cannot recompress them as 4-bit groups of 64: "
           "give compress_weight {bits: 4, group_size: 32} (--compress-weight --weight-bits 4 --weight-group 32) "
           "or none")


def test_the_rule():
    config = REGISTRY["opt-125m"].replace(stored_compression=STORED)
    cache = CompressionConfig(8, 16)
    assert weights_as_stored(Policy(4, compress_cache=cache), config) == Policy(4, compress_weight=STORED,
                                                                                compress_cache=cache)
    same = Policy(4, compress_weight=STORED)
    assert weights_as_stored(same, config) is same
    with pytest.raises(PolicyError) as refused:
        weights_as_stored(Policy(compress_weight=CompressionConfig(4, 64)), config)
    assert str(refused.value) == f"opt-125m {REFUSED}"
    other = Policy(compress_weight=CompressionConfig(3, 64))
    assert weights_as_stored(other, REGISTRY["opt-125m"]) is other  # float weights: any policy


@pytest.fixture
def stored(tiny_model_dir, tmp_path, monkeypatch):
    """A tiny checkpoint whose config says it stores its matrices in STORED (its source hands none
    over compressed, so the store quantizes them), wherever flexoff resolves it; (path, prompts file)."""
    import flexoff.deploy.deployment as deployment
    import flexoff.models as models

    path, _ = tiny_model_dir("opt-pre")
    resolve = deployment.resolve_model

    def as_stored(model, dummy=False):
        config, checkpoint = resolve(model, dummy)
        return config.replace(stored_compression=STORED), checkpoint

    monkeypatch.setattr(deployment, "resolve_model", as_stored)
    monkeypatch.setattr(models, "resolve_model_config", lambda model: as_stored(model, True)[0])
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n" for i, p in enumerate(PROMPTS[:3])))
    return str(path), str(prompts)


def test_an_llm_reads_the_weights_as_stored_and_refuses_to_recompress_them(stored):
    path, _ = stored
    with LLM(path) as llm:
        assert llm.policy.compress_weight == STORED and llm.engine.weights.as_stored
    with LLM(path, policy=Policy(2, compress_weight=STORED, compress_cache=CompressionConfig(8, 16))) as llm:
        assert llm.policy == Policy(2, compress_weight=STORED, compress_cache=CompressionConfig(8, 16))
    with pytest.raises(PolicyError, match="recompress them as 3-bit groups of 64"):
        LLM(path, policy=Policy(compress_weight=CompressionConfig(3, 64)))


def test_the_command_line_refuses_another_weight_compression_in_one_line(stored, capsys):
    path, prompts = stored
    assert main(["run", "--model", path, "--prompts", prompts, "--gen-len", "2", "--quiet", "--compress-weight"]) == 2
    assert one_error_line(capsys).endswith(REFUSED)


def test_a_run_says_the_weights_are_as_stored(stored, capsys):
    path, prompts = stored
    assert main(["run", "--model", path, "--prompts", prompts, "--gen-len", "2", "--quiet"]) == 0
    policy_line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("policy"))
    assert policy_line.endswith(" · weights 4-bit g32 as stored")


def test_a_policy_file_of_the_stored_format_does_not_contradict_compress_off(stored, tmp_path, capsys):
    path, prompts = stored
    policy = tmp_path / "stored.json"
    policy.write_text(json.dumps({"compress_weight": {"bits": 4, "group_size": 32}}))
    assert main(["run", "--model", path, "--prompts", prompts, "--policy", str(policy), "--compress", "off",
                 "--gen-len", "2", "--quiet"]) == 0
    policy.write_text(json.dumps({"compress_weight": {"bits": 4, "group_size": 32},
                                  "compress_cache": {"bits": 4, "group_size": 64}}))
    assert main(["run", "--model", path, "--prompts", prompts, "--policy", str(policy), "--compress", "off"]) == 2
    line = one_error_line(capsys)
    assert "compresses the cache, which contradicts --compress off" in line


@pytest.mark.parametrize("compress", [None, "on"])
def test_policy_auto_plans_the_weights_as_stored_and_compress_decides_the_cache(stored, capsys, compress):
    """Under the tight cap that only a compressed policy of the float model fits, the stored
    model's weights are compressed already: planning off plans them with a lossless cache."""
    path, prompts = stored
    flags = ["--compress", compress] if compress else []
    argv = ["run", "--model", path, "--prompts", prompts, *TIGHT, "--gen-len", "2", "--quiet", "--policy", "auto"]
    assert main(argv + flags) == 0
    captured = capsys.readouterr()
    searched = next(line for line in captured.err.splitlines() if line.startswith("searched"))
    assert (" 4-bit for prompt " in searched) == (compress == "on")
    assert (" 4-bit weights for prompt " in searched) == (compress is None)
    policy_line = next(line for line in captured.out.splitlines() if line.startswith("policy"))
    assert " · weights 4-bit g32 as stored" in policy_line
    assert ("cache 4-bit (lossy)" in policy_line) == (compress == "on")


def test_the_lm_eval_adapter_plans_the_weights_as_stored(stored):
    pytest.importorskip("lm_eval")
    from flexoff.harness.lm_eval_adapter import FlexoffLM

    path, _ = stored
    lm = FlexoffLM(pretrained=path, device="cpu", dtype="bfloat16", policy="auto", hardware="t4", gpu_mem="60KB")
    try:
        with pytest.warns(UserWarning, match="planned .* 4-bit weights on "):
            llm = lm._llm_for(14, 2, 3)
        assert llm.policy.compress_weight == STORED and llm.policy.compress_cache is None
    finally:
        lm.close()
