"""The Llama-family transformer, written to be read top to bottom.

One decoder-only architecture covers Llama 2 / 3.x, Mistral, Mixtral, TinyLlama, SmolLM2, Qwen2 /
2.5 / 3 (and their MoE), Phi-3 / Phi-4-mini and Gemma 2 / 3. They differ only in switches, all in
`ModelConfig`: grouped-query attention, a head_dim that need not be dim / n_heads, q/k/v bias
(Qwen2), RMSNorm on q and k (Qwen3, Gemma 3), tied heads, how RoPE is stretched (rope.py: llama3,
linear, yarn, longrope, dynamic), sliding windows per layer, Gemma's (1 + w) norms, sqrt(dim)
embeddings, GeGLU, sandwich norms, query_pre_attn_scalar, tanh soft-capping, k-of-E expert routers
(moe.py), gpt-oss's attention sinks; DeepSeek-V2 / V3's multi-head latent attention (MLAttention)
hands the cache one latent "head" per token instead of per-head K and V.

The model never knows how K and V are stored. Each attention layer projects q, k, v, rotates q and k
by RoPE at `input_pos`, and hands them to the cache with the layer's window, soft cap and sinks:

    logits = model(tokens[B, T], input_pos[B, T], cache)
    y = cache.attend(layer, q[B, T, H, D], k[B, T, Hkv, D], v[B, T, Hkv, D], input_pos[B, T],
                     window, softcap, sinks)

A query at p then sees keys at p - window < s <= p (window 0: all s <= p). The positions are the
only per-step fact the model passes along; anything else a cache needs (block tables) its caller
writes into the cache before the forward. kv_cache.py holds the static cache; paged.py the paged
one.

Parameter names follow Hugging Face's Llama layout without the leading "model." (so an HF
checkpoint loads by name); formats/weights.py turns every checkpoint format into this layout.
Run `python generate.py` to see it write text; tests/test_model.py checks it against HF.
"""

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from moe import MoEConfig, SparseMoE
from rope import RotaryEmbedding


@dataclass
class MLAConfig:
    """DeepSeek's multi-head latent attention (MLAttention): what the cache keeps per token is the
    latent (kv_lora_rank) and the rotary key shared by every head (qk_rope_head_dim)."""

    kv_lora_rank: int  # R: the latent each head's K and V are projected up from
    qk_nope_head_dim: int  # each head's K/Q part without RoPE
    qk_rope_head_dim: int  # each head's Q part with RoPE, and K's one shared rotary part
    v_head_dim: int
    q_lora_rank: int = 0  # q through a low-rank bottleneck with its own norm; 0: one projection
    softmax_scale: float = 0.0  # 0: (nope + rope) ** -0.5; YaRN's mscale_all_dim squares into it


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
    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm over head_dim on q and k, before RoPE
    sliding_window: int = (
        0  # keys a windowed layer still sees (Mistral, Qwen2, Gemma, Phi-3); 0: none
    )
    # per layer "sliding_attention" or "full_attention"; (): every layer windowed if a window is set
    layer_types: tuple = ()
    rotary_dim: int = (
        0  # the leading dims RoPE rotates (Phi-4-mini's partial_rotary_factor); 0: head_dim
    )
    local_rope_theta: float = (
        0.0  # Gemma 3: sliding layers' own RoPE base, unscaled; 0: the same RoPE
    )
    # Gemma 2 / 3's switches
    norm_offset: float = 0.0  # RMSNorm scales by (offset + w) in float32 (Gemma: 1)
    embed_scale: bool = False  # embeddings times sqrt(dim)
    mlp_act: str = "silu"  # or "gelu_tanh" (GeGLU)
    sandwich_norms: bool = False  # norms after attention and the MLP too, before the residual add
    query_scale: float = (
        0.0  # attention scores scaled by query_scale ** -0.5 (query_pre_attn_scalar); 0: head_dim
    )
    attn_softcap: float = 0.0  # scores -> cap * tanh(scores / cap) (Gemma 2); 0: none
    logit_softcap: float = 0.0  # the same on the final logits
    # gpt-oss: a learned logit per head in each softmax's denominator (kv_cache.attention)
    attn_sinks: bool = False
    moe: MoEConfig | None = (
        None  # mixtures of experts (moe.py): k of E experts per token; None: dense MLPs
    )
    # False: a base model saved without its output head (sentence-transformers' folders): it
    # gives final hidden states (embeddings) only
    has_head: bool = True
    # DeepSeek's latent attention; with it n_kv_heads is 1 and head_dim the latent "head" the
    # cache keeps, kv_lora_rank + qk_rope_head_dim
    mla: MLAConfig | None = None

    def window(self, layer: int) -> int:
        """The sliding window of `layer` (0: it sees the whole context)."""
        full = self.layer_types and self.layer_types[layer] != "sliding_attention"
        return 0 if full else self.sliding_window

    def __post_init__(self):
        if self.head_dim == 0:
            self.head_dim = self.dim // self.n_heads
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}"
            )
        if not isinstance(self.sliding_window, int) or self.sliding_window < 0:
            raise ValueError(f"sliding_window must be an integer >= 0, got {self.sliding_window!r}")
        bad = set(self.layer_types) - {"sliding_attention", "full_attention"}
        if bad or len(self.layer_types) not in (0, self.n_layers):
            raise ValueError(
                f"layer_types must give each of the {self.n_layers} layers one of "
                f"sliding_attention, full_attention; got {sorted(bad) or len(self.layer_types)}"
            )
        if self.mlp_act not in ACTIVATIONS:
            raise ValueError(
                f"MLP activation {self.mlp_act!r} is not supported (supported: "
                f"{', '.join(ACTIVATIONS)})"
            )


NO_HEAD = (
    "this checkpoint is a base model saved without its output head (as sentence-transformers "
    "saves one): it gives embeddings (serve.py's /v1/embeddings, batch.py --embed), not text"
)
ACTIVATIONS = {"silu": F.silu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    # Hugging Face's RoPE layout: the pairs are (x[i], x[i + D/2]), not adjacent elements.
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [B, T, H, D]; cos, sin [B, T, R] -> broadcast over heads; dims past R (partial rotary) pass
    # through
    if cos.shape[-1] < x.shape[-1]:
        rot, rest = x.split([cos.shape[-1], x.shape[-1] - cos.shape[-1]], dim=-1)
        return torch.cat((apply_rope(rot, cos, sin), rest), dim=-1)
    return x * cos[:, :, None, :] + rotate_half(x) * sin[:, :, None, :]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32, then scale in the input dtype, as the reference does (Gemma: by 1 +
        # w in float32).
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (x * (self.offset + self.weight.float())).to(dtype)
        return self.weight * x.to(dtype)


def norm(config: ModelConfig, dim: int = 0) -> RMSNorm:
    return RMSNorm(dim or config.dim, config.norm_eps, config.norm_offset)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer  # index the cache uses to find this layer's K/V
        self.n_heads, self.n_kv_heads, self.head_dim = (
            config.n_heads,
            config.n_kv_heads,
            config.head_dim,
        )
        self.q_proj = nn.Linear(config.dim, config.n_heads * config.head_dim, bias=config.qkv_bias)
        self.k_proj = nn.Linear(
            config.dim, config.n_kv_heads * config.head_dim, bias=config.qkv_bias
        )
        self.v_proj = nn.Linear(
            config.dim, config.n_kv_heads * config.head_dim, bias=config.qkv_bias
        )
        self.o_proj = nn.Linear(config.n_heads * config.head_dim, config.dim, bias=config.o_bias)
        self.qkv_proj = (
            None  # formats/fuse_layers.py may replace q/k/v by one layer with their rows stacked
        )
        if config.qk_norm:
            self.q_norm, self.k_norm = norm(config, config.head_dim), norm(config, config.head_dim)
        else:
            self.q_norm = self.k_norm = None
        self.window, self.softcap = (
            config.window(layer),
            config.attn_softcap,
        )  # what the cache must apply
        self.sinks = nn.Parameter(torch.zeros(config.n_heads)) if config.attn_sinks else None  # [H]
        # query_pre_attn_scalar: folded into q, so every attention kernel keeps its 1/sqrt(D)
        self.q_scale = (config.head_dim / config.query_scale) ** 0.5 if config.query_scale else 1.0

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
        if self.q_scale != 1.0:
            q = q * self.q_scale
        y = cache.attend(
            self.layer, q, k, v, input_pos, self.window, self.softcap, self.sinks
        )  # [B, T, H, D]
        return self.o_proj(y.reshape(B, T, self.n_heads * self.head_dim))


class MLAttention(nn.Module):
    """Multi-head latent attention (DeepSeek-V2 / V3). Each token's K and V come from one latent
    c [R] (R = kv_lora_rank, 512) and one rotary key k_pe [P] (P = qk_rope_head_dim, 64) shared by
    the H heads; the cache keeps [c | k_pe], R + P values a token, not H * (N + P + V)
    (N = qk_nope_head_dim, V = v_head_dim). Head h's key is [W_uk[h] c | k_pe] and value
    W_uv[h] c, with W_uk [H, N, R], W_uv [H, V, R] the rows of kv_b_proj. So

        q_h . k_h = (W_uk[h]^T q_nope_h) . c + q_pe_h . k_pe     ("weight absorption")
        y_h = W_uv[h] (sum_s p_s c_s)

    and attention runs in the latent space as one shared KV "head" of width R + P whose value is
    its first R values: per cached token H * (R + P) multiply-adds for the scores and H * R for
    the values, reading R + P values; expanding instead reads the same R + P but first multiplies
    every cached token's latent by kv_b_proj (H * (N + V) * R each, every step) and attends over
    H * (N + P + V) values. This absorbs on every step, prefill included (a prefill of T tokens
    would expand in T * H * (N + V) * R and attend in H * (N + P + V) per pair instead of
    H * (2R + P): fewer FLOPs when T is large; one path keeps it small). The scale is
    folded into q so that every kernel keeps its 1 / sqrt(R + P)."""

    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        m, H, dim = config.mla, config.n_heads, config.dim
        self.layer, self.m, self.n_heads = layer, m, H
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        self.q_proj = None if m.q_lora_rank else nn.Linear(dim, H * qk, bias=False)
        if m.q_lora_rank:  # HF's own norms here are eps 1e-6 whatever the config says
            self.q_a_proj = nn.Linear(dim, m.q_lora_rank, bias=config.qkv_bias)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, 1e-6)
            self.q_b_proj = nn.Linear(m.q_lora_rank, H * qk, bias=False)
        R = m.kv_lora_rank
        self.kv_a_proj_with_mqa = nn.Linear(dim, R + m.qk_rope_head_dim, bias=config.qkv_bias)
        self.kv_a_layernorm = RMSNorm(R, 1e-6)
        self.kv_b_proj = nn.Linear(R, H * (m.qk_nope_head_dim + m.v_head_dim), bias=False)
        self.o_proj = nn.Linear(H * m.v_head_dim, dim, bias=config.o_bias)
        # the kernels' 1 / sqrt(R + P) becomes the model's scale
        self.q_scale = (m.softmax_scale or qk**-0.5) * (R + m.qk_rope_head_dim) ** 0.5
        self.window, self.softcap, self.sinks = 0, 0.0, None

    def forward(self, x, cos, sin, input_pos, cache):
        B, T, _ = x.shape
        m, H, R = self.m, self.n_heads, self.m.kv_lora_rank
        q = (
            self.q_proj(x)
            if self.q_proj is not None
            else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        )
        q_nope, q_pe = q.view(B, T, H, -1).split([m.qk_nope_head_dim, m.qk_rope_head_dim], -1)
        c, k_pe = self.kv_a_proj_with_mqa(x).split([R, m.qk_rope_head_dim], dim=-1)
        q_pe, k_pe = apply_rope(q_pe, cos, sin), apply_rope(k_pe[:, :, None], cos, sin)
        w = self.kv_b_proj.weight.view(H, -1, R)  # [H, N + V, R]: W_uk rows, then W_uv rows
        q_c = torch.einsum("bthn,hnr->bthr", q_nope, w[:, : m.qk_nope_head_dim])  # [B, T, H, R]
        q = torch.cat((q_c, q_pe), dim=-1) * self.q_scale  # [B, T, H, R + P]
        k = torch.cat((self.kv_a_layernorm(c)[:, :, None], k_pe), dim=-1)  # [B, T, 1, R + P]
        y = cache.attend(self.layer, q, k, k[..., :R], input_pos)  # [B, T, H, R]
        y = torch.einsum("bthr,hvr->bthv", y, w[:, m.qk_nope_head_dim :])  # [B, T, H, V]
        return self.o_proj(y.reshape(B, T, H * m.v_head_dim))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)); Gemma's GeGLU has tanh-GELU in place of silu."""

    def __init__(self, config: ModelConfig, width: int = 0):
        super().__init__()
        width = width or config.intermediate_size
        self.gate_proj = nn.Linear(config.dim, width, bias=config.mlp_bias)
        self.up_proj = nn.Linear(config.dim, width, bias=config.mlp_bias)
        self.down_proj = nn.Linear(width, config.dim, bias=config.mlp_bias)
        self.gate_up_proj = None  # or gate and up stacked in one layer (formats/fuse_layers.py)
        self.act = ACTIVATIONS[config.mlp_act]

    def forward(self, x):
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(self.act(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = norm(config)
        self.self_attn = (MLAttention if config.mla else Attention)(config, layer)
        self.post_attention_layernorm = norm(
            config
        )  # Llama: before the MLP; Gemma: on attention's output
        self.mlp = SparseMoE.for_layer(config, layer, MLP, ACTIVATIONS[config.mlp_act]) or MLP(
            config
        )  # moe.py
        self.sandwich = config.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm, self.post_feedforward_layernorm = (
                norm(config),
                norm(config),
            )

    def forward(self, x, cos, sin, input_pos, cache):
        h = self.self_attn(self.input_layernorm(x), cos, sin, input_pos, cache)
        if self.sandwich:  # Gemma 2 / 3: each branch normalised before and after
            x = x + self.post_attention_layernorm(h)
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.n_layers))
        self.norm = norm(config)
        self.lm_head = (
            nn.Linear(config.dim, config.vocab_size, bias=False) if config.has_head else None
        )
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.make_rope(self.norm.weight.device)

    def make_rope(self, device):
        """The RoPE tables (rope.py): buffers, not parameters, rebuilt from the config, never
        loaded."""
        c = self.config
        self.rotary = RotaryEmbedding(
            c.rotary_dim or c.head_dim, c.rope_theta, c.rope_scaling, c.max_position_embeddings
        ).to(device)
        self.local_rotary = (
            RotaryEmbedding(c.rotary_dim or c.head_dim, c.local_rope_theta).to(device)
            if c.local_rope_theta
            else None
        )

    def embed(self, tokens):
        x = self.embed_tokens(tokens)  # [B, T, dim]
        if (
            self.config.embed_scale
        ):  # Gemma: times sqrt(dim), rounded to the activations' dtype as the reference
            x = x * torch.tensor(self.config.dim**0.5, dtype=x.dtype)
        return x

    def forward_layers(self, x, input_pos, cache, layers):
        """x [B, T, dim] through `layers`, each rotating q, k by its RoPE's cos/sin [B, T, D] at
        input_pos."""
        # one cos/sin pair per distinct RoPE (Gemma 3's sliding layers have their own), once per
        # step
        tables = {}
        for layer in layers:
            local = self.local_rotary is not None and layer.self_attn.window > 0
            if local not in tables:  # in the activations' dtype (the embedding may be int8)
                tables[local] = (self.local_rotary if local else self.rotary)(
                    input_pos, self.norm.weight.dtype
                )
            x = layer(x, *tables[local], input_pos, cache)
        return x

    def check_head(self):
        """ValueError unless the model has an output head (gives text, not only embeddings)."""
        if self.lm_head is None:
            raise ValueError(NO_HEAD)

    def head(self, x):
        self.check_head()
        logits = self.lm_head(self.norm(x)).float()
        if self.config.logit_softcap:  # Gemma 2: cap * tanh(logits / cap)
            logits = torch.tanh(logits / self.config.logit_softcap) * self.config.logit_softcap
        return logits

    def forward(self, tokens, input_pos, cache, last_only: bool = False, keep=None):
        """tokens, input_pos [B, T] -> logits [B, T, vocab] (or [B, 1, vocab] if last_only, or
        [B, len(keep), vocab] for the positions `keep` [n] along T, e.g. each sequence's last token
        in a flattened batch)."""
        x = self.forward_layers(self.embed(tokens), input_pos, cache, self.layers)
        if last_only:  # prefill needs only the next token's logits: skip the [T, vocab] matmul
            x = x[:, -1:]
        elif keep is not None:
            x = x[:, keep]
        return self.head(x)

    def weight_bytes(self) -> int:
        """Bytes of all parameters and buffers holding weights, a tied tensor counted once."""
        seen, total = set(), 0
        for t in list(self.parameters()) + [
            b for n, b in self.named_buffers() if "rotary" not in n
        ]:
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
        return total

    def bytes_read_per_token(self) -> int:
        """Weight bytes one decode step reads: an embedding table that is not also the output head
        is only indexed (one row), so it does not count; nor do the experts a token's router passes
        over."""
        total, head = self.weight_bytes(), getattr(self.lm_head, "weight", None)
        if (
            head is None or head is not self.embed_tokens.weight
        ):  # (None: a head kept as two int4 halves)
            total -= sum(
                t.numel() * t.element_size() for t in self.embed_tokens.state_dict().values()
            )
        return total - sum(
            m.inactive_bytes() for m in self.modules() if isinstance(m, SparseMoE)
        )  # unchosen experts
