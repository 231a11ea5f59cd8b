"""MXFP4, the 4-bit floats gpt-oss's published folders store their experts in, read at their own
bits.

MXFP4 (the OCP microscaling format) gives each group of 32 weights along the input dimension one
power-of-two scale, and each weight a 4-bit float e2m1 (a sign, 2 exponent bits, 1 mantissa bit),
one of 0, 0.5, 1, 1.5, 2, 3, 4, 6 or their negatives (moe.E2M1, indexed by the 4-bit code):

    w[e, n, k] = E2M1[code[e, n, k]] * 2 ** (scale[e, n, k // 32] - 127)

    {projection}_blocks  uint8 [E, N, K/32, 16]  a group's 32 codes: code 2j in the low nibble of
                                                 byte j, code 2j + 1 in the high one
    {projection}_scales  uint8 [E, N, K/32]      the exponent, biased by 127 (E8M0)

config.json says `"quantization_config": {"quant_method": "mxfp4", ...}`. The blocks are [E, out,
in] (gate_up_proj's rows alternate gate, up), unlike the float parameters, [E, in, out]
(families.gpt_oss_experts). Twice an e2m1 value is an integer in [-12, 12], so each weight is also
exactly an int8 times a power of two; here the codes stay as they are, 4.25 bits a weight, in
moe.GroupExperts' "e2m1" projections, and only the experts a step chooses are decoded. With
dequantize=True each projection comes out in float32 instead, the same values.

    import weights; model, info = weights.load("path/to/gpt-oss-20b"); print(info.own_bits)
"""

import torch

from formats.quant_groups import Packed
from moe import e2m1_weights
from runtime import CheckpointError

PARTS = ("gate_up_proj", "down_proj")  # gpt-oss's expert projections with blocks and scales


def packed_tensors(tensors, source, dequantize: bool = False):
    """(file, name, tensor) -> the same stream with each projection's `_blocks` and `_scales`
    replaced by moe.py's projections: (file, "<experts>.gate_proj" | "up_proj" | "down_proj", Packed
    [E, N, K]) (float32 with dequantize), as soon as both halves of a pair have arrived."""
    pending = {}  # "<experts>.<projection>" -> {"blocks": (file, tensor), "scales": ...}
    for file, name, tensor in tensors:
        stem, _, part = name.rpartition("_")
        if part not in ("blocks", "scales") or not stem.endswith(PARTS):
            yield file, name, tensor
            continue
        pair = pending.setdefault(stem, {})
        pair[part] = (file, tensor)
        if len(pair) == 2:
            yield from _convert(stem, pending.pop(stem), source, dequantize)
    for stem, pair in pending.items():
        ((have, (file, _)),) = pair.items()
        missing = "scales" if have == "blocks" else "blocks"
        raise CheckpointError(
            f"{file}: {stem}_{have} has no {stem}_{missing}: the mxfp4 checkpoint is incomplete"
        )


def _convert(stem: str, pair: dict, source, dequantize: bool):
    (file, blocks), (_, scales) = pair["blocks"], pair["scales"]
    if not (
        blocks.dtype == scales.dtype == torch.uint8
        and blocks.dim() == 4
        and blocks.shape[3] == 16
        and tuple(scales.shape) == tuple(blocks.shape[:3])
    ):
        raise CheckpointError(
            f"{file}: {stem}_blocks {tuple(blocks.shape)} {blocks.dtype} and _scales "
            f"{tuple(scales.shape)} {scales.dtype} are not MXFP4 "
            "(uint8 [E, N, K/32, 16] and [E, N, K/32])"
        )
    E, N, G, _ = blocks.shape
    codes = blocks.reshape(E, N, G * 16)  # [E, N, K/2]: two codes a byte, the even one low
    powers = torch.exp2(scales.float() - 127)  # [E, N, K/32], exact in float32
    split = (
        [("gate_proj", slice(0, None, 2)), ("up_proj", slice(1, None, 2))]
        if stem.endswith("gate_up_proj")
        else [("down_proj", slice(None))]
    )
    prefix = stem.rpartition(".")[0]
    for projection, rows in split:
        p = Packed(
            "e2m1",
            {"q": codes[:, rows].contiguous(), "scales": powers[:, rows].contiguous()},
            (E, len(range(N)[rows]), G * 32),
            32,
            "mxfp4",
        )
        yield file, f"{prefix}.{projection}", decode(p) if dequantize else p


def decode(p: Packed) -> torch.Tensor:
    """A Packed e2m1 projection [E, N, K] as float32: E2M1[code] * scale."""
    return e2m1_weights(p.tensors["q"], p.tensors["scales"])
