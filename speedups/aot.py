"""Ahead-of-time compiled decode: the step as an AOTInductor package, run without the compiler.

    python generate.py --prompt "Once upon"  # CPU: the default (--compile auto), a static cache
    python generate.py --prompt_lookup 3 --prompt "..."  # and its verify steps (1 + k tokens)
    python batch.py --requests requests.jsonl  # the engine's decode-only steps, paged cache
                                               # (and with --speculate its verify steps)

--compile auto (generate.py, batch.py, serve.py) uses a package where one can serve and falls back
to eager with the reason in one line (a failed build is remembered in its folder, failed.txt, so
later runs do not build again); --compile aot asks for it and fails instead; --compile off is eager.

Why: `--compile` (torch.compile) keeps dynamo, sympy and Inductor in the process, about 150-220
MiB resident on CPU whatever the model: more than the embedded model's 4-bit weights
(benchmarks/RESULTS.md, "Resident memory besides the weights"). Here the same step is compiled
ahead of time by a child process, which exits before decoding starts, into a package (a .so)
that a C++ class, torch._C._aoti.AOTIModelPackageLoader, runs without importing any of them.

What is compiled: compiling.decode_one with the KV cache's tensors as inputs (written in place) and
two sizes left dynamic, so that one package serves every cache length and every attend length:

    logits [B, V] = step(token [B, 1], pos [B, 1], slots [L], *cache.tensors())  # [B, Hkv, S, *]

`slots` holds the slot indices 0..L-1, its length the attend length kv_cache.py sets (L <= S).
Compiled one-token CPU steps over a static cache attend through cpu_kernels.decode_attention up to
FUSED_DECODE_MAX_SLOTS (1,024) slots and through SDPA or grouped_decode_attention past it: two
packages, "short", and "long" only for caches of more slots; over the int8 cache one, "any".
Speculation adds "verifyT", compiling.verify_step over T = 1 + k tokens (logits [B, T, V], every
attend length; shorter rounds are padded up to it, speculative.padded_length).
The weights are not in the package: the loader is handed the model's own tensors (user-managed,
never copied), so a package is a few MiB and serves any checkpoint of the same shapes. Inductor
adds a few constants of its own (the int4 kernel's group size as a 0-d tensor); they are recorded
while compiling and stored beside the package. Inductor's freezing and max-autotune are off (the
weights are inputs): faster than `--compile` on int4 layers and GGUF files at their own bits,
slower on dense bf16, float32 and --quantize int8 (benchmarks/RESULTS.md, "--compile aot").

Where: $LLM_AOT_CACHE, else $XDG_CACHE_HOME/llm-aot (~/.cache/llm-aot): a folder per key, the
hash of torch's version, the CPU (flags, ATen's instruction set, the thread count Inductor's loops
are built for), the model's structure (every module's class and settings, every tensor's name,
shape and dtype), the cache's class, the batch size (the paged package: the block size) and the
source of the files the step is traced from (`traced_files`: an edit there compiles anew, an
edit to the server's files does not; old folders stay, a few MiB each). A new key compiles once
(about a minute on 2 cores for the embedded model, benchmarks/RESULTS.md, "--compile aot");
later runs load the package in a fraction of a second. This file chooses, loads and runs
packages; speedups/aot_export.py holds the exported step, the key and the child that builds
them. Processes needing the same key wait for the one compiling it (a lock file). While
compiling, the child holds its own copy of the weights (it loads the checkpoint as the caller did)
and the compiler's working memory, next to the caller's copy: the first run's memory peak is
about twice the weights plus what `--compile` needs; every later run adds nothing to eager's.
"""

import contextlib
import os
import time

import torch
import torch.nn.functional as F

from compiling import decode_one
from cpu_kernels import FUSED_DECODE_MAX_SLOTS
from paged import PagedKVCache
from runtime import log
from speedups.aot_export import (
    MAX_BLOCKS,
    MAX_ROWS,
    MAX_SLOTS,
    MAX_WIDTH,
    PARTS,
    AotError,
    AotRefusal,
    PagedStep,
    Step,
    build_in_child,
    named_tensors,
    package_key,
    part_rows,
)


def parts_for(cache, verify: int = 0) -> list:
    """The packages a cache needs (header): the int8 cache one, a static cache one or two; a paged
    one its decode step's; with speculation, the verify steps' too (`verify` tokens a row)."""
    extra = [f"verify{verify}"] if verify > 1 else []
    if isinstance(cache, PagedKVCache):
        return ["paged"] + extra
    if hasattr(cache, "k_scale"):
        return ["any"] + extra
    return ["short"] + (["long"] if cache.max_seq_len > FUSED_DECODE_MAX_SLOTS else []) + extra


def cache_root() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.environ.get("LLM_AOT_CACHE") or os.path.join(base, "llm-aot")


def choose(args, device: str):
    """generate.py's --compile resolved: auto -> "auto" (the package, eager if it cannot be built or
    loaded) where nothing in the flags or the device rules a package out, else None (eager, without
    a word: those runs were never compiled by default); off -> None; aot and jit as given."""
    if args.compile == "auto":
        try:
            check_usable(args, device)
        except AotError:
            return None
    elif args.compile == "aot":
        check_usable(args, device)
    return None if args.compile == "off" else args.compile


def check_usable(args, device: str):
    """generate.py's flags that --compile aot cannot serve, refused before anything loads."""
    if not str(device).startswith("cpu"):
        raise AotError(
            f"--compile aot runs on CPU: pass --device cpu, or on {device} use --compile (CUDA "
            "Graphs)"
        )
    if getattr(args, "lora", None):
        raise AotError(
            "the package is compiled from the checkpoint alone, without --lora's adapter; use "
            "--compile (jit) or --compile off"
        )
    if args.compile_prefill:
        raise AotError(
            "--compile_prefill brings torch.compile into the process, which --compile aot keeps "
            "out; drop one of them"
        )
    if args.cache != "static":
        raise AotError(
            "--compile aot runs the static KV cache; drop --cache paged, or use --compile"
        )
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise AotError(
            "--compile aot runs in one process; tensor-parallel runs (torchrun) take --compile"
        )


class AotDecode:
    """The packages, called as generate.generate calls a decode step: (model, cache, token [B, 1],
    pos [B, 1]) -> logits [B, V], over the prefix cache.attend_len of the cache's slots; given
    T > 1 tokens a row, a verifyT package's logits [B, T, V] (cli/speculate.verify_steps)."""

    has_guards = False  # nothing for compiling.skip_guards to skip (that is torch.compile's)

    def __init__(self, folder: str, step: Step, parts):
        from safetensors.torch import load_file

        self.step, self.loaders, self.kept = step, {}, []
        tensors = named_tensors(step)
        for part in parts:
            try:
                loader = torch._C._aoti.AOTIModelPackageLoader(
                    os.path.join(folder, part + ".pt2"), "model", False, 1, -1
                )
            except RuntimeError as e:
                raise AotError(
                    f"cannot load the package {folder}/{part}.pt2 ({str(e).splitlines()[0]}); "
                    f"delete that folder to compile it again"
                ) from e
            try:
                own = load_file(
                    os.path.join(folder, part + ".safetensors")
                )  # Inductor's own constants
            except Exception as e:  # missing or corrupt (safetensors raises its own error type)
                raise AotError(
                    f"cannot read {folder}/{part}.safetensors ({e}); delete that folder to compile "
                    "it again"
                ) from e
            wanted = loader.get_constant_fqns()
            missing = [n for n in wanted if n not in tensors and n not in own]
            if missing:
                raise AotError(
                    f"the package {folder}/{part}.pt2 reads tensors this model lacks: "
                    f"{missing[:5]}; delete that folder to compile it again"
                )
            self.kept.append(
                own
            )  # kept alive: the loader uses these tensors in place (user-managed)
            loader.load_constants(
                {n: tensors[n] if n in tensors else own[n] for n in wanted}, False, True, True
            )
            self.loaders[part] = loader

    def __call__(self, model, cache, token, pos):
        if (
            model is not self.step.model
            or type(cache) is not self.step.kind
            or cache.batch_size != len(self.step.rows)
        ):
            raise AotError(
                "this compiled step was loaded for another model, cache class or batch size"
            )
        L = cache.attend_len
        # the inputs: a view of `slots` and the cache's own list (no copies)
        inputs = [token.contiguous(), pos.contiguous(), cache.slots[:L], *cache.tensors()]
        if token.shape[1] > 1:  # a verify step: logits [B, T, V] (speculation)
            loader = self.loaders.get(f"verify{token.shape[1]}")
            if loader is None:
                raise AotError(f"no package loaded for verify steps of {token.shape[1]} tokens")
            return loader.run(inputs)[0]
        for part, loader in self.loaders.items():
            if part in PARTS and PARTS[part][0][0] <= L <= PARTS[part][0][1]:
                return loader.run(inputs)[0]
        raise AotError(
            f"no package loaded for attend length {L} (parts {list(self.loaders)}): "
            f"this step was loaded for a shorter cache"
        )


class AotPaged(AotDecode):
    """The paged packages, called as the engine calls its compiled step: (model, cache, tokens [1,
    R * T], pos [1, R * T]) -> logits [R * T, V] inside cache.step_groups, T = 1 ("paged") or a
    verify step's 1 + k ("verifyT", where speculation asks for it). Built for 2 to MAX_ROWS rows
    (a verify package fewer, aot_export.part_rows: the layers' kernels change at row counts,
    quantize.INT4_LARGE_M, and export refuses a range a branch splits), a longer step runs in
    pieces of that many rows (a row's tokens write and read only its own blocks); a step no package
    serves runs eager."""

    max_rows = MAX_ROWS

    def __init__(self, folder: str, step, parts):
        super().__init__(folder, step, parts)
        self.rows = {part: part_rows(part) for part in self.loaders}  # (once, not per step)

    def __call__(self, model, cache, tokens, pos):
        if model is not self.step.model or cache is not self.step.cache:
            raise AotError("this compiled step was loaded for another model or cache")
        T = cache.groups[0][1]
        part = "paged" if T == 1 else f"verify{T}"
        rows = self.rows.get(part)  # (T, fewest rows, most rows) of the package, if loaded
        if (
            len(cache.groups) != 1
            or rows is None
            or cache.groups[0][2].shape[-1] > MAX_WIDTH
            or cache.num_blocks > MAX_BLOCKS
        ):  # sizes it was built for
            return model(tokens, pos, cache)[0]
        table, m = cache.groups[0][2], min(self.max_rows, rows[2])
        pieces = [
            self._rows(
                cache,
                part,
                rows[1],
                tokens[:, i * T : (i + m) * T],
                pos[:, i * T : (i + m) * T],
                table[i : i + m],
            )  # fmt: skip
            for i in range(0, table.shape[0], m)
        ]
        return (
            pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        )  # (one piece: no copy of its logits)

    def _rows(self, cache, part, low, tokens, pos, table):
        """One package call: tokens/pos [1, R * T], table [R, W], 1 <= R <= MAX_ROWS -> logits
        [R * T, V]; fewer rows than `low` are padded up to it."""
        R = table.shape[0]
        T = tokens.shape[1] // R
        if R < low:  # (export specializes sizes 0 and 1): rows of the null block, at 0..T-1
            pad = torch.arange(T, device=pos.device).repeat(low - R)[None]
            tokens, pos = F.pad(tokens, (0, T * (low - R))), torch.cat((pos, pad), dim=1)
            table = F.pad(table, (0, 0, 0, low - R))
        if table.shape[1] == 1:  # and a second block, the null block (never visible: after pos)
            table = F.pad(table, (0, 1))
        inputs = [tokens.contiguous(), pos.contiguous(), table.contiguous(), *cache.tensors()]
        return self.loaders[part].run(inputs)[0][: R * T]


def decode_step(model, cache, load: dict, fallback: bool = False, verify: int = 0):
    """The decode step for `model` and caches like `cache` (any length), compiled ahead of time once
    per key by a child process, then loaded. load: how the child builds the same model,
    weights.load_for_inference's keyword arguments (cli/generate_flags.load_flags) with dtype as
    a name. fallback: where it cannot be built or loaded, say why in one line and return eager
    decode_one. verify: the verify steps too, of that many tokens a row (1 + k)."""
    try:
        return package_step(model, cache, load, retry=not fallback, verify=verify)
    except (
        AotError,
        OSError,
        RuntimeError,
    ) as e:  # OSError: a lock or log file; RuntimeError: the C++ loader
        if not fallback:
            raise
        if not isinstance(e, AotRefusal):
            log(f"decoding eager: {one_line(e)} (--compile off skips the attempt)")
        return decode_one


def one_line(e: Exception) -> str:
    """An error's first line: a failed build's reason and log path, without the log's tail after
    it."""
    return str(e).splitlines()[0]


def package_step(model, cache, load: dict, retry: bool = True, verify: int = 0) -> AotDecode:
    import fcntl

    paged = isinstance(cache, PagedKVCache)
    if not paged and cache.max_seq_len > MAX_SLOTS:
        raise AotError(
            f"--compile aot serves caches of up to {MAX_SLOTS} slots, not {cache.max_seq_len}"
        )
    windows = sorted({layer.self_attn.window for layer in model.layers} - {0})
    if windows and (
        paged or windows[-1] < cache.max_seq_len
    ):  # a step picks its window path by its sizes
        raise AotRefusal(
            f"--compile aot does not export sliding-window layers (window {windows[-1]}"
            + ("" if paged else f", a cache of {cache.max_seq_len} slots")
            + "); use --compile"
        )
    step, kind = (PagedStep, AotPaged) if paged else (Step, AotDecode)
    step = step(model, cache)
    folder, parts = os.path.join(cache_root(), package_key(step)), parts_for(cache, verify)
    try:
        os.makedirs(folder, exist_ok=True)
        lock = open(os.path.join(folder, ".lock"), "w")
    except OSError as e:
        if all(
            os.path.exists(os.path.join(folder, p + ".pt2")) for p in parts
        ):  # built, in a read-only folder
            return kind(folder, step, parts)
        raise AotError(
            f"cannot write the package folder {folder} ({e.strerror}); set LLM_AOT_CACHE to a "
            "writable folder"
        ) from e
    start = time.perf_counter()
    with lock:
        fcntl.flock(
            lock, fcntl.LOCK_EX
        )  # a process compiling the same key: wait for it, then use its packages
        todo = [p for p in parts if not os.path.exists(os.path.join(folder, p + ".pt2"))]
        if todo:
            parts = build_parts(folder, parts, todo, load, cache, retry)
            log(f"compiled in {time.perf_counter() - start:.1f} s")
            start = time.perf_counter()
    aot = kind(folder, step, parts)
    log(f"ahead-of-time decode step loaded in {time.perf_counter() - start:.2f} s from {folder}")
    return aot


def build_parts(folder: str, parts: list, todo: list, load: dict, cache, retry: bool) -> list:
    """Build `todo` in one child -> the parts that can be loaded. Under --compile auto a failed
    build with a verify package among them builds the decode packages alone: speculation's verify
    steps run eager, not the decode steps, and the next runs do not try it again
    (failed-verifyT.txt)."""
    known = [] if retry else [p for p in todo if os.path.exists(failed_file(folder, p))]
    todo, parts = [p for p in todo if p not in known], [p for p in parts if p not in known]
    verify = [p for p in todo if p.startswith("verify")]
    if not todo:
        return parts
    try:
        build_once(folder, todo, load, cache, retry)
        return parts
    except AotError as e:
        if retry or not verify:
            raise
        why = one_line(e)
    log(f"verify steps run eager: {why}")
    for part in verify:
        with contextlib.suppress(OSError), open(failed_file(folder, part), "w") as f:
            f.write(why)
    with contextlib.suppress(FileNotFoundError):  # the decode packages may still build alone
        os.remove(os.path.join(folder, "failed.txt"))
    decode = [p for p in todo if p not in verify]
    if decode:
        build_once(folder, decode, load, cache, retry)
    return [p for p in parts if p not in verify]


def failed_file(folder: str, part: str) -> str:
    return os.path.join(folder, f"failed-{part}.txt")


def build_once(folder: str, parts: list, load: dict, cache, retry: bool):
    """build_in_child, a failure remembered in the folder (failed.txt): without retry (--compile
    auto) the next run does not build again, so a machine without a C++ compiler does not pay for a
    failed build every run; --compile aot (retry) builds again."""
    failed = os.path.join(folder, "failed.txt")
    if not retry and os.path.exists(failed):
        with open(failed) as f:
            raise AotError(
                f"the last build into {folder} failed: {f.read().strip()}; delete that folder to "
                "build again"
            )
    log(
        f"compiling the decode step ahead of time (package{'s' * (len(parts) > 1)} "
        f"{', '.join(parts)}) into "
        f"{folder}; once per model shape, cache and torch version, in a child process"
    )
    try:
        build_in_child(folder, parts, load, cache)
    except AotError as e:
        if not e.transient:  # a child killed by a signal (out of memory, say) may pass next time
            with contextlib.suppress(OSError), open(failed, "w") as f:
                f.write(one_line(e))
        raise
    with contextlib.suppress(FileNotFoundError):
        os.remove(failed)
