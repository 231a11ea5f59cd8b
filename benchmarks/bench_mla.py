"""DeepSeek's multi-head latent attention (model.MLAttention) against HF transformers in one run:
KV bytes per token, and decode speed at a long context.

    .venv/bin/python benchmarks/bench_mla.py [--layers 6] [--context 2048] [--new_tokens 24]

Random weights in DeepSeek-V2-Lite's proportions scaled to fit a 2-core machine: its attention as
published (16 heads, a latent of 512, q/k heads of 128 + 64 rotary, v heads of 128), hidden 1024,
64 experts of width 704 (top 6, 2 shared, softmax routing) after one dense layer, vocabulary
32768, `--layers` layers, bf16.

- KV bytes per token: ours (latent + rotary key per layer, in bf16 and int8), what per-head K and V
  would take in bf16, and our cache at `--context`;
- decode, batch 1, greedy, EOS ignored, after a `--context`-token prompt: ours eager, compiled
  (generate.py's loop and --compile step, static cache; and over the int8 latent cache,
  --kv_cache_dtype int8) and its default (--compile auto: the ahead-of-time package, built here
  once), HF transformers eager
  (DeepseekV2ForCausalLM, a loop of forwards with its DynamicCache); tok/s, median of `--rounds`
  interleaved rounds after a warm-up.
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
from speedups.kv_int8 import Int8KVCache

VOCAB = 32768


def build(layers: int, folder: str):
    """(HF model, our model) on the same random weights, bf16, saved in `folder`."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    config = DeepseekV2Config(vocab_size=VOCAB, hidden_size=1024, intermediate_size=5472,
                              moe_intermediate_size=704, num_hidden_layers=layers,
                              num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=512,
                              q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64,
                              v_head_dim=128, n_routed_experts=64, num_experts_per_tok=6,
                              n_shared_experts=2, first_k_dense_replace=1,
                              max_position_embeddings=8192)  # fmt: skip
    torch.manual_seed(0)
    hf = DeepseekV2ForCausalLM(config)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_((1.0 if "norm" in name else 0.0) + 0.02 * torch.randn_like(p))
    hf.save_pretrained(folder, safe_serialization=True)
    model, _ = weights.load_for_inference(folder, dtype=torch.bfloat16)
    return hf.to(torch.bfloat16).eval(), model


def package(model, folder: str, slots: int):
    """generate.py's default decode step for a batch-1 cache of `slots`: the AOT package."""
    from speedups import aot

    spec = dict(checkpoint=folder, dtype="bfloat16", quantize=None, groupsize=32,
                quantize_head=False, quantize_embedding=False, dequantize=False)  # fmt: skip
    return aot.decode_step(model, StaticKVCache.for_model(model, 1, slots), spec)


def ours(model, prompt, n, decode_fn, kind=StaticKVCache):
    def run():
        cache = kind.for_model(model, 1, len(prompt) + n)
        options = generate.DecodeOptions(ignore_eos=True, decode_fn=decode_fn)
        x = torch.tensor([prompt])
        return generate.generate(model, cache, x, n, SamplingParams(0.0), options)[1][
            "tokens_per_s"
        ]

    return run


def hf_decode(hf, prompt, n):
    from transformers import DynamicCache

    def run():
        cache, x = DynamicCache(config=hf.config), torch.tensor([prompt])
        with torch.no_grad():
            step = hf(input_ids=x, past_key_values=cache, use_cache=True)
            token = step.logits[:, -1].argmax(-1, keepdim=True)
            start = time.perf_counter()
            for _ in range(n - 1):
                step = hf(input_ids=token, past_key_values=cache, use_cache=True)
                token = step.logits[:, -1].argmax(-1, keepdim=True)
        return (n - 1) / (time.perf_counter() - start)

    return run


def kv_table(model, context: int):
    c, m, size = model.config, model.config.mla, 2
    latent = c.n_layers * (m.kv_lora_rank + m.qk_rope_head_dim) * size
    heads = c.n_layers * c.n_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim) * size
    print("\n| KV per token | ours (latent) | expanded heads | ratio | our cache at the context |")
    print("|---|---|---|---|---|")
    for name, kind in (("bf16", StaticKVCache), ("int8 (+ 2 scales)", Int8KVCache)):
        held = kind.for_model(model, 1, context).nbytes()
        print(
            f"| {c.n_layers} layers, {name} | {held // context:,} B | {heads:,} B (bf16) | "
            f"1/{heads / (held // context):.1f} | {held / 2**20:.1f} MiB |"
        )
    assert StaticKVCache.for_model(model, 1, context).nbytes() == latent * context


def main():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--new_tokens", type=int, default=24)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    print(f"# {runtime.cpu_capability()} | torch {torch.__version__} | "
          f"{torch.get_num_threads()} threads | bf16", flush=True)  # fmt: skip
    folder = tempfile.TemporaryDirectory(prefix="mla-")
    hf, model = build(args.layers, folder.name)
    kv_table(model, args.context + args.new_tokens)
    prompt = torch.randint(3, VOCAB, (args.context,), generator=torch.Generator().manual_seed(1))
    prompt = prompt.tolist()
    rows = {
        "ours, eager": ours(model, prompt, args.new_tokens, compiling.decode_one),
        "ours, --compile": ours(
            model, prompt, args.new_tokens, compiling.compile_decode("cpu", autotune=False)
        ),
        "ours, --compile, int8 latent cache": ours(
            model,
            prompt,
            args.new_tokens,
            compiling.compile_decode("cpu", autotune=False),
            Int8KVCache,
        ),
        "ours, default (the AOT package)": ours(
            model,
            prompt,
            args.new_tokens,
            package(model, folder.name, len(prompt) + args.new_tokens),
        ),
        "HF transformers, eager": hf_decode(hf, prompt, args.new_tokens),
    }
    for run in rows.values():  # warm-up (and the compile)
        run()
    samples = {name: [] for name in rows}
    for r in range(args.rounds):  # interleaved, every other round reversed
        for name in list(rows)[:: 1 if r % 2 == 0 else -1]:
            samples[name].append(rows[name]())
    hf_rate = statistics.median(samples["HF transformers, eager"])
    print(f"\ndecode after a {args.context}-token prompt, batch 1, {args.new_tokens} tokens:\n")
    print("| run | tok/s | vs HF eager |\n|---|---|---|")
    for name, s in samples.items():
        print(f"| {name} | {statistics.median(s):.2f} | {statistics.median(s) / hf_rate:.2f}x |")


if __name__ == "__main__":
    main()
