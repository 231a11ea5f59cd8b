"""Where the engine's decode step spends its time, and how close it runs to the machine's matmul
rate: engine.Engine on the embedded SmolLM2-135M, every request decoding (prompts prefilled
before the clock starts), profiled with torch.profiler.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/profile_engine.py  # batch 1, 8, 32, 64
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/profile_engine.py --batches 64 --dtype bfloat16

Per batch size B: the step's wall time; its achieved GFLOP/s (2 x the weights' multiply-adds x B,
plus attention's 4 x layers x heads x head_dim x context x B); the rate torch.mm reaches on the
step's own GEMM shapes ([B, K] x [K, N] for q, k, v, o, gate, up, down and the head), which is
the ceiling; and the profile's split of the step: GEMMs, attention (the paged gather, masking,
SDPA), sampling, host syncs, other ops, and the rest of the wall time (Python: scheduling,
building block tables and inputs).
"""

import argparse
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import runtime
from engine import Engine, RequestParams
from formats import fuse_layers, weights
from formats.tokenizer import load_tokenizer

CATEGORIES = [  # (name, substrings of op names), first match wins
    (
        "GEMM",
        ("aten::mm", "aten::addmm", "aten::bmm", "aten::_weight_int8pack_mm", "onednn", "mkldnn"),
    ),
    (
        "attention",
        (
            "scaled_dot_product",
            "flash_attention",
            "aten::embedding",
            "embedding_bag",
            "aten::index",
            "aten::gather",
            "aten::masked_fill",
            "aten::where",
            "aten::scatter",
            "index_put",
        ),
    ),
    (
        "sampling",
        (
            "aten::argmax",
            "aten::softmax",
            "aten::multinomial",
            "aten::topk",
            "aten::sort",
            "log_softmax",
        ),
    ),
    ("host syncs", ("aten::item", "_local_scalar_dense", "aten::tolist")),
]


def category(name: str) -> str:
    return next((c for c, keys in CATEGORIES if any(k in name for k in keys)), "other ops")


def gemm_shapes(model, B):
    c = model.config
    d, kv = c.dim, c.n_kv_heads * c.head_dim
    per_layer = [
        (d, c.n_heads * c.head_dim),
        (d, kv),
        (d, kv),
        (c.n_heads * c.head_dim, d),
        (d, c.intermediate_size),
        (d, c.intermediate_size),
        (c.intermediate_size, d),
    ]
    return [(B, k, n) for k, n in per_layer] * c.n_layers + [(B, d, c.vocab_size)]


def matmul_rate(model, B, dtype, rounds=5) -> float:
    """GFLOP/s of torch.mm over the step's GEMM shapes, the best of `rounds`."""
    shapes = gemm_shapes(model, B)
    mats = {(k, n): torch.randn(k, n, dtype=dtype) for _, k, n in set(shapes)}
    xs = {k: torch.randn(B, k, dtype=dtype) for _, k, _ in set(shapes)}
    flops = sum(2 * b * k * n for b, k, n in shapes)
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _, k, n in shapes:
            torch.mm(xs[k], mats[(k, n)])
        best = min(best, time.perf_counter() - start)
    return flops / best / 1e9


def step_flops(model, B, context) -> float:
    c = model.config
    gemm = sum(2 * b * k * n for b, k, n in gemm_shapes(model, B))
    return gemm + 4 * c.n_layers * c.n_heads * c.head_dim * context * B


def main():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument(
        "--prompt_tokens",
        type=int,
        default=140,
        help="140: the context stays within one attend-width bucket (12 blocks of 16) while timed",
    )
    p.add_argument("--steps", type=int, default=16, help="decode steps profiled per batch size")
    p.add_argument(
        "--compile",
        action="store_true",
        help="the engine's compiled decode steps (one graph per batch bucket)",
    )
    p.add_argument(
        "--no_fuse",
        action="store_true",
        help="keep q/k/v and gate/up separate (load_engine fuses them)",
    )
    p.add_argument(
        "--kept",
        action="store_true",
        help="the embedded GGUF at its own bits (as serve.py loads it), not dequantized",
    )
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    model, info = weights.load(None, dtype=dtype, dequantize=not args.kept)
    if not args.no_fuse:
        fuse_layers.fuse_projections(model)
    tokenizer = load_tokenizer(info.source)
    with open(os.path.join(ROOT, "data", "declaration.txt")) as f:
        text = tokenizer.encode(f.read())
    bits = " at the file's bits" if args.kept else ""
    print(
        f"# {runtime.cpu_capability()} | torch {torch.__version__} | "
        f"{torch.get_num_threads()} threads | "
        f"{args.dtype}{bits} | prompts of {args.prompt_tokens} tokens | "
        f"{args.steps} decode steps profiled, "
        f"{'compiled' if args.compile else 'eager'}"
    )
    rows = []
    for B in args.batches:
        engine = Engine.for_model(
            model,
            num_blocks=1 + B * (args.prompt_tokens + args.steps + 40) // 16 + B,
            block_size=16,
            max_num_seqs=max(B, 1),
            max_num_batched_tokens=B * (args.prompt_tokens + 1),
            compile=args.compile,
        )  # every prompt prefilled in one step: the batch moves in lockstep
        for i in range(B):
            start = (i * 37) % (len(text) - args.prompt_tokens)
            engine.add_request(
                text[start : start + args.prompt_tokens],
                RequestParams(max_new_tokens=args.steps + 40, temperature=0.0, ignore_eos=True),
            )
        while (
            any(s.num_computed < len(s.request.prompt) for s in engine.scheduler.running)
            or engine.scheduler.waiting
        ):
            # prefill everything (and a first token each): what follows is pure decode
            engine.step()
        for _ in range(3):  # (compiles the step's graph, with --compile)
            engine.step()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            for _ in range(args.steps):
                engine.step()
            wall = (time.perf_counter() - start) / args.steps
        split = {}
        for e in prof.key_averages():
            split[category(e.key)] = (
                split.get(category(e.key), 0.0) + e.self_cpu_time_total / 1e6 / args.steps
            )
        profiled_wall = sum(split.values())
        context = args.prompt_tokens + 3 + args.steps // 2
        unprofiled_start = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        plain = (time.perf_counter() - unprofiled_start) / args.steps
        achieved = step_flops(model, B, context) / plain / 1e9
        rate = matmul_rate(model, B, dtype)
        rows.append((B, plain, achieved, rate, split, wall - profiled_wall, wall))
    print(
        "\n| batch | step ms | tokens/s | achieved GFLOP/s "
        "| torch.mm on the step's shapes, GFLOP/s | share of mm rate |"
    )
    print("|---|---|---|---|---|---|")
    for B, plain, achieved, rate, *_ in rows:
        print(
            f"| {B} | {plain * 1e3:.1f} | {B / plain:.0f} | {achieved:.1f} | {rate:.1f} | "
            f"{achieved / rate:.0%} |"
        )
    names = [c for c, _ in CATEGORIES] + ["other ops", "Python and the rest"]
    print("\n| batch | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for B, _, _, _, split, rest, wall in rows:
        parts = [split.get(n, 0.0) for n in names[:-1]] + [max(rest, 0.0)]
        print(f"| {B} | " + " | ".join(f"{v * 1e3:.1f} ms ({v / wall:.0%})" for v in parts) + " |")


if __name__ == "__main__":
    main()
