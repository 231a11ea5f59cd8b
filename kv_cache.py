"""The static KV cache: preallocated K/V buffers written in place, attention by SDPA.

Every decode step would otherwise recompute K and V for the whole prefix. The cache keeps them:
one buffer pair per layer, allocated once at its final size, so that shapes never change and the
decode step compiles once per attend length (below; on CUDA each replays as one CUDA Graph).

    k[layer], v[layer]  [B, Hkv, S, D]   S = max_seq_len, the most positions a sequence may use

Its size is the number every user should be able to compute:

    bytes = 2 (K and V) * layers * kv_heads * head_dim * bytes_per_elem * S * B

e.g. Llama-3-8B in bf16: 2 * 32 * 8 * 128 * 2 = 128 KiB per token, 1 GiB per 8K-token sequence.
The embedded SmolLM2-135M: 2 * 30 * 3 * 64 * 2 = 22.5 KiB per token in bf16. DeepSeek's latent
attention (model.MLAttention) keeps one "head" of kv_lora_rank + qk_rope_head_dim values and no V
(`latent`: V is K's first kv_lora_rank values): DeepSeek-V2-Lite, 1 * 27 * 1 * 576 * 2 = 30 KiB.

`attend` writes this step's k/v at `input_pos` and attends over a prefix of the slots under a mask
that hides slots after each query's position (unwritten slots are zero, and masked). A query at
position p sees slots 0..p, which is causal attention within the step and full attention to the
past; a layer with a sliding window w sees only p - w < s <= p (`visible`; speedups/kv_window.py
keeps such layers as rings of their window instead). GQA is handled by SDPA's `enable_gqa`, so K/V
are never repeated per query head. That is the reference. A cache may be given a faster one-token
kernel where it is built (`decode`): `for_model` on CPU passes cpu_kernels.static_decode, the same
maths by other routes.

Cost follows the tokens in use, not the capacity. Before a step its caller (generate.generate,
which knows the positions on the host without a sync) calls `cache.use_positions(n)` with one
more than the largest position of the step; attention then reads only the first

    attend_len = min(S, max(MIN_ATTEND_SLOTS, bucket(n)))   bucket: 128, 192, 256, 384, 512, ...

slots (powers of two and the points halfway between), so a step's attention reads at most 1.5n
slots (e.g. 192 of 4096 with 130 in use): its cost grows with the tokens in use, linearly, plus
the weights' fixed cost per step. A compiled step needs one graph per bucket reached (13 for a
whole 8192-slot cache, 2 or 3 for a run of a few hundred tokens), never one per length.
Eager steps need no graphs: `use_positions(n, round_up=False)` attends over n rounded up to a
multiple of EAGER_SLOTS (256), at most 255 slots of padding. Not exactly n: each new length is a
new matmul shape, and oneDNN keeps the kernels it builds per shape (two caches of up to 1,024
entries), so exact lengths grew a bf16 decode's resident memory with every token
(benchmarks/RESULTS.md, "Resident memory besides the weights"). With the prefix, a decode step
over a large cache costs what one sized to the tokens in use does (benchmarks/RESULTS.md,
"Decode cost by tokens in use, not cache capacity").
Without a call (or after `use_positions(None)`) attention reads all S slots: the slow twin that
tests compare against. A caller that writes positions >= attend_len without raising it gets wrong
attention, silently: it is the caller's promise, because checking it would cost a host sync.

`Int8KVCache` (speedups/kv_int8.py, `generate.py --kv_cache_dtype int8`) stores K and V as int8
beside it.
"""

import torch
import torch.nn.functional as F

import cpu_kernels

MIN_ATTEND_SLOTS = 128  # the smallest prefix attended: below it a step's attention costs little
EAGER_SLOTS = 256  # eager steps attend over a multiple of this many slots (few matmul shapes)


def bucket(n: int) -> int:
    """n rounded up to the next of 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, ... (powers of two and the
    points halfway between): few distinct shapes for compiled steps, at most 1.5x padding."""
    power = 1
    while True:
        for size in (power, power + power // 2):
            if size >= n:
                return size
        power *= 2


def attend_len_for(n_positions: int, capacity: int) -> int:
    """The prefix of a cache that holds positions 0..n_positions-1: n rounded up to a bucket, at
    least MIN_ATTEND_SLOTS, at most the capacity (few distinct lengths: few compiled graphs)."""
    return min(capacity, max(MIN_ATTEND_SLOTS, bucket(n_positions)))


def eager_attend_len(n_positions: int, capacity: int) -> int:
    """The prefix an eager step attends over: n rounded up to a multiple of EAGER_SLOTS, at most
    the capacity (few matmul shapes: few cached oneDNN kernels, header)."""
    return min(-(-n_positions // EAGER_SLOTS) * EAGER_SLOTS, capacity)


def kv_bytes_per_token(
    n_layers: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype, latent: bool = False
) -> int:
    """K and V of every layer (latent: one latent "head" of head_dim, model.MLAttention's)."""
    parts = 1 if latent else 2
    return parts * n_layers * n_kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()


class StaticKVCache:
    """A plain object, not an nn.Module: torch.compile then treats its tensors as ordinary inputs,
    so one compiled decode step serves every cache of the same shape (module buffers would be
    guarded by identity once Inductor freezes the model's weights, and recompile per cache)."""

    latent = 0  # (a class default too: speedups/aot_export.py rebuilds caches without __init__)

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
        # One tensor per layer, not one [layers, ...] tensor: Inductor then updates each in place,
        # where writes into a view of one big buffer can become copies of the whole buffer.
        shape = (batch_size, n_kv_heads, max_seq_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        # latent (model.MLAttention): V is K's first `latent` values, read from K, never stored
        self.latent = latent
        self.v = (
            []
            if latent
            else [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        )
        self.slots = torch.arange(max_seq_len, device=device)  # [S]
        self.rows = torch.arange(batch_size, device=device)  # [B]
        self.batch_size, self.max_seq_len = batch_size, max_seq_len
        self.attend_len = max_seq_len  # the prefix of the slots attend reads (use_positions)
        # None, or a one-token kernel (q, k_cache, v_cache, mask) -> y replacing `attention`
        self.decode = decode

    @classmethod
    def for_model(cls, model, batch_size: int, max_seq_len: int):
        a, w = model.config, model.norm.weight  # the activations' dtype and device
        latent = a.mla.kv_lora_rank if a.mla else 0
        # the reference elsewhere (and for a latent cache, whose V is narrower than its K)
        decode = cpu_kernels.static_decode if w.device.type == "cpu" and not latent else None
        shape = (a.n_layers, batch_size, a.n_kv_heads, max_seq_len, a.head_dim)
        return cls(*shape, w.dtype, w.device, decode, latent)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def tensors(self) -> list:
        return self.k + self.v

    def use_positions(self, n_positions, round_up: bool = True) -> int:
        """The next steps use positions < n_positions (None: any): attend reads only the prefix
        attend_len_for(n_positions) of the slots, or without round_up (eager steps: no graphs to
        keep few) n_positions rounded up to a multiple of EAGER_SLOTS. Returns that length. Under
        torch.compile the length is a constant of the graph, so each length compiles its own
        graph."""
        if n_positions is None:
            self.attend_len = self.max_seq_len
        elif round_up:
            self.attend_len = attend_len_for(n_positions, self.max_seq_len)
        else:
            self.attend_len = eager_attend_len(n_positions, self.max_seq_len)
        return self.attend_len

    def attend(self, layer, q, k, v, input_pos, window=0, softcap=0.0, sinks=None):
        # q [B, T, H, D]; k, v [B, T, Hkv, D]; input_pos [B, T] -> [B, T, H, D]
        rows = self.rows[
            : k.shape[0], None
        ]  # [B, 1]: row b writes at its own positions input_pos[b]
        self.k[layer][rows, :, input_pos] = k.to(
            self.k[layer].dtype
        )  # an in-place index_put_ of [B, T, Hkv, D]
        if not self.latent:
            self.v[layer][rows, :, input_pos] = v.to(self.v[layer].dtype)
        L = self.attend_len  # the slots in use, rounded up: a view, nothing is copied
        # narrow, not [:, :, :L]: the same view, and torch.export (speedups/aot.py) derives L <= S
        # from it, not L < S
        k_cache = self.k[layer].narrow(2, 0, L)  # [B, Hkv, L, D]
        v_cache = (self.k[layer] if self.latent else self.v[layer]).narrow(2, 0, L)
        v_cache = v_cache[..., : self.latent] if self.latent else v_cache  # [B, Hkv, L, Dv]
        mask = visible(self.slots[:L], input_pos, window)  # [B, 1, T, L]: slot visible to query
        if (
            q.shape[1] == 1 and self.decode is not None and not softcap and sinks is None
        ):  # picked at build time
            return self.decode(q, k_cache, v_cache, mask)
        return attention(q, k_cache, v_cache, mask, softcap, sinks)

    def reset(self):
        for t in self.tensors():
            t.zero_()


def visible(slots, input_pos, window=0):
    """[B, 1, T, S]: slot s (holding position s) is visible to the query at p when s <= p and, under
    a sliding window w, p - w < s (Hugging Face's convention: w keys, the query's own included).

    slots [S]; input_pos [B, T]"""
    p = input_pos[:, None, :, None]
    return (slots <= p) & (slots > p - window) if window else slots <= p


def attention(q, k_cache, v_cache, mask, softcap=0.0, sinks=None):
    """softmax(q k^T / sqrt(D) + mask) v by SDPA, K/V never repeated per query head (enable_gqa).
    SDPA has neither of two steps some models add, so with them the scores are computed here, query
    heads grouped over their shared KV head: softcap (Gemma 2), scores -> softcap * tanh(scores /
    softcap); sinks [H] (gpt-oss), one learned logit per head that joins every row's softmax as an
    extra column and is dropped after it, so a row's weights sum to less than 1.

    (*) With one KV head the query heads are folded into the query rows instead, so SDPA reads K
    and V once: with enable_gqa its CPU path copies them per head (90% of a latent decode step at
    2K tokens; benchmarks/RESULTS.md, "Latent attention").

    q [B, T, H, D]; k_cache [B, Hkv, S, D], v_cache [B, Hkv, S, Dv]; mask [B, 1, T, S]
    -> [B, T, H, Dv] (Dv = D but for a latent cache)"""
    if softcap or sinks is not None:
        B, T, H, D = q.shape
        Hkv, S = k_cache.shape[1], k_cache.shape[2]
        qg = q.view(B, T, Hkv, H // Hkv, D).permute(0, 2, 3, 1, 4)  # [B, Hkv, G, T, D]
        scores = (qg @ k_cache[:, :, None].transpose(-1, -2)) * D**-0.5  # [B, Hkv, G, T, S]
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        scores = scores.masked_fill(~mask[:, :, None], float("-inf"))
        if sinks is not None:  # [H] -> a column [B, Hkv, G, T, 1]
            scores = torch.cat(
                (scores, sinks.view(1, Hkv, -1, 1, 1).expand(B, -1, -1, T, 1).to(scores.dtype)), -1
            )
        p = torch.softmax(scores, dim=-1, dtype=torch.float32)[..., :S].to(v_cache.dtype)
        return (p @ v_cache[:, :, None]).permute(0, 3, 1, 2, 4).reshape(B, T, H, D)
    B, T, H, D = q.shape
    if k_cache.shape[1] == 1:  # one KV head (multi-query, model.MLAttention's latent): (*)
        rows = mask[:, :, :, None].expand(B, 1, T, H, mask.shape[-1]).reshape(B, 1, T * H, -1)
        y = F.scaled_dot_product_attention(q.reshape(B, 1, T * H, D), k_cache, v_cache, rows)
        return y.view(B, T, H, -1)
    y = F.scaled_dot_product_attention(
        q.transpose(1, 2), k_cache, v_cache, attn_mask=mask, enable_gqa=True
    )
    return y.transpose(1, 2)


class NoCache:
    """Plain causal attention over the step's own tokens, storing nothing.

    For one-shot forwards of whole sequences that start at position 0 (perplexity, tests)."""

    def attend(self, layer, q, k, v, input_pos, window=0, softcap=0.0, sinks=None):
        if window or softcap or sinks is not None:
            k, v = k.transpose(1, 2), v.transpose(1, 2)  # [B, Hkv, T, D]
            return attention(q, k, v, visible(input_pos[0], input_pos, window), softcap, sinks)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
        )
        return y.transpose(1, 2)
