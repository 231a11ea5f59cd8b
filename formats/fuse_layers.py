"""Fused projections: each layer's q, k, v as one matmul, and gate and up as another.

    # formats/weights.load_for_inference does this after loading:
    from formats import fuse_layers; fuse_layers.fuse_projections(model)

At batch 1 a decoder layer's seven matrix-vector products are small (SmolLM2: 192 to 1536 rows
of 576), so each call's fixed cost (thread fan-out, kernel dispatch) is a large part of its time.
Stacking the rows of q/k/v and of gate/up gives four calls per layer instead of seven, reading
the same bytes: SmolLM2-135M at int4, compiled, decodes about 9% faster (RESULTS.md). The outputs
are the same numbers: every output row is still one row of weights times the input.

Layers are concatenated along their output rows in their own format: float (nn.Linear),
quantize.Int8Linear, quantize.Int4Linear on CPU and quant_groups.Int8GroupLinear (their bytes in
the int4 kernel's layout stacked as they are where every layer but the last fills whole layout
blocks, else unpacked and packed again: the slow twin the tests hold them to). Anything else
(mixed formats, different group sizes, the CUDA int4 layout) is left unfused. Fuse last: after
quantizing and tensor-parallel sharding, and not before saving a checkpoint (the fused model has
other module names).
"""

import torch
import torch.nn as nn

import quantize
from formats.quant_groups import Int8GroupLinear
from memory import release_memory


def _cat(tensors):
    return None if tensors[0] is None else torch.cat(tensors)


def _int4_values(m: quantize.Int4Linear):
    """(q [N, K] uint8, scales, zeros [N, K/G]) of a CPU int4 layer."""
    N, K = m.out_features, m.in_features
    q = (
        quantize.unpack_int4(m.portable_weight)
        if m.layout is None
        else quantize.cpu_int4_unpack(m.weight, N, K, *m.layout)
    )
    sz = m.scales_and_zeros.transpose(0, 1)  # [N, K/G, 2]
    return q, sz[..., 0], sz[..., 1]


def cpu_int4_concat(parts: list, rows: list, block: int = 64, pairing: str = "halves"):
    """The packed bytes of the matrices `parts` (rows[i] rows each) stacked along rows, [sum(rows),
    K / 2], or None where a part other than the last ends inside a layout block (its tail rows are
    stored apart): a whole block's bytes hold its rows alone, so the blocks simply follow on."""
    if any(n % block for n in rows[:-1]):
        return None
    return torch.cat([p.reshape(-1) for p in parts]).view(sum(rows), -1)


def _stacked_bytes(layers: list, name: str):
    """The layers' int4-kernel bytes (attribute `name`) stacked by cpu_int4_concat, or None where a
    layer has none, or a layout, group size, input width or nibble layout unlike the first's."""
    first, same = layers[0], ("layout", "groupsize", "in_features", "balanced")
    if any(
        getattr(m, name) is None
        or m.layout is None
        or any(getattr(m, a, None) != getattr(first, a, None) for a in same)
        for m in layers
    ):
        return None
    rows = [m.out_features for m in layers]
    return cpu_int4_concat([getattr(m, name) for m in layers], rows, *first.layout)


def stack_int4(layers: list, bias):
    """One CPU quantize.Int4Linear computing torch.cat([m(x) for m in layers], -1) from the
    layers' packed bytes (no repacking), or None where they cannot stack."""
    first, packed = layers[0], _stacked_bytes(layers, "weight")
    if packed is None:
        return None
    sz = torch.cat([m.scales_and_zeros for m in layers], 1).transpose(0, 1)  # [N, K/G, 2]
    portable = {"cpu_packed": (packed, first.layout), "scales": sz[..., 0], "zeros": sz[..., 1]}
    return quantize.Int4Linear(portable, bias, sz.dtype, first.groupsize, packed.device)


def stack_pairs(layers: list, bias):
    """One Int8GroupLinear computing torch.cat([m(x) for m in layers], -1) from the layers'
    nibble pairs (no repacking), or None where they cannot stack."""
    first, pair = layers[0], _stacked_bytes(layers, "pair")
    if pair is None:
        return None
    N, K, G = pair.shape[0], first.in_features, first.groupsize
    meta = {"device": "meta"}  # an empty shell of the right shape; the pair comes next
    out = Int8GroupLinear(
        torch.empty(N, K, dtype=torch.int8, **meta),
        torch.empty(N, K // G, **meta),
        None,
        bias,
        first.dtype,
    )
    out.weight = out.scales = None
    out.pair, out.layout, out.balanced = pair, first.layout, first.balanced
    out.pair_scales = torch.cat([m.pair_scales for m in layers], 1)
    return out


def concat_rows(layers):
    """One layer computing torch.cat([layer(x) for layer in layers], -1), or None if they differ."""
    first = layers[0]
    if any(type(m) is not type(first) for m in layers):
        return None
    biases = [m.bias for m in layers]
    if any((b is None) != (biases[0] is None) for b in biases):
        return None
    bias = None if biases[0] is None else torch.cat([b.data for b in biases])
    if type(first) is nn.Linear:
        w = torch.cat([m.weight.data for m in layers])
        out = nn.Linear(w.shape[1], w.shape[0], bias=bias is not None, device="meta")
        out.weight = nn.Parameter(w, requires_grad=False)
        if bias is not None:
            out.bias = nn.Parameter(bias, requires_grad=False)
        return out
    if type(first) is quantize.Int8Linear:
        portable = {
            "weight": torch.cat([m.weight for m in layers]),
            "scales": torch.cat([m.scales for m in layers]),
        }
        return quantize.Int8Linear(portable, bias, first.scales.dtype)
    if type(first) is quantize.Int4Linear:
        if not first.cpu or any(m.groupsize != first.groupsize for m in layers):
            return None
        stacked = stack_int4(layers, bias)  # the packed bytes, not repacked
        if stacked is not None:
            return stacked
        q, s, z = (torch.cat(parts) for parts in zip(*map(_int4_values, layers)))
        portable = {"weight": q[:, 0::2] | (q[:, 1::2] << 4), "scales": s, "zeros": z}
        return quantize.Int4Linear(
            portable, bias, first.scales_and_zeros.dtype, first.groupsize, first.weight.device
        )
    if type(first) is Int8GroupLinear:
        if any(m.groupsize != first.groupsize or m.balanced != first.balanced for m in layers):
            return None  # (nibbles with a zero would move a balanced layer's exact values)
        stacked = stack_pairs(layers, bias)  # the nibble pairs, not repacked
        if stacked is not None:
            return stacked
        scales, offsets = zip(*(m.group_scales() for m in layers))
        if any((o is None) != (offsets[0] is None) for o in offsets):
            offsets = [torch.zeros_like(s) if o is None else o for s, o in zip(scales, offsets)]
        return Int8GroupLinear(
            torch.cat([m.int8_values() for m in layers]),
            torch.cat(scales),
            _cat(offsets),
            bias,
            first.dtype,
        )
    return None


def fuse_projections(model) -> int:
    """Fuse every layer's q/k/v and gate/up in place; returns how many groups were fused."""
    fused = 0
    for layer in model.layers:
        a, mlp = (
            layer.self_attn,
            getattr(layer.mlp, "shared_expert", layer.mlp),
        )  # (moe.py: its dense shared expert)
        if getattr(a, "qkv_proj", 0) is None and a.q_proj is not None:  # (not latent attention)
            qkv = concat_rows([a.q_proj, a.k_proj, a.v_proj])
            if qkv is not None:
                a.qkv_proj, a.q_proj, a.k_proj, a.v_proj = qkv, None, None, None
                fused += 1
        if mlp is not None and mlp.gate_up_proj is None and mlp.gate_proj is not None:
            gate_up = concat_rows([mlp.gate_proj, mlp.up_proj])
            if gate_up is not None:
                mlp.gate_up_proj, mlp.gate_proj, mlp.up_proj = gate_up, None, None
                fused += 1
        # the repacking's temporaries, layer by layer, so the peak stays the model's size
        release_memory()
    return fused
