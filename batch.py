"""Offline batch inference from a JSONL file through the continuous-batching engine (engine.py).

    python batch.py --requests requests.jsonl
    python batch.py --requests - < requests.jsonl      # stdin

One request per line, every field but `prompt` optional (a prompt is text, or a list of token ids):

    {"id": "a", "prompt": "The sea is", "max_new_tokens": 64, "temperature": 0.7, "top_k": 50,
     "top_p": 0.9, "seed": 1, "stop": ["\\n\\n"], "stop_token_ids": [2], "ignore_eos": false,
     "n": 1}

and the sampling controls of sampling.py: "min_p", "repetition_penalty", "frequency_penalty",
"presence_penalty", "logit_bias" ({"token id": bias}); "priority" (lower first) with
--schedule_policy priority; "lora": the name of a LoRA adapter given as --lora NAME=PATH, for
that request alone (speedups/lora.py; the base model without one), or "model" where it names
one (any other "model", e.g. the base's, runs the base).

On stdout, one JSON line per request as it finishes: `id` (the line number if not given),
`tokens` (generated ids), `text`, `finish_reason` ("stop", "length"), `time_to_first_token_s`;
with n > 1, `tokens`, `text` and `finish_reason` are lists, one entry per sample. A request that
cannot run (malformed line, bad parameters, a prompt longer than the context or than the whole KV
pool) gets `{"id", "error"}` and every other request still runs. On stderr: the KV memory plan, a
progress bar, and a summary (requests/s, output tokens/s, time to first token, time in the queue
and per output token, peak KV blocks, prefix-cache hit rate, preemptions).

With --embed, each line is an input to embed, {"id": "a", "prompt": "a text", "dimensions": 256}
(dimensions optional), pooled as the checkpoint's sentence-transformers files say or as --pooling
(formats/pooling.py); each output line is {"id", "embedding", "prompt_tokens", "finish_reason"}
("stop": embedded).

    python batch.py --embed --checkpoint Qwen/Qwen3-Embedding-0.6B --requests texts.jsonl
"""

import argparse
import json
import os
import sys
import time

import torch

from engine import Finished, RequestParams
from formats.pooling import encode_input, finish, read_spec
from runtime import log
from server.engine_flags import add_engine_args, check_engine_args, engine_options
from server.tp_engine import load_engine  # one process, or tensor-parallel under torchrun
from speedups.kv_tier import keep_pool

REQUEST_KEYS = (
    "id",
    "prompt",
    "max_new_tokens",
    "temperature",
    "top_k",
    "top_p",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "n",
    "min_p",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
    "logit_bias",
    "priority",
)


def read_line(line: str, line_no: int):
    """One JSONL line -> (id, the request object). Raises ValueError if it is not a JSON object."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"line {line_no} is not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"line {line_no} must be a JSON object, got {type(obj).__name__}")
    return obj.get("id", line_no), obj


def parse_request(obj: dict, tokenizer, adapters=()):
    """A request object -> (prompt ids, RequestParams); adapters: the names --lora serves.
    Raises ValueError naming what is wrong."""
    unknown = sorted(set(obj) - set(REQUEST_KEYS) - {"lora", "model"})
    if unknown:
        raise ValueError(
            f"unknown field(s) {unknown}; a request has {[*REQUEST_KEYS, 'lora', 'model']}"
        )
    model = obj.get("model") if obj.get("model") in adapters else None  # else: the base's name
    if obj.get("lora") and model and obj["lora"] != model:
        raise ValueError("lora and model both name an adapter, different ones: give one")
    prompt = obj.get("prompt")
    if isinstance(prompt, str):
        prompt = tokenizer.encode(prompt)
    elif not (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)):
        raise ValueError("prompt must be a string or a list of token ids")
    params = {k: obj[k] for k in REQUEST_KEYS[2:] if obj.get(k) is not None}
    return prompt, RequestParams(**params, adapter=obj.get("lora") or model)


def parse_embedding(obj: dict, tokenizer, spec, dim: int):
    """An --embed line -> (prompt ids, RequestParams, dimensions or None)."""
    unknown = sorted(set(obj) - {"id", "prompt", "dimensions"})
    if unknown:
        raise ValueError(f"unknown field(s) {unknown}; an input has ['id', 'prompt', 'dimensions']")
    prompt, dims = obj.get("prompt"), obj.get("dimensions")
    if not prompt:
        raise ValueError("the prompt is empty: give a text or token ids to embed")
    if isinstance(prompt, str):
        prompt = encode_input(tokenizer, prompt, spec.chat)
    elif not (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)):
        raise ValueError("prompt must be a string or a list of token ids")
    if dims is not None and not (isinstance(dims, int) and 1 <= dims <= dim):
        raise ValueError(f"dimensions must be an integer in [1, {dim}] (the model's), got {dims!r}")
    return prompt, RequestParams(pooling=spec.pooling), dims


def embedded(result: dict, spec, dims) -> dict:
    """An embedding's output line: the pooled state finished as the checkpoint's pipeline does."""
    if result.get("embedding") is None:  # failed, or aborted
        return result
    vector = finish(torch.tensor([result["embedding"]]), spec.normalize, dims)[0]
    return {**result, "embedding": vector.tolist()}


def percentile(values, q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))] if values else float("nan")


def summary(requests, failed: int, metrics: dict, elapsed: float) -> dict:
    """Throughput and latency of the finished requests (engine.Finished's), and what the KV pool
    went through (the engine's metrics)."""
    seqs = [s for r in requests for s in r.seqs]
    ttft = [
        min(s.token_times[0] for s in r.seqs if s.token_times) - r.arrival
        for r in requests
        if any(s.token_times for s in r.seqs)
    ]
    tpot = [
        (s.token_times[-1] - s.token_times[0]) / (len(s.token_times) - 1)
        for s in seqs
        if len(s.token_times) > 1
    ]
    queued = [r.admitted - r.arrival for r in requests if r.admitted is not None]
    st = metrics
    return {
        "requests": len(requests),
        "failed": failed,
        "elapsed_s": elapsed,
        "requests_per_s": len(requests) / elapsed,
        "output_tokens_per_s": sum(len(s.output) for s in seqs) / elapsed,
        "ttft_mean_s": sum(ttft) / max(1, len(ttft)),
        "ttft_p90_s": percentile(ttft, 0.9),
        "tpot_mean_s": sum(tpot) / max(1, len(tpot)),
        "tpot_p90_s": percentile(tpot, 0.9),
        "queue_p50_s": percentile(queued, 0.5),
        "queue_p99_s": percentile(queued, 0.99),
        "peak_kv_blocks": st["peak_blocks"],
        "kv_blocks": st["kv_blocks_total"],
        "prefix_hit_rate": st["prompt_tokens_hit"] / st["prompt_tokens"]
        if st["prompt_tokens"]
        else 0.0,
        "preemptions": st["preemptions"],
        "peak_running": st["peak_running"],
        "draft_tokens": st["draft_tokens"],
        "draft_tokens_accepted": st["draft_tokens_accepted"],
        "tier_tokens_hit": st["tier_tokens_hit"],
        "tier_blocks_written": st.get("tier_blocks_written", 0),
    }


def summary_line(s: dict) -> str:
    def ms(seconds: float, digits: int = 0) -> str:
        return f"{1e3 * seconds:.{digits}f} ms"

    line = (
        f"{s['requests']} requests ({s['failed']} failed) in {s['elapsed_s']:.2f} s | "
        f"{s['requests_per_s']:.2f} requests/s | {s['output_tokens_per_s']:.1f} output tokens/s | "
        f"time to first token mean {ms(s['ttft_mean_s'])}, p90 {ms(s['ttft_p90_s'])} | "
        f"time in queue p50 {ms(s['queue_p50_s'])}, p99 {ms(s['queue_p99_s'])} | "
        f"time per output token mean {ms(s['tpot_mean_s'], 1)}, p90 {ms(s['tpot_p90_s'], 1)} | "
        f"peak KV blocks {s['peak_kv_blocks']} of {s['kv_blocks']} | "
        f"prefix-cache hit rate {100 * s['prefix_hit_rate']:.1f}% | "
        f"preemptions {s['preemptions']} | peak running {s['peak_running']}"
    )
    if s["tier_tokens_hit"] or s["tier_blocks_written"]:
        line += (
            f" | KV tier: {s['tier_tokens_hit']} prompt tokens not recomputed, "
            f"{s['tier_blocks_written']} blocks written"
        )
    if s["draft_tokens"]:
        line += (
            f" | drafts accepted {s['draft_tokens_accepted']} of {s['draft_tokens']} "
            f"({100 * s['draft_tokens_accepted'] / s['draft_tokens']:.1f}%)"
        )
    return line


def parse_args(argv):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--requests", required=True, help="JSONL file of requests, or - for stdin")
    p.add_argument(
        "--embed", action="store_true", help="embed each line's prompt instead of generating"
    )
    add_engine_args(p)
    args = p.parse_args(argv)
    check_engine_args(p, args)
    return args


def main(argv=None) -> int:
    from tqdm import tqdm

    args = parse_args(argv)
    if args.embed and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        log("error: --embed runs in one process; leave out torchrun")
        return 2
    try:
        # under torchrun only rank 0 reads them (the others follow its steps inside load_engine)
        lines = []
        if int(os.environ.get("RANK", "0")) == 0:
            lines = (sys.stdin if args.requests == "-" else open(args.requests)).read().splitlines()
        engine, tokenizer, info = load_engine(**engine_options(args))
        spec = read_spec(info.source, args.pooling) if args.embed else None
    except (ValueError, OSError) as e:
        log(f"error: {e}")
        return 2
    start, failed, finished, dims = time.perf_counter(), 0, [], {}
    for line_no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        request_id = line_no
        try:
            request_id, obj = read_line(line, line_no)
            if spec:
                dim = engine.model.config.dim
                prompt, params, dims[request_id] = parse_embedding(obj, tokenizer, spec, dim)
                engine.add_request(prompt, params, request_id=request_id)
            else:
                served = engine.adapters.served() if engine.adapters else ()
                engine.add_request(*parse_request(obj, tokenizer, served), request_id=request_id)
        except (ValueError, TypeError) as e:  # this request fails alone
            print(json.dumps({"id": request_id, "error": str(e)}), flush=True)
            failed += 1
    bar = tqdm(total=engine.metrics()["requests"], unit="req", file=sys.stderr, disable=None)
    while engine.has_unfinished():
        for event in engine.step():
            if isinstance(event, Finished):
                result = embedded(event.result, spec, dims.get(event.request_id)) if spec else None
                print(json.dumps(result or event.result), flush=True)
                finished.append(event.request)
                bar.update(1)
    bar.close()
    keep_pool(engine)  # a disk tier (--kv_disk_cache) keeps the pool's prefixes for the next run
    log(summary_line(summary(finished, failed, engine.metrics(), time.perf_counter() - start)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
