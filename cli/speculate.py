"""generate.py's speculative decoding (--draft_checkpoint, --draft_layers, --prompt_lookup): the
drafter the flags ask for, the verify steps compiled per length (by default ahead-of-time
packages, speedups/aot.py), speculative.py's loop at batch 1 and its stats line.

    python generate.py --prompt_lookup 3 --speculate_k 3 --temperature 0 --prompt "..."
    python generate.py --draft_layers 12 --compile --prompt "..."

Its stats line reads: acceptance (the share of drafted tokens kept), tokens per round (of the
target's forwards), and c, a draft step's cost over a target round's: speculation pays when
tokens/round > 1 + k * c.
"""

import json
import time

import torch

from cli.generate_flags import package_load
from compiling import autotune, compile_decode, compiled_message, decode_one, verify_step
from runtime import DTYPES, log
from speculative import ModelDrafter, draft_forward, speculative_generate
from speedups import aot
from speedups.prompt_lookup import PromptLookupDrafter
from text_stream import Printer


def check_flags(args):
    """The flags speculation cannot serve here, refused before anything loads (ValueError)."""
    if args.batch_size != 1 or args.compile_prefill:
        raise ValueError(
            "speculative decoding here runs at --batch_size 1 (and without --compile_prefill)"
        )
    if args.draft_quantize and not args.draft_checkpoint:
        raise ValueError(
            "--draft_quantize applies to a --draft_checkpoint model "
            "(layer-skip drafts share the target's weights)"
        )
    if args.speculate_k < 1:
        raise ValueError(f"--speculate_k must be >= 1, got {args.speculate_k}")


def run(args, model, tokenizer, ids: list, seq_len: int, cache, params, generator, device) -> int:
    """ids: the prompt's tokens; cache: a cache of batch 1 and seq_len positions (check_flags has
    passed)."""
    tune = autotune(model)  # --compile: one static graph per shape (verify k + 1, verify 1, draft)
    start = time.perf_counter()
    verify_fns = verify_steps(args, model, cache, device, tune)
    compile_s = time.perf_counter() - start  # the packages' build, where one ran
    drafter, label = make_drafter(args, model, seq_len, params, device, tune)
    if args.compile == "jit":
        compile_s = warm_up(args, model, cache, drafter, ids, params, verify_fns, device)
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
        per_draft = stats["draft_s"] / max(stats["drafted"], 1)
        stats.update(
            compile_s=compile_s,
            cost_ratio=per_draft / (stats["target_s"] / max(stats["rounds"], 1)),
        )
        show(args, tokenizer, printer, ids, tokens, stats)
        log(stats_line(label, args.speculate_k, len(tokens), stats))
    return 0


def verify_steps(args, model, cache, device, tune) -> dict:
    """{T: a compiled verify step of T tokens}: --compile's graphs for 1 and 1 + k tokens; by
    default (--compile auto, aot) the packages, the decode step's for 1 token and a verify
    package for 1 + k (speedups/aot.py); {} under --compile off. Shorter feeds are padded up to
    these (speculative.padded_length)."""
    k = args.speculate_k
    if args.compile == "jit":
        return {t: compile_decode(device, verify_step, tune) for t in (1, k + 1)}
    if args.compile not in ("aot", "auto"):
        return {}
    step = aot.decode_step(
        model, cache, package_load(args), fallback=args.compile == "auto", verify=k + 1
    )
    if step is decode_one:  # (the reason is logged)
        return {}

    def package(model, cache, tokens, pos):  # tokens, pos [1, T] -> logits [1, T, V]
        # the package reads only the slots in use (pos: on the host, where packages run)
        cache.use_positions(int(pos[0, -1]) + 1)
        try:
            logits = step(model, cache, tokens, pos)
        finally:
            cache.use_positions(None)  # the eager forwards (the prompt's) read every slot
        return logits if tokens.shape[1] > 1 else logits[:, None]

    return {1: package} | ({k + 1: package} if f"verify{k + 1}" in step.loaders else {})


def show(args, tokenizer, printer, ids: list, tokens: list, stats: dict):
    """The sample as one JSON line (--json), or the end of the text streamed so far."""
    if not args.json:
        printer.flush()
        print(flush=True)
        return
    text = tokenizer.decode([t for t in tokens if args.ignore_eos or t not in tokenizer.stop_ids])
    line = {"prompt_tokens": ids, "tokens": tokens, "text": text, "stats": stats}
    print(json.dumps(line), flush=True)


def stats_line(label: str, k: int, n_tokens: int, stats: dict) -> str:
    return (
        f"speculative ({label}, k={k}): {n_tokens} tokens in {stats['rounds']} rounds | "
        f"acceptance {stats['acceptance_rate']:.2f} | "
        f"{stats['tokens_per_round']:.2f} tokens/round | "
        f"draft/target step cost c={stats['cost_ratio']:.2f} | {stats['tokens_per_s']:.2f} tokens/s"
    )


def make_drafter(args, model, seq_len, params, device, tune):
    """(drafter, label) for the flags: prompt lookup, the target's first layers, or a draft
    model."""
    from formats import weights

    step_fn = (  # (by default the draft's steps run eager: no package is built for them)
        compile_decode(device, draft_forward, tune and not args.draft_quantize)
        if args.compile == "jit"
        else None
    )
    if args.prompt_lookup:
        drafter = PromptLookupDrafter(args.prompt_lookup, model.config.vocab_size)
        return drafter, f"prompt lookup n<={args.prompt_lookup}"
    if args.draft_layers:
        if not 1 <= args.draft_layers < model.config.n_layers:
            raise ValueError(
                f"--draft_layers must be between 1 and {model.config.n_layers - 1} for this "
                f"model, got {args.draft_layers}"
            )
        drafter = ModelDrafter(model, seq_len, params, layers=args.draft_layers, step_fn=step_fn)
        return drafter, f"first {args.draft_layers} layers"
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
    drafter = ModelDrafter(draft, seq_len, params, step_fn=step_fn)
    return drafter, f"draft model {args.draft_checkpoint}"


def warm_up(args, model, cache, drafter, ids, params, verify_fns, device) -> float:
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
