"""quantize.py's checkpoints: the tensors each quantized layer writes, and the layers built back
from them.

A folder written by `python quantize.py` (formats/hf_folder.py writes it) holds, in place of each
quantized layer's float weight, its portable tensors (quantize.portable_tensors) and, in the
safetensors metadata under METADATA_KEY, {"mode", "groupsize", "layers"}. formats/weights.py checks
a checkpoint's tensors against `expected_tensors` (through formats/checkpoint_checks.py) and calls
`install` to build the layers:

    int8  (and any embedding)   weight int8 [N, K], scales float32 [N]
    int4                        weight uint8 [N, K/2] (two values a byte),
                                scales and zeros float32 [N, K/g]
    experts (moe.py)            the same per projection, stacked over the experts:
                                {layer}.{projection}.weight, ...
"""

import torch

import moe
from quantize import Int8Embedding, Int8Linear, _set, make_layer

METADATA_KEY = "quantization"  # safetensors metadata: {"mode", "groupsize", "layers"}


def portable_shapes(mode: str, groupsize: int, name: str, N: int, K: int) -> dict:
    """{suffix: (shape, dtype)} of a quantized layer's tensors in a checkpoint."""
    if mode == "int8" or name == "embed_tokens":
        return {"weight": ((N, K), torch.int8), "scales": ((N,), torch.float32)}
    G = (N, K // groupsize)
    return {
        "weight": ((N, K // 2), torch.uint8),
        "scales": (G, torch.float32),
        "zeros": (G, torch.float32),
    }


def expected_tensors(model, quant: dict) -> dict:
    """{tensor name: (shape, dtype)} for the quantized layers of a model built on the meta
    device."""
    out = {}
    for name in quant["layers"]:
        m = model.get_submodule(name)
        if isinstance(
            m, moe.Experts
        ):  # {name}.{projection}.{weight, scales, zeros}, stacked over the experts
            shapes = moe.portable_shapes(m, quant["mode"], quant["groupsize"])
            out.update(
                {
                    f"{name}.{p}.{s}": spec
                    for p, specs in shapes.items()
                    for s, spec in specs.items()
                }
            )
            continue
        N, K = m.weight.shape
        for suffix, spec in portable_shapes(quant["mode"], quant["groupsize"], name, N, K).items():
            out[f"{name}.{suffix}"] = spec
    return out


def install(model, state: dict, quant: dict, dtype, device):
    """Build the quantized layers from their checkpoint tensors (popped from `state`)."""
    mode, g = quant["mode"], quant["groupsize"]
    for name in quant["layers"]:
        m = model.get_submodule(name)
        if isinstance(m, moe.Experts):
            tensors = {
                p: {s: state.pop(f"{name}.{p}.{s}").to(device) for s in specs}
                for p, specs in moe.portable_shapes(m, mode, g).items()
            }
            _set(model, name, moe.from_portable(m, mode, tensors, dtype))
            continue
        portable = {
            s: state.pop(f"{name}.{s}") for s in portable_shapes(mode, g, name, 2, 2 * (g or 1))
        }
        if name == "embed_tokens":
            _set(model, name, Int8Embedding({k: v.to(device) for k, v in portable.items()}, dtype))
            continue
        bias = state.pop(f"{name}.bias", None)
        _set(model, name, make_layer(portable, bias, mode, g, dtype, device))
    emb, head = model.embed_tokens, model.lm_head
    if (
        model.config.tie_word_embeddings
        and isinstance(emb, Int8Embedding)
        and isinstance(head, Int8Linear)
    ):
        emb.weight, emb.scales = head.weight, head.scales  # the same table, computed twice on disk


def describe(report: dict) -> str:
    mode = report["mode"] + (f" (groups of {report['groupsize']})" if report["groupsize"] else "")
    kept = "; ".join(f"{n}: {r}" for n, r in _summarize(report["kept"]).items()) or "nothing"
    mib = 2**20
    return (
        f"quantized {len(report['quantized'])} layers to {mode}: "
        f"weights {report['bytes_before'] / mib:.1f} MiB -> "
        f"{report['bytes_after'] / mib:.1f} MiB | kept in higher precision: {kept}"
    )


def _summarize(kept: dict) -> dict:
    """Collapse layers.0.x, layers.1.x, ... that share a reason into layers.*.x."""
    out = {}
    for name, reason in kept.items():
        out.setdefault(".".join("*" if p.isdigit() else p for p in name.split(".")), reason)
    return out
