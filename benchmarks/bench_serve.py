"""Load test of serve.py: N concurrent streaming clients (the `openai` client) on loopback, against
the offline engine on the same requests, in one run.

    .venv/bin/python benchmarks/bench_serve.py [--clients 1 8 32] [--requests 64]
                                               [--max_tokens 64]   # ~7 min

The server runs as its own process (`serve.py --port 0`, the embedded SmolLM2-135M in bf16, the
default engine flags but --max_num_seqs = the most clients); each client sends its share of the
requests one after another, streaming. Prompts are windows of data/declaration.txt of 50-300
tokens sent as token ids, greedy, `ignore_eos` (an extension) so every request produces
exactly --max_tokens tokens. Reported per client count: requests/s, output tokens/s, time to
first token p50/p90 (measured by the client, from sending to the first chunk with text), and
output tokens/s as a fraction of the offline engine's (engine.py's `run_batch`, all requests
at once, same engine settings, in this process).
"""

import argparse
import asyncio
import os
import random
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from batch import percentile


def start_server(max_num_seqs: int):
    proc = subprocess.Popen(
        [
            sys.executable,
            os.path.join(ROOT, "serve.py"),
            "--port",
            "0",
            "--max_num_seqs",
            str(max_num_seqs),
            "--num_blocks",
            "4000",
            "--dequantize",
        ],
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    for line in proc.stderr:
        if line.startswith("serving on "):
            return proc, line.split()[2]
    raise RuntimeError("the server exited before it was ready")


async def load(url, prompts, clients: int, max_tokens: int) -> dict:
    import openai

    # retries: a kept-alive connection the server closed as a request went out fails before any work
    c = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=2)
    todo, ttfts, tpots, tokens = list(prompts), [], [], 0

    async def worker():
        nonlocal tokens
        while todo:
            prompt = todo.pop()
            sent = time.perf_counter()
            first, n, chunks = None, 0, 0
            stream = await c.completions.create(
                model="m",
                prompt=prompt,
                max_tokens=max_tokens,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].text:
                    first, chunks = first or time.perf_counter() - sent, chunks + 1
                if chunk.usage:
                    n = chunk.usage.completion_tokens
            n = n or chunks  # (a server that sends no usage: a token per chunk)
            tokens += n
            ttfts.append(first)
            tpots.append(
                (time.perf_counter() - sent - first) / max(n - 1, 1)
            )  # time per output token after the first

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(clients)))
    elapsed = time.perf_counter() - start
    await c.close()
    return {
        "clients": clients,
        "requests": len(prompts),
        "rps": len(prompts) / elapsed,
        "tps": tokens / elapsed,
        "ttft50": percentile(ttfts, 0.5),
        "ttft90": percentile(ttfts, 0.9),
        "tpot50": percentile(tpots, 0.5),
        "elapsed": elapsed,
    }


def offline(prompts, max_tokens: int, max_num_seqs: int) -> float:
    import torch

    from engine import Engine, RequestParams
    from formats import weights

    model, _ = weights.load(None, dtype=torch.bfloat16, dequantize=True)
    engine = Engine.for_model(model, num_blocks=4000, max_num_seqs=max_num_seqs)
    start = time.perf_counter()
    out = engine.run_batch(
        prompts, RequestParams(max_new_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    )
    return sum(len(o["tokens"]) for o in out) / (time.perf_counter() - start)


def main():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--max_tokens", type=int, default=64)
    args = p.parse_args()
    from formats import weights
    from formats.tokenizer import load_tokenizer

    _, info = weights.load(None, dequantize=True)
    with open(os.path.join(ROOT, "data", "declaration.txt")) as f:
        ids = load_tokenizer(info.source).encode(f.read())
    rng = random.Random(0)
    prompts = []
    for _ in range(args.requests):
        n = rng.randint(50, 300)
        start = rng.randrange(len(ids) - n)
        prompts.append(ids[start : start + n])
    most = max(args.clients)
    proc, url = start_server(most)
    try:
        asyncio.run(load(url, prompts[:2], 2, 4))  # warm-up
        rows = [asyncio.run(load(url, prompts, n, args.max_tokens)) for n in args.clients]
    finally:
        proc.terminate()
        proc.wait()
    engine_tps = offline(prompts, args.max_tokens, most)
    print(
        f"\n{args.requests} requests, prompts 50-300 tokens, {args.max_tokens} output tokens each, "
        "streamed over loopback\n"
    )
    print(
        "| clients | requests/s | output tok/s | TTFT p50 s | TTFT p90 s | wall s | vs offline "
        "engine |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['clients']} | {r['rps']:.2f} | {r['tps']:.1f} | {r['ttft50']:.2f} | "
            f"{r['ttft90']:.2f} | {r['elapsed']:.1f} | {r['tps'] / engine_tps:.0%} |"
        )
    print(
        f"| offline engine (engine.py run_batch, all at once, max_num_seqs {most}) | | "
        f"{engine_tps:.1f} | | | | 100% |"
    )


if __name__ == "__main__":
    main()
