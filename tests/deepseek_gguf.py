"""A DeepSeek-V2 / V3 HF model written as a GGUF file the way llama.cpp's converter writes its
`deepseek2` architecture (convert_hf_to_gguf.py's DeepseekV2Model): one KV head (the latent), the
latent's sizes as key_length / value_length and the heads' as *_mla, kv_b_proj split per head into
attn_k_b [H, R, N] (transposed) and attn_v_b [H, V, R], HF's rows otherwise unchanged (llama.cpp
rotates deepseek2's pairs interleaved), the correction bias as exp_probs_b.bias, YaRN's
mscale_all_dim as 0.1 x it. For tests/test_deepseek.py."""

from pathlib import Path

import gguf
from helpers import GGUF_NAMES, add_weight, close_gguf, gguf_arrays

NAMES = {
    **GGUF_NAMES,
    "self_attn.q_a_proj": "attn_q_a",
    "self_attn.q_a_layernorm": "attn_q_a_norm",
    "self_attn.q_b_proj": "attn_q_b",
    "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
    "self_attn.kv_a_layernorm": "attn_kv_a_norm",
    "self_attn.kv_b_proj": "attn_kv_b",
    "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
    "mlp.shared_experts.up_proj": "ffn_up_shexp",
    "mlp.shared_experts.down_proj": "ffn_down_shexp",
}


def write_deepseek2(hf, path: Path, qtype="F32", split_kv_b=True, drop=()) -> Path:
    """`hf` as a deepseek2 GGUF; 2-D and 3-D weights in `qtype` where their rows allow it;
    split_kv_b=False keeps one attn_kv_b (files converted before the split); `drop`: metadata keys
    left out."""
    c = hf.config
    w = gguf.GGUFWriter(str(path), "deepseek2")
    for key, value, kind in metadata(c):
        if key not in drop:
            w.add_key_value(f"deepseek2.{key}", value, kind)
    for name, a in gguf_arrays(hf):
        for gname, array in tensors(c, name, a, split_kv_b):
            add_weight(w, gname, array, qtype)  # (attn_v_b [H, V, R] too, where R fills blocks)
    return close_gguf(w, path)


def metadata(c):
    """(key, value, GGUFValueType) as the converter writes them from config.json."""
    U, F, B = gguf.GGUFValueType.UINT32, gguf.GGUFValueType.FLOAT32, gguf.GGUFValueType.BOOL
    R, P = c.kv_lora_rank, c.qk_rope_head_dim
    out = [
        ("block_count", c.num_hidden_layers, U),
        ("context_length", c.max_position_embeddings, U),
        ("embedding_length", c.hidden_size, U),
        ("feed_forward_length", c.intermediate_size, U),
        ("attention.head_count", c.num_attention_heads, U),
        ("attention.head_count_kv", 1, U),
        ("rope.freq_base", c.rope_parameters["rope_theta"], F),
        ("attention.layer_norm_rms_epsilon", c.rms_norm_eps, F),
        ("vocab_size", c.vocab_size, U),
        ("leading_dense_block_count", c.first_k_dense_replace, U),
        ("attention.kv_lora_rank", R, U),
        ("attention.key_length", R + P, U),
        ("attention.value_length", R, U),
        ("attention.key_length_mla", c.qk_nope_head_dim + P, U),
        ("attention.value_length_mla", c.v_head_dim, U),
        ("expert_feed_forward_length", c.moe_intermediate_size, U),
        ("expert_count", c.n_routed_experts, U),
        ("expert_used_count", c.num_experts_per_tok, U),
        ("expert_shared_count", c.n_shared_experts, U),
        ("expert_weights_scale", c.routed_scaling_factor, F),
        ("expert_gating_func", 2 if c.model_type == "deepseek_v3" else 1, U),
        ("expert_group_count", c.n_group, U),
        ("expert_group_used_count", c.topk_group, U),
        ("rope.dimension_count", P, U),
    ]
    out += [("attention.q_lora_rank", c.q_lora_rank, U)] if c.q_lora_rank else []
    out += [("expert_weights_norm", True, B)] if c.norm_topk_prob else []
    rope = c.rope_parameters
    if rope.get("rope_type") == "yarn":
        out += [
            ("rope.scaling.type", "yarn", gguf.GGUFValueType.STRING),
            ("rope.scaling.factor", rope["factor"], F),
            ("rope.scaling.original_context_length", rope["original_max_position_embeddings"], U),
            ("rope.scaling.yarn_beta_fast", rope["beta_fast"], F),
            ("rope.scaling.yarn_beta_slow", rope["beta_slow"], F),
            ("rope.scaling.yarn_log_multiplier", 0.1 * rope["mscale_all_dim"], F),
        ]
    return out


def tensors(c, name: str, a, split_kv_b: bool):
    """[(GGUF name, array)] of one HF tensor."""
    if name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
        short = {"model.embed_tokens.weight": "token_embd", "model.norm.weight": "output_norm"}
        return [(f"{short.get(name, 'output')}.weight", a)]
    parts = name.split(".")
    block = f"blk.{parts[2]}"
    if name.endswith("mlp.gate.e_score_correction_bias"):
        return [(f"{block}.exp_probs_b.bias", a)]
    if name.endswith("kv_b_proj.weight") and split_kv_b:
        H, N, V = c.num_attention_heads, c.qk_nope_head_dim, c.v_head_dim
        kv_b = a.reshape(H, N + V, -1)
        k_b, v_b = kv_b[:, :N].transpose(0, 2, 1), kv_b[:, N:]
        return [(f"{block}.attn_k_b.weight", k_b), (f"{block}.attn_v_b.weight", v_b)]
    return [(f"{block}.{NAMES['.'.join(parts[3:-1])]}.{parts[-1]}", a)]
