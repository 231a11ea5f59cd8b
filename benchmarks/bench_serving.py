"""Serving benchmarks for paged.py + scheduler.py + engine.py on the embedded SmolLM2-135M, one
process, with Hugging Face transformers' static batching in the same run.

    .venv/bin/python benchmarks/bench_serving.py                      # everything (~15 min)
    .venv/bin/python benchmarks/bench_serving.py --only prefix,chunked

Prompts are windows of data/declaration.txt's tokens (fixed seeds); every request sets ignore_eos,
so each produces exactly its output length; greedy; bf16; eager engine (on CPU, compiled steps gain
about 20% at 64 rows but compile one graph per batch bucket, under a minute each).

0. batch 1: generate.py's loop on the static and on the paged cache, eager and compiled.
1. throughput: 64 requests at once, prompts 50-500 tokens, outputs 32-128. Output tokens/s over
   the whole run, prefill included, for the engine; for HF `generate` on the same requests in
   left-padded static batches of 16 (each batch runs until its longest request is done; only
   the tokens each request asked for are counted); and for generate.py at batch 1 (one request's
   decode tokens/s, eager and compiled).
2. paging: the same requests with a KV budget that holds 16 sequences of the longest length:
   the paged cache against a static-style reservation of that length per request.
3. prefix: 32 requests sharing a 1,000-token head plus 20-60 tokens of their own, 32 output
   tokens: mean time to first token with and without prefix caching.
4. chunked: 16 requests decoding when a 4,000-token prompt arrives: p99 gap between tokens of
   the 16, and the long prompt's own time to first token, with chunks of 512 and without.
5. soak: the test suite's soak at scale: 500 requests, random arrivals and aborts, a tight pool.
"""

import argparse
import os
import random
import resource
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(1, os.path.join(ROOT, "tests"))

from helpers import check_allocator

import compiling
import generate
import memory
from batch import percentile
from engine import Engine, Finished, RequestParams
from formats import hf_folder, weights
from formats.tokenizer import load_tokenizer
from kv_cache import StaticKVCache
from paged import PagedKVCache, blocks_for
from sampling import SamplingParams


def corpus(tokenizer):
    with open(os.path.join(ROOT, "data", "declaration.txt")) as f:
        ids = tokenizer.encode(f.read())
    return ids * (1 + 6000 // len(ids))  # long enough for a 4,000-token window


def window(ids, n, rng):
    start = rng.randrange(len(ids) - n)
    return ids[start : start + n]


def run_engine(model, prompts, news, arrive_after=None, **kw) -> dict:
    """All requests through one Engine; `arrive_after` = (step, prompt, new): one more request
    added at that step. Returns throughput, latencies and what the pool went through."""
    engine = Engine.for_model(model, **{"num_blocks": 3000, "block_size": 16, **kw})
    ids = [
        engine.add_request(p, RequestParams(max_new_tokens=n, temperature=0.0, ignore_eos=True))
        for p, n in zip(prompts, news)
    ]
    reqs = [engine.requests[i] for i in ids]
    late, steps, start = None, 0, time.perf_counter()
    while engine.has_unfinished() or (arrive_after and late is None):
        if arrive_after and late is None and steps == arrive_after[0]:
            late = engine.requests[
                engine.add_request(
                    arrive_after[1],
                    RequestParams(max_new_tokens=arrive_after[2], temperature=0.0, ignore_eos=True),
                )
            ]
        engine.step()
        steps += 1
    elapsed = time.perf_counter() - start
    seqs = [r.seqs[0] for r in reqs]
    gaps = [b - a for s in seqs for a, b in zip(s.token_times, s.token_times[1:])]
    # gaps that end while the late request is being prefilled (up to its first token)
    late_gaps = [
        b - a
        for s in seqs
        for a, b in zip(s.token_times, s.token_times[1:])
        if late and late.arrival < b <= late.seqs[0].token_times[0]
    ]
    st = engine.scheduler.stats
    return {
        "elapsed": elapsed,
        "out_tps": sum(len(s.output) for s in seqs) / elapsed,
        "ttft": sum(s.token_times[0] - r.arrival for s, r in zip(seqs, reqs)) / len(seqs),
        "p99_gap": percentile(gaps, 0.99),
        "p99_gap_late": percentile(late_gaps, 0.99) if late else None,
        "max_gap_late": max(late_gaps) if late else None,
        "late_ttft": late.seqs[0].token_times[0] - late.arrival if late else None,
        "peak_running": st["peak_running"],
        "preemptions": st["preemptions"],
        "steps": st["steps"],
        "peak_kv": st["peak_blocks"]
        * memory.bytes_per_block(model, engine.block_size),  # (one pool: not a hybrid)
        "hit": st["prompt_tokens_hit"] / max(1, st["prompt_tokens"]),
    }


def run_hf_static(hf, prompts, news, batch_size=16, pad_id=0) -> dict:
    """HF generate in left-padded static batches; counts only the tokens each request asked for
    (and returns them, per request, as "outputs")."""
    outputs, start = [], time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        ps, ns = prompts[i : i + batch_size], news[i : i + batch_size]
        width = max(map(len, ps))
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in ps])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ps])
        with torch.no_grad():
            out = hf.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max(ns),
                min_new_tokens=max(ns),
                do_sample=False,
                pad_token_id=pad_id,
            )
        outputs += [row[width : width + n].tolist() for row, n in zip(out, ns)]
    elapsed = time.perf_counter() - start
    return {"elapsed": elapsed, "out_tps": sum(news) / elapsed, "outputs": outputs}


def batch1_decode(model, prompt, n, compiled: bool) -> float:
    """generate.py's loop, batch 1, static cache: decode tokens/s (median of 3)."""
    fn = (
        compiling.compile_decode("cpu", autotune=compiling.autotune(model))
        if compiled
        else compiling.decode_one
    )
    cache = StaticKVCache.for_model(model, 1, len(prompt) + n + 64)
    runs = []
    for _ in range(4):  # the first run warms up (and compiles)
        _, timing = generate.generate(
            model,
            cache,
            torch.tensor([prompt]),
            n,
            SamplingParams(0.0),
            generate.DecodeOptions(ignore_eos=True, decode_fn=fn),
        )
        runs.append(timing["tokens_per_s"])
    return sorted(runs[1:])[1]


def batch1_caches(model, ids):
    """generate.py at batch 1 on each cache, eager and compiled, rounds interleaved, medians."""
    prompt, n = ids[:200], 128
    fns = {"eager": compiling.decode_one, "compiled": None}
    rows = {}
    for kind in ("static", "paged"):
        for mode in fns:
            cache = (
                StaticKVCache.for_model(model, 1, 384)
                if kind == "static"
                else PagedKVCache.for_batch(model, 1, 384)
            )
            fn = fns[mode] or compiling.compile_decode("cpu", autotune=compiling.autotune(model))
            rows[kind, mode] = (cache, fn, [])
            generate.generate(
                model,
                cache,
                torch.tensor([prompt]),
                8,
                SamplingParams(0.0),
                generate.DecodeOptions(ignore_eos=True, decode_fn=fn),
            )  # warm-up (compiles)
    for _ in range(3):
        for cache, fn, runs in rows.values():
            _, timing = generate.generate(
                model,
                cache,
                torch.tensor([prompt]),
                n,
                SamplingParams(0.0),
                generate.DecodeOptions(ignore_eos=True, decode_fn=fn),
            )
            runs.append(timing["tokens_per_s"])
    print(
        "\n### 0. Batch 1: generate.py's loop on the static and the paged cache "
        "(200-token prompt, 128 tokens)\n"
    )
    print("| mode | static tok/s | paged tok/s | paged / static |")
    print("|---|---|---|---|")
    for mode in fns:
        s, p = (sorted(rows[kind, mode][2])[1] for kind in ("static", "paged"))
        print(f"| {mode} | {s:.1f} | {p:.1f} | {p / s:.2f} |")


def throughput_and_paging(model, ids, only):
    rng = random.Random(0)
    lengths = [rng.randint(50, 500) for _ in range(64)]
    news = [rng.randint(32, 128) for _ in range(64)]
    prompts = [window(ids, n, rng) for n in lengths]
    if "throughput" in only:
        import tempfile

        from transformers import AutoModelForCausalLM

        folder = hf_folder.save_hf_folder(
            weights.load(None, dequantize=True)[0], tempfile.mkdtemp(prefix="smollm2-hf-")
        )
        hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16).eval()
        run_hf_static(hf, prompts[:2], [4, 4])  # warm-up
        hf_run = run_hf_static(hf, prompts, news)
        ours = run_engine(model, prompts, news)
        eager1 = batch1_decode(model, prompts[0], 128, compiled=False)
        compiled1 = batch1_decode(model, prompts[0], 128, compiled=True)
        print(
            "\n### 1. Throughput: 64 requests, prompts 50-500 tokens, outputs 32-128, all at once\n"
        )
        print(
            "| implementation | output tok/s (whole run) | wall s | vs HF static batches "
            "| vs generate.py batch 1 eager | vs batch 1 compiled |"
        )
        print("|---|---|---|---|---|---|")
        for name, r in (
            ("HF transformers generate, static batches of 16 (left-padded)", hf_run),
            ("engine.py continuous batching (64 seqs, 512-token steps)", ours),
        ):
            print(
                f"| {name} | {r['out_tps']:.1f} | {r['elapsed']:.1f} | "
                f"{r['out_tps'] / hf_run['out_tps']:.2f}x | "
                f"{r['out_tps'] / eager1:.2f}x | {r['out_tps'] / compiled1:.2f}x |"
            )
        print(
            "| generate.py batch 1, eager (decode tok/s of one request) | "
            f"{eager1:.1f} | | | 1.00x | |"
        )
        print(f"| generate.py batch 1, --compile | {compiled1:.1f} | | | | 1.00x |")
        print(
            f"\nengine: mean TTFT {ours['ttft']:.2f} s, peak running {ours['peak_running']}, "
            f"peak KV {ours['peak_kv'] / 2**20:.0f} MiB, {ours['steps']} steps"
        )
        del hf
    if "paging" in only:
        longest = max(p + n for p, n in zip(lengths, news))
        per_seq = blocks_for(longest, 16)
        budget = 1 + 16 * per_seq
        print(
            f"\n### 2. Paging: the same 64 requests, a KV budget of {budget - 1} blocks "
            f"({(budget - 1) * 16} tokens = 16 x the longest request, {longest} tokens)\n"
        )
        print(
            "| cache | most running at once | output tok/s | wall s | preemptions | peak KV MiB |"
        )
        print("|---|---|---|---|---|---|")
        for name, kw in (
            (
                "static-style: reserve the longest length per request",
                dict(reserve_tokens=per_seq * 16),
            ),
            ("paged: blocks as tokens arrive", {}),
        ):
            r = run_engine(model, prompts, news, num_blocks=budget, **kw)
            print(
                f"| {name} | {r['peak_running']} | {r['out_tps']:.1f} | {r['elapsed']:.1f} | "
                f"{r['preemptions']} | {r['peak_kv'] / 2**20:.0f} |"
            )


def prefix(model, ids):
    rng = random.Random(1)
    head = window(ids, 1000, rng)
    prompts = [head + window(ids, rng.randint(20, 60), rng) for _ in range(32)]
    print(
        "\n### 3. Prefix caching: 32 requests sharing a 1,000-token head, "
        "20-60 tokens each of their own, 32 output tokens\n"
    )
    print("| prefix caching | mean TTFT s | wall s | output tok/s | prompt tokens from cache |")
    print("|---|---|---|---|---|")
    results = {}
    for on in (False, True):
        r = results[on] = run_engine(model, prompts, [32] * 32, prefix_caching=on)
        print(
            f"| {'on' if on else 'off'} | {r['ttft']:.2f} | {r['elapsed']:.1f} | "
            f"{r['out_tps']:.1f} | {100 * r['hit']:.0f}% |"
        )
    print(
        f"\nmean TTFT: {results[False]['ttft'] / results[True]['ttft']:.1f}x lower with prefix "
        "caching"
    )


def chunked(model, ids):
    rng = random.Random(2)
    prompts = [window(ids, 100, rng) for _ in range(16)]
    long_prompt = window(ids, 4000, rng)
    print(
        "\n### 4. Chunked prefill: a 4,000-token prompt arrives while 16 requests decode (200 "
        "tokens each)\n"
    )
    print(
        "| prefill | p99 / max gap between tokens of the 16 while it prefills, ms "
        "| p99 gap, whole run, ms | its TTFT s | wall s |"
    )
    print("|---|---|---|---|---|")
    for name, budget in (
        ("chunks of 256 tokens", 256),
        ("chunks of 512 tokens", 512),
        ("whole prompt in one step", 4096 + 16),
    ):
        r = run_engine(
            model,
            prompts,
            [200] * 16,
            arrive_after=(20, long_prompt, 8),
            max_num_batched_tokens=budget,
        )
        print(
            f"| {name} | {1e3 * r['p99_gap_late']:.0f} / {1e3 * r['max_gap_late']:.0f} | "
            f"{1e3 * r['p99_gap']:.0f} | "
            f"{r['late_ttft']:.2f} | {r['elapsed']:.1f} |"
        )


def soak(model, ids, count=500):
    """The soak test at scale: random lengths, arrivals and aborts under a tight pool; the
    allocator's invariants checked every 25 steps, every block free at the end."""
    rng = random.Random(3)
    reqs = [(window(ids, rng.randint(20, 200), rng), rng.randint(8, 64)) for _ in range(count)]
    engine = Engine.for_model(
        model, num_blocks=200, block_size=16, max_num_seqs=32, max_num_batched_tokens=512
    )
    pending, aborted, finished, start = list(range(count)), 0, 0, time.perf_counter()
    while pending or engine.has_unfinished():
        for _ in range(rng.randint(0, 4)):
            if pending:
                i = pending.pop(0)
                engine.add_request(
                    reqs[i][0], RequestParams(max_new_tokens=reqs[i][1], temperature=0.8, seed=i)
                )
        if engine.scheduler.running and rng.random() < 0.03:
            engine.abort(rng.choice(engine.scheduler.running).request.id)
            aborted += 1
        finished += sum(isinstance(e, Finished) for e in engine.step())
        if engine.scheduler.stats["steps"] % 25 == 0:
            for allocator in engine.scheduler.pools:
                check_allocator(allocator)
    for allocator in engine.scheduler.pools:
        check_allocator(allocator)
    elapsed = time.perf_counter() - start
    print(
        f"\n### 5. Soak: {count} requests (prompts 20-200, outputs 8-64, sampled), random "
        f"arrivals, {aborted} aborted, 199 blocks for up to 32 sequences\n"
    )
    st = engine.scheduler.stats
    print(
        f"{finished} finished in {elapsed:.1f} s, {st['steps']} steps, "
        f"{st['preemptions']} preemptions, "
        f"prefix-cache hit rate {st['prompt_tokens_hit'] / max(1, st['prompt_tokens']):.0%}, "
        f"blocks in use at the end: {engine.scheduler.blocks_used()} "
        "(invariants checked every 25 steps)"
    )
    assert engine.scheduler.blocks_used() == 0 and finished == count


def main():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--only",
        default="batch1,throughput,paging,prefix,chunked,soak",
        help="comma-separated workloads",
    )
    args = p.parse_args()
    only = set(args.only.split(","))
    torch.manual_seed(0)
    model, info = weights.load(None, dtype=torch.bfloat16, dequantize=True)
    ids = corpus(load_tokenizer(info.source))
    print(f"SmolLM2-135M bf16, {torch.get_num_threads()} threads, torch {torch.__version__}")
    if "batch1" in only:
        batch1_caches(model, ids)
    if only & {"throughput", "paging"}:
        throughput_and_paging(model, ids, only)
    if "prefix" in only:
        prefix(model, ids)
    if "chunked" in only:
        chunked(model, ids)
    if "soak" in only:
        soak(model, ids)
    print(
        f"\nprocess peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10:.0f} MiB"
    )


if __name__ == "__main__":
    main()
