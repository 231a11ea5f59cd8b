"""The engine (engine.py's continuous batching on the paged cache) against HF transformers'
batched generation, float32 and bfloat16, in one process.

    .venv/bin/python benchmarks/bench_engine.py [--dtypes float32 bfloat16]
                                                [--workloads 64x64 mixed]

Workloads (prompts are windows of data/declaration.txt, fixed seeds; greedy; every request
produces exactly its output length, EOS ignored):
  64x64  64 requests of 64 new tokens, prompts of 32-256 tokens
  mixed  bench_serving.py's throughput workload: 64 requests, prompts 50-500 tokens, outputs 32-128
Runners, in turn: engine.Engine with every request added at once (eager steps, q/k/v and
gate/up fused as batch.py and serve.py load it); HF `generate` in left-padded static batches of
16 (each batch runs until its longest request is done; only the tokens asked for are counted);
HF `generate_batch`'s manager (transformers' own continuous batching on its paged cache), one
request per prompt with its own max_new_tokens. Output tokens/s over the whole run, prefill
included; "equal to HF static" counts requests whose greedy tokens equal HF's (bf16 near-ties can
break differently; float32 should agree).
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

from bench_serving import corpus, run_hf_static, window

import runtime
from engine import Engine, Finished, RequestParams
from formats import fuse_layers, hf_folder, weights
from formats.tokenizer import load_tokenizer


def workload(name, ids):
    rng = random.Random(0)
    if name == "64x64":
        return [window(ids, rng.randint(32, 256), rng) for _ in range(64)], [64] * 64
    lengths = [rng.randint(50, 500) for _ in range(64)]  # bench_serving.py's throughput workload
    news = [rng.randint(32, 128) for _ in range(64)]
    return [window(ids, n, rng) for n in lengths], news


def run_ours(model, prompts, news):
    engine = Engine.for_model(model, num_blocks=3000, block_size=16)
    ids = [
        engine.add_request(p, RequestParams(max_new_tokens=n, temperature=0.0, ignore_eos=True))
        for p, n in zip(prompts, news)
    ]
    start = time.perf_counter()
    done = {}
    while engine.has_unfinished():
        done.update((e.request_id, e.request) for e in engine.step() if isinstance(e, Finished))
    elapsed = time.perf_counter() - start
    return elapsed, [done[i].seqs[0].output for i in ids], engine.scheduler.stats["steps"]


def run_hf_continuous(hf, prompts, news):
    from transformers import GenerationConfig

    cfg = GenerationConfig(
        do_sample=False, max_new_tokens=max(news), eos_token_id=-1, pad_token_id=0
    )
    start = time.perf_counter()
    with hf.continuous_batching_context_manager(
        generation_config=cfg, block=True, timeout=5
    ) as manager:
        rids = [
            manager.add_request(p, max_new_tokens=n, eos_token_id=-1) for p, n in zip(prompts, news)
        ]
        results = {}
        while len(results) < len(rids):
            r = manager.get_result(timeout=1)
            if r is not None and r.is_finished():
                results[r.request_id] = r.generated_tokens
            elif r is None and not manager.is_running():
                raise RuntimeError("transformers' continuous batching stopped before finishing")
    return time.perf_counter() - start, [results[i] for i in rids]


def main():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--dtypes", nargs="+", default=["float32", "bfloat16"], choices=list(runtime.DTYPES)
    )
    p.add_argument("--workloads", nargs="+", default=["64x64", "mixed"], choices=["64x64", "mixed"])
    args = p.parse_args()
    import tempfile

    from transformers import AutoModelForCausalLM

    model, info = weights.load(None, dtype=torch.float32, dequantize=True)
    ids = corpus(load_tokenizer(info.source))
    folder = hf_folder.save_hf_folder(model, tempfile.mkdtemp(prefix="smollm2-hf-"))
    del model
    print(
        f"# {runtime.cpu_capability()} | torch {torch.__version__} | "
        f"{torch.get_num_threads()} threads | SmolLM2-135M"
    )
    print(
        "\n| workload | dtype | runner | output tok/s | wall s | vs HF static "
        "| vs HF generate_batch | equal to HF static |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for dtype in args.dtypes:
        ours_model, _ = weights.load(None, dtype=runtime.DTYPES[dtype], dequantize=True)
        fuse_layers.fuse_projections(ours_model)
        hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=runtime.DTYPES[dtype]).eval()
        run_hf_static(hf, [ids[:20]] * 2, [4, 4])  # warm-up
        for name in args.workloads:
            prompts, news = workload(name, ids)
            results = {}
            static = run_hf_static(hf, prompts, news)
            results["HF generate, static batches of 16"] = static["elapsed"], static["outputs"]
            results["HF generate_batch (continuous)"] = run_hf_continuous(hf, prompts, news)
            secs, outs, steps = run_ours(ours_model, prompts, news)
            results[f"ours: engine.Engine ({steps} steps)"] = secs, outs
            total = sum(news)
            static_s, static_out = results["HF generate, static batches of 16"][:2]
            cont_s = results["HF generate_batch (continuous)"][0]
            for runner, (secs, outs) in results.items():
                equal = sum(a == b for a, b in zip(outs, static_out))
                print(
                    f"| {name} | {dtype} | {runner} | {total / secs:.1f} | {secs:.1f} | "
                    f"{static_s / secs:.2f}x | "
                    f"{cont_s / secs:.2f}x | {equal}/{len(prompts)} |",
                    flush=True,
                )
        del hf, ours_model


if __name__ == "__main__":
    main()
