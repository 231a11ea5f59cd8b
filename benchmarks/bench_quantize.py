"""Decode speed of each weight format, the int8 KV cache at long contexts, and HF transformers.

    .venv/bin/python benchmarks/bench_quantize.py [--new_tokens 128] [--rounds 3]
                                                  [--contexts 512 4096 8000]

The embedded SmolLM2-135M, batch 1, greedy, EOS ignored, compiled decode (generate.py --compile),
one process. Modes: float32 and bf16 (autotuned GEMMs), int8 and int4 (group 64), and int4 with
the int8 KV cache; the quantized modes include the output head (--quantize_head: on this model the
49152 x 576 head is the largest single matrix), int8 shares one int8 table between the tied head
and the embedding. HF transformers runs eager bf16 `generate` on the same dequantized weights
(a plain safetensors folder) at the start and at the end, so the machine's drift shows.

Columns: decode tokens/s (median of --rounds), achieved GB/s (weight bytes read per step x tok/s),
time to first token (eager prefill of the prompt: int4 dequantizes per layer from 32 rows up),
weight MiB, and "matmul-only": the same step's linear layers alone, compiled the same way, as
tokens/s; end-to-end / matmul-only says how much of the step is the matmuls. The KV table decodes
with caches of `--contexts` slots (a static cache attends over all its slots, so cost follows the
cache length) in bf16 and int8 on the int4 model.
"""

import argparse
import os
import tempfile

os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="inductor-cold-"))
import shutil
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_generate import PROMPT, run_hf

import compiling
import generate
import quantize
from formats import hf_folder, weights
from formats.tokenizer import load_tokenizer
from kv_cache import StaticKVCache
from sampling import SamplingParams
from speedups.kv_int8 import Int8KVCache

MODES = [  # label, dtype, quantize mode, KV cache
    ("float32", torch.float32, None, StaticKVCache),
    ("bf16", torch.bfloat16, None, StaticKVCache),
    ("int8", torch.bfloat16, "int8", StaticKVCache),
    ("int4 g64", torch.bfloat16, "int4", StaticKVCache),
    ("int4 g64 + int8 KV", torch.bfloat16, "int4", Int8KVCache),
]


def load(mode, dtype):
    model, _ = weights.load(None, dtype=dtype, dequantize=True)
    if mode:
        quantize.quantize_model(model, mode, 64, head=True, embedding=mode == "int8")
    return model


def decode(model, ids, n, fn, cache):
    cache.reset()
    rows, t = generate.generate(
        model,
        cache,
        torch.tensor([ids]),
        n,
        SamplingParams(0.0),
        generate.DecodeOptions(ignore_eos=True, decode_fn=fn),
    )
    assert len(rows[0]) == n
    return t


def median(xs):
    return sorted(xs)[len(xs) // 2]


def matmul_only(model, autotune: bool, steps: int = 30) -> float:
    """Steps per second of running every linear layer of one decode step, and nothing else."""
    layers = [
        m
        for m in model.modules()
        if isinstance(m, (torch.nn.Linear, quantize.Int8Linear, quantize.Int4Linear))
    ]
    dtype = model.norm.weight.dtype
    inputs = {k: torch.randn(1, 1, k, dtype=dtype) for k in {m.in_features for m in layers}}

    def step():
        return [m(inputs[m.in_features]) for m in layers]

    torch._dynamo.reset()
    fn = compiling.compile_decode("cpu", step, autotune)
    with torch.no_grad():
        for _ in range(3):
            fn()
        start = time.perf_counter()
        for _ in range(steps):
            fn()
    return steps / (time.perf_counter() - start)


def time_steps(model, fn, cache, pos: int, steps: int = 32) -> float:
    token = torch.zeros(1, 1, dtype=torch.long)
    with torch.no_grad():
        for i in range(3):
            fn(model, cache, token, torch.tensor([[pos + i]]))
    with torch.no_grad(), compiling.skip_guards(True):
        start = time.perf_counter()
        for i in range(steps):
            fn(model, cache, token, torch.tensor([[pos + i]]))
    return steps / (time.perf_counter() - start)


def measure_mode(label, ids, new_tokens, rounds, autotune="auto") -> dict:
    _, dtype, mode, cache_cls = next(m for m in MODES if m[0] == label)
    model = load(mode, dtype)
    tune = compiling.autotune(model) if autotune == "auto" else autotune == "on"
    start = time.perf_counter()
    fn = compiling.compile_decode("cpu", autotune=tune)
    cache = cache_cls.for_model(model, 1, len(ids) + new_tokens)
    decode(model, ids, 4, fn, cache)
    compile_s = time.perf_counter() - start
    runs = [decode(model, ids, new_tokens, fn, cache) for _ in range(rounds)]
    tps = median([r["tokens_per_s"] for r in runs])
    return {
        "label": label + ("" if autotune == "auto" else f" (autotune {autotune})"),
        "tps": tps,
        "rounds": [r["tokens_per_s"] for r in runs],
        "gbs": model.bytes_read_per_token() * tps / 1e9,
        "ttft": median([r["time_to_first_token_s"] for r in runs]),
        "weight_bytes": model.weight_bytes(),
        "matmul_only": matmul_only(model, tune),
        "compile_s": compile_s,
    }


def measure_context(ctx, rounds) -> dict:
    model = load("int4", torch.bfloat16)
    out = {"ctx": ctx, "weight_bytes_read": model.bytes_read_per_token()}
    for name, cls in (("bf16", StaticKVCache), ("int8", Int8KVCache)):
        cache = cls.for_model(model, 1, ctx)
        torch._dynamo.reset()
        fn = compiling.compile_decode("cpu", autotune=False)
        out[name] = median([time_steps(model, fn, cache, ctx - 40) for _ in range(rounds)])
        out[name + "_bytes"] = cache.nbytes()
    return out


def child(argv) -> dict:
    """Each mode runs in a fresh process: compiled graphs and frozen weights of one mode never
    add to the next one's memory, and each compile starts cold."""
    import json
    import subprocess

    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), *argv], capture_output=True, text=True
    )
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"{argv} failed:\n{proc.stderr[-3000:]}")
    return json.loads(line[len("RESULT ") :])


def main():
    import json

    p = argparse.ArgumentParser()
    p.add_argument("--new_tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--contexts", type=int, nargs="*", default=[512, 4096, 8000])
    p.add_argument(
        "--modes", nargs="*", default=[m[0] for m in MODES], help="a subset of the modes, by label"
    )
    p.add_argument(
        "--autotune",
        nargs="*",
        default=["auto"],
        choices=["auto", "on", "off"],
        help=(
            "max-autotune for the compiled step: auto (generate.py's choice), on, off; "
            "several compare"
        ),
    )
    p.add_argument("--one_mode", default=None, help=argparse.SUPPRESS)
    p.add_argument("--one_context", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()

    tok = load_tokenizer(weights.default_checkpoint())
    ids = tok.encode_chat([{"role": "user", "content": PROMPT}])
    if args.one_mode:
        print(
            "RESULT "
            + json.dumps(
                measure_mode(args.one_mode, ids, args.new_tokens, args.rounds, args.autotune[0])
            )
        )
        return
    if args.one_context:
        print("RESULT " + json.dumps(measure_context(args.one_context, args.rounds)))
        return
    from transformers import AutoModelForCausalLM

    print(
        f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()} "
        f"(ATEN_CPU_CAPABILITY={os.environ.get('ATEN_CPU_CAPABILITY', 'unset')}), "
        f"{torch.get_num_threads()} threads, prompt {len(ids)} tokens, "
        f"{args.new_tokens} new tokens"
    )
    folder = hf_folder.save_hf_folder(
        weights.load(None, dequantize=True)[0], tempfile.mkdtemp(prefix="smollm2-hf-")
    )
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16).eval()
    run_hf(hf, ids, 8)
    hf_first = median([run_hf(hf, ids, args.new_tokens)["decode_tps"] for _ in range(args.rounds)])
    print(f"  HF transformers eager bf16: {hf_first:.1f} tok/s", flush=True)
    rows = []
    for label, tune in [
        (m[0], t)
        for m in MODES
        if m[0] in args.modes
        for t in args.autotune
        if not (m[2] == "int4" and t == "on")
    ]:  # int4: no autotune (see compiling.autotune)
        r = child(
            [
                "--one_mode",
                label,
                "--new_tokens",
                str(args.new_tokens),
                "--rounds",
                str(args.rounds),
                "--autotune",
                tune,
            ]
        )
        rows.append(r)
        print(
            f"  {r['label']}: {r['tps']:.1f} tok/s "
            f"(rounds {', '.join(format(x, '.1f') for x in r['rounds'])}), "
            f"matmul-only {r['matmul_only']:.1f}/s, compile {r['compile_s']:.0f} s",
            flush=True,
        )
    hf_last = median([run_hf(hf, ids, args.new_tokens)["decode_tps"] for _ in range(args.rounds)])
    hf_tps = (hf_first + hf_last) / 2
    shutil.rmtree(folder)

    print(
        f"\nHF transformers eager bf16: {hf_first:.1f} tok/s at the start, "
        f"{hf_last:.1f} at the end (ratios use the mean)\n"
    )
    print(
        "| mode | decode tok/s | vs HF bf16 eager | GB/s | TTFT ms | weights MiB "
        "| matmul-only steps/s | end-to-end / matmul-only | compile s |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['label']} | {r['tps']:.1f} | {r['tps'] / hf_tps:.2f}x | {r['gbs']:.2f} | "
            f"{1000 * r['ttft']:.0f} | "
            f"{r['weight_bytes'] / 2**20:.1f} | {r['matmul_only']:.1f} | "
            f"{r['tps'] / r['matmul_only']:.0%} | {r['compile_s']:.0f} |"
        )
    if args.contexts:
        print("\nint4 g64 model, decode tok/s by KV cache length (bf16 KV vs int8 KV)\n")
        print(
            "| cache slots | bf16 KV tok/s | int8 KV tok/s | int8 / bf16 | bf16 KV MiB "
            "| int8 KV MiB | bf16 KV / weight bytes read |"
        )
        print("|---|---|---|---|---|---|---|")
        for ctx in args.contexts:
            r = child(["--one_context", str(ctx), "--rounds", str(args.rounds)])
            print(
                f"| {ctx} | {r['bf16']:.1f} | {r['int8']:.1f} | {r['int8'] / r['bf16']:.2f}x | "
                f"{r['bf16_bytes'] / 2**20:.1f} | "
                f"{r['int8_bytes'] / 2**20:.1f} | {r['bf16_bytes'] / r['weight_bytes_read']:.0%} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
