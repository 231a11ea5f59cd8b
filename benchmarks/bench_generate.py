"""Batch-1 decode speed of generate.py against Hugging Face transformers, side by side, one process.

    .venv/bin/python benchmarks/bench_generate.py [--dtypes bfloat16 float32] [--new_tokens 128]

Both run the embedded SmolLM2-135M with the same dequantized weights (HF loads them from a plain
safetensors folder written by hf_folder.save_hf_folder: loading the GGUF directly would keep them
packed and dequantize inside its kernels), the same dtype and thread count, batch 1, greedy, EOS
disabled so both produce exactly `new_tokens` tokens, each after a warm-up run, then `--rounds`
interleaved rounds (HF, ours eager, ours compiled, HF, ...) of which each keeps its median. HF runs
`generate` with its default attention. We run eager and compiled (generate.py --compile).

Columns: decode tokens/s (tokens after the first / time after the first), end-to-end tokens/s,
achieved bandwidth (weight bytes read per step * decode tokens/s) and its fraction of this
machine's read bandwidth, measured here as torch.sum over a float32 buffer of the model's weight
bytes (best of 5; the working-set size matters on CPUs with a large L3 cache), time to first
token, and the process's peak resident memory during the run (both implementations' weights
stay resident, so it mostly shows that neither allocates much while decoding). Also: cold
compile time (a fresh Inductor cache), and the wall time from launching `generate.py` (no
--compile) to its first generated token.
"""

import argparse
import os
import tempfile

# A fresh Inductor cache, so the compile time printed is a cold compile.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="inductor-cold-"))
import shutil
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import compiling
import generate
import memory
import runtime
from formats import hf_folder, weights
from formats.tokenizer import load_tokenizer
from kv_cache import StaticKVCache
from sampling import SamplingParams

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def read_bandwidth(nbytes: int) -> float:
    x = torch.ones(nbytes // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9


class Clock:
    """A streamer for HF generate that records when each token arrives (the first put is the
    prompt)."""

    def __init__(self):
        self.times = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        pass


def run_hf(hf, ids, n):
    clock = Clock()
    memory.reset_peak_memory("cpu")
    start = time.perf_counter()
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False, streamer=clock
        )
    total = time.perf_counter() - start
    assert out.shape[1] - len(ids) == n
    first = clock.times[1] - start  # times[0] is the prompt being handed over
    return {
        "decode_tps": (n - 1) / (clock.times[-1] - clock.times[1]),
        "e2e_tps": n / total,
        "ttft": first,
        "peak": memory.peak_memory_bytes("cpu"),
    }


def run_ours(model, ids, n, decode_fn, seq_len):
    cache = StaticKVCache.for_model(
        model, 1, seq_len
    )  # one length for every run: one compiled graph
    memory.reset_peak_memory("cpu")
    rows, t = generate.generate(
        model,
        cache,
        torch.tensor([ids]),
        n,
        SamplingParams(0.0),
        generate.DecodeOptions(ignore_eos=True, decode_fn=decode_fn),
    )
    assert len(rows[0]) == n
    return {
        "decode_tps": t["tokens_per_s"],
        "e2e_tps": n / t["total_s"],
        "ttft": t["time_to_first_token_s"],
        "peak": memory.peak_memory_bytes("cpu"),
    }


def startup_to_first_token() -> float:
    """Seconds from launching generate.py (no --compile) to its first generated character."""
    start = time.perf_counter()
    prompt = "Hello"
    proc = subprocess.Popen(
        [
            sys.executable,
            os.path.join(ROOT, "generate.py"),
            "--prompt",
            prompt,
            "--max_new_tokens",
            "8",
            "--temperature",
            "0",
            "--ignore_eos",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    seen = b""
    while len(seen) <= len(prompt):
        seen += proc.stdout.read(1)
    elapsed = time.perf_counter() - start
    proc.wait()
    return elapsed


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    p.add_argument("--new_tokens", type=int, default=128)
    p.add_argument(
        "--rounds", type=int, default=3, help="interleaved measured runs per implementation"
    )
    p.add_argument("--skip_compile", action="store_true")
    args = p.parse_args()
    from transformers import AutoModelForCausalLM

    path = weights.default_checkpoint()
    tok = load_tokenizer(path)
    ids = tok.encode_chat([{"role": "user", "content": PROMPT}])
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, prompt {len(ids)} tokens, "
        f"{args.new_tokens} new tokens"
    )
    folder = hf_folder.save_hf_folder(
        weights.load(None, dequantize=True)[0], tempfile.mkdtemp(prefix="smollm2-hf-")
    )
    seq_len = len(ids) + args.new_tokens
    rows = []
    for name in args.dtypes:
        dtype = runtime.DTYPES[name]
        model, _ = weights.load(None, dtype=dtype, dequantize=True)
        hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).eval()
        step_bytes = model.bytes_read_per_token()
        runs = [("HF transformers eager", lambda: run_hf(hf, ids, args.new_tokens))]
        runs.append(
            (
                "ours eager",
                lambda: run_ours(model, ids, args.new_tokens, compiling.decode_one, seq_len),
            )
        )
        compile_s = None
        if not args.skip_compile:
            start = time.perf_counter()
            compiled = compiling.compile_decode("cpu")
            run_ours(
                model, ids, 4, compiled, seq_len
            )  # compiles (cold unless Inductor's cache has it)
            compile_s = time.perf_counter() - start
            runs.append(
                ("ours compiled", lambda: run_ours(model, ids, args.new_tokens, compiled, seq_len))
            )
        for _, fn in runs:
            fn()  # warm-up
        # The machine's speed drifts: interleave the implementations round by round and keep
        # each one's median round, so every ratio compares runs made at nearly the same moment.
        results = {label: [] for label, _ in runs}
        bandwidths = []
        for _ in range(args.rounds):
            bandwidths.append(read_bandwidth(step_bytes))
            for label, fn in runs:
                results[label].append(fn())
        bandwidth = sorted(bandwidths)[len(bandwidths) // 2]
        for label, _ in runs:
            r = sorted(results[label], key=lambda x: x["decode_tps"])[len(results[label]) // 2]
            r.update(
                label=label, dtype=name, gbs=step_bytes * r["decode_tps"] / 1e9, machine=bandwidth
            )
            rows.append(r)
            print(
                f"  {label} {name}: {r['decode_tps']:.1f} tok/s "
                f"(rounds: {', '.join(format(x['decode_tps'], '.1f') for x in results[label])})",
                flush=True,
            )
        if compile_s is not None:
            print(f"  compile (decode step, {name}): {compile_s:.1f} s", flush=True)
        model = hf = None  # freed before the next dtype loads
    shutil.rmtree(folder)
    print()
    print(
        "| implementation | dtype | decode tok/s | end-to-end tok/s | GB/s | % of read bandwidth "
        "| TTFT ms | process peak RSS MiB | vs HF |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        hf_tps = next(
            x["decode_tps"]
            for x in rows
            if x["dtype"] == r["dtype"] and x["label"].startswith("HF")
        )
        print(
            f"| {r['label']} | {r['dtype']} | {r['decode_tps']:.1f} | {r['e2e_tps']:.1f} | "
            f"{r['gbs']:.2f} | {100 * r['gbs'] / r['machine']:.0f}% of {r['machine']:.1f} | "
            f"{1000 * r['ttft']:.0f} | {r['peak'] / 2**20:.0f} | {r['decode_tps'] / hf_tps:.2f}x |"
        )
    print(
        "\nlaunch to first generated token, generate.py without --compile: "
        f"{startup_to_first_token():.1f} s"
    )


if __name__ == "__main__":
    main()
