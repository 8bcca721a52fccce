import csv
import json

import pytest

from flexoff.errors import ConfigError, PolicyError, UnknownModelError
from flexoff.commands import main as cli
from flexoff.planner.hardware import HardwareProfile
from flexoff.policy import Policy


def run(argv, capsys):
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_search_prints_policy_prediction_memory_and_bound(capsys, tmp_path):
    output = tmp_path / "policy.json"
    code, out, err = run(["search", "--model", "opt-30b", "--hardware", "t4", "--compress", "off",
                          "--output", str(output)], capsys)
    assert code == 0, err
    for text in ("gpu batch size x batches", "weights gpu/cpu/disk", "token/s generated", "block latency",
                 "decode bound by", "memory", "usable"):
        assert text in out
    policy = Policy.load(output)  # what `flexoff run --policy FILE` reads
    assert policy.compress_weight is None


def test_pareto_table_csv_and_plot(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    table, image = tmp_path / "frontier.csv", tmp_path / "frontier.png"
    code, out, err = run(["search", "--model", "opt-175b", "--hardware", "t4", "--compress", "on",
                          "--pareto-csv", str(table), "--pareto-plot", str(image)], capsys)
    assert code == 0, err
    assert "latency-throughput frontier" in out
    rows = list(csv.DictReader(table.open()))
    assert len(rows) >= 3
    latencies = [float(r["block_latency_s"]) for r in rows]
    assert latencies == sorted(latencies)
    assert image.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_max_latency_limits_the_chosen_policy_and_the_frontier(capsys):
    code, out, err = run(["search", "--model", "opt-30b", "--hardware", "t4", "--max-latency", "150",
                          "--pareto"], capsys)
    assert code == 0, err
    frontier = out.split("latency-throughput frontier")[1].strip().splitlines()[1:]
    assert frontier and all(float(line.split()[0]) <= 150 for line in frontier)


@pytest.mark.parametrize("argv, message", [
    (["--gpu-mem", "16XB"], "--gpu-mem: cannot parse size '16XB'"),
    (["--max-latency", "1"], "lowest block latency possible is"),
    (["--cpu-mem", "10GB", "--disk-mem", "50GB"], "cannot fit this machine even with everything offloaded"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, argv, message):
    code, out, err = run(["search", "--model", "opt-175b", "--hardware", "t4"] + argv, capsys)
    assert code == 2
    assert message in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_a_bad_size_is_reported_before_a_missing_profile(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # no saved profile
    code, _, err = run(["search", "--model", "opt-30b", "--gpu-mem", "16XB"], capsys)
    assert code == 2 and "--gpu-mem: cannot parse size '16XB'" in err


def test_handlers_raise_flexoff_errors_for_the_main_cli(tmp_path):
    parser = cli.build_parser()
    foreign = tmp_path / "foreign.json"
    foreign.write_text(json.dumps({"hello": 1}))
    with pytest.raises(ConfigError, match="'format'"):
        args = parser.parse_args(["search", "--model", "opt-30b", "--hardware", str(foreign)])
        args.handler(args)
    with pytest.raises(UnknownModelError):
        args = parser.parse_args(["search", "--model", "gpt-5", "--hardware", "t4"])
        args.handler(args)
    with pytest.raises(PolicyError):
        args = parser.parse_args(["search", "--model", "opt-175b", "--hardware", "t4", "--max-latency", "1"])
        args.handler(args)


def test_search_reads_the_saved_profile_by_default(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    code, _, err = run(["search", "--model", "opt-1.3b"], capsys)
    assert code == 2 and "flexoff profile" in err
    from flexoff.planner.hardware import default_profile_path, packaged_profile

    packaged_profile("h100").save(default_profile_path())
    code, out, err = run(["search", "--model", "opt-1.3b"], capsys)
    assert code == 0, err
    assert "on h100" in out


def test_profile_quick_writes_a_loadable_profile(capsys, tmp_path, monkeypatch):
    from flexoff.profiler import machine as profiler

    monkeypatch.setattr(profiler, "QUICK", profiler.ProfileSizes(
        (1 << 20, 4 << 20), 8 << 20, (1, 16, 64), 128, 256, 1, 1 << 16, 0.0, 1 << 20))
    output = tmp_path / "hw.json"
    code, out, err = run(["profile", "--quick", "--device", "cpu", "--output", str(output),
                          "--disk-dir", str(tmp_path)], capsys)
    assert code == 0, err
    profile = HardwareProfile.load(output)
    assert "CPU only" in profile.device
    assert profile.measurements["disk"]["bytes"] == 8 << 20
    assert [m for m, _ in profile.matmul_flops] == [1, 16, 64]
    assert profile.host_seconds_per_layer > 0 and "host_overhead" in profile.measurements
    assert profile.host_seconds_per_llama_layer > 0 and profile.host_seconds_per_sparse_layer > 0
    assert profile.host_seconds_per_disk_rows_layer > 0
    assert "compressed cache on disk, several batches" in profile.measurements["host_overhead"]["decode_seconds_per_step"]
    assert HardwareProfile.load(output) == HardwareProfile.from_dict(profile.to_dict(), "round trip")
    assert profile.measurements["cpu_attention"]["rows"] == [2, 4]
    assert not profile.pinned_host_memory  # no CUDA: the runtime does not pin
    assert "wrote" in out


def test_profile_prints_the_routed_experts_it_measured(capsys, tmp_path, monkeypatch):
    """A GPU's profile lists each expert shape's rates (measured only on CUDA, so stood in for here)."""
    from dataclasses import replace

    from flexoff.profiler import machine as profiler
    from flexoff.planner.hardware import packaged_profile
    from flexoff.planner.sparse_rate import SparseRate

    rate = SparseRate((4096, 14336, 8, 2), ((512.0, 2.1e14), (4096.0, 5.2e14)))
    measured = replace(packaged_profile("h100"), sparse_mlp_flops=(rate,))
    monkeypatch.setattr(profiler, "profile_machine", lambda **kwargs: measured)
    output = tmp_path / "hw.json"
    code, out, err = run(["profile", "--output", str(output)], capsys)
    assert code == 0, err
    assert "routed experts 4096x14336x8x2" in out and "512: 210, 4096: 520" in out
    assert HardwareProfile.load(output).sparse_mlp_flops == (rate,)


@pytest.mark.parametrize("model, compress", [("opt-175b", "on"), ("opt-30b", "off")])
def test_the_frontier_plots_tick_labels_do_not_overlap_and_its_title_names_workload_and_cap(model, compress):
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from flexoff.commands.report import frontier_figure, frontier_title
    from flexoff.models import REGISTRY
    from flexoff.planner import Workload, packaged_profile, pareto_frontier

    hardware = packaged_profile("t4")
    frontier = [r.prediction for r in pareto_frontier(REGISTRY[model], Workload(512, 32), hardware,
                                                      compress=compress)]
    fig = frontier_figure(frontier, frontier_title(model, hardware, 512, 32))
    fig.set_size_inches(5.5, 4)  # a notebook's half-width panel
    try:
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        for axis in (fig.axes[0].xaxis, fig.axes[0].yaxis):
            boxes = [label.get_window_extent(renderer) for label in axis.get_ticklabels(which="both")
                     if label.get_visible() and label.get_text()]
            assert 2 <= len(boxes) <= (7 if axis is fig.axes[0].xaxis else 12)
            # Apart by more than a character's width, not only just clear of one another.
            assert not any(a.padded(8).overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:])
        title = fig.axes[0].get_title()
        assert "prompt 512, generate 32" in title and "GiB" in title and hardware.name in title
        assert fig.axes[0].get_legend() is not None
    finally:
        plt.close(fig)


@pytest.mark.parametrize("where", ["a directory", "under a file"])
def test_profile_refuses_an_output_it_cannot_write_before_measuring(capsys, tmp_path, monkeypatch, where):
    from flexoff.profiler import machine as profiler

    def measure(**kwargs):
        raise AssertionError("measured before the output was checked")

    monkeypatch.setattr(profiler, "profile_machine", measure)
    output = tmp_path
    if where == "under a file":
        (tmp_path / "notes.txt").write_text("kept\n")
        output = tmp_path / "notes.txt" / "hw.json"
    code, out, err = run(["profile", "--output", str(output)], capsys)
    assert code == 2 and str(output) in err and len(err.strip().splitlines()) == 1, err
    assert (tmp_path / "notes.txt").read_text() == "kept\n" if where == "under a file" else output.is_dir()
