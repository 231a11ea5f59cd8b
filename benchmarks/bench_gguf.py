"""GGUF files at their own bits: generate.py against llama.cpp (llama-cpp-python) on the same file.

    .venv/bin/pip install -r benchmarks/requirements-bench.txt   # llama-cpp-python: see that file
    .venv/bin/python benchmarks/bench_gguf.py [--types Q4_1 Q4_K_M Q8_0] [--new_tokens 128]
                                              [--rounds 2] [--runners ...]
    .venv/bin/python benchmarks/bench_gguf.py --shape 1b --llama_cpp_src SRC   # see below

The embedded SmolLM2-135M Q4_1 file, and Q4_K_M and Q8_0 copies of it made by llama.cpp's own
quantizer (llama_model_quantize with allow_requantize, as `llama-quantize --allow-requantize` does:
the copies hold the Q4_1 values requantized, which is what their speed and size need). Every run is
a fresh process, batch 1, greedy, a 16-token prompt then exactly --new_tokens tokens (EOS ignored),
the machine's threads (2 here) for both; rounds alternate ours and llama.cpp. llama.cpp runs the CPU
variant ggml picks (printed below the table), except `sapphirerapids` on CPUs with AMX tiles: its
tile kernels fault with SIGILL in these VMs, so it is set aside and ggml picks its next best.
Columns:
- decode tok/s: tokens after the first over the time after the first (best of the rounds);
- load s: from process start of the weights' read to a model ready (ours: weights.load's own
  timing, the "loaded ... in X s" line; llama.cpp: the Llama() constructor);
- peak RSS: the child's maximum resident set (os.wait4), and for ours the same less a bare
  `python -c "import torch"` (measured in the same run), the figure the goal compares.
Ours runs eager (--compile off), --compile and --compile aot (generate.py's default) (bf16
activations all). The aot package is compiled by the first round's run (in a child process of
generate.py, into a fresh cache folder): that run's peak RSS and compile time are printed below the
table; the table's figures are the best rounds (with --rounds 2 or more, a round whose package was
already compiled, as every later run of a user finds it; with --rounds 1, the compiling run).

--shape 1b (or 3b) measures the sizes people run instead: random weights in Llama-3.2-1B's (3B's)
proportions with SmolLM2's vocabulary of 49,152, converted to a bf16 GGUF by llama.cpp's own
convert_hf_to_gguf.py from SRC (the same llama.cpp the benchmarks build: llama-cpp-python's sdist
holds it under vendor/llama.cpp) and quantized by its quantizer to Q4_0, Q4_K_M, Q5_K_M, Q6_K and
Q8_0 (at these widths K-quants are real K-quants, not the Q5_0 fallback of 576-wide layers).
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from formats import weights

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
FTYPES = {"Q4_0": 2, "Q8_0": 7, "Q4_K_M": 15, "Q5_K_M": 17, "Q6_K": 18}  # LLAMA_FTYPE_MOSTLY_*
# random weights in published proportions, SmolLM2's vocabulary and tokenizer (--shape)
SHAPES = {
    "1b": dict(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, intermediate_size=8192),  # 3.2-1B
    "3b": dict(dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, intermediate_size=8192),  # 3.2-3B
}
RUNNERS = ("llama.cpp", "ours eager", "ours --compile", "ours --compile aot")

# A build with GGML_BACKEND_DL=ON installs its per-CPU backends in site-packages/bin; they are
# loaded through libllama's own handle (the same ggml instance the model uses), best variant first.
# On a CPU with AMX tiles the best is `sapphirerapids`, whose tile kernels fault with SIGILL in
# these VMs: the others are loaded from a folder of links without it, so ggml picks its next best.
AMX = "amx_tile" in open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else False
LOAD_BACKENDS = r"""
import glob, os, tempfile, llama_cpp, llama_cpp.llama_cpp
folder = os.path.join(os.path.dirname(os.path.dirname(llama_cpp.__file__)), "bin")
if os.environ.get("GGML_SET_ASIDE"):
    links = tempfile.mkdtemp(prefix="ggml-variants-")
    for f in glob.glob(os.path.join(folder, "*.so")):
        if os.environ["GGML_SET_ASIDE"] not in os.path.basename(f):
            os.symlink(f, os.path.join(links, os.path.basename(f)))
    folder = links
llama_cpp.llama_cpp._lib.ggml_backend_load_all_from_path(folder.encode())
if os.environ.get("GGML_SET_ASIDE"):
    import shutil; shutil.rmtree(folder)  # (the variants stay loaded)
"""

LLAMA_CPP = (
    LOAD_BACKENDS
    + r"""
import json, sys, time
from llama_cpp import Llama
path, new, threads, prompt = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
start = time.perf_counter()
llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=512, verbose=False)
load = time.perf_counter() - start
n, first = 0, None
for _ in llm.generate(llm.tokenize(prompt.encode()), temp=0.0, top_k=1):
    n += 1
    if n == 1:
        first = time.perf_counter()
    if n == new:
        break
print(json.dumps({"decode": (new - 1) / (time.perf_counter() - first), "load": load}))
"""
)

QUANTIZE = (
    LOAD_BACKENDS
    + r"""
import sys
params = llama_cpp.llama_model_quantize_default_params()
params.ftype, params.allow_requantize, params.nthread = int(sys.argv[3]), True, 2
sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), params))
"""
)


def run_rss(cmd, env=None) -> tuple:
    """(stdout, stderr, peak resident bytes) of a child process (with its own children,
    os.wait4)."""
    aside = {"GGML_SET_ASIDE": "sapphirerapids"} if AMX else {}
    p = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, "HF_HUB_OFFLINE": "1", **aside, **(env or {})},
    )
    out, err = [], []
    readers = [
        threading.Thread(target=lambda f=f, buf=buf: buf.append(f.read()))
        for f, buf in ((p.stdout, out), (p.stderr, err))
    ]
    for t in readers:  # both pipes drained at once: a chatty child never blocks on a full pipe
        t.start()
    _, status, usage = os.wait4(p.pid, 0)
    for t in readers:
        t.join()
    out, err = out[0], err[0]
    if status:
        raise RuntimeError(f"{' '.join(map(str, cmd[:4]))} failed:\n{err[-2000:]}")
    return out, err, usage.ru_maxrss * 1024


def ours(path, new, compile_, aot_cache) -> dict:
    """compile_: None (eager), "jit" (--compile) or "aot" (--compile aot, packages in aot_cache)."""
    cmd = [
        sys.executable,
        "generate.py",
        "--checkpoint",
        str(path),
        "--prompt",
        PROMPT,
        "--max_new_tokens",
        str(new),
        "--temperature",
        "0",
        "--ignore_eos",
        "--json",
        "--compile",
        compile_ or "off",
    ]
    out, err, rss = run_rss(cmd, {"LLM_AOT_CACHE": str(aot_cache)})
    stats = json.loads(out.strip().splitlines()[-1])["stats"]
    load = float(re.search(r"loaded .* in ([0-9.]+) s", err).group(1))
    aot_compile = re.search(
        r"^compiled in ([0-9.]+) s", err, re.M
    )  # speedups/aot.py's line when it compiled
    return {
        "decode": stats["tokens_per_s"],
        "load": load,
        "rss": rss,  # tokens after the first / their time
        "aot_compile": float(aot_compile.group(1)) if aot_compile and compile_ == "aot" else None,
    }


def llama_cpp(path, new, threads) -> dict:
    out, err, rss = run_rss(
        [sys.executable, "-c", LLAMA_CPP, str(path), str(new), str(threads), PROMPT]
    )
    variant = re.search(
        r"loaded CPU backend from \S*libggml-cpu-(\w+)", err
    )  # the variant ggml picked
    return {
        **json.loads(out.strip().splitlines()[-1]),
        "rss": rss,
        "variant": variant.group(1) if variant else "?",
    }


def shaped_file(shape: str, src, folder) -> Path:
    """A bf16 GGUF of random weights in SHAPES[shape]'s proportions, written by llama.cpp's own
    converter (`src`: its source tree, convert_hf_to_gguf.py and gguf-py) from an HF folder made
    here: model.py's Llama with tied embeddings, N(0, 0.02) weights, and SmolLM2's tokenizer (the
    embedded file's, turned into tokenizer.json by transformers)."""
    import torch
    from transformers import AutoTokenizer

    from formats import hf_folder
    from model import ModelConfig, Transformer

    src, folder = Path(src), Path(folder)
    hf = folder / f"random-{shape}"
    config = ModelConfig(vocab_size=49152, tie_word_embeddings=True, rope_theta=500000.0,
                         max_position_embeddings=8192, **SHAPES[shape])  # fmt: skip
    torch.manual_seed(0)
    model = Transformer(config).to(torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.ones_like(p) if "norm" in name else 0.02 * torch.randn_like(p))
    hf_folder.save_hf_folder(model, hf)
    del model
    source = weights.default_checkpoint()
    tokenizer = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    tokenizer.save_pretrained(str(hf))
    out = folder / f"random-{shape}.BF16.gguf"
    convert = [sys.executable, str(src / "convert_hf_to_gguf.py"), str(hf), "--outtype", "bf16"]
    run_rss([*convert, "--outfile", str(out)], {"PYTHONPATH": str(src / "gguf-py")})
    return out


def quantized_files(args, folder: Path) -> dict:
    """{type: path}: the embedded Q4_1 file and copies requantized by llama.cpp, or with --shape a
    converted bf16 file quantized to each type."""
    source = weights.default_checkpoint()
    if args.shape:  # in a child: this process stays small, and so do the children it forks
        code = "import sys; from bench_gguf import shaped_file as f; print(f(*sys.argv[1:]))"
        run_rss(
            [sys.executable, "-c", code, args.shape, args.llama_cpp_src, str(folder)],
            {"PYTHONPATH": str(ROOT / "benchmarks")},
        )
        source = folder / f"random-{args.shape}.BF16.gguf"
    files = {}
    for kind in args.types:
        if kind == "Q4_1" and not args.shape:
            files[kind] = source
            continue
        files[kind] = folder / f"{source.stem.split('.')[0]}.{kind}.gguf"
        run_rss([sys.executable, "-c", QUANTIZE, str(source), str(files[kind]), str(FTYPES[kind])])
    return files


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--types", nargs="+", default=None)
    p.add_argument("--new_tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--shape", choices=list(SHAPES), default=None)
    p.add_argument("--llama_cpp_src", default=None, help="llama.cpp's source tree (with --shape)")
    p.add_argument("--runners", nargs="+", choices=RUNNERS, default=list(RUNNERS))
    args = p.parse_args()
    if args.shape and not args.llama_cpp_src:
        p.error("--shape converts with llama.cpp's converter: pass --llama_cpp_src")
    args.types = args.types or (
        ["Q4_0", "Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0"] if args.shape else ["Q4_1", "Q4_K_M", "Q8_0"]
    )
    import torch

    threads = torch.get_num_threads()
    folder = Path(tempfile.mkdtemp(prefix="bench-gguf-"))
    files = quantized_files(args, folder)
    bare = run_rss([sys.executable, "-c", "import torch"])[2]
    print(
        f"CPU capability {torch.backends.cpu.get_cpu_capability()}, {threads} threads; bare "
        f"`import torch` peak RSS {bare / 2**20:.0f} MiB"
        + (
            "; llama.cpp's sapphirerapids variant set aside (AMX tiles fault with SIGILL "
            "in these VMs), ggml runs its next best"
            if AMX
            else ""
        )
        + (f"; random weights in the {args.shape} shape {SHAPES[args.shape]}" if args.shape else "")
        + "\n"
    )
    table(args, files, bare, threads, folder)


def table(args, files: dict, bare: int, threads: int, folder: Path):
    """Each file's rows: every runner, best of the rounds; then the CPU variant and AOT builds."""
    print(
        "| file | size MiB | runner | decode tok/s | load s | peak RSS MiB | RSS - bare torch MiB "
        "| vs llama.cpp RSS |"
    )
    print("|---|---|---|---|---|---|---|---|")
    first_aot, variants = {}, set()
    for kind, path in files.items():
        runs = {
            "llama.cpp": lambda: llama_cpp(path, args.new_tokens, threads),
            "ours eager": lambda: ours(path, args.new_tokens, None, folder / "aot"),
            "ours --compile": lambda: ours(path, args.new_tokens, "jit", folder / "aot"),
            "ours --compile aot": lambda: ours(path, args.new_tokens, "aot", folder / "aot"),
        }
        best = {}
        for _ in range(args.rounds):
            for name in ["llama.cpp"] + [r for r in args.runners if r != "llama.cpp"]:
                r = runs[name]()
                if r.get("aot_compile") is not None:
                    first_aot[kind] = r
                b = best.setdefault(name, r)
                best[name] = {
                    **b,
                    "decode": max(b["decode"], r["decode"]),
                    "load": min(b["load"], r["load"]),
                    "rss": min(b["rss"], r["rss"]),
                }
        ref = best["llama.cpp"]
        variants.add(ref["variant"])
        for name, r in best.items():
            net = r["rss"] - bare if name != "llama.cpp" else r["rss"]
            print(
                f"| {kind} | {path.stat().st_size / 2**20:.0f} | {name} | "
                f"{r['decode']:.1f} ({r['decode'] / ref['decode']:.2f}x) | "
                f"{r['load']:.2f} | {r['rss'] / 2**20:.0f} | {net / 2**20:.0f} | "
                f"{net / ref['rss']:.2f}x |",
                flush=True,
            )
    print(f"\nllama.cpp's CPU variant (ggml's pick): {', '.join(sorted(variants))}")
    for kind, r in first_aot.items():
        print(
            f"\n{kind}: the first --compile aot run compiled its package in "
            f"{r['aot_compile']:.1f} s; that run's peak "
            f"RSS, the compiling child's included: {r['rss'] / 2**20:.0f} MiB"
        )


if __name__ == "__main__":
    main()
