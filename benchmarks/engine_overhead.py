"""The engine's host work per step, alone: a tiny model (2 layers, dim 32) whose forward costs
almost nothing, on bench_engine.py's 64x64 workload shape (64 requests, prompts of 32-256 random
tokens, 64 greedy tokens each). Prints steps and ms per step, best of --repeats.

    .venv/bin/python benchmarks/engine_overhead.py
"""

import argparse
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine import Engine, RequestParams
from model import ModelConfig, Transformer


def main():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    torch.manual_seed(0)
    model = Transformer(
        ModelConfig(
            vocab_size=256,
            dim=32,
            n_layers=2,
            n_heads=4,
            n_kv_heads=2,
            intermediate_size=64,
            max_position_embeddings=1024,
        )
    ).eval()
    rng, best, steps = random.Random(0), float("inf"), 0
    for _ in range(args.repeats):
        engine = Engine.for_model(model, num_blocks=3000, block_size=16)
        for _ in range(64):
            engine.add_request(
                [rng.randrange(3, 250) for _ in range(rng.randint(32, 256))],
                RequestParams(max_new_tokens=64, temperature=0.0, ignore_eos=True),
            )
        start, steps = time.perf_counter(), 0
        while engine.has_unfinished():
            engine.step()
            steps += 1
        best = min(best, time.perf_counter() - start)
    print(
        "| steps | best s | ms per step |\n|---|---|---|\n"
        f"| {steps} | {best:.3f} | {1e3 * best / steps:.2f} |"
    )


if __name__ == "__main__":
    main()
