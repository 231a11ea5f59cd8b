"""Generate text from the command line: prefill the prompt, then decode one token at a time.

    python generate.py --chat --prompt "What is the capital of France?"      # the embedded model
    python generate.py --checkpoint path/or/org-name --compile --prompt "Once upon a time"

The loop is the textbook one, in three functions: `generate` (timing and stop tokens) calls
`prefill_first_token`, which runs the whole prompt through the model at positions 0..T-1, filling
the static KV cache (kv_cache.py) and sampling the first token, then `decode_n_tokens`, whose
every step feeds one token at the next position. `DecodeOptions` holds the rest (a generator,
stop ids, a compiled step, streaming, constraints). Decode at batch 1 reads every weight once per token,
so its speed limit is memory bandwidth / weight bytes; the stats line prints the achieved
bandwidth next to tokens/s so you can see how close to that limit it runs:

    bandwidth = bytes of weights read per step * tokens/s   (KV cache reads reported apart)

By default (`--compile auto`) a CPU run decodes with an AOTInductor package (speedups/aot.py):
compiled once per model shape, torch version, CPU and source by a child process, cached on disk,
loaded in a fraction of a second later, with no compiler in this process; where none can serve
(CUDA, speculation, torchrun, a failed build) it decodes eager, and says why if a build failed.
`--compile off` is eager. `--compile` (jit) compiles the step in process once per attend length
(fullgraph, static shapes, a few graphs per run; on CUDA each replays as a CUDA Graph); compile time
is reported apart and never counted in tokens/s. `--json` prints one JSON object per sample instead
of text, for scripts and tests. `--interactive` is a chat that prefills only each turn's new tokens;
`--draft_checkpoint`, `--draft_layers` and `--prompt_lookup` decode through speculative.py. This
file is the command line on top of the library (runtime.py holds the prefill and decode steps and
compiling them).
"""

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

import constrain
import tp
from formats.tokenizer import load_tokenizer
from kv_cache import StaticKVCache
from runtime import (
    COMPILE_MODES,
    DTYPES,
    autotune,
    compile_decode,
    compile_default,
    compile_lengths,
    compiled_message,
    configure_inductor_cpu,
    cpu_capability,
    decode_one,
    human,
    log,
    memory_plan,
    peak_memory_bytes,
    pick_device,
    prefill,
    skip_guards,
    verify_step,
)
from sampling import SamplingParams, parse_logit_bias, sample
from speculative import ModelDrafter, draft_forward, speculative_generate
from speedups import aot
from speedups.kv_int8 import Int8KVCache
from speedups.kv_window import WindowedKVCache
from speedups.prompt_lookup import PromptLookupDrafter
from text_stream import Printer


@dataclass
class DecodeOptions:
    """How generate() runs, beyond what it decodes; every field has a default."""

    generator: torch.Generator = None  # sampling's random source (seeded by --seed)
    stop_ids: tuple = ()  # a row's output ends after the first of these
    ignore_eos: bool = False  # decode exactly max_new_tokens (benchmarks)
    decode_fn: Callable = decode_one  # runtime.decode_one, or a compiled twin of it
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


def parse_args(argv):
    class Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
        pass

    p = argparse.ArgumentParser(description=__doc__, formatter_class=Formatter)
    add_prompt_args(p)
    add_sampling_args(p)
    add_run_args(p)
    add_weight_args(p)
    constrain.add_args(p)
    add_speculation_args(p)
    args = p.parse_args(argv)
    for name in ("max_new_tokens", "num_samples", "batch_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    try:  # JSONDecodeError is a ValueError
        args.logit_bias = json.loads(args.logit_bias) if args.logit_bias else None
        SamplingParams.from_fields(args)  # checks every sampling flag
        args.constraint = constrain.from_args(args)
    except ValueError as e:
        p.error(f"--logit_bias is not JSON: {e}" if isinstance(e, json.JSONDecodeError) else str(e))
    return args


def add_prompt_args(p):
    """What to generate from, and how much."""
    p.add_argument(
        "--checkpoint",
        default=None,
        help="HF folder, .gguf file or Hub id (default: embedded SmolLM2-135M)",
    )
    p.add_argument(
        "--prompt",
        default="Hello, my name is",
        help="the text to continue (or, with --chat, the message)",
    )
    p.add_argument(
        "--chat", action="store_true", help="wrap the prompt in the model's chat template"
    )
    p.add_argument(
        "--interactive",
        action="store_true",
        help="a chat loop; each turn prefills only what is new",
    )
    p.add_argument(
        "--max_new_tokens", type=int, default=200, help="most tokens to generate per sample"
    )
    p.add_argument(
        "--max_seq_len",
        type=int,
        default=None,
        help="KV cache length (default: prompt + max_new_tokens, rounded up)",
    )


def add_sampling_args(p):
    """How each token is chosen (sampling.py), and how many samples."""
    p.add_argument("--temperature", type=float, default=0.8, help="0 means greedy")
    p.add_argument(
        "--top_k", type=int, default=200, help="sample among the k most likely tokens (>= 1)"
    )
    p.add_argument(
        "--top_p",
        type=float,
        default=1.0,
        help="sample among the most likely tokens reaching this probability, in (0, 1]",
    )
    p.add_argument(
        "--min_p",
        type=float,
        default=0.0,
        help="drop tokens less likely than min_p x the likeliest, in [0, 1]",
    )
    p.add_argument(
        "--repetition_penalty",
        type=float,
        default=1.0,
        help="> 0: divides positive, multiplies negative logits of seen tokens",
    )
    p.add_argument(
        "--frequency_penalty",
        type=float,
        default=0.0,
        help="in [-2, 2]: minus this x each token's count in the output",
    )
    p.add_argument(
        "--presence_penalty",
        type=float,
        default=0.0,
        help="in [-2, 2]: minus this for each token in the output",
    )
    p.add_argument(
        "--logit_bias",
        default=None,
        help='JSON {"token id": bias}: added to the logits, clamped to [-100, 100]',
    )
    p.add_argument("--seed", type=int, default=None, help="makes sampling reproducible")
    p.add_argument(
        "--ignore_eos", action="store_true", help="do not stop at stop tokens (benchmarks)"
    )
    p.add_argument("--num_samples", type=int, default=1, help="samples generated one after another")
    p.add_argument(
        "--batch_size", type=int, default=1, help="samples of the prompt decoded together"
    )


def add_run_args(p):
    """Where and how the steps run, and what is reported."""
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument(
        "--dtype", default="bfloat16", choices=sorted(DTYPES), help="weights and activations"
    )
    p.add_argument(
        "--compile",
        nargs="?",
        const="jit",
        choices=COMPILE_MODES,
        default=compile_default(),
        help="the decode step: auto (default; $LLM_COMPILE): aot where it can serve, else eager; off: eager; jit (plain "
        "--compile): torch.compile (CUDA Graphs on GPU); aot: a package cached on disk, no compiler in the process (speedups/aot.py)",
    )
    p.add_argument(
        "--compile_prefill", action="store_true", help="compile prefill too (dynamic prompt length)"
    )
    p.add_argument(
        "--profile", default=None, metavar="PATH", help="write a torch.profiler trace of generation"
    )
    p.add_argument(
        "--json", action="store_true", help="one JSON object per sample on stdout, no streamed text"
    )


def add_weight_args(p):
    """Weight formats (quantize.py) and the KV cache's kind."""
    g = p.add_argument_group("quantization (quantize.py)")
    g.add_argument(
        "--quantize",
        default=None,
        choices=("int8", "int4"),
        help="weight-only quantization at load time (a GGUF file is dequantized first)",
    )
    g.add_argument(
        "--dequantize",
        action="store_true",
        help="run a GGUF file's quantized weights as --dtype (default: at the file's own bits)",
    )
    g.add_argument("--groupsize", type=int, default=64, help="int4 group size: 32, 64, 128 or 256")
    g.add_argument(
        "--quantize_head",
        action="store_true",
        help="quantize the output head too (the largest matrix of small models)",
    )
    g.add_argument(
        "--quantize_embedding", action="store_true", help="store the embedding table int8"
    )
    g.add_argument(
        "--kv_cache_dtype",
        default="model",
        choices=("model", "int8"),
        help="int8: K/V stored int8 with per-token scales",
    )
    p.add_argument(
        "--cache",
        default="static",
        choices=("static", "paged"),
        help="KV cache: kv_cache.py's static buffers or paged.py's block pool (same tokens; compare speed)",
    )
    p.add_argument("--block_size", type=int, default=16, help="tokens per block of the paged cache")


def add_speculation_args(p):
    """Speculative decoding from the command line (speculative.py)."""
    g = p.add_argument_group("speculative decoding (speculative.py; batch 1, eager)")
    g.add_argument(
        "--draft_checkpoint", default=None, help="a smaller model with the same tokenizer drafts"
    )
    g.add_argument(
        "--draft_layers",
        type=int,
        default=None,
        help="the target's own first N layers draft (LayerSkip)",
    )
    g.add_argument(
        "--prompt_lookup",
        type=int,
        default=None,
        metavar="N",
        help="draft by copying after the longest matching n-gram, n <= N",
    )
    g.add_argument("--speculate_k", type=int, default=4, help="tokens drafted per round")
    g.add_argument(
        "--draft_quantize",
        default=None,
        choices=("int8", "int4"),
        help="quantize the draft model (--draft_checkpoint)",
    )


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
            f"--max_seq_len {seq_len} is smaller than prompt ({prompt_len}) + --max_new_tokens ({max_new_tokens})"
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
                "--cache paged stores K/V in the model's dtype; --kv_cache_dtype int8 needs --cache static"
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
    from formats import weights

    device = pick_device(args.device)
    if not args.interactive and not args.prompt:
        raise ValueError("the prompt is empty; give some text with --prompt")
    args.compile = aot.choose(
        args, device
    )  # auto: "auto" where a package can serve, else None (eager)
    rank, world = tp.init()  # (0, 1) unless started by torchrun with several processes
    if world > 1:
        tp.quiet_unless_rank_zero(rank)
        device = f"cuda:{torch.cuda.current_device()}" if device.startswith("cuda") else device
    model, info = weights.load_for_inference(
        device=device, dtype=DTYPES[args.dtype], shard=(rank, world), log=log, **load_flags(args)
    )
    if world > 1:
        tp.check_same_checkpoint(model)
        tp.parallelize(model)
        args.seed = tp.shared_seed(args.seed)
        log(
            f"tensor parallel over {world} ranks: this rank holds {human(model.weight_bytes())} of weights"
        )
    parse_logit_bias(args.logit_bias, model.config.vocab_size)  # its ids in this model's vocabulary
    tokenizer = load_tokenizer(info.source)
    weights.settle()
    log(
        f"loaded {info.source} ({info.format}, {human(info.weight_bytes)} as {args.dtype}) in {info.load_s:.2f} s"
        + (f"\nat the file's own bits: {info.own_bits}" if info.own_bits else "")
    )
    if args.interactive:
        return interactive(args, model, tokenizer, device)
    if args.draft_checkpoint or args.draft_layers or args.prompt_lookup:
        return run_speculative(args, model, tokenizer, device)

    ids = encode_prompt(args, tokenizer)
    seq_len = plan_seq_len(model.config, len(ids), args.max_new_tokens, args.max_seq_len)
    cache = make_cache(
        model, args.batch_size, seq_len, args.cache, args.kv_cache_dtype, args.block_size
    )
    log(memory_plan(model, cache))
    decode_fn, prefill_fn, compile_s = decode_one, prefill, 0.0
    if args.compile or args.compile_prefill:
        decode_fn, prefill_fn, compile_s = warm_up(args, model, cache, device, len(ids))
        if args.compile == "jit":  # speedups/aot.py says what it did
            log(compiled_message(compile_s, model, device))
    prompt = torch.tensor([ids] * args.batch_size, device=device)
    generator, params = make_generator(device, args.seed), SamplingParams.from_fields(args)
    profiler = torch.profiler.profile() if args.profile else contextlib.nullcontext()
    with profiler:
        for _ in range(args.num_samples):
            stream = not args.json and args.batch_size == 1
            printer = Printer(tokenizer, tokenizer.stop_ids if not args.ignore_eos else ())
            if stream:
                print(args.prompt if not args.chat else "", end="", flush=True)
            matchers = constrain.row_matchers(
                args.constraint, tokenizer, model.config.vocab_size, args.batch_size
            )
            rows, timing = generate(
                model,
                cache,
                prompt,
                args.max_new_tokens,
                params,
                DecodeOptions(
                    generator=generator,
                    stop_ids=tokenizer.stop_ids,
                    ignore_eos=args.ignore_eos,
                    decode_fn=decode_fn,
                    prefill_fn=prefill_fn,
                    on_token=printer if stream else None,
                    matchers=matchers,
                ),
            )
            if stream:
                printer.flush()
            report(
                args, model, cache, tokenizer, ids, rows, timing, info, compile_s, device, stream
            )
    if args.profile:
        profiler.export_chrome_trace(args.profile)
        log(f"profile written to {args.profile}")
    return 0


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
        common = next(
            (i for i, (a, b) in enumerate(zip(cached, ids)) if a != b), min(len(cached), len(ids))
        )
        common = (
            min(common, len(ids) - 1)
            if len(cached) - common <= getattr(cache, "rewind_limit", len(cached))
            else 0
        )
        if len(ids) + args.max_new_tokens > seq_len:
            log(
                f"the conversation ({len(ids)} tokens) + --max_new_tokens would exceed --max_seq_len {seq_len}; ending"
            )
            break
        if (
            args.compile == "jit"
        ):  # the step's graphs for the lengths this turn can reach, before it starts
            start, before = time.perf_counter(), len(compiled)
            compiled = compile_lengths(
                decode_fn, model, cache, len(ids), len(ids) + args.max_new_tokens - 1, compiled
            )
            if len(compiled) > before:
                log(
                    f"[compiled the decode step for {len(compiled) - before} more attend lengths in {time.perf_counter() - start:.1f} s]"
                )
        printer = Printer(tokenizer, tokenizer.stop_ids)
        prompt = torch.tensor([ids[common:]], device=device)
        rows, timing = generate(
            model,
            cache,
            prompt,
            args.max_new_tokens,
            params,
            DecodeOptions(
                generator=generator,
                stop_ids=tokenizer.stop_ids,
                ignore_eos=False,
                decode_fn=decode_fn,
                start_pos=common,
                on_token=printer,
                context=torch.tensor([ids], device=device),
            ),
        )
        printer.flush()
        print()
        log(
            f"[{len(ids) - common} new prompt tokens of {len(ids)}, {timing['tokens_per_s']:.1f} tokens/s]"
        )
        reply = rows[0]
        cached = ids + reply[:-1] if reply and reply[-1] in tokenizer.stop_ids else ids + reply
        messages.append({"role": "assistant", "content": printer.text.sent})
    return 0


def run_speculative(args, model, tokenizer, device) -> int:
    """--draft_checkpoint / --draft_layers / --prompt_lookup: speculative.py's loop, batch 1."""
    if args.batch_size != 1 or args.compile_prefill:
        raise ValueError(
            "speculative decoding here runs at --batch_size 1 (and without --compile_prefill)"
        )
    if args.draft_quantize and not args.draft_checkpoint:
        raise ValueError(
            "--draft_quantize applies to a --draft_checkpoint model (layer-skip drafts share the target's weights)"
        )
    if args.speculate_k < 1:
        raise ValueError(f"--speculate_k must be >= 1, got {args.speculate_k}")
    ids = encode_prompt(args, tokenizer)
    seq_len = plan_seq_len(model.config, len(ids), args.max_new_tokens, args.max_seq_len)
    params, generator = SamplingParams.from_fields(args), make_generator(device, args.seed)
    tune = autotune(
        model
    )  # --compile: one static graph per shape (verify k + 1 tokens, verify 1, a draft step)
    verify_fns = (
        {t: compile_decode(device, verify_step, tune) for t in (1, args.speculate_k + 1)}
        if args.compile
        else {}
    )
    drafter, label = make_drafter(args, model, seq_len, params, device, tune)
    cache = make_cache(model, 1, seq_len, args.cache, args.kv_cache_dtype, args.block_size)
    log(memory_plan(model, cache))
    compile_s = (
        warm_up_speculative(args, model, cache, drafter, ids, params, verify_fns, device)
        if args.compile
        else 0.0
    )
    for _ in range(args.num_samples):
        printer = Printer(tokenizer, tokenizer.stop_ids if not args.ignore_eos else ())
        if not args.json:
            print(args.prompt if not args.chat else "", end="", flush=True)
        tokens, stats = speculative_generate(
            model,
            cache,
            drafter,
            ids,
            args.max_new_tokens,
            params,
            args.speculate_k,
            generator,
            tokenizer.stop_ids,
            args.ignore_eos,
            on_token=None if args.json else printer,
            verify_fns=verify_fns,
        )
        drafter.rollback(0)  # the next sample starts from an empty sequence
        per_draft, per_round = (
            stats["draft_s"] / max(stats["drafted"], 1),
            stats["target_s"] / max(stats["rounds"], 1),
        )
        stats.update(compile_s=compile_s, cost_ratio=per_draft / per_round)
        text = tokenizer.decode(
            [t for t in tokens if args.ignore_eos or t not in tokenizer.stop_ids]
        )
        if args.json:
            print(
                json.dumps({"prompt_tokens": ids, "tokens": tokens, "text": text, "stats": stats}),
                flush=True,
            )
        else:
            printer.flush()
            print(flush=True)
        log(
            f"speculative ({label}, k={args.speculate_k}): {len(tokens)} tokens in {stats['rounds']} rounds | "
            f"acceptance {stats['acceptance_rate']:.2f} | {stats['tokens_per_round']:.2f} tokens/round | "
            f"draft/target step cost c={stats['cost_ratio']:.2f} | {stats['tokens_per_s']:.2f} tokens/s"
        )
    return 0


def make_drafter(args, model, seq_len, params, device, tune):
    """(drafter, label) for the flags: prompt lookup, the target's first layers, or a draft
    model."""
    from formats import weights

    step_fn = (
        compile_decode(device, draft_forward, tune and not args.draft_quantize)
        if args.compile
        else None
    )
    if args.prompt_lookup:
        return PromptLookupDrafter(
            args.prompt_lookup, model.config.vocab_size
        ), f"prompt lookup n<={args.prompt_lookup}"
    if args.draft_layers:
        if not 1 <= args.draft_layers < model.config.n_layers:
            raise ValueError(
                f"--draft_layers must be between 1 and {model.config.n_layers - 1} for this model, got {args.draft_layers}"
            )
        return ModelDrafter(
            model, seq_len, params, layers=args.draft_layers, step_fn=step_fn
        ), f"first {args.draft_layers} layers"
    draft, _ = weights.load_for_inference(
        args.draft_checkpoint,
        device,
        DTYPES[args.dtype],
        args.draft_quantize,
        args.groupsize,
        log=lambda line: log("draft: " + line),
    )
    if draft.config.vocab_size != model.config.vocab_size:
        raise ValueError(
            f"the draft's vocabulary ({draft.config.vocab_size}) differs from the target's "
            f"({model.config.vocab_size}); a draft must share the target's tokenizer"
        )
    return ModelDrafter(
        draft, seq_len, params, step_fn=step_fn
    ), f"draft model {args.draft_checkpoint}"


def warm_up_speculative(args, model, cache, drafter, ids, params, verify_fns, device) -> float:
    """Compile now, on the real prompt, so compile time stays out of tokens/s; returns its
    seconds."""
    start = time.perf_counter()
    speculative_generate(
        model,
        cache,
        drafter,
        ids,
        3 * args.speculate_k + 2,
        params,
        args.speculate_k,
        ignore_eos=True,
        verify_fns=verify_fns,
    )
    for t, fn in verify_fns.items():  # every shape, even those the warm-up did not reach
        with torch.no_grad():
            fn(
                model,
                cache,
                torch.zeros(1, t, dtype=torch.long, device=device),
                torch.arange(t, device=device)[None],
            )
    drafter.rollback(0)
    compile_s = time.perf_counter() - start
    log(compiled_message(compile_s, model, device))
    return compile_s


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


def load_flags(args) -> dict:
    """The flags that say how weights.load_for_inference builds the model (besides device and
    dtype)."""
    names = (
        "checkpoint",
        "quantize",
        "groupsize",
        "quantize_head",
        "quantize_embedding",
        "dequantize",
    )
    return {name: getattr(args, name) for name in names}


def decode_step(args, model, cache, device):
    """The decode step --compile chose: decode_one, torch.compile'd (jit) or ahead of time (aot)."""
    if args.compile in (
        "aot",
        "auto",
    ):  # the child builds the model from the same flags; auto: eager if it fails
        return aot.decode_step(
            model, cache, {**load_flags(args), "dtype": args.dtype}, fallback=args.compile == "auto"
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
        f"first token {stats['time_to_first_token_s']:.3f} s | peak memory {human(stats['peak_memory_bytes'])} | "
        f"{device} ({stats['cpu_capability']}) | " + memory_plan(model, cache)
    )


if __name__ == "__main__":
    sys.exit(main())
