"""Generate text from the command line: prefill the prompt, then decode one token at a time.

    python generate.py --chat --prompt "What is the capital of France?"      # the embedded model
    python generate.py --checkpoint path/or/org-name --compile --prompt "Once upon a time"

The loop is the textbook one, in three functions: `generate` (timing and stop tokens) calls
`prefill_first_token`, which runs the whole prompt through the model at positions 0..T-1, filling
the static KV cache (kv_cache.py) and sampling the first token, then `decode_n_tokens`, whose
every step feeds one token at the next position. `DecodeOptions` holds the rest (a generator,
stop ids, a compiled step, streaming, constraints). Decode at batch 1 reads every weight once per
token, so its speed limit is memory bandwidth / weight bytes; the stats line prints the achieved
bandwidth next to tokens/s so you can see how close to that limit it runs:

    bandwidth = bytes of weights read per step * tokens/s   (KV cache reads reported apart)

By default (`--compile auto`) a CPU run decodes with an AOTInductor package (speedups/aot.py):
compiled once per model shape, torch version, CPU and source by a child process, cached on disk,
loaded in a fraction of a second later, with no compiler in this process (with speculation, its
verify steps too); where none can serve (CUDA, torchrun, a failed build) it decodes eager, and
says why if a build failed.
`--compile off` is eager. `--compile` (jit) compiles the step in process once per attend length
(fullgraph, static shapes, a few graphs per run; on CUDA each replays as a CUDA Graph); compile time
is reported apart and never counted in tokens/s. `--json` prints one JSON object per sample instead
of text, for scripts and tests. `--interactive` is a chat that prefills only each turn's new tokens;
`--draft_checkpoint`, `--draft_layers` and `--prompt_lookup` decode through speculative.py
(cli/speculate.py runs them). This file is the command line on top of the library: its flags are
cli/generate_flags.py's, and compiling.py holds the prefill and decode steps and compiling them.
"""

import contextlib
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

import constrain
import tp
from cli import generate_flags, speculate
from compiling import (
    autotune,
    compile_decode,
    compile_lengths,
    compiled_message,
    configure_inductor_cpu,
    decode_one,
    prefill,
    skip_guards,
)
from formats.tokenizer import load_tokenizer
from kv_cache import StaticKVCache
from memory import memory_plan, peak_memory_bytes
from runtime import DTYPES, cpu_capability, human, log, pick_device
from sampling import SamplingParams, parse_logit_bias, sample
from speedups import aot, kv_disk, lora
from speedups.kv_int8 import Int8KVCache
from speedups.kv_window import WindowedKVCache
from text_stream import Printer


@dataclass
class DecodeOptions:
    """How generate() runs, beyond what it decodes; every field has a default."""

    generator: torch.Generator = None  # sampling's random source (seeded by --seed)
    stop_ids: tuple = ()  # a row's output ends after the first of these
    ignore_eos: bool = False  # decode exactly max_new_tokens (benchmarks)
    decode_fn: Callable = decode_one  # compiling.decode_one, or a compiled twin of it
    prefill_fn: Callable = prefill
    start_pos: int = 0  # where the prompt starts in the cache (a chat's later turn)
    on_token: Callable = None  # called with each step's tokens [B] (streaming)
    context: torch.Tensor = None  # ids [B, start_pos + T] the repetition penalty sees (the prompt)
    matchers: list = None  # one constrain.Matcher per row, masking each step's logits


def generate(model, cache, prompt, max_new_tokens: int, params, options: DecodeOptions = None):
    """Decode up to max_new_tokens after `prompt` [B, T] (on the device): prefill, then one token
    at a time. Returns (tokens [B, n] as lists, each cut after its first stop token, timing dict).
    Rows that hit a stop token keep decoding (the batch shape is static) but their output ends."""
    o = options or DecodeOptions()
    stop_ids = sorted(o.stop_ids) if not o.ignore_eos else []
    stop = torch.tensor(stop_ids, dtype=torch.long, device=prompt.device)
    start = time.perf_counter()
    token = prefill_first_token(model, cache, prompt, params, o)
    first_token_s = time.perf_counter() - start
    out = decode_n_tokens(model, cache, token, prompt, max_new_tokens - 1, params, stop, o)
    attend_positions(cache, None)  # back to the whole cache, for callers that do not set it
    if prompt.device.type == "cuda":
        torch.cuda.synchronize()
    total_s = time.perf_counter() - start
    rows = torch.stack(out, dim=1).tolist()  # [B, n]
    for r in rows:
        cut = next((i + 1 for i, t in enumerate(r) if t in stop_ids), len(r))
        del r[cut:]
    n, decode_s = len(out), total_s - first_token_s
    return rows, {
        "time_to_first_token_s": first_token_s,
        "total_s": total_s,
        "steps": n,
        "tokens_per_s": (n - 1) / decode_s if n > 1 and decode_s > 0 else 0.0,
    }


def attend_positions(cache, n: int, round_up: bool = True):
    """A static cache attends only over the positions in use (kv_cache.py's use_positions), set
    before each step from the host's count, never read back from the device; -> the attend
    length, or None (a paged cache: its block tables set the width)."""
    use = getattr(cache, "use_positions", None)
    return use(n, round_up=round_up) if use else None


def prefill_first_token(model, cache, prompt, params, o: DecodeOptions):
    """The whole prompt [B, T] through the model at positions start_pos.., filling the cache ->
    the first sampled token [B]. Eager prefill attends over the positions in use (to 256 slots),
    a compiled one over a bucket."""
    context = prompt if o.context is None else o.context
    with torch.no_grad():
        attend_positions(cache, o.start_pos + prompt.shape[1], round_up=o.prefill_fn is not prefill)
        logits = constrain.masked(o.matchers, o.prefill_fn(model, cache, prompt, o.start_pos))
        token = sample(logits, params, o.generator, context, prompt[:, :0])  # [B]
        constrain.advance(o.matchers, token)
    if o.on_token:
        o.on_token(token)
    return token


def decode_n_tokens(model, cache, token, prompt, n: int, params, stop, o: DecodeOptions) -> list:
    """Up to n more tokens after `token` [B], one step each -> every token so far, [B] each. One
    host sync per step: the loop must know when every row has stopped."""
    B, T = prompt.shape
    context = prompt if o.context is None else o.context
    compiled = o.decode_fn is not decode_one
    out, done = [token], torch.isin(token, stop)
    pos = torch.full((B, 1), o.start_pos + T, dtype=torch.long, device=prompt.device)
    attend_len = None
    for step in range(n):
        if bool(done.all()):
            break
        # A new attend length selects another compiled graph (compiling it the first time): that
        # step checks every guard, as skipping them would rerun the graph of the shorter prefix.
        previous = attend_len
        attend_len = attend_positions(cache, o.start_pos + T + step + 1, round_up=compiled)
        checked = step > 0 and getattr(o.decode_fn, "has_guards", compiled)
        with torch.no_grad(), skip_guards(checked and attend_len == previous):
            logits = o.decode_fn(model, cache, token[:, None], pos)
        history = torch.stack(out, 1) if params.needs_history else None
        token = sample(constrain.masked(o.matchers, logits), params, o.generator, context, history)
        constrain.advance(o.matchers, token)
        pos += 1
        done |= torch.isin(token, stop)
        out.append(token)
        if o.on_token:
            o.on_token(token)
    return out


def parse_args(argv=None):
    return generate_flags.parse_args(argv, __doc__)  # cli/generate_flags.py: the flags, in groups


def plan_seq_len(config, prompt_len: int, max_new_tokens: int, max_seq_len: int = None) -> int:
    """The static cache's length: prompt + max_new_tokens rounded up to 64, within the context."""
    context = config.max_position_embeddings
    need = prompt_len + max_new_tokens
    if need > context:
        raise ValueError(
            f"prompt has {prompt_len} tokens and --max_new_tokens is {max_new_tokens}: "
            f"{need} exceeds this model's context of {context} tokens"
        )
    seq_len = max_seq_len or min(context, -(-need // 64) * 64)  # round up to a multiple of 64
    if seq_len < need:
        raise ValueError(
            f"--max_seq_len {seq_len} is smaller than prompt ({prompt_len}) + --max_new_tokens "
            f"({max_new_tokens})"
        )
    if seq_len > context:
        raise ValueError(
            f"--max_seq_len {seq_len} exceeds this model's context of {context} tokens"
        )
    return seq_len


def make_cache(
    model,
    batch_size: int,
    seq_len: int,
    kind: str = "static",
    kv_dtype: str = "model",
    block_size: int = 16,
):
    """kind "static" (kv_cache.py; kv_dtype "int8": speedups/kv_int8.py; windowed layers:
    speedups/kv_window.py's rings) or "paged"."""
    if kind == "paged":
        from paged import PagedKVCache

        if kv_dtype != "model":
            raise ValueError(
                "--cache paged stores K/V in the model's dtype; --kv_cache_dtype int8 needs "
                "--cache static"
            )
        return PagedKVCache.for_batch(model, batch_size, seq_len, block_size)
    windowed = any(layer.self_attn.window for layer in model.layers)
    kind = Int8KVCache if kv_dtype == "int8" else WindowedKVCache if windowed else StaticKVCache
    return kind.for_model(model, batch_size, seq_len)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        return run(args)
    except (
        ValueError,
        FileNotFoundError,
    ) as e:  # CheckpointError and TokenizerError are ValueErrors
        log(f"error: {e}")
        return 2
    except KeyboardInterrupt:
        log("\ninterrupted")
        return 130
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def run(args) -> int:
    device = pick_device(args.device)
    if not args.interactive and not args.prompt:
        raise ValueError("the prompt is empty; give some text with --prompt")
    speculating = args.draft_checkpoint or args.draft_layers or args.prompt_lookup
    if speculating:
        speculate.check_flags(args)  # before any weights load
    args.compile = aot.choose(args, device)  # auto: "auto" where a package can serve, else None
    model, tokenizer, info, device = load(args, device)
    if args.interactive:
        return interactive(args, model, tokenizer, device)
    ids = encode_prompt(args, tokenizer)
    seq_len = plan_seq_len(model.config, len(ids), args.max_new_tokens, args.max_seq_len)
    cache = make_cache(
        model, args.batch_size, seq_len, args.cache, args.kv_cache_dtype, args.block_size
    )
    log(memory_plan(model, cache))
    generator, params = make_generator(device, args.seed), SamplingParams.from_fields(args)
    if speculating:
        return speculate.run(args, model, tokenizer, ids, seq_len, cache, params, generator, device)
    decode_fn, prefill_fn, compile_s = decode_one, prefill, 0.0
    if args.compile or args.compile_prefill:
        decode_fn, prefill_fn, compile_s = warm_up(args, model, cache, device, len(ids))
        if args.compile == "jit":  # speedups/aot.py says what it did
            log(compiled_message(compile_s, model, device))
    prompt = torch.tensor([ids] * args.batch_size, device=device)
    profiler = torch.profiler.profile() if args.profile else contextlib.nullcontext()
    disk = (args.kv_disk_cache, args.kv_disk_cache_size, model, cache, ids)  # --cache paged
    with profiler, kv_disk.prompt_cache(*disk) as start:  # start: the prompt's tokens loaded
        for _ in range(args.num_samples):
            stream = not args.json and args.batch_size == 1
            printer = Printer(tokenizer, tokenizer.stop_ids if not args.ignore_eos else ())
            if stream:
                print(args.prompt if not args.chat else "", end="", flush=True)
            options = DecodeOptions(
                generator=generator,
                stop_ids=tokenizer.stop_ids,
                ignore_eos=args.ignore_eos,
                decode_fn=decode_fn,
                prefill_fn=prefill_fn,
                on_token=printer if stream else None,
                matchers=constrain.row_matchers(
                    args.constraint, tokenizer, model.config.vocab_size, args.batch_size
                ),
                start_pos=start,
                context=prompt,
            )
            n = args.max_new_tokens
            rows, timing = generate(model, cache, prompt[:, start:], n, params, options)
            if stream:
                printer.flush()
            report(
                args, model, cache, tokenizer, ids, rows, timing, info, compile_s, device, stream
            )
    if args.profile:
        profiler.export_chrome_trace(args.profile)
        log(f"profile written to {args.profile}")
    return 0


def load(args, device):
    """(model, tokenizer, LoadInfo, device) for the flags, sharded across ranks under torchrun."""
    from formats import weights

    rank, world = tp.init()  # (0, 1) unless started by torchrun with several processes
    if world > 1:
        tp.quiet_unless_rank_zero(rank)
        device = f"cuda:{torch.cuda.current_device()}" if device.startswith("cuda") else device
    model, info = weights.load_for_inference(
        device=device,
        dtype=DTYPES[args.dtype],
        shard=(rank, world),
        log=log,
        **generate_flags.load_flags(args),
    )
    if world > 1:
        tp.check_same_checkpoint(model)
        tp.parallelize(model)
        args.seed = tp.shared_seed(args.seed)
        held = human(model.weight_bytes())
        log(f"tensor parallel over {world} ranks: this rank holds {held} of weights")
    if args.lora:  # a LoRA adapter merged, or applied on the fly (speedups/lora.py)
        if world > 1:
            raise ValueError("--lora runs in one process; leave out torchrun")
        log(lora.apply(model, args.lora, args.lora_scale, args.merge_lora))
    parse_logit_bias(args.logit_bias, model.config.vocab_size)  # its ids in this model's vocabulary
    tokenizer = load_tokenizer(info.source)
    weights.settle()
    log(
        f"loaded {info.source} ({info.format}, {human(info.weight_bytes)} as {args.dtype}) "
        f"in {info.load_s:.2f} s"
        + (f"\nat the file's own bits: {info.own_bits}" if info.own_bits else "")
    )
    return model, tokenizer, info, device


def encode_prompt(args, tokenizer) -> list:
    ids = (
        tokenizer.encode_chat([{"role": "user", "content": args.prompt}])
        if args.chat
        else tokenizer.encode(args.prompt)
    )
    if not ids:
        raise ValueError("the prompt encodes to no tokens; give some text with --prompt")
    return ids


def make_generator(device, seed):
    generator = torch.Generator(device=device)
    return generator if seed is None else generator.manual_seed(seed)


def interactive(args, model, tokenizer, device) -> int:
    """--interactive: a chat over one static cache. Each turn re-renders the whole conversation
    with the chat template, finds the longest prefix whose K/V are already in the cache, and
    prefills only the tokens after it: a long chat costs each turn only its new tokens."""
    seq_len = args.max_seq_len or min(model.config.max_position_embeddings, 4096)
    cache = make_cache(model, 1, seq_len, args.cache, args.kv_cache_dtype, args.block_size)
    log(memory_plan(model, cache) + "\nType a message; an empty line or Ctrl-D ends the chat.")
    decode_fn = decode_step(args, model, cache, device)
    generator, params = make_generator(device, args.seed), SamplingParams.from_fields(args)
    messages, cached = [], []  # cached: the token ids whose K/V are in the cache, in order
    compiled = set()  # the attend lengths the compiled step has seen
    while True:
        try:
            text = input("\n>>> ")
        except EOFError:
            break
        if not text.strip():
            break
        messages.append({"role": "user", "content": text})
        ids = tokenizer.encode_chat(messages)
        if len(ids) + args.max_new_tokens > seq_len:
            log(
                f"the conversation ({len(ids)} tokens) + --max_new_tokens would exceed "
                f"--max_seq_len {seq_len}; ending"
            )
            break
        if (
            args.compile == "jit"
        ):  # the graphs for the lengths this turn can reach, before it starts
            compiled = compile_turn(args, model, cache, decode_fn, len(ids), compiled)
        common = reusable_prefix(cached, ids, cache)
        printer = Printer(tokenizer, tokenizer.stop_ids)
        options = DecodeOptions(
            generator=generator,
            stop_ids=tokenizer.stop_ids,
            ignore_eos=False,
            decode_fn=decode_fn,
            start_pos=common,
            on_token=printer,
            context=torch.tensor([ids], device=device),
        )
        prompt = torch.tensor([ids[common:]], device=device)
        rows, timing = generate(model, cache, prompt, args.max_new_tokens, params, options)
        printer.flush()
        print()
        new, rate = len(ids) - common, timing["tokens_per_s"]
        log(f"[{new} new prompt tokens of {len(ids)}, {rate:.1f} tokens/s]")
        reply = rows[0]
        cached = ids + reply[:-1] if reply and reply[-1] in tokenizer.stop_ids else ids + reply
        messages.append({"role": "assistant", "content": printer.text.sent})
    return 0


def reusable_prefix(cached: list, ids: list, cache) -> int:
    """How many of the turn's tokens `ids` already have their K/V in the cache: the common prefix
    with `cached`, less one (the last prompt token is fed again for its logits), or 0 where a
    cache cannot rewind that far (speedups/kv_window.py's rings keep only a window)."""
    common = next(
        (i for i, (a, b) in enumerate(zip(cached, ids)) if a != b), min(len(cached), len(ids))
    )
    if len(cached) - common > getattr(cache, "rewind_limit", len(cached)):
        return 0
    return min(common, len(ids) - 1)


def compile_turn(args, model, cache, decode_fn, prompt_len: int, compiled: set) -> set:
    """Compile the decode step for the attend lengths a turn of prompt_len tokens can reach."""
    start, before = time.perf_counter(), len(compiled)
    end = prompt_len + args.max_new_tokens - 1
    compiled = compile_lengths(decode_fn, model, cache, prompt_len, end, compiled)
    if len(compiled) > before:
        seconds = time.perf_counter() - start
        log(
            f"[compiled the decode step for {len(compiled) - before} more attend lengths "
            f"in {seconds:.1f} s]"
        )
    return compiled


def warm_up(args, model, cache, device, prompt_len):
    """Compile now, on throwaway inputs, so compile time never lands in tokens/s."""
    start = time.perf_counter()
    decode_fn = decode_step(args, model, cache, device)
    if args.compile_prefill and device == "cpu":
        configure_inductor_cpu()
    prefill_fn = torch.compile(prefill, dynamic=True) if args.compile_prefill else prefill
    with torch.no_grad():
        getattr(cache, "use_positions", lambda n: None)(prompt_len)
        prefill_fn(
            model, cache, torch.zeros(cache.batch_size, prompt_len, dtype=torch.long, device=device)
        )
    if args.compile == "jit":
        compile_lengths(decode_fn, model, cache, prompt_len, prompt_len + args.max_new_tokens - 1)
    return decode_fn, prefill_fn, time.perf_counter() - start


def decode_step(args, model, cache, device):
    """The decode step --compile chose: decode_one, torch.compile'd (jit) or ahead of time (aot)."""
    if args.compile in (
        "aot",
        "auto",
    ):  # the child builds the model from the same flags; auto: eager if it fails
        return aot.decode_step(
            model,
            cache,
            generate_flags.package_load(args),
            fallback=args.compile == "auto",
        )
    return compile_decode(device, autotune=autotune(model)) if args.compile else decode_one


def report(args, model, cache, tokenizer, ids, rows, timing, info, compile_s, device, streamed):
    bandwidth = model.bytes_read_per_token() * timing["tokens_per_s"] / 1e9
    stats = {
        "tokens_per_s": timing["tokens_per_s"],
        "bandwidth_gb_s": bandwidth,
        "time_to_first_token_s": timing["time_to_first_token_s"],
        "total_s": timing["total_s"],
        "peak_memory_bytes": peak_memory_bytes(device),
        "model_bytes": model.weight_bytes(),
        "kv_cache_bytes": cache.nbytes(),
        "compile_s": compile_s,
        "load_s": info.load_s,
        "cpu_capability": cpu_capability(),
        "device": device,
    }
    for row in rows:
        text = tokenizer.decode([t for t in row if args.ignore_eos or t not in tokenizer.stop_ids])
        if args.json:
            print(
                json.dumps({"prompt_tokens": ids, "tokens": row, "text": text, "stats": stats}),
                flush=True,
            )
        elif not streamed:
            print(f"{args.prompt if not args.chat else ''}{text}\n" + "-" * 40, flush=True)
    if streamed:
        print(flush=True)
    log(
        f"{len(rows[0])} tokens | {stats['tokens_per_s']:.2f} tokens/s | {bandwidth:.2f} GB/s | "
        f"first token {stats['time_to_first_token_s']:.3f} s | peak memory "
        f"{human(stats['peak_memory_bytes'])} | "
        f"{device} ({stats['cpu_capability']}) | " + memory_plan(model, cache)
    )


if __name__ == "__main__":
    sys.exit(main())
