"""DeepSeek-V2 / V3 checkpoints (HF folders): their config keys as model.py's switches, and their
tensors in its layout.

    from formats.deepseek import deepseek_fields
    fields = deepseek_fields(json.load(open("DeepSeek-V2-Lite/config.json")))  # mla, moe, ...

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


def deepseek_experts(cfg: dict) -> MoEConfig:
    """moe.MoEConfig from a DeepSeek config.json (model_type deepseek_v2 or deepseek_v3); a key
    the experts need and the config lacks is a CheckpointError naming it."""
    kind = cfg.get("model_type", "deepseek_v2")
    get = {**DEFAULTS.get(kind, DEFAULTS["deepseek_v2"]), **cfg}.get
    for key in ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size"):
        if not isinstance(get(key), int):
            raise CheckpointError(f"config.json: {kind} needs {key} (an integer), got {get(key)!r}")
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
        raise CheckpointError(f"config.json: {e}") from None


def deepseek_fields(cfg: dict, scaling: dict) -> dict:
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
            raise CheckpointError(
                f"config.json: {cfg.get('model_type')} needs {key}, got {value!r}"
            )
    q_rank = cfg.get("q_lora_rank") or 0
    if not isinstance(q_rank, int) or q_rank < 0:
        raise CheckpointError(
            f"config.json: q_lora_rank must be a positive integer or null, got {q_rank!r}"
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
        moe=deepseek_experts(cfg),
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
    m = config.mla
    interleaved = cfg.get("model_type") == "deepseek_v2" or cfg.get("rope_interleave", True)
    if not interleaved or not isinstance(t, torch.Tensor):
        return file, name, t
    P = m.qk_rope_head_dim
    halves = torch.cat((torch.arange(0, P, 2), torch.arange(1, P, 2)))  # new row j: old row
    qk = m.qk_nope_head_dim + P
    if name.endswith(("q_proj.weight", "q_b_proj.weight")) and t.shape[0] == config.n_heads * qk:
        heads = t.reshape(config.n_heads, qk, -1)
        order = torch.cat((torch.arange(m.qk_nope_head_dim), m.qk_nope_head_dim + halves))
        return file, name, heads[:, order].reshape(t.shape).contiguous()
    if ".kv_a_proj_with_mqa." in name and t.dim() and t.shape[0] == m.kv_lora_rank + P:
        order = torch.cat((torch.arange(m.kv_lora_rank), m.kv_lora_rank + halves))
        return file, name, t[order].contiguous()
    return file, name, t
