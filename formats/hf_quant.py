"""HF folders quantized by GPTQ, AWQ or compressed-tensors, read into int4 layers at their own bits.

A folder whose config.json carries a `quantization_config` stores each quantized linear layer as
4-bit integers packed into int32 words, with a scale and a zero point per group of G input
channels. All three formats mean the same weight:

    w[n, k] = scale[g, n] * (q[k, n] - z[g, n])          q, z in [0, 15], g = k // G

and differ only in how q and z are packed (word = int32, nibble i = bits 4i..4i+3):

  gptq  (AutoGPTQ, GPTQModel) qweight [K/8, N]  nibble i of qweight[r, n] = q[8r + i, n]   (along K)
                              qzeros [K/G, N/8] nibble i of qzeros[g, c]  = z[g, 8c + i]   (along N)
                              scales [K/G, N], g_idx [K]. checkpoint_format "gptq" (classic) stores
                              z - 1 (sym stores 7 for 8): z = nibble + 1, as AutoGPTQ's kernels
                              compute it (nibble 15 reads as 16); "gptq_v2" stores z itself.
  awq   (AutoAWQ GEMM)        qweight [K, N/8], qzeros [K/G, N/8], both along N in AWQ's order:
                              nibble i of word j holds column 8j + AWQ_ORDER[i]; scales [K/G, N].
  compressed-tensors          weight_packed [N, K/8] along K (nibble i = q[n, 8j + i]), stored as
  (pack-quantized)            q + 8 of a signed q in [-8, 7]; weight_scale [N, K/G]; asymmetric
                              folders add weight_zero_point [N/8, K/G] packed along N the same way
                              (or, from older writers, unpacked [N, K/G]); symmetric means z = 8.

Each layer becomes one quant_groups.Packed in quantize.py's portable int4, which weights.build
(through quant_groups.install) turns into quantize.Int4Linear:

    w = (q - 8) * s + zero      with  zero = s * (8 - z)   (float32, from the file's fp16/bf16 s)

For fp16/bf16 scales this is exact: s * (8 - z) and (q - 8) * s are exact float32 products, and
their sum s * (q - z) needs at most 11 + 5 bits, so the layer dequantizes to the very float32
value the format defines. (float32 scales, which compressed-tensors may write, round once more.)

Group sizes: the int4 kernels take groups of 32, 64, 128 or 256 (quantize.GROUP_SIZES) and need
N % 16 == 0. A file's group size G (-1 or a per-channel strategy: one group over all of K) runs
at the largest kernel group G' dividing both G and K, each file group's scale and zero repeated
G / G' times: the same values exactly. Where no such G' exists (G = 16, say) or N % 16 != 0, the
layer is *not refused*: it runs as int8 values with the same group scales (quant_groups'
Int8GroupLinear: exact in float32; in bf16 on CPU the int4 kernel over two nibbles a value, with
bf16 scales as above and a zero that rounds to bf16 where there are offsets), and a note is
printed.

Act-order (GPTQ desc_act): a g_idx other than k // G assigns scattered input channels to each
group; that is refused (re-quantize with desc_act=False, or use a checkpoint without act-order).
So are other bit widths, AWQ's GEMV/Marlin/exllama packings, activation quantization, and every
other quant_method (fp8, bitsandbytes, hqq, ...), by `check` before any tensor is read.

With dequantize=True (generate.py --dequantize, or --quantize, which quantizes again from float)
each layer comes out as its float32 dequantization instead of a Packed.

    import weights
    model, info = weights.load("path/to/Llama-3.2-1B-Instruct-GPTQ"); print(info.own_bits)
"""

import math

import torch

import quantize
from formats.quant_groups import Packed
from runtime import CheckpointError

METHODS = ("gptq", "awq", "compressed-tensors")
SUPPORTED = (
    "gptq and awq (4-bit, GEMM packing), "
    "compressed-tensors (pack-quantized int4, group or channel) "
    "and mxfp4 (gpt-oss's experts: formats/mxfp4.py)"
)
GPTQ_FORMATS = {"gptq": 1, "gptq_v2": 0}  # added to each stored zero nibble
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds column 8j + AWQ_ORDER[i]
# The tensors of one layer: (required, optional) suffixes after "<layer>."
PARTS = {
    "gptq": (("qweight", "qzeros", "scales"), ("g_idx",)),
    "awq": (("qweight", "qzeros", "scales"), ()),
    "compressed-tensors": (
        ("weight_packed", "weight_scale"),
        ("weight_zero_point", "weight_shape", "weight_g_idx"),
    ),
}
SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)  # nibble i sits at bits 4i..4i+3


def method_of(quant_config: dict) -> str:
    return str(quant_config.get("quant_method", "")).lower()


# ---- refusing what cannot load, before reading tensors ---------------------------------------


def check(quant_config: dict, source) -> None:
    """Raise CheckpointError for a quantization this file does not read, naming what it is."""
    if not isinstance(quant_config, dict):
        raise CheckpointError(f"{source}: quantization_config is not a JSON object")
    method = method_of(quant_config)
    if method == "mxfp4":  # gpt-oss's experts: nothing in the config to check (formats/mxfp4.py)
        return
    if method not in METHODS:
        raise CheckpointError(
            f"{source}: quant_method {quant_config.get('quant_method')!r} is not supported; "
            f"this loader reads {SUPPORTED}. Load the float checkpoint instead "
            "(--quantize int4 quantizes it at load time)"
        )
    c = quant_config
    if method == "gptq":
        fmt = c.get("checkpoint_format", c.get("format", "gptq"))
        _need(source, c.get("bits") == 4, f"gptq with {c.get('bits')} bits (only 4-bit is read)")
        _need(
            source,
            fmt in GPTQ_FORMATS,
            f"gptq checkpoint_format {fmt!r} (read: {', '.join(GPTQ_FORMATS)})",
        )
        _need(source, not c.get("dynamic"), "gptq per-module overrides ('dynamic')")
        _group_size(c.get("group_size"), source)
    elif method == "awq":
        bits, version = c.get("bits", c.get("w_bit")), str(c.get("version", "gemm")).lower()
        _need(source, bits == 4, f"awq with {bits} bits (only 4-bit is read)")
        _need(source, version == "gemm", f"awq version {version!r} (only the GEMM packing is read)")
        _group_size(c.get("group_size", c.get("q_group_size")), source)
    else:
        for name, weights in _ct_schemes(c, source):
            _need(
                source,
                weights.get("type") == "int" and weights.get("num_bits") == 4,
                f"compressed-tensors {name}: {weights.get('type')} "
                f"with {weights.get('num_bits')} bits (only int4 is read)",
            )
            _need(
                source,
                weights.get("strategy") in ("group", "channel"),
                f"compressed-tensors {name}: strategy {weights.get('strategy')!r} "
                "(read: group, channel)",
            )
            if weights.get("strategy") == "group":
                _group_size(weights.get("group_size"), source)


def _need(source, ok: bool, what: str):
    if not ok:
        raise CheckpointError(f"{source}: {what} is not supported; this loader reads {SUPPORTED}")


def _group_size(group_size, source) -> None:
    _need(
        source,
        isinstance(group_size, int)
        and not isinstance(group_size, bool)
        and (group_size > 0 or group_size == -1),
        f"group size {group_size!r}",
    )


def _ct_schemes(c: dict, source):
    """(group name, weight args) of every compressed-tensors config group, after checking the parts
    of the config that apply to the whole folder."""
    fmt = c.get("format")
    _need(source, fmt == "pack-quantized", f"compressed-tensors format {fmt!r}")
    _need(
        source,
        c.get("quantization_status", "compressed") == "compressed",
        f"compressed-tensors status {c.get('quantization_status')!r} "
        "(the weights must be stored compressed)",
    )
    for key in ("kv_cache_scheme", "sparsity_config", "transform_config"):
        _need(source, not c.get(key), f"compressed-tensors {key}")
    groups = c.get("config_groups") or {}
    _need(source, isinstance(groups, dict) and groups, "compressed-tensors without config_groups")
    out = []
    for name, scheme in groups.items():
        scheme = scheme if isinstance(scheme, dict) else {}
        _need(
            source,
            not scheme.get("input_activations") and not scheme.get("output_activations"),
            f"compressed-tensors {name}: activation quantization",
        )
        _need(
            source,
            scheme.get("format") in (None, "pack-quantized"),
            f"compressed-tensors {name}: format {scheme.get('format')!r}",
        )
        out.append((name, scheme.get("weights") or {}))
    return out


# ---- the stream: buffer each layer's tensors, yield one Packed ------------------------------


def packed_tensors(quant_config: dict, tensors, source, dequantize: bool = False):
    """(file, name, tensor) -> the same stream with each quantized layer's tensors replaced by one
    (file, "<layer>.weight", Packed) (or its float32 dequantization when dequantize=True).

    A layer's tensors may come in any order and from different shard files, so they wait in a
    buffer (memory-mapped views, no copies) until all are seen; a layer that still lacks its
    optional tensors (a symmetric zero point, g_idx) is converted when the stream ends."""
    method = method_of(quant_config)
    required, optional = PARTS[method]
    pending = {}  # layer -> {part: (file, tensor)}
    for file, name, tensor in tensors:
        layer, _, part = name.rpartition(".")
        if part not in required + optional:
            yield file, name, tensor
            continue
        parts = pending.setdefault(layer, {})
        parts[part] = (file, tensor)
        if set(parts) == set(required + optional):
            yield _convert(method, quant_config, layer, pending.pop(layer), source, dequantize)
    for layer, parts in pending.items():
        missing = [p for p in required if p not in parts]
        if missing:
            files = sorted({str(f) for f, _ in parts.values()})
            raise CheckpointError(
                f"{source}: layer {layer!r} has {', '.join(sorted(parts))} (in {', '.join(files)}) "
                f"but no {', '.join(missing)}: the {method} checkpoint is incomplete"
            )
        yield _convert(method, quant_config, layer, parts, source, dequantize)


def _convert(method, c: dict, layer: str, parts: dict, source, dequantize: bool):
    file = parts[PARTS[method][0][0]][0]
    t = {part: tensor for part, (_, tensor) in parts.items()}
    if method == "gptq":
        q, z, scales, G, label = _gptq(c, layer, t, file)
    elif method == "awq":
        q, z, scales, G, label = _awq(c, layer, t, file)
    else:
        q, z, scales, G, label = _compressed_tensors(c, layer, t, file)
    packed = to_packed(layer, q, z, scales, G, t.get("g_idx", t.get("weight_g_idx")), label, file)
    return file, f"{layer}.weight", packed.dequantize() if dequantize else packed


def _unpack_rows(words: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] -> uint8 [R, 8C], nibble i of word [r, c] at [r, 8c + i] (packed along the last
    dim)."""
    R, C = words.shape
    return ((words.to(torch.int32)[:, :, None] >> SHIFTS) & 15).to(torch.uint8).reshape(R, 8 * C)


def _expect(file, layer, part, tensor, shape, why):
    if tuple(tensor.shape) != tuple(shape):
        raise CheckpointError(
            f"{file}: {layer}.{part} has shape {tuple(tensor.shape)}, "
            f"but {why} needs {tuple(shape)}"
        )


def _int32(file, layer, part, tensor):
    if tensor.dtype != torch.int32:
        raise CheckpointError(
            f"{file}: {layer}.{part} is {tensor.dtype}, expected torch.int32 (packed 4-bit values)"
        )


def _file_group(group_size: int, K: int) -> int:
    return K if group_size == -1 else group_size


def _gptq(c, layer, t, file):
    """-> q uint8 [N, K], z [N, K/G] (the real zero), scales float32 [N, K/G], G, label."""
    qweight, qzeros, scales = t["qweight"], t["qzeros"], t["scales"]
    _int32(file, layer, "qweight", qweight)
    _int32(file, layer, "qzeros", qzeros)
    K, N = 8 * qweight.shape[0], qweight.shape[1]
    G = _file_group(c["group_size"], K)
    why = f"qweight's shape {tuple(qweight.shape)} with group size {c['group_size']}"
    _expect(file, layer, "scales", scales, (math.ceil(K / G), N), why)
    _expect(file, layer, "qzeros", qzeros, (math.ceil(K / G), math.ceil(N / 8)), why)
    if "g_idx" in t:
        _expect(file, layer, "g_idx", t["g_idx"], (K,), why)
    q = _unpack_rows(qweight.t().contiguous())  # [N, K/8] -> [N, K]: packed along K
    offset = GPTQ_FORMATS[c.get("checkpoint_format", c.get("format", "gptq"))]
    z = _unpack_rows(qzeros)[:, :N].t().int() + offset  # [K/G, N] -> [N, K/G]
    return q, z, scales.t().float(), G, "gptq"


def _awq(c, layer, t, file):
    qweight, qzeros, scales = t["qweight"], t["qzeros"], t["scales"]
    _int32(file, layer, "qweight", qweight)
    _int32(file, layer, "qzeros", qzeros)
    K, N = qweight.shape[0], 8 * qweight.shape[1]
    G = _file_group(c.get("group_size", c.get("q_group_size")), K)
    why = f"qweight's shape {tuple(qweight.shape)} with group size {G}"
    _expect(file, layer, "scales", scales, (math.ceil(K / G), N), why)
    _expect(file, layer, "qzeros", qzeros, (math.ceil(K / G), N // 8), why)
    # nibble i of word j holds column 8j + AWQ_ORDER[i]; put each column back in its place
    q = _unscramble_awq(qweight).t().contiguous()  # [K, N] -> [N, K]
    z = _unscramble_awq(qzeros).t().int()  # [K/G, N] -> [N, K/G]
    return q, z, scales.t().float(), G, "awq"


def _unscramble_awq(words: torch.Tensor) -> torch.Tensor:
    """int32 [R, N/8] in AWQ's order -> uint8 [R, N]: nibble i of word j holds column 8j +
    AWQ_ORDER[i]."""
    R = words.shape[0]
    nibble_of_column = torch.tensor(AWQ_ORDER).argsort()  # [0, 4, 1, 5, 2, 6, 3, 7]
    return _unpack_rows(words).reshape(R, -1, 8)[:, :, nibble_of_column].reshape(R, -1)


def _compressed_tensors(c, layer, t, file):
    packed, scales = t["weight_packed"], t["weight_scale"]
    _int32(file, layer, "weight_packed", packed)
    N, K = packed.shape[0], 8 * packed.shape[1]
    if "weight_shape" in t:
        N, K = (int(v) for v in t["weight_shape"].tolist())  # one-time read at load, not a hot path
        _expect(
            file, layer, "weight_packed", packed, (N, math.ceil(K / 8)), f"weight_shape {(N, K)}"
        )
    if scales.ndim != 2 or scales.shape[0] != N:
        raise CheckpointError(
            f"{file}: {layer}.weight_scale has shape {tuple(scales.shape)}, but weight_packed's "
            f"shape {tuple(packed.shape)} needs ({N}, K / group size)"
        )
    sizes = {
        K if w.get("strategy") == "channel" else w["group_size"] for _, w in _ct_schemes(c, file)
    }
    fits = [g for g in sorted(sizes) if math.ceil(K / _file_group(g, K)) == scales.shape[1]]
    if not fits:
        raise CheckpointError(
            f"{file}: {layer}.weight_scale has shape {tuple(scales.shape)}, which no group size of "
            f"the config ({', '.join(map(str, sorted(sizes)))}) makes for {K} input channels"
        )
    G = _file_group(fits[0], K)
    if "weight_g_idx" in t:
        _expect(file, layer, "weight_g_idx", t["weight_g_idx"], (K,), f"weight_shape {(N, K)}")
    q = _unpack_rows(packed)[:, :K]  # [N, K], already q + 8 in [0, 15]
    zero_point = t.get("weight_zero_point")
    if zero_point is None:
        z = torch.full(scales.shape, 8, dtype=torch.int32)  # symmetric
    elif zero_point.dtype == torch.int32 and tuple(zero_point.shape) == (
        math.ceil(N / 8),
        scales.shape[1],
    ):
        z = (
            _unpack_rows(zero_point.t().contiguous())[:, :N].t().int()
        )  # packed along N -> [N, K/G], already + 8
    elif tuple(zero_point.shape) == tuple(scales.shape):
        z = zero_point.int() + 8  # an unpacked signed zero point
    else:
        raise CheckpointError(
            f"{file}: {layer}.weight_zero_point has shape {tuple(zero_point.shape)}, "
            f"but weight_scale's shape {tuple(scales.shape)} "
            f"needs {(math.ceil(N / 8), scales.shape[1])} (packed)"
        )
    return q, z, scales.float(), G, "compressed-tensors"


# ---- one layer's values -> portable int4 (or int8 groups) ----------------------------------


def kernel_groupsize(G: int, N: int, K: int):
    """The int4 kernels' group size that holds groups of G exactly, or None."""
    fits = [g for g in quantize.GROUP_SIZES if math.gcd(G, K) % g == 0]
    return max(fits) if fits and N % 16 == 0 else None


def to_packed(layer, q, z, scales, G: int, g_idx, label: str, file) -> Packed:
    """q uint8 [N, K] in [0, 15], z [N, ceil(K/G)] in [0, 16], scales float32 [N, ceil(K/G)] ->
    Packed."""
    N, K = q.shape
    if g_idx is not None and not torch.equal(g_idx.long(), torch.arange(K) // G):
        raise CheckpointError(
            f"{file}: {layer}.g_idx is not k // {G}: the layer was quantized with act-order "
            "(desc_act), whose groups are scattered over the input channels; that is not "
            "supported here (use a checkpoint quantized with desc_act=False)"
        )
    zeros = scales * (8 - z).float()  # exact for fp16/bf16 scales (see the header)
    source = f"{label} int4 g{G}"
    g = kernel_groupsize(G, N, K)
    int4 = g is not None
    if not int4:  # no int4 kernel for this shape: the same values as int8 with group scales
        g = math.gcd(G, K)
        why = f"group size {G}" if N % 16 == 0 else f"{N} output channels (not a multiple of 16)"
        quantize.warn_once(
            f"{source} layers with {why} run as int8 values with groups of {g} (the same weights, "
            f"1 byte each): the int4 kernels take groups of {quantize.GROUP_SIZES} and N % 16 == 0"
        )
    index = torch.arange(K // g) * g // G  # group j of g channels -> the file's group holding them
    scales, zeros = scales[:, index].contiguous(), zeros[:, index].contiguous()  # [N, K/g]
    if not int4:
        return Packed(
            "int8g",
            {"q": q.to(torch.int8) - 8, "scales": scales, "offsets": zeros},
            (N, K),
            g,
            source,
        )
    weight = q[:, 0::2] | (q[:, 1::2] << 4)  # [N, K/2]: q[2i] low nibble, q[2i+1] high
    return Packed("int4", {"weight": weight, "scales": scales, "zeros": zeros}, (N, K), g, source)
