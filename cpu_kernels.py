"""CPU fast paths: kernels that pay only on a CPU, each standing in for a plain reference a reader
can follow where it lives (a cache's `attend`, F.linear, the int4 formula).

The references stay in their files; a kernel here is picked explicitly where its user is built
(`StaticKVCache.for_model`, `PagedKVCache.for_model` on CPU) or called by name, and is tested
against that reference (tests/test_cpu_kernels.py; those marked isa under each
ATEN_CPU_CAPABILITY, because ATen and Inductor choose kernels by the CPU's instruction set):

    static_decode        for SDPA over a static cache, one token: dispatches to one of the next two
    decode_attention     for SDPA, compiled: two reductions Inductor fuses, no flash call per layer
                         (whose fixed cost dominates at batch 1); with scales it reads int8 K/V
    grouped_decode_attention  for SDPA in bf16/fp16: two matmuls (SDPA's one-token bf16 kernel is
                         slow)
    PagedDecodeInPlace   for gather blocks + SDPA, one token: reads the pool where it lies, no copy
    padded_linear        for F.linear: rows padded to few counts (oneDNN keeps a kernel per shape)
    flash_attention_works  whether SDPA's flash kernel runs here (else it is switched off at import)
    cpu_int4_kernel_error  checks ATen's int4 kernel against (q - 8) * scale + zero per group

Run its tests:

    .venv/bin/python -m pytest tests/test_cpu_kernels.py -q
    ATEN_CPU_CAPABILITY=avx2 .venv/bin/python -m pytest tests/test_cpu_kernels.py -m isa -q

This file imports only torch, so any other file of the project can use it.
"""

import functools

import torch
import torch.nn.functional as F

# Compiled one-token CPU steps over caches up to this many slots use decode_attention (cheaper
# than the flash kernel's fixed cost per call); longer ones, and eager steps, use SDPA in float32
# and grouped_decode_attention in bf16/fp16 (benchmarks/RESULTS.md, "Weight-only quantization and
# the int8 KV cache (CPU)").
FUSED_DECODE_MAX_SLOTS = 1024


def flash_attention_works() -> bool:
    """Whether torch's CPU flash attention runs a bf16 and an fp16 prefill here. It picks its AMX
    path from the hardware but packs with a kernel gated by ATen's capability, so on an AMX Xeon
    under ATEN_CPU_CAPABILITY=avx2 or default a prefill of 100 queries fails ("pack_vnni2 is only
    supported when avx512 is supported"). Only checked below AVX-512, where that can happen."""
    if torch.backends.cpu.get_cpu_capability() == "AVX512":
        return True
    try:
        for dtype in (torch.bfloat16, torch.float16):
            x = torch.zeros(1, 1, 100, 16, dtype=dtype)
            F.scaled_dot_product_attention(x, x, x)
        return True
    except RuntimeError:
        return False


if not flash_attention_works():  # SDPA then takes its math kernel: the same maths, slower
    torch.backends.cuda.enable_flash_sdp(
        False
    )  # (the switch is named for CUDA; it selects CPU flash too)


# ---- one-token attention over a static cache -------------------------------------------------


def static_decode(q, k_cache, v_cache, mask):
    """StaticKVCache's one-token step on CPU (for_model picks it): the reference's maths,
    softmax(q k^T / sqrt(D) + mask) v, by the fastest route for the step.

    q [B, 1, H, D]; k_cache, v_cache [B, Hkv, L, D] (a prefix view); mask [B, 1, 1, L] -> [B, 1, H,
    D]"""
    if torch.compiler.is_compiling() and k_cache.shape[2] <= FUSED_DECODE_MAX_SLOTS:
        # compiled: the same maths as SDPA, written as two reductions Inductor fuses
        return decode_attention(q, k_cache, v_cache, mask)
    if k_cache.dtype in (torch.bfloat16, torch.float16):
        return grouped_decode_attention(q, k_cache, v_cache, mask)
    y = F.scaled_dot_product_attention(
        q.transpose(1, 2), k_cache, v_cache, attn_mask=mask, enable_gqa=True
    )
    return y.transpose(1, 2)


def decode_attention(q, k_cache, v_cache, mask, k_scale=None, v_scale=None):
    """One query token's attention written as two reductions, for Inductor to fuse on CPU
    (scores over D, then the weighted sum over S), instead of a call to the flash kernel, whose
    fixed cost per call dominates at batch 1. With scales, the caches are int8 and are
    converted inside the fused loops, so only their int8 bytes are read.

    q [B, 1, H, D]; k_cache, v_cache [B, Hkv, S, D]; mask [B, 1, 1, S]; scales [B, Hkv, S, 1]."""
    B, _, H, D = q.shape
    Hkv = k_cache.shape[1]
    qg = q.reshape(B, Hkv, H // Hkv, 1, D).float()  # query heads grouped by their KV head
    # each .float() before its broadcast dim: on a prefix view that keeps the strides' order plain,
    # so torch.export (speedups/aot.py) derives no "attend length < cache length" from it
    scores = (qg * k_cache.float()[:, :, None]).sum(-1)  # [B, Hkv, G, S]
    if k_scale is not None:
        scores = scores * k_scale[..., 0].float()[:, :, None]
    scores = scores * D**-0.5 + torch.where(mask[:, :, None, 0], 0.0, float("-inf"))
    p = torch.softmax(scores, dim=-1)  # [B, Hkv, G, S]
    if v_scale is not None:
        p = p * v_scale[..., 0].float()[:, :, None]
    y = (p[..., None] * v_cache.float()[:, :, None]).sum(-2)  # [B, Hkv, G, D]
    return y.reshape(B, 1, H, D).to(q.dtype)


def grouped_decode_attention(q, k_cache, v_cache, mask):
    """One query token's attention as two batched matrix products, the query heads of each KV head
    stacked as the rows of one product (no K/V repeated per head), softmax in float32. On CPU in
    bf16 SDPA's kernel at one query token ran several times slower than this; in float32 about as
    fast, so float32 keeps SDPA (benchmarks/RESULTS.md, "bf16 one-token steps without SDPA").

    q [B, 1, H, D]; k_cache, v_cache [B, Hkv, S, D] (views are fine); mask [B, 1, 1, S] -> [B, 1, H,
    D]"""
    B, _, H, D = q.shape
    Hkv = k_cache.shape[1]
    qg = q.reshape(B, Hkv, H // Hkv, D)  # [B, Hkv, G, D]
    scores = torch.matmul(qg, k_cache.transpose(-1, -2))  # [B, Hkv, G, S]
    scores = scores.to(torch.promote_types(scores.dtype, torch.float32)) * D**-0.5
    p = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1).to(v_cache.dtype)
    return torch.matmul(p, v_cache).reshape(B, 1, H, D)


# ---- one-token attention over a paged pool ----------------------------------------------------


class PagedDecodeInPlace:
    """PagedKVCache's one-token rows on CPU (for_model picks it), reading K and V where they lie in
    the pool: no gathered copy.

    F.embedding_bag(indices, rows, per_sample_weights) sums weighted rows picked by index, which is
    both halves of attention over a block table. Scores: the K pool holds each block transposed,
    [Hkv, D, bs], so the D rows of one head's block weighted by that query head's q sum to its bs
    scores. Output: V's rows are one token's one head, weighted by the softmax. Each byte of the
    pool is read once (the G query heads sharing a KV head read it from cache); the gather-then-SDPA
    reference writes a copy and reads it twice (benchmarks/RESULTS.md, "Decode rows reading the
    paged blocks in place"). One per cache: it keeps the indices of the last block table it read
    (of each of a hybrid's two, views of one [2, R, W] tensor)."""

    def __init__(self):
        self._bag_cache = (
            None,
            None,
            {},
        )  # (the table last read, or what it views; its version; {view: rows})

    def __call__(self, q, pool_k, pool_v, table, mask):
        """q [R, 1, H, D]; pool_k [N, Hkv, D, bs]; pool_v [N, bs, Hkv, D]; table [R, W];
        mask [R, 1, 1, L] (slot visible to the row's query, L = W * bs) -> [R, 1, H, D]"""
        R, _, H, D = q.shape
        W, bs, Hkv = table.shape[1], pool_v.shape[1], pool_v.shape[2]
        k_index, v_index = self._bag_indices(table, H, Hkv, D, bs)
        weights = (q.view(R, H, 1, D) * D**-0.5).to(pool_k.dtype).expand(R, H, W, D).reshape(-1, D)
        scores = F.embedding_bag(
            k_index, pool_k.view(-1, bs), mode="sum", per_sample_weights=weights
        )
        scores = scores.view(R, H, W * bs).to(
            torch.promote_types(scores.dtype, torch.float32)
        )  # float64 stays
        p = torch.softmax(
            scores.masked_fill(~mask[:, 0], float("-inf")), dim=-1
        )  # mask [R, 1, L] over H
        p = p.to(pool_v.dtype)  # [R, H, L]
        y = F.embedding_bag(
            v_index, pool_v.view(-1, D), mode="sum", per_sample_weights=p.view(R * H, -1)
        )
        return y.view(R, 1, H, D).to(q.dtype)

    def _bag_indices(self, table, H, Hkv, D, bs):
        """The rows __call__ sums, from a block table [R, W]: K's [R * H * W, D] (query head h of
        row r, block w: the D rows of its KV head's transposed block) and V's [R * H, L] (the L
        tokens' rows of its KV head). Every layer reads the same table (or one of a hybrid's two),
        so eager steps build them once per table (and again if it is changed in place)."""
        compiling = torch.compiler.is_compiling()  # (a compiled step builds them in its graph)
        if not compiling:
            base, (cached_base, version, entries) = (
                table if table._base is None else table._base,
                self._bag_cache,
            )
            key, same = (
                (table.storage_offset(), tuple(table.shape), tuple(table.stride())),
                cached_base is base,
            )
            if same and version == base._version and key in entries:
                return entries[key]
        R, W = table.shape
        G = H // Hkv
        kv_head = torch.arange(H, device=table.device) // G  # [H]
        k_index = (table[:, None, :] * Hkv + kv_head[:, None])[..., None] * D + torch.arange(
            D, device=table.device
        )  # [R, H, W, D]
        slot = (table[:, :, None] * bs + torch.arange(bs, device=table.device)).view(R, 1, W * bs)
        v_index = slot * Hkv + kv_head[:, None]  # [R, H, L]
        out = (k_index.view(R * H * W, D), v_index.view(R * H, W * bs))
        if not compiling:
            kept = (
                entries if same and version == base._version else {}
            )  # (an edit in place: the others are stale)
            self._bag_cache = (base, base._version, kept | {key: out})
        return out


# ---- GEMM row padding ------------------------------------------------------------------------

# oneDNN keeps the kernels it builds for every matmul shape it sees, in two caches of up to 1,024
# shapes (LRU_CACHE_CAPACITY, ONEDNN_PRIMITIVE_CACHE_CAPACITY), so callers whose row counts vary
# widely pad them to few values: a bf16 server's resident memory grew with every prompt length
# otherwise; float32 does not grow (benchmarks/RESULTS.md, "Resident memory besides the weights").
# From GEMM_PAD_FROM rows up, at most GEMM_ROWS - 1 extra rows.
GEMM_ROWS, GEMM_PAD_FROM, GEMM_PAD_DTYPES = 16, 128, (torch.bfloat16, torch.float16)


def gemm_padding(rows: int, dtype, device) -> int:
    """Rows to add to a GEMM of `rows` rows so that its shape is one of few (see above); 0 if
    none."""
    if rows < GEMM_PAD_FROM or torch.device(device).type != "cpu" or dtype not in GEMM_PAD_DTYPES:
        return 0
    return -rows % GEMM_ROWS


def padded_linear(x2: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """F.linear(x2 [M, K], w [N, K]) -> [M, N], its rows padded as gemm_padding says (few GEMM
    shapes, so few cached oneDNN kernels; prompts of every length reach here). Under
    torch.compile with dynamic shapes (--compile_prefill) the padding is a guard: one more graph."""
    M = x2.shape[0]
    pad = gemm_padding(M, x2.dtype, x2.device)
    if not pad:
        return F.linear(x2, w)
    return F.linear(F.pad(x2, (0, 0, 0, pad)), w)[:M]


# ---- the CPU int4 kernel's probe -------------------------------------------------------------


@functools.cache
def cpu_int4_kernel_error(capability: str):
    """None if `_weight_int4pack_mm_for_cpu` multiplies a probe matrix correctly under this
    capability, else what went wrong: checked once per process, so int4 never prints garbage."""
    generator = torch.Generator().manual_seed(0)
    N, K, G = (
        48,
        128,
        32,
    )  # one full 32-row block and a tail, on every packed layout (quantize.CPU_INT4_LAYOUTS)
    q = torch.randint(0, 16, (N, K), generator=generator, dtype=torch.int32)
    scales, zeros = (
        torch.rand(N, K // G, generator=generator) + 0.5,
        torch.randn(N, K // G, generator=generator),
    )
    x = torch.randn(3, K, generator=generator)
    w = (q.reshape(N, K // G, G).float() - 8) * scales[..., None] + zeros[
        ..., None
    ]  # (q - 8) * scale + zero per group
    ref = x @ w.reshape(N, K).T  # [3, N]
    try:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        sz = torch.stack([scales, zeros], dim=2).transpose(0, 1).contiguous()  # [K/G, N, 2]
        for rows in (1, 3):
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x[:rows], packed, G, sz)
            if not torch.allclose(y, ref[:rows], atol=1e-3 * ref.abs().max().item(), rtol=0):
                return f"its result at {rows} row(s) differs from the dequantized reference"
    except (RuntimeError, NotImplementedError) as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0]}"
    return None
