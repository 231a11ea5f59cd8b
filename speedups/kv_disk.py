"""The KV tier's folder on disk (speedups/kv_tier.py): evicted prefix blocks as files that outlive
the process, and generate.py's prompt kept for its next run.

    tier = DiskTier("~/.cache/llm-kv", 20 * 2**30, fingerprint(model, 16, torch.bfloat16))
    python serve.py --kv_disk_cache ~/.cache/llm-kv --kv_disk_cache_size 20GiB
    python generate.py --cache paged --kv_disk_cache ~/.cache/llm-kv --prompt "..."

A folder's files are written by a thread of their own (a step never waits on the disk: a full
queue drops the block, counted) and read ahead by another while a request waits (`prefetch`, from
add_request: its admission then finds them in memory). Each is safetensors (never a pickle) with a
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
from speedups.kv_tier import (
    STATS,
    VERSION,
    Tier,
    fingerprint,
    fits,
    kv_nbytes,
    prefix_chain,
    window_start,
)

READ_AHEAD_BYTES = 256 * 2**20  # blocks read ahead and not yet asked for, at most


class DiskTier(Tier):
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
        self.warned, self.broken = set(), None
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
        self.asked = set()  # names queued for the reader
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

    def put(self, h: int, parent, tokens, k, v, pool: int = 0, wait: bool = False):
        """Queue a pool's block for writing (its tensors copied now); dropped, counted, if the
        writer is behind (unless `wait`: keep_pool's) or the folder cannot be written. Never
        raises."""
        h = self.name(h, pool)
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

    def holds(self, h: int, pool: int) -> bool:
        name = self.name(h, pool)
        return name in self.files or name in self.ahead

    def prefetch(self, request, pools):
        """Read a queued request's prefix blocks ahead, on the reader thread, so its admission
        finds them in memory: those Tier.extend would load (Tier.reach's), unless the pool holds
        them or an earlier prefetch asked for them. Never raises."""
        if request.scoring or request.pools_every_token:  # (these compute their prefix)
            return
        prompt, bs = request.prompt, pools[0].block_size
        chain = prefix_chain(prompt, request.hash_root, bs, (len(prompt) - 1) // bs)
        end = self.reach(pools, chain, 0, len(chain))
        for p, a in enumerate(pools):
            for h, parent, tokens in chain[window_start(a, end) : end]:
                name = self.name(h, p)
                if h in a.cached or name in self.asked or name not in self.files:
                    continue
                try:
                    self.wanted.put_nowait((name, parent, tokens, p))
                except queue.Full:
                    return
                self.asked.add(name)

    def _read_loop(self):
        while (item := self.wanted.get()) is not None:
            h, parent, tokens, pool = item  # (h: the block's name here)
            now = time.monotonic()
            with self.lock:  # entries never asked for within a minute (their request left) go
                while self.ahead and now - next(iter(self.ahead.values()))[0] > 60:
                    self.ahead_bytes -= kv_nbytes(*self.ahead.popitem(last=False)[1][3:])
            full = self.ahead_bytes > READ_AHEAD_BYTES  # then later requests' blocks wait
            kv = None if h in self.ahead or full else self._load(h, parent, tokens, pool)
            with self.lock:
                self.asked.discard(h)
                if kv is not None:
                    self.ahead[h] = (now, parent, tokens, *kv)
                    self.ahead_bytes += kv_nbytes(*kv)

    def fetch(self, h: int, parent, tokens, pool: int = 0):
        """(k, v) of the pool's block with this hash, parent and tokens: read ahead, or from its
        file, or None (a file that fails a check is removed, with one warning per kind of
        failure)."""
        h = self.name(h, pool)
        with self.lock:
            entry = self.ahead.pop(h, None)
            if entry is not None:
                self.ahead_bytes -= kv_nbytes(*entry[3:])
                if entry[1:3] == (parent, tuple(tokens)):
                    self._count_read(h, *entry[3:])
                    self.stats["tier_blocks_read_ahead"] += 1
                    return entry[3:]
        kv = self._load(h, parent, tokens, pool)
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
        self.stats["tier_bytes_read"] += kv_nbytes(k, v)

    def _load(self, h: int, parent, tokens, pool: int):
        """(k, v) from the block's file, checked, or None (a bad file removed, warned of)."""
        with self.lock:
            if h not in self.files:
                return None
        path = self.root / f"{h:032x}.safetensors"
        try:
            k, v, meta = _read(path)
            why = _mismatch(meta, self.fp, parent, tokens, k, v)
            why = why or ("" if fits(self, pool, k, v) else "foreign (another pool layout)")
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
    tier.expected = cache.block_shapes()  # (one pool: generate.py's has no windowed one)
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


def _crc(k, v) -> int:
    return zlib.crc32(_bytes(v), zlib.crc32(_bytes(k)))


def _bytes(t):
    return t.contiguous().view(torch.uint8).numpy()


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0
