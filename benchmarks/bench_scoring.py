"""Prompt scoring through serve.py against lm-evaluation-harness's own `hf` backend, one run, same
machine: requests/s on a multiple-choice task (lm-eval's loglikelihood requests), and how far the
two backends' per-choice log-likelihoods are apart.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/bench_scoring.py  # 64 questions x 4 choices
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/bench_scoring.py --questions 16 --hf_batch_sizes 8

The model is the embedded SmolLM2-135M, dequantized and written as an HF folder (float32
weights, its tokenizer), which both backends load. Questions are windows of data/declaration.txt
(`--question_tokens` tokens each) followed by "Answer:", with 4 short choices: every choice of a
question repeats the question, the usual shape of a multiple-choice task. lm-eval's hf backend
runs at each of --hf_batch_sizes (it sorts requests by length and pads); serve.py runs as users
run it, in its own process (`python serve.py --checkpoint FOLDER --dtype float32`), and lm-eval
talks to it with `local-completions` (token-id prompts, echo, logprobs), with and without the
prefix cache. Wall time is lm-eval's whole evaluation once its model object exists (the hf model
loaded, the server started).
"""

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import runtime
from formats import hf_folder, weights


def embedded_hf_folder(folder: str) -> str:
    """The embedded model as an HF folder: float32 safetensors, config.json, its tokenizer."""
    from transformers import AutoTokenizer

    model, _ = weights.load(None, dtype=torch.float32, dequantize=True)
    hf_folder.save_hf_folder(model, folder)
    gguf = weights.default_checkpoint()
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(folder)
    return folder


def write_task(folder: str, questions: int, question_tokens: int, seed: int = 0):
    from lm_eval.tasks import TaskManager
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    with open(os.path.join(ROOT, "data", "declaration.txt")) as f:
        ids = tok.encode(f.read())
    words = re.findall(r"[A-Za-z]+", tok.decode(ids))
    rng, docs = random.Random(seed), []
    for _ in range(questions):
        start = rng.randrange(len(ids) - question_tokens)
        text = tok.decode(ids[start : start + question_tokens]).strip()
        choices = [" ".join(rng.sample(words, rng.randint(1, 3))) for _ in range(4)]
        docs.append({"question": text + "\nAnswer:", "choices": choices, "answer": 0})
    data = os.path.join(folder, "mc.jsonl")
    with open(data, "w") as f:
        f.write("\n".join(json.dumps(d) for d in docs))
    with open(os.path.join(folder, "bench_mc.yaml"), "w") as f:
        f.write(
            "task: bench_mc\ndataset_path: json\ndataset_kwargs:\n"
            f"  data_files:\n    test: {data}\n"
            "test_split: test\noutput_type: multiple_choice\ndoc_to_text: '{{question}}'\n"
            "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{answer}}'\n"
            "metric_list:\n  - metric: acc\n"
        )
    return TaskManager(include_path=folder)


def evaluate(manager, model, model_args, batch_size=1):
    """(seconds, per-choice log-likelihoods, accuracy); the model is built before the clock
    starts."""
    import lm_eval
    from lm_eval.api.registry import get_model

    lm = get_model(model).create_from_arg_string(model_args, {"batch_size": batch_size})
    start = time.perf_counter()
    out = lm_eval.simple_evaluate(
        model=lm, tasks=["bench_mc"], task_manager=manager, log_samples=True
    )
    seconds = time.perf_counter() - start
    samples = sorted(out["samples"]["bench_mc"], key=lambda s: s["doc_id"])
    return (
        seconds,
        [float(r[0][0]) for s in samples for r in s["resps"]],
        out["results"]["bench_mc"]["acc,none"],
    )


def engine_alone(folder: str, seconds_per_request=None):
    """The same 256 requests (context + " " + choice, as lm-eval joins them) through
    engine.Engine in this process, 32 in flight: the server's work without HTTP or a client."""
    from engine import Engine, RequestParams
    from formats.tokenizer import load_tokenizer

    model, info = weights.load(folder, dtype=torch.float32)
    tok = load_tokenizer(info.source)
    with open(os.path.join(folder, "mc.jsonl")) as f:
        docs = [json.loads(line) for line in f]
    pending = [
        tok.encode(d["question"]) + tok.encode(" " + c, bos=False)
        for d in docs
        for c in d["choices"]
    ]
    engine = Engine.for_model(model, num_blocks=3000, block_size=16)
    start = time.perf_counter()
    while pending or engine.has_unfinished():
        while pending and len(engine.scheduler.waiting) + len(engine.scheduler.running) < 32:
            engine.add_request(
                pending.pop(0),
                RequestParams(max_new_tokens=1, temperature=0.0, logprobs=1, prompt_logprobs=1),
            )
        engine.step()
    return time.perf_counter() - start


def start_server(folder: str, threads: int, extra=()):
    """serve.py in its own process; returns (process, base url)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    proc = subprocess.Popen(
        [
            sys.executable,
            os.path.join(ROOT, "serve.py"),
            "--checkpoint",
            folder,
            "--dtype",
            "float32",
            "--port",
            "0",
            *extra,
        ],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    for line in proc.stderr:
        if m := re.search(r"serving on (http://\S+)", line):
            return proc, m.group(1)
    raise RuntimeError("serve.py did not start")


def main():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--questions", type=int, default=64)
    p.add_argument("--question_tokens", type=int, default=160)
    p.add_argument("--hf_batch_sizes", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument(
        "--concurrency", type=int, default=8, help="lm-eval num_concurrent against serve.py"
    )
    p.add_argument(
        "--prompts_per_request", type=int, default=4, help="lm-eval batch_size against serve.py"
    )
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    folder = embedded_hf_folder(tempfile.mkdtemp(prefix="bench-scoring-"))
    manager = write_task(folder, args.questions, args.question_tokens)
    n_requests = args.questions * 4
    print(
        f"# {runtime.cpu_capability()} | torch {torch.__version__} | {args.threads} threads | "
        f"{args.questions} questions x 4 choices = {n_requests} loglikelihood requests, "
        f"questions of {args.question_tokens} tokens"
    )
    rows, reference = [], None
    for bs in args.hf_batch_sizes:
        seconds, ll, acc = evaluate(
            manager, "hf", f"pretrained={folder},dtype=float32,device=cpu", bs
        )
        reference = reference or ll
        rows.append((f"lm-eval hf, batch_size={bs}", seconds, ll, acc))
    client = (
        f"model=bench,tokenizer={folder},tokenized_requests=True,tokenizer_backend=huggingface,"
        f"num_concurrent={args.concurrency},max_retries=1"
    )
    for label, extra in (
        ("serve.py (prefix cache)", ()),
        ("serve.py --no_prefix_caching", ("--no_prefix_caching",)),
    ):
        proc, url = start_server(folder, args.threads, extra)
        try:
            seconds, ll, acc = evaluate(
                manager,
                "local-completions",
                f"base_url={url}/v1/completions,{client}",
                args.prompts_per_request,
            )
        finally:
            proc.terminate()
            proc.wait(timeout=60)
        rows.append(
            (
                f"{label}, lm-eval local-completions, {args.concurrency} concurrent x "
                f"{args.prompts_per_request} prompts",
                seconds,
                ll,
                acc,
            )
        )
    seconds = engine_alone(folder)
    rows.append(
        ("engine.Engine alone, in process (no HTTP, no lm-eval), 32 in flight", seconds, None, None)
    )
    best_hf = min(s for name, s, _, _ in rows if name.startswith("lm-eval hf"))
    print("\n| backend | wall s | requests/s | vs best hf | max abs loglik diff vs hf | acc |")
    print("|---|---|---|---|---|---|")
    for name, seconds, ll, acc in rows:
        diff = f"{max(abs(a - b) for a, b in zip(ll, reference)):.2e}" if ll else "-"
        acc = f"{acc:.3f}" if acc is not None else "-"
        print(
            f"| {name} | {seconds:.1f} | {n_requests / seconds:.1f} | {best_hf / seconds:.2f}x | "
            f"{diff} | {acc} |"
        )


if __name__ == "__main__":
    main()
