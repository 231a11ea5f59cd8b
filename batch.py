"""Offline batch inference from a JSONL file through the continuous-batching engine (scheduler.py).

    python batch.py --requests requests.jsonl
    python batch.py --requests - < requests.jsonl      # stdin

One request per line, every field but `prompt` optional (a prompt is text, or a list of token ids):

    {"id": "a", "prompt": "The sea is", "max_new_tokens": 64, "temperature": 0.7, "top_k": 50,
     "top_p": 0.9, "seed": 1, "stop": ["\\n\\n"], "stop_token_ids": [2], "ignore_eos": false, "n": 1}

and the sampling controls of sampling.py: "min_p", "repetition_penalty", "frequency_penalty",
"presence_penalty", "logit_bias" ({"token id": bias}).

On stdout, one JSON line per request as it finishes: `id` (the line number if not given),
`tokens` (generated ids), `text`, `finish_reason` ("stop", "length"), `time_to_first_token_s`;
with n > 1, `tokens`, `text` and `finish_reason` are lists, one entry per sample. A request that
cannot run (malformed line,
bad parameters, a prompt longer than the context or than the whole KV pool) gets `{"id", "error"}`
and every other request still runs. On stderr: the KV memory plan, a progress bar, and a summary
(requests/s, output tokens/s, time to first token and per output token, peak KV blocks,
prefix-cache hit rate, preemptions).
"""
import argparse
import json
import sys
import time

from runtime import DTYPES, log, pick_device
from scheduler import Engine, RequestParams

REQUEST_KEYS = ("id", "prompt", "max_new_tokens", "temperature", "top_k", "top_p", "seed", "stop",
                "stop_token_ids", "ignore_eos", "n", "min_p", "repetition_penalty", "frequency_penalty",
                "presence_penalty", "logit_bias")


def read_line(line: str, line_no: int):
    """One JSONL line -> (id, the request object). Raises ValueError if it is not a JSON object."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"line {line_no} is not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"line {line_no} must be a JSON object, got {type(obj).__name__}")
    return obj.get("id", line_no), obj


def parse_request(obj: dict, tokenizer):
    """A request object -> (prompt ids, RequestParams). Raises ValueError naming what is wrong."""
    unknown = sorted(set(obj) - set(REQUEST_KEYS))
    if unknown:
        raise ValueError(f"unknown field(s) {unknown}; a request has {list(REQUEST_KEYS)}")
    prompt = obj.get("prompt")
    if isinstance(prompt, str):
        prompt = tokenizer.encode(prompt)
    elif not (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)):
        raise ValueError("prompt must be a string or a list of token ids")
    return prompt, RequestParams(**{k: obj[k] for k in REQUEST_KEYS[2:] if obj.get(k) is not None})


def percentile(values, q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))] if values else float("nan")


def summary(requests, failed: int, engine, elapsed: float) -> dict:
    """Throughput and latency of the finished requests, and what the KV pool went through."""
    seqs = [s for r in requests for s in r.seqs]
    ttft = [min(s.token_times[0] for s in r.seqs if s.token_times) - r.arrival
            for r in requests if any(s.token_times for s in r.seqs)]
    tpot = [(s.token_times[-1] - s.token_times[0]) / (len(s.token_times) - 1) for s in seqs if len(s.token_times) > 1]
    st = engine.stats
    return {"requests": len(requests), "failed": failed, "elapsed_s": elapsed,
            "requests_per_s": len(requests) / elapsed, "output_tokens_per_s": sum(len(s.output) for s in seqs) / elapsed,
            "ttft_mean_s": sum(ttft) / max(1, len(ttft)), "ttft_p90_s": percentile(ttft, 0.9),
            "tpot_mean_s": sum(tpot) / max(1, len(tpot)), "tpot_p90_s": percentile(tpot, 0.9),
            "peak_kv_blocks": st["peak_blocks"], "kv_blocks": engine.allocator.num_blocks - 1,
            "prefix_hit_rate": st["prompt_tokens_hit"] / st["prompt_tokens"] if st["prompt_tokens"] else 0.0,
            "preemptions": st["preemptions"], "peak_running": st["peak_running"]}


def summary_line(s: dict) -> str:
    return (f"{s['requests']} requests ({s['failed']} failed) in {s['elapsed_s']:.2f} s | "
            f"{s['requests_per_s']:.2f} requests/s | {s['output_tokens_per_s']:.1f} output tokens/s | "
            f"time to first token mean {1e3 * s['ttft_mean_s']:.0f} ms, p90 {1e3 * s['ttft_p90_s']:.0f} ms | "
            f"time per output token mean {1e3 * s['tpot_mean_s']:.1f} ms, p90 {1e3 * s['tpot_p90_s']:.1f} ms | "
            f"peak KV blocks {s['peak_kv_blocks']} of {s['kv_blocks']} | prefix-cache hit rate "
            f"{100 * s['prefix_hit_rate']:.1f}% | preemptions {s['preemptions']} | peak running {s['peak_running']}")


def parse_size(text: str) -> int:
    """'2GiB', '512MiB', '1.5GB', '1000000' -> bytes."""
    units = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "kib": 2**10, "mib": 2**20, "gib": 2**30}
    t = text.strip().lower()
    number = t.rstrip("bikmg")
    try:
        return int(float(number) * units[t[len(number):]])
    except (KeyError, ValueError):
        raise argparse.ArgumentTypeError(f"cannot read {text!r} as a size (e.g. 2GiB, 512MiB, 1GB)") from None


def add_engine_args(p: argparse.ArgumentParser):
    """The model and engine flags, shared with serve.py."""
    p.add_argument("--checkpoint", default=None, help="HF folder, .gguf file or Hub id (default: embedded SmolLM2-135M)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--compile", action="store_true", help="compile decode steps (batch padded to a few sizes)")
    p.add_argument("--quantize", default=None, choices=("int8", "int4"), help="weight-only quantization at load time (a GGUF file is dequantized first)")
    p.add_argument("--dequantize", action="store_true", help="run a GGUF file's quantized weights as --dtype (default: at the file's own bits)")
    p.add_argument("--block_size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--num_blocks", type=int, default=None, help="KV blocks in the pool (overrides --kv_cache_memory)")
    p.add_argument("--kv_cache_memory", type=parse_size, default=None,
                   help="memory for the KV pool, e.g. 2GiB (default: 20%% of free memory, at most what "
                        "max_num_seqs full contexts need)")
    p.add_argument("--max_num_seqs", type=int, default=64, help="most sequences running at once")
    p.add_argument("--max_num_batched_tokens", type=int, default=512, help="most tokens per step (the prefill chunk)")
    p.add_argument("--no_prefix_caching", action="store_true", help="do not reuse the KV of shared prompt heads")
    p.add_argument("--schedule_policy", default="fcfs", choices=("fcfs", "lpm"),
                   help="admission order: arrival, or longest cached prefix first")


def check_engine_args(p: argparse.ArgumentParser, args):
    for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")


def engine_options(args) -> dict:
    """The values of add_engine_args' flags, as load_engine's keywords."""
    names = ("checkpoint", "device", "dtype", "compile", "quantize", "dequantize", "block_size", "num_blocks", "kv_cache_memory",
             "max_num_seqs", "max_num_batched_tokens", "schedule_policy")
    return {**{n: getattr(args, n) for n in names}, "prefix_caching": not args.no_prefix_caching}


def load_engine(checkpoint=None, device=None, dtype="bfloat16", compile=False, quantize=None, block_size=16,
                num_blocks=None, kv_cache_memory=None, max_num_seqs=64, max_num_batched_tokens=512,
                schedule_policy="fcfs", prefix_caching=True, dequantize=False):
    """(Engine, tokenizer, load info) for a checkpoint; prints the memory plan."""
    import weights
    from paged import plan_blocks
    from tokenizer import load_tokenizer

    device = pick_device(device)
    model, info = weights.load_for_inference(checkpoint, device, DTYPES[dtype], quantize, dequantize=dequantize, log=log)
    tokenizer = load_tokenizer(info.source)
    num_blocks, plan = plan_blocks(model, block_size, num_blocks, kv_cache_memory,
                                   max_tokens=max_num_seqs * model.config.max_position_embeddings)
    log(f"loaded {info.source} in {info.load_s:.2f} s" + (f" (at the file's own bits: {info.kept})" if info.kept else "") + f"\n{plan}")
    engine = Engine(model, num_blocks, block_size, max_num_seqs, max_num_batched_tokens,
                    prefix_caching, schedule_policy, tokenizer.stop_ids, tokenizer, compile)
    return engine, tokenizer, info


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", required=True, help="JSONL file of requests, or - for stdin")
    add_engine_args(p)
    args = p.parse_args(argv)
    check_engine_args(p, args)
    return args


def main(argv=None) -> int:
    from tqdm import tqdm

    args = parse_args(argv)
    try:
        lines = (sys.stdin if args.requests == "-" else open(args.requests)).read().splitlines()
        engine, tokenizer, _ = load_engine(**engine_options(args))
    except (ValueError, OSError) as e:
        log(f"error: {e}")
        return 2
    start, failed, finished = time.perf_counter(), 0, []
    for line_no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        request_id = line_no
        try:
            request_id, obj = read_line(line, line_no)
            engine.add_request(*parse_request(obj, tokenizer), request_id=request_id)
        except (ValueError, TypeError) as e:  # this request fails alone
            print(json.dumps({"id": request_id, "error": str(e)}), flush=True)
            failed += 1
    bar = tqdm(total=len(engine.requests), unit="req", file=sys.stderr, disable=None)
    while engine.has_unfinished():
        engine.step()
        for rid in [rid for rid, r in engine.requests.items() if r.finished]:
            req = engine.requests.pop(rid)
            print(json.dumps(req.result(tokenizer)), flush=True)
            finished.append(req)
            bar.update(1)
    bar.close()
    log(summary_line(summary(finished, failed, engine, time.perf_counter() - start)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
