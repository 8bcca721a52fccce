"""With no policy flags, a job that does not fit the compute device is planned (losslessly) on this
machine's profile, measured quickly and saved the first time; a job that fits keeps the default."""

import json

import pytest
import torch

from flexoff.api import DEFAULT_POLICY
from flexoff.commands.main import main
from flexoff.errors import PolicyError
from flexoff.models import resolve_model_config
from flexoff.planner.cost_model import Workload
from flexoff.planner.default import job_needs, plan_default
from flexoff.planner.hardware import default_profile_path, packaged_profile
from tests.conftest import untimed_records
from flexoff.planner.search import search_policy
from flexoff.layout import Capacity, overflow
from tests.conftest import PROMPTS

WORKLOAD = Workload(14, 4, len(PROMPTS))
H100 = packaged_profile("h100")
ROOMY = 1 << 30


def never():
    raise AssertionError("the profile is read only when the default does not fit")


@pytest.fixture
def tiny(tiny_model_dir):
    path, _ = tiny_model_dir("opt-pre")
    return path, resolve_model_config(str(path))


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_job_that_fits_keeps_the_default(tiny, device):
    _, config = tiny
    plan = plan_default(config, WORKLOAD, Capacity(ROOMY, ROOMY, None, device), torch.bfloat16, never, DEFAULT_POLICY)
    assert plan.policy is DEFAULT_POLICY and plan.search is None and plan.message is None


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_job_that_does_not_fit_the_device_is_planned_losslessly(tiny, device):
    _, config = tiny
    needed = job_needs(config, DEFAULT_POLICY, torch.bfloat16, WORKLOAD)["gpu"]
    cap = needed // 4
    capacity = Capacity(cap, ROOMY, None, device)
    plan = plan_default(config, WORKLOAD, capacity, torch.bfloat16, lambda: H100, DEFAULT_POLICY)
    assert plan.policy != DEFAULT_POLICY
    assert plan.policy.compress_weight is None and plan.policy.compress_cache is None
    assert overflow(job_needs(config, plan.policy, torch.bfloat16, WORKLOAD), capacity) is None
    cpu = ROOMY - cap if device == "cpu" else ROOMY  # on a CPU the device's cap comes out of the same RAM
    expected = search_policy(config, WORKLOAD, H100.with_memory(cap, cpu, 0), compress="off")
    assert plan.policy == expected.policy
    assert plan.message.startswith("planned    ") and "h100" in plan.message


def test_on_a_cpu_without_a_device_cap_planning_cannot_help(tiny):
    _, config = tiny
    needed = job_needs(config, DEFAULT_POLICY, torch.bfloat16, WORKLOAD)["gpu"]
    with pytest.raises(PolicyError, match=r"device \(cpu\) tier.*--percent.*--offload-dir"):
        plan_default(config, WORKLOAD, Capacity(None, needed // 2, None, "cpu"), torch.bfloat16, never,
                     DEFAULT_POLICY)


def test_when_no_lossless_policy_fits_the_error_says_what_it_needs_and_suggests_compression(tiny):
    _, config = tiny
    with pytest.raises(PolicyError, match=r"needs .* with everything there \(.* available\), and no lossless policy fits either: .*needs at least"
                                          r".*--compress-weight.*--compress auto"):
        plan_default(config, WORKLOAD, Capacity(1000, ROOMY, None, "cuda"), torch.bfloat16, lambda: H100,
                     DEFAULT_POLICY)


def test_planning_needs_16_bit(tiny):
    _, config = tiny
    with pytest.raises(PolicyError, match="--dtype float16 or bfloat16"):
        plan_default(config, WORKLOAD, Capacity(1000, ROOMY, None, "cuda"), torch.float32, never, DEFAULT_POLICY)


def _printed_plan(err: str) -> str:
    planned = [line for line in err.splitlines() if line.startswith("planned    ")]
    assert len(planned) == 1, err
    return planned[0].split()[1:3]  # "NxM", "w"


def _run(path, tmp_path, capsys, *extra):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    out = tmp_path / f"out{len(list(tmp_path.iterdir()))}.jsonl"
    code = main(["run", "--model", str(path), "--prompts", str(prompts), "--dtype", "bfloat16", "--gen-len", "4",
                 "--quiet", "--ignore-eos", "--output", str(out), *extra])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return captured, out


def test_the_headline_command_prints_the_plan_and_runs_it(tiny, tmp_path, capsys):
    path, config = tiny
    needed = job_needs(config, DEFAULT_POLICY, torch.bfloat16, WORKLOAD)["gpu"]
    cap = str(needed // 4)
    captured, planned_out = _run(path, tmp_path, capsys, "--hardware", "h100", "--gpu-mem", cap)
    plan = plan_default(config, WORKLOAD, Capacity(int(cap), ROOMY, None, "cpu"), torch.bfloat16, H100,
                        DEFAULT_POLICY).policy
    batches = f"{plan.gpu_batch_size}x{plan.num_gpu_batches}"
    assert _printed_plan(captured.err)[0] == batches
    assert f"gpu batch {plan.gpu_batch_size} × {plan.num_gpu_batches}" in captured.out  # the plan ran
    saved = tmp_path / "plan.json"
    plan.save(saved)
    _, explicit_out = _run(path, tmp_path, capsys, "--policy", str(saved))
    assert untimed_records(planned_out) == untimed_records(explicit_out)


def test_a_job_that_fits_runs_the_default_without_a_plan(tiny, tmp_path, capsys):
    path, _ = tiny
    captured, _ = _run(path, tmp_path, capsys, "--hardware", "h100")
    assert "planned" not in captured.err
    assert f"gpu batch {DEFAULT_POLICY.gpu_batch_size} × {DEFAULT_POLICY.num_gpu_batches}" in captured.out


def test_without_a_saved_profile_a_quick_one_is_measured_once_and_saved(tiny, tmp_path, capsys, monkeypatch):
    path, config = tiny
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    calls = []

    def measure(quick=False, disk_dir=None, device=None, log=None, progress=None):
        calls.append((quick, device))
        progress(0.0, "copies")
        progress(0.5, "host time")
        progress(1.0, None)
        return H100

    from flexoff.profiler import machine as profiler

    monkeypatch.setattr(profiler, "profile_machine", measure)
    cap = str(job_needs(config, DEFAULT_POLICY, torch.bfloat16, WORKLOAD)["gpu"] // 4)
    work = tmp_path / "work"
    work.mkdir()
    first, _ = _run(path, work, capsys, "--gpu-mem", cap)
    assert calls == [(True, "cpu")]
    assert json.loads(default_profile_path().read_text())["name"] == H100.name
    assert str(default_profile_path()) in first.err and _printed_plan(first.err)
    # the user hears that it is measuring, and how far it is (stderr is no terminal here: a line each)
    assert ("profile    measuring   0%  copies\nprofile    measuring  50%  host time\n"
            "profile    measuring 100%\n") in first.err
    second, _ = _run(path, work, capsys, "--gpu-mem", cap)
    assert calls == [(True, "cpu")]  # read back, not measured again
    assert _printed_plan(second.err) == _printed_plan(first.err) and "measuring" not in second.err


def test_the_python_api_plans_for_a_workload_it_is_given(tiny):
    from flexoff import LLM

    path, config = tiny
    cap = job_needs(config, DEFAULT_POLICY, torch.bfloat16, WORKLOAD)["gpu"] // 4
    expected = plan_default(config, WORKLOAD, Capacity(cap, ROOMY, None, "cpu"), torch.bfloat16, H100,
                            DEFAULT_POLICY).policy
    with LLM(str(path), dtype="bfloat16", gpu_mem=cap, workload=WORKLOAD, hardware=H100) as llm:
        assert llm.policy == expected and llm.plan.message.startswith("planned    ")
    with LLM(str(path), dtype="bfloat16", workload=WORKLOAD, hardware=never) as llm:
        assert llm.policy == DEFAULT_POLICY and llm.plan.message is None


def test_the_python_api_measuring_a_profile_logs_it_and_prints_nothing(tiny, tmp_path, capsys, caplog, monkeypatch):
    """The API says what it measures through the ``flexoff`` logger; only the commands print."""
    from flexoff import LLM
    from flexoff.profiler import machine as profiler

    path, config = tiny
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(profiler, "profile_machine", lambda **kwargs: H100)
    cap = job_needs(config, DEFAULT_POLICY, torch.bfloat16, WORKLOAD)["gpu"] // 4
    capsys.readouterr()
    with caplog.at_level("INFO", logger="flexoff"):
        with LLM(str(path), dtype="bfloat16", gpu_mem=cap, workload=WORKLOAD) as llm:
            assert llm.plan.search is not None  # planned, on the profile just measured
    assert capsys.readouterr() == ("", "")
    said = [record.getMessage() for record in caplog.records if record.name == "flexoff"]
    assert said[0].startswith("no hardware profile saved at ") and said[-1].startswith("measured in ")


@pytest.mark.parametrize("search_stages", [False, True])
def test_a_planned_job_forms_its_blocks_with_the_plans_generated_token_weight(tiny, monkeypatch, search_stages):
    """The Python API's plan and the command line's (each pipeline stage searched, one here) keep
    the searched policy's prediction; the blocks are formed weighing a generated token by it, and
    an explicit policy counts both alike."""
    import flexoff.api.llm as llm_module
    from flexoff import LLM
    from flexoff.deploy.deployment import Request, resolve_deployment

    path, config = tiny
    cap = job_needs(config, DEFAULT_POLICY, torch.bfloat16, WORKLOAD)["gpu"] // 4
    weights = []
    real = llm_module.form_blocks
    monkeypatch.setattr(llm_module, "form_blocks", lambda *a, **k: weights.append(k["budget_weight"]) or real(*a, **k))
    if search_stages:
        request = Request(str(path), dtype="bfloat16", gpu_mem=str(cap), hardware=H100, policy="auto",
                          search_stages=True)
        llm = LLM.from_deployment(resolve_deployment(request), WORKLOAD)
    else:
        llm = LLM(str(path), dtype="bfloat16", gpu_mem=cap, workload=WORKLOAD, hardware=H100)
    with llm:
        predicted = llm.plan.prediction
        assert predicted is not None and predicted.policy.gpu_batch_size == llm.policy.gpu_batch_size
        llm.generate(PROMPTS[:2])
        assert weights == [predicted.generated_token_weight]
    with LLM(str(path), dtype="bfloat16", policy=llm.policy, gpu_mem=cap) as explicit:
        assert explicit.plan is None or explicit.plan.prediction is None
        explicit.generate(PROMPTS[:2])
        assert weights[-1] == 1
