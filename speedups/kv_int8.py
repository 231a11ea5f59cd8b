"""The int8 static KV cache: K and V stored as int8 with one scale per token and head.

A long-context decode step reads the whole KV prefix; halving its bytes halves that part of the
step (`generate.py --kv_cache_dtype int8`, `perplexity.py --kv_cache_dtype int8`):

    bytes per token = 2 * layers * kv_heads * (head_dim * 1 + bytes of one scale)

or, for DeepSeek's latent attention (one latent "head" holding K, whose first values are V),
layers * (kv_lora_rank + qk_rope_head_dim + bytes of two scales).

It is kv_cache.StaticKVCache with int8 buffers plus scale buffers; the reference path dequantizes
and runs the same attention, and a compiled one-token step reads the int8 bytes directly.
"""

import torch

from cpu_kernels import decode_attention
from kv_cache import StaticKVCache, attention, visible


def quantize_per_token(x: torch.Tensor):
    """x [..., D] -> (int8 [..., D], scale [..., 1]) with x ~= q * scale, symmetric per vector."""
    scale = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-8) / 127
    return torch.round(x.float() / scale).clamp(-127, 127).to(torch.int8), scale.to(x.dtype)


class Int8KVCache(StaticKVCache):
    """K/V as int8 [B, Hkv, S, D] plus scales [B, Hkv, S, 1] in the model's dtype.

    The reference: dequantize, then `attention` (or the one-token `decode` kernel, as the float
    cache). A one-token step under torch.compile runs cpu_kernels.decode_attention on the int8
    cache directly (Inductor fuses the int8 -> float conversion into its loops), so the step reads
    half the bytes of a bf16 cache."""

    def __init__(
        self,
        n_layers,
        batch_size,
        n_kv_heads,
        max_seq_len,
        head_dim,
        dtype=torch.float32,
        device=None,
        decode=None,
        latent=0,
    ):
        super().__init__(
            n_layers,
            batch_size,
            n_kv_heads,
            max_seq_len,
            head_dim,
            torch.int8,
            device,
            decode,
            latent,
        )
        # a latent's K is [c | k_pe]: one scale for each part (k_pe's magnitudes are its own)
        shape = (batch_size, n_kv_heads, max_seq_len, 2 if latent else 1)
        self.k_scale = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v_scale = (
            []
            if latent
            else [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        )

    def tensors(self) -> list:
        return self.k + self.v + self.k_scale + self.v_scale

    def attend(self, layer, q, k, v, input_pos, window=0, softcap=0.0, sinks=None):
        # q [B, T, H, D]; k, v [B, T, Hkv, D]; input_pos [B, T] -> [B, T, H, D]
        if self.latent:
            return self.attend_latent(layer, q, k, input_pos, window)
        rows = self.rows[: k.shape[0], None]
        for cache, scales, x in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
            xq, xs = quantize_per_token(x)
            cache[layer][rows, :, input_pos] = xq
            scales[layer][rows, :, input_pos] = xs
        L = self.attend_len
        mask = visible(self.slots[:L], input_pos, window)  # [B, 1, T, L]
        k_cache, v_cache, k_scale, v_scale = (
            t[layer].narrow(2, 0, L) for t in (self.k, self.v, self.k_scale, self.v_scale)
        )
        if q.shape[1] == 1 and torch.compiler.is_compiling() and not softcap and sinks is None:
            # compiled decode only: the eager path below, softmax(q (k * k_scale)^T / sqrt(D) +
            # mask) (v * v_scale), with the int8 values converted inside the fused reductions
            return decode_attention(q, k_cache, v_cache, mask, k_scale, v_scale)
        k_cache, v_cache = (
            k_cache.to(q.dtype) * k_scale,
            v_cache.to(q.dtype) * v_scale,
        )  # [B, Hkv, L, D]
        if q.shape[1] == 1 and self.decode is not None and not softcap and sinks is None:
            return self.decode(q, k_cache, v_cache, mask)
        return attention(q, k_cache, v_cache, mask, softcap, sinks)

    def attend_latent(self, layer, q, k, input_pos, window=0):
        """model.MLAttention's one latent "head" per token, K = [c | k_pe] (V: c), as int8 with one
        scale for c and one for k_pe; dequantized, then kv_cache.attention (heads folded into the
        query rows), compiled or not.

        q [B, T, H, R + P]; k [B, T, 1, R + P] -> [B, T, H, R]"""
        R, rows = self.latent, self.rows[: k.shape[0], None]
        parts = [quantize_per_token(x) for x in (k[..., :R], k[..., R:])]
        self.k[layer][rows, :, input_pos] = torch.cat([p[0] for p in parts], dim=-1)
        self.k_scale[layer][rows, :, input_pos] = torch.cat([p[1] for p in parts], dim=-1)
        L = self.attend_len
        kq, scale = (t[layer].narrow(2, 0, L) for t in (self.k, self.k_scale))  # [B, 1, L, *]
        k_cache = torch.cat(
            (kq[..., :R].to(q.dtype) * scale[..., :1], kq[..., R:].to(q.dtype) * scale[..., 1:]),
            dim=-1,
        )  # [B, 1, L, R + P]
        mask = visible(self.slots[:L], input_pos, window)  # [B, 1, T, L]
        return attention(q, k_cache, k_cache[..., :R], mask)
