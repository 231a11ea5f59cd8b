"""The wire between tensor-parallel ranks (server/tp_engine.py): each engine step rank 0
broadcasts as two int64 tensors, a fixed header and a payload, and the Link that sends, receives,
keeps an idle group alive and fails loudly when a rank is gone.

    header   [kind, tokens N, kept rows K, copies C, groups G, payload length]
    payload  tokens [N] | positions [N] | keep [K] | copies [3C] | (rows, T, width, tables) [4G]
             | tables

    header, payload = pack(copies, groups, tokens, pos, keep)        # rank 0
    copies, groups, tokens, pos, keep = unpack(header, payload)       # every other rank

Every collective, a waiting broadcast too, fails after the process group's timeout, so an idle
rank 0 sends a keepalive every KEEPALIVE_S. A rank that dies makes the next collective fail on the
others (gloo; NCCL's watchdog aborts them after the timeout instead, so rank 0 also looks at the
processes of the ranks on its machine every few seconds): each says what it knows, rank 0 naming
the ranks on its machine that are gone, and exits 1, never hanging past the timeout.
"""

import os
import socket
import threading
import time

import torch
import torch.distributed as dist

from runtime import log

STEP, KEEPALIVE, STOP = 0, 1, 2
KEEPALIVE_S = 20.0  # an idle rank 0 says so this often


def pack(copies, groups, tokens, pos, keep):
    """A step as (header [6], payload [L]) int64 tensors on the tokens' device."""
    device = tokens.device
    long = dict(dtype=torch.long, device=device)
    meta = torch.tensor(
        [
            (rows, T, table.shape[-1], table.numel() // (rows * table.shape[-1]))
            for rows, T, table in groups
        ],
        **long,
    ).view(-1)  # (a hybrid's table is two: [2, rows, width])
    parts = [
        tokens.view(-1),
        pos.view(-1),
        keep.view(-1),
        torch.tensor(copies, **long).view(-1),
        meta,
    ]
    payload = torch.cat(parts + [table.reshape(-1) for _, _, table in groups])
    header = torch.tensor(
        [STEP, tokens.numel(), keep.numel(), len(copies), len(groups), payload.numel()], **long
    )
    return header, payload


def unpack(header, payload):
    """(copies, groups, tokens [1, N], positions [1, N], keep) from pack's tensors."""
    _, n, k, c, g, length = header.tolist()
    sizes = [n, n, k, 3 * c, 4 * g]
    tokens, pos, keep, copies, meta, tables = payload.split(sizes + [length - sum(sizes)])
    groups, at = [], 0
    for rows, T, width, count in meta.view(g, 4).tolist():
        shape = (count, rows, width) if count > 1 else (rows, width)
        groups.append((rows, T, tables[at : at + count * rows * width].view(shape)))
        at += count * rows * width
    return (
        [tuple(p) for p in copies.view(c, 3).tolist()],
        groups,
        tokens.view(1, n),
        pos.view(1, n),
        keep,
    )


class Link:
    """The steps rank 0 broadcasts and the others receive; the lock keeps a keepalive from landing
    inside a step's collectives (the forward's all-reduces included)."""

    def __init__(self, device, peers):
        # peers: (host, pid) per rank
        self.device, self.peers, self.lock = device, peers, threading.RLock()
        self.rank, self.last, self.steps, self.seconds, self.stopped = (
            dist.get_rank(),
            time.monotonic(),
            0,
            0.0,
            False,
        )

    def send(self, header, payload=None):
        start = time.perf_counter()
        dist.broadcast(header, 0)
        if payload is not None:
            dist.broadcast(payload, 0)
        self.last = time.monotonic()
        if payload is not None:
            self.steps, self.seconds = self.steps + 1, self.seconds + time.perf_counter() - start

    def signal(self, kind: int):
        with self.lock:
            if not self.stopped:
                self.send(torch.tensor([kind, 0, 0, 0, 0, 0], dtype=torch.long, device=self.device))

    def receive(self):
        """(kind, the step or None)."""
        header = torch.empty(6, dtype=torch.long, device=self.device)
        dist.broadcast(header, 0)
        kind, *_, length = header.tolist()  # one device-to-host read per step
        if kind != STEP:
            return kind, None
        payload = torch.empty(length, dtype=torch.long, device=self.device)
        dist.broadcast(payload, 0)
        return STEP, unpack(header, payload)

    def keep_alive(self):
        """Rank 0, in a daemon thread: a keepalive whenever no step went out for KEEPALIVE_S, and a
        look at the ranks on this machine (NCCL's collectives do not fail when a peer dies: its
        watchdog aborts them after the timeout, with no word of which rank)."""
        while True:
            time.sleep(KEEPALIVE_S / 4)
            # (stop takes the lock too: after a stop, followers that ended are no failure)
            with self.lock:
                if self.stopped:
                    return
                if self.gone():
                    self.fail(RuntimeError("its process has ended"))
                if time.monotonic() - self.last > KEEPALIVE_S:
                    try:
                        self.signal(KEEPALIVE)
                    except Exception as e:
                        self.fail(e)

    def gone(self) -> list:
        """The ranks on this machine whose process has ended."""
        here = socket.gethostname()
        return [
            r
            for r, (host, pid) in enumerate(self.peers)
            if host == here and pid != os.getpid() and not alive(pid)
        ]

    def stop(self):
        """Rank 0, at exit: the followers stop and exit 0; no step goes out after this."""
        with self.lock:
            if self.stopped:
                return
            try:
                self.signal(STOP)
            except Exception as e:  # a follower is gone: say which
                self.fail(e)
            self.stopped = True
            # before the interpreter exits: a group left to its destructors can abort the process
            # ("terminate called without an active exception")
            dist.destroy_process_group()
            if self.steps:
                log(
                    f"tensor parallel: {self.steps} steps broadcast to {len(self.peers) - 1} "
                    f"ranks, {1e6 * self.seconds / self.steps:.0f} us each"
                )

    def fail(self, error):
        """A collective failed: say which ranks on this machine are gone, and exit 1 (never
        hang)."""
        time.sleep(0.5)  # a rank that failed is still exiting
        gone = self.gone()
        who = (
            f"rank {', '.join(map(str, gone))} stopped"
            if gone
            else "a rank stopped or failed (this one, or another)"
        )
        log(
            f"error: tensor parallel rank {self.rank}: {who} ({type(error).__name__}: {error}); "
            "exiting"
        )
        os._exit(1)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True
