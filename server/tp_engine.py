"""Serving past one device: the engine (engine.py) over tensor-parallel ranks (tp.py), so that
batch.py and serve.py run under torchrun with the outputs of one process.

    torchrun --nproc_per_node 2 batch.py --requests requests.jsonl
    torchrun --nproc_per_node 3 serve.py --port 8000          # the embedded model: 1 or 3 ranks

One scheduler, N runners. Rank 0 owns everything on the host: the Scheduler and its block
allocator, the tokenizer, sampling, and serve.py's HTTP server. Every rank holds 1/N of the
weights (tp.py) and a KV pool of the same blocks holding 1/N of the KV heads, so a block id means
the same on every rank and only rank 0 needs to know which are free. Each step rank 0 broadcasts
what the forward needs as two int64 tensors, a fixed header and a payload (server/tp_link.py),
and every rank runs the same forward on its shard (the copy-on-write copies first). The output
head is replicated, so every rank computes the full logits and nothing comes back: rank 0 samples.

The other ranks run `follow()`: receive a step, run it, until rank 0 says stop. A collective that
fails (a rank gone, a group idle past its timeout) ends every rank with exit code 1, never a hang
(server/tp_link.py says how). torchrun passes SIGTERM to every rank; the followers ignore it, and
serve.py's rank 0 drains and then stops them, so all exit 0 (batch.py's rank 0 just ends, and its
followers then exit 1).
"""

import atexit
import contextlib
import os
import signal
import socket
import threading

import torch
import torch.distributed as dist

import tp
from engine import Engine
from formats.tokenizer import load_tokenizer
from memory import plan_blocks
from runtime import DTYPES, human, log, pick_device
from server.engine_flags import refuse_under_torchrun
from server.one_process import load_one_process
from server.tp_link import STEP, STOP, Link, pack

TIMEOUT_S = 600.0  # the process group's: the longest any collective waits (loading included)
CHECKED = (
    "checkpoint",
    "device",
    "dtype",
    "quantize",
    "dequantize",
    "block_size",
    "num_blocks",
    "kv_cache_memory",
    "max_num_seqs",
    "max_num_batched_tokens",
    "schedule_policy",
    "compile",
    "prefix_caching",
)


class LeaderCache:
    """Rank 0's cache as the engine sees it: the copy-on-write copies and step groups it is given
    are kept for the next broadcast; everything else is the real cache's."""

    def __init__(self, cache):
        self.inner, self.copies, self.groups = cache, [], None

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def copy_block(self, src: int, dst: int, pool: int = 0):
        self.inner.copy_block(src, dst, pool)
        self.copies.append((src, dst, pool))

    @contextlib.contextmanager
    def step_groups(self, groups):
        self.groups = groups
        with self.inner.step_groups(groups):
            yield self


class LeaderModel:
    """Rank 0's model as the engine sees it: each forward is first broadcast, then run here."""

    def __init__(self, model, link: Link):
        self.inner, self.link = model, link

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, tokens, input_pos, cache: LeaderCache, keep=None):
        with self.link.lock:
            if self.link.stopped:  # shutting down: the other ranks have gone
                raise RuntimeError("the tensor-parallel ranks have been stopped")
            try:
                keep = (
                    keep
                    if keep is not None
                    else torch.arange(tokens.shape[1], device=tokens.device)
                )
                self.link.send(*pack(cache.copies, cache.groups, tokens, input_pos, keep))
                cache.copies = []
                return self.inner(tokens, input_pos, cache.inner, keep=keep)
            except BaseException as e:
                # (an interrupt too) the ranks are out of step now: nothing can go on
                self.link.fail(e)


def ignore_signals_unless_rank_zero():
    """A follower ignores SIGTERM and SIGINT (rank 0 drains, then stops it). Call it on the main
    thread (only it may set handlers): serve.py does before its engine thread loads the model."""
    if (
        int(os.environ.get("RANK", "0")) != 0
        and threading.current_thread() is threading.main_thread()
    ):
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)


def follow(model, cache, link: Link):
    """Ranks other than 0: run each step rank 0 sends, until it says stop."""
    ignore_signals_unless_rank_zero()
    while True:
        try:
            kind, step = link.receive()
            if kind == STOP:
                return
            if kind == STEP:
                copies, groups, tokens, pos, keep = step
                for src, dst, pool in copies:
                    cache.copy_block(src, dst, pool)
                with torch.no_grad(), cache.step_groups(groups):  # (no rows kept: rank 0 samples)
                    model(tokens, pos, cache, keep=keep[:0])
        except Exception as e:
            link.fail(e)


def check_same_options(options: dict):
    """Every rank must run the same engine: ValueError naming the flags that differ."""
    mine = {k: options.get(k) for k in CHECKED}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    differ = {
        k: [o[k] for o in everyone] for k in CHECKED if any(o[k] != mine[k] for o in everyone)
    }
    if differ:
        raise ValueError(
            "every rank must be started with the same engine flags; these differ (per rank): "
            + "; ".join(f"{k}: {v}" for k, v in differ.items())
        )


def build(
    model,
    tokenizer,
    num_blocks=None,
    block_size=16,
    kv_cache_memory=None,
    max_num_seqs=64,
    max_num_batched_tokens=512,
    schedule_policy="fcfs",
    prefix_caching=True,
):
    """The engine on rank 0 of a parallelized model (tp.parallelize); on the other ranks, follow
    rank 0's steps and then end the process with exit code 0."""
    rank, world = dist.get_rank(), dist.get_world_size()
    num_blocks, window_blocks, plan = agreed_pool(
        model, block_size, num_blocks, kv_cache_memory, max_num_seqs, max_num_batched_tokens
    )
    peers = [None] * world
    dist.all_gather_object(peers, (socket.gethostname(), os.getpid()))
    engine = Engine.for_model(
        model,
        num_blocks,
        block_size,
        max_num_seqs,
        max_num_batched_tokens,
        prefix_caching,
        schedule_policy,
        tokenizer.stop_ids,
        tokenizer,
        window_blocks=window_blocks,
    )
    link = Link(engine.device, peers)
    if rank != 0:
        follow(model, engine.cache, link)
        dist.destroy_process_group()  # (as Link.stop does on rank 0)
        raise SystemExit(0)
    lead(engine, model, link, plan, num_blocks)
    return engine


def agreed_pool(
    model, block_size, num_blocks, kv_cache_memory, max_num_seqs, max_num_batched_tokens
):
    """(num_blocks, window_blocks, plan) of the KV pool every rank can hold: each rank plans the
    pool its own memory allows, and the smallest wins."""
    sizes = dict(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
    mine, _, _ = plan_blocks(
        model,
        block_size,
        num_blocks,
        kv_cache_memory,
        max_tokens=max_num_seqs * model.config.max_position_embeddings,
        **sizes,
    )
    # (NCCL reduces device tensors only)
    agreed = torch.tensor([mine], device=model.norm.weight.device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN)  # the pool every rank can hold
    num_blocks = int(agreed.item())
    _, window_blocks, plan = plan_blocks(model, block_size, num_blocks, **sizes)
    return num_blocks, window_blocks, plan


def lead(engine, model, link: Link, plan: str, num_blocks: int):
    """Rank 0: the pool logged, the engine's model and cache swapped for ones that broadcast each
    step first (LeaderModel, LeaderCache), the other ranks kept alive while idle and stopped at
    exit."""
    world, per_rank = len(link.peers), engine.cache.nbytes()
    pids = ", ".join(str(pid) for _, pid in link.peers)
    log(
        f"{plan}\ntensor parallel over {world} ranks (pids {pids}): {num_blocks} "
        f"blocks on each, {human(per_rank)} of KV per rank, {human(world * per_rank)} in all"
    )
    engine.model, engine.cache, engine.ranks = (
        LeaderModel(model, link),
        LeaderCache(engine.cache),
        world,
    )
    atexit.register(link.stop)
    threading.Thread(target=link.keep_alive, daemon=True, name="tp-keepalive").start()


def load_engine(**options):
    """load_one_process, and under torchrun with several processes the tensor-parallel engine:
    (Engine, tokenizer, load info) on rank 0; the other ranks serve rank 0 and exit 0 inside."""
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return load_one_process(**options)
    from formats import weights

    rank, world = tp.init(TIMEOUT_S)
    check_same_options(options)
    refuse_under_torchrun(options)
    device = pick_device(options.get("device"))
    device = f"cuda:{torch.cuda.current_device()}" if device.startswith("cuda") else device
    model, info = weights.load_for_inference(
        options.get("checkpoint"),
        device,
        DTYPES[options.get("dtype", "bfloat16")],
        options.get("quantize"),
        dequantize=options.get("dequantize", False),
        shard=(rank, world),
        log=log if rank == 0 else None,
    )
    tp.check_same_checkpoint(model)
    tp.parallelize(model)
    tokenizer = load_tokenizer(info.source)
    weights.settle()
    if rank == 0:
        log(
            f"loaded {info.source} in {info.load_s:.2f} s; this rank holds "
            f"{human(model.weight_bytes())} of weights"
        )
    names = (
        "num_blocks",
        "block_size",
        "kv_cache_memory",
        "max_num_seqs",
        "max_num_batched_tokens",
        "schedule_policy",
        "prefix_caching",
    )
    return (
        build(model, tokenizer, **{k: options[k] for k in names if k in options}),
        tokenizer,
        info,
    )
