"""Sliding windows: decode cost at 1x and 4x the window, next to HF transformers in the same run.

    .venv/bin/python benchmarks/bench_windows.py [--window 1024] [--multiples 1 4] [--layers 12]
                                                 [--dtype bfloat16] [--skip_compile] [--skip_hf]
                                                 [--hybrid 6]

A Mistral of SmolLM2-135M's proportions (dim 576, 9 heads, 3 KV heads, head_dim 64, FFN 1536,
vocabulary 49152; `--layers` of them) with random weights and a sliding window of `--window`
on every layer; or, with `--hybrid N`, a Gemma 3 text model of the same proportions whose every
N-th layer sees the whole context (Gemma 3's pattern is 6: five windowed layers to one full).
For each multiple m a prompt of m * window random tokens is prefilled (untimed),
then `--new_tokens` tokens are decoded greedily, batch 1, EOS ignored:

- ours, static cache (generate.py's loop), eager and compiled (generate.py --compile's step): "ring"
  is speedups/kv_window.py (what generate.py uses for windowed models: each layer keeps window + 64
  slots, a step reads them all), so its cost should follow the window, not the context; "masked" is
  kv_cache.py, its slow twin, which keeps every position and masks the old ones;
- ours, paged cache through the engine (batch.py's path): blocks behind the window are freed, and
  the step reads only the window's blocks; the most blocks the sequence held in the windowed
  layers is printed against the bound window / block_size + 2. A hybrid model runs it twice:
  with the windowed layers' own pool (memory.py), and with one pool keeping every block
  (`window_blocks=0`, as before that pool existed), each with its KV pools' bytes;
- HF transformers eager on the same weights (MistralForCausalLM or Gemma3ForCausalLM, its
  DynamicCache keeping the window), decoded by a plain loop of forwards.

Each configuration is warmed up, then `--rounds` interleaved rounds run (every other one in reverse
order), each row keeping its median.
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import compiling
import generate
import runtime
from engine import Engine, RequestParams
from formats import weights
from kv_cache import StaticKVCache
from sampling import SamplingParams
from speedups.kv_window import WindowedKVCache


def build(args):
    """(HF model, our model) on the same random weights."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, MistralConfig, MistralForCausalLM

    shape = dict(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=args.layers,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        sliding_window=args.window,
        max_position_embeddings=max(args.multiples) * args.window + 2 * args.new_tokens,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    if args.hybrid:
        types = [
            "full_attention" if (i + 1) % args.hybrid == 0 else "sliding_attention"
            for i in range(args.layers)
        ]
        hf = Gemma3ForCausalLM(Gemma3TextConfig(**shape, layer_types=types))
    else:
        hf = MistralForCausalLM(MistralConfig(**shape, rope_theta=100000.0))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_((1.0 if "norm" in name else 0.0) + 0.02 * torch.randn_like(p))
    folder = tempfile.mkdtemp(prefix="windowed-")
    hf.save_pretrained(folder, safe_serialization=True)
    dtype = runtime.DTYPES[args.dtype]
    model, _ = weights.load(folder, dtype=dtype)
    return hf.to(dtype).eval(), model


def static_run(model, prompt, n, decode_fn, kind, kv_bytes):
    """() -> tokens/s of n greedy steps after prefilling `prompt` into a fresh static cache of
    `kind`."""
    cache = kind.for_model(model, 1, len(prompt) + n)
    kv_bytes[kind.__name__, len(prompt)] = cache.nbytes()
    x = torch.tensor([prompt])
    with torch.no_grad():
        cache.use_positions(len(prompt) - 1, round_up=False)
        model(x[:, :-1], torch.arange(len(prompt) - 1)[None], cache)

    def run():
        rows, t = generate.generate(
            model,
            cache,
            x[:, -1:],
            n,
            SamplingParams(0.0),
            generate.DecodeOptions(ignore_eos=True, decode_fn=decode_fn, start_pos=len(prompt) - 1),
        )
        return t["tokens_per_s"]

    return run


def engine_run(model, prompt, n, block_size, held, kv_bytes, window_blocks=None):
    """() -> decode tokens/s of one request through the engine; held[0]: the most blocks it held in
    its windowed layers (every layer's table, but a hybrid's windowed one)."""

    def run():
        engine = Engine.for_model(
            model,
            num_blocks=len(prompt) // block_size + 64,
            block_size=block_size,
            max_num_seqs=1,
            max_num_batched_tokens=512,
            window_blocks=window_blocks,
        )
        kv_bytes[
            f"paged, {engine.cache.num_blocks} + {engine.cache.window_blocks} blocks", len(prompt)
        ] = engine.cache.nbytes()
        engine.add_request(
            prompt, RequestParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
        )
        steps, start = 0, None
        while engine.has_unfinished():
            decoding = any(s.num_computed >= len(prompt) for s in engine.scheduler.running)
            if decoding and start is None:
                start = time.perf_counter()
            engine.step()
            steps += decoding
            for s in engine.scheduler.running:
                held[0] = max(
                    held[0],
                    sum(
                        1
                        for b in (s.window_blocks if engine.cache.window_blocks else s.blocks)
                        if b
                    ),
                )
        return (steps - 1) / (time.perf_counter() - start)

    return run


def hf_run(hf, prompt, n):
    from transformers import DynamicCache

    def run():
        dc, x = DynamicCache(config=hf.config), torch.tensor([prompt])
        with torch.no_grad():
            token = (
                hf(input_ids=x, past_key_values=dc, use_cache=True)
                .logits[:, -1]
                .argmax(-1, keepdim=True)
            )
            start = time.perf_counter()
            for _ in range(n - 1):
                token = (
                    hf(input_ids=token, past_key_values=dc, use_cache=True)
                    .logits[:, -1]
                    .argmax(-1, keepdim=True)
                )
        return (n - 1) / (time.perf_counter() - start)

    return run


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--multiples", type=int, nargs="+", default=[1, 4])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--new_tokens", type=int, default=32)
    p.add_argument("--block_size", type=int, default=16)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dtype", default="bfloat16", choices=sorted(runtime.DTYPES))
    p.add_argument("--skip_compile", action="store_true")
    p.add_argument("--skip_hf", action="store_true")
    p.add_argument(
        "--hybrid", type=int, default=0, help="every N-th layer full (Gemma 3: 6); 0: all windowed"
    )
    args = p.parse_args()
    hf, model = build(args)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"CPU capability {runtime.cpu_capability()}, "
        f"{args.dtype}, {args.layers} layers "
        f"({f'every {args.hybrid}th full' if args.hybrid else 'all windowed'}), "
        f"window {args.window}, contexts "
        f"{[m * args.window for m in args.multiples]}, {args.new_tokens} new tokens",
        flush=True,
    )
    compiled = (
        None
        if args.skip_compile
        else compiling.compile_decode("cpu", autotune=compiling.autotune(model))
    )
    rng = torch.Generator().manual_seed(1)
    rows, held, kv_bytes = [], {}, {}
    for m in args.multiples:
        prompt = torch.randint(3, 49152, (m * args.window,), generator=rng).tolist()
        for name, kind in (("ring", WindowedKVCache), ("masked", StaticKVCache)):
            rows.append(
                (
                    f"ours static {name} eager",
                    m,
                    static_run(model, prompt, args.new_tokens, generate.decode_one, kind, kv_bytes),
                )
            )
            if compiled:
                rows.append(
                    (
                        f"ours static {name} compiled",
                        m,
                        static_run(model, prompt, args.new_tokens, compiled, kind, kv_bytes),
                    )
                )
        for label, window_blocks in (("ours paged engine", None),) + (
            (("ours paged engine, one pool", 0),) if args.hybrid else ()
        ):
            held[label, m] = [0]
            rows.append(
                (
                    label,
                    m,
                    engine_run(
                        model,
                        prompt,
                        args.new_tokens,
                        args.block_size,
                        held[label, m],
                        kv_bytes,
                        window_blocks,
                    ),
                )
            )
        if not args.skip_hf:
            rows.append(("HF transformers eager", m, hf_run(hf, prompt, args.new_tokens)))
    start = time.perf_counter()
    for _, _, run in rows:  # warm-up (compiles each attend length once)
        run()
    print(f"warm-up (compiling included): {time.perf_counter() - start:.1f} s", flush=True)
    speeds = [[] for _ in rows]
    for r in range(
        args.rounds
    ):  # every other round in reverse order: no row always runs first or last
        for i in range(len(rows)) if r % 2 == 0 else reversed(range(len(rows))):
            speeds[i].append(rows[i][2]())
    median = {(label, m): statistics.median(s) for (label, m, _), s in zip(rows, speeds)}
    base = min(args.multiples)
    print(
        f"\n| path | context | tok/s | vs {base}x window | "
        f"KV blocks held (bound {args.window // args.block_size + 2}) |"
    )
    print("|---|---|---|---|---|")
    for label, m, _ in rows:
        ratio = median[(label, m)] / median[(label, base)]
        blocks = str(held[label, m][0]) if "paged" in label else ""
        print(
            f"| {label} | {m * args.window} ({m}x) | {median[(label, m)]:.1f} | "
            f"{ratio:.2f} | {blocks} |"
        )
    print(
        "\nKV cache bytes: "
        + ", ".join(
            f"{name} at {n} tokens {b / 2**20:.1f} MiB" for (name, n), b in sorted(kv_bytes.items())
        )
    )


if __name__ == "__main__":
    main()
