"""The model's steps, and compiling them.

    logits = prefill(model, cache, tokens[B, T])               # -> [B, V], the next token's
    logits = decode_one(model, cache, token[B, 1], pos[B, 1])  # -> [B, V], what --compile compiles
    step = compile_decode("cpu")                               # the same step, compiled once

A decode step has static shapes (positions are tensors, so advancing them never recompiles), so it
compiles once per attend length of the static cache (kv_cache.py: a bucket of the positions in use,
which generate.generate sets before each step): on CUDA it then replays as a CUDA Graph (mode
"reduce-overhead"); on CPU the weights are frozen as constants and GEMMs autotuned against
Inductor's C++ templates. Inductor's C++ code and ATen's kernels both depend on the CPU's
instruction set, so compile_decode sets Inductor's vector width from the one ATen uses
(runtime.inductor_vector_bits).

This file imports only torch and runtime.py.
"""

import contextlib
import os

import torch

from runtime import cpu_capability, has_amx, inductor_vector_bits


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
