"""The KV tier (speedups/kv_tier.py) on the embedded SmolLM2-135M, bf16, eager steps:

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/bench_kv_tier.py [--head 4000] [--heads 16]
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/bench_kv_tier.py --shape llama3.2-1b   # 1. only
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/bench_kv_tier.py --hybrid 512

1. Restart: a request sharing a `--head`-token head with one served before a "restart" (a new
   engine and a new DiskTier object over the same folder; the OS page cache dropped first where
   the process may): time to first token loading the head from disk, against computing it, and
   the rate the reload reaches (the KV bytes read over the time to first token).
2. Hot prefixes 4x the pool: `--heads` heads of 512 tokens, each asked 4 times in turn (a 16-token
   tail, 16 new tokens), through a pool of 4 sequences' worth: output tokens/s and the prefix-cache
   hit rate (pool and tier together) without a tier, with the host tier and with the disk tier.

`--shape llama3.2-1b`: Llama-3.2-1B's proportions (16 layers of 2,048, 8 KV heads of 64: 32 KiB
of KV a token) with random weights in bf16, the restart only (its prefill is what a reload
saves, at a size where the hot-prefix run would take too long here).

`--hybrid W`: every other layer given a W-token window (Gemma 2's pattern), so the engine has a
hybrid's two pools: a reload reads the full layers' blocks of the whole head and the windowed
layers' of its last window only (the GB/s column counts the bytes read).
"""

import argparse
import dataclasses
import os
import random
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from bench_serving import corpus, window

import runtime
from engine import Engine, RequestParams
from formats import fuse_layers, weights
from formats.tokenizer import load_tokenizer
from speedups.kv_disk import DiskTier
from speedups.kv_tier import HostTier, fingerprint, keep_pool


def drop_page_cache() -> str:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "dropped"
    except OSError:
        return "warm (could not drop it)"


def ttft(engine, prompt) -> float:
    start = time.perf_counter()
    engine.run_batch([prompt], RequestParams(max_new_tokens=1, temperature=0))
    return time.perf_counter() - start


def restart(model, ids, head_len: int, folder: str):
    rng, fp = random.Random(1), fingerprint(model, 16, model.norm.weight.dtype)
    head = window(ids, head_len, rng)
    a, b = head + window(ids, 16, rng), head + window(ids, 16, rng)
    blocks = 2 * (head_len + 64) // 16

    def engine(tier):
        return Engine.for_model(model, blocks, max_num_batched_tokens=512, tier=tier)

    ttft(engine(None), ids[:64])  # warm-up
    computed = ttft(engine(None), b)
    first = engine(DiskTier(folder, 2**34, fp))
    ttft(first, a)
    keep_pool(first)
    cache = drop_page_cache()
    again = engine(DiskTier(folder, 2**34, fp))
    loaded = ttft(again, b)
    hit, read = again.metrics()["tier_tokens_hit"], again.metrics()["tier_bytes_read"]
    gb = read / loaded / 1e9
    print(
        "\n| head | computed TTFT | loaded from disk TTFT | ratio | tokens loaded | GB/s | cache |"
    )
    print("|---|---|---|---|---|---|---|")
    print(
        f"| {head_len} | {computed * 1e3:.0f} ms | {loaded * 1e3:.0f} ms | "
        f"{loaded / computed:.2f} | {hit} | {gb:.2f} | {cache} |"
    )


def hot_prefixes(model, ids, n_heads: int, folder: str):
    rng = random.Random(2)
    heads = [window(ids, 512, rng) for _ in range(n_heads)]
    prompts = [h + window(ids, 16, rng) for _ in range(4) for h in heads]
    params = RequestParams(max_new_tokens=16, temperature=0, ignore_eos=True)
    pool = 4 * (512 + 32) // 16 + 8
    fp = fingerprint(model, 16, model.norm.weight.dtype)
    print(f"\n{n_heads} heads of 512 tokens ({n_heads * 32} blocks) through a pool of {pool}:")
    print("\n| tier | output tok/s | wall s | prefix hit rate | tokens from the tier |")
    print("|---|---|---|---|---|")
    for name, tier in (
        ("none", None),
        ("host", HostTier(2**34)),
        ("disk", DiskTier(os.path.join(folder, "hot"), 2**34, fp)),
    ):
        engine = Engine.for_model(
            model, pool, max_num_seqs=4, max_num_batched_tokens=512, tier=tier
        )
        start = time.perf_counter()
        out = engine.run_batch(prompts, params)
        secs, m = time.perf_counter() - start, engine.metrics()
        tokens = sum(len(r["tokens"]) for r in out)
        print(
            f"| {name} | {tokens / secs:.1f} | {secs:.1f} | "
            f"{m['prompt_tokens_hit'] / m['prompt_tokens']:.1%} | {m['tier_tokens_hit']} |",
            flush=True,
        )


def hybrid(model, window: int):
    """Gemma 2's layout on this model: a window on the odd layers (the outputs change, the work
    per layer does not, bar the window's attention)."""
    n = model.config.n_layers
    types = tuple("sliding_attention" if i % 2 else "full_attention" for i in range(n))
    model.config = dataclasses.replace(model.config, sliding_window=window, layer_types=types)
    for i, layer in enumerate(model.layers):
        layer.self_attn.window = model.config.window(i)


def main():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--head", type=int, default=4000)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--shape", choices=("smollm2-135m", "llama3.2-1b"), default="smollm2-135m")
    p.add_argument("--hybrid", type=int, default=0, metavar="W", help="windows on odd layers")
    args = p.parse_args()
    model, info = weights.load(None, dtype=torch.bfloat16, dequantize=True)
    ids = corpus(load_tokenizer(info.source))  # (SmolLM2's ids: valid in either vocabulary)
    if args.shape == "llama3.2-1b":
        from gpu_check import SHAPES, random_model

        model = random_model(SHAPES["llama3.2-1b"], "cpu", torch.bfloat16)
    fuse_layers.fuse_projections(model)
    if args.hybrid:
        hybrid(model, args.hybrid)
    print(
        f"# {runtime.cpu_capability()} | torch {torch.__version__} | "
        f"{torch.get_num_threads()} threads | {args.shape} bf16, eager"
        + (f", a {args.hybrid}-token window on every other layer" if args.hybrid else "")
    )
    with tempfile.TemporaryDirectory(prefix="kv-tier-") as folder:
        restart(model, ids, args.head, folder)
        if args.shape == "smollm2-135m":
            hot_prefixes(model, ids, args.heads, folder)


if __name__ == "__main__":
    main()
