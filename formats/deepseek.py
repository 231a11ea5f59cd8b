"""DeepSeek-V2 / V3 checkpoints (HF folders): their config keys as model.py's switches, and their
tensors in its layout.

    from formats.deepseek import deepseek_fields
    fields = deepseek_fields(json.load(open("DeepSeek-V2-Lite/config.json")), {})  # mla, moe, ..

Attention is multi-head latent attention (model.MLAttention, MLAConfig): the cache keeps one
latent "head" of kv_lora_rank + qk_rope_head_dim values per token. Its rotary dims are stored
with pairs interleaved (x[2i], x[2i + 1]), where model.py rotates (x[i], x[i + P/2]): those rows of
q and of the rotary key are reordered here (the dot product of q and k does not change), unless a
V3 config says rope_interleave false. YaRN's mscale_all_dim enters the softmax scale squared.

The experts: routed ones beside shared experts that every token passes through, added without a
gate; the first `first_k_dense_replace` layers (and, every `moe_layer_freq`, the layers between)
keep a dense MLP. The router is V2's (softmax scores, greedy or group-limited choice) or V3's
(sigmoid scores with a correction bias for the choice, "noaux_tc"); moe.py holds both.
"""

import math

import torch

from model import MLAConfig
from moe import MoEConfig
from runtime import CheckpointError

KINDS = ("deepseek_v2", "deepseek_v3")
MLA_KEYS = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
# the published defaults of keys a config may leave out (DeepSeek-V2's, then V3's where they part)
DEFAULTS = {
    "deepseek_v2": dict(
        scoring_func="softmax",
        topk_method="greedy",
        norm_topk_prob=False,
        routed_scaling_factor=1.0,
    ),
    "deepseek_v3": dict(
        scoring_func="sigmoid",
        topk_method="noaux_tc",
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
    ),
}


def deepseek_experts(cfg: dict, source: str = "config.json") -> MoEConfig:
    """moe.MoEConfig from a DeepSeek config.json (model_type deepseek_v2 or deepseek_v3); a key
    the experts need and the config lacks is a CheckpointError naming it."""
    kind = cfg.get("model_type", "deepseek_v2")
    get = {**DEFAULTS.get(kind, DEFAULTS["deepseek_v2"]), **cfg}.get
    for key in ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size"):
        if not isinstance(get(key), int):
            raise CheckpointError(f"{source}: {kind} needs {key} (an integer), got {get(key)!r}")
    n, first, freq = (
        cfg["num_hidden_layers"],
        get("first_k_dense_replace") or 0,
        get("moe_layer_freq") or 1,
    )
    try:
        return MoEConfig(
            get("n_routed_experts"),
            get("num_experts_per_tok"),
            get("moe_intermediate_size"),
            norm_topk_prob=bool(get("norm_topk_prob")),
            shared_expert_size=(get("n_shared_experts") or 0) * get("moe_intermediate_size"),
            dense_layers=tuple(i for i in range(n) if i < first or i % freq),
            shared_expert_gate=False,
            scoring=get("scoring_func"),
            topk_method=get("topk_method"),
            n_group=get("n_group") or 1,
            topk_group=get("topk_group") or 1,
            routed_scaling_factor=float(get("routed_scaling_factor")),
            correction_bias=get("topk_method") == "noaux_tc",
            router_fp32=True,
        )
    except ValueError as e:  # an unknown router, or groups that cannot hold k experts
        raise CheckpointError(f"{source}: {e}") from None


def deepseek_fields(cfg: dict, scaling: dict, source: str = "config.json") -> dict:
    """ModelConfig's fields that DeepSeek's keys set (over those of a Llama-like reading): the
    latent attention (one latent "head" per token, n_kv_heads 1), its rotary dims, the experts.
    scaling: the RoPE scaling read from the config (YaRN's mscale_all_dim scales the softmax)."""
    if cfg.get("quantization_config"):
        raise CheckpointError(
            f"config.json: a quantized {cfg['model_type']} folder (quantization_config) is not "
            "read yet; load its float original, with --quantize int8 or int4 if you like"
        )
    for key in MLA_KEYS:
        value = cfg.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise CheckpointError(f"{source}: {cfg.get('model_type')} needs {key}, got {value!r}")
    q_rank = cfg.get("q_lora_rank") or 0
    if not isinstance(q_rank, int) or q_rank < 0:
        raise CheckpointError(
            f"{source}: q_lora_rank must be a positive integer or null, got {q_rank!r}"
        )
    qk = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    scale = qk**-0.5
    if scaling.get("mscale_all_dim") and (scaling.get("factor") or 1) > 1:
        scale *= (0.1 * scaling["mscale_all_dim"] * math.log(scaling["factor"]) + 1.0) ** 2
    mla = MLAConfig(
        cfg["kv_lora_rank"],
        cfg["qk_nope_head_dim"],
        cfg["qk_rope_head_dim"],
        cfg["v_head_dim"],
        q_rank,
        scale,
    )
    return dict(
        mla=mla,
        n_kv_heads=1,
        head_dim=mla.kv_lora_rank + mla.qk_rope_head_dim,
        rotary_dim=mla.qk_rope_head_dim,
        moe=deepseek_experts(cfg, source),
    )


def deepseek_tensors(cfg: dict, config, file, name: str, t):
    """[(file, name, tensor)] in model.py's names: shared_experts as shared_expert, the rotary rows
    of q (every head's last qk_rope_head_dim) and of the rotary key (kv_a_proj_with_mqa's last
    ones) from interleaved pairs to halves; V3's multi-token-prediction layers (numbered from
    num_hidden_layers on) left out, as transformers leaves them."""
    parts = name.split(".") + [""]
    layer = parts[parts.index("layers") + 1] if "layers" in parts else ""
    if layer.isdigit() and int(layer) >= config.n_layers:
        return []
    return [_renamed(cfg, config, file, name, t)]


def _renamed(cfg: dict, config, file, name: str, t):
    name = name.replace(".mlp.shared_experts.", ".mlp.shared_expert.")
    interleaved = cfg.get("model_type") == "deepseek_v2" or cfg.get("rope_interleave", True)
    if not interleaved or not isinstance(t, torch.Tensor):
        return file, name, t
    order = rope_rows(config, name, t.shape[0] if t.dim() else 0)
    return file, name, t if order is None else t[order].contiguous()


def rope_rows(config, name: str, rows: int):
    """The row order that turns a tensor's interleaved rotary rows into halves (new row j: old row
    order[j]), for q_proj / q_b_proj (each head's last P rows) and kv_a_proj_with_mqa (its last P);
    None for other tensors."""
    m = config.mla
    P = m.qk_rope_head_dim
    halves = torch.cat((torch.arange(0, P, 2), torch.arange(1, P, 2)))
    qk = m.qk_nope_head_dim + P
    if name.endswith(("q_proj.weight", "q_b_proj.weight")) and rows == config.n_heads * qk:
        head = torch.cat((torch.arange(m.qk_nope_head_dim), m.qk_nope_head_dim + halves))
        return (torch.arange(config.n_heads)[:, None] * qk + head).reshape(-1)
    if ".kv_a_proj_with_mqa." in name and rows == m.kv_lora_rank + P:
        return torch.cat((torch.arange(m.kv_lora_rank), m.kv_lora_rank + halves))
    return None


# llama.cpp's deepseek2 tensors (after "blk.N.") -> model.py's (formats/gguf_weights.py)
GGUF_LAYER_NAMES = {
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",  # (files converted before the split below)
    "attn_k_b": "self_attn.k_b",  # kv_b_proj's K rows per head, transposed: [H, R, N]
    "attn_v_b": "self_attn.v_b",  # its V rows per head: [H, V, R]
    "exp_probs_b": "mlp.gate.e_score_correction",  # V3's correction bias (".bias")
}


def gguf_cfg(get, opt, has_bias: bool) -> dict:
    """The config.json keys deepseek_fields reads, from a deepseek2 GGUF's metadata as llama.cpp's
    converter writes it: get(key) for the keys it always writes (a CheckpointError names a missing
    one), opt(key, default) for the others. The router is not named in the file: V3's sigmoid
    (expert_gating_func 2) with its correction bias chooses by noaux_tc, V2's softmax by
    group-limited greedy where the experts are grouped, else greedy; the MLA sizes are
    key_length_mla and value_length_mla (key_length and value_length in files from before them)."""
    rope = get("rope.dimension_count")
    gating, groups = opt("expert_gating_func", 1), opt("expert_group_count", 1) or 1
    return dict(
        model_type="deepseek_v3" if gating == 2 else "deepseek_v2",
        num_hidden_layers=get("block_count"),
        kv_lora_rank=get("attention.kv_lora_rank"),
        q_lora_rank=opt("attention.q_lora_rank", 0),
        qk_rope_head_dim=rope,
        qk_nope_head_dim=(opt("attention.key_length_mla") or get("attention.key_length")) - rope,
        v_head_dim=opt("attention.value_length_mla") or get("attention.value_length"),
        n_routed_experts=get("expert_count"),
        num_experts_per_tok=get("expert_used_count"),
        moe_intermediate_size=get("expert_feed_forward_length"),
        n_shared_experts=opt("expert_shared_count", 0),
        first_k_dense_replace=opt("leading_dense_block_count", 0),
        scoring_func={1: "softmax", 2: "sigmoid"}.get(gating, f"expert_gating_func {gating}"),
        topk_method="noaux_tc" if has_bias else "group_limited_greedy" if groups > 1 else "greedy",
        n_group=groups,
        topk_group=opt("expert_group_used_count", 1) or 1,
        norm_topk_prob=bool(opt("expert_weights_norm", False)),
        routed_scaling_factor=opt("expert_weights_scale", 1.0) or 1.0,
    )


def gguf_tensors(config, items, path):
    """llama.cpp's deepseek2 tensors (file, name, tensor) in model.py's layout: attn_k_b and
    attn_v_b joined back into kv_b_proj (kept float: MLAttention reads it as a matrix), the
    correction bias renamed, the rotary rows of q and of the rotary key from interleaved pairs to
    halves (llama.cpp rotates deepseek2's pairs interleaved and stores HF's rows unchanged)."""
    halves, joined = {}, set()  # layer -> the first of its k_b, v_b; layers given kv_b_proj
    for file, name, w in items:
        if name.endswith(".e_score_correction.bias"):
            name = name.replace(".e_score_correction.bias", ".e_score_correction_bias")
        if name.endswith(("self_attn.k_b.weight", "self_attn.v_b.weight")):
            stem = name.rsplit(".", 2)[0]
            if stem not in halves:
                halves[stem] = (name, w)
                continue
            w = _kv_b(config, dict([halves.pop(stem), (name, w)]), path)
            name = f"{stem}.kv_b_proj.weight"
        elif name.endswith("kv_b_proj.weight") and not isinstance(w, torch.Tensor):
            w = w.dequantize()
        if name.endswith("kv_b_proj.weight"):  # (a file with both forms: the first one kept)
            if name in joined:
                continue
            joined.add(name)
        order = rope_rows(config, name, w.shape[0])
        if order is not None:
            w = w[order].contiguous() if isinstance(w, torch.Tensor) else w.rows(order)
        yield file, name, w
    if halves:
        raise CheckpointError(f"{path}: {next(iter(halves.values()))[0]} has no other half")


def _kv_b(config, pair: dict, path) -> torch.Tensor:
    """kv_b_proj [H * (N + V), R] from attn_k_b [H, R, N] and attn_v_b [H, V, R]."""
    m, H = config.mla, config.n_heads
    R, N, V = m.kv_lora_rank, m.qk_nope_head_dim, m.v_head_dim
    for name, w in pair.items():
        want = (H, R, N) if name.endswith("k_b.weight") else (H, V, R)
        if tuple(w.shape) != want:
            layer, half = name.split(".")[1], "k_b" if name.endswith("k_b.weight") else "v_b"
            raise CheckpointError(
                f"{path}: tensor blk.{layer}.attn_{half}.weight has shape {list(w.shape)}, "
                f"expected {list(want)} for the file's {H} heads, kv_lora_rank {R}, "
                f"qk_nope_head_dim {N} and v_head_dim {V}"
            )
    k_b, v_b = (
        next(w for n, w in pair.items() if n.endswith(h)) for h in ("k_b.weight", "v_b.weight")
    )
    return torch.cat((k_b.transpose(1, 2), v_b), dim=1).reshape(H * (N + V), R).contiguous()
