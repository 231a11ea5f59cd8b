"""Speculative decoding against plain decoding, compiled, greedy, batch 1, one process.

    .venv/bin/python benchmarks/bench_speculative.py [--k 4] [--new_tokens 96]  # ~20 min (compiles)

The target is the embedded SmolLM2-135M in bf16. Drafters: prompt lookup (n <= 3), the target's
own first layers (layer-skip), and quantized copies of the target (int8, and int4 at group 64:
the embedded weights already are int4 at group 32, which would accept everything). Every step
is compiled as generate.py --compile does (the target's one-token step for plain decoding, its
verification of 1 and of k + 1 tokens, each drafter's one-token step); compile time is kept out.

For each drafter the script reports the acceptance rate alpha (accepted / drafted), the measured
cost ratio c (time of one draft step / time of one verification), the speed-up its alpha and c
predict, (1 - alpha^(k+1)) / ((1 - alpha)(k c + 1)), the measured speed-up over plain decoding
of the same prompt (median of 3 runs each, interleaved), and their ratio. Two prompts: a story
opening (drafts must guess) and a copy task (the answer repeats code from the prompt).
All speculative outputs are checked equal to plain greedy decoding.
"""

import argparse
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import compiling
import generate
import quantize
from formats import weights
from formats.tokenizer import load_tokenizer
from kv_cache import StaticKVCache
from sampling import SamplingParams
from speculative import ModelDrafter, draft_forward, speculative_generate
from speedups.prompt_lookup import PromptLookupDrafter

CODE = (
    "def add(a, b):\n    result = a + b\n    return result\n\n\n"
    "def sub(a, b):\n    result = a - b\n    return result\n\n\n"
    "def mul(a, b):\n    result = a * b\n    return result\n\n\n"
)
PROMPTS = {
    "story": "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "copy": CODE + "# The same three functions again, with `result` renamed to `out`:\n",
}
GREEDY = SamplingParams(0.0)


def median(xs):
    return sorted(xs)[len(xs) // 2]


def predicted(alpha, c, k):
    if alpha >= 1:
        return (k + 1) / (k * c + 1)
    return (1 - alpha ** (k + 1)) / ((1 - alpha) * (k * c + 1))


def main():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--new_tokens", type=int, default=96)
    p.add_argument("--layers", type=int, default=15, help="layer-skip draft depth")
    args = p.parse_args()
    k, n = args.k, args.new_tokens
    target, info = weights.load(None, dtype=torch.bfloat16, dequantize=True)
    tok = load_tokenizer(info.source)
    seq_len = 512
    cache = StaticKVCache.for_model(target, 1, seq_len)
    t0 = time.perf_counter()
    plain_fn = compiling.compile_decode("cpu")
    verify_fns = {t: compiling.compile_decode("cpu", compiling.verify_step) for t in (1, k + 1)}
    drafters = {
        "prompt lookup n<=3": PromptLookupDrafter(3, target.config.vocab_size),
        f"layer-skip, first {args.layers} of 30 layers": ModelDrafter(
            target,
            seq_len,
            GREEDY,
            layers=args.layers,
            step_fn=compiling.compile_decode("cpu", draft_forward),
        ),
    }
    for mode, group in (("int8", 64), ("int4", 64)):
        draft, _ = weights.load(None, dtype=torch.bfloat16, dequantize=True)
        quantize.quantize_model(draft, mode, group, head=True)
        step = compiling.compile_decode("cpu", draft_forward, autotune=compiling.autotune(draft))
        label = f"{mode} copy of the target" + (
            f" (group {group}, head quantized)" if mode == "int4" else " (head quantized)"
        )
        drafters[label] = ModelDrafter(draft, seq_len, GREEDY, step_fn=step)

    def plain(ids):
        rows, timing = generate.generate(
            target,
            cache,
            torch.tensor([ids]),
            n,
            GREEDY,
            generate.DecodeOptions(ignore_eos=True, decode_fn=plain_fn),
        )
        return rows[0], timing["tokens_per_s"]

    def spec(drafter, ids):
        drafter.rollback(0)
        out, stats = speculative_generate(
            target, cache, drafter, ids, n, GREEDY, k, ignore_eos=True, verify_fns=verify_fns
        )
        stats["c"] = (stats["draft_s"] / max(stats["drafted"], 1)) / (
            stats["target_s"] / stats["rounds"]
        )
        return out, stats

    for name, text in PROMPTS.items():  # warm-up: compiles every graph on both prompts' shapes
        ids = tok.encode(text)
        plain(ids)
        for d in drafters.values():
            spec(d, ids)
            for t, fn in verify_fns.items():
                with torch.no_grad():
                    fn(target, cache, torch.zeros(1, t, dtype=torch.long), torch.arange(t)[None])
    print(f"compiled everything in {time.perf_counter() - t0:.0f} s\n")
    print(
        f"SmolLM2-135M bf16 target, compiled, greedy, batch 1, k = {k}, {n} new tokens, "
        "median of 3 interleaved runs\n"
    )
    print(
        "| prompt | drafter | tok/s | measured speed-up | alpha | tokens/round | c | predicted "
        "| measured / predicted | same tokens |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, text in PROMPTS.items():
        ids = tok.encode(text)
        runs = {"plain": []} | {d: [] for d in drafters}
        reference = None
        for _ in range(3):
            out, tps = plain(ids)
            reference = out
            runs["plain"].append((tps, None, out))
            for label, d in drafters.items():
                out, stats = spec(d, ids)
                runs[label].append((stats["tokens_per_s"], stats, out))
        base = median([r[0] for r in runs["plain"]])
        print(f"| {name} | none (plain decoding) | {base:.1f} | 1.00x | | 1 | | | | |")
        for label in drafters:
            tps, stats, out = sorted(runs[label], key=lambda r: r[0])[1]
            a, c = stats["acceptance_rate"], stats["c"]
            pred = predicted(a, c, k)
            print(
                f"| {name} | {label} | {tps:.1f} | {tps / base:.2f}x | {a:.2f} | "
                f"{stats['tokens_per_round']:.2f} | "
                f"{c:.3f} | {pred:.2f}x | {tps / base / pred:.0%} | {out == reference} |"
            )


if __name__ == "__main__":
    main()
