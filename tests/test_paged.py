"""paged.py: the paged cache gives the static cache's logits; the block allocator's prefix cache
(reference counts, chained hashes, leaf-first LRU eviction) keeps its invariants under random
use."""

import pytest
import torch
from helpers import check_allocator, tiny_checkpoint
from hypothesis import given, settings
from hypothesis import strategies as st

import compiling
import generate
from formats import weights
from kv_cache import StaticKVCache
from memory import plan_blocks
from paged import BlockAllocator, NoFreeBlocks, PagedKVCache, bucket
from sampling import SamplingParams


@pytest.fixture(scope="module")
def tiny64(tmp_path_factory):
    """The tiny model in float64: exact comparisons never flip on near-ties."""
    model, _ = weights.load(
        tiny_checkpoint(tmp_path_factory.mktemp("paged-tiny")), dtype=torch.float64
    )
    return model


@pytest.mark.isa
def test_ragged_flat_batch_equals_static_cache_per_request(tiny64):
    """Three requests of 5, 19 and 33 tokens: one flattened prefill step (a group each), then six
    decode steps as one group of 3 rows at different positions; every logit equals the same
    request alone in a static cache."""
    model, bs = tiny64, 4
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 250, (n,), generator=g) for n in (5, 19, 33)]
    cache = PagedKVCache.for_model(model, num_blocks=64, block_size=bs)
    tables = [list(range(1 + 16 * i, 17 + 16 * i)) for i in range(3)]  # 16 blocks each, disjoint
    statics = [StaticKVCache.for_model(model, 1, 64) for _ in prompts]

    def table(rows, width):
        return torch.tensor([t[:width] for t in rows])

    with torch.no_grad():
        cache.groups = [
            (1, len(p), table([t], bucket(-(-len(p) // bs)))) for p, t in zip(prompts, tables)
        ]
        tokens = torch.cat(prompts)[None]
        pos = torch.cat([torch.arange(len(p)) for p in prompts])[None]
        ends = torch.tensor([4, 4 + 19, 4 + 19 + 33])
        paged = model(tokens, pos, cache, keep=ends)[0]
        for i, p in enumerate(prompts):
            static = model(p[None], torch.arange(len(p))[None], statics[i])[0, -1]
            torch.testing.assert_close(paged[i], static, rtol=0, atol=1e-10)
        nxt = paged.argmax(-1)
        lengths = [len(p) for p in prompts]
        for step in range(6):
            cache.groups = [(3, 1, table(tables, bucket(-(-(max(lengths) + 1) // bs))))]
            paged = model(nxt[None], torch.tensor([lengths]), cache)[0]
            for i in range(3):
                static = model(nxt[i].view(1, 1), torch.tensor([[lengths[i]]]), statics[i])[0, -1]
                torch.testing.assert_close(paged[i], static, rtol=0, atol=1e-10)
            nxt, lengths = paged.argmax(-1), [n + 1 for n in lengths]


def test_generate_paged_equals_static(tiny64):
    """generate.py's loop on PagedKVCache.for_batch: the static cache's tokens, batch of 2."""
    prompt = torch.tensor([[5, 9, 11, 3, 7], [8, 2, 6, 4, 1]])
    out = []
    for cache in (
        StaticKVCache.for_model(tiny64, 2, 64),
        PagedKVCache.for_batch(tiny64, 2, 64, block_size=8),
    ):
        rows, _ = generate.generate(
            tiny64, cache, prompt, 30, SamplingParams(0.0), generate.DecodeOptions(ignore_eos=True)
        )
        out.append(rows)
    assert out[0] == out[1] and len(out[0][0]) == 30


@pytest.mark.isa
def test_compiled_paged_decode_equals_eager(tiny64):
    """The compiled one-token step (the in-place read, embedding_bag as an ATen call inside
    Inductor's graph) gives eager's tokens."""
    import torch._dynamo

    torch._dynamo.reset()
    prompt = torch.tensor([[5, 9, 11, 3, 7]] * 2)
    eager, _ = generate.generate(
        tiny64,
        PagedKVCache.for_batch(tiny64, 2, 64, 8),
        prompt,
        20,
        SamplingParams(0.0),
        generate.DecodeOptions(ignore_eos=True),
    )
    with torch._dynamo.config.patch(error_on_recompile=True):
        fn = compiling.compile_decode("cpu", autotune=False)
        compiled, _ = generate.generate(
            tiny64,
            PagedKVCache.for_batch(tiny64, 2, 64, 8),
            prompt,
            20,
            SamplingParams(0.0),
            generate.DecodeOptions(ignore_eos=True, decode_fn=fn),
        )
    assert compiled == eager


def test_leaf_first_lru_eviction():
    """Chains 1-2-3 and 4-5 cached and unreferenced, the first chain used least recently: blocks
    go tail first (3, 2, 1), then 5, 4 - never a block whose child is still cached."""
    a = BlockAllocator(num_blocks=6, block_size=2)
    chains = [[(1, 2), (3, 4), (5, 6)], [(7, 8), (9, 9)]]
    for chain in chains:
        blocks, parent = [], None
        for toks in chain:
            b = a.allocate()
            parent = a.register(b, parent, toks, blocks[-1] if blocks else None)
            blocks.append(b)
        for b in blocks:
            a.release(b)
    assert a.num_available() == 5 and not a.free
    order = [a.allocate() for _ in range(5)]
    assert order == [3, 2, 1, 5, 4]
    with pytest.raises(NoFreeBlocks):
        a.allocate()
    check_allocator(a)


def test_a_request_that_repeats_a_cached_one_can_use_every_available_block():
    """A's chain of 5 blocks is cached and unused; B shares its first 2, then writes the same tokens
    into blocks of its own (each a copy of A's, left unnamed) while eviction takes A's tail. Naming
    B's copy of block 5 under A's block 4 would pin A's 4 and 3 (a cached child): counted as
    available, never evictable. B must get every block num_available counts."""
    a = BlockAllocator(num_blocks=8, block_size=2)
    chain = [(1, 2), (3, 4), (5, 6), (7, 8), (9, 10)]
    blocks, parent = [], None
    for toks in chain:
        blocks.append(a.allocate())
        parent = a.register(blocks[-1], parent, toks, blocks[-2] if len(blocks) > 1 else None)
    for b in blocks:
        a.release(b)
    hit, hashes = a.lookup_prefix([t for toks in chain for t in toks], 2)
    for b in hit:
        a.share(b)
    parent, mine = hashes[-1], list(hit)
    for toks in chain[2:]:  # B decodes A's tokens again, a block at a time
        mine.append(a.allocate())
        parent = a.register(mine[-1], parent, toks, mine[-2])
    assert a.num_available() == 2
    assert a.allocate_many(2) is not None
    check_allocator(a)


def test_copies_of_a_prefix_another_request_holds_name_nothing_under_it():
    """A and B prefill the same 3 blocks in one step: A's are named, B's stay unnamed copies. B's
    fourth block must not be named under A's third, which B does not hold: once A finishes, A's
    chain would be counted as available yet never evictable while B runs."""
    a = BlockAllocator(num_blocks=8, block_size=2)
    chain = [(1, 2), (3, 4), (5, 6)]
    first, second = [], []
    for owner in (first, second):
        parent = None
        for toks in chain:
            owner.append(a.allocate())
            parent = a.register(owner[-1], parent, toks, owner[-2] if len(owner) > 1 else None)
    second.append(a.allocate())
    a.register(second[-1], parent, (7, 8), second[-2])
    for b in first:  # A finishes
        a.release(b)
    assert a.num_available() == 3 and not a.free
    assert a.allocate_many(3) is not None
    check_allocator(a)


def test_a_windowed_pool_evicts_behind_the_window_and_hits_on_the_window_alone():
    """window 8, blocks of 4: a sequence frees its oldest blocks first, so they are evicted first
    though their children are cached; a cached prefix of 6 blocks whose first ones are gone is
    still a hit of 24 tokens, taking only the blocks the next token sees ((24 - 8) // 4 = 4 on; 0
    before); a missing block inside that window leaves no hit."""
    a = BlockAllocator(num_blocks=8, block_size=4, window=8)
    tokens, chain, parent = list(range(30)), [], None
    for i in range(6):
        chain.append(a.allocate())
        parent = a.register(chain[-1], parent, tokens[4 * i : 4 * i + 4], chain[-2] if i else None)
    for b in chain:  # the sequence ends: all 6 cached, unused
        a.release(b)
    assert a.num_available() == 7
    assert (
        a.allocate_many(4) is not None
    )  # the free block, then the 3 oldest though they have cached children
    check_allocator(a)
    hit, hashes = a.lookup_prefix(tokens, 7)
    assert hit == [0, 0, 0, 0] + chain[4:6] and len(hashes) == 6
    assert a.lookup_prefix(tokens, 5) == (
        [0, 0, 0] + chain[3:5],
        hashes[:5],
    )  # 20 tokens: blocks 3 and 4
    for b in (chain[3], chain[5]):  # used again: chain[4] is now the least recently used
        a.share(b)
        a.release(b)
    assert a.allocate() == chain[4]
    assert a.lookup_prefix(tokens, 7) == ([], [])
    check_allocator(a)


def test_lookup_reuses_longest_cached_prefix_only():
    a = BlockAllocator(num_blocks=8, block_size=2)
    parent, blocks = None, []
    for toks in [(1, 2), (3, 4)]:
        blocks.append(a.allocate())
        parent = a.register(blocks[-1], parent, toks, blocks[-2] if len(blocks) > 1 else None)
    assert a.lookup_prefix([1, 2, 3, 4, 5], 2)[0] == [1, 2]
    assert a.lookup_prefix([1, 2, 3, 9, 5], 2)[0] == [1]  # diverges in the second block
    assert a.lookup_prefix([9, 2, 3, 4], 2)[0] == []  # same second block, different head: no hit
    assert a.lookup_prefix([1, 2, 3, 4], 1)[0] == [1]  # capped


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("new"), st.lists(st.integers(0, 2), min_size=1, max_size=9)),
        st.tuples(st.just("free"), st.integers(0, 20)),
        st.tuples(st.just("fork"), st.integers(0, 20)),
    ),
    max_size=40,
)


@settings(max_examples=150, deadline=None, derandomize=True)
@given(OPS)
def test_allocator_invariants_under_random_use(ops):
    """Sequences arrive (reusing cached prefixes, registering full blocks), fork (sharing every
    block) and finish, on a pool of 10 blocks. After every operation: reference counts equal the
    number of live owners (never negative, a block shared only when counted so), a newly
    allocated block is never one a live sequence holds, the state counts agree; at the end every
    block is available again."""
    bs = 2
    a = BlockAllocator(num_blocks=10, block_size=bs)
    live = []  # block lists of live sequences
    for op, arg in ops:
        if op == "new":
            hit, hashes = a.lookup_prefix(arg, (len(arg) - 1) // bs)
            for b in hit:
                a.share(b)
            blocks = list(hit)
            need = -(-len(arg) // bs) - len(blocks)
            if need > a.num_available():
                for b in blocks:
                    a.release(b)
                continue
            for _ in range(need):
                b = a.allocate()
                assert all(b not in owned for owned in live), (
                    "allocated a block a live sequence holds"
                )
                blocks.append(b)
            parent = hashes[-1] if hashes else None
            for i in range(len(hashes), len(arg) // bs):  # register the full blocks just computed
                parent = a.register(
                    blocks[i], parent, arg[i * bs : (i + 1) * bs], blocks[i - 1] if i else None
                )
            live.append(blocks)
        elif live and op == "free":
            for b in live.pop(arg % len(live)):
                a.release(b)
        elif live and op == "fork":
            blocks = list(live[arg % len(live)])
            for b in blocks:
                a.share(b)
            live.append(blocks)
        check_allocator(a)
        owners = [0] * a.num_blocks
        for blocks in live:
            for b in blocks:
                owners[b] += 1
        assert owners == a.ref
    for blocks in live:
        for b in blocks:
            a.release(b)
    check_allocator(a)
    assert a.num_available() == a.num_blocks - 1 and a.num_used() == 0


def test_memory_plan_arithmetic(tiny64):
    """bytes per block = 2 * layers * block_size * kv_heads * head_dim * bytes; the pool fits the
    budget."""
    a = tiny64.config
    per_block = 2 * a.n_layers * 16 * a.n_kv_heads * a.head_dim * 8
    n, window_blocks, line = plan_blocks(tiny64, 16, memory_bytes=100 * per_block + 5)
    assert (
        n == 100
        and window_blocks == 0
        and f"{per_block} bytes per block" in line
        and f"{99 * 16} tokens" in line
    )
    assert plan_blocks(tiny64, 16, num_blocks=7)[0] == 7
    assert plan_blocks(tiny64, 16, max_tokens=40)[0] == 1 + 3  # capped at what 40 tokens can use
    n, _, line = plan_blocks(
        tiny64, 16, memory_bytes=100 * per_block + 5, draft=tiny64
    )  # a draft's pool beside it
    assert n == 50 and f"the draft model's pool: {per_block} bytes per block" in line
    with pytest.raises(ValueError, match="at least 2"):
        plan_blocks(tiny64, 16, memory_bytes=per_block)


def test_gpu_memory_plan_leaves_the_kv_pool_what_the_rest_does_not_take():
    """--gpu_memory_utilization's arithmetic (memory.gpu_kv_budget; a GPU run measures its
    inputs): 0.9 of 80 GiB = 72 GiB, less 14 GiB of weights, 3 GiB of activations and 1 GiB of
    graphs, leaves 54 GiB, unless less is free."""
    from memory import gpu_kv_budget

    G = 2**30
    kv, line = gpu_kv_budget(80 * G, 70 * G, 0.9, 14 * G, 3 * G, 1 * G)
    assert kv == 54 * G
    assert "90% of 80.0 GiB = 72.0 GiB" in line and "KV cache 54.0 GiB" in line
    assert gpu_kv_budget(80 * G, 40 * G, 0.9, 14 * G, 3 * G, 1 * G)[0] == 36 * G  # others' memory
    with pytest.raises(ValueError, match="nothing left for the KV cache.*--gpu_memory_utilization"):
        gpu_kv_budget(16 * G, 16 * G, 0.9, 14 * G, 1 * G, G // 2)
