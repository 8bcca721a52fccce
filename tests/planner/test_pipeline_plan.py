"""Planning a pipeline: each device's placement for its own layers and GPU memory, one batch
shape for all, the job at the pace of its slowest device; `flexoff search --pipeline-parallel`."""

import re
from dataclasses import replace

import pytest
import torch

from flexoff.commands.main import main
from flexoff.errors import PolicyError
from flexoff.layout import job_bytes, pins_host_memory
from flexoff.layout.stage_split import stage_view
from flexoff.models import resolve_model_config
from flexoff.planner.cost_model import Workload
from flexoff.planner.hardware import HardwareProfile, resolve_hardware
from flexoff.planner.pipeline import plan_pipeline, stage_workload
from flexoff.planner.search import search_policy
from flexoff.policy import TIERS

GiB = 1 << 30
JOB = Workload(512, 32, 480)


@pytest.fixture(scope="module")
def opt30b():
    return resolve_model_config("opt-30b")


def _h100(gpu_gib: float, share: int):
    profile = resolve_hardware("h100")
    return profile.with_memory(int(gpu_gib * GiB), profile.cpu_memory // share)


def test_each_stage_is_planned_for_its_layers_at_one_shape_with_room_for_every_block_in_rotation(opt30b):
    hardware = [_h100(16, 2)] * 2
    plan = plan_pipeline(opt30b, JOB, hardware, compress="off")
    assert [list(s.layers) for s in plan.stages] == [list(range(0, 24)), list(range(24, 48))]
    shape = {(p.gpu_batch_size, p.num_gpu_batches) for p in plan.policies}
    assert len(shape) == 1
    (size, batches), = shape
    for stage in plan.stages:
        # What the runtime checks before it makes a block's batches: the weights and two blocks fit.
        needed = job_bytes(stage_view(opt30b, 24), stage.policy, torch.float16, 512, 32,
                           pins_host_memory(stage.policy.pin_cpu_memory), blocks=2)
        assert all(needed[tier] <= stage.hardware.capacity(tier) for tier in TIERS), needed
        # Holding a second block never makes a device faster than it would be alone at that shape.
        alone = search_policy(stage_view(opt30b, 24), Workload(512, 32, 240), stage.hardware, compress="off",
                              gpu_batch_sizes=[size], num_gpu_batches=[batches])
        assert stage.prediction.total_throughput <= alone.throughput * (1 + 1e-9)
    assert plan.throughput == min(s.prediction.total_throughput for s in plan.stages)


def test_a_bigger_gpu_holds_more_of_its_stage_and_never_slows_the_pipeline(opt30b):
    plan = plan_pipeline(opt30b, JOB, [_h100(12, 2), _h100(40, 2)], compress="off")
    small, big = plan.stages
    assert big.policy.weights.gpu > small.policy.weights.gpu
    # The small GPU sets the pace of an even split; the plan gives the big one layers to even it out.
    assert plan.slowest is small or len(big.layers) > len(small.layers)
    assert len(big.layers) >= len(small.layers)
    even = plan_pipeline(opt30b, JOB, [_h100(12, 2)] * 2, compress="off")
    assert plan.throughput >= even.throughput * 0.999  # a bigger second GPU never slows the pipeline


def test_replicas_multiply_the_job_and_share_the_prompts(opt30b):
    one = plan_pipeline(opt30b, Workload(512, 32, None), [_h100(16, 4)] * 2, compress="off")
    two = plan_pipeline(opt30b, Workload(512, 32, None), [_h100(16, 4)] * 2, replicas=2, compress="off")
    assert two.throughput == pytest.approx(2 * one.throughput)
    assert stage_workload(Workload(512, 32, 480), 2, 2).num_prompts == 120
    assert stage_workload(Workload(512, 32, 7), 4).num_prompts == 2
    assert stage_workload(Workload(512, 32, None), 4).num_prompts is None


def test_a_pipeline_that_cannot_be_planned_says_why(opt30b):
    with pytest.raises(PolicyError, match="more than the 48 layers"):
        plan_pipeline(opt30b, JOB, [_h100(16, 49)] * 49)
    with pytest.raises(PolicyError, match="a pipeline stage of opt-30b fits no policy"):
        plan_pipeline(opt30b, JOB, [_h100(0.05, 2)] * 2)


def test_search_prints_every_stage_and_the_job(capsys):
    assert main(["search", "--model", "opt-30b", "--hardware", "h100", "--gpu-mem", "16GiB,24GiB",
                 "--pipeline-parallel", "2", "--num-prompts", "480"]) == 0
    out = capsys.readouterr().out
    assert "2 pipeline stages x 1 replica, host memory shared by 2 processes" in out
    stages = re.findall(r"^stage (\d)  layers (\d+)-(\d+) · gpu ([0-9.]+) GiB", out, re.M)
    (_, first, cut, _), (_, after, last, _) = stages
    # The stages cover the 48 layers in order, the smaller GPU's with no more than half.
    assert (int(first), int(cut) + 1, int(last)) == (0, int(after), 47) and int(cut) + 1 <= 24
    assert float(stages[0][3]) < float(stages[1][3])  # each stage's own cap, less the profile's headroom
    assert re.search(r"^job +[0-9.]+ token/s predicted: stage \d, the slowest", out, re.M)


def _predicted(pattern: str, out: str) -> float:
    return float(re.search(pattern, out, re.M).group(1))


def test_search_sets_the_plan_beside_one_gpu(capsys):
    argv = ["search", "--model", "opt-30b", "--hardware", "h100", "--pipeline-parallel", "2", "--num-prompts", "480"]
    assert main([*argv, "--gpu-mem", "16GiB,24GiB", "--compress", "auto"]) == 0
    out = capsys.readouterr().out
    job, alone = _predicted(r"^job +([0-9.]+) token/s", out), _predicted(r"^one GPU +([0-9.]+) token/s", out)
    # One GPU is planned at the largest cap (24 GiB) with the whole host, as `flexoff search` plans it.
    assert main(["search", "--model", "opt-30b", "--hardware", "h100", "--num-prompts", "480", "--gpu-mem", "24GiB",
                 "--compress", "auto"]) == 0
    single = _predicted(r"^  throughput +([0-9.]+) token/s", capsys.readouterr().out)
    assert alone == pytest.approx(single, rel=1e-3)
    ratio = _predicted(r"this plan is ([0-9.]+)x that", out)
    assert ratio == pytest.approx(job / alone, abs=0.01)
    assert ("fewer GPUs run this job faster" in out) == (job < alone)
    # Where one GPU cannot hold the job under the caps, the pipeline is what runs it.
    assert main(["search", "--model", "opt-66b", "--hardware", "h100", "--pipeline-parallel", "2", "--gpu-mem", "80GiB",
                 "--cpu-mem", "40GiB", "--disk-mem", "1GiB", "--num-prompts", "64"]) == 0
    assert "one GPU  fits no policy under these caps" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--gpu-mem", "16GiB,24GiB", "--pipeline-parallel", "3"], "--gpu-mem gives 2 sizes for 3 pipeline stages"),
    (["--pipeline-parallel", "2", "--output", "p.json"], "--output plans one device"),
    (["--gpu-mem", "16GiB,x"], "--gpu-mem: "),
])
def test_bad_pipeline_searches_are_one_line(capsys, argv, message):
    assert main(["search", "--model", "opt-30b", "--hardware", "h100", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_devices_that_differ_get_layers_by_their_speed_when_that_is_faster():
    """A small and a large device: the plan moves layers to the large one, and beats the even split."""
    from flexoff.planner.pipeline import _plan_split

    config = resolve_model_config("opt-125m")
    t4 = resolve_hardware("t4")
    MiB = 1 << 20
    hardware = [t4.with_memory(420 * MiB, 2 * GiB), t4.with_memory(800 * MiB, 2 * GiB)]
    job = Workload(64, 6, 24)
    plan = plan_pipeline(config, job, hardware, compress="off")
    even = _plan_split(config, stage_workload(job, 2), hardware, 1, [6, 6], {"compress": "off"})
    assert plan.layer_counts[0] < plan.layer_counts[1] and sum(plan.layer_counts) == 12
    assert plan.throughput > even.throughput
    same = plan_pipeline(config, job, [hardware[1]] * 2, compress="off")
    assert same.layer_counts == [6, 6]  # alike devices keep the even split


def test_gpus_whose_links_share_the_host_are_planned_at_their_share(tmp_path, capsys):
    """A profile that measured 1.2x one link's rate with copies to both GPUs at once: each of two
    stages plans at 0.6x, and is predicted slower than with links of their own."""
    profile = resolve_hardware("h100")
    shared = replace(profile, cpu_to_all_gpus_bandwidth=1.2 * profile.cpu_to_gpu_bandwidth, gpu_count=2)
    assert shared.sharing_links(2).cpu_to_gpu_bandwidth == pytest.approx(0.6 * profile.cpu_to_gpu_bandwidth)
    assert shared.sharing_links(2).gpu_to_cpu_bandwidth == pytest.approx(0.6 * profile.gpu_to_cpu_bandwidth)
    assert shared.sharing_links(1) is shared and profile.sharing_links(2) is profile
    fast = replace(profile, cpu_to_all_gpus_bandwidth=2.5 * profile.cpu_to_gpu_bandwidth, gpu_count=2)
    assert fast.sharing_links(2).cpu_to_gpu_bandwidth == profile.cpu_to_gpu_bandwidth  # never above one link
    path = tmp_path / "shared.json"
    shared.save(path)
    assert HardwareProfile.load(path) == shared
    rates = []
    for hardware in (profile, shared):
        hardware.save(path)
        assert main(["search", "--model", "opt-30b", "--hardware", str(path), "--gpu-mem", "16GiB",
                     "--pipeline-parallel", "2", "--num-prompts", "480"]) == 0
        out = capsys.readouterr().out
        rates.append(float(re.search(r"^job +([0-9.]+) token/s", out, re.M).group(1)))
    assert "host memory and links shared by 2 processes" in out
    assert rates[1] < rates[0]
