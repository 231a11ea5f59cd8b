"""A second tier for the prefix cache: KV blocks the pool evicts are kept (in host memory, or in a
folder on disk) and loaded back into the pool when a prompt's prefix misses the pool but hits the
tier, instead of being computed again; on disk they outlive the process.

    engine = Engine.for_model(model, num_blocks=512, tier=DiskTier("kv", 20 * 2**30, fp))
    python serve.py --kv_disk_cache ~/.cache/llm-kv --kv_disk_cache_size 20GiB

A block is named by the prefix cache's chained hash (paged.BlockAllocator.chain_hash: stable
across processes), so equal names mean equal whole prefixes; an entry also holds its parent's hash
and its own tokens, checked on every read, so a collision is a miss. Its size is the pool's:

    bytes per block = 2 * layers * kv_heads * head_dim * block_size * bytes per element
    (SmolLM2-135M in bf16: 30 * 2 * 3 * 64 * 16 * 2 = 368,640 bytes, 23 KiB a token)

The scheduler (host only) asks `fetch` while admitting a request and plans the loads; the engine
copies evicted blocks out (`put`) and loaded ones in before the step's forward. A folder's files
are written by a thread of their own (a step never waits on the disk: a full queue drops the
block, counted) and read ahead by another while a request waits (`prefetch`, from add_request:
its admission then finds them in memory). Each is safetensors (never a pickle) with a
fingerprint of the model and layout and a CRC32 of its bytes: a file from another model, block
size or dtype, truncated or corrupt, is skipped with one warning and removed. Files are replaced
atomically (written aside, renamed), so two processes may share a folder; each re-reads it every
256 writes, so together they keep it within its size, oldest first.
"""

import contextlib
import json
import os
import queue
import threading
import time
import zlib
from collections import OrderedDict
from pathlib import Path

import torch

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
READ_AHEAD_BYTES = 256 * 2**20  # blocks read ahead and not yet asked for, at most


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


class HostTier:
    """Blocks kept in host memory (pinned when the pool is on a GPU), least recently used dropped
    beyond `capacity` bytes."""

    def __init__(self, capacity: int, pin: bool = False):
        self.capacity, self.pin, self.entries = capacity, pin, OrderedDict()
        self.stats = dict.fromkeys(STATS, 0)
        self.expected = None  # ((shape, dtype) of k, of v): the engine's pool's (Engine.for_model)

    def put(self, h: int, parent, tokens, k, v, wait: bool = False):
        """A block evicted from the pool: k, v its tensors, copied to the host here (never
        raises: a block that cannot be kept is only not kept)."""
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
        self.stats["tier_bytes"] += _nbytes(k, v)
        self.stats["tier_bytes_written"] += _nbytes(k, v)
        self.stats["tier_blocks_written"] += 1
        while self.stats["tier_bytes"] > self.capacity and self.entries:
            *_, k0, v0 = self.entries.popitem(last=False)[1]
            self.stats["tier_bytes"] -= _nbytes(k0, v0)

    def fetch(self, h: int, parent, tokens):
        """(k, v) of the block with this name, parent and tokens, or None."""
        entry = self.entries.get(h)
        if entry is None or entry[:2] != (parent, tuple(tokens)) or not _fits(self, *entry[2:]):
            return None
        self.entries.move_to_end(h)
        self.stats["tier_blocks_read"] += 1
        self.stats["tier_bytes_read"] += _nbytes(*entry[2:])
        return entry[2:]

    def prefetch(self, request, allocator):
        pass  # (already in memory)

    def close(self):
        pass  # (host memory ends with the process)


class DiskTier:
    """Blocks as files in `folder`/<fingerprint>/, at most `capacity` bytes, written by a thread."""

    def __init__(
        self, folder, capacity: int, fingerprint: str, max_queued: int = 256, rescan_every=256
    ):
        self.root = Path(folder) / fingerprint
        self.capacity, self.fp = capacity, fingerprint
        # a peer process sharing the folder writes files this one's index lacks: re-read the
        # folder every rescan_every writes, so the two together keep it within its size
        self.rescan_every, self.writes = rescan_every, 0
        self.stats = dict.fromkeys(STATS, 0)
        self.warned, self.broken, self.expected = set(), None, None
        self.lock = threading.Lock()  # `files` and `stats`: the writer thread's and the engine's
        self.queued = set()  # hashes waiting for the writer
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            probe = self.root / f".probe-{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            self.broken = f"{self.root} cannot be written ({e})"
            log(f"warning: the KV disk tier is off: {self.broken}")
        self.files = OrderedDict()  # hash -> bytes, oldest first
        self._rescan()
        self.todo = queue.Queue(max_queued)
        self.writer = threading.Thread(target=self._write_loop, daemon=True, name="kv-tier")
        self.writer.start()
        # read ahead: a waiting request's prefix blocks read by a thread of their own
        self.ahead, self.ahead_bytes, self.wanted = OrderedDict(), 0, queue.Queue(4096)
        self.asked = set()  # hashes queued for the reader
        reader = threading.Thread(target=self._read_loop, daemon=True, name="kv-tier-read")
        reader.start()

    def _rescan(self):
        """The index rebuilt from the folder, least recently used file first (built aside, then
        swapped in: a lookup meanwhile sees the old one)."""
        files = OrderedDict()
        for p in sorted(self.root.glob("*.safetensors"), key=_mtime):
            try:
                files[int(p.stem, 16)] = p.stat().st_size
            except (ValueError, OSError):
                pass
        with self.lock:
            self.files = files
            self.stats["tier_bytes"] = sum(files.values())

    def put(self, h: int, parent, tokens, k, v, wait: bool = False):
        """Queue a block for writing (its tensors copied now); dropped, counted, if the writer is
        behind (unless `wait`: keep_pool's) or the folder cannot be written. Never raises."""
        if self.broken or h in self.files or h in self.queued:
            return
        try:
            item = (h, parent, list(tokens), k.to("cpu", copy=True), v.to("cpu", copy=True))
            self.queued.add(h)  # (before the writer can finish it)
            self.todo.put(item, block=wait)
        except queue.Full:
            self.queued.discard(h)
            self.stats["tier_blocks_dropped"] += 1
        except Exception as e:  # out of memory copying it out
            log(f"warning: the KV disk tier could not keep a block ({type(e).__name__}: {e})")

    def prefetch(self, request, allocator):
        """Read a queued request's prefix blocks ahead, on the reader thread, so its admission
        finds them in memory: those of its hash chain (from its adapter's root) that the pool
        (`allocator`) does not hold and no earlier prefetch has asked for. Never raises."""
        if request.scoring or request.pools_every_token:  # (these compute their prefix)
            return
        prompt, bs = request.prompt, allocator.block_size
        for h, parent, tokens in prefix_chain(
            prompt, request.hash_root, bs, (len(prompt) - 1) // bs
        ):
            if h not in allocator.cached and h not in self.asked:
                if h not in self.files:  # (a prefix is read in order: a gap ends it)
                    return
                try:
                    self.wanted.put_nowait((h, parent, tokens))
                except queue.Full:
                    return
                self.asked.add(h)

    def _read_loop(self):
        while (item := self.wanted.get()) is not None:
            h, parent, tokens = item
            now = time.monotonic()
            with self.lock:  # entries never asked for within a minute (their request left) go
                while self.ahead and now - next(iter(self.ahead.values()))[0] > 60:
                    self.ahead_bytes -= _nbytes(*self.ahead.popitem(last=False)[1][3:])
            full = self.ahead_bytes > READ_AHEAD_BYTES  # then later requests' blocks wait
            kv = None if h in self.ahead or full else self._load(h, parent, tokens)
            with self.lock:
                self.asked.discard(h)
                if kv is not None:
                    self.ahead[h] = (now, parent, tokens, *kv)
                    self.ahead_bytes += _nbytes(*kv)

    def fetch(self, h: int, parent, tokens):
        """(k, v) of the block with this name, parent and tokens: read ahead, or from its file,
        or None (a file that fails a check is removed, with one warning per kind of failure)."""
        with self.lock:
            entry = self.ahead.pop(h, None)
            if entry is not None:
                self.ahead_bytes -= _nbytes(*entry[3:])
                if entry[1:3] == (parent, tuple(tokens)):
                    self._count_read(h, *entry[3:])
                    self.stats["tier_blocks_read_ahead"] += 1
                    return entry[3:]
        kv = self._load(h, parent, tokens)
        if kv is not None:
            with self.lock:
                self._count_read(h, *kv)
        return kv

    def _count_read(self, h: int, k, v):
        if h in self.files:
            self.files.move_to_end(h)
            try:  # the file's time is its last use: a rescan (or a peer) keeps that order
                os.utime(self.root / f"{h:032x}.safetensors")
            except OSError:
                pass
        self.stats["tier_blocks_read"] += 1
        self.stats["tier_bytes_read"] += _nbytes(k, v)

    def _load(self, h: int, parent, tokens):
        """(k, v) from the block's file, checked, or None (a bad file removed, warned of)."""
        with self.lock:
            if h not in self.files:
                return None
        path = self.root / f"{h:032x}.safetensors"
        try:
            k, v, meta = _read(path)
            why = _mismatch(meta, self.fp, parent, tokens, k, v)
            why = why or ("" if _fits(self, k, v) else "foreign (another pool layout)")
        except FileNotFoundError:  # another process sharing the folder removed it: a plain miss
            with self.lock:
                self.stats["tier_bytes"] -= self.files.pop(h, 0)
            return None
        except Exception as e:  # truncated, corrupt: a miss
            why = f"unreadable ({type(e).__name__})"
        if why:
            self._drop(h, path, why)
            return None
        return k, v

    def _drop(self, h: int, path: Path, why: str):
        kind = why.split(" ")[0]
        if kind not in self.warned:
            self.warned.add(kind)
            log(f"warning: KV disk tier: skipped {path.name}: {why} (said once per kind)")
        with self.lock:
            self.stats["tier_bytes"] -= self.files.pop(h, 0)
        try:
            path.unlink(missing_ok=True)
        except OSError:  # a read-only folder: it stays, and is skipped again
            pass

    def _write_loop(self):
        while True:
            item = self.todo.get()
            if item is None:
                return
            try:
                self._write(*item)
            except Exception as e:  # disk full, folder gone or read-only: serve on without it
                self.broken = f"writing to {self.root} failed ({type(e).__name__}: {e})"
                log(f"warning: the KV disk tier is off: {self.broken}")
            finally:
                self.queued.discard(item[0])
                self.todo.task_done()

    def _write(self, h, parent, tokens, k, v):
        from safetensors.torch import save_file

        meta = {
            "fingerprint": self.fp,
            "version": str(VERSION),
            "parent": str(parent),
            "tokens": json.dumps(tokens),
            "crc32": str(_crc(k, v)),
        }
        path, tmp = self.root / f"{h:032x}.safetensors", self.root / f".{h:032x}.{os.getpid()}"
        save_file({"k": k.contiguous(), "v": v.contiguous()}, tmp, metadata=meta)
        os.replace(tmp, path)  # atomic: a reader sees the old file or the whole new one
        self.writes += 1
        if self.writes % self.rescan_every == 0:
            self._rescan()
        gone = []
        with self.lock:
            self.stats["tier_bytes"] -= self.files.pop(h, 0)  # (a peer's file it replaced)
            self.files[h] = path.stat().st_size
            self.stats["tier_bytes"] += self.files[h]
            self.stats["tier_bytes_written"] += self.files[h]
            self.stats["tier_blocks_written"] += 1
            while self.stats["tier_bytes"] > self.capacity and len(self.files) > 1:
                old, size = self.files.popitem(last=False)
                self.stats["tier_bytes"] -= size
                gone.append(old)
        for old in gone:
            (self.root / f"{old:032x}.safetensors").unlink(missing_ok=True)

    def flush(self):
        """Wait until every queued block is on disk."""
        self.todo.join()

    def close(self):
        self.flush()
        self.todo.put(None)
        self.wanted.put(None)  # the reader ends; what it read ahead goes
        with self.lock:
            self.ahead.clear()
            self.ahead_bytes = 0


class HostOverDisk:
    """Host memory in front of a disk folder (`--kv_host_cache` with `--kv_disk_cache`): a block
    the pool evicts goes to both (the disk's write queued), a fetch tries host memory first and
    the folder second, and a restart finds the folder's."""

    def __init__(self, host: HostTier, disk: DiskTier):
        self.host, self.disk = host, disk

    @property
    def stats(self) -> dict:
        return {k: self.host.stats.get(k, 0) + self.disk.stats.get(k, 0) for k in STATS}

    @property
    def expected(self):
        return self.host.expected

    @expected.setter
    def expected(self, shapes):
        self.host.expected = self.disk.expected = shapes

    def put(self, h: int, parent, tokens, k, v, wait: bool = False):
        self.host.put(h, parent, tokens, k, v)
        self.disk.put(h, parent, tokens, k, v, wait)

    def fetch(self, h: int, parent, tokens):
        return self.host.fetch(h, parent, tokens) or self.disk.fetch(h, parent, tokens)

    def prefetch(self, request, allocator):
        self.disk.prefetch(request, allocator)

    def close(self):
        self.disk.close()


def keep_pool(engine):
    """At the end of a run: every block the pool still caches into the engine's tier too (the
    tier held only what was evicted), then the tier closed: a restart finds them all."""
    tier, a = engine.scheduler.tier, engine.scheduler.allocator
    if tier is None:
        return
    tier = tier.disk if isinstance(tier, HostOverDisk) else tier
    if isinstance(tier, HostTier):  # host memory ends with the process
        return
    for block, h in list(a.hash_of.items()):
        tier.put(h, *a.key[block], *engine.cache.block_kv(block), wait=True)
    tier.close()


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


@contextlib.contextmanager
def prompt_cache(folder, size: int, model, cache, prompt: list):
    """generate.py --kv_disk_cache with --cache paged: yields how many of the prompt's first tokens
    were loaded from the folder's blocks into every row's (whole blocks, never the last token:
    the prefill computes at least one); on exit the prompt's whole blocks are written for the
    next run. Without a folder: 0, and nothing is read or written."""
    if not folder:
        yield 0
        return
    bs = cache.block_size
    tier = DiskTier(folder, size, fingerprint(model, bs, cache.k[0].dtype))
    tier.expected = tuple((t.shape, t.dtype) for t in cache.block_kv(0))
    chain = prefix_chain(prompt, None, bs, len(prompt) // bs)  # each whole block of the prompt
    loaded, start = 0, time.perf_counter()
    for i, (h, parent, tokens) in enumerate(chain[: (len(prompt) - 1) // bs]):
        kv = tier.fetch(h, parent, tokens)
        if kv is None:
            break
        for row in cache.block_tables.tolist():
            cache.load_block(row[i], *kv)
        loaded += bs
    ms = (time.perf_counter() - start) * 1000  # (before the time to first token is counted)
    log(
        f"KV disk tier: the prompt's first {loaded} of {len(prompt)} tokens loaded from "
        f"{tier.root} in {ms:.0f} ms"
    )
    yield loaded
    for i, (h, parent, tokens) in enumerate(chain):  # row 0's blocks, for the next run
        tier.put(h, parent, tokens, *cache.block_kv(int(cache.block_tables[0, i])), wait=True)
    tier.close()


def _read(path: Path):
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return f.get_tensor("k"), f.get_tensor("v"), f.metadata() or {}


def _mismatch(meta: dict, fp: str, parent, tokens, k, v) -> str:
    """Why a file's block cannot be used for (parent, tokens) here, or "" if it can."""
    if meta.get("fingerprint") != fp or meta.get("version") != str(VERSION):
        return "foreign (another model, block size, KV dtype or file version)"
    if meta.get("parent") != str(parent) or json.loads(meta.get("tokens", "null")) != list(tokens):
        return "collision (another prefix under the same name)"
    if meta.get("crc32") != str(_crc(k, v)):
        return "corrupt (its checksum does not match its bytes)"
    return ""


def _fits(tier, k, v) -> bool:
    """Whether k, v have the shapes and dtypes of the engine's pool blocks (once it said them)."""
    return tier.expected is None or tier.expected == ((k.shape, k.dtype), (v.shape, v.dtype))


def _crc(k, v) -> int:
    return zlib.crc32(_bytes(v), zlib.crc32(_bytes(k)))


def _bytes(t):
    return t.contiguous().view(torch.uint8).numpy()


def _nbytes(k, v) -> int:
    return k.numel() * k.element_size() + v.numel() * v.element_size()


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0
