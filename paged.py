"""The paged KV cache: one pool of fixed-size blocks shared by all requests, read through block
tables, with prefix caching (vLLM's PagedAttention and automatic prefix caching, SGLang's
leaf-first eviction).

A static cache reserves `max_seq_len` slots per sequence up front, so most of its memory holds
nothing (the PagedAttention paper measured 20-38% of KV memory holding real tokens). Here the
memory is a pool of blocks of `block_size` tokens per layer; a sequence owns a list of block ids,
its block table, and grows one block at a time. Position p of a sequence lives at

    block = block_table[p // block_size],  offset = p % block_size
    (at most block_size - 1 slots wasted per sequence)

    k_pool[layer]  [num_blocks, Hkv, D, block_size]   (each block transposed for CPU's in-place
                                                       decode kernel, below; else as V's)
    v_pool[layer]  [num_blocks, block_size, Hkv, D]

Block 0 is the null block: never handed out, it is where padding tokens write and what unused
entries of a block table point at (they are read but masked, so what it holds never matters).

Batch layout. A ragged batch (decodes of one token next to prefill chunks of hundreds) is
flattened: tokens [1, N], every token of every sequence side by side, so the linear layers do no
work on padding. Attention is the one place that needs sequences apart; the caller describes the
flat token axis as a list of rectangles, `groups = [(rows, T, block_table[rows, W]), ...]`: the
first rows * T tokens are `rows` sequences of T tokens each, and so on (engine.py puts all
one-token rows in one group and gives each prefill chunk its own). Padding a ragged batch to
[B, T_max] instead would make 16 decodes next to a 512-token chunk cost 16 * 512 tokens of MLP.
generate.py's rectangular batches need no groups: with `groups = None` the whole [B, T] input is
one group over `block_tables`.

The caller hands the step's groups over around the forward, `with cache.step_groups(groups):`.
A block table's width W, in blocks, is the attend width: the group's longest context rounded up
to a power of two, never the model's whole context. Slot mappings are derived from the positions
inside `attend` (above), so a compiled decode step needs no host work per token. Padding rows
point at the null block at position 0.

Attention reads a group's W blocks. The reference (`_attend_group`) gathers them into one
contiguous [rows, Hkv, W * block_size, D] copy for SDPA, whose matrix products then run at full
rate for prefill chunks (T > 1). For one-token rows a cache may be given a faster kernel where
it is built (`decode`): `for_model` on CPU passes cpu_kernels.PagedDecodeInPlace, which reads the
pool where it lies with F.embedding_bag (K's blocks are stored transposed for it) instead of
writing a copy of every block and reading it twice. `read_in_place` hands every group to an
attention over the pool instead (speedups/paged_flex.py: FlexAttention, `--paged_attention`).

Prefix caching. A full block is named by a hash chained over its token ids and its parent's hash,
so equal hashes mean equal whole prefixes. A new request reuses the cached blocks of its longest
cached prefix and computes only the rest. Blocks that no sequence references stay cached until
space is needed, then are evicted least recently used first, and only leaves: a block whose
children are cached is never evicted before them (SGLang's radix tree; windowed layers' pools evict
any: BlockAllocator's window). Shared blocks are never written: a sequence that must write into a
block others reference copies it first (copy-on-write): `n > 1` samples share a prompt and fork.
"""

import contextlib
import hashlib
import heapq
from array import array
from collections import deque

import torch
import torch.nn.functional as F

from cpu_kernels import PagedDecodeInPlace
from kv_cache import attention, bucket, visible
from scheduler import blocks_for

NULL_BLOCK = 0


class NoFreeBlocks(RuntimeError):
    pass


class BlockAllocator:
    """Reference-counted blocks with a prefix cache. Pure bookkeeping: no tensors.

    A block is in exactly one of three states:
      free        ref 0, not cached            in `free`
      cached      ref 0, cached (has a hash)   evictable once it has no cached children
      in use      ref > 0 (cached or not)      owned by ref sequences

    window: the layers' sliding window, or 0. Their sequences release their oldest blocks first
    (scheduler.py): a cached block is evictable even with cached children, and a hit needs only
    the blocks its next token sees.
    """

    def __init__(
        self, num_blocks: int, block_size: int, prefix_caching: bool = True, window: int = 0
    ):
        if num_blocks < 2:
            raise ValueError(
                f"the KV pool needs at least 2 blocks (block 0 is the null block), got {num_blocks}"
            )
        self.num_blocks, self.block_size, self.prefix_caching = (
            num_blocks,
            block_size,
            prefix_caching,
        )
        self.window = window
        self.ref = [0] * num_blocks
        self.free = deque(range(1, num_blocks))  # block 0 is the null block
        self.cached = {}  # hash -> block
        # cached block -> (parent hash, token ids): checked on lookup, so a hash collision is a miss
        self.key = {}
        self.hash_of = {}  # cached block -> hash
        self.parent = {}  # cached block -> the cached block holding its parent hash (or None)
        self.children = [0] * num_blocks  # cached blocks whose parent is this block
        self.last_used = [0] * num_blocks
        self.clock = 0
        self.evictable = []  # heap of (last_used, block); entries that went stale are skipped
        self.num_cached_unused = 0  # cached blocks with ref 0
        # (hash, parent hash, tokens, block) of each cached block evicted since the scheduler last
        # took them, when a second tier keeps them (speedups/kv_tier.py); None: not kept
        self.evicted = None

    # -- counting ------------------------------------------------------------------------------
    def num_available(self) -> int:
        """Blocks an allocation can get: free ones plus every unreferenced cached one (leaf-first
        eviction can reach them all)."""
        return len(self.free) + self.num_cached_unused

    def num_used(self) -> int:  # every block but the null one is free, cached unused, or used
        return self.num_blocks - 1 - len(self.free) - self.num_cached_unused

    # -- allocation ----------------------------------------------------------------------------
    def allocate(self) -> int:
        block = self.free.popleft() if self.free else self._evict()
        self.ref[block] = 1
        self._touch(block)
        return block

    def allocate_many(self, n: int):
        """n blocks, or None (and none taken) when free and evictable blocks are too few."""
        if n > self.num_available():
            return None
        got = []
        try:
            while len(got) < n:
                got.append(self.allocate())
        except (
            NoFreeBlocks
        ):  # num_available also counts cached blocks that eviction cannot reach yet
            for b in got:
                self.release(b)
            return None
        return got

    def _evict(self) -> int:
        while self.evictable:
            used, block = heapq.heappop(self.evictable)
            if self._is_evictable_leaf(block) and self.last_used[block] == used:
                if self.evicted is not None:  # its bytes are copied out before anything writes
                    self.evicted.append((self.hash_of[block], *self.key[block], block))
                self._uncache(block)
                return block
        raise NoFreeBlocks("no free KV blocks")

    def _is_evictable_leaf(self, block) -> bool:
        return block in self.hash_of and self.ref[block] == 0 and self.children[block] == 0

    def _uncache(self, block):
        h = self.hash_of.pop(block)
        del self.cached[h], self.key[block]
        self.num_cached_unused -= 1
        parent = self.parent.pop(block)
        if parent is not None:
            self.children[parent] -= 1
            if self._is_evictable_leaf(parent):  # its last cached child is gone: it is a leaf now
                heapq.heappush(self.evictable, (self.last_used[parent], parent))

    def _touch(self, block):
        self.clock += 1
        self.last_used[block] = self.clock

    def share(self, block: int):
        """One more owner of `block` (a prefix-cache hit, or a forked sample)."""
        if self.ref[block] == 0:
            if block not in self.hash_of:
                raise ValueError(f"block {block} is free: only cached or used blocks can be shared")
            self.num_cached_unused -= 1
        self.ref[block] += 1
        self._touch(block)

    def release(self, block: int):
        """One owner fewer. An unreferenced block stays cached if it has a hash, else is free."""
        if self.ref[block] <= 0:
            raise ValueError(f"block {block} released more often than it was taken")
        self.ref[block] -= 1
        if self.ref[block] == 0:
            if block in self.hash_of:
                self.num_cached_unused += 1
                if self.children[block] == 0:
                    heapq.heappush(self.evictable, (self.last_used[block], block))
            else:
                self.free.append(block)

    # -- prefix cache --------------------------------------------------------------------------
    @staticmethod
    def chain_hash(parent_hash, tokens) -> int:
        """A 128-bit name for a block of `tokens` after the prefix named `parent_hash`: the same in
        every process (Python's hash() of None is not), so a disk tier's files keep their names."""
        head = b"" if parent_hash is None else parent_hash.to_bytes(16, "little")
        data = head + array("q", tokens).tobytes()
        return int.from_bytes(hashlib.blake2b(data, digest_size=16).digest(), "little")

    def lookup_prefix(self, tokens, max_blocks: int, root=None):
        """The cached blocks holding the longest cached prefix of `tokens`, up to max_blocks
        blocks, with their hashes (root: what the first block's hash chains from, e.g. a LoRA
        adapter's key, so its prefixes never meet another's). Takes no reference. With a window,
        a prefix of h blocks needs only those from (h * block_size - window) // block_size on
        (what positions h * bs - 1 and h * bs see); the entries before them are 0, the null
        block."""
        blocks, hashes, parent, bs = [], [], root, self.block_size
        start = best = (
            0  # start: where the run of hits ending here starts; best: the longest hit so far
        )
        for i in range(max_blocks if self.prefix_caching else 0):
            chunk = tuple(tokens[i * bs : (i + 1) * bs])
            h = self.chain_hash(parent, chunk)
            block = self.cached.get(h)
            if block is None or self.key[block] != (parent, chunk):
                if not self.window:
                    break
                block, start = 0, i + 1
            elif start <= max(0, ((i + 1) * bs - self.window) // bs):
                best = i + 1
            blocks.append(block)
            hashes.append(h)
            parent = h
        first = max(0, (best * bs - self.window) // bs) if self.window else 0
        return [0] * first + blocks[first:best], hashes[:best]

    def register(self, block: int, parent_hash, tokens, parent_block=None) -> int:
        """Name a block just filled with `tokens` (all block_size of them) in the prefix cache;
        parent_block is the caller's block before it (None for its first). Returns its hash. It
        stays unnamed (freed, not cached, when released) if another block holds the same prefix,
        or if the cached parent is not the caller's own (the caller's is an unnamed copy): named
        under a block its owner does not hold, it would keep that one from ever being evicted."""
        h = self.chain_hash(parent_hash, tokens)
        parent = self.cached.get(parent_hash) if parent_hash is not None else None
        if (
            self.window
        ):  # no parents tracked: the blocks behind a window are released, and evicted, first
            parent = parent_block = None
        if (
            not self.prefix_caching
            or h in self.cached
            or block in self.hash_of
            or parent != parent_block
        ):
            return h
        self.cached[h], self.hash_of[block], self.key[block] = (
            block,
            h,
            (parent_hash, tuple(tokens)),
        )
        self.parent[block] = parent
        if parent is not None:
            self.children[parent] += 1
        return h


class PagedKVCache:
    """K/V pools of blocks per layer, attended through block tables (see the module docstring).

    A plain object (not an nn.Module), like StaticKVCache, so compiled steps take its tensors as
    inputs.

    Hybrid models (Gemma 2/3; vLLM's hybrid allocator): with window_blocks, the window_layers get
    a pool of that many blocks, with ids of their own, and a group's table is [2, R, W]: [0] for
    the full layers, [1] for the windowed ones, whose blocks behind the window are freed."""

    latent = 0  # (as kv_cache.StaticKVCache's)

    def __init__(
        self,
        n_layers,
        num_blocks,
        block_size,
        n_kv_heads,
        head_dim,
        dtype=torch.float32,
        device=None,
        decode=None,
        window_layers=(),
        window_blocks=0,
        latent=0,
        transpose_k=True,
    ):
        self.pool_of = [
            int(bool(window_blocks) and i in window_layers) for i in range(n_layers)
        ]  # layer -> 0 or 1
        sizes = (num_blocks, window_blocks)
        # zeros, not empty: read-but-masked slots must hold finite numbers (0 * NaN is NaN).
        # K's blocks are transposed ([Hkv, D, bs]) so a decode step can read them in place
        # (PagedDecodeInPlace; for_model: CPU, no latent); else laid out as V's
        self.transpose_k, self.sizes, self.block_size = transpose_k, sizes, block_size
        self.k = [self._k_pool(sizes[p], n_kv_heads, head_dim, dtype, device) for p in self.pool_of]
        # latent (model.MLAttention): V is K's first `latent` values, so V's pools hold nothing
        self.latent, dv = latent, 0 if latent else head_dim
        self.v = [
            torch.zeros(sizes[p], block_size, n_kv_heads, dv, dtype=dtype, device=device)
            for p in self.pool_of
        ]
        self.num_blocks, self.window_blocks = num_blocks, window_blocks
        # per step, inside step_groups: [(rows, T, block_table[rows, W] or [2, rows, W]), ...]
        self.groups = None
        self.block_tables = None  # with groups None: one group over the whole [B, T] input
        self.slots = torch.arange(bucket(num_blocks) * block_size, device=device)
        self.decode = decode  # None, or a one-token kernel (q, pool_k, pool_v, table, mask) -> y
        self.in_place = None  # None, or attention over the pool for any group: read_in_place
        self.attention = (
            attention  # what the gathered blocks go through (batch_invariant.py puts its own)
        )

    @classmethod
    def for_model(
        cls, model, num_blocks: int, block_size: int = 16, window_blocks: int = 0
    ):  # (a hybrid's)
        a, w = model.config, model.norm.weight
        latent = a.mla.kv_lora_rank if a.mla else 0
        # the reference elsewhere (and for latents, whose V is narrower than K)
        decode = PagedDecodeInPlace() if w.device.type == "cpu" and not latent else None
        windowed = [i for i in range(a.n_layers) if a.window(i)]
        return cls(
            a.n_layers,
            num_blocks,
            block_size,
            a.n_kv_heads,
            a.head_dim,
            w.dtype,
            w.device,
            decode,
            windowed,
            window_blocks if 0 < len(windowed) < a.n_layers else 0,
            latent,
            transpose_k=decode is not None,
        )

    @classmethod
    def for_batch(cls, model, batch_size: int, max_seq_len: int, block_size: int = 16):
        """A cache laid out like a static one, for generate.py: each row owns a fixed run of
        blocks, so `block_tables` is set once and decode steps only advance positions."""
        width = blocks_for(max_seq_len, block_size)
        cache = cls.for_model(model, 1 + batch_size * width, block_size)
        cache.block_tables = 1 + torch.arange(batch_size * width, device=cache.slots.device).view(
            batch_size, width
        )
        cache.batch_size, cache.max_seq_len = batch_size, width * block_size
        return cache

    def _k_pool(self, n, n_kv_heads, head_dim, dtype, device):
        bs = self.block_size
        shape = (n, n_kv_heads, head_dim, bs) if self.transpose_k else (n, bs, n_kv_heads, head_dim)
        return torch.zeros(shape, dtype=dtype, device=device)

    def read_in_place(self, attend):
        """Every group's attention by `attend(q, pool_k, pool_v, table, pos, window, softcap,
        sinks)` over the pool where it lies (speedups/paged_flex.PagedFlex), instead of the gather
        and the one-token `decode`. K's pools are laid out as V's ([N, bs, Hkv, D]) for it: call
        it before the first step (what the pools held is dropped)."""
        if self.latent:
            raise ValueError("a latent cache is attended by the gathered reference only")
        if self.transpose_k:  # (the old pools freed first: a large pool is not held twice)
            self.transpose_k = False
            (_, Hkv, D, _), k = self.k[0].shape, self.k[0]
            dtype, device, self.k = k.dtype, k.device, []
            del k
            self.k = [self._k_pool(self.sizes[p], Hkv, D, dtype, device) for p in self.pool_of]
        self.in_place, self.decode = attend, None

    def tensors(self) -> list:
        return self.k + ([] if self.latent else self.v)  # (a latent's V pools are empty)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    @contextlib.contextmanager
    def step_groups(self, groups):
        """The step's rectangles of the flat token axis (module docstring), for the forward
        inside."""
        self.groups = groups
        try:
            yield self
        finally:
            self.groups = None

    def block_kv(self, block: int, pool: int = 0):
        """One block of every layer of a pool (1: a hybrid's windowed layers), what a second tier
        keeps (speedups/kv_tier.py): (k [layers, Hkv, D, bs] or as v's, v [layers, bs, Hkv, D])."""
        layers = self._layers(pool)
        return torch.stack([self.k[i][block] for i in layers]), torch.stack(
            [self.v[i][block] for i in layers]
        )

    def load_block(self, block: int, k, v, pool: int = 0):
        """block_kv's tensors back into `block` of every layer of the pool."""
        for j, layer in enumerate(self._layers(pool)):
            self.k[layer][block], self.v[layer][block] = k[j], v[j]

    def block_shapes(self) -> list:
        """[((k shape, dtype), (v shape, dtype)) of block_kv] per pool."""
        pools = range(1 + bool(self.window_blocks))
        return [tuple((t.shape, t.dtype) for t in self.block_kv(0, p)) for p in pools]

    def _layers(self, pool: int) -> list:
        return [i for i, p in enumerate(self.pool_of) if p == pool]

    def copy_block(self, src: int, dst: int, pool: int = 0):
        """Copy-on-write: dst gets src's K/V in every layer of that pool (1: a hybrid's windowed
        layers)."""
        for layer in self._layers(pool):
            self.k[layer][dst], self.v[layer][dst] = self.k[layer][src], self.v[layer][src]

    def attend(self, layer, q, k, v, input_pos, window=0, softcap=0.0, sinks=None):
        # q [B, T, H, D]; k [B, T, Hkv, D], v [B, T, Hkv, Dv]; input_pos [B, T] -> [B, T, H, Dv]
        # (Dv = D but for latents)
        (B, T, H, D), Dv = q.shape, v.shape[-1]
        groups = self.groups if self.groups is not None else [(B, T, self.block_tables)]
        if len(groups) == 1:  # the common case: no slicing of the flat token axis
            rows, t, table = groups[0]
            return self._attend_group(
                layer,
                q.view(rows, t, H, D),
                k.view(rows, t, -1, D),
                v.view(rows, t, -1, Dv),
                input_pos.view(rows, t),
                table,
                window,
                softcap,
                sinks,
            ).reshape(B, T, H, Dv)
        q, k, v, pos = (
            q.reshape(B * T, H, D),
            k.reshape(B * T, -1, D),
            v.reshape(B * T, -1, Dv),
            input_pos.reshape(-1),
        )
        out, start = [], 0
        for rows, t, table in groups:
            s = slice(start, start + rows * t)
            y = self._attend_group(
                layer,
                q[s].view(rows, t, H, D),
                k[s].view(rows, t, -1, D),
                v[s].view(rows, t, -1, Dv),
                pos[s].view(rows, t),
                table,
                window,
                softcap,
                sinks,
            )
            out.append(y.reshape(rows * t, H, Dv))
            start += rows * t
        return torch.cat(out).view(B, T, H, Dv)

    def _attend_group(self, layer, q, k, v, pos, table, window, softcap, sinks):
        # q [R, T, H, D]; k, v [R, T, Hkv, D]; pos [R, T]; table [R, W] -> [R, T, H, D]
        pool_k, pool_v, bs = self.k[layer], self.v[layer], self.block_size
        table = table[self.pool_of[layer]] if table.dim() == 3 else table  # a hybrid's two tables
        block, offset = table.gather(1, pos // bs), pos % bs  # [R, T]: where each token is written
        k_slots = pool_k.permute(0, 3, 1, 2) if self.transpose_k else pool_k  # [N, bs, Hkv, D]
        k_slots[block, offset] = k.to(pool_k.dtype)  # in-place index_put_ of [R, T, Hkv, D]
        if not self.latent:
            pool_v[block, offset] = v.to(pool_v.dtype)
        if self.in_place is not None and self.attention is attention:  # not batch_invariant's
            y = self.in_place(q, pool_k, pool_v, table, pos, window, softcap, sinks)
            if y is not None:  # (None: it cannot serve this layer)
                return y
        T, H, D = q.shape[1:]
        # decode past the window: its blocks only (not under batch_invariant.py: a narrower sum than
        # the prefill's)
        if T == 1 and window and self.attention is attention and window // bs + 2 < table.shape[1]:
            first = (pos - window + 1).clamp(min=0) // bs  # [R, 1]: the window's first block
            table = table.gather(
                1, (first + self.slots[: window // bs + 2]).clamp(max=table.shape[1] - 1)
            )
            pos = pos - first * bs  # within the window's blocks (the mask is shift-invariant)
        R, W = table.shape
        Hkv, L = pool_v.shape[2], W * bs  # L: the gather width, this group's blocks
        mask = visible(self.slots[:L], pos, window)  # [R, 1, T, L]: slots each query sees
        if T == 1 and self.decode is not None and not softcap and sinks is None:  # (at build time)
            return self.decode(q, pool_k, pool_v, table, mask)
        # each table entry picks one block (one contiguous row of the pool): [R, W] -> [R, Hkv, L,
        # D]. F.embedding is the gather, several times faster than pool[table] on CPU.
        k_ctx = F.embedding(table, pool_k.flatten(1))  # (no len(): export)
        if self.transpose_k:
            k_ctx = k_ctx.view(R, W, Hkv, D, bs).permute(0, 2, 1, 4, 3).reshape(R, Hkv, L, D)
        else:
            k_ctx = k_ctx.view(R, L, Hkv, D).transpose(1, 2)
        if self.latent:  # V: K's first values (V's pools are empty)
            v_ctx = k_ctx[..., : self.latent]
        else:
            v_ctx = F.embedding(table, pool_v.flatten(1)).view(R, L, Hkv, D)
            v_ctx = v_ctx.transpose(1, 2)
        return self.attention(q, k_ctx, v_ctx, mask, softcap, sinks)
