"""Paged attention read where the blocks lie, by FlexAttention: no gathered copy of a group's
blocks, for one-token rows and prefill chunks alike (paged.py's reference gathers them, then SDPA).

    cache = PagedKVCache.for_model(model, num_blocks, block_size)
    cache.read_in_place(PagedFlex())  # before the first step: K's pool is laid out as V's
    # every group's attention now reads the pool through its block table

The idea (vLLM's PagedAttention, in FlexAttention's terms): the whole pool is one long key
sequence, [N blocks, bs, Hkv, D] seen as [1, Hkv, N * bs, D] (a strided view, no copy), and each
row of a group is a batch entry [R, H, T, D] that may read only its own blocks. Two pieces say
which keys a query sees:
- the mask_mod, the whole rule: slot s (of block s // bs) is visible to query t of row r iff that
  block sits at index j of r's table and the position it holds, j * bs + s % bs, is <= pos[r, t]
  (and > pos[r, t] - window). `logical[r, block] = j` (-1: not r's) is built per step by scatter;
- the BlockMask, what a compiled kernel reads at all: row r's table entries from the window's
  first block to its last query's block, as lists of blocks of bs keys (FlexAttention's sparse
  blocks are the pool's blocks): "full" ones every query sees whole (no mask_mod evaluated) and
  partial ones. Eager FlexAttention evaluates the mask_mod over every slot of the pool (a
  reference, slow); compiled, only the listed blocks are read.
Soft-capping is a score_mod; attention sinks (one logit per head joining the softmax) rescale the
output by sigmoid(lse - sink), from the log-sum-exp FlexAttention returns.

Per step, every layer reads the same tables and positions: the mask is built once per group and
window (a hybrid's two). Its block lists and `logical` span the whole pool ([R, N] int32 each, as
FlexAttention's BlockMask must cover every key): a cost per step that grows with the pool.
tests/test_paged_flex.py checks it against the gathered SDPA reference;
benchmarks/bench_paged_attention.py times it against the gather and cpu_kernels.PagedDecodeInPlace.
"""

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

Q_BLOCK = 128  # FlexAttention's default query block: a group's T queries in ceil(T / 128) blocks


def block_mask(table, pos, block_size: int, num_blocks: int, window: int = 0) -> BlockMask:
    """The mask of a group: table [R, W] (block ids, 0: none), pos [R, T] (each query's position)
    over a pool of num_blocks blocks of block_size keys -> BlockMask [R, 1, T, num_blocks * bs].
    Blocks every query of a row sees whole are "full" (no mask_mod there); the row's others in
    reach are partial."""
    (R, W), T, bs, device = table.shape, pos.shape[1], block_size, table.device
    low, high = pos.amin(1, keepdim=True), pos.amax(1, keepdim=True)  # [R, 1]
    start = torch.arange(W, device=device) * bs  # [W]: the first position each table entry holds
    reached = start <= high  # [R, W]
    full = start + bs - 1 <= low
    if window:
        reached &= start + bs - 1 > low - window
        full &= start > high - window
    partial = reached & ~full
    logical = torch.full((R, num_blocks), -1, dtype=torch.int32, device=device)
    logical.scatter_(
        1, table, torch.arange(W, device=device, dtype=torch.int32).expand(R, W).contiguous()
    )
    logical[:, 0] = -1  # the null block holds no position of any row

    def mask_mod(b, h, q_idx, kv_idx):
        j = logical[b, kv_idx // bs]
        p, now = j * bs + kv_idx % bs, pos[b, q_idx]
        seen = (j >= 0) & (p <= now)
        return seen & (p > now - window) if window else seen

    q_blocks = -(-T // Q_BLOCK)

    def listed(chosen):  # [R, W] bool -> (counts [R, 1, Qb], block ids [R, 1, Qb, N]), chosen first
        order = torch.sort((~chosen).to(torch.uint8), dim=1, stable=True).indices
        ids = torch.zeros(R, num_blocks, dtype=torch.int32, device=device)
        n = min(W, num_blocks)  # (a graph's table may be wider than the pool: its tail unread)
        ids[:, :n] = table.gather(1, order)[:, :n]
        counts = chosen.sum(1, dtype=torch.int32)
        return (
            counts.view(R, 1, 1).expand(R, 1, q_blocks).contiguous(),
            ids.view(R, 1, 1, num_blocks).expand(R, 1, q_blocks, num_blocks).contiguous(),
        )

    return BlockMask.from_kv_blocks(
        *listed(partial),
        *listed(full),
        BLOCK_SIZE=(Q_BLOCK, bs),
        mask_mod=mask_mod,
        seq_lengths=(T, num_blocks * bs),
        compute_q_blocks=False,
    )


class PagedFlex:
    """paged.PagedKVCache's attention over the pool in place, for any group (read_in_place sets
    it). compiled: FlexAttention through torch.compile, which reads only the mask's blocks (on
    CPU, Inductor's C++ template; on CUDA, its Triton kernel, with key tiles of the pool's block
    size); else eager FlexAttention, the reference path that scores every slot of the pool
    (tests, tiny pools). cuda: the pool is on a GPU."""

    KEPT = 16  # masks kept: a step's groups x windows (a hybrid's two), across a few steps

    def __init__(self, compiled: bool = True, cuda: bool = True):
        self.compiled, self.cuda, self.flex = compiled, cuda, flex_attention
        if compiled:  # a graph per shape on CPU, where Inductor's template fails to build at
            # dynamic sizes (torch 2.13); past dynamo's limit it would run eager over the whole pool
            limit = torch._dynamo.config.recompile_limit
            torch._dynamo.config.recompile_limit = max(limit, 256)
            self.flex = torch.compile(flex_attention, dynamic=None if cuda else False)
        self._masks = {}  # key -> (BlockMask, the tensors it was built from): see _mask

    def __call__(self, q, pool_k, pool_v, table, pos, window=0, softcap=0.0, sinks=None):
        """q [R, T, H, D]; pool_k, pool_v [N, bs, Hkv, D]; table [R, W]; pos [R, T]; window,
        softcap: the layer's (0: none); sinks [H] or None -> [R, T, H, D], or None where this
        cannot serve: sinks need the log-sum-exp, which Inductor's CPU template does not return
        (the caller gathers instead)"""
        lse = sinks is not None
        if lse and self.compiled and q.device.type == "cpu":
            return None
        N, bs, Hkv, D = pool_k.shape
        mask = self._mask(table, pos, bs, N, window)
        keys = pool_k.view(1, N * bs, Hkv, D).transpose(1, 2)  # [1, Hkv, N * bs, D], no copy
        values = pool_v.view(1, N * bs, Hkv, -1).transpose(1, 2)
        score_mod = None
        if softcap:

            def score_mod(score, b, h, q_idx, kv_idx):
                return torch.tanh(score / softcap) * softcap

        # Triton's key tile must divide the sparse block, the pool's block (choose checks its size)
        options = {"BLOCK_N": bs} if self.compiled and self.cuda else None
        y = self.flex(
            q.transpose(1, 2).to(pool_k.dtype),
            keys,
            values,
            score_mod=score_mod,
            block_mask=mask,
            enable_gqa=True,
            return_lse=lse,
            kernel_options=options,
        )  # y [R, H, T, D] (and lse [R, H, T])
        if lse:  # the sink's share of each softmax, taken off every weight
            y, lse = y
            y = y * torch.sigmoid(lse - sinks.view(1, -1, 1).float())[..., None].to(y.dtype)
        return y.transpose(1, 2).to(q.dtype)

    def _mask(self, table, pos, bs, num_blocks, window):
        """block_mask, built once per group and window for every layer reading the same tensors
        (a compiled step builds it in its graph). A kept mask holds its tensors' bases, so their
        ids stay theirs; an edit in place bumps a version and misses."""
        if torch.compiler.is_compiling():
            return block_mask(table, pos, bs, num_blocks, window)
        bases = tuple(t if t._base is None else t._base for t in (table, pos))
        # a CUDA graph's capture builds its own, in the graph: one from before would be replayed
        capturing = table.is_cuda and torch.cuda.is_current_stream_capturing()
        key = (
            tuple((id(b), b._version) for b in bases),
            tuple((t.storage_offset(), tuple(t.shape), t.stride()) for t in (table, pos)),
            (bs, num_blocks, window, capturing),
        )
        if key not in self._masks:
            if len(self._masks) >= self.KEPT:  # the oldest first (dicts keep insertion order)
                del self._masks[next(iter(self._masks))]
            self._masks[key] = (block_mask(table, pos, bs, num_blocks, window), bases)
        return self._masks[key][0]


READERS = ("auto", "flex", "gather")  # --paged_attention's choices


def choose(cache, reader: str = "auto"):
    """--paged_attention: how the engine's cache reads its pool. auto: on CPU the one-token kernel
    cpu_kernels.PagedDecodeInPlace and the gather for prefill chunks, both faster there than
    compiled FlexAttention (benchmarks/RESULTS.md, "Paged attention's readers"); on CUDA the
    gather until a GPU run of benchmarks/gpu_check.py shows FlexAttention equal and faster there.
    flex: FlexAttention on any device (CUDA: block sizes of 16, 32 or 64, its key tiles); gather:
    the reference everywhere. A latent cache (DeepSeek) is always gathered."""
    if reader not in READERS:
        raise ValueError(f"--paged_attention {reader!r}: expected one of {', '.join(READERS)}")
    cuda = cache.slots.device.type == "cuda"
    if cache.latent or reader == "gather" or (reader == "auto" and cuda):
        cache.decode = None
    elif reader == "flex":
        if cuda and cache.block_size not in (16, 32, 64):
            raise ValueError(
                f"--paged_attention flex on CUDA reads blocks of 16, 32 or 64 tokens (Triton's key "
                f"tiles); --block_size is {cache.block_size}"
            )
        cache.read_in_place(PagedFlex(compiled=True, cuda=cuda))
