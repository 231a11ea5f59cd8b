"""Model families: an HF config.json (and its tensor names) turned into model.py's ModelConfig and
layout.

Each family the model runs is a set of switches (model.py's ModelConfig); this file reads them
from the keys each family's config.json uses, with that family's defaults for keys a published
config leaves out (Gemma 3's text_config gives only what differs from Gemma3TextConfig), and
renames or splits tensors whose layout differs from Llama's:

    llama, mistral      Mistral v0.1: a sliding window on every layer
    qwen2, qwen3        use_sliding_window: windows on the layers from max_window_layers on
    gemma2              (1 + w) norms, sqrt(dim) embeddings, GeGLU, sandwich norms, soft-capping,
                        sliding and full layers alternating
    gemma3_text, gemma3 q/k norms, five sliding layers to one full, a local RoPE base for sliding
                        ones (gemma3: the text model of the multimodal checkpoint; its vision
                        tower is skipped)
    phi3                fused qkv_proj and gate_up_proj (split here), LongRoPE, partial rotary
    mixtral             mixture of experts (moe.py): 8 experts, top 2, per-expert w1/w3/w2
                        stacked here
    qwen2_moe           experts plus a gated shared expert, norm_topk_prob, decoder_sparse_step,
                        mlp_only_layers
    qwen3_moe           experts, q/k norms
    deepseek_v2, _v3    multi-head latent attention, routed and shared experts (deepseek.py)
    gpt_oss             experts with biases and a clamped SwiGLU, a router bias, attention sinks,
                        biases on q/k/v/o, sliding and full layers alternating, YaRN;
                        gate_up_proj [E, dim, 2 ff] (gate and up columns interleaved) split here;
                        MXFP4 expert blocks are formats/mxfp4.py's

    python -c "import json; from formats import families; \
        print(families.config_from_hf(json.load(open('config.json')), 'config.json'))"
"""

from dataclasses import replace
from pathlib import Path

import torch

from formats.deepseek import KINDS as DEEPSEEK
from formats.deepseek import deepseek_fields, deepseek_tensors
from model import ModelConfig
from moe import MoEConfig
from rope import kind_of
from runtime import CheckpointError

SUPPORTED_HF = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma2",
    "gemma3_text",
    "gemma3",
    "phi3",
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "gpt_oss",
    "deepseek_v2",
    "deepseek_v3",
)
QWEN = ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")
GEMMA3_DEFAULTS = dict(
    vocab_size=262208,
    hidden_size=2304,
    intermediate_size=9216,
    num_hidden_layers=26,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=256,
    rms_norm_eps=1e-6,
    max_position_embeddings=131072,
    query_pre_attn_scalar=256,
    sliding_window=4096,
    rope_theta=1_000_000.0,
    rope_local_base_freq=10_000.0,
    sliding_window_pattern=6,
    tie_word_embeddings=True,
)
GEMMA2_DEFAULTS = dict(
    query_pre_attn_scalar=256,
    sliding_window=4096,
    attn_logit_softcapping=50.0,
    final_logit_softcapping=30.0,
    head_dim=256,
    max_position_embeddings=8192,
)
HF_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}  # HF's names -> model.py's


def config_from_hf(cfg: dict, source) -> ModelConfig:
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{source}: config.json is not a JSON object")
    try:
        return _config_from_hf(cfg, source)
    except CheckpointError:
        raise
    except KeyError as e:
        raise CheckpointError(f"{source}: config.json has no {e.args[0]!r}") from None
    except (
        TypeError,
        ValueError,
        AttributeError,
        ZeroDivisionError,
    ) as e:  # wrong types, zero heads
        raise CheckpointError(
            f"{source}: config.json has values that do not make a model ({e})"
        ) from None


def text_config(cfg: dict) -> dict:
    """The language model's config: Gemma 3's multimodal checkpoints nest it, with its defaults."""
    if cfg.get("model_type") == "gemma3":
        cfg = {**cfg.get("text_config", {}), "model_type": "gemma3_text"}
    defaults = {"gemma3_text": GEMMA3_DEFAULTS, "gemma2": GEMMA2_DEFAULTS}.get(
        cfg.get("model_type"), {}
    )
    return {**defaults, **cfg}  # a key given as null stays null (no soft cap, no window), as in HF


def rope_of(cfg: dict, kind: str):
    """(theta, scaling, local theta) from the classic `rope_theta` + `rope_scaling` or the newer
    `rope_parameters` (Gemma 3's nested per layer type: full_attention, sliding_attention)."""
    rope = dict(cfg.get("rope_parameters") or {})
    local = rope.pop("sliding_attention", None)
    rope = dict(rope.pop("full_attention", None) or rope)
    theta = rope.pop("rope_theta", cfg.get("rope_theta", 10000.0))
    scaling = rope or dict(cfg.get("rope_scaling") or {})
    if kind == "phi3" and kind_of(scaling) in ("su", "yarn"):  # Phi-3's older names for LongRoPE
        scaling["rope_type"] = "longrope"
    if kind_of(scaling) in (
        "yarn",
        "longrope",
        "llama3",
    ):  # Phi-3 keeps the original context outside
        old = cfg.get("original_max_position_embeddings") if kind == "phi3" else None
        scaling["original_max_position_embeddings"] = old or scaling.get(
            "original_max_position_embeddings", cfg.get("max_position_embeddings", 4096)
        )
    for key in ("partial_rotary_factor", "rope_theta"):
        scaling.pop(key, None)
    if kind_of(scaling) == "default":
        scaling = {}
    local_theta = (
        (local or {}).get("rope_theta", cfg.get("rope_local_base_freq"))
        if kind == "gemma3_text"
        else 0.0
    )
    return theta, scaling, local_theta or 0.0


def layer_types_of(cfg: dict, kind: str, n_layers: int, window):
    """Which layers are windowed, from `layer_types` or each family's older keys; () means all of
    them."""
    types = _layer_types(cfg, kind, n_layers, window)
    every = len(types) == n_layers and all(t == "sliding_attention" for t in types)
    return () if every else types  # (a list of another length: model.ModelConfig refuses it)


def _layer_types(cfg: dict, kind: str, n_layers: int, window):
    if not window:
        return ()
    if cfg.get("layer_types"):
        return tuple(cfg["layer_types"])
    if kind == "qwen2_moe":  # transformers' rule: odd layers below max_window_layers
        first = cfg.get("max_window_layers", 28)
        return tuple(
            "sliding_attention" if (i + 1) % 2 and i < first else "full_attention"
            for i in range(n_layers)
        )
    if kind in ("qwen2", "qwen3"):
        first = cfg.get("max_window_layers", 28)
        return tuple(
            "sliding_attention" if i >= first else "full_attention" for i in range(n_layers)
        )
    if kind in ("gemma2", "gemma3_text", "gpt_oss"):
        every = cfg.get("sliding_window_pattern", 6) if kind == "gemma3_text" else 2
        return tuple(
            "sliding_attention" if (i + 1) % every else "full_attention" for i in range(n_layers)
        )
    return ()


def _config_from_hf(cfg: dict, source) -> ModelConfig:
    _check_architecture(cfg, source)
    cfg = text_config(cfg)
    kind = cfg["model_type"]
    if cfg.get("use_bidirectional_attention"):
        raise CheckpointError(
            f"{source}: use_bidirectional_attention makes an embedding model (EmbeddingGemma), "
            "not one that generates; this project runs causal language models"
        )
    theta, scaling, local_theta = rope_of(cfg, kind)
    heads = cfg["num_attention_heads"]
    head_dim = _head_dim_of(cfg, heads, source)
    partial = (cfg.get("rope_parameters") or {}).get(
        "partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)
    )
    bias = bool(cfg.get("attention_bias", kind == "gpt_oss"))
    windowed = cfg.get("use_sliding_window", False) if kind in QWEN else kind != "llama"
    window = cfg.get("sliding_window") if windowed else None
    if window is not None and (
        not isinstance(window, int) or isinstance(window, bool) or window < 1
    ):
        raise ValueError(f"sliding_window must be a positive integer or null, got {window!r}")
    gemma = kind in ("gemma2", "gemma3_text")
    mlp_act = _mlp_act_of(cfg, gemma, source)
    config = ModelConfig(
        vocab_size=cfg["vocab_size"],
        dim=cfg["hidden_size"],
        n_layers=cfg["num_hidden_layers"],
        n_heads=heads,
        n_kv_heads=1 if kind in DEEPSEEK else cfg.get("num_key_value_heads") or heads,
        intermediate_size=cfg["intermediate_size"],
        head_dim=head_dim,
        norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", gemma)),
        qkv_bias=bias or kind == "qwen2" or (kind == "qwen2_moe" and cfg.get("qkv_bias", True)),
        o_bias=bias,
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        qk_norm=kind in ("qwen3", "qwen3_moe", "gemma3_text"),
        sliding_window=window or 0,
        layer_types=layer_types_of(cfg, kind, cfg["num_hidden_layers"], window),
        rotary_dim=int(head_dim * partial) if partial != 1.0 else 0,
        local_rope_theta=local_theta,
        mlp_act=mlp_act,
        attn_sinks=kind == "gpt_oss",
        **_gemma_switches(cfg, gemma),
        **experts_of(cfg, kind),
    )
    return replace(config, **deepseek_fields(cfg, scaling)) if kind in DEEPSEEK else config


def _check_architecture(cfg: dict, source):
    """A CheckpointError unless config.json's model_type is a family this project runs."""
    if cfg.get("model_type") not in SUPPORTED_HF:
        raise CheckpointError(
            f"{source}: architecture {cfg.get('model_type')!r} ({cfg.get('architectures')}) "
            f"is not a family this project runs (supported model_type: {', '.join(SUPPORTED_HF)})"
        )


def _head_dim_of(cfg: dict, heads: int, source) -> int:
    """`head_dim` if the config gives it (a positive integer), else hidden_size / heads."""
    if cfg.get("head_dim") is not None and not (
        isinstance(cfg["head_dim"], int) and cfg["head_dim"] > 0
    ):
        raise CheckpointError(
            f"{source}: head_dim must be a positive integer, got {cfg['head_dim']!r}"
        )
    return cfg.get("head_dim") or cfg["hidden_size"] // heads


def _mlp_act_of(cfg: dict, gemma: bool, source) -> str:
    """model.py's name of the MLP's activation (HF_ACTIVATIONS), by default GeGLU's for Gemma."""
    act = (
        cfg.get("hidden_activation")
        or cfg.get("hidden_act")
        or ("gelu_pytorch_tanh" if gemma else "silu")
    )
    if act not in HF_ACTIVATIONS:
        raise CheckpointError(
            f"{source}: MLP activation {act!r} is not supported "
            f"(supported: {', '.join(HF_ACTIVATIONS)})"
        )
    return HF_ACTIVATIONS[act]


def _gemma_switches(cfg: dict, gemma: bool) -> dict:
    """ModelConfig's Gemma fields: (1 + w) norms, sqrt(dim) embeddings, sandwich norms, the query
    scale and the soft caps (all off for the other families)."""
    return dict(
        norm_offset=1.0 if gemma else 0.0,
        embed_scale=gemma,
        sandwich_norms=gemma,
        query_scale=cfg.get("query_pre_attn_scalar") or 0.0 if gemma else 0.0,
        attn_softcap=cfg.get("attn_logit_softcapping") or 0.0 if gemma else 0.0,
        logit_softcap=cfg.get("final_logit_softcapping") or 0.0 if gemma else 0.0,
    )


def experts_of(cfg: dict, kind: str) -> dict:
    """ModelConfig's mixture-of-experts fields from Mixtral's and Qwen-MoE's keys ({} for a dense
    model)."""
    if kind == "mixtral":
        return dict(
            moe=MoEConfig(
                cfg.get("num_local_experts", 8),
                cfg.get("num_experts_per_tok", 2),
                cfg["intermediate_size"],
            )
        )
    if (
        kind == "gpt_oss"
    ):  # its router takes top-k of the logits, then a softmax over those k: renormalised
        return dict(
            moe=MoEConfig(
                cfg.get("num_local_experts", 128),
                cfg.get("num_experts_per_tok") or cfg.get("experts_per_token", 4),
                cfg["intermediate_size"],
                norm_topk_prob=True,
                router_bias=True,
                expert_bias=True,
                glu_limit=cfg.get("swiglu_limit", 7.0),
                glu_alpha=cfg.get("swiglu_alpha", 1.702),
            )
        )
    # published Qwen configs say num_experts; transformers 5 writes num_local_experts for Qwen3-MoE
    experts = cfg.get(
        "num_experts", cfg.get("num_local_experts", 60 if kind == "qwen2_moe" else 128)
    )
    if kind not in ("qwen2_moe", "qwen3_moe") or not experts:
        return {}
    n = cfg["num_hidden_layers"]
    step, only = cfg.get("decoder_sparse_step") or 1, set(cfg.get("mlp_only_layers") or ())
    shared = cfg.get("shared_expert_intermediate_size", 5632) if kind == "qwen2_moe" else 0
    return dict(
        moe=MoEConfig(
            experts,
            cfg.get("num_experts_per_tok", 4 if kind == "qwen2_moe" else 8),
            cfg.get("moe_intermediate_size", 1408 if kind == "qwen2_moe" else 768),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            shared_expert_size=shared or 0,
            dense_layers=tuple(i for i in range(n) if i in only or (i + 1) % step),
        )
    )


def hf_tensors(cfg: dict, config: ModelConfig, tensors):
    """(file, name, tensor) in model.py's names: Phi-3's fused projections split, Gemma 3's text
    model taken out of its multimodal checkpoint (the vision tower and projector skipped)."""
    kind = cfg.get("model_type")
    q, kv = config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
    for file, name, t in tensors:
        if kind == "gemma3":
            if not name.startswith("language_model."):
                continue  # vision_tower.*, multi_modal_projector.*
            name = name.removeprefix("language_model.").removeprefix("model.")
        if kind == "gpt_oss" and ".mlp." in name:
            yield from gpt_oss_experts(file, name, t)
        elif kind in DEEPSEEK:
            yield from deepseek_tensors(cfg, config, file, name, t)
        elif kind == "phi3" and name.endswith("self_attn.qkv_proj.weight"):
            _check_rows(file, name, t, q + 2 * kv)
            for part, w in zip(("q_proj", "k_proj", "v_proj"), t.split([q, kv, kv])):
                yield (
                    file,
                    name.replace("qkv_proj", part),
                    w.clone(),
                )  # its own storage: no parameter is a view
        elif kind == "phi3" and name.endswith("mlp.gate_up_proj.weight"):
            _check_rows(file, name, t, 2 * config.intermediate_size)
            for part, w in zip(("gate_proj", "up_proj"), t.chunk(2)):
                yield file, name.replace("gate_up_proj", part), w.clone()
        else:
            yield file, name, t


def gpt_oss_experts(file, name, t):
    """gpt-oss's router (mlp.router) as mlp.gate, and its experts stored as x @ W: gate_up_proj [E,
    dim, 2 ff] with gate and up columns interleaved (and their bias [E, 2 ff]), down_proj [E, ff,
    dim], as moe.py's [E, out, in] projections; MXFP4 blocks and scales pass on to
    formats/hf_quant.py."""
    name = name.replace(".mlp.router.", ".mlp.gate.")
    if (
        name.endswith(("_blocks", "_scales"))
        or not isinstance(t, torch.Tensor)
        or ".experts." not in name
    ):
        yield file, name, t
    elif name.endswith("gate_up_proj") or name.endswith("gate_up_proj_bias"):
        bias = name.endswith("_bias")
        if t.dim() != (2 if bias else 3) or t.shape[-1] % 2:
            raise CheckpointError(
                f"{file}: tensor {name!r} has shape {tuple(t.shape)}, expected "
                f"{'[E, 2 ff]' if bias else '[E, dim, 2 ff]'} (gate and up interleaved)"
            )
        for part, cols in (("gate_proj", t[..., 0::2]), ("up_proj", t[..., 1::2])):
            yield (
                file,
                name.replace("gate_up_proj", part),
                (cols if bias else cols.transpose(1, 2)).contiguous(),
            )
    elif name.endswith("down_proj"):
        if t.dim() != 3:
            raise CheckpointError(
                f"{file}: tensor {name!r} has shape {tuple(t.shape)}, expected [E, ff, dim]"
            )
        yield file, name, t.transpose(1, 2).contiguous()
    else:
        yield file, name, t


MIXTRAL_EXPERT = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def stacked_experts(config: ModelConfig, tensors):
    """(file, name, tensor) with each layer's per-expert weights
    (`mlp.experts.{e}.gate_proj.weight`, Mixtral's `block_sparse_moe.experts.{e}.w1.weight`) stacked
    into moe.py's `mlp.experts.gate_proj` [E, ff, dim] as soon as all E have arrived; transformers'
    own stacked `gate_up_proj` split."""
    pending = {}  # stacked name -> {expert: tensor}
    for file, name, t in tensors:
        name = name.replace(".block_sparse_moe.", ".mlp.")
        parts = name.split(".")
        if (
            len(parts) == 7
            and parts[2:4] == ["mlp", "experts"]
            and parts[4].isdigit()
            and parts[6] == "weight"
        ):
            e, proj = int(parts[4]), MIXTRAL_EXPERT.get(parts[5], parts[5])
            target = ".".join(parts[:4] + [proj])
            if e >= config.moe.n_experts:
                raise CheckpointError(
                    f"{file}: tensor {name!r} is expert {e}, "
                    f"but the config has {config.moe.n_experts} experts"
                )
            group = pending.setdefault(target, {})
            group[e] = t
            if len(group) == config.moe.n_experts:
                yield file, target, _stack(file, target, pending.pop(target))
        elif (
            name.endswith("mlp.experts.gate_up_proj")
            and isinstance(t, torch.Tensor)
            and t.dim() == 3
        ):
            gate, up = t.chunk(2, dim=1)  # transformers' [E, 2 ff, dim]: gate rows, then up rows
            yield file, name.replace("gate_up_proj", "gate_proj"), gate.clone()
            yield file, name.replace("gate_up_proj", "up_proj"), up.clone()
        else:
            yield file, name, t
    # (named with the folder: a sharded one spreads experts over files)
    for target, group in pending.items():
        missing = sorted(set(range(config.moe.n_experts)) - set(group))
        raise CheckpointError(
            f"{Path(file).parent}: {target} is missing experts {missing[:8]} "
            f"of {config.moe.n_experts}"
        )


def _stack(file, target, group: dict) -> torch.Tensor:
    first = group[0]
    for e, t in group.items():
        if not isinstance(t, torch.Tensor) or t.shape != first.shape:
            raise CheckpointError(
                f"{file}: expert {e} of {target} has shape {tuple(getattr(t, 'shape', ()))}, "
                f"expert 0 has {tuple(first.shape)}"
            )
    return torch.stack([group[e] for e in range(len(group))])


def _check_rows(file, name, t, rows):
    if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.shape[0] != rows:
        raise CheckpointError(
            f"{file}: tensor {name!r} has shape {tuple(getattr(t, 'shape', ()))}, "
            f"expected {rows} rows (the fused projections of the config)"
        )
