"""The engine's command-line flags, which batch.py and serve.py share: the model and how it runs,
the paged KV pool and the scheduler, speculation. `engine_options(args)` turns their values into
server/tp_engine.py's `load_engine` keywords, so both entry points build the same engine.

    python -c "from server import engine_flags"     # library only; batch.py and serve.py use it
"""

from compiling import COMPILE_MODES, compile_default
from memory import parse_size
from sequence import POOLINGS


def add_engine_args(p):
    """Every engine flag on the argparse parser p, in four groups."""
    add_model_args(p)
    add_cache_args(p)
    add_tier_args(p)
    add_speculation_args(p)
    add_lora_args(p)


def add_model_args(p):
    """The model: which checkpoint, where, in which dtype and weight format, compiled how."""
    p.add_argument(
        "--checkpoint",
        default=None,
        help="HF folder, .gguf file or Hub id (default: embedded SmolLM2-135M)",
    )
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument(
        "--compile",
        nargs="?",
        const="jit",
        choices=COMPILE_MODES,
        default=compile_default(),
        help="decode steps (batch padded to a few sizes): auto (the default, $LLM_COMPILE): aot "
        "where it can serve, else eager; off: eager; jit (plain --compile): torch.compile; aot: an "
        "ahead-of-time package cached on disk (CPU; speedups/aot.py), or an error saying why not",
    )
    p.add_argument(
        "--pooling",
        default=None,
        choices=POOLINGS,
        help="how an embedding pools the final states: the last token's, their mean, the first's "
        "(default: the checkpoint's sentence-transformers files; formats/pooling.py)",
    )
    add_quantize_args(p)


def add_quantize_args(p):
    """The weight format at load time (generate.py's flags share these)."""
    p.add_argument(
        "--quantize",
        default=None,
        choices=("int8", "int4"),
        help="weight-only quantization at load time (a GGUF file is dequantized first)",
    )
    p.add_argument(
        "--dequantize",
        action="store_true",
        help="run a GGUF file's quantized weights as --dtype (default: at the file's own bits)",
    )


def add_cache_args(p):
    """The paged KV pool and the scheduler: block size and count, batch limits, admission."""
    p.add_argument("--block_size", type=int, default=16, help="tokens per KV block")
    p.add_argument(
        "--num_blocks",
        type=int,
        default=None,
        help="KV blocks in the pool (overrides --kv_cache_memory; "
        "a hybrid model's full layers' pool: memory.py sizes its windowed layers' own)",
    )
    p.add_argument(
        "--kv_cache_memory",
        type=parse_size,
        default=None,
        help="memory for the KV pool, e.g. 2GiB "
        "(default: 20%% of free memory, at most what max_num_seqs full contexts need)",
    )
    p.add_argument(
        "--gpu_memory_utilization",
        type=float,
        default=0.9,
        help="on CUDA without --num_blocks / --kv_cache_memory: the share of the GPU's memory "
        "for weights, a step's activations, CUDA graphs and the KV cache (which gets the rest)",
    )
    p.add_argument("--max_num_seqs", type=int, default=64, help="most sequences running at once")
    p.add_argument(
        "--max_num_batched_tokens",
        type=int,
        default=512,
        help="most tokens per step (the prefill chunk)",
    )
    p.add_argument(
        "--no_prefix_caching",
        action="store_true",
        help="do not reuse the KV of shared prompt heads",
    )
    p.add_argument(
        "--schedule_policy",
        default="fcfs",
        choices=("fcfs", "lpm", "priority"),
        help="admission order: arrival, longest cached prefix first, or each request's "
        "priority (lower first; then arrival; the lowest preempted first)",
    )
    p.add_argument(
        "--paged_attention",
        default="auto",
        choices=("auto", "flex", "gather"),
        help="how attention reads the KV pool: auto (FlexAttention in place on CUDA; on CPU the "
        "in-place one-token kernel, gathered prefill), flex, or gather (the reference)",
    )
    p.add_argument(
        "--batch_invariant",
        action="store_true",
        help="a request's tokens the same whatever runs beside it "
        "(batch_invariant.py; eager steps, slower prefill)",
    )


def add_tier_args(p):
    """A second tier for the prefix cache's evicted blocks (speedups/kv_tier.py)."""
    p.add_argument(
        "--kv_disk_cache",
        default=None,
        metavar="DIR",
        help="keep prefix blocks the pool evicts as files in DIR, reloaded instead of recomputed, "
        "and still there after a restart (speedups/kv_tier.py)",
    )
    p.add_argument(
        "--kv_disk_cache_size",
        type=parse_size,
        default=parse_size("20GiB"),
        help="most bytes --kv_disk_cache keeps, oldest dropped first (default 20GiB)",
    )
    p.add_argument(
        "--kv_host_cache",
        type=parse_size,
        default=None,
        help="keep evicted prefix blocks in host memory, e.g. 16GiB (pinned for a GPU); with "
        "--kv_disk_cache, in front of the folder",
    )


def add_speculation_args(p):
    """Speculative decoding inside the engine: drafts by prompt lookup or a draft model."""
    p.add_argument(
        "--speculate",
        default=None,
        choices=("prompt_lookup", "draft"),
        help="draft tokens by prompt lookup "
        "(speedups/prompt_lookup.py: faster where outputs quote their prompts) or a draft model "
        "(speedups/draft_model.py) and "
        "verify them in each step: the output is exactly the target's",
    )
    p.add_argument(
        "--draft_checkpoint",
        default=None,
        help="--speculate draft: the draft model (HF folder, .gguf file "
        "or Hub id) with the target's tokenizer, loaded at --dtype",
    )
    p.add_argument(
        "--speculate_k",
        type=int,
        default=4,
        help="most tokens drafted per sequence and step (1..16)",
    )
    p.add_argument(
        "--prompt_lookup_min", type=int, default=1, help="shortest n-gram prompt lookup matches"
    )
    p.add_argument(
        "--prompt_lookup_max", type=int, default=3, help="longest n-gram prompt lookup matches"
    )


def check_engine_args(p, args):
    for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    if not 0 < args.gpu_memory_utilization <= 1:
        p.error(f"--gpu_memory_utilization must be in (0, 1], got {args.gpu_memory_utilization}")
    if args.speculate and not 1 <= args.speculate_k <= 16:
        p.error(f"--speculate_k must be an integer in 1..16, got {args.speculate_k}")
    if (args.speculate == "draft") != bool(args.draft_checkpoint):
        p.error("--speculate draft and --draft_checkpoint go together: give both, or neither")
    if (args.kv_disk_cache or args.kv_host_cache) and args.no_prefix_caching:
        p.error("the KV tier keeps prefix-cache blocks: it needs prefix caching (drop the --no_)")
    if lora_options(args, p) and args.batch_invariant:
        p.error("--batch_invariant runs no LoRA adapters (their products follow the batch)")
    if args.batch_invariant and args.compile in ("jit", "aot"):
        p.error(
            "--batch_invariant runs eager steps (a compiled step's kernels follow its batch); "
            "leave out --compile"
        )


def engine_options(args) -> dict:
    """The values of add_engine_args' flags, as load_engine's keywords."""
    names = (
        "checkpoint",
        "device",
        "dtype",
        "quantize",
        "dequantize",
        "block_size",
        "num_blocks",
        "kv_cache_memory",
        "max_num_seqs",
        "max_num_batched_tokens",
        "schedule_policy",
        "batch_invariant",
        "paged_attention",
        "gpu_memory_utilization",
        "speculate",
        "speculate_k",
        "prompt_lookup_min",
        "prompt_lookup_max",
        "draft_checkpoint",
    )
    return {
        **{n: getattr(args, n) for n in names},
        "compile": args.compile,
        "prefix_caching": not args.no_prefix_caching,
        "kv_tier": tier_options(args),
        "lora": lora_options(args),
    }


def tier_options(args):
    """--kv_disk_cache / --kv_host_cache as load_one_process's kv_tier, or None."""
    if not (args.kv_disk_cache or args.kv_host_cache):
        return None
    return {
        "disk": args.kv_disk_cache,
        "disk_size": args.kv_disk_cache_size,
        "host": args.kv_host_cache,
    }


def add_lora_args(p):
    g = p.add_argument_group("LoRA adapters (speedups/lora.py)")
    g.add_argument(
        "--lora",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="a PEFT LoRA adapter folder served as model NAME (repeat for several)",
    )
    g.add_argument(
        "--max_loras",
        type=int,
        default=None,
        help="adapters resident at once, least recently used evicted (default: 4 with --lora, "
        "else none; give it to load adapters only at run time)",
    )
    g.add_argument(
        "--max_lora_rank",
        type=int,
        default=16,
        help="the largest adapter rank the slots hold",
    )


def lora_options(args, p=None):
    """--lora / --max_loras / --max_lora_rank as load_one_process's `lora`, or None (p: the
    parser, to report a malformed flag; check_engine_args passes it)."""
    pairs = []
    for item in args.lora:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            p and p.error(f"--lora takes NAME=PATH, got {item!r}")
        pairs.append((name, path))
    if len({n for n, _ in pairs}) < len(pairs) and p:
        p.error("--lora: each adapter needs a name of its own")
    slots = args.max_loras if args.max_loras is not None else (4 if pairs else 0)
    if (slots < 0 or args.max_lora_rank < 1 or len(pairs) > slots) and p:
        p.error(
            f"--max_loras ({slots}) must hold every --lora ({len(pairs)}), --max_lora_rank >= 1"
        )
    return {"adapters": pairs, "slots": slots, "rank": args.max_lora_rank} if slots else None


def refuse_under_torchrun(options):
    """ValueError naming the first flag the tensor-parallel engine does not run."""
    flags = {
        "compile": "--compile",
        "speculate": "--speculate",
        "kv_tier": "--kv_disk_cache / --kv_host_cache",
        "batch_invariant": "--batch_invariant",
        "lora": "--lora / --max_loras",
        "paged_attention": "--paged_attention",
    }
    for key, flag in flags.items():
        value = options.get(key)
        if value and (key != "compile" or value in ("jit", "aot", True)) and value != "auto":
            raise ValueError(
                f"{flag} does not run tensor-parallel engine steps yet; leave it out under torchrun"
            )
