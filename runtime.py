"""What every entry point shares: the model's steps, compiling them, devices, dtypes and memory
(the engine's command-line flags are server/engine_flags.py's).

    logits = prefill(model, cache, tokens[B, T])               # -> [B, V], the next token's logits
    logits = decode_one(model, cache, token[B, 1], pos[B, 1])  # -> [B, V], the step --compile compiles
    step = compile_decode("cpu")                               # the same step, compiled once

A decode step has static shapes (positions are tensors, so advancing them never recompiles), so it
compiles once per attend length of the static cache (kv_cache.py: a bucket of the positions in use,
which generate.generate sets before each step): on CUDA it then replays as a CUDA Graph (mode
"reduce-overhead"); on CPU the weights are frozen as constants and GEMMs autotuned against
Inductor's C++ templates. Inductor's C++ code and ATen's kernels both depend on the CPU's
instruction set (AVX2, AVX-512, AMX), which ATEN_CPU_CAPABILITY=default|avx2|avx512 lowers:
compile_decode keeps the two in step.

This file imports only torch, so any other file of the project can use it.
"""

import argparse
import contextlib
import os
import resource
import sys

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class CheckpointError(ValueError):
    """A checkpoint that cannot be used, with the file and the reason."""


class TokenizerError(ValueError):
    """A tokenizer that cannot be built or used, with the file and the reason."""


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024


def pick_device(name):
    if name is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(
            f"--device {name}: CUDA is not available on this machine (no GPU or a CPU-only PyTorch); use --device cpu"
        )
    if not name.startswith(("cpu", "cuda")):
        raise ValueError(f"--device {name}: expected cpu or cuda")
    return name


def cpu_capability() -> str:
    """The instruction set ATen dispatches to on this CPU ("AVX512", "AVX2", "DEFAULT", ...); set
    ATEN_CPU_CAPABILITY=default|avx2|avx512 to choose a lower one."""
    return torch.backends.cpu.get_cpu_capability()


# ---- the model's steps -------------------------------------------------------------------------


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


# ---- compiling ---------------------------------------------------------------------------------


def inductor_vector_bits():
    """The vector width for Inductor's C++ code, matched to the instruction set ATen dispatches to
    (ATEN_CPU_CAPABILITY): 512 (AVX-512, or AMX where present), 256 (AVX2). Left to Inductor, parts
    of it use the CPU's widest set while its loops follow ATEN_CPU_CAPABILITY, and under avx2 on an
    AVX-512 CPU that mix computed NaNs. Under "default" (no SIMD in ATen) Inductor's code still uses
    AVX2 where the CPU has it: its scalar fallback fails to compile some masked loads (torch
    2.13)."""
    from torch._inductor.cpu_vec_isa import valid_vec_isa_list

    widths = sorted({isa.bit_width() for isa in valid_vec_isa_list()})
    want = {"AVX512": 512, "AVX2": 256}.get(cpu_capability(), widths[0] if widths else None)
    return want if want in widths else None  # None: Inductor's own choice (other CPUs)


def has_amx() -> bool:
    """Whether the CPU has AMX tiles (and ATen may use them: ATEN_CPU_CAPABILITY not lowered)."""
    return (
        cpu_capability() == "AVX512"
        and getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
    )


def autotune(model) -> bool:
    """Whether max-autotune pays for this model on this CPU, as measured (benchmarks/RESULTS.md,
    "Batch-1 speed by instruction set"): not where a layer says it does not (int4's kernel gains
    nothing from it and its search takes many GiB); not for a model whose matrices are all bf16 on
    an AVX-512 CPU without AMX, where Inductor's bf16 GEMM templates ran slower than the oneDNN
    kernels freezing prepacks, at twice the compile time. Float32, int8, and bf16 under AVX2 gain
    from it; AMX is what it is for."""
    if not all(getattr(m, "compile_autotune", True) for m in model.modules()):
        return False
    matrices = [
        m.weight
        for m in model.modules()
        if isinstance(getattr(m, "weight", None), torch.Tensor) and m.weight.dim() == 2
    ]
    dense_bf16 = all(w.dtype == torch.bfloat16 and w.device.type == "cpu" for w in matrices)
    return not (dense_bf16 and cpu_capability() == "AVX512" and not has_amx())


def compiled_message(seconds: float, model, device) -> str:
    """The line generate.py prints after compiling: its time, and on CPU whether max-autotune
    ran."""
    return f"compiled in {seconds:.1f} s" + (
        f" (max-autotune {'on' if autotune(model) else 'off'})" if device == "cpu" else ""
    )


def static_cache(cache):
    """Mark the cache's tensors as living at fixed addresses: a CUDA Graph may then write them in
    place. Unmarked, Inductor sees a mutated graph input and skips CUDA Graphs for the whole
    step."""
    if getattr(cache, "static_marked", False):  # once per cache
        return cache
    cache.static_marked = True
    for value in vars(cache).values():
        for t in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(t, torch.Tensor) and t.is_cuda:
                torch._dynamo.mark_static_address(t)
    return cache


COMPILE_MODES = (
    "auto",
    "off",
    "jit",
    "aot",
)  # --compile's choices (generate.py, batch.py, serve.py)


def compile_default() -> str:
    """--compile's default: $LLM_COMPILE, else auto."""
    value = os.environ.get("LLM_COMPILE", "auto")
    if value not in COMPILE_MODES:
        raise SystemExit(f"error: LLM_COMPILE={value!r}: expected auto, off, jit or aot")
    return value


def compile_decode(device: str, fn=decode_one, autotune: bool = True):
    """The decode step compiled once. On CUDA: CUDA Graphs ("reduce-overhead") remove per-kernel
    launch cost. On CPU: weights frozen as constants (prepacked for oneDNN) and, with autotune,
    GEMMs autotuned against Inductor's C++ templates, which use AMX where the CPU has it: at batch 1
    bf16 this is well ahead of eager, whose bf16 matrix-vector products are slow on CPU
    (benchmarks/RESULTS.md, "Batch-1 decode on CPU: generate.py against Hugging Face
    transformers")."""
    import torch._dynamo

    # one graph per attend length of a static cache (kv_cache.py: 13 for the 8192 slots of a whole
    # context) per cache shape: more than dynamo's default of 8 per function, past which it runs
    # eagerly
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    if str(device).startswith("cuda"):
        step = torch.compile(fn, fullgraph=True, dynamic=False, mode="reduce-overhead")
        return lambda model, cache, *args: step(model, static_cache(cache), *args)
    configure_inductor_cpu()
    # dynamic=False: a cache of another length gets its own static graph, never a slow dynamic one
    return torch.compile(
        fn, fullgraph=True, dynamic=False, mode="max-autotune" if autotune else None
    )


def compile_lengths(
    decode_fn, model, cache, first: int, end: int, done: frozenset = frozenset()
) -> set:
    """Run the decode step for every attend length (kv_cache.py's use_positions) that decode steps
    at positions first..end-1 reach and `done` lacks, so that each graph compiles now, not in the
    middle of a reply. Each length L runs at position L - 1 >= first, a slot no cached token uses
    and a later step overwrites before any query reads it. Returns the lengths now compiled."""
    use = getattr(
        cache, "use_positions", lambda n: 1
    )  # the paged cache: one graph, run at position 0
    lengths = {use(n + 1) for n in range(first, end)} - done
    B, device = cache.batch_size, model.norm.weight.device
    with torch.no_grad():
        for length in sorted(lengths):
            use(length)
            for _ in range(3):  # CUDA Graphs record on the second or third call
                decode_fn(
                    model,
                    cache,
                    torch.zeros(B, 1, dtype=torch.long, device=device),
                    torch.full((B, 1), length - 1, dtype=torch.long, device=device),
                )
    use(None)
    return done | lengths


def configure_inductor_cpu():
    import torch._inductor.config

    torch._inductor.config.freezing = True  # inference only: parameters never change after this
    torch._inductor.config.max_autotune_report_choices_stats = False  # keep stderr readable
    torch._inductor.config.cpp.simdlen = inductor_vector_bits()


def skip_guards(enabled: bool):
    """After the first decode step has checked every guard of the compiled function (compiling
    if needed), the rest of the loop passes the same model and cache, with the same shapes.
    Re-checking hundreds of guards per step is a visible share of a CPU step (benchmarks/RESULTS.md,
    "What the profile says"), so only the guards that choose between compiled graphs are
    evaluated. A step that changes what selects a graph (a static cache's attend length) must
    check them all: with one graph compiled so far, skipping would rerun it for the new length,
    silently (generate.generate does so)."""
    return (
        torch.compiler.set_stance("default", skip_guard_eval_unsafe=True)
        if enabled
        else contextlib.nullcontext()
    )


# ---- memory ------------------------------------------------------------------------------------


def available_memory(device: str) -> int:
    """Bytes free on the device now: CUDA's free memory, or the OS's MemAvailable on CPU."""
    if str(device).startswith("cuda"):
        return torch.cuda.mem_get_info()[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30


def parse_size(text: str) -> int:
    """'2GiB', '512MiB', '1.5GB', '1000000' -> bytes."""
    units = {
        "": 1,
        "b": 1,
        "kb": 1e3,
        "mb": 1e6,
        "gb": 1e9,
        "kib": 2**10,
        "mib": 2**20,
        "gib": 2**30,
    }
    t = text.strip().lower()
    number = t.rstrip("bikmg")
    try:
        return int(float(number) * units[t[len(number) :]])
    except (KeyError, ValueError):
        raise argparse.ArgumentTypeError(
            f"cannot read {text!r} as a size (e.g. 2GiB, 512MiB, 1GB)"
        ) from None


def reset_peak_memory(device: str):
    if str(device).startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    else:
        try:  # Linux: "5" resets this process's peak resident set size (VmHWM)
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass


def release_memory():
    """Hand freed heap pages back to the OS (glibc's malloc_trim). Loading builds and frees many
    mid-sized temporaries; glibc keeps them, so the resident size would stay at the load's peak."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


def peak_memory_bytes(device: str) -> int:
    """Peak GPU memory allocated, or on CPU the process's peak resident set size."""
    if str(device).startswith("cuda"):
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def weights_line(model) -> str:
    """Weight bytes and the bytes a decode step reads (with experts: parameters, total and
    active)."""
    line = f"weights {human(model.weight_bytes())} ({human(model.bytes_read_per_token())} read per step) | "
    if model.config.moe:  # moe.py: a step reads only the experts its tokens chose
        m, (total, active) = model.config.moe, model.config.moe.parameter_counts(model.config)
        line += (
            f"{total / 1e9:.2f}B parameters, {active / 1e9:.2f}B active per token "
            f"({m.n_experts_per_tok} of {m.n_experts} experts) | "
        )
    return line


def memory_plan(model, cache) -> str:
    """The line generate.py prints: weight bytes, and the KV cache as bytes per token x tokens."""
    weights = weights_line(model)
    if hasattr(cache, "block_size"):  # paged: the pool, block 0 being the null block
        per_block = cache.nbytes() / cache.num_blocks
        return weights + (
            f"paged KV cache {human(per_block / cache.block_size)}/token x {cache.block_size} tokens per block "
            f"x {cache.num_blocks} blocks = {human(cache.nbytes())}"
        )
    rings = [
        r for r in getattr(cache, "ring", ()) if r
    ]  # speedups/kv_window.py: windowed layers keep only their window
    if rings:
        full = sum(
            t.numel() * t.element_size() * cache.max_seq_len // t.shape[2] for t in cache.tensors()
        )
        return weights + (
            f"KV cache {human(cache.nbytes())}: {len(rings)} of {len(cache.ring)} layers windowed, kept as "
            f"rings of {max(rings)} slots ({human(full)} if every layer kept {cache.max_seq_len} tokens "
            f"x {cache.batch_size})"
        )
    per_token = cache.nbytes() / (cache.max_seq_len * cache.batch_size)
    return (
        weights
        + f"KV cache {human(per_token)}/token x {cache.max_seq_len} tokens x {cache.batch_size} = {human(cache.nbytes())}"
    )
