import json
import math

import pytest

from flexoff.errors import ConfigError
from flexoff.planner.hardware import HardwareProfile, packaged_profile, resolve_hardware


def test_packaged_profiles_load_by_name_and_say_where_they_come_from():
    t4 = resolve_hardware("t4")
    assert t4.name == "t4_flexgen"
    assert t4.cpu_to_gpu_bandwidth == pytest.approx(12.89e9)
    assert t4.capacity("gpu") == pytest.approx(15e9 * 0.8)
    h100 = resolve_hardware("H100")
    assert "measured by `flexoff profile" in h100.source and "H100" in h100.device
    assert h100.matmul_flops_at(4096) == pytest.approx(770e12, rel=0.05)  # anchors.md: 770 TFLOP/s
    assert h100.host_seconds_per_layer > 0


def test_profile_round_trips_through_json(tmp_path):
    original = packaged_profile("t4")
    path = tmp_path / "p.json"
    original.save(path)
    again = HardwareProfile.load(path)
    assert again == original
    assert again.notes == original.notes
    assert resolve_hardware(str(path)) == original


def test_optional_measurements_round_trip(tmp_path, make_hardware):
    measured = make_hardware(disk_to_cpu_cached_bandwidth=9e9, gpu_kv_dequant_throughput=5e11,
                             gpu_kv_quant_throughput=2e10, cpu_attention_share_under_copy=0.44,
                             cpu_attention_seconds_per_call=3e-4, host_seconds_per_layer=2e-4,
                             host_seconds_per_step=1e-3)
    measured.save(tmp_path / "p.json")
    assert HardwareProfile.load(tmp_path / "p.json") == measured
    assert not measured.pinned_host_memory  # the round test machine's choice survives the trip
    # A profile that does not say is of a CUDA machine, whose runtime pins host memory.
    assert resolve_hardware("t4").pinned_host_memory
    # Profiles without them price disk reads cold, KV rows like weights, and no contention.
    plain = make_hardware()
    assert plain.kv_dequant_throughput == plain.kv_quant_throughput == plain.gpu_dequant_throughput
    assert plain.disk_to_cpu_cached_bandwidth is None and plain.cpu_attention_share_under_copy == 1.0
    assert plain.host_seconds_per_layer == plain.host_seconds_per_step == plain.cpu_attention_seconds_per_call == 0.0


def test_matmul_curve_interpolates_log_log_and_scales_below_the_first_point(make_hardware):
    hw = make_hardware(matmul_flops=((8.0, 10.0), (32.0, 40.0), (128.0, 50.0)))
    assert hw.matmul_flops_at(8) == pytest.approx(10.0)
    assert hw.matmul_flops_at(16) == pytest.approx(20.0)  # halfway in log m: geometric mean of 10 and 40
    assert hw.matmul_flops_at(64) == pytest.approx(math.sqrt(40 * 50))
    assert hw.matmul_flops_at(2) == pytest.approx(2.5)  # same time as m = 8, a quarter of the work
    assert hw.matmul_flops_at(1000) == pytest.approx(50.0)


def _t4_dict():
    return packaged_profile("t4").to_dict()


@pytest.mark.parametrize("mutate, field", [
    (lambda d: d.pop("bandwidth_bytes_per_s"), "bandwidth_bytes_per_s"),
    (lambda d: d["bandwidth_bytes_per_s"].pop("disk_to_cpu"), "bandwidth_bytes_per_s.disk_to_cpu"),
    (lambda d: d["bandwidth_bytes_per_s"].update(cpu_to_gpu="fast"), "bandwidth_bytes_per_s.cpu_to_gpu"),
    (lambda d: d["bandwidth_bytes_per_s"].update(cpu_to_gpu=-1.0), "bandwidth_bytes_per_s.cpu_to_gpu"),
    (lambda d: d["compute"].update(matmul_flop_per_s=[[1, 2, 3]]), "compute.matmul_flop_per_s[0]"),
    (lambda d: d["compute"].update(matmul_flop_per_s=[[8, 1.0], [4, 2.0]]), "compute.matmul_flop_per_s"),
    (lambda d: d["memory_bytes"].update(gpu="16XB"), "memory_bytes.gpu"),
    (lambda d: d["usable_fraction"].update(cpu=1.5), "usable_fraction.cpu"),
    (lambda d: d.update(version=7), "version"),
    (lambda d: d.update(speed_of_light=1), "speed_of_light"),
    (lambda d: d["compute"].update(tensor_cores=1), "compute.tensor_cores"),
    (lambda d: d["compute"].update(cpu_attention_share_under_copy=1.5), "compute.cpu_attention_share_under_copy"),
    (lambda d: d["compute"].update(gpu_kv_dequant_elements_per_s=0), "compute.gpu_kv_dequant_elements_per_s"),
    (lambda d: d["compute"].update(host_seconds_per_layer=-1e-3), "compute.host_seconds_per_layer"),
    (lambda d: d["compute"].update(cpu_attention_seconds_per_call="0.3ms"), "compute.cpu_attention_seconds_per_call"),
    (lambda d: d.update(pinned_host_memory="yes"), "pinned_host_memory"),
    (lambda d: d["bandwidth_bytes_per_s"].update(disk_to_cpu_cached="x"), "bandwidth_bytes_per_s.disk_to_cpu_cached"),
])
def test_malformed_profile_is_refused_naming_the_field(mutate, field):
    data = _t4_dict()
    mutate(data)
    with pytest.raises(ConfigError, match=f"'{field}'".replace("[", r"\[").replace("]", r"\]")):
        HardwareProfile.from_dict(data)


def test_foreign_json_is_refused(tmp_path):
    path = tmp_path / "policy.json"
    path.write_text(json.dumps({"gpu_batch_size": 4}))
    with pytest.raises(ConfigError, match="'format'.*not a flexoff hardware profile"):
        HardwareProfile.load(path)
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        HardwareProfile.load(path)
    path.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="JSON object"):
        HardwareProfile.load(path)


def test_sizes_may_be_written_with_units():
    data = _t4_dict()
    data["memory_bytes"]["gpu"] = "16GiB"
    assert HardwareProfile.from_dict(data).gpu_memory == 16 * 2**30


def test_unknown_names_and_missing_files_are_user_errors(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="neither a file nor a packaged profile"):
        resolve_hardware("a100")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with pytest.raises(ConfigError, match="run `flexoff profile` first"):
        resolve_hardware(None)


def test_with_memory_replaces_only_the_named_tiers():
    hw = packaged_profile("t4").with_memory(gpu=24 * 10**9)
    assert hw.gpu_memory == 24 * 10**9
    assert hw.cpu_memory == packaged_profile("t4").cpu_memory
