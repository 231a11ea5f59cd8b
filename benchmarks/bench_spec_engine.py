"""Speculation inside continuous batching (prompt lookup, engine.py) against the same engine
without it, and HF transformers' own prompt lookup at batch 1, in one process.

    .venv/bin/python benchmarks/bench_spec_engine.py [--dtype bfloat16] [--compile | --aot]
        [--k 4] [--concurrency 1 2 4 8 16 32] [--max_rows 64]  # ~10 min eager on 2 cores

Workloads (greedy, 128 new tokens each, EOS ignored; the embedded SmolLM2-135M):
  quoting    prompts that contain most of their answer: a passage of data/declaration.txt (60-200
             words) followed by "The passage again, word for word:" and its first words; every
             fourth one a code file to repeat with a name changed
  free text  windows of the same text (32-256 tokens) to continue
For each concurrency c, c requests are added at once and stepped to the end, speculation off and on,
rounds interleaved (the median of --rounds). The table gives output tokens/s over the run, the
speed-up, the acceptance rate (kept / drafted), the mean tokens a drafted row gained per step, the
speed-up those predict from one step's measured cost (a step of c rows each verifying k drafts that
are all rejected, over a plain step of c rows), and how many requests' tokens equal the run without
speculation. --max_rows sets PromptLookup's cut-off (speculation off for a step with more decoding
rows); 64 keeps it on everywhere, to find where it stops paying. --draft int8|int4 speculates with a
draft model instead (speedups/draft_model.py): a quantized copy of the target (group 64, head
quantized), as a smaller checkpoint with the same vocabulary would be. --profile instead times a
plain step and a verify step (every row k drafts) of c quoting requests and prints torch.profiler's
top ops of each: where a verify step's cost goes.
"""

import argparse
import os
import random
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from bench_serving import corpus, window
from bench_speculative import CODE

import quantize
import runtime
from engine import Engine, Finished, RequestParams
from formats import fuse_layers, hf_folder, weights
from formats.tokenizer import load_tokenizer
from speedups.draft_model import DraftModel
from speedups.prompt_lookup import PromptLookup

NEW = 128


def quoting(tok, words, count, rng):
    """quoting_texts, encoded."""
    return [tok.encode(text) for text in quoting_texts(words, count, rng)]


def quoting_texts(words, count, rng):
    """Prompts whose answer is mostly in them: a passage to repeat word for word, or a code file."""
    prompts = []
    for i in range(count):
        if i % 4 == 3:
            text = CODE + (
                "# The same three functions again, with `result` renamed to `out`:\ndef add(a, "
                "b):\n"
            )
        else:
            start, n = rng.randrange(len(words) - 200), rng.randint(60, 200)
            passage = " ".join(words[start : start + n])
            text = (
                f"Passage:\n{passage}\n\nThe passage again, word for word:\n"
                f"{' '.join(words[start : start + 4])}"
            )
        prompts.append(text)
    return prompts


def free_text(ids, count, rng):
    return [window(ids, rng.randint(32, 256), rng) for _ in range(count)]


class Rejected:
    """k drafts per decoding row that are never kept (token 0): one verification step's cost."""

    def __init__(self, k):
        self.k = k

    def propose(self, seqs, max_model_len):
        for s in seqs:
            s.draft = [0] * self.k if len(s.tokens) - s.num_computed == 1 else []


class Counted:
    """A proposer, counting the rows that drafted (each: a row-step that verified drafts)."""

    def __init__(self, proposer):
        self.proposer, self.k, self.rows = proposer, proposer.k, 0

    def propose(self, seqs, max_model_len):
        self.proposer.propose(seqs, max_model_len)
        self.rows += sum(1 for s in seqs if s.draft)


def run(model, prompts, speculate, compile):
    """-> (seconds, outputs, engine metrics, seconds per decode step). compile: False, True
    (torch.compile) or a dict, batch.py's default: the ahead-of-time packages (decode and verify
    steps) for a model loaded as the dict says."""
    engine = Engine.for_model(
        model, num_blocks=4000, block_size=16, speculate=speculate, compile=compile is True
    )
    if isinstance(compile, dict):
        from speedups import aot

        verify = 1 + speculate.k if speculate else 0
        engine.decode_fn = aot.decode_step(model, engine.cache, compile, verify=verify)
    params = RequestParams(max_new_tokens=NEW, temperature=0.0, ignore_eos=True)
    ids, done, decode_s, decode_steps = [engine.add_request(p, params) for p in prompts], {}, 0.0, 0
    start = time.perf_counter()
    while engine.has_unfinished():
        prefilling = (
            any(len(s.tokens) - s.num_computed > 1 for s in engine.scheduler.running)
            or engine.scheduler.waiting
        )
        t = time.perf_counter()
        done.update((e.request_id, e.request) for e in engine.step() if isinstance(e, Finished))
        if not prefilling:
            decode_s, decode_steps = decode_s + time.perf_counter() - t, decode_steps + 1
    return (
        time.perf_counter() - start,
        [done[i].seqs[0].output for i in ids],
        engine.metrics(),
        decode_s / max(decode_steps, 1),
    )


def mode(args) -> str:
    return "ahead-of-time packages" if args.aot else "torch.compile" if args.compile else "eager"


def median(xs):
    return sorted(xs)[len(xs) // 2]


def quantized_copy(mode):
    """A draft model: the embedded model again, quantized (int8 or int4, group 64, head too)."""
    draft, _ = weights.load(None, dtype=torch.bfloat16, dequantize=True)
    quantize.quantize_model(draft, mode, 64, head=True)
    return draft


def measure(model, prompts, k, max_rows, min_n, compile, rounds, draft=None):
    """Off and on, rounds interleaved -> a table row's numbers."""
    off, on = [], []
    proposer = (
        (lambda: DraftModel(draft, model, k, 4000, 16, max_rows))
        if draft
        else (lambda: PromptLookup(k=k, min_n=min_n, max_n=max(3, min_n), max_rows=max_rows))
    )
    counted = Counted(proposer())
    if compile:  # every graph these runs need, compiled before any is timed
        [run(model, prompts, p, compile) for p in (None, Rejected(k), proposer())]
    for _ in range(rounds):
        off.append(run(model, prompts, None, compile))
        counted.proposer = (
            proposer()
        )  # a fresh one per engine (a draft's pool follows one engine's block ids)
        on.append(run(model, prompts, counted, compile))
    off_s, on_s = median([r[0] for r in off]), median([r[0] for r in on])
    kept, drafted = (
        sum(r[2][key] for r in on) for key in ("draft_tokens_accepted", "draft_tokens")
    )
    alpha = kept / max(drafted, 1)
    cost = run(model, prompts, Rejected(k), compile)[3] / median(
        [r[3] for r in off]
    )  # c: a verify step / a plain one
    gain = 1 + kept / max(counted.rows, 1)  # tokens per drafted row-step
    equal = sum(a == b for a, b in zip(off[0][1], on[0][1]))
    return off_s, on_s, alpha, gain, gain / cost, cost, equal


def profile_steps(model, prompts, k, compile):
    """A plain and a verify step of `prompts` decoding together: median ms of 10, then the top ops
    of 5."""
    for speculate in (None, Rejected(k)):
        engine = Engine.for_model(
            model, num_blocks=4000, block_size=16, speculate=speculate, compile=compile is True
        )
        for p in prompts:
            engine.add_request(
                p, RequestParams(max_new_tokens=NEW, temperature=0.0, ignore_eos=True)
            )
        while (
            any(len(s.tokens) - s.num_computed > 1 for s in engine.scheduler.running)
            or engine.scheduler.waiting
        ):
            engine.step()
        times = []
        for _ in range(13):
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        with torch.profiler.profile() as prof:
            for _ in range(5):
                engine.step()
        print(
            f"\n{'verify' if speculate else 'plain'} step, {len(prompts)} rows: "
            f"{1e3 * median(times[3:]):.1f} ms "
            f"(median of 10); torch.profiler over 5 steps:"
        )
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=6))


def hf_batch1(hf_model, prompt, *ks, rounds=3):
    """HF generate at batch 1, greedy, plain and with its prompt lookup of each k -> tokens/s of
    each (plain first)."""
    out = []
    for lookup in (None, *ks):
        times = []
        for _ in range(rounds):
            start = time.perf_counter()
            with torch.no_grad():
                hf_model.generate(
                    torch.tensor([prompt]),
                    max_new_tokens=NEW,
                    min_new_tokens=NEW,
                    do_sample=False,
                    pad_token_id=0,
                    prompt_lookup_num_tokens=lookup,
                )
            times.append(time.perf_counter() - start)
        out.append(NEW / median(times))
    return out


def main():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--dtype", default="bfloat16", choices=list(runtime.DTYPES))
    p.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile's decode and verify steps (--compile jit)",
    )
    p.add_argument(
        "--aot",
        action="store_true",
        help="batch.py's default: the ahead-of-time packages' decode and verify steps",
    )
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--max_rows", type=int, default=64)
    p.add_argument("--prompt_lookup_min", type=int, default=1)
    p.add_argument(
        "--rounds", type=int, default=3, help="runs of each, interleaved (the median is shown)"
    )
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    p.add_argument(
        "--workloads", nargs="+", default=["quoting", "free"], choices=["quoting", "free"]
    )
    p.add_argument("--no_hf", action="store_true")
    p.add_argument(
        "--draft",
        choices=["int8", "int4"],
        default=None,
        help="a quantized copy as the draft model, not prompt lookup",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="only profile a plain and a verify step at each concurrency",
    )
    args = p.parse_args()

    model, info = weights.load(None, dtype=runtime.DTYPES[args.dtype], dequantize=True)
    if args.aot:  # how the packages' child loads the same model (fused as below)
        args.compile = dict(checkpoint=None, dtype=args.dtype, quantize=None, dequantize=True)
    tok = load_tokenizer(info.source)
    with open(os.path.join(os.path.dirname(HERE), "data", "declaration.txt")) as f:
        words = f.read().split()
    ids, rng = corpus(tok), random.Random(0)
    work = {
        "quoting": quoting(tok, words, max(args.concurrency), rng),
        "free": free_text(ids, max(args.concurrency), rng),
    }
    if not args.no_hf:
        import tempfile

        from transformers import AutoModelForCausalLM

        folder = hf_folder.save_hf_folder(model, tempfile.mkdtemp(prefix="smollm2-hf-"))
        hf_model = AutoModelForCausalLM.from_pretrained(
            str(folder), dtype=runtime.DTYPES[args.dtype]
        ).eval()
        plain, lookup = hf_batch1(hf_model, work["quoting"][0], args.k)
        print(
            f"HF transformers generate, batch 1, quoting prompt 0: {plain:.1f} tok/s plain, "
            f"{lookup:.1f} tok/s with prompt_lookup_num_tokens={args.k} ({lookup / plain:.2f}x)"
        )
        del hf_model
    fuse_layers.fuse_projections(model)
    if args.profile:
        for c in args.concurrency:
            if args.compile:  # its graphs, before any step is timed
                [run(model, work["quoting"][:c], p, True) for p in (None, Rejected(args.k))]
            profile_steps(model, work["quoting"][:c], args.k, args.compile)
        return
    run(model, work["quoting"][:2], PromptLookup(k=args.k), False)  # warm-up
    print(
        f"# {runtime.cpu_capability()} | torch {torch.__version__} | "
        f"{torch.get_num_threads()} threads | "
        f"SmolLM2-135M {args.dtype} | {mode(args)} | "
        f"k={args.k} | max_rows={args.max_rows} | "
        + (
            f"draft model: an {args.draft} copy"
            if args.draft
            else f"prompt_lookup_min={args.prompt_lookup_min}"
        )
    )
    print(
        "\n| workload | requests | off tok/s | on tok/s | speed-up | acceptance "
        "| tokens per drafted row-step "
        "| predicted | verify cost c | equal to off |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    draft = quantized_copy(args.draft) if args.draft else None
    for name in args.workloads:
        for c in args.concurrency:
            off_s, on_s, alpha, gain, pred, cost, equal = measure(
                model,
                work[name][:c],
                args.k,
                args.max_rows,
                args.prompt_lookup_min,
                args.compile,
                args.rounds,
                draft,
            )
            print(
                f"| {name} | {c} | {c * NEW / off_s:.1f} | {c * NEW / on_s:.1f} | "
                f"{off_s / on_s:.2f}x | {alpha:.2f} | "
                f"{gain:.2f} | {pred:.2f}x | {cost:.2f} | {equal}/{c} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
