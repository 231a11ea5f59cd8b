"""The Llama-family transformer, written to be read top to bottom.

One decoder-only architecture covers Llama 2, Llama 3 / 3.1 / 3.2, Mistral (without sliding
window), TinyLlama, SmolLM2, Qwen2 / Qwen2.5 and Qwen3. They differ only in a few switches, all
in `ModelConfig`: grouped-query attention (n_kv_heads < n_heads), a head_dim that need not be
dim / n_heads, bias on q/k/v (Qwen2), RMSNorm on q and k per head (Qwen3), a tied or untied
output head, and how RoPE frequencies are scaled (`llama3`, `linear`).

The model never knows how K and V are stored. Each attention layer projects q, k, v, rotates q
and k by RoPE at `input_pos`, and hands them to the cache:

    logits = model(tokens[B, T], input_pos[B, T], cache)
    y = cache.attend(layer, q[B, T, H, D], k[B, T, Hkv, D], v[B, T, Hkv, D], input_pos[B, T])

The positions are the only per-step fact the model passes along; anything else a cache needs
(block tables) its caller writes into the cache before the forward. kv_cache.py
holds the static cache; paged.py the paged one.

Parameter names follow Hugging Face's Llama layout without the leading "model." (so an HF
checkpoint loads by name); weights.py turns every checkpoint format into this layout.
Run `python generate.py` to see it write text; tests/test_model.py checks it against HF.
"""
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class ModelConfig:
    vocab_size: int
    dim: int  # hidden size
    n_layers: int
    n_heads: int
    n_kv_heads: int
    intermediate_size: int  # FFN hidden size
    head_dim: int = 0  # 0: dim // n_heads
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict = field(default_factory=dict)  # {} or {"rope_type": "llama3", ...}
    max_position_embeddings: int = 4096  # the model's context
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2
    o_bias: bool = False  # Llama's attention_bias puts a bias on o_proj too
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k, before RoPE
    sliding_window: int = 0  # Mistral; 0: none. Not implemented: contexts must fit inside it.

    def __post_init__(self):
        if self.head_dim == 0:
            self.head_dim = self.dim // self.n_heads
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Per-pair rotation speeds [head_dim/2], with the checkpoint's frequency scaling applied.
    Computed on the CPU whatever the default device (on meta tensors this arithmetic would import
    the compiler stack); the caller moves it."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64, device="cpu").float() / d))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":  # positions divided by `factor`
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between
        # low_freq_factor and high_freq_factor interpolated smoothly.
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_context = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
        smooth = (old_context / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_context / high) & (wavelen <= old_context / low)
        return torch.where(medium, smoothed, scaled)
    if kind == "freq_factors":  # GGUF's rope_freqs.weight: one divisor per pair, precomputed
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32, device="cpu")
    raise ValueError(f"RoPE scaling type {kind!r} is not supported (supported: default, linear, llama3)")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    # Hugging Face's RoPE layout: the pairs are (x[i], x[i + D/2]), not adjacent elements.
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [B, T, H, D]; cos, sin [B, T, D] -> broadcast over heads
    return x * cos[:, :, None, :] + rotate_half(x) * sin[:, :, None, :]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32, then scale in the input dtype, as the reference does.
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer  # index the cache uses to find this layer's K/V
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
        self.q_proj = nn.Linear(config.dim, config.n_heads * config.head_dim, bias=config.qkv_bias)
        self.k_proj = nn.Linear(config.dim, config.n_kv_heads * config.head_dim, bias=config.qkv_bias)
        self.v_proj = nn.Linear(config.dim, config.n_kv_heads * config.head_dim, bias=config.qkv_bias)
        self.o_proj = nn.Linear(config.n_heads * config.head_dim, config.dim, bias=config.o_bias)
        self.qkv_proj = None  # fuse_layers.py may replace q/k/v by one layer with their rows stacked
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x, cos, sin, input_pos, cache):
        B, T, _ = x.shape
        if self.qkv_proj is not None:
            kv = self.n_kv_heads * self.head_dim
            q, k, v = self.qkv_proj(x).split([self.n_heads * self.head_dim, kv, kv], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(B, T, self.n_heads, self.head_dim)  # [B, T, H, D]
        k = k.view(B, T, self.n_kv_heads, self.head_dim)  # [B, T, Hkv, D]
        v = v.view(B, T, self.n_kv_heads, self.head_dim)  # [B, T, Hkv, D]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = cache.attend(self.layer, q, k, v, input_pos)  # [B, T, H, D]
        return self.o_proj(y.reshape(B, T, self.n_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.dim, config.intermediate_size, bias=config.mlp_bias)
        self.up_proj = nn.Linear(config.dim, config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.dim, bias=config.mlp_bias)
        self.gate_up_proj = None  # or gate and up stacked in one layer (fuse_layers.py)

    def forward(self, x):
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.dim, config.norm_eps)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.dim, config.norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, input_pos, cache):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, input_pos, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.lm_head = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # Not a parameter: rebuilt from config wherever the model is created, never loaded.
        self.register_buffer("inv_freq", rope_inv_freq(config).to(self.norm.weight.device), persistent=False)

    def rope(self, input_pos: torch.Tensor):
        # input_pos [B, T] -> cos, sin [B, T, D], computed in float32 then cast like the reference
        freqs = input_pos[..., None].float() * self.inv_freq  # [B, T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [B, T, D]
        dtype = self.norm.weight.dtype  # the activations' dtype (the embedding may be int8)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(self, tokens, input_pos, cache, last_only: bool = False, keep=None):
        """tokens, input_pos [B, T] -> logits [B, T, vocab] (or [B, 1, vocab] if last_only, or
        [B, len(keep), vocab] for the positions `keep` [n] along T, e.g. each sequence's last token
        in a flattened batch)."""
        x = self.embed_tokens(tokens)  # [B, T, dim]
        cos, sin = self.rope(input_pos)
        for layer in self.layers:
            x = layer(x, cos, sin, input_pos, cache)
        if last_only:  # prefill needs only the next token's logits: skip the [T, vocab] matmul
            x = x[:, -1:]
        elif keep is not None:
            x = x[:, keep]
        return self.lm_head(self.norm(x)).float()

    def weight_bytes(self) -> int:
        """Bytes of all parameters and buffers holding weights, a tied tensor counted once."""
        seen, total = set(), 0
        for t in list(self.parameters()) + [b for n, b in self.named_buffers() if n != "inv_freq"]:
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
        return total

    def bytes_read_per_token(self) -> int:
        """Weight bytes one decode step reads: an embedding table that is not also the output head
        is only indexed (one row), so it does not count."""
        total, head = self.weight_bytes(), getattr(self.lm_head, "weight", None)
        if head is None or head is not self.embed_tokens.weight:  # (None: a head kept as two int4 halves)
            total -= sum(t.numel() * t.element_size() for t in self.embed_tokens.state_dict().values())
        return total
