"""speedups/paged_flex.py: FlexAttention over the paged pool in place against paged.py's gathered
SDPA reference, group by group (prefill chunks after earlier context, one-token rows, rows of
different lengths sharing a step), with windows, soft-capping, sinks and grouped heads; and the
engine's greedy tokens with it."""

import pytest
import torch

from paged import PagedKVCache
from speedups.paged_flex import PagedFlex

Hkv, G, D, BS = 2, 3, 16, 4


def caches(n_blocks, dtype, compiled=False):
    ref = PagedKVCache(1, n_blocks, BS, Hkv, D, dtype, transpose_k=False)
    flex = PagedKVCache(1, n_blocks, BS, Hkv, D, dtype)  # transposed until read_in_place
    flex.read_in_place(PagedFlex(compiled=compiled, cuda=False))
    return ref, flex


def attend_both(ref, flex, groups, T_total, pos, layer_args, dtype, gen):
    """One step of the given groups in both caches, same q/k/v -> (ref out, flex out)."""
    H = Hkv * G
    q = torch.randn(1, T_total, H, D, generator=gen).to(dtype)
    k = torch.randn(1, T_total, Hkv, D, generator=gen).to(dtype)
    v = torch.randn(1, T_total, Hkv, D, generator=gen).to(dtype)
    outs = []
    for cache in (ref, flex):
        with cache.step_groups(groups):
            outs.append(cache.attend(0, q, k, v, pos, *layer_args))
    return outs


def shuffled_tables(R, W, n_blocks, gen):
    """Each row's W blocks, distinct and scattered over the pool (never the null block)."""
    ids = 1 + torch.randperm(n_blocks - 1, generator=gen)[: R * W]
    return ids.view(R, W)


@pytest.mark.parametrize(
    "window, softcap, sinks, dtype",
    [
        (0, 0.0, False, torch.float32),
        (6, 0.0, False, torch.float32),
        (0, 30.0, True, torch.float32),
        (5, 20.0, True, torch.bfloat16),
    ],
)
def test_flex_equals_gathered_reference_over_prefill_and_decode(window, softcap, sinks, dtype):
    gen = torch.Generator().manual_seed(0)
    R, W, n_blocks = 3, 8, 40
    ref, flex = caches(n_blocks, dtype)
    table = shuffled_tables(R, W, n_blocks, gen)
    sink = torch.randn(Hkv * G, generator=gen) if sinks else None
    args = (window, softcap, sink)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    lengths = [9, 5, 13]  # each row's prompt, prefilled as a group of its own
    for r, n in enumerate(lengths):
        pos = torch.arange(n)[None]
        a, b = attend_both(ref, flex, [(1, n, table[r : r + 1])], n, pos, args, dtype, gen)
        torch.testing.assert_close(b, a, atol=tol, rtol=tol)
    for step in range(6):  # all rows decode together, each at its own position
        pos = torch.tensor([[n + step] for n in lengths])
        a, b = attend_both(ref, flex, [(R, 1, table)], R, pos.view(1, R), args, dtype, gen)
        torch.testing.assert_close(b, a, atol=tol, rtol=tol)
    # a mixed step: two decode rows, then a chunk of 5 continuing row 0's context
    pos = torch.tensor([[lengths[1] + 6, lengths[2] + 6] + list(range(15, 20))])
    groups = [(2, 1, table[1:]), (1, 5, table[:1])]
    a, b = attend_both(ref, flex, groups, 7, pos, args, dtype, gen)
    torch.testing.assert_close(b, a, atol=tol, rtol=tol)
    assert not torch.equal(a[0, :2], a[0, 2:4])  # the rows' outputs differ: a real comparison


def test_flex_masks_padding_rows_and_stays_within_each_rows_blocks():
    """A padding row (the null block at position 0) and two rows whose tables share a prefix
    block (prefix caching): each query sees its own table's blocks only."""
    gen = torch.Generator().manual_seed(1)
    ref, flex = caches(24, torch.float32)
    shared = torch.tensor([[5, 7, 0, 0], [5, 9, 0, 0], [0, 0, 0, 0]])
    pos = torch.tensor([[0, 1, 2, 3]])
    a, b = attend_both(ref, flex, [(1, 4, shared[:1])], 4, pos, (0, 0.0, None), torch.float32, gen)
    torch.testing.assert_close(b, a)
    pos = torch.tensor([[5, 6, 0]])  # rows 0 and 1 at their own positions, row 2 padding
    rows = shared.clone()
    a, b = attend_both(ref, flex, [(3, 1, rows)], 3, pos, (0, 0.0, None), torch.float32, gen)
    torch.testing.assert_close(b[:, :2], a[:, :2])  # a padding row's output is never read ...
    assert torch.isfinite(b[:, 2]).all()  # ... but must not spread NaNs


def test_compiled_flex_reads_the_masks_blocks_only_and_agrees():
    """Compiled FlexAttention reads only the BlockMask's blocks (eager scores the whole pool), so
    the mask's block lists are checked here: a slot it left out would change the result."""
    gen = torch.Generator().manual_seed(2)
    ref, flex = caches(48, torch.float32, compiled=True)
    table = shuffled_tables(2, 8, 48, gen)
    for r, n in enumerate((11, 17)):
        pos = torch.arange(n)[None]
        args = (8, 0.0, None)
        a, b = attend_both(ref, flex, [(1, n, table[r : r + 1])], n, pos, args, torch.float32, gen)
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    pos = torch.tensor([[11, 17]])
    a, b = attend_both(ref, flex, [(2, 1, table)], 2, pos, (8, 0.0, None), torch.float32, gen)
    torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    # a chunk whose first query sees a block whole that its last query's window has left
    pos = torch.arange(12, 18)[None]
    a, b = attend_both(ref, flex, [(1, 6, table[:1])], 6, pos, (8, 0.0, None), torch.float32, gen)
    torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)


def test_engine_with_flex_gives_each_request_its_alone_tokens(tmp_path):
    """The engine's steps (prefill chunks beside decodes, prefix hits) all read through PagedFlex:
    float64, so equal tokens are exact."""
    from helpers import alone, tiny_checkpoint

    from engine import Engine, RequestParams
    from formats import weights

    model, _ = weights.load(tiny_checkpoint(tmp_path), dtype=torch.float64)
    prompts = [[3 + i, 8, 13, 21 + i] * (2 + i) for i in range(4)] + [[3, 8, 13, 21] * 2 + [5]]
    news = [9, 6, 11, 7, 8]
    engine = Engine.for_model(
        model, num_blocks=60, block_size=4, max_num_seqs=4, max_num_batched_tokens=8
    )
    engine.cache.read_in_place(PagedFlex(compiled=False, cuda=False))
    greedy = [RequestParams(max_new_tokens=n, temperature=0.0, ignore_eos=True) for n in news]
    out = engine.run_batch(prompts, greedy)
    assert [o["tokens"] for o in out] == [alone(model, p, n) for p, n in zip(prompts, news)]
    assert engine.scheduler.stats["prompt_tokens_hit"] > 0


def test_paged_attention_choices():
    """--paged_attention: auto keeps CPU's in-place one-token kernel; gather drops it; flex reads
    the pool in place (K re-laid as V's); a latent cache is always gathered; a typo is named."""
    from cpu_kernels import PagedDecodeInPlace
    from speedups.paged_flex import choose

    def cache(latent=0):
        return PagedKVCache(
            1, 8, 4, 1 if latent else 2, 8, decode=PagedDecodeInPlace(), latent=latent
        )

    auto, gather, flex, latent = cache(), cache(), cache(), cache(latent=6)
    choose(auto, "auto")
    choose(gather, "gather")
    choose(flex, "flex")
    choose(latent, "flex")
    assert isinstance(auto.decode, PagedDecodeInPlace) and auto.in_place is None
    assert gather.decode is None and gather.in_place is None and gather.transpose_k
    assert isinstance(flex.in_place, PagedFlex) and flex.decode is None and not flex.transpose_k
    assert flex.k[0].shape == flex.v[0].shape == (8, 4, 2, 8)
    assert latent.in_place is None and latent.decode is None
    with pytest.raises(ValueError, match="expected one of auto, flex, gather"):
        choose(cache(), "flash")


def test_compiled_flex_over_a_long_chunk_beside_decode_rows_and_padding():
    """One step of two groups, compiled: a chunk of 140 queries (two query blocks of the mask)
    continuing a row's context under a window, and three one-token rows, the last of them
    padding (the null block at position 0)."""
    gen = torch.Generator().manual_seed(3)
    ref, flex = caches(160, torch.float32, compiled=True)
    table = shuffled_tables(3, 48, 160, gen)
    table[2] = 0  # the padding row
    args = (24, 0.0, None)
    pos = torch.arange(0, 20)[None]  # the chunk row's first 20 tokens, and the decode row's
    for r in (0, 1):
        a, b = attend_both(
            ref, flex, [(1, 20, table[r : r + 1])], 20, pos, args, torch.float32, gen
        )
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    pos = torch.tensor([[20, 0, 0] + list(range(20, 160))])  # decode rows 1 and 2, then the chunk
    groups = [(3, 1, table[[1, 2, 2]]), (1, 140, table[:1])]
    a, b = attend_both(ref, flex, groups, 143, pos, args, torch.float32, gen)
    torch.testing.assert_close(b[:, :1], a[:, :1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(b[:, 3:], a[:, 3:], atol=1e-5, rtol=1e-5)
    assert torch.isfinite(b).all()


def test_a_table_wider_than_the_pool():
    """CUDA graphs pad every table to one width (speedups/cuda_graphs.py), which a small pool may
    not reach: only the row's own blocks are read."""
    gen = torch.Generator().manual_seed(4)
    ref, flex = caches(8, torch.float32)
    table = torch.tensor([[3, 5, 1] + [0] * 13])  # 16 entries over a pool of 8 blocks
    pos = torch.arange(10)[None]
    q, k, v = (torch.randn(1, 10, h, D, generator=gen) for h in (Hkv * G, Hkv, Hkv))
    with ref.step_groups([(1, 10, table[:, :3])]):  # the reference reads the row's own width
        a = ref.attend(0, q, k, v, pos)
    with flex.step_groups([(1, 10, table)]):
        b = flex.attend(0, q, k, v, pos)
    torch.testing.assert_close(b, a)
