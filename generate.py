"""Generate text from the command line: prefill the prompt, then decode one token at a time.

    python generate.py --chat --prompt "What is the capital of France?"      # the embedded model
    python generate.py --checkpoint path/or/org-name --compile --prompt "Once upon a time"

The loop is the textbook one. Prefill runs the whole prompt through the model at positions
0..T-1, filling the static KV cache (kv_cache.py) and giving the first token's logits; each decode
step feeds one token at the next position. Decode at batch 1 reads every weight once per token,
so its speed limit is memory bandwidth / weight bytes; the stats line prints the achieved
bandwidth next to tokens/s so you can see how close to that limit it runs:

    bandwidth = bytes of weights read per step * tokens/s   (KV cache reads reported apart)

`--compile` compiles the decode step once (fullgraph, static shapes: positions are tensors, so
advancing them never recompiles); on CUDA it also replays as a CUDA Graph (mode
"reduce-overhead"). Compile time is reported separately and never counted in tokens/s.
`--json` prints one JSON object per sample instead of text, for scripts and tests.
"""
import argparse
import contextlib
import json
import resource
import sys
import time

import torch

import tp
from kv_cache import Int8KVCache, StaticKVCache
from sampling import SamplingParams, check_sampling, sample

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def prefill(model, cache, tokens, start_pos: int = 0):
    """tokens [B, T] written at positions start_pos.. -> logits of the last position [B, V]."""
    B, T = tokens.shape
    input_pos = torch.arange(start_pos, start_pos + T, device=tokens.device).expand(B, T)
    return model(tokens, input_pos, cache, last_only=True)[:, -1]


def decode_one(model, cache, token, input_pos):
    """token, input_pos [B, 1] -> logits [B, V]. The function --compile compiles."""
    return model(token, input_pos, cache)[:, -1]


def verify_step(model, cache, tokens, input_pos):
    """tokens, input_pos [B, T] -> logits at every position [B, T, V] (speculative verification)."""
    return model(tokens, input_pos, cache)


def compile_decode(device: str, fn=decode_one, autotune: bool = True):
    """The decode step compiled once. On CUDA: CUDA Graphs ("reduce-overhead") remove per-kernel
    launch cost. On CPU: weights frozen as constants (prepacked for oneDNN) and GEMMs autotuned
    against Inductor's C++ templates, which use AMX where the CPU has it: at batch 1 bf16 this is
    about twice as fast as eager, whose bf16 matrix-vector products are slow on CPU (int8 layers
    get Inductor's templates too). Models with int4 layers skip the autotuning (autotune=False):
    it does not speed their kernel and takes many GiB of memory."""
    if device.startswith("cuda"):
        return torch.compile(fn, fullgraph=True, dynamic=False, mode="reduce-overhead")
    import torch._inductor.config

    torch._inductor.config.freezing = True  # inference only: parameters never change after this
    torch._inductor.config.cpp.simdlen = inductor_vector_bits()
    torch._inductor.config.max_autotune_report_choices_stats = False  # keep stderr readable
    # dynamic=False: a cache of another length gets its own static graph, never a slow dynamic one
    return torch.compile(fn, fullgraph=True, dynamic=False, mode="max-autotune" if autotune else None)


def inductor_vector_bits():
    """The vector width for Inductor's C++ code, matched to the instruction set ATen dispatches to
    (ATEN_CPU_CAPABILITY): 512 (AVX-512, or AMX where present), 256 (AVX2). Left to Inductor, parts
    of it use the CPU's widest set while its loops follow ATEN_CPU_CAPABILITY, and under avx2 on an
    AVX-512 CPU that mix computed NaNs. Under "default" (no SIMD in ATen) Inductor's code still uses
    AVX2 where the CPU has it: its scalar fallback fails to compile some masked loads (torch 2.13)."""
    from torch._inductor.cpu_vec_isa import valid_vec_isa_list

    widths = sorted({isa.bit_width() for isa in valid_vec_isa_list()})
    want = {"AVX512": 512, "AVX2": 256}.get(torch.backends.cpu.get_cpu_capability(), widths[0] if widths else None)
    return want if want in widths else None  # None: Inductor's own choice (other CPUs)


def reset_peak_memory(device: str):
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    else:
        try:  # Linux: "5" resets this process's peak resident set size (VmHWM)
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass


def peak_memory_bytes(device: str) -> int:
    """Peak GPU memory allocated, or on CPU the process's peak resident set size."""
    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def skip_guards(enabled: bool):
    """After the first decode step has checked every guard of the compiled function (compiling
    if needed), the rest of the loop passes the same model and cache, with the same shapes.
    Re-checking hundreds of guards per step costs about 0.8 ms on CPU, so only the guards that
    choose between compiled graphs are evaluated."""
    return torch.compiler.set_stance("default", skip_guard_eval_unsafe=True) if enabled else contextlib.nullcontext()


def generate(model, cache, prompt, max_new_tokens, params, generator=None, stop_ids=(), ignore_eos=False,
             decode_fn=decode_one, prefill_fn=prefill, start_pos=0, on_token=None):
    """Decode up to max_new_tokens after `prompt` [B, T] (already on the device).

    Returns (tokens [B, n] as lists, each cut after its first stop token, timing dict).
    Rows that hit a stop token keep decoding (the batch shape is static) but their output ends."""
    B, T = prompt.shape
    device = prompt.device
    stop = torch.tensor(sorted(stop_ids) if not ignore_eos else [], dtype=torch.long, device=device)
    start = time.perf_counter()
    with torch.no_grad():
        token = sample(prefill_fn(model, cache, prompt, start_pos), params, generator)  # [B]
    out, done = [token], torch.isin(token, stop)
    first_token_s = time.perf_counter() - start
    if on_token:
        on_token(token)
    pos = torch.full((B, 1), start_pos + T, dtype=torch.long, device=device)
    for step in range(max_new_tokens - 1):
        if bool(done.all()):  # one host sync per step: the loop must know when to stop
            break
        with torch.no_grad(), skip_guards(step > 0 and decode_fn is not decode_one):
            logits = decode_fn(model, cache, token[:, None], pos)
        token = sample(logits, params, generator)
        pos += 1
        done |= torch.isin(token, stop)
        out.append(token)
        if on_token:
            on_token(token)
    if device.type == "cuda":
        torch.cuda.synchronize()
    total_s = time.perf_counter() - start
    rows = torch.stack(out, dim=1).tolist()  # [B, n]
    stop_set = set(stop.tolist())
    for r in rows:
        cut = next((i + 1 for i, t in enumerate(r) if t in stop_set), len(r))
        del r[cut:]
    n = len(out)
    decode_s = total_s - first_token_s
    return rows, {"time_to_first_token_s": first_token_s, "total_s": total_s, "steps": n,
                  "tokens_per_s": (n - 1) / decode_s if n > 1 and decode_s > 0 else 0.0}


class Streamer:
    """Prints the text of row 0 as tokens arrive, holding back incomplete UTF-8 characters."""

    def __init__(self, tokenizer, stop_ids, out=None):
        self.tokenizer, self.stop_ids, self.out = tokenizer, set(stop_ids), out or sys.stdout
        self.ids, self.printed, self.stopped = [], "", False

    def __call__(self, token):
        t = int(token[0])  # a host sync, only when streaming to a terminal
        if self.stopped or t in self.stop_ids:
            self.stopped = True
            return
        self.ids.append(t)
        self.flush(final=False)

    def flush(self, final=True):
        text = self.tokenizer.decode(self.ids)
        if final or not text.endswith("\ufffd"):  # a partial character: wait for its other bytes
            self.out.write(text[len(self.printed):])
            self.out.flush()
            self.printed = text


def parse_args(argv):
    class Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
        pass

    p = argparse.ArgumentParser(description=__doc__, formatter_class=Formatter)
    p.add_argument("--checkpoint", default=None, help="HF folder, .gguf file or Hub id (default: embedded SmolLM2-135M)")
    p.add_argument("--prompt", default="Hello, my name is", help="the text to continue (or, with --chat, the message)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--interactive", action="store_true", help="a chat loop; each turn prefills only what is new")
    p.add_argument("--max_new_tokens", type=int, default=200, help="most tokens to generate per sample")
    p.add_argument("--max_seq_len", type=int, default=None, help="KV cache length (default: prompt + max_new_tokens, rounded up)")
    p.add_argument("--temperature", type=float, default=0.8, help="0 means greedy")
    p.add_argument("--top_k", type=int, default=200, help="sample among the k most likely tokens (>= 1)")
    p.add_argument("--top_p", type=float, default=1.0, help="sample among the most likely tokens reaching this probability, in (0, 1]")
    p.add_argument("--seed", type=int, default=None, help="makes sampling reproducible")
    p.add_argument("--ignore_eos", action="store_true", help="do not stop at stop tokens (benchmarks)")
    p.add_argument("--num_samples", type=int, default=1, help="samples generated one after another")
    p.add_argument("--batch_size", type=int, default=1, help="samples of the prompt decoded together")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES), help="weights and activations")
    p.add_argument("--compile", action="store_true", help="compile the decode step (CUDA Graphs on GPU)")
    p.add_argument("--compile_prefill", action="store_true", help="compile prefill too (dynamic prompt length)")
    p.add_argument("--profile", default=None, metavar="PATH", help="write a torch.profiler trace of generation")
    p.add_argument("--json", action="store_true", help="one JSON object per sample on stdout, no streamed text")
    g = p.add_argument_group("quantization (quantize.py)")
    g.add_argument("--quantize", default=None, choices=("int8", "int4"), help="weight-only quantization at load time")
    g.add_argument("--groupsize", type=int, default=64, help="int4 group size: 32, 64, 128 or 256")
    g.add_argument("--quantize_head", action="store_true", help="quantize the output head too (the largest matrix of small models)")
    g.add_argument("--quantize_embedding", action="store_true", help="store the embedding table int8")
    g.add_argument("--kv_cache_dtype", default="model", choices=("model", "int8"), help="int8: K/V stored int8 with per-token scales")
    p.add_argument("--cache", default="static", choices=("static", "paged"),
                   help="KV cache: kv_cache.py's static buffers or paged.py's block pool (same tokens; compare speed)")
    p.add_argument("--block_size", type=int, default=16, help="tokens per block of the paged cache")
    g = p.add_argument_group("speculative decoding (speculative.py; batch 1, eager)")
    g.add_argument("--draft_checkpoint", default=None, help="a smaller model with the same tokenizer drafts")
    g.add_argument("--draft_layers", type=int, default=None, help="the target's own first N layers draft (LayerSkip)")
    g.add_argument("--prompt_lookup", type=int, default=None, metavar="N", help="draft by copying after the longest matching n-gram, n <= N")
    g.add_argument("--speculate_k", type=int, default=4, help="tokens drafted per round")
    g.add_argument("--draft_quantize", default=None, choices=("int8", "int4"), help="quantize the draft model (--draft_checkpoint)")
    args = p.parse_args(argv)
    for name in ("max_new_tokens", "num_samples", "batch_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    try:
        check_sampling(args.temperature, args.top_k, args.top_p)
    except ValueError as e:
        p.error(str(e))
    return args


def pick_device(name):
    if name is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: CUDA is not available on this machine (no GPU or a CPU-only PyTorch); use --device cpu")
    if not name.startswith(("cpu", "cuda")):
        raise ValueError(f"--device {name}: expected cpu or cuda")
    return name


def plan_seq_len(args, model_args, prompt_len: int) -> int:
    context = model_args.max_position_embeddings
    need = prompt_len + args.max_new_tokens
    if need > context:
        raise ValueError(f"prompt has {prompt_len} tokens and --max_new_tokens is {args.max_new_tokens}: "
                         f"{need} exceeds this model's context of {context} tokens")
    seq_len = args.max_seq_len or min(context, -(-need // 64) * 64)  # round up to a multiple of 64
    if seq_len < need:
        raise ValueError(f"--max_seq_len {seq_len} is smaller than prompt ({prompt_len}) + --max_new_tokens ({args.max_new_tokens})")
    if seq_len > context:
        raise ValueError(f"--max_seq_len {seq_len} exceeds this model's context of {context} tokens")
    if model_args.sliding_window and seq_len > model_args.sliding_window:
        raise ValueError(f"--max_seq_len {seq_len} exceeds the sliding window ({model_args.sliding_window}), which is not implemented")
    return seq_len


def make_cache(args, model, batch_size: int, seq_len: int):
    if getattr(args, "cache", "static") == "paged":
        from paged import PagedKVCache

        if args.kv_cache_dtype != "model":
            raise ValueError("--cache paged stores K/V in the model's dtype; --kv_cache_dtype int8 needs --cache static")
        return PagedKVCache.for_batch(model, batch_size, seq_len, args.block_size)
    kind = Int8KVCache if getattr(args, "kv_cache_dtype", "model") == "int8" else StaticKVCache
    return kind.for_model(model, batch_size, seq_len)


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024


def memory_plan(model, cache) -> str:
    weights = f"weights {human(model.weight_bytes())} ({human(model.bytes_read_per_token())} read per step) | "
    if hasattr(cache, "block_size"):  # paged: the pool, block 0 being the null block
        per_block = cache.nbytes() / cache.num_blocks
        return weights + (f"paged KV cache {human(per_block / cache.block_size)}/token x {cache.block_size} tokens per block "
                          f"x {cache.num_blocks} blocks = {human(cache.nbytes())}")
    per_token = cache.nbytes() / (cache.max_seq_len * cache.batch_size)
    return weights + f"KV cache {human(per_token)}/token x {cache.max_seq_len} tokens x {cache.batch_size} = {human(cache.nbytes())}"


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        return run(args)
    except (ValueError, FileNotFoundError) as e:  # CheckpointError and TokenizerError are ValueErrors
        log(f"error: {e}")
        return 2
    except KeyboardInterrupt:
        log("\ninterrupted")
        return 130
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def run(args) -> int:
    import weights
    from tokenizer import load_tokenizer

    device = pick_device(args.device)
    if not args.interactive and not args.prompt:
        raise ValueError("the prompt is empty; give some text with --prompt")
    rank, world = tp.init()  # (0, 1) unless started by torchrun with several processes
    if world > 1:
        tp.quiet_unless_rank_zero(rank)
        device = f"cuda:{torch.cuda.current_device()}" if device.startswith("cuda") else device
    model, info = weights.load(args.checkpoint, device=device, dtype=DTYPES[args.dtype], shard=(rank, world))
    if args.quantize:  # before tp.parallelize: each rank quantizes its own shard
        import quantize

        quantize.quantize_model(model, args.quantize, args.groupsize, args.quantize_head, args.quantize_embedding, log=log)
    if world > 1:
        tp.check_same_checkpoint(model)
        tp.parallelize(model)
        args.seed = tp.shared_seed(args.seed)
        log(f"tensor parallel over {world} ranks: this rank holds {human(model.weight_bytes())} of weights")
    tokenizer = load_tokenizer(info.source)
    log(f"loaded {info.source} ({info.format}, {human(info.weight_bytes)} as {args.dtype}) in {info.load_s:.2f} s")
    if args.interactive:
        from chat import interactive
        return interactive(args, model, tokenizer, device)
    if args.draft_checkpoint or args.draft_layers or args.prompt_lookup:
        from speculative import run_speculative
        return run_speculative(args, model, tokenizer, info, device)

    ids = tokenizer.encode_chat([{"role": "user", "content": args.prompt}]) if args.chat else tokenizer.encode(args.prompt)
    if not ids:
        raise ValueError("the prompt encodes to no tokens; give some text with --prompt")
    seq_len = plan_seq_len(args, model.args, len(ids))
    cache = make_cache(args, model, args.batch_size, seq_len)
    log(memory_plan(model, cache))
    decode_fn, prefill_fn, compile_s = decode_one, prefill, 0.0
    if args.compile or args.compile_prefill:
        decode_fn, prefill_fn, compile_s = warm_up(args, model, cache, device, len(ids))
        log(f"compiled in {compile_s:.1f} s")
    prompt = torch.tensor([ids] * args.batch_size, device=device)
    generator = torch.Generator(device=device)
    if args.seed is not None:
        generator.manual_seed(args.seed)
    params = SamplingParams(args.temperature, args.top_k, args.top_p)
    profiler = torch.profiler.profile() if args.profile else contextlib.nullcontext()
    with profiler:
        for _ in range(args.num_samples):
            stream = not args.json and args.batch_size == 1
            streamer = Streamer(tokenizer, tokenizer.stop_ids if not args.ignore_eos else ())
            if stream:
                print(args.prompt if not args.chat else "", end="", flush=True)
            rows, timing = generate(model, cache, prompt, args.max_new_tokens, params, generator, tokenizer.stop_ids,
                                    args.ignore_eos, decode_fn, prefill_fn, on_token=streamer if stream else None)
            if stream:
                streamer.flush()
            report(args, model, cache, tokenizer, ids, rows, timing, info, compile_s, device, stream)
    if args.profile:
        profiler.export_chrome_trace(args.profile)
        log(f"profile written to {args.profile}")
    return 0


def autotune(model) -> bool:
    """Autotune unless the model has int4 layers (see compile_decode)."""
    return not any(type(m).__name__ == "Int4Linear" for m in model.modules())


def warm_up(args, model, cache, device, prompt_len):
    """Compile now, on throwaway inputs, so compile time never lands in tokens/s."""
    start = time.perf_counter()
    decode_fn = compile_decode(device, autotune=autotune(model)) if args.compile else decode_one
    prefill_fn = torch.compile(prefill, dynamic=True) if args.compile_prefill else prefill
    B = cache.batch_size
    with torch.no_grad():
        prefill_fn(model, cache, torch.zeros(B, prompt_len, dtype=torch.long, device=device))
        for step in range(3):  # CUDA Graphs record on the second or third call
            decode_fn(model, cache, torch.zeros(B, 1, dtype=torch.long, device=device),
                      torch.full((B, 1), step, dtype=torch.long, device=device))
    return decode_fn, prefill_fn, time.perf_counter() - start


def report(args, model, cache, tokenizer, ids, rows, timing, info, compile_s, device, streamed):
    bandwidth = model.bytes_read_per_token() * timing["tokens_per_s"] / 1e9
    stats = {"tokens_per_s": timing["tokens_per_s"], "bandwidth_gb_s": bandwidth,
             "time_to_first_token_s": timing["time_to_first_token_s"], "total_s": timing["total_s"],
             "peak_memory_bytes": peak_memory_bytes(device), "model_bytes": model.weight_bytes(),
             "kv_cache_bytes": cache.nbytes(), "compile_s": compile_s, "load_s": info.load_s,
             "cpu_capability": torch.backends.cpu.get_cpu_capability(), "device": device}
    for row in rows:
        text = tokenizer.decode([t for t in row if args.ignore_eos or t not in tokenizer.stop_ids])
        if args.json:
            print(json.dumps({"prompt_tokens": ids, "tokens": row, "text": text, "stats": stats}), flush=True)
        elif not streamed:
            print(f"{args.prompt if not args.chat else ''}{text}\n" + "-" * 40, flush=True)
    if streamed:
        print(flush=True)
    log(f"{len(rows[0])} tokens | {stats['tokens_per_s']:.2f} tokens/s | {bandwidth:.2f} GB/s | "
        f"first token {stats['time_to_first_token_s']:.3f} s | peak memory {human(stats['peak_memory_bytes'])} | "
        f"{device} ({stats['cpu_capability']}) | " + memory_plan(model, cache))


if __name__ == "__main__":
    sys.exit(main())
