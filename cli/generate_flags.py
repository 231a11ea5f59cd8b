"""generate.py's command line: its flags in groups (the prompt, sampling, where and how the steps
run, weight formats and the KV cache, constraints, speculative decoding), checked as they are
read so a bad flag fails before any weights load.

    args = parse_args(["--prompt", "Hi", "--temperature", "0"], description=generate.__doc__)
    args.constraint   # constrain.py's parsed constraint, or None
"""

import argparse
import json
import os

import constrain
from compiling import COMPILE_MODES, compile_default
from memory import parse_size
from runtime import DTYPES
from sampling import SamplingParams
from server import engine_flags


def parse_args(argv, description: str):
    class Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
        pass

    p = argparse.ArgumentParser(description=description, formatter_class=Formatter)
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
    if (args.lora_scale != 1.0 or args.merge_lora) and not args.lora:
        p.error("--lora_scale and --merge_lora need --lora PATH")
    speculating = args.draft_checkpoint or args.draft_layers or args.prompt_lookup
    if args.kv_disk_cache and os.environ.get("WORLD_SIZE", "1") != "1":
        p.error("--kv_disk_cache runs in one process; leave out torchrun")
    if args.kv_disk_cache and (args.cache != "paged" or args.interactive or speculating):
        p.error(
            "--kv_disk_cache keeps a paged cache's blocks: give --cache paged (one prompt, no "
            "--interactive or speculative decoding)"
        )
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
        help="the decode step: auto (default; $LLM_COMPILE): aot where it can serve, else eager; "
        "off: eager; jit (plain --compile): torch.compile (CUDA Graphs on GPU); aot: a package "
        "cached on disk, no compiler in the process (speedups/aot.py)",
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
    engine_flags.add_quantize_args(g)  # --quantize, --dequantize: the engine's own
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
        help="KV cache: kv_cache.py's static buffers or paged.py's block pool (same tokens; "
        "compare speed)",
    )
    p.add_argument("--block_size", type=int, default=16, help="tokens per block of the paged cache")
    p.add_argument(
        "--kv_disk_cache",
        default=None,
        metavar="DIR",
        help="with --cache paged: the prompt's K/V blocks kept in DIR, and a later run's prompt "
        "with the same head loads them instead of computing them (speedups/kv_disk.py)",
    )
    p.add_argument(
        "--kv_disk_cache_size",
        type=parse_size,
        default=parse_size("20GiB"),
        help="most bytes --kv_disk_cache keeps, oldest dropped first",
    )
    g = p.add_argument_group("a LoRA adapter (speedups/lora.py)")
    g.add_argument("--lora", default=None, metavar="PATH", help="a PEFT LoRA adapter folder")
    g.add_argument("--lora_scale", type=float, default=1.0, help="the adapter's delta times this")
    g.add_argument(
        "--merge_lora",
        action="store_true",
        help="add the adapter into the float weights once (base speed) instead of on the fly",
    )


def add_speculation_args(p):
    """Speculative decoding from the command line (speculative.py)."""
    g = p.add_argument_group(
        "speculative decoding (speculative.py; batch 1, compiled as --compile says)"
    )
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
    g.add_argument(
        "--speculate_k",
        type=int,
        default=3,
        help="tokens drafted per round (3: a verify step of 4 tokens fills one row block of the "
        "CPU int4 kernel, benchmarks/RESULTS.md)",
    )
    g.add_argument(
        "--draft_quantize",
        default=None,
        choices=("int8", "int4"),
        help="quantize the draft model (--draft_checkpoint)",
    )


def load_flags(args) -> dict:
    """The flags that say how weights.load_for_inference builds the model (besides device and
    dtype): generate.py's load, and the child that compiles its packages (speedups/aot.py)."""
    names = (
        "checkpoint",
        "quantize",
        "groupsize",
        "quantize_head",
        "quantize_embedding",
        "dequantize",
    )
    return {name: getattr(args, name) for name in names}


def package_load(args) -> dict:
    """load_flags with the dtype by name: how the child building a package loads the model
    (speedups/aot.decode_step)."""
    return {**load_flags(args), "dtype": args.dtype}
