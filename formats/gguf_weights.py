"""GGUF files (llama.cpp's format) into model.py's layout: tensors and blocks to layers
(formats/gguf_config.py reads the metadata into a config).

A GGUF file carries metadata (architecture, sizes, RoPE base, tokenizer, chat template) and
tensors, many of them block-quantized (Q4_1: blocks of 32 weights sharing a scale and a minimum).
By default the quantized matrices run at the file's own bits, decoded here in torch (decode_blocks)
into integers and per-group scales without passing through float:

    file type               runs as                          exact?
    Q4_0, Q4_1, Q4_K        quantize.Int4Linear, groups of 32 yes: zero = min + 8 * scale is
                            (the int4 kernels; N % 16 == 0)   checked to be exact in float32,
                                                              else int8 groups
    Q8_0, Q5_0, Q5_1, Q5_K  quant_groups.Int8GroupLinear,     yes (q * scale + offset in gguf's
                            groups of 32 (bf16 on CPU: the    order); the int4 kernel takes bf16
                            int4 kernel on two halves of q)   scales and zeros (Int8GroupLinear)
    Q6_K                    Int8GroupLinear, groups of 16     yes
    Q2_K, Q3_K              float (--dtype), decoded by gguf.quants; the load line names them
                            and their bytes in memory against the file's (dequantized_note)
    IQ* and others          refused, naming the tensor and its type
    token_embd (Q4_*, Q5_*, Q6_K,  quant_groups.Int8GroupEmbedding (rows looked up, then scaled;
      Q8_0)                        tied to a head run as two int4 halves: rows read from those)
    output (int8-group types,      two int4 halves in bf16 on CPU, else float in --dtype
      or tied to token_embd)       (quant_groups.HEAD_NOTE); an untied Q4_* output keeps int4
    ffn_{gate,up,down}_exps        moe.GroupExperts, per projection: Q4_* as 4 bits where exact,
      (experts stacked [E, N, K])  MXFP4 (gpt-oss) as its 4-bit floats, the other block types as
                                   8-bit groups, the rest float

formats/gguf_file.py reads the container itself, over a memory map; of the `gguf` package this file
uses gguf.quants (float32 from F32, F16, BF16, Q2_K and Q3_K tensors) and GGUFWriter
(write_tokenizer_only). The load line prints the plan per tensor kind ("Q4_1 -> int4 g32: q_proj,
..."). With dequantize (generate.py --dequantize) every tensor becomes float32 (decode_blocks'
integers times their scales, the same values) and formats/weights.py casts it to the dtype asked
for; quantize.py may then quantize it again in its own layout.

Two facts a reader needs:
- llama.cpp stores the Q and K projections of `llama` models with each head's rows interleaved
  for its RoPE kernel ("Meta" layout: pairs are adjacent elements). model.py rotates pairs
  (i, i + D/2) as Hugging Face does, so those rows are permuted back here. Qwen2/Qwen3, Gemma and
  Phi-3 files use the other RoPE kind and are stored unpermuted; deepseek2 files keep HF's rows,
  interleaved pairs in their rotary dims alone (formats/deepseek.py reorders those). Gemma's norms
  are stored as 1 + w (model.py adds the 1 itself, so it is taken off here) and Phi-3's attn_qkv
  and ffn_up hold fused projections (split here).
- GGUF lists shapes innermost first; formats/gguf_file.py hands arrays in PyTorch order
  (block-quantized ones as bytes [rows, row_bytes]).
"""

from pathlib import Path

import numpy as np
import torch

from formats import deepseek
from formats.gguf_config import GEMMA, config_from_gguf, field, read
from runtime import CheckpointError

SUPPORTED_TYPES = (
    "F32",
    "F16",
    "BF16",
    "Q8_0",
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q2_K",
    "Q3_K",
    "Q4_K",
    "Q5_K",
    "Q6_K",
    "MXFP4",
)

# GGUF tensor name (after "blk.N.") -> model.py name (after "layers.N.")
LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_qkv": "self_attn.qkv_proj",  # (Phi-3's, split on loading)
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # experts (moe.py): the router, each projection stacked [E, out, in], Qwen2-MoE's gated shared
    # expert
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "attn_sinks": "self_attn.sinks",
    "post_attention_norm": "post_attention_layernorm",  # gpt-oss (its pre-MLP norm)
    **deepseek.GGUF_LAYER_NAMES,  # latent attention's own (deepseek2)
}
GLOBAL_NAMES = {"token_embd": "embed_tokens", "output_norm": "norm", "output": "lm_head"}
GEMMA_NAMES = {
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}  # Gemma's four norms per layer


def model_name(gguf_name: str, arch: str = "llama") -> str:
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        names = {**LAYER_NAMES, **GEMMA_NAMES} if arch in GEMMA else LAYER_NAMES
        name = f"layers.{parts[1]}.{names.get(parts[2], parts[2])}.{'.'.join(parts[3:])}"
        if (
            parts[2].endswith("_exps") or parts[2] == "attn_sinks"
        ):  # moe.py's stacked parameters, gpt-oss's sinks
            return name.removesuffix(".weight").replace(".bias", "_bias")
        return name
    return f"{GLOBAL_NAMES.get(parts[0], parts[0])}.{parts[1]}"


def unpermute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head interleave of Q/K rows: [(h, D/2, 2), in] -> [(h, 2, D/2), in]."""
    rows = w.shape[0]
    return (
        w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
    )


# bytes per block and weights per block of each type decode_blocks reads
BLOCKS = {
    "Q8_0": (34, 32),
    "Q4_0": (18, 32),
    "Q4_1": (20, 32),
    "Q5_0": (22, 32),
    "Q5_1": (24, 32),
    "Q4_K": (144, 256),
    "Q5_K": (176, 256),
    "Q6_K": (210, 256),
}
INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")  # 4-bit values in groups of 32: the int4 kernels run them


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[..., 2] bytes -> [..., 1] float32 from little-endian float16."""
    return b.contiguous().view(torch.float16).float()


def _nibbles(b: torch.Tensor) -> torch.Tensor:
    """[..., n] bytes -> [..., 2n]: the n low nibbles, then the n high ones."""
    return torch.cat((b & 0x0F, b >> 4), dim=-1)


def _bits(b: torch.Tensor, count: int) -> torch.Tensor:
    """[..., n] bytes -> [..., count, n]: bit i of every byte in row i."""
    shifts = torch.arange(count, dtype=torch.uint8).reshape(count, 1)
    return (b.unsqueeze(-2) >> shifts) & 1


def _k_scales(s: torch.Tensor):
    """Q4_K/Q5_K's 12 bytes of eight 6-bit scales and eight 6-bit minimums -> two [..., 8]."""
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), dim=-1)
    mn = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), dim=-1)
    return sc.float(), mn.float()


def decode_blocks(blocks: torch.Tensor, kind: str):
    """[rows, n_blocks * block_bytes] uint8 -> (q int8 [rows, K], scales float32 [rows, K/g],
    offsets float32 [rows, K/g] or None) with weight = q * scale + offset, exactly as gguf.quants
    computes it:
      Q8_0  d (f16), 32 int8                          q * d                    g = 32
      Q4_0  d, 16 bytes of nibbles                    (q - 8) * d              g = 32
      Q4_1  d, m (f16), 16 bytes of nibbles           q * d + m                g = 32
      Q5_0  d, 32 high bits, 16 bytes of nibbles      (q - 16) * d             g = 32
      Q5_1  d, m, 32 high bits, nibbles               q * d + m                g = 32
      Q4_K  d, dmin, 12 bytes of 6-bit sc/m, 128 B    q * (d*sc) - dmin*m      g = 32 (8 per block)
      Q5_K  as Q4_K plus 32 bytes of high bits        q * (d*sc) - dmin*m      g = 32
      Q6_K  128 B low nibbles, 64 B 2-bit highs,      (q - 32) * (d*sc)        g = 16
            16 int8 sc, d
    Legacy nibbles: byte j holds weight j (low) and j + 16 (high); K-quants: each 32-byte run holds
    one sub-block in its low nibbles and the next in its high ones."""
    size, per = BLOCKS[kind]
    rows = blocks.shape[0]
    b = blocks.reshape(rows, -1, size)  # [rows, n_blocks, block_bytes]
    offsets = None
    if kind == "Q8_0":
        q, scales = b[..., 2:].contiguous().view(torch.int8), _f16(b[..., 0:2])
    elif kind in ("Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        scales = _f16(b[..., 0:2])
        if kind in ("Q4_1", "Q5_1"):
            offsets = _f16(b[..., 2:4])
        q = _nibbles(b[..., size - 16 :])  # [rows, n_blocks, 32]
        if kind in ("Q5_0", "Q5_1"):
            high = b[..., size - 20 : size - 16]  # a little-endian uint32: bit j is weight j's
            q = q | (_bits(high, 8).transpose(-1, -2).reshape(rows, -1, 32) << 4)
        q = q.to(torch.int8) - {"Q4_0": 8, "Q5_0": 16}.get(kind, 0)
    elif kind in ("Q4_K", "Q5_K"):
        d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
        sc, mn = _k_scales(b[..., 4:16])
        scales, offsets = d * sc, -(dmin * mn)  # [rows, n_blocks, 8]
        low = b[..., size - 128 :].reshape(rows, -1, 4, 32)
        q = _nibbles(low).reshape(rows, -1, 8, 32)
        if kind == "Q5_K":
            q = q | (_bits(b[..., 16:48], 8) << 4)  # bit i of byte j: sub-block i, weight j
        q = q.to(torch.int8)
    elif kind == "Q6_K":
        low = b[..., 0:128].reshape(rows, -1, 2, 1, 64)
        low = torch.cat((low & 0x0F, low >> 4), dim=-2).reshape(rows, -1, 8, 32)
        high = b[..., 128:192].reshape(rows, -1, 2, 1, 32)
        shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(4, 1)
        high = ((high >> shifts) & 3).reshape(rows, -1, 8, 32)
        q = (low | (high << 4)).to(torch.int8) - 32
        scales = (
            _f16(b[..., 208:210]) * b[..., 192:208].contiguous().view(torch.int8).float()
        )  # [rows, nb, 16]
    else:
        raise ValueError(f"no block decoder for {kind}")
    return (
        q.reshape(rows, -1),
        scales.reshape(rows, -1),
        None if offsets is None else offsets.reshape(rows, -1),
    )


def _blocks(t, path, kind) -> torch.Tensor:
    """The tensor's bytes as [rows, row_bytes], checked against its shape."""
    size, per = BLOCKS[kind]
    K = int(t.shape[0])  # GGUF lists the innermost (input) size first
    data = np.asarray(t.data, dtype=np.uint8)
    rows = int(np.prod(t.shape[1:])) if len(t.shape) > 1 else 1
    if K % per or data.size != rows * K // per * size:
        raise CheckpointError(
            f"{path}: tensor {t.name!r} ({kind}, shape {list(t.shape)}) holds {data.size:,} bytes "
            f"of blocks, expected {rows * (K // per) * size:,}: truncated or corrupt"
        )
    return torch.from_numpy(data.copy()).reshape(rows, -1)


def packed(t, name: str, path):
    """A quant_groups.Packed for a quantized 2-D weight (the int4 route where it is exact), or for
    stacked experts [E, N, K] (each tensor then [E, N, ...]), else None."""
    from formats import quant_groups

    kind, experts = t.tensor_type.name, len(t.shape) == 3 and ".mlp.experts." in name
    if kind == "MXFP4" and experts:
        return _mxfp4_experts(t, path)
    if kind not in BLOCKS or not (len(t.shape) == 2 and name.endswith(".weight") or experts):
        return None
    q, scales, offsets = decode_blocks(_blocks(t, path, kind), kind)
    if experts:  # the blocks' rows are the experts' rows, one expert after another
        p = _packed_rows(q, scales, offsets, kind, name, True)
        E = int(t.shape[2])
        tensors = {k: None if v is None else v.unflatten(0, (E, -1)) for k, v in p.tensors.items()}
        return quant_groups.Packed(
            p.kind, tensors, (E, q.shape[0] // E, q.shape[1]), p.groupsize, kind
        )
    return _packed_rows(q, scales, offsets, kind, name, q.shape[0] % 16 == 0)


def _mxfp4_experts(t, path):
    """An MXFP4 expert tensor (gpt-oss) as formats/mxfp4.py's e2m1 Packed [E, N, K]. A GGUF block is
    17 bytes: the E8M0 exponent, then 16 bytes whose low nibbles hold values 0-15 and high nibbles
    16-31; Packed's bytes hold values 2j (low) and 2j + 1 (high), as the published safetensors
    do."""
    from formats import quant_groups

    E, N, K = (int(n) for n in reversed(t.shape))
    data = np.asarray(t.data, dtype=np.uint8)
    if K % 32 or data.size != E * N * K // 32 * 17:
        raise CheckpointError(
            f"{path}: tensor {t.name!r} (MXFP4, shape {list(t.shape)}) holds {data.size:,} bytes, "
            f"expected {E * N * K // 32 * 17:,}: truncated or corrupt"
        )
    b = torch.from_numpy(data.copy()).reshape(E, N, K // 32, 17)
    codes = torch.cat((b[..., 1:] & 15, b[..., 1:] >> 4), dim=-1)  # [E, N, K/32, 32] in value order
    q = (codes[..., 0::2] | (codes[..., 1::2] << 4)).reshape(E, N, K // 2)
    scales = torch.exp2(b[..., 0].float() - 127)  # [E, N, K/32]
    return quant_groups.Packed("e2m1", {"q": q, "scales": scales}, (E, N, K), 32, "MXFP4")


def _packed_rows(q, scales, offsets, kind, name, int4_rows: bool):
    from formats import quant_groups

    N, K = q.shape
    g = K // scales.shape[1]
    if kind in INT4_TYPES and not name.startswith("embed_tokens") and int4_rows:
        # quantize.Int4Linear computes (u - 8) * scale + zero with u = q (+ 8 for signed Q4_0); the
        # zero = offset + 8 * scale must be exact in float32 for that to equal q * scale + offset
        zeros = torch.zeros_like(scales) if offsets is None else offsets + 8 * scales
        exact = offsets is None or torch.equal(
            zeros.double(), offsets.double() + 8 * scales.double()
        )
        if exact:
            u = (q + 8 if offsets is None else q).to(torch.uint8)
            tensors = {"weight": u[:, 0::2] | (u[:, 1::2] << 4), "scales": scales, "zeros": zeros}
            return quant_groups.Packed("int4", tensors, (N, K), g, kind)
    return quant_groups.Packed(
        "int8g", {"q": q, "scales": scales, "offsets": offsets}, (N, K), g, kind
    )


def dequantize(t, path) -> torch.Tensor:
    """A tensor as float32 in PyTorch order: decode_blocks' values for the types it reads,
    gguf.quants' for the others (F32, F16, BF16, Q2_K, Q3_K); a CheckpointError for a type not
    supported."""
    from gguf import quants

    from formats import quant_groups

    kind = t.tensor_type.name
    if kind not in SUPPORTED_TYPES:
        raise CheckpointError(
            f"{path}: tensor {t.name!r} has type {kind}, which is not supported "
            f"(supported: {', '.join(SUPPORTED_TYPES)})"
        )
    if kind in BLOCKS:
        q, scales, offsets = decode_blocks(_blocks(t, path, kind), kind)
        return quant_groups.dequantize_groups(q, scales, offsets).reshape(
            tuple(reversed([int(n) for n in t.shape]))
        )
    try:
        array = quants.dequantize(t.data, t.tensor_type)
    except Exception as e:
        raise CheckpointError(
            f"{path}: tensor {t.name!r} ({kind}) cannot be decoded, truncated or corrupt ({e})"
        ) from None
    array = np.ascontiguousarray(array, dtype=np.float32)
    return torch.from_numpy(array if array.flags.writeable else array.copy())


def open_gguf(path: Path, keep_quantized: bool = True, dequantized: dict = None):
    """(ModelConfig, iterator of (file, name, tensor), total bytes) for a GGUF file, under
    model.py's names (llama's Q/K rows unpermuted). The tensors are float32, or with keep_quantized
    a quant_groups.Packed for each weight matrix of a type decode_blocks reads; `dequantized` (a
    dict, if given) then collects the quantized tensors that could not stay so
    (dequantized_note)."""
    reader = read(path)
    config = config_from_gguf(reader, path)
    arch = field(reader, "general.architecture")

    def tensors():
        for t in reader.tensors:
            if t.name.startswith(("rope_freqs.", "rope_factors_")):
                continue  # folded into config.rope_scaling
            name = model_name(t.name, arch)
            w = (keep_quantized and packed(t, name, path)) or dequantize(t, path)
            kind, floats = t.tensor_type.name, ("F32", "F16", "BF16")
            if keep_quantized and dequantized is not None and isinstance(w, torch.Tensor):
                if kind not in floats:  # no Packed for it: it runs as floats
                    dequantized.setdefault(kind, []).append((name, t.data.nbytes, w.numel()))
            if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
                heads = config.n_heads if "q_proj" in name else config.n_kv_heads
                w = (
                    unpermute(w, heads)
                    if isinstance(w, torch.Tensor)
                    else w.rows(unpermute(torch.arange(w.shape[0]), heads))
                )
            if name.endswith("shared_expert_gate.weight"):
                w = w.reshape(1, -1)  # llama.cpp stores the shared expert's gate [dim] as a vector
            if arch in GEMMA and name.endswith("norm.weight"):
                w = w - 1  # llama.cpp stores Gemma's (1 + w); model.py adds the 1 itself
            reader.release(t)  # w is a copy: its pages of the file need not stay resident
            yield from split_fused(path, name, w, config) if arch == "phi3" else [(path, name, w)]

    stream = tensors()
    if arch == "deepseek2":  # kv_b_proj from its two halves, the rotary rows as model.py's
        stream = deepseek.gguf_tensors(config, stream, path)
    return config, stream, path.stat().st_size


def dequantized_note(dequantized: dict, dtype) -> str:
    """open_gguf's `dequantized` {type: [(name, file bytes, elements)]} -> "Q3_K -> bfloat16, no
    kernel at its bits (3.0 MiB in memory against 0.7 MiB in the file): v_proj, down_proj", one
    clause per type ("" if none)."""
    from runtime import human

    size = torch.tensor([], dtype=dtype).element_size()
    notes = []
    for kind, tensors in sorted(dequantized.items()):
        leaves = ", ".join(dict.fromkeys(n.split(".")[-2] for n, _, _ in tensors))
        held, stored = sum(n for _, _, n in tensors) * size, sum(b for _, b, _ in tensors)
        notes.append(
            f"{kind} -> {str(dtype).removeprefix('torch.')}, no kernel at its bits ({human(held)} "
            f"in memory against {human(stored)} in the file): {leaves}"
        )
    return "; ".join(notes)


def split_fused(path, name, w, config):
    """Phi-3's attn_qkv and fused ffn_up (gate rows, then up rows) as model.py's separate layers."""
    q, kv, ff = (
        config.n_heads * config.head_dim,
        config.n_kv_heads * config.head_dim,
        config.intermediate_size,
    )
    fused = {
        "self_attn.qkv_proj.weight": [
            ("self_attn.q_proj", q),
            ("self_attn.k_proj", kv),
            ("self_attn.v_proj", kv),
        ],
        "mlp.up_proj.weight": [("mlp.gate_proj", ff), ("mlp.up_proj", ff)],
    }
    key = next((k for k in fused if name.endswith(k)), None)
    if key is None:
        return [(path, name, w)]
    if w.shape[0] != sum(n for _, n in fused[key]):
        raise CheckpointError(
            f"{path}: fused tensor {name!r} has {w.shape[0]} rows, expected "
            f"{sum(n for _, n in fused[key])} for the heads and feed_forward_length in its metadata"
        )
    out, start, prefix = [], 0, name[: -len(key)]
    for part, n in fused[key]:
        rows = (
            w[start : start + n].clone()
            if isinstance(w, torch.Tensor)
            else w.rows(torch.arange(start, start + n))
        )
        out.append((path, f"{prefix}{part}.weight", rows))
        start += n
    return out


def write_tokenizer_only(src: Path, dst: Path):
    """Copy a GGUF file's tokenizer.* and general.architecture fields into a GGUF with no
    tensors."""
    import gguf

    reader = read(src)
    writer = gguf.GGUFWriter(str(dst), arch=str(field(reader, "general.architecture")))
    for key, f in reader.fields.items():
        if key.startswith("tokenizer."):
            sub = gguf.GGUFValueType(f.types[-1]) if len(f.types) > 1 else None
            writer.add_key_value(key, f.contents(), gguf.GGUFValueType(f.types[0]), sub_type=sub)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
