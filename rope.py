"""Rotary position embeddings (RoPE) and the ways checkpoints stretch them past their trained
context.

RoPE rotates each pair of q/k dimensions i by the angle `position * inv_freq[i]`, so the dot
product of q at p and k at s depends only on p - s. A model trained on `original` positions has
never seen the slowest pairs turn further than that; the scalings below change `inv_freq` (and
sometimes the size of cos/sin) so that longer contexts stay within what it learnt. Each is
defined as Hugging Face transformers' rope initialisation functions define it, read from the
`rope_scaling` (or `rope_parameters`) dict of config.json:

    default    inv_freq[i] = theta ** (-2i / d)
    linear     inv_freq / factor: positions squeezed by `factor`
    llama3     (Llama 3.1) long wavelengths slowed by `factor`, short ones kept, a smooth
               band between
    yarn       (Qwen2.5/3, DeepSeek) per pair a blend of interpolated (inv_freq / factor) and
               original speeds, by how many turns the pair makes in the original context
               (beta_fast..beta_slow), and cos/sin scaled by the attention factor 0.1 ln(factor) + 1
    longrope   (Phi-3, Phi-4-mini) inv_freq / short_factor[i] inside the original context,
               / long_factor[i] past it, cos/sin scaled by sqrt(1 + ln(context / original) /
               ln(original))
    dynamic    (NTK) theta grown with the sequence:
               theta * (factor * n / original - (factor - 1)) ** (d / (d - 2))
    freq_factors  GGUF's rope_freqs tensor: one precomputed divisor per pair (how llama.cpp
               stores llama3)

`dynamic` and `longrope` depend on how long the sequence is. Hugging Face decides that per forward,
from the largest position in it, so one long prefill and the same tokens fed one at a time rotate
early keys differently. Here it is decided per token: a token at position p is rotated as it would
be in a forward that ends at p, which is exactly Hugging Face's token-by-token decoding (and its
prefill, whenever the prefill stays inside the original context). Keys already in a cache keep the
rotation they were written with; none is rewritten as the sequence grows. The result then does
not depend on chunked prefill, batching or which cache holds the keys.

    rope = RotaryEmbedding(64, theta=1e6, scaling={"rope_type": "yarn", "factor": 4.0, ...})
    cos, sin = rope(input_pos[B, T], torch.bfloat16)      # [B, T, rotary_dim]
"""

import math

import torch
from torch import nn

SUPPORTED = ("default", "linear", "llama3", "yarn", "longrope", "dynamic", "freq_factors")


def kind_of(scaling: dict) -> str:
    return (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))


def pair_exponents(d: int) -> torch.Tensor:
    """2i / d for the d / 2 pairs, on the CPU (on meta tensors this arithmetic would import the
    compiler)."""
    return torch.arange(0, d, 2, dtype=torch.int64, device="cpu").float() / d


def base_inv_freq(theta: float, d: int) -> torch.Tensor:
    """theta ** (-2i / d) for the d / 2 pairs."""
    return 1.0 / (theta ** pair_exponents(d))


def llama3_inv_freq(inv_freq, s: dict) -> torch.Tensor:
    factor, low, high, old = (
        s["factor"],
        s["low_freq_factor"],
        s["high_freq_factor"],
        s["original_max_position_embeddings"],
    )
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old / low, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old / high) & (wavelen <= old / low)
    return torch.where(medium, smoothed, scaled)


def yarn_inv_freq(theta: float, d: int, s: dict, context: int):
    """(inv_freq, attention factor): pairs that turn more than beta_fast times in the original
    context keep their speed, those turning fewer than beta_slow times are interpolated, a linear
    ramp between."""
    factor = s.get("factor") or context / s["original_max_position_embeddings"]
    old = s["original_max_position_embeddings"]

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = s.get("attention_factor")
    if attention is None:
        m, m_all = s.get("mscale"), s.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def pair_turning(turns):  # the pair index that turns `turns` times over the original context
        return d * math.log(old / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = pair_turning(s.get("beta_fast") or 32), pair_turning(s.get("beta_slow") or 1)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    high = high + 0.001 if low == high else high  # no zero-width ramp
    ramp = ((torch.arange(d // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(
        0, 1
    )
    speed = theta ** pair_exponents(d)
    keep = 1 - ramp  # 1: original speed (extrapolate), 0: interpolated
    return (1.0 / (factor * speed)) * (1 - keep) + (1.0 / speed) * keep, float(attention)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for one RoPE (module docstring); buffers only, rebuilt from the config, never
    loaded.

    rotary_dim: the leading dims rotated (Phi-4-mini's partial_rotary_factor); context: the model's
    max_position_embeddings (yarn and longrope derive their factor from it when none is given)."""

    def __init__(self, rotary_dim: int, theta: float, scaling: dict = None, context: int = 4096):
        super().__init__()
        s, d, self.kind = dict(scaling or {}), rotary_dim, kind_of(scaling)
        self.attention_factor, self.original = (
            1.0,
            s.get("original_max_position_embeddings", context),
        )
        self.theta, self.factor = theta, s.get("factor", 1.0)
        inv_freq = base_inv_freq(theta, d)
        if self.kind == "linear":
            inv_freq = inv_freq / s["factor"]
        elif self.kind == "llama3":
            inv_freq = llama3_inv_freq(inv_freq, s)
        elif self.kind == "freq_factors":
            inv_freq = inv_freq / torch.tensor(s["factors"], dtype=torch.float32, device="cpu")
        elif self.kind == "yarn":
            inv_freq, self.attention_factor = yarn_inv_freq(theta, d, s, context)
        elif self.kind == "longrope":
            factor = s.get("factor") or context / self.original
            self.attention_factor = s.get("attention_factor") or (
                1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(self.original))
            )
            shape = pair_exponents(d)
            inv_freq = 1.0 / (
                torch.tensor(s["short_factor"], dtype=torch.float32, device="cpu") * theta**shape
            )
            self.register_buffer(
                "long_inv_freq",
                1.0
                / (
                    torch.tensor(s["long_factor"], dtype=torch.float32, device="cpu") * theta**shape
                ),
                persistent=False,
            )
        elif self.kind == "dynamic":
            self.original = (
                context  # Hugging Face's dynamic NTK takes the model's context as the original
            )
        elif self.kind != "default":
            raise ValueError(
                f"RoPE scaling type {self.kind!r} is not supported (supported: "
                f"{', '.join(SUPPORTED)})"
            )
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("exponents", pair_exponents(d), persistent=False)

    def per_token_inv_freq(self, input_pos: torch.Tensor) -> torch.Tensor:
        """[B, T, d/2] speeds of each token, for the scalings that depend on the sequence's
        length."""
        if self.kind == "longrope":  # past the original context: the long factors
            return torch.where(
                input_pos[..., None] >= self.original, self.long_inv_freq, self.inv_freq
            )
        n = (
            (input_pos + 1).clamp(min=self.original).float()
        )  # dynamic: the length of a forward ending here
        base = self.theta * ((self.factor * n / self.original) - (self.factor - 1)) ** (
            self.exponents.numel() * 2 / (self.exponents.numel() * 2 - 2)
        )
        return 1.0 / (base[..., None] ** self.exponents)

    def forward(self, input_pos: torch.Tensor, dtype: torch.dtype):
        # input_pos [B, T] -> cos, sin [B, T, rotary_dim], computed in float32 then cast like the
        # reference
        inv_freq = (
            self.per_token_inv_freq(input_pos)
            if self.kind in ("longrope", "dynamic")
            else self.inv_freq
        )
        freqs = input_pos[..., None].float() * inv_freq  # [B, T, d/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [B, T, d]
        cos, sin = emb.cos(), emb.sin()
        if (
            self.attention_factor != 1.0
        ):  # yarn, longrope: the attention temperature, folded into q and k
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype), sin.to(dtype)
