"""Q8_0's int8-group layers on CPU: the path they take now (quant_groups.Int8GroupLinear's two int4
halves) against one-pass candidates, per layer shape, at the few rows a decode step has.

    .venv/bin/python benchmarks/bench_int8_groups.py [--rows 1 4 16] [--copies 30]

The shapes are the embedded SmolLM2-135M's fused layers and its head (a Q8_0 file's: int8 values,
one float scale per 32 inputs, no offsets), random values, bf16 activations. Candidates:
  two halves   Int8GroupLinear in bf16: the int4 kernel over each group's lo then hi nibbles,
               2K columns (measured below on the earlier [lo | hi] layout: RESULTS.md's date)
  reduction    Int8GroupLinear's float32 path compiled: Inductor's fused per-group reduction
               (int8 read once, bf16 activations; the few-row path of a float32 model)
  int_mm       activations quantized per 32 to int8 (as llama.cpp does for Q8_0), torch._int_mm
               on a block-diagonal copy of them ([M * G, K]: each group's partial sums), then the
               two scales and the sum over groups; not exact (the activations' rounding)
  per-channel  torch's int8 weight-only kernel (_weight_int8pack_mm) with one scale per row: the
               speed of a one-pass int8 kernel without group scales (not Q8_0's values: a bound)
  bf16 GEMM    the dequantized weight in bf16, F.linear (twice the bytes)
Each layer shape has --copies copies called in turn (a decode step reads each layer's weights
once, from memory: one layer timed alone would sit in the cache); median of 5 runs, and each is
checked against the dequantized weights in float32 (the largest error over the largest output).
"""

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import runtime
from formats.quant_groups import Int8GroupLinear

SHAPES = {
    "qkv": (960, 576),
    "o": (576, 576),
    "gate_up": (3072, 576),
    "down": (576, 1536),
    "head": (49152, 576),
}
G = 32


def int_mm_groups(q):
    """The int_mm candidate for int8 weights q [N, K] with scales [N, K/G] -> f(x, scales)."""
    N, K = q.shape
    qt = q.t().contiguous()  # [K, N]
    eye = torch.eye(K // G, dtype=torch.int8).repeat_interleave(G, 1)  # [K/G, K]: group g's columns

    def f(x, scales):
        M = x.shape[0]
        xs = x.float().view(M, K // G, G).abs().amax(-1).clamp(min=1e-12) / 127  # [M, K/G]
        xq = torch.round(x.float().view(M, K // G, G) / xs[..., None]).to(torch.int8).view(M, 1, K)
        block = (xq * eye).view(M * (K // G), K)  # [M * K/G, K]: row (m, g) holds group g of x[m]
        if block.shape[0] <= 16:  # _int_mm wants more than 16 rows
            block = torch.cat([block, block.new_zeros(17 - block.shape[0], K)])
        part = torch._int_mm(block, qt)[: M * (K // G)].view(M, K // G, N).float()  # [M, K/G, N]
        return torch.einsum("mgn,ng,mg->mn", part, scales, xs).to(x.dtype)

    return f


def timed(fn, reps):
    for _ in range(3):
        fn()
    runs = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        runs.append((time.perf_counter() - start) / reps * 1e3)
    return sorted(runs)[2]


def reduction(x, q, scales):
    """Int8GroupLinear's few-row compiled path (formats/quant_groups.py): a fused reduction over
    each group."""
    N, K = q.shape
    xg = x.float().reshape(-1, 1, K // G, G)  # [M, 1, K/G, G]
    return ((q.reshape(N, K // G, G).float() * xg).sum(-1) * scales).sum(-1).to(x.dtype)


def layer_copies(N, K, copies):
    """`copies` random Q8_0-like layers [N, K] in every candidate's form."""
    out = []
    for _ in range(copies):
        q = torch.randint(-127, 128, (N, K), dtype=torch.int8)
        scales = torch.rand(N, K // G) * 1e-3 + 1e-4
        w32 = Int8GroupLinear(q, scales, None, None, torch.float32).dequantize()
        per_row = (w32.abs().amax(1) / 127).clamp(min=1e-12)
        out.append(
            dict(
                q=q,
                scales=scales,
                w32=w32,
                halves=Int8GroupLinear(q, scales, None, None, torch.bfloat16),
                wb=w32.to(torch.bfloat16),
                q_row=torch.round(w32 / per_row[:, None]).to(torch.int8),
                s_row=per_row.to(torch.bfloat16),
                int_mm=int_mm_groups(q),
            )
        )
    return out


def main():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--reps", type=int, default=10, help="passes over the copies per timed run")
    p.add_argument(
        "--copies",
        type=int,
        default=30,
        help="copies of each layer (the model's 30 layers), so "
        "its weights come from memory, not the cache, as in a decode step",
    )
    args = p.parse_args()
    torch.manual_seed(0)
    torch._dynamo.config.recompile_limit = 64  # a graph per shape and row count
    compiled = torch.compile(reduction, dynamic=False)
    print(
        f"# {runtime.cpu_capability()} | torch {torch.__version__} | "
        f"{torch.get_num_threads()} threads | "
        f"Q8_0-like int8 with a float scale per {G} inputs, bf16 activations, "
        f"{args.copies} copies of each "
        f"layer (1 of the head) called in turn; ms per call (max error / max output)\n"
    )
    print(
        "| layer [N x K] | rows | two halves | reduction (compiled) | int_mm | per-channel (bound) "
        "| bf16 GEMM |"
    )
    print("|---|---|---|---|---|---|---|")
    totals = {}
    for name, (N, K) in SHAPES.items():
        layers = layer_copies(N, K, 1 if name == "head" else args.copies)
        for m in args.rows:
            x = torch.randn(m, K, dtype=torch.bfloat16)
            want = x.float() @ layers[0]["w32"].t()
            paths = {
                "two halves": lambda c: c["halves"](x),
                "reduction": lambda c: compiled(x, c["q"], c["scales"]),
                "int_mm": lambda c: c["int_mm"](x, c["scales"]),
                "per-channel": lambda c: torch.ops.aten._weight_int8pack_mm(
                    x, c["q_row"], c["s_row"]
                ),
                "bf16": lambda c: F.linear(x, c["wb"]),
            }
            cells = []
            with torch.no_grad():
                for fn in paths.values():
                    try:
                        err = ((fn(layers[0]).float() - want).abs().max() / want.abs().max()).item()
                        ms = timed(lambda: [fn(c) for c in layers], args.reps) / len(layers)
                        cells.append(f"{ms:.3f} ({err:.0e})")
                    except Exception as e:  # noqa: BLE001 (a path this machine cannot run: say why)
                        cells.append(f"fails: {type(e).__name__}")
            print(f"| {name} [{N} x {K}] | {m} | " + " | ".join(cells) + " |", flush=True)
            totals[m] = [
                t + (1 if name == "head" else args.copies) * float(c.split()[0])
                if c[0].isdigit()
                else t
                for t, c in zip(totals.setdefault(m, [0.0] * len(cells)), cells)
            ]
    for m, t in totals.items():  # every layer once, as in a step of the model
        print(
            f"| a step's layers ({args.copies} of each, the head) | {m} | "
            + " | ".join(f"{x:.2f}" for x in t)
            + " |"
        )


if __name__ == "__main__":
    main()
