"""The engine's resident memory across repeated workloads: does a long-running server keep growing?

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/engine_memory.py [--dense] [--requests 60]
                                                                   [--rounds 3]

The embedded model in bf16 (at its own bits, or --dense: dequantized to bf16 GEMMs) serves
`--rounds` workloads in turn, each `--requests` greedy requests with random prompts (20-300
tokens) and outputs (4-24 tokens) arriving a few per step, through a fresh Engine each time (400
blocks of 16, 32 sequences, 512 tokens per step). After each workload it prints the process's
resident set. The KV pool and the first workload's buffers account for the first jump; what
grows after it is held across requests. oneDNN keeps the kernels it builds per matmul shape
(LRU_CACHE_CAPACITY and ONEDNN_PRIMITIVE_CACHE_CAPACITY, 1,024 each by default; set both to 8
to see the run without them).
"""

import argparse
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from engine import Engine
from formats import weights
from sequence import RequestParams


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def workload(model, seed: int, count: int) -> float:
    rng = random.Random(seed)
    engine = Engine.for_model(
        model, num_blocks=400, block_size=16, max_num_seqs=32, max_num_batched_tokens=512
    )
    pending = [
        ([rng.randint(10, 1000) for _ in range(rng.randint(20, 300))], rng.randint(4, 24))
        for _ in range(count)
    ]
    start = time.perf_counter()
    while pending or engine.has_unfinished():
        for _ in range(rng.randint(0, 4)):
            if pending:
                prompt, new = pending.pop(0)
                engine.add_request(
                    prompt, RequestParams(max_new_tokens=new, temperature=0.0, ignore_eos=True)
                )
        engine.step()  # a finished request is forgotten once its Finished event is returned
    return time.perf_counter() - start


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dense", action="store_true", help="dequantize the GGUF weights to bf16")
    p.add_argument("--requests", type=int, default=60)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    model, info = weights.load_for_inference(None, "cpu", torch.bfloat16, dequantize=args.dense)
    weights.settle()
    caps = {
        k: os.environ.get(k, "default")
        for k in ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY")
    }
    print(
        f"{'dense bf16' if args.dense else 'own bits'}; "
        f"CPU {torch.backends.cpu.get_cpu_capability()}; {caps}\n"
    )
    print("| after | seconds | RSS MiB |\n|---|---|---|")
    print(f"| load | - | {rss_mib():.0f} |")
    for r in range(args.rounds):
        elapsed = workload(model, r, args.requests)
        print(
            f"| workload {r + 1} ({args.requests} requests) | {elapsed:.1f} | {rss_mib():.0f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
