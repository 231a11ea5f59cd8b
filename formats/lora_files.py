"""LoRA adapters as PEFT saves them, read into lora.Adapter and checked against the base model.

A PEFT folder holds adapter_config.json (`peft_type` "LORA", `r`, `lora_alpha`, `use_rslora`,
`target_modules`, `rank_pattern` / `alpha_pattern`, ...) and adapter_model.safetensors, whose
tensors are named after the base model's modules:

    base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight   [r, in]
    base_model.model.model.layers.3.self_attn.q_proj.lora_B.weight   [out, r]

Each pair is checked (both there, finite, the config's rank, the base's in and out) and B is
scaled by alpha / r (alpha / sqrt(r) with rsLoRA) once here. What the engine cannot apply is
refused by name: DoRA, trained biases, `modules_to_save` (whole modules replaced), embeddings or
the output head as targets, another method than LoRA.

    python -m formats.lora_files ADAPTER_FOLDER     # what it holds
    adapter = read_adapter("./sql-adapter", model.config)  # -> Adapter (speedups/lora.py runs it)
"""

import hashlib
import json
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from runtime import CheckpointError

# what a PEFT target names -> the projections it covers (a fused one covers several, in order)
TARGETS = {
    "q_proj": ("q",),
    "k_proj": ("k",),
    "v_proj": ("v",),
    "o_proj": ("o",),
    "gate_proj": ("gate",),
    "up_proj": ("up",),
    "down_proj": ("down",),
    "qkv_proj": ("q", "k", "v"),  # Phi-3's
    "gate_up_proj": ("gate", "up"),
}


@dataclass
class Adapter:
    """One fine-tune, read from its files: weights {(layer, target): (A [r, in], B [out, r] times
    its scale)} in float32; key: a 128-bit fingerprint of them, the root of its prefix-cache
    hashes (a prefix computed under one adapter never serves another)."""

    name: str
    weights: dict
    rank: int
    key: int
    path: str = ""


def projection_shapes(config) -> dict:
    """{projection: (in, out)} of every decoder layer, from the config alone."""
    q, kv = config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
    d, f = config.dim, config.intermediate_size
    return {
        "q": (d, q),
        "k": (d, kv),
        "v": (d, kv),
        "o": (q, d),
        "gate": (d, f),
        "up": (d, f),
        "down": (f, d),
    }


def target_shape(config, target: str) -> tuple:
    """(in, out) of a PEFT target: a fused one's outputs are its parts' stacked."""
    shapes = projection_shapes(config)
    parts = TARGETS[target]
    return shapes[parts[0]][0], sum(shapes[p][1] for p in parts)


KEY = re.compile(
    r"^base_model\.model\.(?:model\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)"
    r"\.lora_([AB])(?:\.[\w-]+)?\.weight$"
)
REFUSED = {
    "use_dora": "DoRA (use_dora) adapters",
    "modules_to_save": "modules_to_save (whole modules the adapter replaces)",
}


def read_config(folder: Path) -> dict:
    """adapter_config.json, checked: a LoRA whose every setting the engine applies."""
    path = folder / "adapter_config.json"
    if not path.is_file():
        raise CheckpointError(f"{folder}: no adapter_config.json (is this a PEFT LoRA adapter?)")
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    if config.get("peft_type", "LORA") != "LORA":
        raise CheckpointError(f"{path}: peft_type {config['peft_type']!r}; only LORA runs here")
    for key, what in REFUSED.items():
        if config.get(key):
            raise CheckpointError(f"{path}: {what} are not supported")
    if config.get("bias", "none") != "none":
        raise CheckpointError(f"{path}: bias {config['bias']!r}: trained biases are not supported")
    if config.get("fan_in_fan_out"):
        raise CheckpointError(f"{path}: fan_in_fan_out (Conv1D bases, GPT-2's) is not supported")
    for key in ("r", "lora_alpha"):
        value = config.get(key)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            raise CheckpointError(f"{path}: {key} must be a positive number, got {value!r}")
    for key in ("rank_pattern", "alpha_pattern"):
        pattern = config.get(key) or {}
        if not isinstance(pattern, dict) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0
            for v in pattern.values()
        ):
            raise CheckpointError(f"{path}: {key} must map module names to positive numbers")
    targets = config.get("target_modules") or []
    names = [targets] if isinstance(targets, str) else list(targets)
    for t in names:
        if t in ("lm_head", "embed_tokens"):
            raise CheckpointError(f"{path}: adapters on {t} are not supported")
        if t != "all-linear" and t not in TARGETS and not isinstance(targets, str):
            raise CheckpointError(
                f"{path}: unknown target module {t!r} (supported: {', '.join(TARGETS)})"
            )
    return config


def _pattern(patterns: dict, module: str, default):
    """PEFT's rank_pattern / alpha_pattern: the first key matching the module's name's end."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _tensors(folder: Path) -> dict:
    """adapter_model.safetensors (or a weights-only .bin) -> {name: tensor}."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    st, binary = folder / "adapter_model.safetensors", folder / "adapter_model.bin"
    try:
        if st.is_file():
            return load_file(st)
        if binary.is_file():
            return torch.load(binary, map_location="cpu", weights_only=True)
    except (SafetensorError, Exception) as e:  # any failure to parse is the file's
        path = st if st.is_file() else binary
        raise CheckpointError(f"{path}: cannot be read, truncated or corrupt ({e})") from None
    raise CheckpointError(f"{folder}: no adapter_model.safetensors")


def read_adapter(path, model_config, name: str = None) -> Adapter:
    """The PEFT adapter in folder `path`, checked against the base model's config -> lora.Adapter
    (named `name`, default the folder's name). CheckpointError naming the file and what is wrong."""
    folder = Path(path)
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: no such adapter folder")
    config, tensors = read_config(folder), _tensors(folder)
    pairs = {}
    for key, t in tensors.items():
        m = KEY.match(key)
        if m is None or m.group(2) not in TARGETS:
            raise CheckpointError(
                f"{folder}: tensor {key!r} is not a LoRA A or B of a decoder projection "
                f"({', '.join(TARGETS)})"
            )
        pairs.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = (key, t)
    if not pairs:
        raise CheckpointError(f"{folder}: the adapter holds no LoRA tensors")
    weights, digest = {}, hashlib.blake2b(digest_size=16)
    for (layer, target), ab in sorted(pairs.items()):
        a, b = _check_pair(folder, config, model_config, layer, target, ab)
        r = a.shape[0]
        alpha = _pattern(config.get("alpha_pattern"), _module(layer, target), config["lora_alpha"])
        scale = alpha / (math.sqrt(r) if config.get("use_rslora") else r)
        weights[layer, target] = (a, b * scale)
        digest.update(f"{layer}.{target}.{scale}".encode())
        digest.update(a.numpy().tobytes() + b.numpy().tobytes())
    rank = max(a.shape[0] for a, _ in weights.values())
    key = int.from_bytes(digest.digest(), "little")
    return Adapter(name or folder.name, weights, rank, key, str(folder))


MLPS = ("gate_proj", "up_proj", "down_proj", "gate_up_proj")


def _module(layer: int, target: str) -> str:
    """The module's name in the base model, as PEFT's patterns match it."""
    return f"model.layers.{layer}.{'mlp' if target in MLPS else 'self_attn'}.{target}"


def _check_pair(folder, config, model_config, layer: int, target: str, ab: dict):
    """(A, B) float32 of one projection: both there, finite, shapes the base's and the rank."""
    for part in "AB":
        if part not in ab:
            other = ab["B" if part == "A" else "A"][0]
            raise CheckpointError(f"{folder}: {other} has no lora_{part} partner")
    if layer >= model_config.n_layers:
        raise CheckpointError(
            f"{folder}: {ab['A'][0]} is for layer {layer}; the base model has "
            f"{model_config.n_layers} layers (an adapter for another model?)"
        )
    (ka, a), (kb, b) = ab["A"], ab["B"]
    d_in, d_out = target_shape(model_config, target)
    r = _pattern(config.get("rank_pattern"), _module(layer, target), config["r"])
    for key, t, want in ((ka, a, (r, d_in)), (kb, b, (d_out, r))):
        if tuple(t.shape) != want:
            raise CheckpointError(
                f"{folder}: {key} has shape {list(t.shape)}; the base model's {target} with "
                f"rank {r} needs {list(want)} (an adapter for another model, or another rank?)"
            )
        if not t.is_floating_point() or not torch.isfinite(t).all():
            raise CheckpointError(f"{folder}: {key} holds non-finite or non-float values")
    return a.float(), b.float()


def main(argv=None):
    """Print what an adapter folder holds (its config checked, not its shapes)."""
    folder = Path((argv or sys.argv[1:])[0])
    config = read_config(folder)
    keys = sorted({KEY.match(k).group(2) for k in _tensors(folder) if KEY.match(k)})
    print(f"{folder}: LoRA r={config['r']} alpha={config['lora_alpha']} on {', '.join(keys)}")


if __name__ == "__main__":
    main()
