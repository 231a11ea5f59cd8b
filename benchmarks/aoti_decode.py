"""A probe: the decode step as an AOTInductor package, run by a process that never imports the compiler.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/aoti_decode.py [--slots 256] [--tokens 64] [--checkpoint F.gguf]

Why: `--compile` costs about 150-220 MiB of resident memory for Inductor itself, whatever the
model (benchmarks/RESULTS.md, "Resident memory besides the weights"), more than the embedded
model's weights. AOTInductor compiles the same step ahead of time into a package (a .so and the
weights); torch._C._aoti.AOTIModelPackageLoader, a C++ class, runs it without importing
torch._dynamo, sympy or Inductor. Here the step is runtime.decode_one on the embedded GGUF (or
--checkpoint, a GGUF of the same SmolLM2-135M shapes) at its own bits (bf16), its static KV cache of --slots slots passed in as inputs (written in place), so
the cache stays in the caller's hands. Each part runs in its own process:
1. export + compile the package (torch.export, aoti_compile_and_package);
2. run it: greedy decode of --tokens tokens from token 1, tokens/s and peak RSS;
3. the eager model on the same steps: the greedy tokens must be the same;
4. a bare `import torch`, for the RSS baseline.
Not a generate.py mode: prefill, attend-length buckets and sampling would each need their own
package or path; this measures what such a mode could cost.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SHAPE = (30, 3, 64)  # the embedded SmolLM2-135M: layers, KV heads, head dim


def export(path: str, slots: int, checkpoint=None):
    import torch

    import runtime
    import weights
    from kv_cache import StaticKVCache

    model, _ = weights.load_for_inference(checkpoint, "cpu", torch.bfloat16)
    template = StaticKVCache.for_model(model, 1, slots)

    class Step(torch.nn.Module):  # decode_one with the cache's K and V as inputs (mutated in place)
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, token, pos, *kv):
            cache = StaticKVCache.__new__(StaticKVCache)
            cache.__dict__.update(template.__dict__)
            cache.k, cache.v = list(kv[: len(kv) // 2]), list(kv[len(kv) // 2:])
            return runtime.decode_one(self.model, cache, token, pos)

    start = time.perf_counter()
    with torch.no_grad():
        program = torch.export.export(Step().eval(), (torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long),
                                                      *template.k, *template.v))
        torch._inductor.aoti_compile_and_package(program, package_path=path)
    return {"compile_s": time.perf_counter() - start, "package_mib": os.path.getsize(path) / 2**20}


def decode(step, slots: int, n: int) -> dict:
    """Greedy tokens from token 1 at positions 0.. through `step(token, pos, k, v) -> logits`."""
    import torch

    layers, heads, dim = SHAPE
    k = [torch.zeros(1, heads, slots, dim, dtype=torch.bfloat16) for _ in range(layers)]
    v = [torch.zeros(1, heads, slots, dim, dtype=torch.bfloat16) for _ in range(layers)]
    token, out = torch.tensor([[1]]), []
    with torch.no_grad():
        for i in range(n):
            if i == 1:
                start = time.perf_counter()
            token = step(token, torch.full((1, 1), i), k, v).argmax(-1).view(1, 1)
            out.append(int(token))
    return {"tokens": out, "tok_s": (n - 1) / (time.perf_counter() - start)}


def run_package(path: str, slots: int, n: int) -> dict:
    import torch

    loader = torch._C._aoti.AOTIModelPackageLoader(path, "model", False, 1, -1)
    result = decode(lambda t, p, k, v: loader.run([t, p, *k, *v])[0], slots, n)
    return {**result, "compiler_imported": [m for m in ("torch._dynamo", "sympy", "torch._inductor.compile_fx")
                                            if m in sys.modules]}


def run_eager(slots: int, n: int, checkpoint=None) -> dict:
    import torch

    import runtime
    import weights
    from kv_cache import StaticKVCache

    model, _ = weights.load_for_inference(checkpoint, "cpu", torch.bfloat16)
    template = StaticKVCache.for_model(model, 1, slots)

    def step(token, pos, k, v):
        template.k, template.v = k, v
        return runtime.decode_one(model, template, token, pos)

    return decode(step, slots, n)


def child(args: list) -> tuple:
    """(the JSON a part prints, its peak RSS in MiB) from a fresh process."""
    proc = subprocess.Popen([sys.executable, __file__, *args], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    if status != 0:
        raise SystemExit(f"{' '.join(args)} failed")
    return json.loads(out.strip().splitlines()[-1]) if out.strip() else {}, usage.ru_maxrss / 1024


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--slots", type=int, default=256)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--checkpoint", default=None, help="a GGUF of the embedded model's shapes (default: the embedded one)")
    p.add_argument("--part", choices=["export", "package", "eager", "bare"], help=argparse.SUPPRESS)
    p.add_argument("--path", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.part:
        result = {"export": lambda: export(args.path, args.slots, args.checkpoint),
                  "package": lambda: run_package(args.path, args.slots, args.tokens),
                  "eager": lambda: run_eager(args.slots, args.tokens, args.checkpoint), "bare": lambda: {}}[args.part]()
        print(json.dumps(result))
        return
    import torch

    path = os.path.join(tempfile.mkdtemp(prefix="aoti-decode-"), "step.pt2")
    common = ["--slots", str(args.slots), "--tokens", str(args.tokens), "--path", path]
    common += ["--checkpoint", args.checkpoint] if args.checkpoint else []
    made, compile_rss = child(["--part", "export", *common])
    (pkg, pkg_rss), (eager, eager_rss), (_, bare) = (child(["--part", part, *common]) for part in ("package", "eager", "bare"))
    print(f"CPU capability {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads, "
          f"{args.slots} KV slots, {args.tokens} greedy tokens; bare `import torch` peak RSS {bare:.0f} MiB")
    print(f"package: compiled in {made['compile_s']:.0f} s (that process's peak RSS {compile_rss:.0f} MiB), "
          f"{made['package_mib']:.1f} MiB on disk\n")
    print("| runner | decode tok/s | peak RSS MiB | RSS - bare torch MiB | compiler imported | greedy tokens equal to eager |")
    print("|---|---|---|---|---|---|")
    same = sum(a == b for a, b in zip(pkg["tokens"], eager["tokens"]))
    print(f"| AOTInductor package (C++ loader) | {pkg['tok_s']:.1f} | {pkg_rss:.0f} | {pkg_rss - bare:.0f} | "
          f"{', '.join(pkg['compiler_imported']) or 'no'} | {same}/{args.tokens} |")
    print(f"| eager (generate.py's model) | {eager['tok_s']:.1f} | {eager_rss:.0f} | {eager_rss - bare:.0f} | no | - |")


if __name__ == "__main__":
    main()
