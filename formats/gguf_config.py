"""GGUF metadata into model.py's ModelConfig: what llama.cpp's converters write, per architecture.

A GGUF file names its architecture (`general.architecture`) and keeps the model's sizes under keys
prefixed by it (`llama.block_count`, `qwen3moe.expert_count`, ...). This file reads them, with what
each converter leaves out (Gemma's layer pattern and query_pre_attn_scalar, gpt-oss's SwiGLU limit:
llama.cpp keeps those in its code), RoPE scaling from `rope.scaling.*` and the factor tensors,
sliding windows, the experts of a mixture (`expert_*`, a router tensor per sparse layer), and
DeepSeek's latent attention (`deepseek2`: formats/deepseek.py reads its keys as config.json's).
formats/gguf_weights.py reads the tensors; formats/gguf_tokenizer.py the vocabulary; both through
`read`, which keeps the last files' parsed metadata.

    python -c "import sys; from formats import gguf_config as g; \
        print(g.config_from_gguf(g.read(sys.argv[1]), sys.argv[1]))" model.gguf
"""

import functools
from pathlib import Path

import numpy as np

from model import ModelConfig
from runtime import CheckpointError

SUPPORTED_ARCH = (
    "llama",
    "qwen2",
    "qwen3",
    "gemma2",
    "gemma3",
    "phi3",
    "qwen2moe",
    "qwen3moe",
    "gpt-oss",
    "deepseek2",
)
GEMMA = ("gemma2", "gemma3")


def read(path: Path):
    """A gguf_file.GGUFFile, or a CheckpointError saying the file is not readable GGUF.

    Both the weights and the tokenizer need the metadata, so the last readers are kept, keyed by
    the file's identity (settle() in formats/weights.py drops them once both are loaded)."""
    stat = Path(path).stat()
    return _read(str(path), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=2)
def _read(path: str, mtime_ns: int, size: int):
    from formats.gguf_file import GGUFFile

    try:
        return GGUFFile(path)
    except (
        Exception
    ) as e:  # the reader fails in many ways on a bad file; all mean the same to a user
        raise CheckpointError(
            f"{path}: not a readable GGUF file, truncated or corrupt ({type(e).__name__}: {e})"
        ) from None


def forget_readers():
    _read.cache_clear()


def field(reader, key, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def config_from_gguf(reader, path) -> ModelConfig:
    arch = field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCH:
        raise CheckpointError(
            f"{path}: architecture {arch!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ARCH)})"
        )

    def get(key, default=None):
        value = field(reader, f"{arch}.{key}", default)
        if value is None:
            raise CheckpointError(f"{path}: metadata {arch}.{key} is missing")
        return value

    names = {t.name for t in reader.tensors}
    heads = get("attention.head_count")
    vocab = field(reader, f"{arch}.vocab_size") or len(field(reader, "tokenizer.ggml.tokens", []))
    fields = dict(
        vocab_size=vocab,
        dim=get("embedding_length"),
        n_layers=get("block_count"),
        n_heads=heads,
        n_kv_heads=get("attention.head_count_kv", heads),
        intermediate_size=get("feed_forward_length"),
        head_dim=get("attention.key_length", 0),
        norm_eps=get("attention.layer_norm_rms_epsilon"),
        rope_theta=get("rope.freq_base", 10000.0),
        rope_scaling=rope_scaling(reader, arch, path),
        max_position_embeddings=get("context_length"),
        tie_word_embeddings="output.weight" not in names,
        qkv_bias="blk.0.attn_q.bias" in names,
        o_bias="blk.0.attn_output.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        **family_switches(reader, arch, path, get),
    )
    if arch == "deepseek2":
        return ModelConfig(**{**fields, **_deepseek2(reader, path, get, fields, names)})
    return ModelConfig(**fields, moe=experts_of(reader, arch, path, get, names))


def _deepseek2(reader, path, get, fields: dict, names) -> dict:
    """DeepSeek-V2 / V3's latent attention and experts (formats/deepseek.py). llama.cpp keeps
    YaRN's mscale_all_dim as 0.1 x it (yarn_log_multiplier) and leaves cos and sin unscaled."""
    from formats import deepseek

    scaling = fields["rope_scaling"]
    if scaling.get("rope_type") == "yarn":
        log_multiplier = field(reader, "deepseek2.rope.scaling.yarn_log_multiplier", 0.0)
        scaling.update(mscale_all_dim=log_multiplier / 0.1, attention_factor=1.0)
    cfg = deepseek.gguf_cfg(
        get,
        lambda key, default=None: field(reader, f"deepseek2.{key}", default),
        any(n.endswith("exp_probs_b.bias") for n in names),
    )
    return deepseek.deepseek_fields(cfg, scaling, str(path))


def experts_of(reader, arch, path, get, names):
    """moe.MoEConfig from `expert_*` metadata (Mixtral's files are arch llama), or None for a dense
    model. Layers without a router tensor (ffn_gate_inp) keep a dense MLP. llama.cpp renormalises
    the chosen weights of Mixtral and Qwen3-MoE, not Qwen2-MoE's, unless `expert_weights_norm`
    says."""
    from moe import MoEConfig

    count = field(reader, f"{arch}.expert_count", 0)
    if not count:
        if arch.endswith("moe"):
            raise CheckpointError(
                f"{path}: metadata {arch}.expert_count is missing or 0: {arch} needs it"
            )
        return None
    if any(n.startswith("blk.0.ffn_gate.0.") for n in names):
        raise CheckpointError(
            f"{path}: experts stored one tensor each (blk.N.ffn_gate.E.weight, an older llama.cpp "
            "layout); convert the model again with a current llama.cpp (ffn_gate_exps)"
        )
    gating = field(reader, f"{arch}.expert_gating_func", 1)
    if gating != 1:
        raise CheckpointError(
            f"{path}: metadata {arch}.expert_gating_func {gating} is not supported "
            "(supported: 1, softmax over the experts)"
        )
    n_layers = get("block_count")
    oss = (
        arch == "gpt-oss"
    )  # biases, and the clamped SwiGLU whose limit and slope llama.cpp fixes in its code
    try:
        return MoEConfig(
            count,
            get("expert_used_count"),
            field(reader, f"{arch}.expert_feed_forward_length") or get("feed_forward_length"),
            norm_topk_prob=bool(field(reader, f"{arch}.expert_weights_norm", arch != "qwen2moe")),
            router_bias="blk.0.ffn_gate_inp.bias" in names,
            expert_bias="blk.0.ffn_gate_exps.bias" in names,
            glu_limit=_number(
                field(reader, f"{arch}.swiglu_clamp_exp", 7.0), f"{arch}.swiglu_clamp_exp", path
            )
            if oss
            else 0.0,
            glu_alpha=1.702,
            shared_expert_size=field(reader, f"{arch}.expert_shared_feed_forward_length", 0) or 0,
            dense_layers=tuple(
                i for i in range(n_layers) if f"blk.{i}.ffn_gate_inp.weight" not in names
            ),
        )
    except ValueError as e:  # counts that contradict each other
        raise CheckpointError(
            f"{path}: metadata {arch}.expert_count / {arch}.expert_used_count: {e}"
        ) from None


def rope_scaling(reader, arch, path) -> dict:
    """RoPE scaling from `rope.scaling.*` metadata and the factor tensors llama.cpp stores."""
    data = {
        t.name: np.asarray(t.data, dtype=np.float32).tolist()
        for t in reader.tensors
        if t.name in ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
    }
    kind = field(reader, f"{arch}.rope.scaling.type")
    if "rope_freqs.weight" in data:  # Llama 3.1+: per-pair frequency divisors stored as a tensor
        return {"rope_type": "freq_factors", "factors": data["rope_freqs.weight"]}
    if "rope_factors_long.weight" in data:  # Phi-3's LongRoPE
        scaling = {
            "rope_type": "longrope",
            "long_factor": data["rope_factors_long.weight"],
            "short_factor": data.get("rope_factors_short.weight", data["rope_factors_long.weight"]),
            "original_max_position_embeddings": field(
                reader, f"{arch}.rope.scaling.original_context_length"
            ),
        }
        attention = field(reader, f"{arch}.rope.scaling.attn_factor")
        return {**scaling, "attention_factor": attention} if attention else scaling
    if kind in ("linear", "yarn"):
        scaling = {"rope_type": kind, "factor": field(reader, f"{arch}.rope.scaling.factor")}
        if kind == "yarn":
            scaling["original_max_position_embeddings"] = field(
                reader, f"{arch}.rope.scaling.original_context_length"
            )
            for key in ("beta_fast", "beta_slow"):
                if field(reader, f"{arch}.rope.scaling.yarn_{key}") is not None:
                    scaling[key] = field(reader, f"{arch}.rope.scaling.yarn_{key}")
            if (
                arch == "gpt-oss"
            ):  # its YaRN blends the frequencies without rounding the band (truncate false)
                scaling["truncate"] = False
        return scaling
    if kind not in (None, "none"):
        raise CheckpointError(
            f"{path}: metadata {arch}.rope.scaling.type {kind!r} is not supported "
            "(supported: none, linear, yarn, and the rope_freqs / rope_factors_* tensors)"
        )
    return {}


def family_switches(reader, arch, path, get) -> dict:
    """Sliding windows, partial rotary and Gemma's switches, as llama.cpp's converter writes them:
    Gemma's layer pattern and local RoPE base are not stored (every 2nd / 6th layer full, base
    10000), nor query_pre_attn_scalar (head_dim, or dim / heads for the 27B models: 46 or 62
    layers)."""
    window = _sliding_window(reader, arch, path)
    n_layers, out = get("block_count"), {"sliding_window": window}
    # (llama.cpp writes no key_length for phi3)
    rotary = field(reader, f"{arch}.rope.dimension_count")
    if rotary and rotary != (
        field(reader, f"{arch}.attention.key_length")
        or get("embedding_length") // get("attention.head_count")
    ):
        out["rotary_dim"] = rotary
    if arch == "gpt-oss":
        return {**out, **_gpt_oss_switches(n_layers)}
    if arch not in GEMMA:
        return out
    return {**out, **_gemma_switches(reader, arch, path, get, window, n_layers)}


def _sliding_window(reader, arch, path) -> int:
    """`attention.sliding_window` (0: none), a CheckpointError unless a non-negative integer."""
    window = field(reader, f"{arch}.attention.sliding_window", 0)
    if not isinstance(window, int) or window < 0:
        raise CheckpointError(
            f"{path}: metadata {arch}.attention.sliding_window must be a positive integer, "
            f"got {window!r}"
        )
    return window


def _gpt_oss_switches(n_layers: int) -> dict:
    """gpt-oss's attention sinks, and windows on every other layer from the first (llama.cpp's
    pattern 2)."""
    return {
        "attn_sinks": True,
        "layer_types": tuple(
            "full_attention" if i % 2 else "sliding_attention" for i in range(n_layers)
        ),
    }


def _gemma_switches(reader, arch, path, get, window: int, n_layers: int) -> dict:
    """Gemma's layer pattern (every 2nd / 6th layer full unless the file lists them), its norms,
    embedding scale and GeGLU, query_pre_attn_scalar, the soft caps and Gemma 3's local RoPE
    base."""
    pattern = field(
        reader, f"{arch}.attention.sliding_window_pattern", 2 if arch == "gemma2" else 6
    )
    if isinstance(pattern, list) and len(pattern) != n_layers:
        raise CheckpointError(
            f"{path}: metadata {arch}.attention.sliding_window_pattern lists {len(pattern)} "
            f"layers, the file has {n_layers} (block_count)"
        )
    if not window:
        raise CheckpointError(
            f"{path}: metadata {arch}.attention.sliding_window is missing: {arch} needs it"
        )
    windowed = (
        pattern if isinstance(pattern, list) else [(i + 1) % pattern != 0 for i in range(n_layers)]
    )
    large = n_layers == (46 if arch == "gemma2" else 62)
    return {
        "layer_types": tuple("sliding_attention" if w else "full_attention" for w in windowed),
        "norm_offset": 1.0,
        "embed_scale": True,
        "sandwich_norms": True,
        "mlp_act": "gelu_tanh",
        "query_scale": get("embedding_length") / get("attention.head_count")
        if large
        else get("attention.key_length"),
        "attn_softcap": field(reader, f"{arch}.attn_logit_softcapping", 0.0) or 0.0,
        "logit_softcap": field(reader, f"{arch}.final_logit_softcapping", 0.0) or 0.0,
        "local_rope_theta": field(reader, f"{arch}.rope.freq_base_swa", 10000.0)
        if arch == "gemma3"
        else 0.0,
    }


def _number(value, key, path) -> float:
    """A positive number, or one repeated per layer (a list of equal numbers), else a
    CheckpointError."""
    values = value if isinstance(value, list) else [value]
    if (
        not values
        or len(set(values)) != 1
        or not all(isinstance(v, (int, float)) and v > 0 for v in values)
    ):
        raise CheckpointError(
            f"{path}: metadata {key} must be one positive number (or the same for every layer), "
            f"got {str(value)[:80]}"
        )
    return float(values[0])
