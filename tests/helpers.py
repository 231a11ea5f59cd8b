"""Builders for test checkpoints: tiny random-weight HF folders of each supported architecture."""

import json
from pathlib import Path

import torch

TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
)

# One entry per architecture the model claims, each exercising its distinguishing switch.
DEEPSEEK = dict(  # MLA sizes (a latent of 32, a rotary key of 8) and four experts in groups of 2
    num_key_value_heads=4,
    kv_lora_rank=32,
    q_lora_rank=None,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    moe_intermediate_size=32,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
    n_group=2,
    topk_group=1,
)
ARCHS = {
    "llama2": dict(model_type="llama", num_key_value_heads=4),  # multi-head attention
    "llama3": dict(
        model_type="llama",
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ),
    "llama3.2": dict(
        model_type="llama",
        tie_word_embeddings=True,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "llama_linear_rope": dict(
        model_type="llama", rope_scaling={"rope_type": "linear", "factor": 4.0}
    ),
    "mistral": dict(model_type="mistral", sliding_window=None),
    "tinyllama_mqa": dict(model_type="llama", num_key_value_heads=1),
    "smollm2": dict(
        model_type="llama",
        hidden_size=48,
        num_attention_heads=3,
        num_key_value_heads=1,
        tie_word_embeddings=True,
        rope_theta=100000.0,
    ),
    "qwen2": dict(model_type="qwen2", tie_word_embeddings=True, rope_theta=1000000.0),
    "qwen3": dict(
        model_type="qwen3", head_dim=32
    ),  # head_dim != hidden / heads, RMSNorm on q and k
    "llama_bias": dict(model_type="llama", attention_bias=True, mlp_bias=True),
    # sliding windows shorter than the tests' prompts, and RoPE stretched past the original context
    "mistral_window": dict(model_type="mistral", sliding_window=8),
    "qwen2_windows": dict(
        model_type="qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=1
    ),
    "qwen2_yarn": dict(
        model_type="qwen2",
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    ),
    "llama_dynamic": dict(
        model_type="llama",
        max_position_embeddings=32,
        rope_scaling={"rope_type": "dynamic", "factor": 2.0},
    ),
    "phi3_longrope": dict(
        model_type="phi3",
        pad_token_id=0,
        max_position_embeddings=128,
        original_max_position_embeddings=32,
        partial_rotary_factor=0.5,
        sliding_window=None,
        rope_scaling={
            "rope_type": "longrope",
            "short_factor": [1.0, 1.1, 1.3, 1.6],
            "long_factor": [1.0, 2.5, 6.0, 11.0],
        },
    ),
    # small soft caps, so that tanh bends the scores and logits of these tiny random models
    "gemma2": dict(
        model_type="gemma2",
        head_dim=16,
        query_pre_attn_scalar=24,
        sliding_window=8,
        attn_logit_softcapping=2.0,
        final_logit_softcapping=3.0,
    ),
    "gemma3": dict(
        model_type="gemma3_text",
        head_dim=16,
        query_pre_attn_scalar=24,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
        },
    ),
    # mixtures of experts: few experts, so every token's choice matters; one dense layer in
    # Qwen2-MoE
    "mixtral": dict(
        model_type="mixtral", num_local_experts=4, num_experts_per_tok=2, intermediate_size=32
    ),
    "qwen2_moe": dict(
        model_type="qwen2_moe",
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        norm_topk_prob=False,
        mlp_only_layers=[1],
    ),
    "qwen3_moe": dict(
        model_type="qwen3_moe",
        num_experts=8,
        num_experts_per_tok=3,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        head_dim=32,
    ),
    # latent attention (q through one projection, or a low-rank one with its norm), routed and
    # shared experts after a dense first layer; V2's group-limited softmax router, V3's sigmoid one
    # with a correction bias, and YaRN with DeepSeek's mscale in the softmax
    "deepseek_v2": dict(model_type="deepseek_v2", **DEEPSEEK, topk_method="group_limited_greedy"),
    "deepseek_v2_q_lora": dict(model_type="deepseek_v2", **{**DEEPSEEK, "q_lora_rank": 24}),
    "deepseek_v3": dict(
        model_type="deepseek_v3",
        **{**DEEPSEEK, "q_lora_rank": 24},
        norm_topk_prob=True,
        rope_parameters={
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "rope_theta": 10000.0,
        },
    ),
    # sinks, biases everywhere, a clamped SwiGLU that bites (limit 1.5), windows of 8 on every other
    # layer, YaRN
    "gpt_oss": dict(
        model_type="gpt_oss",
        num_local_experts=4,
        num_experts_per_tok=2,
        intermediate_size=32,
        head_dim=16,
        sliding_window=8,
        swiglu_limit=1.5,
        rope_parameters={
            "rope_type": "yarn",
            "factor": 4.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 64,
            "rope_theta": 150000.0,
        },
    ),
}


def hf_model(arch: str, seed: int = 0, **sizes):
    """A random HF transformers model of a tiny `arch` config, with every weight perturbed."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = {**TINY, **ARCHS[arch], **sizes}
    config = AutoConfig.for_model(kw.pop("model_type"), **kw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():  # norms around 1, everything else around 0
            p.copy_((1.0 if "norm" in name else 0.0) + 0.2 * torch.randn_like(p))
        for name, b in model.named_buffers():  # DeepSeek-V3's router bias: one that moves choices
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn_like(b))
    return model.eval()


def save_hf(model, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def to_classic_config(folder: Path):
    """Rewrite config.json from the newer `rope_parameters` form to `rope_theta` +
    `rope_scaling`."""
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    rope = cfg.pop("rope_parameters")
    if "full_attention" in rope:  # Gemma 3: the sliding layers' base was rope_local_base_freq
        cfg["rope_local_base_freq"] = rope["sliding_attention"]["rope_theta"]
        rope = rope["full_attention"]
    cfg["rope_theta"] = rope.pop("rope_theta")
    cfg["rope_scaling"] = None if rope.get("rope_type") == "default" else rope
    path.write_text(json.dumps(cfg))


def hf_reference_embedded():
    from transformers import AutoModelForCausalLM

    from formats import weights

    path = weights.default_checkpoint()
    return AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()


def llama_cpp_permute(w, n_heads):
    """llama.cpp's converter: each head's Q/K rows reordered from (2, D/2) to (D/2, 2) pairs."""
    return (
        w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


GGUF_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "self_attn.qkv_proj": "attn_qkv",
    "mlp.gate_up_proj": "ffn_up",  # Phi-3's fused layers
    # experts (llama.cpp's names): the router, each projection stacked [E, out, in], Qwen2-MoE's
    # shared expert
    "mlp.gate": "ffn_gate_inp",
    "mlp.experts.gate_proj": "ffn_gate_exps",
    "mlp.experts.up_proj": "ffn_up_exps",
    "mlp.experts.down_proj": "ffn_down_exps",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.router": "ffn_gate_inp",
    "self_attn.sinks": "attn_sinks",  # gpt-oss
}
GEMMA_GGUF_NAMES = {
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}


def write_family_metadata(w, hf, arch):
    """What llama.cpp's converter writes for Gemma 2 / 3 and Phi-3 besides the Llama keys."""
    import numpy as np

    c = hf.config
    if getattr(c, "sliding_window", None):
        w.add_sliding_window(c.sliding_window)
    if arch in ("gemma2", "gemma3"):
        w.add_sliding_window_pattern([t == "sliding_attention" for t in c.layer_types])
    if arch == "gemma2":
        w.add_float32("gemma2.attn_logit_softcapping", c.attn_logit_softcapping)
        w.add_float32("gemma2.final_logit_softcapping", c.final_logit_softcapping)
    if arch == "gemma3":
        full = c.rope_parameters["full_attention"]
        w.add_rope_freq_base_swa(c.rope_parameters["sliding_attention"]["rope_theta"])
        if full.get("rope_type") == "linear":
            w.add_rope_scaling_type(__import__("gguf").RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(full["factor"])
    experts = getattr(c, "num_local_experts", None) or getattr(c, "num_experts", None)
    if experts:  # Mixtral (arch llama), qwen2moe, qwen3moe
        w.add_expert_count(experts)
        w.add_expert_used_count(c.num_experts_per_tok)
        if hasattr(c, "moe_intermediate_size") or c.model_type == "gpt_oss":
            w.add_expert_feed_forward_length(
                getattr(c, "moe_intermediate_size", c.intermediate_size)
            )
        if getattr(c, "shared_expert_intermediate_size", None):
            w.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    if c.rope_parameters.get("rope_type") == "yarn":  # Qwen2.5 / Qwen3 long-context files
        w.add_rope_scaling_type(__import__("gguf").RopeScalingType.YARN)
        w.add_rope_scaling_factor(c.rope_parameters["factor"])
        w.add_rope_scaling_orig_ctx_len(c.rope_parameters["original_max_position_embeddings"])
        if "beta_fast" in c.rope_parameters:
            w.add_rope_scaling_yarn_beta_fast(c.rope_parameters["beta_fast"])
            w.add_rope_scaling_yarn_beta_slow(c.rope_parameters["beta_slow"])
    if arch == "phi3":
        rope = c.rope_parameters
        head_dim = c.hidden_size // c.num_attention_heads
        w.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], dtype=np.float32))
        w.add_tensor(
            "rope_factors_short.weight", np.asarray(rope["short_factor"], dtype=np.float32)
        )


def gguf_arrays(hf):
    """(HF name, float32 array) of each tensor, as llama.cpp's converter lays experts out:
    transformers' stacked gate_up_proj [E, 2 ff, dim] split into ffn_gate_exps and ffn_up_exps, the
    shared expert's gate [1, dim] stored as [dim]. (Names end in .weight, so that the layer name is
    all but the last part.)"""
    import numpy as np

    for name, t in hf.state_dict().items():
        a = t.float().numpy()
        if (
            hf.config.model_type == "gpt_oss"
        ):  # x @ W, gate and up interleaved: as the others, [E, out, in]
            stem, _, leaf = name.rpartition(".")
            if leaf in ("gate_up_proj", "gate_up_proj_bias"):
                suffix = "bias" if leaf.endswith("_bias") else "weight"
                for part, cols in (("gate_proj", a[..., 0::2]), ("up_proj", a[..., 1::2])):
                    yield (
                        f"{stem}.{part}.{suffix}",
                        np.ascontiguousarray(cols if suffix == "bias" else cols.transpose(0, 2, 1)),
                    )
                continue
            if leaf == "down_proj" and "experts" in stem:
                yield f"{name}.weight", np.ascontiguousarray(a.transpose(0, 2, 1))
                continue
            if leaf in ("down_proj_bias", "sinks"):
                yield (
                    (f"{stem}.down_proj.bias" if leaf == "down_proj_bias" else f"{name}.weight"),
                    a,
                )
                continue
        if name.endswith("mlp.experts.gate_up_proj"):
            gate, up = np.split(a, 2, axis=1)
            yield name.replace("gate_up_proj", "gate_proj.weight"), gate
            yield name.replace("gate_up_proj", "up_proj.weight"), up
        elif name.endswith("mlp.experts.down_proj"):
            yield name + ".weight", a
        else:
            yield name, a[0] if name.endswith("shared_expert_gate.weight") else a


def prefill_then_decode(model, x, prefill: int):
    """Logits [1, T, V] of x [1, T] through a static cache: its first `prefill` tokens at once,
    then one token a step (what a twin's whole-sequence logits are compared with)."""
    from kv_cache import StaticKVCache

    cache = StaticKVCache.for_model(model, 1, x.shape[1] + 8)
    with torch.no_grad():
        out = [model(x[:, :prefill], torch.arange(prefill)[None], cache)]
        out += [
            model(x[:, t : t + 1], torch.full((1, 1), t), cache) for t in range(prefill, x.shape[1])
        ]
    return torch.cat(out, 1)


def write_gguf(hf, path: Path, arch="llama", qtype="F32", raw_blocks=None, pooling_type=None):
    """Write an HF model as a GGUF file the way llama.cpp's converter lays it out.

    2-D weights get `qtype` (quantized with gguf.quants); `raw_blocks` maps a GGUF tensor name to
    (quantization type, raw block bytes) to store verbatim instead (for types gguf cannot
    encode); pooling_type: an embedding model's (gguf.PoolingType)."""
    import gguf
    import numpy as np

    c = hf.config
    w = gguf.GGUFWriter(str(path), arch)
    if pooling_type is not None:
        w.add_pooling_type(pooling_type)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    if arch != "phi3":  # llama.cpp's Phi-3 converter writes rope.dimension_count but no key_length
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    rope = c.rope_parameters.get(
        "full_attention", c.rope_parameters
    )  # (Gemma 3 nests it per layer type)
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    write_family_metadata(w, hf, arch)
    if (
        c.rope_parameters.get("rope_type") == "llama3"
    ):  # as llama.cpp: divisors of each pair's speed
        d = head_dim
        plain = 1.0 / (c.rope_parameters["rope_theta"] ** (torch.arange(0, d, 2).float() / d))
        w.add_tensor(
            "rope_freqs.weight", (plain / hf.model.rotary_emb.inv_freq).numpy().astype(np.float32)
        )
    for name, a in gguf_arrays(hf):
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        parts = name.split(".")
        if parts[0] == "model" and parts[1] == "layers":
            sub = ".".join(parts[3:-1])
            names = {**GGUF_NAMES, **GEMMA_GGUF_NAMES} if arch.startswith("gemma") else GGUF_NAMES
            gname = f"blk.{parts[2]}.{names[sub]}.{parts[-1]}"
        else:
            gname = {
                "model.embed_tokens.weight": "token_embd.weight",
                "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight",
            }[name]
        if arch == "gpt-oss":  # its pre-MLP norm is llama.cpp's post_attention_norm
            gname = gname.replace(".ffn_norm.", ".post_attention_norm.")
        if arch.startswith("gemma") and gname.endswith("norm.weight"):
            a = a + 1  # llama.cpp's converter stores Gemma's norms as 1 + w
        if arch == "llama" and gname.endswith(("attn_q.weight", "attn_k.weight")):
            heads = c.num_attention_heads if "attn_q" in gname else c.num_key_value_heads
            a = llama_cpp_permute(a, heads)
        if raw_blocks and gname in raw_blocks:
            kind, blocks = raw_blocks[gname]
            w.add_tensor(gname, blocks, raw_dtype=getattr(gguf.GGMLQuantizationType, kind))
        else:
            add_weight(w, gname, a, qtype)
    return close_gguf(w, path)


def add_weight(w, gname: str, a, qtype: str):
    """One tensor into a gguf.GGUFWriter as llama.cpp's quantizer leaves it: a 2-D or 3-D weight
    in `qtype` where its rows hold whole blocks (routers stay float), anything else float32."""
    import gguf
    import numpy as np

    kind = getattr(gguf.GGMLQuantizationType, qtype)
    if (
        a.ndim in (2, 3)
        and qtype != "F32"
        and "ffn_gate_inp" not in gname
        and a.shape[-1] % gguf.GGML_QUANT_SIZES[kind][0] == 0
    ):
        w.add_tensor(gname, gguf.quants.quantize(a, kind), raw_dtype=kind)
    else:
        w.add_tensor(gname, np.ascontiguousarray(a, dtype=np.float32))


def close_gguf(w, path: Path) -> Path:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# gpt-oss's reply format (server/harmony.py) in a template of our own: its markers, a dated system
# message
HARMONY_SPECIAL = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>")
HARMONY_TEMPLATE = (
    "<|start|>system<|message|>Knowledge cutoff: 2024-06\n"
    "Current date: {{ strftime_now('%Y-%m-%d') }}\n\n"
    "Reasoning: {{ reasoning_effort | default('medium') }}\n\n"
    "# Valid channels: analysis, commentary, final.<|end|>"
    "{% if tools %}<|start|>developer<|message|># Tools\n"
    "{% for t in tools %}{{ t.function.name }}\n{% endfor %}<|end|>"
    "{% endif %}{% for m in messages %}{% if m.role == 'user' %}"
    "<|start|>user<|message|>{{ m.content }}<|end|>"
    "{% elif m.role == 'assistant' %}"
    "<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)


def tiny_checkpoint(
    folder: Path,
    arch="smollm2",
    max_position_embeddings=256,
    special=(),
    chat_template=None,
    **sizes,
) -> Path:
    """A complete tiny checkpoint folder: random weights plus a byte-level BPE tokenizer.json
    trained here (with `special` tokens after the three it always has), a chat template and an EOS
    token, so generate.py runs on it end to end."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoConfig, AutoModelForCausalLM

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>", *special],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(
        ["hello world, the quick brown fox jumps over the lazy dog"] * 10, trainer
    )
    kw = {
        **TINY,
        **ARCHS[arch],
        "vocab_size": tok.get_vocab_size(),
        "max_position_embeddings": max_position_embeddings,
        "eos_token_id": 2,
        "bos_token_id": 1,
        **sizes,
    }
    config = AutoConfig.for_model(kw.pop("model_type"), **kw)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((1.0 if "norm" in name else 0.0) + 0.2 * torch.randn_like(p))
    save_hf(model, folder)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|im_end|>", "chat_template": chat_template or CHAT_TEMPLATE})
    )
    return folder


def check_allocator(a):
    """paged.BlockAllocator's invariants: counts agree with states, nothing is in two states."""
    assert a.ref[0] == 0 and 0 not in a.free and 0 not in a.hash_of, "block 0 is the null block"
    assert all(r >= 0 for r in a.ref)
    free = set(a.free)
    assert len(free) == len(a.free), "a block is free twice"
    assert not free & set(a.hash_of), "a free block is also cached"
    assert all(a.ref[b] == 0 for b in free), "a free block is referenced"
    assert a.num_cached_unused == sum(1 for b in a.hash_of if a.ref[b] == 0)
    for b, p in a.parent.items():
        assert p is None or p in a.hash_of, "a cached block's parent is not cached"
    for b in range(1, a.num_blocks):
        n = sum(1 for p in a.parent.values() if p == b)
        assert a.children[b] == n, f"block {b}: children count {a.children[b]} != {n}"
    accounted = (
        len(free)
        + len(a.hash_of)
        + sum(1 for b in range(a.num_blocks) if a.ref[b] > 0 and b not in a.hash_of)
    )
    assert accounted == a.num_blocks - 1, "a block is lost"


def run_to_end(engine) -> dict:
    """Step an engine until nothing is left: {request id: its Request} from the Finished events."""
    from engine import Finished

    done = {}
    while engine.has_unfinished():
        done.update((e.request_id, e.request) for e in engine.step() if isinstance(e, Finished))
    return done


def linear_coverage(model) -> float:
    """Fraction of the decoder layers' linear weight elements that are quantized (head aside)."""
    from torch import nn

    from quantize import Int4Linear, Int8Linear

    done = total = 0
    for m in model.layers.modules():
        if isinstance(m, (nn.Linear, Int8Linear, Int4Linear)):
            n = m.out_features * m.in_features
            total += n
            done += n if not isinstance(m, nn.Linear) else 0
    return done / total


def alone(model, prompt, n_new):
    """The engine's slow twin: one request, a static cache, generate.py's loop, greedy."""
    import generate
    from kv_cache import StaticKVCache
    from sampling import SamplingParams

    cache = StaticKVCache.for_model(model, 1, len(prompt) + n_new)
    rows, _ = generate.generate(
        model,
        cache,
        torch.tensor([prompt]),
        n_new,
        SamplingParams(0.0),
        generate.DecodeOptions(ignore_eos=True),
    )
    return rows[0]
