"""Mixture-of-experts decode and prefill, next to HF transformers and a dense twin in the same run.

    .venv/bin/python benchmarks/bench_moe.py [--layers 8] [--dtype bfloat16] [--rounds 5]
                                             [--skip_compile]

A Qwen3-MoE of Qwen3-30B-A3B's proportions scaled to hidden 1024 (16 heads of 128, 2 KV heads,
64 experts of width 384, top 8, normalised; vocabulary 32768; `--layers` layers), random weights.
Its dense twin has the same active parameters per token: a Qwen3 with an MLP of width 8 x 384.

- decode, batch 1, greedy, EOS ignored, after a 64-token prompt: ours eager and compiled
  (generate.py's loop and --compile step), HF transformers eager (Qwen3MoeForCausalLM, a loop of
  forwards with its DynamicCache); tok/s and the bandwidth achieved over the bytes a step reads
  (model.bytes_read_per_token: active experts only), the dense twin's beside it;
- prefill of `--prefill` tokens (our eager prefill: the grouped expert path), MoE against the twin;
- `--paths`: one layer's experts alone, eager, the gathered path (index the chosen experts'
  weights, batched matmuls) against the grouped one (a matmul per expert hit), by tokens.

Each row is warmed up, then `--rounds` interleaved rounds run (every other one reversed); medians.
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
from formats import weights
from kv_cache import StaticKVCache
from sampling import SamplingParams

SIZES = dict(
    vocab_size=32768,
    hidden_size=1024,
    num_attention_heads=16,
    num_key_value_heads=2,
    head_dim=128,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)


def build(args, moe: bool):
    """(HF model, our model) on the same random weights: the MoE or its dense twin."""
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    if moe:
        config = Qwen3MoeConfig(
            num_hidden_layers=args.layers,
            num_experts=64,
            num_experts_per_tok=8,
            moe_intermediate_size=384,
            norm_topk_prob=True,
            intermediate_size=3072,
            **SIZES,
        )
        cls = Qwen3MoeForCausalLM
    else:
        config, cls = (
            Qwen3Config(num_hidden_layers=args.layers, intermediate_size=8 * 384, **SIZES),
            Qwen3ForCausalLM,
        )
    torch.manual_seed(0)
    hf = cls(config)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_((1.0 if "norm" in name else 0.0) + 0.02 * torch.randn_like(p))
    dtype = runtime.DTYPES[args.dtype]
    with tempfile.TemporaryDirectory(
        prefix="moe-" if moe else "dense-"
    ) as folder:  # (GBs of float32: removed)
        hf.save_pretrained(folder, safe_serialization=True)
        model, _ = weights.load_for_inference(
            folder, dtype=dtype
        )  # as generate.py loads: q/k/v (and gate/up) fused
    return hf.to(dtype).eval(), model


def ours_decode(model, prompt, n, decode_fn):
    x = torch.tensor([prompt])

    def run():
        cache = StaticKVCache.for_model(model, 1, len(prompt) + n)
        _, t = generate.generate(
            model,
            cache,
            x,
            n,
            SamplingParams(0.0),
            generate.DecodeOptions(ignore_eos=True, decode_fn=decode_fn),
        )
        return t["tokens_per_s"]

    return run


def hf_decode(hf, prompt, n):
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


def ours_prefill(model, n):
    """() -> prefill tokens/s of n tokens into a fresh static cache (the next token's logits
    only)."""
    x = torch.randint(3, SIZES["vocab_size"], (1, n), generator=torch.Generator().manual_seed(2))

    def run():
        cache = StaticKVCache.for_model(model, 1, n)
        start = time.perf_counter()
        with torch.no_grad():
            compiling.prefill(model, cache, x)
        return n / (time.perf_counter() - start)

    return run


def expert_paths(dtype, rounds: int):
    """ms per call of one layer's experts (64 of 1024 x 384, top 8), gathered and grouped, by
    tokens."""
    from moe import Experts

    torch.manual_seed(0)
    experts = Experts(64, 1024, 384, torch.nn.functional.silu)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(0.02 * torch.randn_like(p))
    experts = experts.to(dtype)
    print("\n| tokens | gathered ms | grouped ms |\n|---|---|---|")
    for T in (1, 2, 4, 16, 64):
        x = torch.randn(T, 1024, dtype=dtype)
        idx = torch.stack([torch.randperm(64)[:8] for _ in range(T)])
        w = torch.rand(T, 8).softmax(-1)
        times = {}
        for name in ("gathered", "grouped"):
            run = getattr(experts, name)
            with torch.no_grad():
                run(x, idx, w)
                samples = []
                for _ in range(rounds):
                    start = time.perf_counter()
                    for _ in range(10):
                        run(x, idx, w)
                    samples.append((time.perf_counter() - start) / 10 * 1e3)
            times[name] = statistics.median(samples)
        print(f"| {T} | {times['gathered']:.2f} | {times['grouped']:.2f} |")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--new_tokens", type=int, default=48)
    p.add_argument("--prefill", type=int, default=512)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dtype", default="bfloat16", choices=sorted(runtime.DTYPES))
    p.add_argument("--skip_compile", action="store_true")
    p.add_argument(
        "--paths", action="store_true", help="only time the two eager expert paths of one layer"
    )
    args = p.parse_args()
    if args.paths:
        return expert_paths(runtime.DTYPES[args.dtype], args.rounds)
    prompt = torch.randint(
        3, SIZES["vocab_size"], (64,), generator=torch.Generator().manual_seed(1)
    ).tolist()
    rows, read = [], {}
    for kind in ("MoE", "dense twin"):
        hf, model = build(args, kind == "MoE")
        read[kind] = model.bytes_read_per_token()
        total = sum(p.numel() for p in model.parameters())
        print(
            f"{kind}: {total / 1e6:.0f}M parameters, "
            f"{read[kind] / 2**20:.0f} MiB read per decode step",
            flush=True,
        )
        rows.append(
            (
                kind,
                "decode, ours eager",
                ours_decode(model, prompt, args.new_tokens, compiling.decode_one),
            )
        )
        if not args.skip_compile:
            compiled = compiling.compile_decode("cpu", autotune=compiling.autotune(model))
            rows.append(
                (
                    kind,
                    "decode, ours compiled",
                    ours_decode(model, prompt, args.new_tokens, compiled),
                )
            )
        if kind == "MoE":
            rows.append(
                (kind, "decode, HF transformers eager", hf_decode(hf, prompt, args.new_tokens))
            )
        rows.append(
            (kind, f"prefill {args.prefill}, ours eager", ours_prefill(model, args.prefill))
        )
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"CPU capability {runtime.cpu_capability()}, "
        f"{args.dtype}, {args.layers} layers",
        flush=True,
    )
    start = time.perf_counter()
    for *_, run in rows:  # warm-up (compiling included)
        run()
    print(f"warm-up (compiling included): {time.perf_counter() - start:.1f} s", flush=True)
    speeds = [[] for _ in rows]
    for r in range(args.rounds):
        for i in range(len(rows)) if r % 2 == 0 else reversed(range(len(rows))):
            speeds[i].append(rows[i][2]())
    median = [statistics.median(s) for s in speeds]
    print("\n| model | path | tok/s | GB/s over bytes read | vs HF eager | vs dense twin |")
    print("|---|---|---|---|---|---|")
    by = {(kind, label): m for (kind, label, _), m in zip(rows, median)}
    hf_speed = by[("MoE", "decode, HF transformers eager")]
    for (kind, label, _), m in zip(rows, median):
        gbs = (
            f"{m * read[kind] / 1e9:.2f}"
            if label.startswith("decode") and "HF" not in label
            else ""
        )
        vs_hf = f"{m / hf_speed:.2f}x" if kind == "MoE" and label.startswith("decode") else ""
        twin = by.get(("dense twin", label))
        vs_twin = f"{m / twin:.2f}x" if kind == "MoE" and twin else ""
        print(f"| {kind} | {label} | {m:.1f} | {gbs} | {vs_hf} | {vs_twin} |")


if __name__ == "__main__":
    main()
