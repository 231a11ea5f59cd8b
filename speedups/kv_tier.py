"""A second tier for the prefix cache: KV blocks the pool evicts are kept (in host memory, or in a
folder on disk: speedups/kv_disk.py) and loaded back into the pool when a prompt's prefix misses
the pool but hits the tier, instead of being computed again; on disk they outlive the process.

    engine = Engine.for_model(model, num_blocks=512, tier=HostTier(16 * 2**30))
    python serve.py --kv_disk_cache ~/.cache/llm-kv --kv_disk_cache_size 20GiB

A block is named by the prefix cache's chained hash (paged.BlockAllocator.chain_hash: stable
across processes), so equal names mean equal whole prefixes; an entry also holds its parent's hash
and its own tokens, checked on every read, so a collision is a miss. Its size is the pool's:

    bytes per block = 2 * layers * kv_heads * head_dim * block_size * bytes per element
    (SmolLM2-135M in bf16: 30 * 2 * 3 * 64 * 16 * 2 = 368,640 bytes, 23 KiB a token; a hybrid's
    pools: the same over their own layers)

A hybrid model (Gemma 2/3, windowed Qwen2) has two pools, its full layers' and its windowed
layers'; each keeps its own blocks in the tier (Tier.name), and a prefix loaded back needs the
full layers' blocks from its start but the windowed layers' for its last window only (Tier.extend:
a windowed block missing there ends the prefix before it).

The scheduler (host only) asks `extend` while admitting a request and plans the loads; the engine
copies evicted blocks out (`put`) and loaded ones in before the step's forward.
"""

import json
from collections import OrderedDict

from runtime import log

VERSION = 1  # the file layout's: a file of another version is skipped
STATS = (  # engine.metrics() and /metrics report these (server/engine_loop.py)
    "tier_blocks_read",
    "tier_blocks_written",
    "tier_blocks_dropped",
    "tier_bytes_read",
    "tier_bytes_written",
    "tier_bytes",
    "tier_blocks_read_ahead",  # of tier_blocks_read: read while their request waited
)


def fingerprint(model, block_size: int, kv_dtype) -> str:
    """What a block's bytes depend on: the weights (64 values sampled across every tensor, and
    every shape and dtype), the config, the block size, the KV dtype and the device type. 16 hex
    digits."""
    import hashlib
    from dataclasses import asdict

    h = hashlib.blake2b(digest_size=8)
    config = asdict(model.config)
    device = model.norm.weight.device.type
    h.update(json.dumps([config, block_size, str(kv_dtype), device, VERSION], default=str).encode())
    for name, t in model.state_dict().items():
        h.update(f"{name}{tuple(t.shape)}{t.dtype}".encode())
        flat = t.detach().reshape(-1)
        h.update(flat[:: max(1, len(flat) // 64)][:64].float().cpu().numpy().tobytes())
    return h.hexdigest()


class Tier:
    """What every tier shares: its blocks' names, and which of a prompt's blocks it supplies."""

    expected = None  # [((k shape, dtype), (v shape, dtype))] per pool: Engine.for_model's

    def name(self, h: int, pool: int) -> int:
        """A block's name here: its prefix-cache hash for a one-pool model's (every layer); a
        hybrid's pools hold other layers, so theirs chain one more token, -1 - pool."""
        if len(self.expected or ()) < 2:
            return h
        from paged import BlockAllocator

        return BlockAllocator.chain_hash(h, (-1 - pool,))

    def holds(self, h: int, pool: int) -> bool:
        """Whether a pool's block h is here (a probe: fetch may still find it bad)."""
        raise NotImplementedError

    def extend(self, seq, pools, loads) -> int:
        """Lengthen seq's prefix hit (its tables, hashes and num_computed, as the pools' lookup set
        them) with the blocks this tier holds, and the pools' own cached ones past the hit, as far
        as the pools have room; returns the tokens gained (recomputed without the tier). Loaded
        blocks go to `loads` (block, (k, v), pool). A block that fails its checks when read is
        gone from the tier, so the hit is sought again."""
        bs = pools[0].block_size
        start, most = len(seq.hashes), (len(seq.tokens) - 1) // bs
        if seq.num_computed != start * bs or most <= start:  # (prompt scoring cut the hit)
            return 0
        chain = prefix_chain(seq.tokens[start * bs :], seq.last_hash, bs, most - start)
        for _ in range(3):
            end = self.reach(pools, chain, start, most)
            while end > start and (short := _shortfall(pools, chain, start, end)) > 0:
                end = self.reach(pools, chain, start, end - short)
            if end <= start:
                return 0
            picks = [{} for _ in pools]  # per pool: block index -> cached block or (k, v)
            for p, a in enumerate(pools):
                for i in range(max(start, window_start(a, end)), end):
                    picks[p][i] = _cached(a, *chain[i - start]) or self.fetch(*chain[i - start], p)
            if all(src is not None for pick in picks for src in pick.values()):
                return self._take(seq, pools, picks, chain, start, end, loads)
        return 0

    def reach(self, pools, chain, start: int, upper: int) -> int:
        """How many blocks of the prompt (chain: its blocks from `start` on) the pools and this
        tier hold together, at most `upper`: a full pool needs every block from `start` to the
        end, a windowed one only those of the end's last window (walked newest first: a gap ends
        the hit before it; a hybrid has one windowed pool). Probes only; reads nothing."""
        end = upper
        for p, a in [(p, a) for p, a in enumerate(pools) if not a.window]:
            for i in range(start, end):
                if not (_cached(a, *chain[i - start]) or self.holds(chain[i - start][0], p)):
                    end = i
                    break
        for p, a in [(p, a) for p, a in enumerate(pools) if a.window]:
            i = end - 1
            while i >= max(start, window_start(a, end)):
                if not (_cached(a, *chain[i - start]) or self.holds(chain[i - start][0], p)):
                    end = i
                i -= 1
        return end

    def _take(self, seq, pools, picks, chain, start: int, end: int, loads) -> int:
        """seq's tables extended to `end` blocks: picked cached blocks shared, the others new
        blocks named in their pool's prefix cache and queued for loading, each with one more
        reference, the plan's, until loaded; the blocks behind a window released. All or none:
        0 if a pool lacks the room."""
        tables = [seq.blocks, seq.window_blocks][: len(pools)]
        wanted = [
            [(i, picks[p][i]) for i in range(max(start, window_start(a, end)), end)]
            for p, a in enumerate(pools)
        ]
        for a, want in zip(pools, wanted):
            for _, b in [w for w in want if isinstance(w[1], int)]:
                a.share(b)
        loaded = [[s for _, s in want if not isinstance(s, int)] for want in wanted]
        got = [a.allocate_many(len(kvs)) for a, kvs in zip(pools, loaded)]
        if None in got:
            for a, want, blocks in zip(pools, wanted, got):
                for b in [s for _, s in want if isinstance(s, int)] + (blocks or []):
                    a.release(b)
            return 0
        for p, (a, table, want, new) in enumerate(zip(pools, tables, wanted, got)):
            for i in range(min(window_start(a, end), len(table))):  # behind the new hit's window
                if table[i]:
                    a.release(table[i])
                    table[i] = 0
            table += [0] * (want[0][0] - len(table)) if want else []
            for i, src in want:
                if not isinstance(src, int):
                    b, (_, parent, tokens) = new.pop(0), chain[i - start]
                    a.register(b, parent, tokens, table[-1] if table else None)
                    a.share(b)  # the plan's reference
                    loads.append((b, src, p))
                    src = b
                table.append(src)
        seq.hashes += [h for h, _, _ in chain[: end - start]]
        seq.num_computed = end * pools[0].block_size
        return (end - start) * pools[0].block_size


class HostTier(Tier):
    """Blocks kept in host memory (pinned when the pool is on a GPU), least recently used dropped
    beyond `capacity` bytes."""

    def __init__(self, capacity: int, pin: bool = False):
        self.capacity, self.pin, self.entries = capacity, pin, OrderedDict()
        self.stats = dict.fromkeys(STATS, 0)

    def put(self, h: int, parent, tokens, k, v, pool: int = 0, wait: bool = False):
        """A block evicted from a pool: k, v its tensors, copied to the host here (never raises:
        a block that cannot be kept is only not kept)."""
        h = self.name(h, pool)
        if h in self.entries:
            self.entries.move_to_end(h)
            return
        try:
            k, v = (
                t.to("cpu").pin_memory() if self.pin else t.to("cpu", copy=True) for t in (k, v)
            )
        except Exception as e:  # out of (pinned) memory
            log(f"warning: the KV host tier could not keep a block ({type(e).__name__}: {e})")
            return
        self.entries[h] = (parent, tuple(tokens), k, v)
        self.stats["tier_bytes"] += kv_nbytes(k, v)
        self.stats["tier_bytes_written"] += kv_nbytes(k, v)
        self.stats["tier_blocks_written"] += 1
        while self.stats["tier_bytes"] > self.capacity and self.entries:
            *_, k0, v0 = self.entries.popitem(last=False)[1]
            self.stats["tier_bytes"] -= kv_nbytes(k0, v0)

    def holds(self, h: int, pool: int) -> bool:
        return self.name(h, pool) in self.entries

    def fetch(self, h: int, parent, tokens, pool: int = 0):
        """(k, v) of the pool's block with this hash, parent and tokens, or None (an entry of
        this name that is not, another prefix's or another layout's, goes)."""
        h = self.name(h, pool)
        entry = self.entries.get(h)
        if entry is None:
            return None
        if entry[:2] != (parent, tuple(tokens)) or not fits(self, pool, *entry[2:]):
            self.stats["tier_bytes"] -= kv_nbytes(*self.entries.pop(h)[2:])
            return None
        self.entries.move_to_end(h)
        self.stats["tier_blocks_read"] += 1
        self.stats["tier_bytes_read"] += kv_nbytes(*entry[2:])
        return entry[2:]

    def prefetch(self, request, pools):
        pass  # (already in memory)

    def close(self):
        pass  # (host memory ends with the process)


class HostOverDisk(Tier):
    """Host memory in front of a disk folder (`--kv_host_cache` with `--kv_disk_cache`): a block
    the pool evicts goes to both (the disk's write queued), a fetch tries host memory first and
    the folder second, and a restart finds the folder's."""

    def __init__(self, host: HostTier, disk):
        self.host, self.disk = host, disk

    @property
    def stats(self) -> dict:
        """The two tiers' STATS summed, and the blocks each served (hits per tier)."""
        both = {k: self.host.stats.get(k, 0) + self.disk.stats.get(k, 0) for k in STATS}
        both["tier_host_blocks_read"] = self.host.stats["tier_blocks_read"]
        both["tier_disk_blocks_read"] = self.disk.stats["tier_blocks_read"]
        return both

    @property
    def expected(self):
        return self.host.expected

    @expected.setter
    def expected(self, shapes):
        self.host.expected = self.disk.expected = shapes

    def put(self, h: int, parent, tokens, k, v, pool: int = 0, wait: bool = False):
        self.host.put(h, parent, tokens, k, v, pool)
        self.disk.put(h, parent, tokens, k, v, pool, wait)

    def holds(self, h: int, pool: int) -> bool:
        return self.host.holds(h, pool) or self.disk.holds(h, pool)

    def fetch(self, h: int, parent, tokens, pool: int = 0):
        got = self.host.fetch(h, parent, tokens, pool)
        return got or self.disk.fetch(h, parent, tokens, pool)

    def prefetch(self, request, pools):
        self.disk.prefetch(request, pools)

    def close(self):
        self.disk.close()


def keep_pool(engine):
    """At the end of a run: every block the pools still cache into the engine's tier too (the
    tier held only what was evicted), then the tier closed: a restart finds them all."""
    tier = engine.scheduler.tier
    if tier is None:
        return
    tier = tier.disk if isinstance(tier, HostOverDisk) else tier
    if isinstance(tier, HostTier):  # host memory ends with the process
        return
    for pool, a in enumerate(engine.scheduler.pools):
        for block, h in list(a.hash_of.items()):
            tier.put(h, *a.key[block], *engine.cache.block_kv(block, pool), pool, wait=True)
    tier.close()


def _cached(allocator, h: int, parent, tokens):
    """The allocator's cached block holding block h (after `parent`, of `tokens`), or None."""
    block = allocator.cached.get(h)
    return block if block is not None and allocator.key[block] == (parent, tokens) else None


def _shortfall(pools, chain, start: int, end: int) -> int:
    """How many blocks more than it has room for some pool needs to take the hit to `end`: new
    ones, and cached ones no sequence holds (shared, they are no longer available). The blocks a
    windowed pool would release behind the new window are not counted: they free later."""
    short = 0
    for a in pools:
        held = [_cached(a, *chain[i - start]) for i in range(max(start, window_start(a, end)), end)]
        takes = sum(b is None or a.ref[b] == 0 for b in held)
        short = max(short, takes - a.num_available())
    return short


def window_start(allocator, end: int) -> int:
    """The first block that a query after `end` blocks sees in the allocator's pool."""
    bs, window = allocator.block_size, allocator.window
    return max(0, (end * bs - window) // bs) if window else 0


def prefix_chain(tokens, root, block_size: int, n: int) -> list:
    """[(hash, parent hash, tokens)] of the first n blocks of `tokens`: the prefix cache's chain
    (paged.BlockAllocator.chain_hash) from `root`, the names the tier's blocks have."""
    from paged import BlockAllocator

    chain, parent = [], root
    for i in range(n):
        block = tuple(tokens[i * block_size : (i + 1) * block_size])
        chain.append((BlockAllocator.chain_hash(parent, block), parent, block))
        parent = chain[-1][0]
    return chain


def fits(tier, pool: int, k, v) -> bool:
    """Whether k, v have the shapes and dtypes of the pool's blocks (once the engine said them)."""
    shapes = ((k.shape, k.dtype), (v.shape, v.dtype))
    return tier.expected is None or (pool < len(tier.expected) and tier.expected[pool] == shapes)


def kv_nbytes(k, v) -> int:
    return k.numel() * k.element_size() + v.numel() * v.element_size()
