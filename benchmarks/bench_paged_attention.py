"""Paged attention's three readers of the pool, one layer's call timed alone: the gathered copy
then SDPA (paged.py's reference), cpu_kernels.PagedDecodeInPlace (one-token rows, CPU's default)
and FlexAttention in place (speedups/paged_flex.py, compiled), for decode rows and a prefill
chunk, at a small and a 1B-class head layout. Each result is checked against the gather first.

    python benchmarks/bench_paged_attention.py                 # CPU, bf16 and float32
    python benchmarks/bench_paged_attention.py --device cuda   # the same table on a GPU

Prints ms per call (median of --repeats after a warm-up) and the pool bytes read per second.
Each call gets new table and position tensors, as an engine step does, so per-step work (the
in-place kernel's indices, FlexAttention's mask) is in the time; the pool is four times what the
rows use.
"""

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from cpu_kernels import PagedDecodeInPlace  # noqa: E402
from paged import PagedKVCache  # noqa: E402
from speedups.paged_flex import PagedFlex  # noqa: E402

HEADS = {"smollm2-135m": (9, 3, 64), "llama3.2-1b": (32, 8, 64)}  # H, Hkv, D


def reader_cache(name, n_blocks, bs, Hkv, D, dtype, device):
    if name == "in_place":
        return PagedKVCache(1, n_blocks, bs, Hkv, D, dtype, device, decode=PagedDecodeInPlace())
    cache = PagedKVCache(1, n_blocks, bs, Hkv, D, dtype, device, transpose_k=False)
    if name == "flex":
        cache.read_in_place(PagedFlex(compiled=True, cuda=device.startswith("cuda")))
    return cache


def fill(cache, table, k, v):
    """The context's K/V [rows, L, Hkv, D] written straight into the pool, in its layout."""
    bs, L = cache.block_size, k.shape[1]
    pos = torch.arange(L, device=k.device)
    block, offset = table[:, pos // bs], (pos % bs).expand(len(table), L)
    pool_k = cache.k[0].permute(0, 3, 1, 2) if cache.transpose_k else cache.k[0]
    pool_k[block, offset], cache.v[0][block, offset] = k, v


def time_call(fn, device, repeats) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def case(shape, rows, T, context, dtype, device, repeats, bs=16):
    """{reader: ms} for `rows` rows of T queries at `context` tokens each, one layer."""
    H, Hkv, D = HEADS[shape]
    W = -(-(context + T) // bs)
    n_blocks = 1 + 4 * rows * W  # a pool a quarter in use (flex's mask spans the whole pool)
    gen = torch.Generator().manual_seed(0)
    table = (1 + torch.randperm(n_blocks - 1, generator=gen))[: rows * W].view(rows, W).to(device)
    k_all = torch.randn(rows, context + T, Hkv, D, generator=gen).to(device, dtype)
    v_all = torch.randn(rows, context + T, Hkv, D, generator=gen).to(device, dtype)
    q = torch.randn(1, rows * T, H, D, generator=gen).to(device, dtype)
    pos = torch.arange(context, context + T, device=device).repeat(rows, 1)
    readers = ("gather", "in_place", "flex") if T == 1 else ("gather", "flex")
    out, ms = {}, {}
    for name in readers:
        if name == "in_place" and device != "cpu":
            continue
        cache = reader_cache(name, n_blocks, bs, Hkv, D, dtype, device)
        fill(cache, table, k_all[:, :context], v_all[:, :context])
        k, v = k_all[:, context:].reshape(1, -1, Hkv, D), v_all[:, context:].reshape(1, -1, Hkv, D)

        def step():  # new table and position tensors each call, as each engine step has
            with torch.no_grad(), cache.step_groups([(rows, T, table.clone())]):
                return cache.attend(0, q, k, v, pos.reshape(1, -1).clone())

        out[name] = step()
        ms[name] = time_call(step, device, repeats)
    for name in out:
        torch.testing.assert_close(out[name].float(), out["gather"].float(), atol=2e-2, rtol=2e-2)
    pool_bytes = rows * (context + T) * Hkv * D * 2 * torch.finfo(dtype).bits // 8
    return ms, pool_bytes


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args(argv)
    torch.set_grad_enabled(False)
    torch._dynamo.config.recompile_limit = 256  # a graph per shape (paged_flex.py on CPU)
    print("| shape | dtype | rows x T | context | gather ms | in_place ms | flex ms | flex GB/s |")
    print("|---|---|---|---|---|---|---|---|")
    for dtype in [getattr(torch, d) for d in args.dtypes.split(",")]:
        for shape in HEADS:
            for rows, T, context in ((1, 1, 512), (1, 1, 2048), (16, 1, 512), (1, 128, 512)):
                ms, nbytes = case(shape, rows, T, context, dtype, args.device, args.repeats)
                cells = [f"{ms[n]:.3f}" if n in ms else "-" for n in ("gather", "in_place", "flex")]
                gbs = nbytes / ms["flex"] / 1e6
                print(
                    f"| {shape} | {str(dtype)[6:]} | {rows} x {T} | {context} | "
                    + " | ".join(cells)
                    + f" | {gbs:.1f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
