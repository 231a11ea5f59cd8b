"""The bound torch's int4 kernel puts on a 4-bit GGUF file's decode: every linear layer of a model
shape through aten._weight_int4pack_mm_for_cpu at one row, each with its own weights (a decode step
reads them from memory, not from cache), timed as one pass.

    .venv/bin/python benchmarks/bench_int4_kernel.py [--shape 1b] [--rounds 10]

Q4_0, Q4_1 and Q4_K files run their 4-bit layers through this kernel (formats/gguf_weights.py), so
the pass time is what a decode step cannot go below whatever else is removed (the head, the
embedding, attention and norms come on top). It prints the pass time, the bytes it reads (4-bit
values plus the kernel's bf16 scale and zero per 32 weights) per second, and the tokens per
second it allows. Random values; bf16 activations; the machine's threads.
"""

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_gguf import SHAPES

GROUP = 32


def layers(shape: dict) -> list:
    """[(packed int4 weight, scales and zeros, K)] for every linear layer of the shape."""
    d, ff = shape["dim"], shape["intermediate_size"]
    kv = shape["n_kv_heads"] * d // shape["n_heads"]  # KV heads x head_dim
    per_layer = [
        (d, d),
        (kv, d),
        (kv, d),
        (d, d),
        (ff, d),
        (ff, d),
        (d, ff),
    ]  # q k v o gate up down
    out = []
    for _ in range(shape["n_layers"]):
        for N, K in per_layer:
            w = torch.randint(0, 16, (N, K), dtype=torch.int32)
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(w, 1)
            out.append((packed, torch.randn(K // GROUP, N, 2, dtype=torch.bfloat16), K))
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=list(SHAPES), default="1b")
    p.add_argument("--rounds", type=int, default=10)
    args = p.parse_args()
    torch.manual_seed(0)
    stack = layers(SHAPES[args.shape])
    xs = {K: torch.randn(1, K, dtype=torch.bfloat16) for _, _, K in stack}

    def one_pass():
        for packed, scales, K in stack:
            torch.ops.aten._weight_int4pack_mm_for_cpu(xs[K], packed, GROUP, scales)

    for _ in range(3):
        one_pass()
    times = []
    for _ in range(args.rounds):
        start = time.perf_counter()
        one_pass()
        times.append(time.perf_counter() - start)
    dt = statistics.median(times)
    weights = sum(s.shape[0] * GROUP * s.shape[1] for _, s, _ in stack)
    read = weights // 2 + sum(s.numel() * s.element_size() for _, s, _ in stack)
    print(
        f"{args.shape}, {torch.get_num_threads()} threads, CPU capability "
        f"{torch.backends.cpu.get_cpu_capability()}: {len(stack)} int4 linears at one row, "
        f"{dt * 1e3:.1f} ms a pass (median of {args.rounds}), {read / dt / 1e9:.1f} GB/s "
        f"({read / 2**20:.0f} MiB read), at most {1 / dt:.1f} tokens/s from these layers alone"
    )


if __name__ == "__main__":
    main()
