"""The machine the planner plans for: memory per tier, link bandwidths, and compute rates.

A profile is a JSON file. The reference ones ship inside the package (``t4``, ``h100``);
``flexoff profile`` measures the machine it runs on and writes a new one.
All quantities are in base units: bytes, bytes per second, FLOP per second, elements per second.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path

from ..errors import ConfigError
from ..fileio import nothing_at, read_user_json, write_text_atomic
from ..units import parse_size
from .sparse_rate import KEY as SPARSE_KEY
from .sparse_rate import SHAPE_KEYS, SparseRate, loglog

FORMAT_TAG = "flexoff-hardware-profile"
FORMAT_VERSION = 1
TIERS = ("gpu", "cpu", "disk")
# Short names for the packaged profiles.
PACKAGED_PROFILES = {"t4": "t4_flexgen", "t4_flexgen": "t4_flexgen", "h100": "h100", "h200": "h200"}

_BANDWIDTH_FIELDS = ("cpu_to_gpu", "gpu_to_cpu", "disk_to_cpu", "cpu_to_disk")
_OPTIONAL_BANDWIDTH_FIELDS = ("gpu_to_cpu_cache", "cpu_to_disk_cache", "disk_to_cpu_cached", "cpu_to_all_gpus")
_COMPUTE_FIELDS = (
    "prefill_attention_flop_per_s",
    "decode_attention_flop_per_s",
    "gpu_memory_bytes_per_s",
    "cpu_attention_flop_per_s",
    "gpu_dequant_elements_per_s",
    "cpu_dequant_elements_per_s",
)
HOST_EXTRA_FIELDS = ("host_seconds_per_travelling_layer", "host_seconds_per_compressed_cache_layer",
                     "host_seconds_per_compressed_weight_layer", "host_seconds_per_llama_layer",
                     "host_seconds_per_sparse_layer", "host_seconds_per_disk_rows_layer")
_OPTIONAL_COMPUTE_FIELDS = ("gpu_kv_dequant_elements_per_s", "gpu_kv_quant_elements_per_s",
                            "cpu_attention_share_under_copy", "cpu_attention_seconds_per_call",
                            "host_seconds_per_layer", "host_seconds_per_step", *HOST_EXTRA_FIELDS)
_TOP_FIELDS = {
    "format", "version", "name", "device", "source", "memory_bytes", "usable_fraction", "pinned_host_memory",
    "bandwidth_bytes_per_s", "compute", "notes", "measurements", "gpu_count",
}


@dataclass(frozen=True)
class HardwareProfile:
    """Measured (or published) constants of one machine.

    ``matmul_flops`` maps a matmul's row count m to its FLOP/s: decode multiplies few rows and is
    bound by reading the weights, prefill multiplies many and is bound by compute, so one number
    is wrong for one of them.
    """

    name: str
    gpu_memory: int
    cpu_memory: int
    disk_memory: int
    cpu_to_gpu_bandwidth: float
    gpu_to_cpu_bandwidth: float
    disk_to_cpu_bandwidth: float
    cpu_to_disk_bandwidth: float
    matmul_flops: tuple[tuple[float, float], ...]
    prefill_attention_flops: float
    decode_attention_flops: float
    gpu_memory_bandwidth: float
    cpu_attention_flops: float
    gpu_dequant_throughput: float
    cpu_dequant_throughput: float
    # KV-cache writes are strided and slower on some machines; None means "same as the plain link".
    gpu_to_cpu_cache_bandwidth: float | None = None
    cpu_to_disk_cache_bandwidth: float | None = None
    # Reads of a file the page cache still holds; None: every disk read is priced at the cold rate.
    disk_to_cpu_cached_bandwidth: float | None = None
    # Host-to-GPU bytes per second in all, with copies to each of the machine's ``gpu_count`` GPUs at
    # once: below gpu_count x cpu_to_gpu where their links share the way to host memory. None: not
    # measured (one GPU, or profiled before), and each GPU is taken to have its link to itself.
    cpu_to_all_gpus_bandwidth: float | None = None
    gpu_count: int = 1
    # Dequantizing KV-cache-shaped tensors (short groups along head_dim) runs slower than weights.
    gpu_kv_dequant_throughput: float | None = None
    # Quantizing a prefill's keys into a compressed cache; None: at the KV dequantization rate.
    gpu_kv_quant_throughput: float | None = None
    # CPU attention and the copy engine share host memory: the share of its speed CPU attention
    # keeps while pinned host-to-GPU copies run (1.0: no contention).
    cpu_attention_share_under_copy: float = 1.0
    # A fixed cost of each CPU attention call (up to CPU_ATTENTION_ROWS sequences) beside its FLOPs:
    # small GPU batches attend at well under the profiled rate. 0: not measured.
    cpu_attention_seconds_per_call: float = 0.0
    # The runtime's host time per decoder layer and per step of one GPU batch (launches, bookkeeping),
    # apart from the work it launches: a floor under small batches. 0: not measured.
    host_seconds_per_layer: float = 0.0
    host_seconds_per_step: float = 0.0
    # The host's extra time per decoder layer of one GPU batch whose cache travels to the GPU (the
    # load, the workspace, the store of the new slot); more where that cache is compressed
    # (quantizing and dequantizing it); and per pass over a layer's compressed weights. 0: not measured.
    host_seconds_per_travelling_layer: float = 0.0
    host_seconds_per_compressed_cache_layer: float = 0.0
    host_seconds_per_compressed_weight_layer: float = 0.0
    # The host's extra time per layer of a Llama-family model over an OPT one (RMS norms, rotary
    # embedding, a gated MLP), and per sparse layer of a mixture of experts over a dense one (the
    # router, the sort by expert, the grouped matmuls). 0: not measured.
    host_seconds_per_llama_layer: float = 0.0
    host_seconds_per_sparse_layer: float = 0.0
    # The host's extra time per decoder layer of one GPU batch with cache rows on disk, over the
    # same batch's cache travelling from host memory: the batch's reads and writes of its files and
    # the helper threads' turns at the interpreter. Per batch, however few of its rows are on disk.
    # 0: not measured.
    host_seconds_per_disk_rows_layer: float = 0.0
    # A sparse layer's routed experts by shape (see sparse_rate); none measured: the dense curve.
    sparse_mlp_flops: tuple[SparseRate, ...] = ()
    usable_fraction: tuple[float, float, float] = (0.9, 0.9, 0.9)
    # The runtime pins host memory where CUDA exists; the cache in slabs whose unused ends count too.
    pinned_host_memory: bool = True
    device: str = ""
    source: str = ""
    notes: dict = field(default_factory=dict, compare=False)
    measurements: dict = field(default_factory=dict, compare=False)

    # ---- derived quantities the cost model reads

    @property
    def gtoc_cache_bandwidth(self) -> float:
        return self.gpu_to_cpu_cache_bandwidth or self.gpu_to_cpu_bandwidth

    @property
    def ctod_cache_bandwidth(self) -> float:
        return self.cpu_to_disk_cache_bandwidth or self.cpu_to_disk_bandwidth

    @property
    def kv_dequant_throughput(self) -> float:
        return self.gpu_kv_dequant_throughput or self.gpu_dequant_throughput

    @property
    def kv_quant_throughput(self) -> float:
        return self.gpu_kv_quant_throughput or self.kv_dequant_throughput

    def sharing_links(self, gpus: int) -> "HardwareProfile":
        """The machine as each of ``gpus`` GPUs copying at once sees it (a pipeline's stages on one
        host): its host links at its share of what they move together, where that is less."""
        if gpus <= 1 or self.cpu_to_all_gpus_bandwidth is None:
            return self
        each = min(self.cpu_to_gpu_bandwidth, self.cpu_to_all_gpus_bandwidth / min(gpus, self.gpu_count))
        scale = each / self.cpu_to_gpu_bandwidth
        return replace(self, cpu_to_gpu_bandwidth=each, gpu_to_cpu_bandwidth=self.gpu_to_cpu_bandwidth * scale,
                       gpu_to_cpu_cache_bandwidth=(self.gpu_to_cpu_cache_bandwidth * scale
                                                   if self.gpu_to_cpu_cache_bandwidth is not None else None))

    def capacity(self, tier: str) -> float:
        """Bytes the planner may fill on ``tier``: the capacity less the headroom."""
        index = TIERS.index(tier)
        total = (self.gpu_memory, self.cpu_memory, self.disk_memory)[index]
        return total * self.usable_fraction[index]

    def matmul_flops_at(self, rows: float) -> float:
        """FLOP/s of a matmul with ``rows`` rows, interpolated log-log between profiled points.

        Below the smallest profiled m the time stays that of m (the weights must be read anyway),
        so FLOP/s fall in proportion; above the largest they stay flat.
        """
        points = self.matmul_flops
        if rows <= points[0][0]:
            return points[0][1] * rows / points[0][0]
        return loglog(points, rows)

    def sparse_mlp_flops_at(self, shape: tuple[int, int, int, int], tokens: float) -> float | None:
        """FLOP/s of the routed experts of ``shape`` (sparse_rate.expert_shape) with ``tokens`` tokens
        routed together, where the profile measured that shape; None where it did not."""
        rate = next((r for r in self.sparse_mlp_flops if r.shape == tuple(shape)), None)
        return None if rate is None else rate.flops_at(tokens, self.matmul_flops_at)

    def with_memory(self, gpu: int | None = None, cpu: int | None = None, disk: int | None = None) -> "HardwareProfile":
        """The same machine with some tier capacities replaced (``--gpu-mem`` and friends)."""
        return replace(
            self,
            gpu_memory=self.gpu_memory if gpu is None else int(gpu),
            cpu_memory=self.cpu_memory if cpu is None else int(cpu),
            disk_memory=self.disk_memory if disk is None else int(disk),
        )

    # ---- JSON

    def to_dict(self) -> dict:
        bandwidth = {
            "cpu_to_gpu": self.cpu_to_gpu_bandwidth,
            "gpu_to_cpu": self.gpu_to_cpu_bandwidth,
            "disk_to_cpu": self.disk_to_cpu_bandwidth,
            "cpu_to_disk": self.cpu_to_disk_bandwidth,
        }
        if self.gpu_to_cpu_cache_bandwidth is not None:
            bandwidth["gpu_to_cpu_cache"] = self.gpu_to_cpu_cache_bandwidth
        if self.cpu_to_disk_cache_bandwidth is not None:
            bandwidth["cpu_to_disk_cache"] = self.cpu_to_disk_cache_bandwidth
        if self.disk_to_cpu_cached_bandwidth is not None:
            bandwidth["disk_to_cpu_cached"] = self.disk_to_cpu_cached_bandwidth
        if self.cpu_to_all_gpus_bandwidth is not None:
            bandwidth["cpu_to_all_gpus"] = self.cpu_to_all_gpus_bandwidth
        compute = {}
        if self.gpu_kv_dequant_throughput is not None:
            compute["gpu_kv_dequant_elements_per_s"] = self.gpu_kv_dequant_throughput
        if self.gpu_kv_quant_throughput is not None:
            compute["gpu_kv_quant_elements_per_s"] = self.gpu_kv_quant_throughput
        if self.cpu_attention_share_under_copy != 1.0:
            compute["cpu_attention_share_under_copy"] = self.cpu_attention_share_under_copy
        for key in ("cpu_attention_seconds_per_call", "host_seconds_per_layer", "host_seconds_per_step",
                    *HOST_EXTRA_FIELDS):
            if getattr(self, key) > 0:
                compute[key] = getattr(self, key)
        if self.sparse_mlp_flops:
            compute[SPARSE_KEY] = [rate.to_dict() for rate in self.sparse_mlp_flops]
        return {
            "format": FORMAT_TAG,
            "version": FORMAT_VERSION,
            "name": self.name,
            "device": self.device,
            "source": self.source,
            "memory_bytes": {"gpu": self.gpu_memory, "cpu": self.cpu_memory, "disk": self.disk_memory},
            "usable_fraction": dict(zip(TIERS, self.usable_fraction)),
            "pinned_host_memory": self.pinned_host_memory,
            **({"gpu_count": self.gpu_count} if self.gpu_count != 1 else {}),
            "bandwidth_bytes_per_s": bandwidth,
            "compute": {
                "matmul_flop_per_s": [[m, f] for m, f in self.matmul_flops],
                "prefill_attention_flop_per_s": self.prefill_attention_flops,
                "decode_attention_flop_per_s": self.decode_attention_flops,
                "gpu_memory_bytes_per_s": self.gpu_memory_bandwidth,
                "cpu_attention_flop_per_s": self.cpu_attention_flops,
                "gpu_dequant_elements_per_s": self.gpu_dequant_throughput,
                "cpu_dequant_elements_per_s": self.cpu_dequant_throughput,
                **compute,
            },
            "notes": dict(self.notes),
            "measurements": dict(self.measurements),
        }

    def save(self, path: str | Path) -> None:
        write_text_atomic(Path(path), json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def from_dict(cls, data, source: str = "hardware profile") -> "HardwareProfile":
        return _parse_profile(data, source)

    @classmethod
    def load(cls, path: str | Path) -> "HardwareProfile":
        return _parse_profile(read_user_json(path, "hardware profile", ConfigError), str(path))


def _positive(value, where: str, source: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{source}: field {where!r} must be a positive number, got {value!r}")
    return float(value)


def _size(value, where: str, source: str) -> int:
    if isinstance(value, str):
        try:
            return parse_size(value)
        except ConfigError as exc:
            raise ConfigError(f"{source}: field {where!r}: {exc}") from None
    return int(_positive(value, where, source))


def _section(data: dict, key: str, source: str, required: tuple, optional: tuple = ()) -> dict:
    if key not in data:
        raise ConfigError(f"{source}: field {key!r} is missing")
    section = data[key]
    if not isinstance(section, dict):
        raise ConfigError(f"{source}: field {key!r} must be a JSON object")
    for name in required:
        if name not in section:
            raise ConfigError(f"{source}: field '{key}.{name}' is missing")
    unknown = sorted(set(section) - set(required) - set(optional))
    if unknown:
        raise ConfigError(f"{source}: unknown field '{key}.{unknown[0]}'")
    return section


def _curve(value, where: str, source: str, unit: str) -> tuple[tuple[float, float], ...]:
    """A non-empty list of [x, FLOP/s] pairs of positive numbers, x (a count of ``unit``s) strictly
    increasing."""
    if not isinstance(value, list) or not value:
        raise ConfigError(f"{source}: field {where!r} must be a non-empty list of [{unit}s, FLOP/s] pairs")
    points = []
    for i, point in enumerate(value):
        if not isinstance(point, list) or len(point) != 2:
            raise ConfigError(f"{source}: field '{where}[{i}]' must be a [{unit}s, FLOP/s] pair, got {point!r}")
        points.append((_positive(point[0], f"{where}[{i}][0]", source), _positive(point[1], f"{where}[{i}][1]", source)))
    xs = [x for x, _ in points]
    if xs != sorted(xs) or len(set(xs)) != len(xs):
        raise ConfigError(f"{source}: field {where!r} must list strictly increasing {unit} counts")
    return tuple(points)


def _sparse_rates(value, source: str) -> tuple[SparseRate, ...]:
    """The routed experts' rates by shape (see sparse_rate), each malformed field named."""
    where = f"compute.{SPARSE_KEY}"
    if not isinstance(value, list):
        raise ConfigError(f"{source}: field {where!r} must be a list of measured expert shapes")
    rates = []
    for i, entry in enumerate(value):
        at = f"{where}[{i}]"
        if not isinstance(entry, dict) or set(entry) != {*SHAPE_KEYS, "points"}:
            raise ConfigError(f"{source}: field {at!r} must be an object with {', '.join(SHAPE_KEYS)} and points")
        for key in SHAPE_KEYS:
            number = entry[key]
            if isinstance(number, bool) or not isinstance(number, int) or number <= 0:
                raise ConfigError(f"{source}: field '{at}.{key}' must be a positive integer, got {number!r}")
        rates.append(SparseRate(tuple(entry[key] for key in SHAPE_KEYS),
                                _curve(entry["points"], f"{at}.points", source, "token")))
    return tuple(rates)


def _top_fields(data, source: str) -> dict:
    """The profile's identity (format, version, name) and its free-form fields, checked."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: a hardware profile must be a JSON object")
    if data.get("format") != FORMAT_TAG:
        raise ConfigError(
            f"{source}: field 'format' must be {FORMAT_TAG!r} (got {data.get('format')!r}); "
            "this is not a flexoff hardware profile (make one with `flexoff profile`)"
        )
    if data.get("version") != FORMAT_VERSION:
        raise ConfigError(f"{source}: field 'version' must be {FORMAT_VERSION}, got {data.get('version')!r}")
    unknown = sorted(set(data) - _TOP_FIELDS)
    if unknown:
        raise ConfigError(f"{source}: unknown field {unknown[0]!r}")
    name = data.get("name")
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{source}: field 'name' must be a non-empty string")
    for text_field in ("device", "source"):
        if not isinstance(data.get(text_field, ""), str):
            raise ConfigError(f"{source}: field {text_field!r} must be a string")
    for free_field in ("notes", "measurements"):
        if not isinstance(data.get(free_field, {}), dict):
            raise ConfigError(f"{source}: field {free_field!r} must be a JSON object")
    return dict(name=name, device=data.get("device", ""), source=data.get("source", ""),
                notes=dict(data.get("notes", {})), measurements=dict(data.get("measurements", {})))


def _memory_fields(data: dict, source: str) -> dict:
    """Each tier's bytes and usable share, the GPUs' count, and whether host memory is pinned."""
    memory = _section(data, "memory_bytes", source, TIERS)
    sizes = [_size(memory[t], f"memory_bytes.{t}", source) for t in TIERS]
    gpu_count = data.get("gpu_count", 1)
    if isinstance(gpu_count, bool) or not isinstance(gpu_count, int) or gpu_count < 1:
        raise ConfigError(f"{source}: field 'gpu_count' must be a positive integer, got {gpu_count!r}")
    pinned = data.get("pinned_host_memory", True)
    if not isinstance(pinned, bool):
        raise ConfigError(f"{source}: field 'pinned_host_memory' must be true or false, got {pinned!r}")
    usable = _section(data, "usable_fraction", source, TIERS)
    fractions = tuple(_positive(usable[t], f"usable_fraction.{t}", source) for t in TIERS)
    for tier, fraction in zip(TIERS, fractions):
        if fraction > 1:
            raise ConfigError(f"{source}: field 'usable_fraction.{tier}' must be at most 1, got {fraction}")
    return dict(gpu_memory=sizes[0], cpu_memory=sizes[1], disk_memory=sizes[2], gpu_count=gpu_count,
                pinned_host_memory=pinned, usable_fraction=fractions)


def _bandwidth_fields(data: dict, source: str) -> dict:
    """The links' bytes per second; the optional ones None where absent."""
    bandwidth = _section(data, "bandwidth_bytes_per_s", source, _BANDWIDTH_FIELDS, _OPTIONAL_BANDWIDTH_FIELDS)
    bw = {k: _positive(bandwidth[k], f"bandwidth_bytes_per_s.{k}", source) for k in _BANDWIDTH_FIELDS}
    bw_cache = {
        k: (_positive(bandwidth[k], f"bandwidth_bytes_per_s.{k}", source) if bandwidth.get(k) is not None else None)
        for k in _OPTIONAL_BANDWIDTH_FIELDS
    }
    return dict(
        cpu_to_gpu_bandwidth=bw["cpu_to_gpu"], gpu_to_cpu_bandwidth=bw["gpu_to_cpu"],
        disk_to_cpu_bandwidth=bw["disk_to_cpu"], cpu_to_disk_bandwidth=bw["cpu_to_disk"],
        gpu_to_cpu_cache_bandwidth=bw_cache["gpu_to_cpu_cache"],
        cpu_to_disk_cache_bandwidth=bw_cache["cpu_to_disk_cache"],
        disk_to_cpu_cached_bandwidth=bw_cache["disk_to_cpu_cached"],
        cpu_to_all_gpus_bandwidth=bw_cache["cpu_to_all_gpus"],
    )


def _compute_fields(data: dict, source: str) -> dict:
    """The compute rates and the host's times; the optional ones at their "not measured" values
    where absent."""
    compute = _section(data, "compute", source, ("matmul_flop_per_s",) + _COMPUTE_FIELDS,
                       _OPTIONAL_COMPUTE_FIELDS + (SPARSE_KEY,))
    rates = {k: _positive(compute[k], f"compute.{k}", source) for k in _COMPUTE_FIELDS}
    optional = {k: _positive(compute[k], f"compute.{k}", source) if compute.get(k) is not None else None
                for k in _OPTIONAL_COMPUTE_FIELDS}
    share = optional["cpu_attention_share_under_copy"]
    if share is not None and share > 1:
        raise ConfigError(f"{source}: field 'compute.cpu_attention_share_under_copy' must be at most 1, got {share}")
    points = _curve(compute["matmul_flop_per_s"], "compute.matmul_flop_per_s", source, "row")
    return dict(
        gpu_kv_dequant_throughput=optional["gpu_kv_dequant_elements_per_s"],
        gpu_kv_quant_throughput=optional["gpu_kv_quant_elements_per_s"],
        cpu_attention_share_under_copy=1.0 if share is None else share,
        cpu_attention_seconds_per_call=optional["cpu_attention_seconds_per_call"] or 0.0,
        host_seconds_per_layer=optional["host_seconds_per_layer"] or 0.0,
        host_seconds_per_step=optional["host_seconds_per_step"] or 0.0,
        **{key: optional[key] or 0.0 for key in HOST_EXTRA_FIELDS},
        matmul_flops=points,
        sparse_mlp_flops=_sparse_rates(compute.get(SPARSE_KEY, []), source),
        prefill_attention_flops=rates["prefill_attention_flop_per_s"],
        decode_attention_flops=rates["decode_attention_flop_per_s"],
        gpu_memory_bandwidth=rates["gpu_memory_bytes_per_s"],
        cpu_attention_flops=rates["cpu_attention_flop_per_s"],
        gpu_dequant_throughput=rates["gpu_dequant_elements_per_s"],
        cpu_dequant_throughput=rates["cpu_dequant_elements_per_s"],
    )


def _parse_profile(data, source: str) -> HardwareProfile:
    """A profile from its JSON, checked part by part in one fixed order, so that a file with
    several wrong fields always has the same one named."""
    fields = _top_fields(data, source)
    for part in (_memory_fields, _bandwidth_fields, _compute_fields):
        fields.update(part(data, source))
    return HardwareProfile(**fields)


def default_profile_path() -> Path:
    """Where ``flexoff profile`` saves this machine's profile and ``flexoff search`` looks for it."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "flexoff" / "hardware.json"


def packaged_profile(name: str) -> HardwareProfile:
    """A reference profile shipped with flexoff: ``t4`` (the FlexGen paper's machine), or ``h100`` and
    ``h200`` (the lent machines, each measured there by ``flexoff profile``)."""
    key = PACKAGED_PROFILES.get(name.lower())
    if key is None:
        raise ConfigError(f"unknown hardware profile {name!r}; packaged: {', '.join(sorted(PACKAGED_PROFILES))}")
    resource = resources.files(__package__).joinpath("profiles", f"{key}.json")
    return _parse_profile(json.loads(resource.read_text()), f"packaged profile {key}")


def resolve_hardware(spec: str | None = None) -> HardwareProfile:
    """A packaged profile name, a path to a profile JSON, or None for this machine's saved profile."""
    if spec is None:
        path = default_profile_path()
        if nothing_at(path):
            raise ConfigError(
                f"no hardware profile for this machine at {path}: run `flexoff profile` first, "
                "or pass --hardware t4|h100|FILE"
            )
        return HardwareProfile.load(path)
    if spec.lower() in PACKAGED_PROFILES:
        return packaged_profile(spec)
    if nothing_at(spec):
        raise ConfigError(
            f"hardware profile {spec!r} is neither a file nor a packaged profile "
            f"({', '.join(sorted(PACKAGED_PROFILES))})"
        )
    return HardwareProfile.load(spec)
