"""generate.py's speculation on its default path against plain decoding on the same path, with HF
transformers' prompt lookup beside them: does turning --prompt_lookup on keep its gain?

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/bench_spec_generate.py [--k 3 4] [--rounds 3]
        [--weights int4 bf16] [--no_hf]   # ~10 min on 2 cores, packages built in untimed runs

Each measurement is one generate.py process (`--json`, greedy, 128 new tokens, EOS ignored) on the
embedded SmolLM2-135M, default flags (`--compile auto`: the decode package and, speculating, a
verify package of 1 + k tokens, speedups/aot.py): plain, then `--prompt_lookup 3` at each k, runs
interleaved, the median of --rounds shown. Weights: "int4" is the embedded file at its own bits
(the default), "bf16" the same weights dequantized (`--dequantize`). Prompts: bench_spec_engine's
quoting prompts (three passages of data/declaration.txt to repeat word for word, and the code file
to repeat with a name changed). The table gives tokens/s (generate.py's own, after the first
token), the speed-up over plain, acceptance (kept / drafted), tokens per round, and whether the
tokens equal plain decoding's (in bf16 a verify step rounds differently from one-token steps, so
a near-tie can part them). HF: `generate` plain and with `prompt_lookup_num_tokens` = each k on
the bf16 weights, same prompts, in this process.
"""

import argparse
import json
import os
import random
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

from bench_spec_engine import hf_batch1, quoting_texts

NEW = 128


def generate(text: str, flags: list) -> dict:
    """One generate.py run -> its JSON line (tokens, stats)."""
    argv = [sys.executable, "generate.py", "--prompt", text, "--max_new_tokens", str(NEW)]
    argv += ["--temperature", "0", "--ignore_eos", "--json", "--compile", "auto", *flags]
    p = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"generate.py {' '.join(flags)} failed:\n{p.stderr[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def measure(texts: list, weights: list, ks: list, rounds: int) -> list:
    """Rows of the table: (weights, prompt, mode, tok/s, speed-up, acceptance, tokens/round,
    equal to plain)."""
    rows = []
    for form in weights:
        base = ["--dequantize"] if form == "bf16" else []
        modes = {"plain": base} | {
            f"prompt lookup k={k}": base + ["--prompt_lookup", "3", "--speculate_k", str(k)]
            for k in ks
        }
        for i, text in enumerate(texts):
            for flags in modes.values():  # untimed: builds any package not yet built
                generate(text, flags)
            runs = {
                mode: [generate(text, flags) for _ in range(rounds)]
                for mode, flags in modes.items()
            }
            plain = statistics.median([r["stats"]["tokens_per_s"] for r in runs["plain"]])
            for mode, out in runs.items():
                tps = statistics.median([r["stats"]["tokens_per_s"] for r in out])
                stats = out[0]["stats"]
                rows.append(
                    (
                        form,
                        i,
                        mode,
                        tps,
                        tps / plain,
                        stats.get("acceptance_rate"),
                        stats.get("tokens_per_round", 1.0),
                        out[0]["tokens"] == runs["plain"][0]["tokens"],
                    )
                )
            print(f"  {form} prompt {i}: done", file=sys.stderr, flush=True)
    return rows


def hf_rows(texts: list, ks: list, rounds: int) -> list:
    """HF generate on the bf16 weights: (prompt, mode, tok/s, speed-up) per prompt and k."""
    import tempfile

    import torch
    from transformers import AutoModelForCausalLM

    from formats import hf_folder, weights
    from formats.tokenizer import load_tokenizer

    model, info = weights.load(None, dtype=torch.bfloat16, dequantize=True)
    tok = load_tokenizer(info.source)
    folder = hf_folder.save_hf_folder(model, tempfile.mkdtemp(prefix="smollm2-hf-"))
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16).eval()
    rows = []
    for i, text in enumerate(texts):
        speed = hf_batch1(hf, tok.encode(text), *ks, rounds=rounds)
        for k, tps in zip([None, *ks], speed):
            rows.append((i, "plain" if k is None else f"prompt lookup k={k}", tps, tps / speed[0]))
    return rows


def main():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--k", type=int, nargs="+", default=[3, 4])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--weights", nargs="+", default=["int4", "bf16"], choices=["int4", "bf16"])
    p.add_argument("--prompts", type=int, default=4, help="the first N quoting prompts")
    p.add_argument("--no_hf", action="store_true")
    args = p.parse_args()
    with open(os.path.join(ROOT, "data", "declaration.txt")) as f:
        words = f.read().split()
    texts = quoting_texts(words, args.prompts, random.Random(0))
    rows = measure(texts, args.weights, args.k, args.rounds)
    print(
        "| weights | prompt | mode | tok/s | speed-up | acceptance | tokens/round | same as plain |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for form, i, mode, tps, up, acc, tpr, same in rows:
        acc = "" if acc is None else f"{acc:.2f}"
        same = "yes" if same else "no"
        print(f"| {form} | {i} | {mode} | {tps:.1f} | {up:.2f}x | {acc} | {tpr:.2f} | {same} |")
    for form in args.weights:
        for mode in sorted({r[2] for r in rows if r[2] != "plain"}):
            ups = [r[4] for r in rows if r[0] == form and r[2] == mode]
            mean = statistics.geometric_mean(ups)
            print(f"{form}, {mode}: geometric mean speed-up {mean:.2f}x over {len(ups)} prompts")
    if not args.no_hf:
        print("\nHF transformers generate, bf16 weights, batch 1:")
        print("| prompt | mode | tok/s | speed-up |\n|---|---|---|---|")
        for i, mode, tps, up in hf_rows(texts, args.k, args.rounds):
            print(f"| {i} | {mode} | {tps:.1f} | {up:.2f}x |")


if __name__ == "__main__":
    main()
