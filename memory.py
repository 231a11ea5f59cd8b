"""Memory: what the weights and the KV cache take, what the device has free, and the paged KV
cache's plan, how many blocks each pool gets (paged.py holds the blocks, scheduler.py hands them
out).

    num_blocks, window_blocks, lines = plan_blocks(model, block_size=16, memory_bytes=2 << 30)
    allocator, window_allocator, cache = pools(model, num_blocks, 16, window_blocks=window_blocks)
    print(memory_plan(model, cache))  # weights 1.2 GiB | KV cache 32.0 KiB/token x 4096 tokens ...

One pool of blocks serves every layer, unless the model mixes sliding-window layers with full
ones (Gemma 2 / 3: a hybrid). Then the windowed layers get a pool of their own, window_blocks,
which never needs more than every running sequence's window and one step's prefill chunks can
hold at once (`window_pool_cap`): the memory beyond that goes to the full layers' pool, where a
sequence keeps every block. A model windowed on every layer keeps one pool whose sequences hold
at most window / block_size + 2 blocks each.
"""

import argparse
import resource

import torch

from kv_cache import NoCache, bucket, kv_bytes_per_token
from paged import BlockAllocator, PagedKVCache
from runtime import human
from scheduler import blocks_for


def available_memory(device: str) -> int:
    """Bytes free on the device now: CUDA's free memory, or the OS's MemAvailable on CPU."""
    if str(device).startswith("cuda"):
        return torch.cuda.mem_get_info()[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30


def parse_size(text: str) -> int:
    """'2GiB', '512MiB', '1.5GB', '1000000' -> bytes."""
    units = {
        "": 1,
        "b": 1,
        "kb": 1e3,
        "mb": 1e6,
        "gb": 1e9,
        "kib": 2**10,
        "mib": 2**20,
        "gib": 2**30,
    }
    t = text.strip().lower()
    number = t.rstrip("bikmg")
    try:
        return int(float(number) * units[t[len(number) :]])
    except (KeyError, ValueError):
        raise argparse.ArgumentTypeError(
            f"cannot read {text!r} as a size (e.g. 2GiB, 512MiB, 1GB)"
        ) from None


def reset_peak_memory(device: str):
    if str(device).startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    else:
        try:  # Linux: "5" resets this process's peak resident set size (VmHWM)
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass


def release_memory():
    """Hand freed heap pages back to the OS (glibc's malloc_trim). Loading builds and frees many
    mid-sized temporaries; glibc keeps them, so the resident size would stay at the load's peak."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


def peak_memory_bytes(device: str) -> int:
    """Peak GPU memory allocated, or on CPU the process's peak resident set size."""
    if str(device).startswith("cuda"):
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def step_peak(model, n_tokens: int, logits_rows: int = 1) -> int:
    """Bytes one forward of n_tokens allocates beyond what is held, at its peak (CUDA): measured
    once, before the KV pool exists, with attention over the step's own tokens (kv_cache.NoCache;
    with windows or soft-capping its scores are T x T, more than the engine's attention holds);
    logits_rows: the rows whose logits the step keeps (a decode step keeps all)."""
    device = model.norm.weight.device
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    held = torch.cuda.memory_allocated(device)
    tokens = torch.zeros(1, n_tokens, dtype=torch.long, device=device)
    pos = torch.arange(n_tokens, device=device)[None]
    keep = torch.arange(n_tokens - logits_rows, n_tokens, device=device)
    with torch.no_grad():
        if model.lm_head is None:  # an embedding model: its final states, no logits
            model.norm(model.forward_layers(model.embed(tokens), pos, NoCache(), model.layers))
        else:
            model(tokens, pos, NoCache(), keep=keep)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - held
    torch.cuda.empty_cache()  # (what it cached is free again for the plan that reads free memory)
    return peak


def graphs_bytes(model, rows: int, tokens_per_row: int) -> int:
    """An estimate of the CUDA graphs' pool (speedups/cuda_graphs.py): the widest graph's step at
    its peak (the graphs share one pool) and every graph's logits, held as its static output
    (one graph per rows bucket up to `rows`, and per tokens per row: 1, and 1 + k speculating)."""
    widest = step_peak(model, rows * tokens_per_row, rows * tokens_per_row)
    per_row = model.config.vocab_size * model.norm.weight.element_size()
    buckets, n = [], 1
    while n <= rows:
        buckets.append(n)
        n = bucket(n + 1)
    return widest + sum(buckets) * per_row * (1 + tokens_per_row if tokens_per_row > 1 else 1)


def gpu_kv_budget(total, free, utilization, held, activations, graphs):
    """(bytes for the KV pool, the plan's line), as vLLM's --gpu-memory-utilization: of
    utilization x the device's total, what this process holds (the weights), one step's
    activations at their peak and the CUDA graphs' pool come first; the KV pool gets the rest,
    never more than is free (other processes' memory is not ours)."""
    allowed = int(total * utilization)
    kv = min(allowed - held - activations - graphs, free - activations - graphs)
    line = (
        f"GPU memory: {utilization:.0%} of {human(total)} = {human(allowed)}: weights "
        f"{human(held)} + a step's activations {human(activations)} + CUDA graphs "
        f"{human(graphs)} + KV cache {human(max(kv, 0))}"
    )
    if kv <= 0:
        raise ValueError(
            f"{line}: nothing left for the KV cache ({human(free)} free now); raise "
            "--gpu_memory_utilization, lower --max_num_batched_tokens or --max_num_seqs, or "
            "quantize the weights"
        )
    return kv, line


def weights_line(model) -> str:
    """Weight bytes and the bytes a decode step reads (with experts: parameters, total and
    active)."""
    read = human(model.bytes_read_per_token())
    line = f"weights {human(model.weight_bytes())} ({read} read per step) | "
    if model.config.moe:  # moe.py: a step reads only the experts its tokens chose
        m, (total, active) = model.config.moe, model.config.moe.parameter_counts(model.config)
        line += (
            f"{total / 1e9:.2f}B parameters, {active / 1e9:.2f}B active per token "
            f"({m.n_experts_per_tok} of {m.n_experts} experts) | "
        )
    return line


def memory_plan(model, cache) -> str:
    """The line generate.py prints: weight bytes, and the KV cache as bytes per token x tokens."""
    weights = weights_line(model)
    if hasattr(cache, "block_size"):  # paged: the pool, block 0 being the null block
        per_block = cache.nbytes() / cache.num_blocks
        return weights + (
            f"paged KV cache {human(per_block / cache.block_size)}/token x {cache.block_size} "
            f"tokens per block x {cache.num_blocks} blocks = {human(cache.nbytes())}"
        )
    rings = [
        r for r in getattr(cache, "ring", ()) if r
    ]  # speedups/kv_window.py: windowed layers keep only their window
    if rings:
        full = sum(
            t.numel() * t.element_size() * cache.max_seq_len // t.shape[2] for t in cache.tensors()
        )
        return weights + (
            f"KV cache {human(cache.nbytes())}: {len(rings)} of {len(cache.ring)} layers windowed, "
            f"kept as rings of {max(rings)} slots ({human(full)} if every layer kept "
            f"{cache.max_seq_len} tokens x {cache.batch_size})"
        )
    per_token = cache.nbytes() / (cache.max_seq_len * cache.batch_size)
    return (
        weights
        + f"KV cache {human(per_token)}/token x {cache.max_seq_len} tokens x {cache.batch_size} "
        f"= {human(cache.nbytes())}" + _latent_note(model.config, cache)
    )


def _latent_note(c, cache) -> str:
    """For latent attention (model.MLAttention): what per-head K and V would have taken."""
    if not c.mla:
        return ""
    m, dtype = c.mla, model_dtype(cache)
    heads = c.n_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim)
    size = torch.tensor([], dtype=dtype).element_size()
    return (
        f" (a latent of {m.kv_lora_rank} + a rotary key of {m.qk_rope_head_dim} per token; "
        f"expanded heads: {human(c.n_layers * heads * size)}/token in "
        f"{str(dtype).removeprefix('torch.')})"
    )


def model_dtype(cache):
    """The activations' dtype a cache was made for (an int8 cache's scales are in it)."""
    return cache.k_scale[0].dtype if getattr(cache, "k_scale", None) else cache.k[0].dtype


# ---- the paged KV cache's plan ----------------------------------------------------------


def bytes_per_block(model, block_size: int, n_layers: int = None) -> int:
    c = model.config  # (n_layers: those of one pool of a hybrid cache)
    return block_size * kv_bytes_per_token(
        n_layers or c.n_layers, c.n_kv_heads, c.head_dim, model.norm.weight.dtype, bool(c.mla)
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
            f"a windowed layers' pool of {window_blocks} blocks cannot hold one sequence's window "
            f"of {c.sliding_window} tokens and a {max_num_batched_tokens}-token chunk: give at "
            f"least {least}"
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
    n_full = c.n_layers - len(windowed) if hybrid else c.n_layers  # the layers kept whole
    full_bytes = bytes_per_block(model, block_size, n_full)
    window_bytes = bytes_per_block(model, block_size, len(windowed)) if hybrid else 0
    cap = window_pool_cap(c, block_size, max_num_seqs, max_num_batched_tokens) if hybrid else 0
    extra = bytes_per_block(draft, block_size) if draft is not None else 0
    if num_blocks is None:
        budget = memory_bytes
        if budget is None:
            budget = int(available_memory(str(model.norm.weight.device)) * memory_fraction)
        num_blocks = budget // (full_bytes + window_bytes + extra)  # the windowed pool as large
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
    lines = plan_line(model, block_size, num_blocks, n_full if hybrid else 0, extra)
    lines += window_lines(c, block_size, num_blocks, window_blocks, window_bytes or full_bytes)
    return num_blocks, window_blocks, lines


def plan_line(model, block_size: int, num_blocks: int, n_full: int, extra: int) -> str:
    """The plan's first line: a block's bytes as the product of its sizes, the pool's MiB and
    tokens. n_full: a hybrid's full layers (0: not a hybrid); extra: a draft's bytes per block."""
    c = model.config
    layers = f"{n_full} full layers" if n_full else f"{c.n_layers} layers"
    per_block = bytes_per_block(model, block_size, n_full or c.n_layers)
    line = (
        f"KV cache: {per_block} bytes per block ({1 if c.mla else 2} * {layers} * {block_size} "
        f"tokens * "
        f"{c.n_kv_heads} kv heads * {c.head_dim} dims * {model.norm.weight.element_size()} bytes) "
        f"| {num_blocks} blocks = {num_blocks * per_block / 2**20:.1f} MiB | "
        f"{(num_blocks - 1) * block_size} tokens (block 0 is the null block)"
    )
    if extra:
        line += f" | the draft model's pool: {extra} bytes per block, "
        line += f"{num_blocks * extra / 2**20:.1f} MiB"
    return line


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
            f"\nsliding window of {w} tokens on every layer: a sequence holds at most {most} "
            f"blocks ({most * window_bytes / 2**20:.1f} MiB) however long it grows; older blocks "
            "are freed"
        )
    return (
        f"\nsliding window of {w} tokens on {n} of {config.n_layers} layers: their own pool of "
        f"{window_blocks} blocks of {window_bytes} bytes = "
        f"{window_blocks * window_bytes / 2**20:.1f} MiB, where a sequence holds at most {most} "
        "however long it grows (kept whole, they would take "
        f"{(num_blocks - window_blocks) * window_bytes / 2**20:.1f} MiB more)"
    )
