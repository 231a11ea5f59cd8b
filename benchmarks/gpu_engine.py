"""The engine's GPU path checked, then timed (gpu_check.py's engine sections): decode steps
replayed as CUDA graphs (speedups/cuda_graphs.py) equal eager steps at every batch bucket, in
float32 and bf16, over the gathered reference and over FlexAttention in place
(speedups/paged_flex.py), with graph launches counted per step; then nano-vllm's workload (random
prompts of 100-1024 tokens, outputs of 100-1024, EOS ignored) on random weights of Qwen3-0.6B's
and a 7B shape, against HF transformers' continuous batching (`generate_batch`'s manager) on
the same weights in the same run.

    python benchmarks/gpu_check.py --device cuda --out $OUT   # runs both sections
    python benchmarks/gpu_engine.py --device cpu --tiny       # alone, tiny shapes (the suite's)

On CPU the capture is a stand-in that reruns the step on the graph's static buffers (what a
replay computes, without the launch), so the buffers and keys are checked there too.
"""

import argparse
import json
import random
import statistics
import time

import torch
from bench_engine import run_hf_continuous
from gpu_check import SHAPES, TINY, random_model

import quantize
from engine import Engine, RequestParams, Token
from formats.hf_folder import hf_config, hf_state_dict
from model import ModelConfig
from speedups import paged_flex
from speedups.cuda_graphs import Rerun, for_engine

QWEN3_06B = ModelConfig(
    vocab_size=151936,
    dim=1024,
    n_layers=28,
    n_heads=16,
    n_kv_heads=8,
    head_dim=128,
    intermediate_size=3072,
    norm_eps=1e-6,
    rope_theta=1000000.0,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
    qk_norm=True,
)
TINY_BUCKETS, BUCKETS = (1, 3, 8), (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


def engine_for(model, reader: str, graphs: str, max_num_seqs: int, num_blocks: int = 1024):
    """graphs: "" (eager steps), "captured" (CUDA graphs on a GPU, the stand-in on CPU) or "rerun"
    (the stand-in: the graph path's compiled layout and static buffers, every step run eagerly:
    the twin a real capture must equal, on the same row padding and GEMM shapes)."""
    cuda = model.norm.weight.device.type == "cuda"
    engine = Engine.for_model(
        model,
        num_blocks=num_blocks,
        block_size=16,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=1024,
    )
    if reader == "flex" and not cuda:  # eager FlexAttention: CPU's compiled one is slower
        engine.cache.read_in_place(paged_flex.PagedFlex(compiled=False, cuda=False))
    else:
        paged_flex.choose(engine.cache, reader)
    if graphs:
        rerun = graphs == "rerun" or not cuda
        engine.decode_fn = for_engine(engine, Rerun() if rerun else None)
    return engine


def graph_launches(engine) -> int:
    """cudaGraphLaunch calls in one engine step (torch.profiler)."""
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        engine.step()
        torch.cuda.synchronize()
    return sum(e.count for e in prof.key_averages() if e.key == "cudaGraphLaunch")


def share_equal(a, b) -> float:
    return sum(x["tokens"] == y["tokens"] for x, y in zip(a, b)) / len(a)


def bucket_case(model, reader, prompts, width, checks, name):
    """One bucket: captured graphs against their twin (on CPU: eager steps); the launches of one
    decode-only step of every row on a GPU. -> the twin's results."""
    cuda = model.norm.weight.device.type == "cuda"
    params = RequestParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    twin = engine_for(model, reader, "rerun" if cuda else "", width).run_batch(prompts, params)
    engine = engine_for(model, reader, "captured", width)
    checks[f"{name}: graph == eager (share of requests)"] = share_equal(
        engine.run_batch(prompts, params), twin
    )
    s = engine.decode_fn.stats
    checks[f"{name}: replays, eager steps"] = f"{s['replays']}, {s['eager_steps']}"
    if cuda:
        long = RequestParams(max_new_tokens=64, temperature=0.0, ignore_eos=True)
        for p in prompts:
            engine.add_request(p, long)
        for _ in range(4):  # the prefill chunks, then decode-only steps
            engine.step()
        checks[f"{name}: cudaGraphLaunch in one decode step"] = graph_launches(engine)
    return twin


def check_buckets(device, tiny, checks, deadline=None):
    """Per dtype, reader and bucket: the graph engine's greedy tokens against its twin's on the
    same requests (distinct prompts, one per row of the bucket, all decoding together);
    FlexAttention's against the gather's; then int8 and int4 weights at the widest bucket. A
    bucket begun after the deadline (time.time()) is skipped, so saying so."""
    args = TINY if tiny else SHAPES["smollm2-135m"]
    buckets = TINY_BUCKETS if tiny else BUCKETS
    rng = random.Random(0)
    for dtype in (torch.float32, torch.bfloat16):
        model = random_model(args, device, dtype)
        for rows in buckets:
            if deadline is not None and time.time() > deadline:
                checks[f"{str(dtype)[6:]} {rows} rows"] = "skipped: past the time box"
                continue
            prompts = [
                [rng.randrange(args.vocab_size) for _ in range(rng.randint(5, 40))]
                for _ in range(rows)
            ]
            done = {}
            for reader in ("gather", "flex"):
                name = f"{str(dtype)[6:]} {reader} {rows} rows"
                done[reader] = bucket_case(model, reader, prompts, max(buckets), checks, name)
            flex_vs_gather = share_equal(done["flex"], done["gather"])
            checks[f"{str(dtype)[6:]} {rows} rows: flex == gather"] = flex_vs_gather
    for mode in ("int8", "int4"):  # the quantized kernels under the graphs, at the widest bucket
        model = random_model(args, device, torch.bfloat16, seed=1)
        quantize.quantize_model(model, mode, 64, head=True)
        rows = buckets[-1]
        prompts = [[rng.randrange(args.vocab_size) for _ in range(9 + i)] for i in range(rows)]
        bucket_case(model, "auto", prompts, rows, checks, f"{mode} auto {rows} rows")
    ok = [v for k, v in checks.items() if "graph == eager" in k]
    checks["graphs equal eager at every bucket, both dtypes"] = all(v == 1.0 for v in ok)


def nano_workload(n_requests: int, vocab: int, tiny: bool, seed=0):
    """nano-vllm's bench.py: prompts of 100-1024 random tokens, outputs of 100-1024."""
    rng = random.Random(seed)
    hi = 64 if tiny else 1024
    lo = 8 if tiny else 100
    prompts = [
        [rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n_requests)
    ]
    return prompts, [rng.randint(lo, hi) for _ in prompts]


def hf_twin(model):
    """HF transformers' model on the same weights, in memory."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = hf_config(model)
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    w = model.norm.weight
    with torch.device(w.device):
        hf = AutoModelForCausalLM.from_config(config, dtype=w.dtype, attn_implementation="sdpa")
    hf.load_state_dict(hf_state_dict(model, keep_head=True), strict=False)
    return hf.eval()


def timed_run(engine, prompts, news):
    """(seconds, output tokens, TTFT p50, time per output token p50) with every request added
    at once."""
    ids = [
        engine.add_request(p, RequestParams(max_new_tokens=n, temperature=0.0, ignore_eos=True))
        for p, n in zip(prompts, news)
    ]
    first, last, count, start = {}, {}, dict.fromkeys(ids, 0), time.perf_counter()
    while engine.has_unfinished():
        events = engine.step()
        now = time.perf_counter() - start
        for e in events:
            if isinstance(e, Token) and e.token is not None:
                first.setdefault(e.request_id, now)
                last[e.request_id], count[e.request_id] = now, count[e.request_id] + 1
    seconds = time.perf_counter() - start
    tpot = [(last[i] - first[i]) / (count[i] - 1) for i in ids if count[i] > 1]
    return seconds, sum(count.values()), statistics.median(first.values()), statistics.median(tpot)


def engine_vs_hf(device, tiny, report, n_requests, deadline=None):
    """Output tok/s, TTFT and time per output token of the engine (its GPU defaults) and HF's
    continuous batching, per shape, on the same requests; a shape begun after the deadline
    (time.time()) is skipped, so saying so."""
    shapes = {"qwen3-0.6b": QWEN3_06B, "llama2-7b": SHAPES["llama2-7b"]}
    shapes = dict(list(shapes.items())[:1]) if tiny else shapes  # (one tiny stand-in will do)
    rows = report.setdefault("engine_vs_hf", [])
    for name, args in shapes.items():
        if deadline is not None and time.time() > deadline:
            report.setdefault("skipped", []).append(f"engine_vs_hf {name}: past the time box")
            continue
        args = TINY if tiny else args
        model = random_model(args, device, torch.bfloat16)
        prompts, news = nano_workload(n_requests, args.vocab_size, tiny)
        blocks = 1 + sum(-(-(len(p) + n) // 16) for p, n in zip(prompts, news))  # no preemption
        engine = engine_for(model, "auto", "captured", 256, blocks)
        ours_s, total, ttft, tpot = timed_run(engine, prompts, news)
        hf_s, _ = run_hf_continuous(hf_twin(model), prompts, news)
        rows.append(
            {
                "shape": name + (" (tiny stand-in)" if tiny else ""),
                "requests": n_requests,
                "output_tokens": total,
                "ours_tok_s": total / ours_s,
                "hf_continuous_tok_s": sum(news) / hf_s,
                "ratio": (total / ours_s) / (sum(news) / hf_s),
                "ours_ttft_p50_s": ttft,
                "ours_time_per_output_token_p50_s": tpot,
                "graphs": engine.decode_fn.stats,
            }
        )
        del engine, model
        if device.startswith("cuda"):
            torch.cuda.empty_cache()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--requests", type=int, default=256)
    args = p.parse_args(argv)
    report = {"checks": {}}
    check_buckets(args.device, args.tiny, report["checks"], time.time() + 300)
    engine_vs_hf(args.device, args.tiny, report, 4 if args.tiny else args.requests)
    print(json.dumps(report, indent=1, default=str))
    return report


if __name__ == "__main__":
    main()
