"""batch.py in one process against batch.py under torchrun (server/tp_engine.py), on the same
requests: throughput, and what rank 0's per-step broadcast of the step (two int64 tensors) costs.
The outputs are checked equal (greedy, float32).

    .venv/bin/python benchmarks/bench_tp_engine.py                  # the embedded model, 3 ranks
    .venv/bin/python benchmarks/bench_tp_engine.py --ranks 2 --checkpoint HF_FOLDER

On CPU the ranks share the machine's cores (torchrun gives each one OpenMP thread), and every
layer's two all-reduces go through gloo: tensor parallelism is for models that do not fit one
device, not for speed here. The broadcast's figure is rank 0's time in it per step, which
includes waiting for the slowest rank to be ready; the probe times the two broadcasts alone.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = [
    "The capital of France is",
    "Once upon a time",
    "The quick brown fox",
    "In the beginning",
    "The best way to learn is",
    "Water boils at",
    "A haiku about the sea:",
    "The history of Rome",
]


def run(launcher, args, requests_path):
    start = time.perf_counter()
    out = subprocess.run(
        launcher + ["batch.py", "--requests", requests_path, "--compile", "off", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - start
    if out.returncode:
        sys.exit(out.stderr[-3000:])
    tokens = {
        json.loads(line)["id"]: json.loads(line)["tokens"] for line in out.stdout.splitlines()
    }
    rate = float(re.search(r"([\d.]+) output tokens/s", out.stderr).group(1))
    steps = re.search(r"(\d+) steps broadcast to \d+ ranks, (\d+) us each", out.stderr)
    return tokens, rate, wall, steps and (int(steps.group(1)), int(steps.group(2)))


def probe(repeats: int = 2000):
    """Under torchrun: the two broadcasts of a 16-row decode step alone (ranks in step after a
    barrier), as rank 0 sends them; prints microseconds per step on rank 0."""
    import torch
    import torch.distributed as dist

    sys.path.insert(0, ROOT)
    from server import tp_link

    dist.init_process_group("gloo")
    tokens = torch.arange(16).view(1, 16)
    groups = [(16, 1, torch.arange(16 * 4).view(16, 4))]
    header, payload = tp_link.pack([], groups, tokens, tokens, torch.arange(16))
    dist.barrier()
    start = time.perf_counter()
    for _ in range(repeats):
        dist.broadcast(header, 0)
        dist.broadcast(payload, 0)
    dist.barrier()
    if dist.get_rank() == 0:
        print(
            f"probe: {1e6 * (time.perf_counter() - start) / repeats:.0f} us per step "
            f"({payload.numel()} int64)"
        )
    dist.destroy_process_group()


def main():
    if "--probe" in sys.argv:
        return probe()
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--checkpoint", default=None)
    p.add_argument("--ranks", type=int, default=3)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--max_new_tokens", type=int, default=32)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "requests.jsonl")
        with open(path, "w") as f:
            for i in range(args.requests):
                f.write(
                    json.dumps(
                        {
                            "id": i,
                            "prompt": PROMPTS[i % len(PROMPTS)] + f" ({i})",
                            "temperature": 0,
                            "max_new_tokens": args.max_new_tokens,
                            "ignore_eos": True,
                        }
                    )
                    + "\n"
                )
        # --dequantize: ranks shard float weights (tp.py), so one process runs the same float layers
        flags = ["--dtype", "float32", "--dequantize"] + (
            ["--checkpoint", args.checkpoint] if args.checkpoint else []
        )
        alone, rate1, wall1, _ = run([sys.executable], flags, path)
        torchrun = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(args.ranks),
        ]
        ranked, rate_n, wall_n, (steps, us) = run(torchrun, flags, path)
        probed = subprocess.run(
            torchrun + [os.path.abspath(__file__), "--probe"], capture_output=True, text=True
        )
        alone_us = re.search(r"probe: (\d+) us", probed.stdout).group(1)
    print(
        f"{args.requests} requests x {args.max_new_tokens} greedy tokens, float32; "
        f"outputs equal: {ranked == alone}"
    )
    print("| run | output tokens/s | wall s (load included) | steps | broadcast us per step |")
    print("|---|---|---|---|---|")
    print(f"| one process | {rate1:.1f} | {wall1:.1f} | | |")
    print(
        f"| {args.ranks} ranks (gloo) | {rate_n:.1f} | {wall_n:.1f} | {steps} | "
        f"{us} (alone: {alone_us}) |"
    )
    print(
        "(in the run, rank 0's broadcast waits for the slowest rank; alone: the two broadcasts "
        "of a 16-row decode step, ranks in step)"
    )


if __name__ == "__main__":
    main()
