"""The static KV cache: preallocated K/V buffers written in place, attention by SDPA.

Every decode step would otherwise recompute K and V for the whole prefix. The cache keeps them:
one buffer pair per layer, allocated once at its final size, so that shapes never change and the
decode step compiles once (and, on CUDA, replays as one CUDA Graph).

    k[layer], v[layer]  [B, Hkv, S, D]   S = max_seq_len, the most positions a sequence may use

Its size is the number every user should be able to compute:

    bytes = 2 (K and V) * layers * kv_heads * head_dim * bytes_per_elem * S * B

e.g. Llama-3-8B in bf16: 2 * 32 * 8 * 128 * 2 = 128 KiB per token, 1 GiB per 8K-token sequence.
The embedded SmolLM2-135M: 2 * 30 * 3 * 64 * 2 = 22.5 KiB per token in bf16.

`attend` writes this step's k/v at `input_pos` and attends over all S slots under a mask that
hides slots after each query's position (unwritten slots are zero, and masked). A query at
position p sees slots 0..p, which is causal attention within the step and full attention to
the past. GQA is handled by SDPA's `enable_gqa`, so K/V are never repeated per query head.
"""
import torch
import torch.nn.functional as F


def kv_bytes_per_token(n_layers: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    return 2 * n_layers * n_kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()


class StaticKVCache:
    """A plain object, not an nn.Module: torch.compile then treats its tensors as ordinary inputs,
    so one compiled decode step serves every cache of the same shape (module buffers would be
    guarded by identity once Inductor freezes the model's weights, and recompile per cache)."""

    def __init__(self, n_layers, batch_size, n_kv_heads, max_seq_len, head_dim, dtype=torch.float32, device=None):
        # One tensor per layer, not one [layers, ...] tensor: Inductor then updates each in place,
        # where writes into a view of one big buffer can become copies of the whole buffer.
        shape = (batch_size, n_kv_heads, max_seq_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.slots = torch.arange(max_seq_len, device=device)  # [S]
        self.rows = torch.arange(batch_size, device=device)  # [B]
        self.batch_size, self.max_seq_len = batch_size, max_seq_len

    @classmethod
    def for_model(cls, model, batch_size: int, max_seq_len: int):
        a, w = model.args, model.embed_tokens.weight
        return cls(a.n_layers, batch_size, a.n_kv_heads, max_seq_len, a.head_dim, w.dtype, w.device)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def attend(self, layer, q, k, v, input_pos):
        # q [B, T, H, D]; k, v [B, T, Hkv, D]; input_pos [B, T] -> [B, T, H, D]
        k_cache, v_cache = self.k[layer], self.v[layer]  # [B, Hkv, S, D]
        rows = self.rows[: k.shape[0], None]  # [B, 1]: row b writes at its own positions input_pos[b]
        k_cache[rows, :, input_pos] = k.to(k_cache.dtype)  # an in-place index_put_ of [B, T, Hkv, D]
        v_cache[rows, :, input_pos] = v.to(v_cache.dtype)
        mask = self.slots <= input_pos[:, None, :, None]  # [B, 1, T, S]: slot visible to query
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k_cache, v_cache, attn_mask=mask, enable_gqa=True)
        return y.transpose(1, 2)  # [B, T, H, D]

    def reset(self):
        for t in self.k + self.v:
            t.zero_()


class NoCache:
    """Plain causal attention over the step's own tokens, storing nothing.

    For one-shot forwards of whole sequences that start at position 0 (perplexity, tests)."""

    def attend(self, layer, q, k, v, input_pos):
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
        )
        return y.transpose(1, 2)
