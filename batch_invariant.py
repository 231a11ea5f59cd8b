"""Batch-invariant steps: a request's tokens are the same whatever it is batched with.

Floating-point sums depend on their order, and an engine picks its kernels by the shape of the
whole step. So in the default engine a greedy request can change its text when other requests
run beside it, though each row's maths is the same. Three things did it
(tests/test_batch_invariant.py; benchmarks/RESULTS.md, "Batch-invariant greedy decoding"):

  1. int4 layers on CPU switch from the int4 kernel to dequantize + GEMM at quantize.INT4_LARGE_M
     rows: a decode row beside a 700-token prefill is computed by the other route;
  2. a one-row float product takes another kernel (GEMV) whose sums differ from a many-row one's;
  3. attention reductions run over a width set by others: eager decode rows over their group's
     gathered blocks by embedding_bag, prefill chunks by SDPA's flash kernel over the chunk's last
     block, so where the scheduler cut a prompt (its share of the step's budget) changed its keys.

The quantized kernels (int8, int4) give a row the same bits at any row count. A float product
does not: oneDNN picks its kernel and blocking by the shape of the whole call, and on Xeons with
AMX a dense bf16 layer's row changed with the step's row count (AMX tiles for some counts, AVX-512
for others, whose sums round differently). So the mode keeps every row's arithmetic a function of
the row alone, on every CPU kind:

  - int4 layers take one route at every row count (the int4 kernel), and every float matrix
    (nn.Linear, GGUF groups dequantized for F.linear) runs in blocks of exactly ROWS rows, the
    last padded with zeros (`fixed_rows`): one shape per layer, so one kernel and one blocking,
    whatever the step's rows (ROWS x the weight's bytes are re-read per block: the cost);
  - every query row, decode or prompt, attends with the same `attention` (its products in blocks of
    ROWS rows too), over a width that follows its own position: kv_cache.bucket(p // block_size + 1)
    blocks. engine.py groups decode rows by it and cuts prefill chunks where it changes (`pieces`).

A token's K/V then has the same bits whether it was computed as a decode or inside any prefill
chunk, so preemption and prefix-cache hits keep the invariance too. Proven for CPU in bfloat16
(`check` refuses the rest: float32's vector maths round an element by where it falls against a
vector's tail; CUDA's GEMMs split by shape; an expert of a mixture may get one row). It costs
speed (benchmarks/RESULTS.md, "Batch-invariant greedy decoding": the int4 kernel on many rows,
attention by matmuls rather than the flash kernel or reading blocks in place), eager steps only,
and on sliding-window layers decode rows read their whole context, not just the window's blocks.

    .venv/bin/python serve.py --batch_invariant
"""

import sys

import torch
import torch.nn.functional as F

import quantize
from kv_cache import bucket

ROWS = 16  # the rows of every float product under the mode: an AMX tile's height
_SAVED = {}


def check(model):
    """ValueError unless the mode is proven for this model where it runs (see above)."""
    w, c = model.norm.weight, model.config
    if w.device.type != "cpu" or w.dtype != torch.bfloat16 or c.moe:
        raise ValueError(
            f"--batch_invariant is proven on CPU in bfloat16 for dense models; this model runs on "
            f"{w.device.type} in {str(w.dtype).removeprefix('torch.')}"
            + (" with experts" if c.moe else "")
        )


def enable(model, cache):
    """The mode for `model` over its paged `cache`: every int4 layer of the process takes the int4
    kernel at any row count (a constant of quantize.py, so every model of the process: a server
    holds one), and the cache attends through `attention` (no one-token kernel, no window read)."""
    check(model)
    one_int4_route()
    for m in float_layers(model):
        if not getattr(m.forward, "fixed_rows", False):  # once, though two engines share a model
            m.forward = fixed_rows(m.forward)
    cache.attention, cache.decode = attention, None


def float_layers(model) -> list:
    """The modules whose product is a float GEMM: nn.Linear, or int8 groups dequantized for
    F.linear."""
    kernel = (quantize.Int4Linear, quantize.Int8Linear)
    return [
        m
        for m in model.modules()
        if hasattr(m, "in_features")
        and not isinstance(m, kernel)
        and getattr(m, "pair", None) is None
    ]


def fixed_rows(forward):
    """forward(x [..., K]) -> [..., N] run on blocks of exactly ROWS rows, the last padded with
    zeros: every call has one shape, so the row's sums do not follow the step's row count."""

    def blocks(x):
        x2 = x.reshape(-1, x.shape[-1])  # [M, K]
        M = x2.shape[0]
        x2 = F.pad(x2, (0, 0, 0, -M % ROWS))  # [ceil(M / ROWS) * ROWS, K]
        ys = [forward(block) for block in x2.split(ROWS)]  # a decode step: one block, no copy
        y = (ys[0] if len(ys) == 1 else torch.cat(ys))[:M]  # [M, N]
        return y.view(*x.shape[:-1], y.shape[-1])

    blocks.fixed_rows = True
    return blocks


def one_int4_route():
    _SAVED.setdefault("INT4_LARGE_M", quantize.INT4_LARGE_M)
    quantize.INT4_LARGE_M = sys.maxsize


def disable():
    """Undo `one_int4_route` (tests, benchmarks)."""
    for name, value in _SAVED.items():
        setattr(quantize, name, value)
    _SAVED.clear()


def pieces(start: int, n: int, block_size: int) -> list:
    """A prefill chunk of positions start..start+n-1 cut where its queries' attend width changes
    -> [(tokens, width in blocks)]: each query's width is bucket(p // block_size + 1)."""
    out, p = [], start
    while p < start + n:
        width = bucket(p // block_size + 1)
        end = min(start + n, width * block_size)  # the last position this width holds, plus one
        out.append((end - p, width))
        p = end
    return out


def attention(q, k, v, mask, softcap=0.0, sinks=None):
    """softmax(q k^T / sqrt(D) + mask) v as two batched matmuls whose rows are (query, head in the
    KV head's group), cut into blocks of ROWS rows (the last padded): every product has ROWS rows
    and a batch of two or more (oneDNN splits a reduction across threads only in a batch of one),
    so a row's bits do not depend on how many queries share the call. Softcap (Gemma 2) and sinks
    (gpt-oss) as kv_cache.attention defines them.

    q [R, T, H, D]; k [R, Hkv, L, D], v [R, Hkv, L, Dv]; mask [R, 1, T, L] -> [R, T, H, Dv]"""
    R, T, H, D = q.shape
    Hkv, L = k.shape[1], k.shape[2]
    G = H // Hkv
    if R * Hkv * -(-T * G // ROWS) == 1:  # a batch of one product: twice, one kept (see above)
        two = attention(
            torch.cat((q, q)),
            torch.cat((k, k)),
            torch.cat((v, v)),
            torch.cat((mask, mask)),
            softcap,
            sinks,
        )
        return two[:R]
    qg = q.reshape(R, T, Hkv, G, D).permute(0, 2, 1, 3, 4).reshape(R, Hkv, T * G, D)  # rows (t, g)
    scores = in_blocks(qg, k.transpose(-1, -2))  # [R, Hkv, T*G, L]
    scores = scores.to(torch.promote_types(scores.dtype, torch.float32)) * D**-0.5
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.view(R, Hkv, T, G, L).masked_fill(~mask[:, :, :, None], float("-inf"))
    if sinks is not None:  # [H] -> one more column per row, dropped after the softmax
        column = sinks.view(1, Hkv, 1, G, 1).expand(R, Hkv, T, G, 1).to(scores.dtype)
        p = torch.softmax(torch.cat((scores, column), -1), dim=-1)[..., :L]
    else:
        p = torch.softmax(scores, dim=-1)
    y = in_blocks(p.reshape(R, Hkv, T * G, L).to(v.dtype), v)  # [R, Hkv, T*G, Dv]
    Dv = v.shape[-1]  # D but for a latent cache (model.MLAttention: V is K's first values)
    return y.view(R, Hkv, T, G, Dv).permute(0, 2, 1, 3, 4).reshape(R, T, H, Dv)


def in_blocks(a, b):
    """a [R, Hkv, M, K] @ b [R, Hkv, K, N] -> [R, Hkv, M, N], a's rows in blocks of ROWS, the
    last padded with zeros: one batched matmul of [ROWS, K] x [K, N] products."""
    R, Hkv, M, K = a.shape
    blocks = -(-M // ROWS)
    a = F.pad(a, (0, 0, 0, blocks * ROWS - M)).view(R, Hkv, blocks, ROWS, K)
    y = torch.matmul(a, b[:, :, None])  # [R, Hkv, blocks, ROWS, N]
    return y.view(R, Hkv, blocks * ROWS, -1)[:, :, :M]
