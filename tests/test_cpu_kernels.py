"""cpu_kernels.py: every CPU fast kernel against the plain reference it stands in for (a cache built
with decode=None, SDPA, F.linear, the int4 formula), float64 where the kernel computes in it."""

import pytest
import torch
import torch.nn.functional as F

import cpu_kernels
import quantize
import runtime
from kv_cache import StaticKVCache
from paged import PagedKVCache
from speedups.kv_int8 import Int8KVCache, quantize_per_token


def rel_error(y, ref):
    return ((y.float() - ref.float()).norm() / ref.float().norm()).item()


TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}


# ---- one-token attention over a static cache -------------------------------------------------


@pytest.mark.isa
@pytest.mark.parametrize("int8", [False, True])
def test_decode_attention_equals_sdpa(int8):
    torch.manual_seed(0)
    B, Hkv, H, S, D = 2, 2, 6, 40, 16
    q, k, v = torch.randn(B, 1, H, D), torch.randn(B, Hkv, S, D), torch.randn(B, Hkv, S, D)
    mask = torch.arange(S) <= torch.tensor([17, 39])[:, None, None, None]  # [B, 1, 1, S]
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k, v, attn_mask=mask, enable_gqa=True
    )
    if int8:
        (kq, ks), (vq, vs) = quantize_per_token(k), quantize_per_token(v)
        y = cpu_kernels.decode_attention(q, kq, vq, mask, ks, vs)
        assert rel_error(y, ref.transpose(1, 2)) < 0.01
    else:
        torch.testing.assert_close(
            cpu_kernels.decode_attention(q, k, v, mask), ref.transpose(1, 2), atol=1e-5, rtol=1e-5
        )


@pytest.mark.isa
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_grouped_decode_attention_equals_sdpa(dtype):
    """The bf16 one-token route of static_decode (two grouped matmuls) against SDPA in float64 on
    the same values; on a slice of a longer cache, as StaticKVCache.attend passes it."""
    g = torch.Generator().manual_seed(0)
    B, Hkv, H, S, D = 3, 2, 6, 64, 16
    q = torch.randn(B, 1, H, D, generator=g).to(dtype)
    k, v = (torch.randn(B, Hkv, S + 8, D, generator=g).to(dtype) for _ in range(2))
    mask = torch.arange(S) <= torch.tensor([0, 17, 63])[:, None, None, None]  # [B, 1, 1, S]
    y = cpu_kernels.grouped_decode_attention(q, k[:, :, :S], v[:, :, :S], mask)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.double().transpose(1, 2),
        k[:, :, :S].double(),
        v[:, :, :S].double(),
        attn_mask=mask,
        enable_gqa=True,
    )
    tol = 1e-12 if dtype == torch.float64 else 2e-2
    torch.testing.assert_close(y.double(), ref.transpose(1, 2), atol=tol, rtol=tol)


def static_pair(cls, B, Hkv, S, D, dtype):
    """The same cache twice: the reference (decode=None) and with the CPU kernel for_model picks."""
    return cls(1, B, Hkv, S, D, dtype), cls(
        1, B, Hkv, S, D, dtype, decode=cpu_kernels.static_decode
    )


@pytest.mark.isa
@pytest.mark.parametrize("cls", [StaticKVCache, Int8KVCache])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
def test_static_decode_equals_the_cache_reference(cls, dtype):
    """Eager one-token steps, batch 2 at different positions, through StaticKVCache.attend with
    decode=None and with cpu_kernels.static_decode: the same outputs, over prefixes that end past
    the positions written (128 of 320 slots, a multiple of 256, the whole cache) and across 128."""
    g = torch.Generator().manual_seed(0)
    B, Hkv, H, S, D = 2, 2, 6, 320, 16
    caches = static_pair(cls, B, Hkv, S, D, dtype)
    q, k, v = (torch.randn(B, 100, n, D, generator=g).to(dtype) for n in (H, Hkv, Hkv))
    for c in caches:  # a prefill through the reference (T > 1): identical contents in both
        c.attend(0, q, k, v, torch.arange(100).expand(B, 100))
    starts, lengths = torch.tensor([[100], [110]]), set()
    for step, (n, round_up) in enumerate(
        [(128, True), (128, False), (None, True), (200, True)] * 2
    ):
        q, k, v = (
            torch.randn(B, 1, n_heads, D, generator=g).to(dtype) for n_heads in (H, Hkv, Hkv)
        )
        lengths |= {c.use_positions(n, round_up) for c in caches}
        ref, fast = (c.attend(0, q, k, v, starts + step) for c in caches)
        torch.testing.assert_close(fast.double(), ref.double(), atol=TOL[dtype], rtol=TOL[dtype])
    assert lengths == {128, 256, S}


def exact_int8(shape, g, dtype):
    """Values per_token quantization keeps exactly (integers of one power-of-two step, 127 in each
    vector): compiled and eager writes then hold the same int8 bytes."""
    x = torch.randint(-127, 128, shape, generator=g).to(dtype)
    x[..., 0] = 127
    return x / 16


@pytest.mark.isa
@pytest.mark.parametrize("cls", [StaticKVCache, Int8KVCache])
def test_compiled_one_token_kernels_equal_the_cache_reference(cls):
    """Under torch.compile a one-token step takes decode_attention (StaticKVCache through
    static_decode up to FUSED_DECODE_MAX_SLOTS; Int8KVCache always, on its int8 bytes and scales):
    equal to the eager reference (decode=None: SDPA, after dequantizing for int8) over the same
    cache in float64, at a prefix past the positions written (128 of 192 slots) and the whole
    cache."""
    import torch._dynamo
    import torch._inductor.config

    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    B, Hkv, H, S, D = 2, 2, 6, 192, 16
    ref, fast = static_pair(cls, B, Hkv, S, D, torch.float64)
    q, k, v = (
        torch.randn(B, 40, H, D, generator=g).double(),
        exact_int8((B, 40, Hkv, D), g, torch.float64),
        exact_int8((B, 40, Hkv, D), g, torch.float64),
    )
    for c in (ref, fast):
        c.attend(0, q, k, v, torch.arange(40).expand(B, 40))
    step = torch.compile(
        lambda c, q, k, v, pos: c.attend(0, q, k, v, pos), fullgraph=True, dynamic=False
    )
    with torch._inductor.config.patch({"cpp.simdlen": runtime.inductor_vector_bits()}):
        for n, at in ((128, [[40], [60]]), (None, [[41], [150]])):
            q = torch.randn(B, 1, H, D, generator=g).double()
            k, v = (
                exact_int8((B, 1, Hkv, D), g, torch.float64),
                exact_int8((B, 1, Hkv, D), g, torch.float64),
            )
            ref.use_positions(n), fast.use_positions(n)
            want, got = (
                ref.attend(0, q, k, v, torch.tensor(at)),
                step(fast, q, k, v, torch.tensor(at)),
            )
            assert all(torch.equal(a, b) for a, b in zip(ref.tensors(), fast.tensors()))
            torch.testing.assert_close(
                got, want, atol=1e-5, rtol=1e-5
            )  # decode_attention computes in float32


# ---- one-token attention over a paged pool ----------------------------------------------------


@pytest.mark.isa
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_rows_read_in_place_equal_attention_over_each_rows_own_tokens(dtype):
    """One-token rows read K and V where they lie in the pool (F.embedding_bag, whose float32 and
    bf16 kernels depend on the instruction set): equal to attention computed in float64 over the
    tokens each row's block table lists, one token at a time. Rows of different lengths, blocks
    out of order, 6 query heads on 2 KV heads."""
    g = torch.Generator().manual_seed(0)
    R, H, Hkv, D, bs, W = 5, 6, 2, 16, 4, 4
    cache = PagedKVCache(1, 1 + R * W, bs, Hkv, D, dtype, decode=cpu_kernels.PagedDecodeInPlace())
    for pool in cache.tensors():
        pool.copy_(torch.randn(pool.shape, generator=g))
    table = (1 + torch.randperm(R * W, generator=g)).view(R, W)
    pos = torch.tensor([[0], [3], [7], [12], [15]])  # the new token's position in each row
    q, k, v = (torch.randn(R, 1, n, D, generator=g).to(dtype) for n in (H, Hkv, Hkv))
    cache.groups = [(R, 1, table)]
    y = cache.attend(0, q, k, v, pos)  # writes k, v at pos, then attends over positions 0..pos
    for r in range(R):
        n = int(pos[r]) + 1
        blocks, offsets = table[r, torch.arange(n) // bs], torch.arange(n) % bs
        keys = cache.k[0][blocks, :, :, offsets].double()  # [n, Hkv, D]
        values = cache.v[0][blocks, offsets].double()
        assert torch.equal(keys[-1], k[r, 0].double()) and torch.equal(values[-1], v[r, 0].double())
        for h in range(H):
            p = torch.softmax(keys[:, h // (H // Hkv)] @ q[r, 0, h].double() / D**0.5, dim=0)
            want = p @ values[:, h // (H // Hkv)]
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(y[r, 0, h].double(), want, rtol=tol, atol=tol)


@pytest.mark.isa
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_paged_decode_in_place_equals_the_cache_reference(dtype):
    """PagedKVCache.attend with decode=None (gather the blocks, SDPA) and with
    cpu_kernels.PagedDecodeInPlace, on the same pools: the same outputs for one-token rows of
    ragged lengths, at table widths past the blocks in use (entries at the null block) and after
    the table is changed in place (the kernel's cached indices must follow), over several layers."""
    g = torch.Generator().manual_seed(0)
    R, H, Hkv, D, bs, layers = 4, 6, 2, 8, 4, 3
    ref = PagedKVCache(layers, 1 + R * 8, bs, Hkv, D, dtype)
    fast = PagedKVCache(
        layers, 1 + R * 8, bs, Hkv, D, dtype, decode=cpu_kernels.PagedDecodeInPlace()
    )
    for a, b in zip(ref.tensors(), fast.tensors()):
        a.copy_(torch.randn(a.shape, generator=g))
        b.copy_(a)
    blocks = (1 + torch.randperm(R * 8, generator=g)).view(R, 8)
    lengths = torch.tensor(
        [1, 6, 13, 20]
    )  # tokens already in each row; the new one goes at this position
    for width in (8, 16, 8):  # 16: half the entries point at the null block
        table = torch.zeros(R, width, dtype=torch.long)
        table[:, :8] = blocks
        for step in range(3):
            if step == 2:  # the same table object, edited: a row's last blocks swapped
                table[3, 5], table[3, 6] = table[3, 6].clone(), table[3, 5].clone()
            pos = (lengths + step)[:, None]
            ref.groups = fast.groups = [(R, 1, table)]
            for layer in range(layers):
                q, k, v = (torch.randn(R, 1, n, D, generator=g).to(dtype) for n in (H, Hkv, Hkv))
                want, got = ref.attend(layer, q, k, v, pos), fast.attend(layer, q, k, v, pos)
                torch.testing.assert_close(
                    got.double(), want.double(), atol=TOL[dtype], rtol=TOL[dtype]
                )
        lengths = lengths + 3
    assert all(torch.equal(a, b) for a, b in zip(ref.tensors(), fast.tensors()))


@pytest.mark.isa
def test_paged_decode_in_place_reads_a_hybrids_two_tables_and_follows_their_edits():
    """A hybrid cache (layers 0 and 2 windowed, in a pool of their own): each layer reads its
    pool's half of the [2, R, W] table; the kernel keeps both halves' indices (views of one
    tensor) for the step, and builds them again when the table is edited in place."""
    g = torch.Generator().manual_seed(0)
    R, H, Hkv, D, bs, layers, dtype = 3, 4, 2, 8, 4, 3, torch.float32
    ref, fast = (
        PagedKVCache(
            layers,
            1 + R * 4,
            bs,
            Hkv,
            D,
            dtype,
            decode=d,
            window_layers=(0, 2),
            window_blocks=1 + R * 3,
        )
        for d in (None, cpu_kernels.PagedDecodeInPlace())
    )
    for a, b in zip(ref.tensors(), fast.tensors()):
        a.copy_(torch.randn(a.shape, generator=g))
        b.copy_(a)
    table = torch.stack(
        [
            (1 + torch.randperm(R * 4, generator=g)).view(R, 4),
            (1 + torch.randperm(R * 3, generator=g)).view(R, 3).repeat(1, 2)[:, :4],
        ]
    )  # [2, R, 4]
    for step in range(3):
        if step == 2:  # edited in place: the windowed layers' rows swap
            table[1] = table[1].flip(0).clone()
        pos = torch.tensor([[2], [7], [13]]) + step
        ref.groups = fast.groups = [(R, 1, table)]
        for layer in range(layers):
            q, k, v = (torch.randn(R, 1, n, D, generator=g) for n in (H, Hkv, Hkv))
            torch.testing.assert_close(
                fast.attend(layer, q, k, v, pos),
                ref.attend(layer, q, k, v, pos),
                atol=1e-5,
                rtol=1e-5,
            )
        assert fast.decode._bag_cache[0] is table and len(fast.decode._bag_cache[2]) == 2
    assert all(torch.equal(a, b) for a, b in zip(ref.tensors(), fast.tensors()))


# ---- GEMM row padding ------------------------------------------------------------------------


def test_large_gemms_see_few_row_counts():
    """The dequantize + GEMM path (128 rows and more) pads its rows to a multiple of
    cpu_kernels.GEMM_ROWS in bf16, so that oneDNN builds and keeps few kernels (one per shape):
    every row count from 128 to 160 reaches the GEMM as 128, 144 or 160 rows, with each row's result
    that of its own product."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = set()

    class Rows(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
                seen.add(args[-2].shape[0])
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    layer = quantize.make_layer(
        quantize.portable_tensors(torch.randn(64, 256) * 0.05, "int4", 64),
        None,
        "int4",
        64,
        torch.bfloat16,
        "cpu",
    )
    w = layer.dequantize().to(torch.bfloat16)
    for rows in range(128, 161):
        x = torch.randn(rows, 256).to(torch.bfloat16)
        with Rows():
            y = layer(x)
        assert y.shape == (rows, 64)
        torch.testing.assert_close(y.float(), (x.float() @ w.float().T), atol=2e-2, rtol=2e-2)
    assert seen == {128, 144, 160}


def test_padded_linear_equals_f_linear(monkeypatch):
    """gemm_padding's rule (bf16/fp16 on CPU from 128 rows: up to a multiple of 16), and
    padded_linear against F.linear with the rule forced onto float64: each row its own product."""
    assert [
        cpu_kernels.gemm_padding(n, torch.bfloat16, "cpu") for n in (1, 127, 128, 129, 143, 144)
    ] == [0, 0, 0, 15, 1, 0]
    assert (
        cpu_kernels.gemm_padding(130, torch.float32, "cpu")
        == 0
        == cpu_kernels.gemm_padding(130, torch.bfloat16, "cuda")
    )
    monkeypatch.setattr(cpu_kernels, "GEMM_PAD_DTYPES", (torch.float64,))
    g = torch.Generator().manual_seed(0)
    w = torch.randn(24, 32, generator=g, dtype=torch.float64)
    for rows in (1, 127, 128, 129, 150, 160):
        x = torch.randn(rows, 32, generator=g, dtype=torch.float64)
        y = cpu_kernels.padded_linear(x, w)
        assert y.shape == (rows, 24)
        torch.testing.assert_close(y, F.linear(x, w), atol=1e-12, rtol=1e-12)


# ---- the CPU int4 kernel's probe -------------------------------------------------------------


@pytest.mark.isa
def test_cpu_int4_kernel_passes_its_load_time_probe():
    assert cpu_kernels.cpu_int4_kernel_error(runtime.cpu_capability()) is None


def test_the_int4_probe_reports_a_wrong_or_missing_kernel(monkeypatch):
    """The probe is not vacuous: a kernel whose result is off by 1% fails it, and one that raises
    is reported by its error (uncached calls: the real kernel's verdict stays cached)."""
    probe, real = (
        cpu_kernels.cpu_int4_kernel_error.__wrapped__,
        torch.ops.aten._weight_int4pack_mm_for_cpu,
    )
    monkeypatch.setattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu", lambda *a: real(*a) * 1.01)
    assert probe("test") == "its result at 1 row(s) differs from the dequantized reference"

    def missing(*a):
        raise NotImplementedError("no kernel for this CPU\nmore detail")

    monkeypatch.setattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu", missing)
    assert probe("test") == "NotImplementedError: no kernel for this CPU"


# ---- an int4 layer unpacked a row block at a time --------------------------------------------


@pytest.mark.isa
@pytest.mark.parametrize(
    "N, chunk", [(256, 64), (320, 64), (256, 128), (144, 64)]
)  # (16 tail rows)
def test_int4_dense_by_row_blocks_equals_the_whole_unpack(N, chunk):
    """Int4Linear.dense, the large-row path's weight (quantize.int4_large_m), unpacks the kernel's
    private layout a block of rows at a time: bit-equal to dequantize() of the whole matrix on this
    machine's layout, and the layer's many-row output through it equals F.linear on it."""
    K = 128
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(N)) * 0.02
    layer = quantize.Int4Linear(
        quantize.portable_tensors(w, "int4", 32), None, torch.bfloat16, 32, "cpu"
    )
    whole = layer.dequantize().to(torch.bfloat16)
    assert torch.equal(layer.dense(torch.bfloat16, chunk, least=0), whole)
    x = torch.randn(300, K, dtype=torch.bfloat16)
    torch.testing.assert_close(layer(x), F.linear(x, whole), atol=1e-2, rtol=1e-2)
