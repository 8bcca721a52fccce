"""A registry model as a GGUF file of random 4-bit weights, for llama.cpp's benchmarks (bench/llamacpp.py).

The file has llama.cpp's layout for the model's architecture (``llama`` for Llama 3 and Mixtral, ``qwen3`` and
``qwen3moe`` for Qwen3): every matrix in Q4_0 (4 bits in groups of 32 with an fp16 scale, the class of flexoff's
4-bit groups), norms at 1 and the router in F32, as llama.cpp's quantizer leaves them. No tokenizer is stored
(``tokenizer.ggml.model`` "none" with the vocabulary's size), which llama-batched-bench does not need: it draws
its token ids at random. The scales are small (values of about 0.01) so that activations stay finite through
every layer. A 70B model is about 40 GB, written in a few repeated random chunks rather than held in memory.

    python bench/dummy_gguf.py --model llama-3-70b --out /tmp/llama-3-70b.q4_0.gguf
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flexoff.models import REGISTRY, ModelConfig  # noqa: E402

BLOCK = 32  # values per Q4_0 block
BLOCK_BYTES = 18  # an fp16 scale and 16 bytes of two 4-bit codes each
SCALE = 0.003  # of a code step: codes span -8..7, so values within +-0.024, about 0.01 on average
CHUNK = 1 << 22  # bytes of random codes, repeated through a matrix
FILE_TYPE_Q4_0 = 2  # llama.cpp's LLAMA_FTYPE_MOSTLY_Q4_0


class NotConvertible(ValueError):
    """A model llama.cpp has no architecture for, or a shape Q4_0 cannot hold."""


@dataclass(frozen=True)
class Tensor:
    name: str
    shape: tuple[int, ...]  # numpy order: the last dimension is the one ggml's blocks run along
    kind: str  # "matrix" (Q4_0), "norm" (F32 ones) or "router" (F32 random)


def architecture(cfg: ModelConfig) -> str:
    """llama.cpp's architecture name for ``cfg``."""
    if cfg.family != "llama":
        raise NotConvertible(f"llama.cpp has no architecture for the {cfg.family} family ({cfg.name})")
    if cfg.attention_bias or cfg.shared_expert_intermediate_size or cfg.dense_layers:
        raise NotConvertible(f"{cfg.name}: attention biases, shared experts and dense layers of a MoE model "
                             "are not written (llama.cpp's qwen2 and qwen2moe layouts)")
    if cfg.qk_norm:
        return "qwen3moe" if cfg.num_experts else "qwen3"
    return "llama"


def tensors(cfg: ModelConfig) -> list[Tensor]:
    """The tensors llama.cpp loads for ``cfg``, named and shaped as its converter writes them."""
    arch, hidden, head = architecture(cfg), cfg.hidden_size, cfg.head_dim
    out = [Tensor("token_embd.weight", (cfg.vocab_size, hidden), "matrix")]
    for i in range(cfg.num_layers):
        blk = f"blk.{i}."
        out += [Tensor(blk + "attn_norm.weight", (hidden,), "norm"),
                Tensor(blk + "attn_q.weight", (cfg.num_heads * head, hidden), "matrix"),
                Tensor(blk + "attn_k.weight", (cfg.num_kv_heads * head, hidden), "matrix"),
                Tensor(blk + "attn_v.weight", (cfg.num_kv_heads * head, hidden), "matrix"),
                Tensor(blk + "attn_output.weight", (hidden, cfg.num_heads * head), "matrix"),
                Tensor(blk + "ffn_norm.weight", (hidden,), "norm")]
        if arch.startswith("qwen3"):
            out += [Tensor(blk + "attn_q_norm.weight", (head,), "norm"),
                    Tensor(blk + "attn_k_norm.weight", (head,), "norm")]
        if cfg.num_experts:
            experts, inner = cfg.num_experts, cfg.expert_intermediate_size
            out += [Tensor(blk + "ffn_gate_inp.weight", (experts, hidden), "router"),
                    Tensor(blk + "ffn_gate_exps.weight", (experts, inner, hidden), "matrix"),
                    Tensor(blk + "ffn_up_exps.weight", (experts, inner, hidden), "matrix"),
                    Tensor(blk + "ffn_down_exps.weight", (experts, hidden, inner), "matrix")]
        else:
            inner = cfg.intermediate_size
            out += [Tensor(blk + "ffn_gate.weight", (inner, hidden), "matrix"),
                    Tensor(blk + "ffn_up.weight", (inner, hidden), "matrix"),
                    Tensor(blk + "ffn_down.weight", (hidden, inner), "matrix")]
    out.append(Tensor("output_norm.weight", (hidden,), "norm"))
    if not cfg.tie_word_embeddings:
        out.append(Tensor("output.weight", (cfg.vocab_size, hidden), "matrix"))
    for t in out:
        if t.kind == "matrix" and t.shape[-1] % BLOCK:
            raise NotConvertible(f"{cfg.name}: {t.name}'s rows of {t.shape[-1]} values are not whole Q4_0 "
                                 f"blocks of {BLOCK}")
    return out


def stored_bytes(t: Tensor) -> int:
    count = int(np.prod(t.shape))
    return count // BLOCK * BLOCK_BYTES if t.kind == "matrix" else 4 * count


def q4_0_chunk(rng: np.random.Generator) -> np.ndarray:
    """CHUNK bytes (a whole number of blocks) of random codes, each block scaled by SCALE."""
    blocks = rng.integers(0, 256, size=(CHUNK // BLOCK_BYTES, BLOCK_BYTES), dtype=np.uint8)
    scales = (SCALE * rng.uniform(0.5, 1.5, size=len(blocks))).astype(np.float16)
    blocks[:, :2] = scales.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(-1)


def data(t: Tensor, chunk: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    if t.kind == "norm":
        return np.ones(t.shape, np.float32)
    if t.kind == "router":
        return rng.normal(0.0, 0.02, size=t.shape).astype(np.float32)
    # Start at a random block so that matrices do not all begin with the same codes.
    start = int(rng.integers(0, len(chunk) // BLOCK_BYTES)) * BLOCK_BYTES
    return np.resize(np.roll(chunk, -start), stored_bytes(t))


def write_dummy_gguf(cfg: ModelConfig, path: str | Path, seed: int = 0, context: int | None = None) -> Path:
    """Write ``cfg`` as a dummy Q4_0 GGUF at ``path`` (through a temporary file, renamed when whole)."""
    import gguf

    arch, layout = architecture(cfg), tensors(cfg)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    writer = gguf.GGUFWriter(partial, arch)
    writer.add_name(f"{cfg.name} (dummy weights)")
    writer.add_file_type(FILE_TYPE_Q4_0)
    writer.add_context_length(context or cfg.max_positions)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_heads)
    writer.add_head_count_kv(cfg.num_kv_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_layer_norm_rms_eps(cfg.norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    if cfg.num_experts:
        writer.add_expert_count(cfg.num_experts)
        writer.add_expert_used_count(cfg.experts_per_token)
        if arch == "qwen3moe":
            writer.add_expert_feed_forward_length(cfg.expert_intermediate_size)
    writer.add_tokenizer_model("none")
    for t in layout:
        if t.kind == "matrix":
            byte_shape = (*t.shape[:-1], t.shape[-1] // BLOCK * BLOCK_BYTES)
            writer.add_tensor_info(t.name, byte_shape, np.dtype(np.uint8), stored_bytes(t),
                                   raw_dtype=gguf.GGMLQuantizationType.Q4_0)
        else:
            writer.add_tensor_info(t.name, t.shape, np.dtype(np.float32), stored_bytes(t))
    rng = np.random.default_rng(seed)
    chunk = q4_0_chunk(rng)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for t in layout:
            writer.write_tensor_data(data(t, chunk, rng))
        writer.close()
        partial.replace(path)
    except BaseException:
        writer.close()
        partial.unlink(missing_ok=True)
        raise
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a registry name, e.g. llama-3-70b")
    parser.add_argument("--out", required=True, help="the .gguf file to write")
    parser.add_argument("--context", type=int, help="the context length the file declares (default: the model's)")
    args = parser.parse_args()
    if args.model not in REGISTRY:
        parser.exit(2, f"dummy_gguf.py: error: unknown model {args.model!r}\n")
    try:
        path = write_dummy_gguf(REGISTRY[args.model], args.out, context=args.context)
    except NotConvertible as err:
        parser.exit(2, f"dummy_gguf.py: error: {err}\n")
    print(f"wrote {path} ({path.stat().st_size / 2**30:.2f} GiB)")


if __name__ == "__main__":
    main()
