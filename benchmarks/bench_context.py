"""Decode speed against the tokens in use, at a fixed large cache capacity, next to HF transformers.

    .venv/bin/python benchmarks/bench_context.py [--in_use 128 1024 4096] [--capacity 8192]
                                                 [--dtype bfloat16]
                                                 [--threads 1] [--skip_compile] [--skip_hf]

A static KV cache of `--capacity` slots (default: the model's whole context, as
`generate.py --interactive` reserves) is filled with `in_use` tokens of real text by one prefill,
then `--new_tokens` tokens are decoded greedily from there, batch 1, EOS ignored. The decode step
attends over only the positions in use, rounded up (kv_cache.py: compiled steps to a bucket,
eager ones to a multiple of 256 slots), so its cost
should follow `in_use`, not `--capacity`. Rows:

- HF transformers eager, its default attention, on the same dequantized weights (a plain
  safetensors folder from hf_folder.save_hf_folder), its DynamicCache holding the same K/V (copied
  from ours: both store post-RoPE keys [B, Hkv, T, D]), decoded by a plain loop of forwards;
- ours eager and compiled (generate.py --compile's step) at the same lengths;
- references at the smallest length: ours with a cache of only 256 slots (what a plain run of a
  short prompt allocates), and ours attending over all `--capacity` slots (kv_cache.py before it
  attended over a prefix).

Each configuration is warmed up, then `--rounds` interleaved rounds run (every row once per
round), and each row keeps its median round, so ratios compare runs made at nearly the same
moment. Compile time (one graph per attend length reached) is printed and never counted.
"""

import argparse
import os
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import compiling
import generate
import runtime
from formats import hf_folder, weights
from formats.tokenizer import load_tokenizer
from kv_cache import StaticKVCache, attend_len_for, eager_attend_len
from sampling import SamplingParams


class WholeCache(StaticKVCache):
    """The static cache as it was: every step attends over all its slots."""

    def use_positions(self, n_positions, round_up=True):
        return self.max_seq_len


def text_ids(tokenizer, n: int) -> list:
    ids = tokenizer.encode(open(os.path.join(ROOT, "data", "declaration.txt")).read())
    return (ids * (n // len(ids) + 1))[:n]


def run_ours(model, cache, last, in_use, n, decode_fn):
    """Decode n tokens after position in_use - 1 (the prefix already in the cache)."""
    rows, t = generate.generate(
        model,
        cache,
        torch.tensor([[last]]),
        n,
        SamplingParams(0.0),
        generate.DecodeOptions(ignore_eos=True, decode_fn=decode_fn, start_pos=in_use - 1),
    )
    assert len(rows[0]) == n
    return t["tokens_per_s"], rows[0]


def hf_cache(hf, cache, in_use):
    from transformers import DynamicCache

    dc = DynamicCache(config=hf.config)
    for layer in range(len(cache.k)):
        dc.update(
            cache.k[layer][:, :, : in_use - 1].clone(),
            cache.v[layer][:, :, : in_use - 1].clone(),
            layer,
        )
    return dc


def run_hf(hf, dc, last, in_use, n):
    """The same n greedy steps with HF's forward: the first (the prompt's last token) untimed, as
    ours."""
    extra = dc.get_seq_length() - (in_use - 1)  # the previous run's tokens
    if extra:
        dc.crop(-extra)  # this version of transformers takes the number of tokens to drop, negated
    token, out = torch.tensor([[last]]), []
    with torch.no_grad():
        for i in range(n):
            if i == 1:
                start = time.perf_counter()
            token = (
                hf(input_ids=token, past_key_values=dc, use_cache=True)
                .logits[:, -1]
                .argmax(-1, keepdim=True)
            )
            out.append(int(token))
    return (n - 1) / (time.perf_counter() - start), out


def attend_range(first: int, last: int, slots: int, eager: bool) -> str:
    """The slots a run's steps attend over (kv_cache.py): eager_attend_len, or a bucket if
    compiled."""
    length = eager_attend_len if eager else attend_len_for
    return "-".join(sorted({str(length(first, slots)), str(length(last, slots))}, key=int))


def main():
    p = argparse.ArgumentParser()
    p.add_argument(
        "--in_use",
        type=int,
        nargs="+",
        default=[128, 1024, 4096, 16384],
        help="tokens in the cache when decoding starts (lengths beyond the capacity are skipped)",
    )
    p.add_argument(
        "--capacity", type=int, default=None, help="cache slots (default: the model's context)"
    )
    p.add_argument("--new_tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dtype", default="bfloat16", choices=sorted(runtime.DTYPES))
    p.add_argument("--skip_compile", action="store_true")
    p.add_argument("--skip_hf", action="store_true")
    p.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's own choice)"
    )
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    dtype = runtime.DTYPES[args.dtype]
    model, info = weights.load(None, dtype=dtype, dequantize=True)
    tokenizer = load_tokenizer(info.source)
    context = model.config.max_position_embeddings
    capacity = args.capacity or context
    lengths = [n for n in args.in_use if n + args.new_tokens <= capacity]
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"CPU capability {runtime.cpu_capability()}, "
        f"{args.dtype}, model context {context}, capacity {capacity} slots, in use {lengths}, "
        f"{args.new_tokens} new tokens, skipped (beyond capacity): "
        f"{sorted(set(args.in_use) - set(lengths))}",
        flush=True,
    )
    hf = None
    if not args.skip_hf:
        folder = hf_folder.save_hf_folder(
            weights.load(None, dequantize=True)[0], tempfile.mkdtemp(prefix="smollm2-hf-")
        )
        hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).eval()
    compiled = (
        None
        if args.skip_compile
        else compiling.compile_decode("cpu", autotune=compiling.autotune(model))
    )
    runs = []  # (label, in_use, fn returning (tokens/s, tokens))
    ids = text_ids(tokenizer, max(lengths))
    for n in lengths:
        cache = StaticKVCache.for_model(model, 1, capacity)
        start = time.perf_counter()
        with torch.no_grad():  # the prefix: every token but the last, which the decode run feeds
            cache.use_positions(n - 1)
            compiling.prefill(model, cache, torch.tensor([ids[: n - 1]]))
            cache.use_positions(None)
        print(f"  prefill of {n - 1} tokens: {time.perf_counter() - start:.1f} s", flush=True)
        last = ids[n - 1]
        if hf is not None:
            dc = hf_cache(hf, cache, n)
            runs.append(
                (
                    "HF transformers eager",
                    n,
                    lambda c=dc, n=n, t=last: run_hf(hf, c, t, n, args.new_tokens),
                )
            )
        runs.append(
            (
                "ours eager",
                n,
                lambda c=cache, n=n, t=last: run_ours(
                    model, c, t, n, args.new_tokens, compiling.decode_one
                ),
            )
        )
        if compiled is not None:
            runs.append(
                (
                    "ours compiled",
                    n,
                    lambda c=cache, n=n, t=last: run_ours(
                        model, c, t, n, args.new_tokens, compiled
                    ),
                )
            )
        if n == lengths[0]:  # the references: a small cache, and attention over the whole capacity
            for label, ref in (
                (f"ours, {256}-slot cache", StaticKVCache.for_model(model, 1, 256)),
                (f"ours, all {capacity} slots attended", WholeCache.for_model(model, 1, capacity)),
            ):
                if n + args.new_tokens > ref.max_seq_len:
                    continue
                for i in range(len(ref.k)):
                    ref.k[i].copy_(cache.k[i][:, :, : ref.max_seq_len])
                    ref.v[i].copy_(cache.v[i][:, :, : ref.max_seq_len])
                runs.append(
                    (
                        label + " eager",
                        n,
                        lambda c=ref, n=n, t=last: run_ours(
                            model, c, t, n, args.new_tokens, compiling.decode_one
                        ),
                    )
                )
                if compiled is not None:
                    runs.append(
                        (
                            label + " compiled",
                            n,
                            lambda c=ref, n=n, t=last: run_ours(
                                model, c, t, n, args.new_tokens, compiled
                            ),
                        )
                    )
    start = time.perf_counter()
    agree = {}
    for label, n, fn in runs:  # warm-up, compiling every graph the runs reach
        agree[(label, n)] = fn()[1]
    print(f"  warm-up (compiling included): {time.perf_counter() - start:.1f} s", flush=True)
    results = {(label, n): [] for label, n, _ in runs}
    for _ in range(args.rounds):
        for label, n, fn in runs:
            results[(label, n)].append(fn()[0])
    print()
    print(
        "| tokens in use | implementation | cache slots | slots attended | decode tok/s | rounds | "
        "vs HF eager | greedy tokens equal to ours eager |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for label, n, _ in runs:
        r = sorted(results[(label, n)])
        hf_r = sorted(results.get(("HF transformers eager", n), [float("nan")]))
        med, hf_med = r[len(r) // 2], hf_r[len(hf_r) // 2]
        slots = 256 if "256-slot" in label else capacity
        attended = (
            str(capacity)
            if "all" in label
            else f"{n}-{n + args.new_tokens - 1}"
            if label.startswith("HF")
            else attend_range(n, n + args.new_tokens - 1, slots, label.endswith("eager"))
        )
        same = sum(a == b for a, b in zip(agree[(label, n)], agree[("ours eager", n)]))
        print(
            f"| {n} | {label} | {'dynamic' if label.startswith('HF') else slots} | {attended} | "
            f"{med:.1f} | {', '.join(f'{x:.1f}' for x in results[(label, n)])} | "
            f"{'-' if args.skip_hf else format(med / hf_med, '.2f') + 'x'} | "
            f"{same}/{args.new_tokens} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
