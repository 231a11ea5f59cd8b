"""GGUF files (llama.cpp's format) read into model.py's layout, through the `gguf` package.

A GGUF file carries metadata (architecture, sizes, RoPE base, tokenizer, chat template) and
tensors, many of them block-quantized (Q4_1: blocks of 32 weights sharing a scale and a minimum).
We dequantize every tensor to float32 with `gguf.quants.dequantize`, then weights.py casts it to
the dtype asked for; quantize.py may quantize it again in its own layout.

Two facts a reader needs:
- llama.cpp stores the Q and K projections of `llama` models with each head's rows interleaved
  for its RoPE kernel ("Meta" layout: pairs are adjacent elements). model.py rotates pairs
  (i, i + D/2) as Hugging Face does, so those rows are permuted back here. Qwen2/Qwen3 files use
  the other RoPE kind and are stored unpermuted.
- GGUF lists shapes innermost first; the `gguf` package hands arrays in PyTorch order.
"""
import functools
from pathlib import Path

import numpy as np
import torch

from model import ModelConfig
from runtime import CheckpointError

SUPPORTED_ARCH = ("llama", "qwen2", "qwen3")
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")

# GGUF tensor name (after "blk.N.") -> model.py name (after "layers.N.")
LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
GLOBAL_NAMES = {"token_embd": "embed_tokens", "output_norm": "norm", "output": "lm_head"}


def read(path: Path):
    """A gguf.GGUFReader, or a CheckpointError saying the file is not readable GGUF.

    Parsing the metadata takes seconds (50k vocabulary strings), and both the weights and the
    tokenizer need it, so the last readers are kept, keyed by the file's identity."""
    stat = Path(path).stat()
    return _read(str(path), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=2)
def _read(path: str, mtime_ns: int, size: int):
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # the reader fails in many ways on a bad file; all mean the same to a user
        raise CheckpointError(f"{path}: not a readable GGUF file, truncated or corrupt ({type(e).__name__}: {e})") from None


def field(reader, key, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def config_from_gguf(reader, path) -> ModelConfig:
    arch = field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCH:
        raise CheckpointError(f"{path}: architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCH)})")

    def get(key, default=None):
        value = field(reader, f"{arch}.{key}", default)
        if value is None:
            raise CheckpointError(f"{path}: metadata {arch}.{key} is missing")
        return value

    names = {t.name for t in reader.tensors}
    heads = get("attention.head_count")
    scaling = {}
    if field(reader, f"{arch}.rope.scaling.type") == "linear":
        scaling = {"rope_type": "linear", "factor": get("rope.scaling.factor")}
    if "rope_freqs.weight" in names:  # Llama 3.1+: per-pair frequency divisors stored as a tensor
        t = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
        scaling = {"rope_type": "freq_factors", "factors": np.asarray(t.data, dtype=np.float32).tolist()}
    vocab = field(reader, f"{arch}.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    return ModelConfig(
        vocab_size=vocab, dim=get("embedding_length"), n_layers=get("block_count"), n_heads=heads,
        n_kv_heads=get("attention.head_count_kv", heads), intermediate_size=get("feed_forward_length"),
        head_dim=get("attention.key_length", 0), norm_eps=get("attention.layer_norm_rms_epsilon"),
        rope_theta=get("rope.freq_base", 10000.0), rope_scaling=scaling,
        max_position_embeddings=get("context_length"), tie_word_embeddings="output.weight" not in names,
        qkv_bias="blk.0.attn_q.bias" in names, o_bias="blk.0.attn_output.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
    )


def model_name(gguf_name: str) -> str:
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        return f"layers.{parts[1]}.{LAYER_NAMES.get(parts[2], parts[2])}.{parts[3]}"
    return f"{GLOBAL_NAMES.get(parts[0], parts[0])}.{parts[1]}"


def unpermute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head interleave of Q/K rows: [(h, D/2, 2), in] -> [(h, 2, D/2), in]."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def dequantize_fast(blocks: torch.Tensor, kind: str) -> torch.Tensor:
    """The legacy block types decoded with torch ops: [rows, n_blocks * block_bytes] uint8 ->
    [rows, n_blocks * 32] float32. Each block holds 32 weights:
      Q8_0: scale d (f16), 32 int8 q        -> d * q
      Q4_0: scale d (f16), 16 bytes of nibbles -> d * (q - 8)
      Q4_1: scale d (f16), min m (f16), 16 bytes of nibbles -> d * q + m
    Nibbles: byte j holds weight j in its low 4 bits and weight j + 16 in its high 4 bits.
    (gguf.quants does the same in numpy, several times slower; tests check one against the other.)"""
    rows = blocks.shape[0]
    size = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}[kind]
    b = blocks.reshape(rows, -1, size)  # [rows, n_blocks, block_bytes]
    d = b[..., 0:2].contiguous().view(torch.float16).float()  # [rows, n_blocks, 1]
    if kind == "Q8_0":
        q = b[..., 2:].contiguous().view(torch.int8).float()
        return (d * q).reshape(rows, -1)
    packed = b[..., size - 16:]  # [rows, n_blocks, 16]
    q = torch.cat((packed & 0x0F, packed >> 4), dim=-1).float()  # [rows, n_blocks, 32]
    if kind == "Q4_0":
        return (d * (q - 8)).reshape(rows, -1)
    m = b[..., 2:4].contiguous().view(torch.float16).float()
    return (d * q + m).reshape(rows, -1)


def dequantize(t, path) -> torch.Tensor:
    from gguf import quants

    kind = t.tensor_type.name
    if kind not in SUPPORTED_TYPES:
        raise CheckpointError(f"{path}: tensor {t.name!r} has type {kind}, which is not supported (supported: {', '.join(SUPPORTED_TYPES)})")
    if kind in ("Q8_0", "Q4_0", "Q4_1") and t.data.ndim == 2:
        size = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}[kind]
        if t.data.shape[1] % size == 0:
            return dequantize_fast(torch.from_numpy(np.array(t.data, dtype=np.uint8)), kind)
    try:
        array = quants.dequantize(t.data, t.tensor_type)
    except Exception as e:
        raise CheckpointError(f"{path}: tensor {t.name!r} ({kind}) cannot be decoded, truncated or corrupt ({e})") from None
    array = np.ascontiguousarray(array, dtype=np.float32)
    return torch.from_numpy(array if array.flags.writeable else array.copy())


def open_gguf(path: Path):
    """(ModelConfig, iterator of (file, name, float32 tensor), total bytes) for a GGUF file."""
    reader = read(path)
    config = config_from_gguf(reader, path)
    arch = field(reader, "general.architecture")

    def tensors():
        for t in reader.tensors:
            if t.name == "rope_freqs.weight":
                continue  # folded into config.rope_scaling
            name, w = model_name(t.name), dequantize(t, path)
            if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
                w = unpermute(w, config.n_heads if "q_proj" in name else config.n_kv_heads)
            yield path, name, w

    return config, tensors(), path.stat().st_size


def write_tokenizer_only(src: Path, dst: Path):
    """Copy a GGUF file's tokenizer.* and general.architecture fields into a GGUF with no tensors."""
    import gguf

    reader = read(src)
    writer = gguf.GGUFWriter(str(dst), arch=str(field(reader, "general.architecture")))
    for key, f in reader.fields.items():
        if key.startswith("tokenizer."):
            sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(key, f.contents(), f.types[0], sub_type=sub)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
