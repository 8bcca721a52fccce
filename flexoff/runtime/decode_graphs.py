"""CUDA graphs of a decode step's layer halves, replayed for each GPU batch.

A decode step runs each layer once per GPU batch, a few tokens each: the host's time to enqueue a
layer's dozens of small kernels is longer than the GPU's to run them. So the two halves of a
layer around attention (``attention_inputs`` and ``after_attention``) are captured once per shape
and weight placement and replayed; attention itself, whose cache grows every step, runs as before.
A sparse layer's second half is captured where the fused expert kernels run it (``moe.fused_kernels``:
routing, sorting and the experts all stay on the device) and its experts are all in place; with
route-first loading the host copies in the experts its tokens chose, so that half runs eagerly.

A graph reads its inputs from fixed addresses. The activations and the small weights (norms,
biases: each layer's own, where the layer's weights stay on the GPU) are copied into buffers of
its signature before each replay, in one fused copy. Matrices are read in place: the graph's key
holds their addresses, which repeat, since streamed layers share a ring of buffers. Compressed
matrices dequantized into one scratch per read are dequantized inside the graph; those
dequantized once for every batch of a stage are dequantized before it, as before. Graphs share
one memory pool and write their outputs into their signature's buffers, whose values are cloned
out after each replay: nothing a graph allocates outlives its capture, so the pool is one half's
temporaries, whatever the number of graphs.

Where graphs cannot run (the CPU, a capture that fails), layers run as they always did; why is
told once, by ``describe``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import torch

from ..models import ModelConfig
from ..models.moe import ROUTER, fused_kernels

# More keys than this means the weights' addresses do not repeat; later keys run eagerly.
MAX_GRAPHS = 512
# GPU memory a capture must find free beyond its inputs' and outputs' bytes (times CAPTURE_FACTOR):
# its pool reserves fresh segments, where the eager run reuses the allocator's cached ones, and an
# allocation that fails inside a capture can leave the device unusable. Short of that, the half
# runs eagerly.
CAPTURE_ROOM = 64 << 20
CAPTURE_FACTOR = 8


def _flat(value) -> list[torch.Tensor]:
    """A step context or a half's result as its tensors (None has none)."""
    if value is None:
        return []
    return [value] if isinstance(value, torch.Tensor) else list(value)


def _rebuild(like, tensors: list[torch.Tensor]):
    """``tensors`` in the structure of ``like`` (None, a tensor or a tuple of tensors)."""
    if like is None:
        return None
    return tensors[0] if isinstance(like, torch.Tensor) else tuple(tensors)


def _address(t: torch.Tensor) -> tuple:
    return (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)


class _Recording(Mapping):
    """A stage's weights, noting the names a half reads, in order."""

    def __init__(self, weights: Mapping):
        self.weights = weights
        self.read: list[str] = []

    def __getitem__(self, name: str):
        value = self.weights[name]
        if name not in self.read:
            self.read.append(name)
        return value

    def __contains__(self, name) -> bool:
        return name in self.weights

    def __iter__(self) -> Iterator[str]:
        return iter(self.weights)

    def __len__(self) -> int:
        return len(self.weights)


class _Bound(Mapping):
    """A half's weights as its graph reads them: copied ones from the signature's buffers, the
    matrices in place, and per-read dequantizations from the stage's mapping (inside the graph)."""

    def __init__(self, weights: Mapping, tensors: dict[str, torch.Tensor]):
        self.weights = weights
        self.tensors = tensors

    def __getitem__(self, name: str):
        found = self.tensors.get(name)
        return self.weights[name] if found is None else found

    def __contains__(self, name) -> bool:
        return name in self.weights

    def __iter__(self) -> Iterator[str]:
        return iter(self.weights)

    def __len__(self) -> int:
        return len(self.weights)


@dataclass
class _Signature:
    """What the graphs of one half, shapes and weight names share: the buffers their inputs are
    copied into before a replay, and those their outputs are written to."""

    inputs: list[torch.Tensor]
    outputs: list[torch.Tensor] = field(default_factory=list)


class DecodeGraphs:
    """The decode layers' graphs of one engine, on ``device``; ``enabled=False`` turns them off.
    ``limit``: the bytes the process may reserve on the device (its cap), if any."""

    def __init__(self, device: torch.device, enabled: bool = True, limit: int | None = None):
        self.device = device
        self.limit = limit
        self.reason: str | None = None  # why graphs do not run, if they do not
        if not enabled:
            self.reason = "turned off"
        elif device.type != "cuda":
            self.reason = f"the device is {device.type}"
        self._names: dict[tuple, tuple[str, ...]] = {}
        self._signatures: dict[tuple, _Signature] = {}
        self._graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self._pool = None
        self._stream = None
        self.captured = 0
        self.replays = 0
        self.short_of_memory = 0  # captures not tried for want of memory

    @property
    def enabled(self) -> bool:
        return self.reason is None

    def describe(self) -> str:
        """One phrase for the run's summary."""
        if not self.enabled:
            return f"off ({self.reason})"
        short = f", {self.short_of_memory} not captured for want of GPU memory" if self.short_of_memory else ""
        return f"on ({self.captured} captured, {self.replays} replays{short})"

    def layer(self, arch, cfg: ModelConfig, weights: Mapping, hidden: torch.Tensor, context,
              attend: Callable) -> torch.Tensor:
        """One decode layer of one GPU batch (``arch.layer``'s arguments), its halves from graphs."""
        if not self.enabled:
            return arch.layer(cfg, weights, hidden, context, attend, weights)
        parts = _flat(context)

        def inputs(w, h, *ctx):
            return arch.attention_inputs(cfg, w, h, _rebuild(context, list(ctx)))

        q, k, v = self._half("inputs", inputs, weights, [hidden, *parts])
        attn = attend(q, k, v)
        if ROUTER in weights and (getattr(weights, "routes_first", False) or fused_kernels(hidden) is None):
            return arch.after_attention(cfg, weights, hidden, attn, weights)

        def after(w, h, a):
            return arch.after_attention(cfg, w, h, a, None)

        out, = self._half("after", after, weights, [hidden, attn])
        return out

    def _half(self, kind: str, body: Callable, weights, live: list[torch.Tensor]) -> list[torch.Tensor]:
        """``body(weights, *live)``'s tensors, from its graph for this key where there is one."""
        stage = (kind, tuple(weights))
        names = self._names.get(stage)
        if names is None:  # the first layer of its kind: run eagerly, noting what it reads
            recording = _Recording(weights)
            out = _flat(body(recording, *live))
            self._names[stage] = tuple(recording.read)
            return out
        copied, in_place, dequantized = self._split(weights, names)
        sources = live + [t for _, t in copied]
        signature_key = (stage, names, tuple((tuple(t.shape), t.dtype) for t in sources))
        key = (signature_key, tuple(_address(t) for _, t in in_place),
               tuple((name, *map(_address, weights.read_tensors(name))) for name in dequantized))
        signature = self._signatures.get(signature_key)
        graph = self._graphs.get(key)
        if graph is not None:
            torch._foreach_copy_(signature.inputs, sources)
            graph.replay()
            self.replays += 1
            return [t.clone() for t in signature.outputs]
        if len(self._graphs) >= MAX_GRAPHS:
            return _flat(body(weights, *live))
        out = self._warm_up(body, weights, live)
        if not self._room(sum(t.numel() * t.element_size() for t in sources + out)):
            self.short_of_memory += 1
            return out
        if signature is None:
            signature = _Signature([torch.empty_like(t) for t in sources], [torch.empty_like(t) for t in out])
            self._signatures[signature_key] = signature
        statics = dict(in_place)
        statics.update(zip((name for name, _ in copied), signature.inputs[len(live):]))
        try:
            self._graphs[key] = self._capture(body, _Bound(weights, statics), signature, len(live))
            self.captured += 1
        except Exception as error:  # a kernel or allocation that cannot be captured: run eagerly from now
            self.reason = f"capture failed: {(str(error).splitlines() or [type(error).__name__])[0]}"
        return out

    @staticmethod
    def _split(weights, names: tuple[str, ...]):
        """The half's weights by how a graph reads them: copied into its buffers (vectors), read in
        place (matrices), dequantized inside it (compressed matrices dequantized per read)."""
        copied, in_place, dequantized = [], [], []
        for name in names:
            if weights.dequantizes_on_read(name):
                dequantized.append(name)
                continue
            tensor = weights[name]
            (copied if tensor.dim() <= 1 else in_place).append((name, tensor))
        return copied, in_place, dequantized

    def _side_stream(self):
        if self._stream is None:
            self._pool = torch.cuda.graph_pool_handle()
            self._stream = torch.cuda.Stream(self.device)
        return self._stream

    def _warm_up(self, body: Callable, weights, live: list[torch.Tensor]) -> list[torch.Tensor]:
        """The half run eagerly on the capture's stream, after the current one's work: kernels are
        compiled and tuned before the capture, and cuBLAS takes that stream's workspace from the
        allocator, not from the graphs' pool (where it would stay once the graphs are gone)."""
        current = torch.cuda.current_stream(self.device)
        side = self._side_stream()
        side.wait_stream(current)
        with torch.cuda.stream(side):
            out = _flat(body(weights, *live))
        current.wait_stream(side)
        for t in out:
            t.record_stream(current)  # read on the current stream, once the side stream is done
        return out

    def _room(self, io_bytes: int) -> bool:
        """Whether the device has room for a capture whose inputs and outputs take ``io_bytes``."""
        free = torch.cuda.mem_get_info(self.device)[0]
        if self.limit is not None:
            free = min(free, self.limit - torch.cuda.memory_reserved(self.device))
        return free >= CAPTURE_ROOM + CAPTURE_FACTOR * io_bytes

    def _capture(self, body: Callable, weights: _Bound, signature: _Signature, activations: int):
        """A graph of ``body`` over the signature's input buffers, writing its output buffers. The
        capture runs on a side stream (the current one may be the legacy default, which cannot
        capture), after all work enqueued on the current one."""
        current = torch.cuda.current_stream(self.device)
        side = self._side_stream()
        side.wait_stream(current)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(side):
            # thread_local: the host worker's and disk threads' CUDA calls go on meanwhile.
            graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
            try:
                result = _flat(body(weights, *signature.inputs[:activations]))
                torch._foreach_copy_(signature.outputs, result)
                del result  # freed inside the capture: the pool keeps none of it
            except BaseException:
                try:
                    graph.capture_end()
                except RuntimeError:
                    pass  # the capture was invalidated; the first error is the one to tell
                raise
            graph.capture_end()
        current.wait_stream(side)
        return graph

    def close(self) -> None:
        """Free the graphs and their pool, and the capture stream's cuBLAS workspace (cached by
        torch per stream, for the process's lifetime otherwise)."""
        if self._stream is None:
            return
        torch.cuda.current_stream(self.device).wait_stream(self._stream)
        self._graphs.clear()
        self._signatures.clear()
        self._pool = self._stream = None
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear is not None:
            clear()
