"""Where an int4 layer on CPU should leave torch's int4 kernel for dequantize + GEMM, as the rows
grow (quantize.int4_large_m): per layer shape of a 1B model, the kernel, the whole matrix unpacked
then a bf16 GEMM, and Int4Linear.dense's unpacking by blocks of 256 rows then the GEMM; then a
GGUF file's prefill through the model as it loads (--gguf), tokens/s at a few prompt lengths.
--pairs: the same question for int8 groups held as nibble pairs (formats/quant_groups.py's
Int8GroupLinear: the kernel over 2K columns against Int8GroupLinear.dense + GEMM), groups of 32
(Q8_0's layout, with a zero) and 16 (Q6_K's balanced nibbles).

    .venv/bin/python benchmarks/bench_int4_rows.py [--gguf FILE.gguf] [--pairs]
    .venv/bin/python benchmarks/bench_int4_rows.py --few --repeats 50  # 1-16 rows (speculation)

Random int4 weights (groups of 32), bf16 activations, median of --repeats, the machine's threads.
"""

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import quantize  # noqa: E402
from cpu_kernels import padded_linear  # noqa: E402 (the row padding Int4Linear.forward uses)
from kv_cache import NoCache  # noqa: E402

SHAPES = {  # Llama-3.2-1B's linears (out, in); gate and up fused as the engine loads them
    "q/o": (2048, 2048),
    "k/v": (512, 2048),
    "gate+up": (16384, 2048),
    "down": (2048, 8192),
}


def median_ms(fn, repeats) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def layer_rows(repeats):
    print(
        "| layer | weights | rows | kernel ms | whole unpack + GEMM ms | dense() + GEMM ms | path |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, (N, K) in SHAPES.items():
        w = torch.randn(N, K, dtype=torch.bfloat16) * 0.02
        layer = quantize.Int4Linear(
            quantize.portable_tensors(w, "int4", 32), None, torch.bfloat16, 32, "cpu"
        )
        for M in (64, 128, 256, 512):
            x = torch.randn(M, K, dtype=torch.bfloat16)
            kernel = median_ms(
                lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(
                    x, layer.weight, layer.groupsize, layer.scales_and_zeros
                ),
                repeats,
            )
            whole = median_ms(
                lambda: padded_linear(x, layer.dequantize().to(torch.bfloat16)), repeats
            )
            dense = median_ms(lambda: padded_linear(x, layer.dense(torch.bfloat16)), repeats)
            path = "kernel" if M < quantize.int4_large_m(N, K, torch.bfloat16) else "dense"
            print(
                f"| {name} | {N}x{K} | {M} | {kernel:.1f} | {whole:.1f} | {dense:.1f} | {path} |",
                flush=True,
            )


def few_rows(repeats):
    """The kernel at 1-16 rows, where a speculative verify step lives (1 + k tokens): its time
    steps up every 4 rows, so 4 rows cost well under 5, and 5 about what 8 do."""
    rows = (1, 2, 3, 4, 5, 8, 9, 16)
    print("| layer | weights | " + " | ".join(f"{M} rows ms" for M in rows) + " |")
    print("|---|---|" + "---|" * len(rows))
    shapes = {"embedded gate+up": (3072, 576), "embedded down": (576, 1536), **SHAPES}
    for name, (N, K) in shapes.items():
        w = torch.randn(N, K, dtype=torch.bfloat16) * 0.02
        layer = quantize.Int4Linear(
            quantize.portable_tensors(w, "int4", 32), None, torch.bfloat16, 32, "cpu"
        )
        xs = [torch.randn(M, K, dtype=torch.bfloat16) for M in rows]
        times = [median_ms(lambda: layer(x), repeats) for x in xs]
        print(f"| {name} | {N}x{K} | " + " | ".join(f"{t:.3f}" for t in times) + " |", flush=True)


def pair_rows(repeats):
    from formats.quant_groups import Int8GroupLinear

    print("\n| layer | weights | G | rows | kernel ms | dense() + GEMM ms | path |")
    print("|---|---|---|---|---|---|---|")
    for name, (N, K) in SHAPES.items():
        for G, low in ((32, -128), (16, -32)):
            q = torch.randint(low, -low, (N, K), dtype=torch.int8)
            layer = Int8GroupLinear(q, torch.rand(N, K // G) * 0.01, None, None, torch.bfloat16)
            for M in (32, 64, 128, 256):
                x = torch.randn(M, K, dtype=torch.bfloat16)
                xg = x.view(M, K // G, 1, G)
                xx = torch.cat([xg, 16 * xg], 2).view(M, 2 * K)  # as its forward lays x out
                kernel = median_ms(
                    lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(
                        xx, layer.pair, 2 * G, layer.pair_scales
                    ),
                    repeats,
                )
                dense = median_ms(lambda: padded_linear(x, layer.dense(torch.bfloat16)), repeats)
                path = "kernel" if M < quantize.INT4_LARGE_M else "dense"
                print(
                    f"| {name} | {N}x{K} | {G} | {M} | {kernel:.1f} | {dense:.1f} | {path} |",
                    flush=True,
                )


def prefill(gguf, repeats):
    from formats import weights

    model, _ = weights.load_for_inference(gguf, "cpu", torch.bfloat16, None)
    print(f"\n{os.path.basename(gguf)}, prefill of one prompt (the head on its last token only)\n")
    print("| tokens | ms | tokens/s |")
    print("|---|---|---|")
    for T in (16, 128, 300, 512):
        x, pos = torch.randint(0, 1000, (1, T)), torch.arange(T)[None]
        ms = median_ms(lambda: model(x, pos, NoCache(), last_only=True), repeats)
        print(f"| {T} | {ms:.0f} | {T / ms * 1e3:.0f} |", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gguf", default=None)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--pairs", action="store_true", help="int8 groups as nibble pairs too")
    p.add_argument("--few", action="store_true", help="only the kernel at 1-16 rows")
    args = p.parse_args()
    torch.set_grad_enabled(False)
    if args.few:
        return few_rows(args.repeats)
    layer_rows(args.repeats)
    if args.pairs:
        pair_rows(args.repeats)
    if args.gguf:
        prefill(args.gguf, args.repeats)


if __name__ == "__main__":
    main()
