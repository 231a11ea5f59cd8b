"""serve.py against llama.cpp's own server (llama-server) on the same GGUF file, streaming clients.

    .venv/bin/python benchmarks/bench_llama_server.py [--clients 1 8 32] [--requests 64]
        [--llama_server PATH] [--serve_flags "--compile"]      # ~15 min, plus ~10 min to build once

Setup: unless --llama_server names a binary, llama-server is built once into benchmarks/.llama.cpp
(ignored by git) from the llama.cpp sources inside llama-cpp-python's sdist (the version pinned in
benchmarks/requirements-bench.txt, fetched with pip), with cmake for this machine's instruction
set (GGML_NATIVE) and ggml's AMX tile kernels off: they fault with SIGILL in these VMs.
Both servers load the embedded SmolLM2-135M Q4_1 GGUF (or --gguf) with 2 threads: serve.py at the
file's own bits (its default; --serve_flags adds flags), llama-server with one slot per client of
the largest count (-np; continuous batching is its default) and 1,024 tokens of context per slot.
The clients (the `openai` client, on loopback) stream completions one after another, each its
share of --requests: prompts of 20-320 words of data/declaration.txt (fixed seed, the same text to
both), 128 tokens each, greedy, EOS ignored (`ignore_eos`, which both accept). Columns: output
tokens/s over the run, time to first token p50 and p90, and time per output token p50 (per
request, after its first token). Servers run in turn, never side by side.
"""

import argparse
import asyncio
import glob
import os
import random
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

from bench_serve import load

BUILD = os.path.join(HERE, ".llama.cpp")
PIN = "llama-cpp-python==0.3.36"  # benchmarks/requirements-bench.txt


def build_llama_server() -> str:
    """llama-server built from the pinned sdist's vendored llama.cpp, once; its path."""
    binary = os.path.join(BUILD, "build", "bin", "llama-server")
    if os.path.exists(binary):
        return binary
    tmp = tempfile.mkdtemp(prefix="llama-sdist-")
    print(
        f"building llama-server from {PIN}'s sources into {BUILD} (once; about 10 min on 2 cores)",
        flush=True,
    )
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "-q",
            "--no-deps",
            "--no-binary",
            ":all:",
            PIN,
            "-d",
            tmp,
        ],
        check=True,
    )
    with tarfile.open(glob.glob(os.path.join(tmp, "*.tar.gz"))[0]) as t:
        t.extractall(tmp, filter="data")
    src = glob.glob(os.path.join(tmp, "llama_cpp_python-*", "vendor", "llama.cpp"))[0]
    shutil.rmtree(BUILD, ignore_errors=True)
    shutil.copytree(src, BUILD)
    flags = [
        "-DGGML_NATIVE=ON",
        "-DGGML_AMX_TILE=OFF",
        "-DGGML_AMX_INT8=OFF",
        "-DGGML_AMX_BF16=OFF",
        "-DLLAMA_CURL=OFF",
        "-DLLAMA_BUILD_SERVER=ON",
        "-DLLAMA_BUILD_TESTS=OFF",
        "-DLLAMA_BUILD_EXAMPLES=OFF",
        "-DCMAKE_BUILD_TYPE=Release",
    ]
    subprocess.run(
        ["cmake", "-S", BUILD, "-B", os.path.join(BUILD, "build"), *flags],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    subprocess.run(
        ["cmake", "--build", os.path.join(BUILD, "build"), "--target", "llama-server", "-j", "2"],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return binary


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(proc, url: str, timeout: float = 300):
    start = time.perf_counter()
    while time.perf_counter() - start < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}) before it was ready")
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"the server at {url} was not ready within {timeout} s")


def start(name, binary, gguf, slots, serve_flags):
    port = free_port()
    if name == "llama-server":
        cmd = [
            binary,
            "-m",
            gguf,
            "-t",
            "2",
            "-tb",
            "2",
            "-np",
            str(slots),
            "-c",
            str(1024 * slots),
            "--port",
            str(port),
            "--host",
            "127.0.0.1",
            "--no-webui",
            "--threads-http",
            str(slots + 4),
        ]  # a thread per streaming client (its default follows the cores)
    else:
        cmd = [
            sys.executable,
            os.path.join(ROOT, "serve.py"),
            "--checkpoint",
            gguf,
            "--port",
            str(port),
            "--max_num_seqs",
            str(slots),
            *serve_flags.split(),
        ]
    log = tempfile.NamedTemporaryFile("w+", prefix=f"{name}-", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    proc.log = log.name  # its output, shown if a run fails
    url = f"http://127.0.0.1:{port}"
    wait_ready(proc, url, timeout=1800)  # (serve.py builds its compiled package on a first run)
    return proc, url


def prompts(count: int, seed: int = 0) -> list:
    with open(os.path.join(ROOT, "data", "declaration.txt")) as f:
        words = f.read().split()
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        n = rng.randint(20, 320)
        i = rng.randrange(len(words) - n)
        out.append(" ".join(words[i : i + n]))
    return out


def main():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--max_tokens", type=int, default=128)
    p.add_argument(
        "--llama_server", default=None, help="a llama-server binary (default: build one, see above)"
    )
    p.add_argument("--serve_flags", default="", help="more flags for serve.py, e.g. '--compile'")
    p.add_argument(
        "--gguf",
        default=None,
        help="the GGUF both servers load (default: the embedded model; e.g. bench_gguf.py "
        "--shape 1b's Q4_K_M file)",
    )
    args = p.parse_args()
    from formats import weights

    binary = args.llama_server or build_llama_server()
    gguf, texts, slots = (
        args.gguf or str(weights.default_checkpoint()),
        prompts(args.requests),
        max(args.clients),
    )
    rows = []
    for name in ("serve.py", "llama-server"):
        proc, url = start(name, binary, gguf, slots, args.serve_flags)
        try:
            asyncio.run(load(url, texts[:2], 2, 8))  # warm-up
            for clients in args.clients:
                share = texts[: max(clients, args.requests if clients > 1 else args.requests // 4)]
                rows.append((name, asyncio.run(load(url, share, clients, args.max_tokens))))
        except Exception:
            print(
                f"{name} failed; the end of its log ({proc.log}):\n"
                + open(proc.log).read()[-3000:],
                file=sys.stderr,
            )
            raise
        finally:
            proc.terminate()
            proc.wait()
    print(
        f"\n{os.path.basename(gguf)}, {args.max_tokens} tokens per request (EOS ignored), "
        "prompts 20-320 words, "
        f"2 threads each; serve.py {args.serve_flags or '(defaults)'}; llama-server -np {slots}\n"
    )
    print(
        "| server | clients | requests | output tok/s | TTFT p50 s | TTFT p90 s "
        "| time per output token p50 ms |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, r in sorted(rows, key=lambda x: (x[1]["clients"], x[0])):
        print(
            f"| {name} | {r['clients']} | {r['requests']} | {r['tps']:.1f} | "
            f"{r['ttft50']:.2f} | {r['ttft90']:.2f} | "
            f"{1000 * r['tpot50']:.1f} |"
        )


if __name__ == "__main__":
    main()
