"""The paged KV cache's memory plan: how many blocks each pool gets, and the lines the engine logs
about it (paged.py holds the blocks, scheduler.py hands them out).

    num_blocks, window_blocks, lines = plan_blocks(model, block_size=16, memory_bytes=2 << 30)
    allocator, window_allocator, cache = pools(model, num_blocks, 16, window_blocks=window_blocks)

One pool of blocks serves every layer, unless the model mixes sliding-window layers with full
ones (Gemma 2 / 3: a hybrid). Then the windowed layers get a pool of their own, window_blocks,
which never needs more than every running sequence's window and one step's prefill chunks can
hold at once (`window_pool_cap`): the memory beyond that goes to the full layers' pool, where a
sequence keeps every block. A model windowed on every layer keeps one pool whose sequences hold
at most window / block_size + 2 blocks each.
"""

from kv_cache import kv_bytes_per_token
from paged import BlockAllocator, PagedKVCache
from runtime import available_memory
from scheduler import blocks_for


def bytes_per_block(model, block_size: int, n_layers: int = None) -> int:
    c = model.config  # (n_layers: those of one pool of a hybrid cache)
    return block_size * kv_bytes_per_token(
        n_layers or c.n_layers, c.n_kv_heads, c.head_dim, model.norm.weight.dtype
    )


def windowed_layers(config) -> list:
    return [i for i in range(config.n_layers) if config.window(i)]


def is_hybrid(config) -> bool:
    """Windowed layers and full ones: two pools (paged.PagedKVCache's window_blocks)."""
    return 0 < len(windowed_layers(config)) < config.n_layers


def window_pool_cap(config, block_size: int, max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """The most blocks a hybrid's windowed layers hold at once: per running sequence its window's
    window / block_size + 2 and one more where a prefill chunk starts, the chunks' own tokens'
    blocks, and the null block."""
    return (
        1
        + max_num_seqs * (config.sliding_window // block_size + 3)
        + blocks_for(max_num_batched_tokens, block_size)
    )


def pools(
    model,
    num_blocks: int,
    block_size: int,
    prefix_caching: bool = True,
    window_blocks: int = None,
    max_num_seqs: int = 64,
    max_num_batched_tokens: int = 512,
):
    """(allocator, the windowed layers' allocator or None, paged.PagedKVCache) for num_blocks, and
    for a hybrid model window_blocks (None: as many as they can use, at most num_blocks; 0: no pool
    of their own, they keep every block in the full layers')."""
    c = model.config
    if window_blocks is None:
        window_blocks = min(
            num_blocks, window_pool_cap(c, block_size, max_num_seqs, max_num_batched_tokens)
        )
    least = min(
        num_blocks, window_pool_cap(c, block_size, 1, max_num_batched_tokens)
    )  # one sequence's window and chunk
    if is_hybrid(c) and 0 < window_blocks < least:
        raise ValueError(
            f"a windowed layers' pool of {window_blocks} blocks cannot hold one sequence's window of "
            f"{c.sliding_window} tokens and a {max_num_batched_tokens}-token chunk: give at least {least}"
        )
    cache = PagedKVCache.for_model(
        model, num_blocks, block_size, window_blocks
    )  # (its window_blocks: 0 unless hybrid)
    # a window on every layer, or a hybrid's windowed pool: blocks behind the window are freed as
    # sequences grow
    window = c.sliding_window if len(windowed_layers(c)) == c.n_layers else 0
    allocator = BlockAllocator(num_blocks, block_size, prefix_caching, window)
    n = cache.window_blocks
    windows = BlockAllocator(n, block_size, prefix_caching, c.sliding_window) if n else None
    return allocator, windows, cache


def plan_blocks(
    model,
    block_size: int,
    num_blocks: int = None,
    memory_bytes: int = None,
    memory_fraction: float = 0.2,
    max_tokens: int = None,
    max_num_seqs: int = 64,
    max_num_batched_tokens: int = 512,
    draft=None,
):
    """(num_blocks, window_blocks, the lines serving engines log): blocks of the pool every layer
    uses (a hybrid's full layers), and of a hybrid's windowed layers (else 0).

    num_blocks wins; else memory_bytes; else memory_fraction of the memory free now, capped at
    what max_tokens (e.g. max_num_seqs * context) could ever use. draft: a draft model whose own
    pool has a block for each of these (speedups/draft_model.py), so the memory holds both."""
    c, windowed = model.config, windowed_layers(model.config)
    hybrid = is_hybrid(c)
    n_full = (
        c.n_layers - len(windowed) if hybrid else c.n_layers
    )  # the layers of the pool every sequence keeps whole
    full_bytes = bytes_per_block(model, block_size, n_full)
    window_bytes = bytes_per_block(model, block_size, len(windowed)) if hybrid else 0
    cap = window_pool_cap(c, block_size, max_num_seqs, max_num_batched_tokens) if hybrid else 0
    extra = bytes_per_block(draft, block_size) if draft is not None else 0
    if num_blocks is None:
        device = model.norm.weight.device
        budget = (
            memory_bytes
            if memory_bytes is not None
            else int(available_memory(str(device)) * memory_fraction)
        )
        num_blocks = budget // (
            full_bytes + window_bytes + extra
        )  # the windowed pool as large as the full one ...
        if num_blocks > cap:  # ... up to its cap; the rest of the budget is the full pool's
            num_blocks = (budget - cap * window_bytes) // (full_bytes + extra)
        if memory_bytes is None and max_tokens:
            num_blocks = min(num_blocks, 1 + blocks_for(max_tokens, block_size))
    if num_blocks < 2:
        raise ValueError(
            f"the KV memory given holds {num_blocks} blocks of {full_bytes + window_bytes} bytes; "
            "at least 2 are needed"
        )
    window_blocks = min(num_blocks, cap)
    lines = (
        f"KV cache: {full_bytes} bytes per block (2 * {n_full} {'full ' * hybrid}layers * {block_size} tokens * "
        f"{c.n_kv_heads} kv heads * {c.head_dim} dims * {model.norm.weight.element_size()} bytes) | {num_blocks} "
        f"blocks = {num_blocks * full_bytes / 2**20:.1f} MiB | {(num_blocks - 1) * block_size} tokens "
        f"(block 0 is the null block)"
    ) + (
        f" | the draft model's pool: {extra} bytes per block, {num_blocks * extra / 2**20:.1f} MiB"
        if extra
        else ""
    )
    return (
        num_blocks,
        window_blocks,
        lines + window_lines(c, block_size, num_blocks, window_blocks, window_bytes or full_bytes),
    )


def window_lines(
    config, block_size: int, num_blocks: int, window_blocks: int, window_bytes: int
) -> str:
    """The plan's line on sliding windows: what they save in the paged cache, or ''."""
    n, w, most = (
        len(windowed_layers(config)),
        config.sliding_window,
        config.sliding_window // block_size + 2,
    )
    if not n:
        return ""
    if n == config.n_layers:
        return (
            f"\nsliding window of {w} tokens on every layer: a sequence holds at most {most} blocks "
            f"({most * window_bytes / 2**20:.1f} MiB) however long it grows; older blocks are freed"
        )
    return (
        f"\nsliding window of {w} tokens on {n} of {config.n_layers} layers: their own pool of {window_blocks} "
        f"blocks of {window_bytes} bytes = {window_blocks * window_bytes / 2**20:.1f} MiB, where a sequence holds "
        f"at most {most} however long it grows (kept whole, they would take "
        f"{(num_blocks - window_blocks) * window_bytes / 2**20:.1f} MiB more)"
    )
