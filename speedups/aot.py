"""Ahead-of-time compiled decode: the step as an AOTInductor package, run without the compiler.

    python generate.py --prompt "Once upon a time"     # CPU: the default (--compile auto), static KV cache
    python batch.py --requests requests.jsonl          # the engine's decode-only steps, paged cache (PagedStep)

--compile auto (generate.py, batch.py, serve.py) uses a package where one can serve and falls back
to eager with the reason in one line (a failed build is remembered in its folder, failed.txt, so
later runs do not build again); --compile aot asks for it and fails instead; --compile off is eager.

Why: `--compile` (torch.compile) keeps dynamo, sympy and Inductor in the process, about 150-220
MiB resident on CPU whatever the model: more than the embedded model's 4-bit weights
(benchmarks/RESULTS.md, "Resident memory besides the weights"). Here the same step is compiled
ahead of time by a child process, which exits before decoding starts, into a package (a .so)
that a C++ class, torch._C._aoti.AOTIModelPackageLoader, runs without importing any of them.

What is compiled: runtime.decode_one with the KV cache's tensors as inputs (written in place) and
two sizes left dynamic, so that one package serves every cache length and every attend length:

    logits [B, V] = step(token [B, 1], pos [B, 1], slots [L], *cache.tensors())   # each [B, Hkv, S, *]

`slots` holds the slot indices 0..L-1, its length the attend length kv_cache.py sets (L <= S).
Compiled one-token CPU steps over a static cache attend through cpu_kernels.decode_attention up to
FUSED_DECODE_MAX_SLOTS (1,024) slots and through SDPA or grouped_decode_attention past it: two
packages, "short", and "long" only for caches of more slots; over the int8 cache one, "any".
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
(SmolLM2-135M: 40-55 s on 2 cores, a second package as long again, the paged one 90-120 s);
later runs load the package in a fraction of a second.
Processes needing the same key wait for the one compiling it (a lock file). While compiling, the
child holds its own copy of the weights (it loads the checkpoint as the caller did) and the
compiler's working memory, next to the caller's copy: the first run's memory peak is about twice
the weights plus what `--compile` needs; every later run adds nothing to eager's.
"""

import contextlib
import glob
import hashlib
import inspect
import json
import os
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from cpu_kernels import FUSED_DECODE_MAX_SLOTS
from paged import PagedKVCache
from runtime import DTYPES, cpu_capability, decode_one, log

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the project's root
CACHE_FIELDS = (
    "k",
    "v",
    "k_scale",
    "v_scale",
)  # StaticKVCache has the first two, Int8KVCache all four
MAX_SLOTS = 1 << 20  # the largest cache length a package accepts
# per package: (the attend lengths it serves, the example attend length and cache length it is
# exported at)
PARTS = {
    "short": ((2, FUSED_DECODE_MAX_SLOTS), 128, 256),
    "long": (
        (FUSED_DECODE_MAX_SLOTS + 1, MAX_SLOTS),
        FUSED_DECODE_MAX_SLOTS + 64,
        FUSED_DECODE_MAX_SLOTS + 128,
    ),
    "any": ((2, MAX_SLOTS), 128, 256),
}
MAX_ROWS, MAX_WIDTH, MAX_BLOCKS = (
    64,
    1 << 16,
    1 << 24,
)  # a paged package's dynamic sizes: rows, table width, pool


def parts_for(cache) -> list:
    """The packages a cache needs (header): the int8 cache one, a static cache one or two."""
    if isinstance(cache, PagedKVCache):
        return ["paged"]
    if hasattr(cache, "k_scale"):
        return ["any"]
    return ["short"] + (["long"] if cache.max_seq_len > FUSED_DECODE_MAX_SLOTS else [])


class AotError(ValueError):
    """The ahead-of-time step cannot be built or used here, and why."""

    transient = False  # a build killed by a signal: not remembered as failed (build_once)


class AotRefusal(AotError):
    """The model itself rules a package out (sliding windows): --compile auto runs eager without a
    word."""


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
            f"--compile aot runs on CPU: pass --device cpu, or on {device} use --compile (CUDA Graphs)"
        )
    if args.compile_prefill:
        raise AotError(
            "--compile_prefill brings torch.compile into the process, which --compile aot keeps out; "
            "drop one of them"
        )
    if args.cache != "static":
        raise AotError(
            "--compile aot runs the static KV cache; drop --cache paged, or use --compile"
        )
    if args.draft_checkpoint or args.draft_layers or args.prompt_lookup:
        raise AotError(
            "speculative decoding compiles its own steps: use --compile with it, not --compile aot"
        )
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise AotError(
            "--compile aot runs in one process; tensor-parallel runs (torchrun) take --compile"
        )


class Step(torch.nn.Module):
    """decode_one over a cache given as tensors: what is exported. `cache` gives the class, the
    batch size and the one-token kernel (`decode`); each call builds the cache object around the
    input tensors."""

    def __init__(self, model, cache):
        super().__init__()
        self.model, self.kind, self.decode = model, type(cache), cache.decode
        self.fields = [f for f in CACHE_FIELDS if hasattr(cache, f)]
        self.register_buffer("rows", torch.arange(cache.batch_size))
        self.signature = f"batch {cache.batch_size}"

    def forward(self, token, pos, slots, *tensors):
        cache, n = self.kind.__new__(self.kind), len(tensors) // len(self.fields)
        for i, field in enumerate(self.fields):  # tensors: cache.tensors(), field by field
            setattr(cache, field, list(tensors[i * n : (i + 1) * n]))
        torch._check(slots.shape[0] <= tensors[0].shape[2])  # L <= S
        cache.rows, cache.slots, cache.attend_len = (
            self.rows,
            slots,
            slots.shape[0],
        )  # all that attend reads
        cache.decode = self.decode
        return decode_one(self.model, cache, token, pos)


class PagedStep(torch.nn.Module):
    """The engine's decode-only step (engine.flat_forward, its one-token rows padded to a bucket in
    one group) over a paged cache given as tensors, rows, table width and pool size left dynamic:

        logits [R, V] = step(tokens [1, R], pos [1, R], table [R, W], *cache.tensors())   # pools [N, ...]

    `cache` gives the block size and the decode kernel; its tensors are swapped for the inputs."""

    def __init__(self, model, cache):
        super().__init__()
        self.model, self.kind, self.cache = model, type(cache), cache
        self.signature = f"block_size {cache.block_size}"

    def forward(self, tokens, pos, table, *pools):
        c, n = self.cache, len(pools) // 2
        saved = c.k, c.v, c.slots, c.groups
        c.k, c.v, c.groups = list(pools[:n]), list(pools[n:]), [(table.shape[0], 1, table)]
        c.slots = torch.arange(
            table.shape[1] * c.block_size, device=table.device
        )  # the slots one row's blocks hold
        try:
            return self.model(tokens, pos, c)[0]
        finally:
            c.k, c.v, c.slots, c.groups = saved


def named_tensors(module) -> dict:
    """Every tensor the exported step reads, by the name export gives it: parameters and buffers
    (a shared one under each of its names) and plain tensor attributes."""
    out = dict(module.named_parameters(remove_duplicate=False))
    out.update(module.named_buffers(remove_duplicate=False))
    for prefix, m in module.named_modules(remove_duplicate=False):
        for name, value in vars(m).items():
            if isinstance(value, torch.Tensor):
                out.setdefault(f"{prefix}.{name}" if prefix else name, value)
    return out


def package_key(step) -> str:
    """The hash that names a folder of packages (header: what the compiled code depends on)."""
    settings = (int, float, str, bool, tuple, torch.dtype, type(None))
    parts = [
        torch.__version__,
        cpu_capability(),
        str(torch.get_num_threads()),
        step.kind.__name__,
        step.signature,
        repr(step.model.config),
    ]
    for name, m in step.named_modules(remove_duplicate=False):
        plain = sorted(
            (k, repr(v))
            for k, v in vars(m).items()
            if not k.startswith("_") and k != "training" and isinstance(v, settings)
        )
        parts.append(f"{name} {type(m).__qualname__} {plain}")
    parts += [
        f"{n} {tuple(t.shape)} {t.dtype} {t.stride()}"
        for n, t in sorted(named_tensors(step).items())
    ]
    try:  # a cache folder shared between machines: the CPU's flags decide the instructions used
        parts += [line for line in open("/proc/cpuinfo") if line.startswith("flags")][:1]
    except OSError:
        pass
    h = hashlib.sha256("\0".join(parts).encode())
    for path in traced_files(step):
        with open(path, "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:24]


def traced_files(step) -> list:
    """The project's files the compiled step is traced from: those defining its layers, its
    cache's classes and one-token kernel, decode_one and this file, with every project file they
    import at their top (so editing the server's files compiles nothing anew)."""
    todo = [type(m).__module__ for m in step.modules()] + [c.__module__ for c in step.kind.__mro__]
    todo += [
        getattr(getattr(step, "decode", None), "__module__", None),
        decode_one.__module__,
        __name__,
    ]
    seen = set()
    while todo:
        module = sys.modules.get(todo.pop() or "")
        path = os.path.abspath(getattr(module, "__file__", None) or "")
        if not is_source(path) or path in seen:
            continue
        seen.add(path)
        for value in vars(module).values():
            name = value.__name__ if inspect.ismodule(value) else getattr(value, "__module__", None)
            todo.append(name if isinstance(name, str) else None)
    return sorted(seen)


def is_source(path: str) -> bool:
    """A file of the project's code: at the root or in one of its packages (formats/, ...), not a
    package's __init__ (its attributes follow what is loaded) nor a test's or a benchmark's."""
    folder = os.path.dirname(path)
    if folder == ROOT:
        return True
    in_package = os.path.dirname(folder) == ROOT and os.path.exists(
        os.path.join(folder, "__init__.py")
    )
    return in_package and not path.endswith("__init__.py")


class AotDecode:
    """The packages, called as generate.generate calls a decode step: (model, cache, token [B, 1],
    pos [B, 1]) -> logits [B, V], over the prefix cache.attend_len of the cache's slots."""

    has_guards = False  # nothing for runtime.skip_guards to skip (that is torch.compile's)

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
                    f"cannot read {folder}/{part}.safetensors ({e}); delete that folder to compile it again"
                ) from e
            wanted = loader.get_constant_fqns()
            missing = [n for n in wanted if n not in tensors and n not in own]
            if missing:
                raise AotError(
                    f"the package {folder}/{part}.pt2 reads tensors this model lacks: {missing[:5]}; "
                    f"delete that folder to compile it again"
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
        for part, loader in self.loaders.items():
            low, high = PARTS[part][0]
            if (
                low <= L <= high
            ):  # the inputs: a view of `slots` and the cache's own list (no copies)
                return loader.run(
                    [token.contiguous(), pos.contiguous(), cache.slots[:L], *cache.tensors()]
                )[0]
        raise AotError(
            f"no package loaded for attend length {L} (parts {list(self.loaders)}): "
            f"this step was loaded for a shorter cache"
        )


class AotPaged(AotDecode):
    """The paged package, called as the engine calls its compiled step: (model, cache, tokens [1,
    R], pos [1, R]) -> logits [R, V] inside cache.step_groups. Built for 2 to MAX_ROWS rows (the
    layers' kernels change at row counts, quantize.INT4_LARGE_M, and export refuses a range a branch
    splits), a longer step runs in pieces of max_rows rows (a decode step's rows are independent:
    each writes and reads only its own blocks); drafted steps run eager (RESULTS.md, "Compiled by
    default")."""

    max_rows = MAX_ROWS

    def __call__(self, model, cache, tokens, pos):
        if model is not self.step.model or cache is not self.step.cache:
            raise AotError("this compiled step was loaded for another model or cache")
        if (
            len(cache.groups) != 1
            or cache.groups[0][1] != 1
            or cache.groups[0][2].shape[-1] > MAX_WIDTH
            or cache.num_blocks > MAX_BLOCKS
        ):  # sizes it was built for
            return model(tokens, pos, cache)[0]
        table, m = cache.groups[0][2], self.max_rows
        pieces = [
            self._rows(cache, tokens[:, i : i + m], pos[:, i : i + m], table[i : i + m])
            for i in range(0, tokens.shape[1], m)
        ]
        return (
            pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        )  # (one piece: no copy of its logits)

    def _rows(self, cache, tokens, pos, table):
        """One package call: tokens/pos [1, R], table [R, W], 1 <= R <= MAX_ROWS -> logits [R,
        V]."""
        R = tokens.shape[1]
        if (
            R == 1
        ):  # export specializes sizes 0 and 1: a second row, of the null block at position 0
            tokens, pos, table = (
                F.pad(tokens, (0, 1)),
                F.pad(pos, (0, 1)),
                F.pad(table, (0, 0, 0, 1)),
            )
        if table.shape[1] == 1:  # and a second block, the null block (never visible: after pos)
            table = F.pad(table, (0, 1))
        inputs = [tokens.contiguous(), pos.contiguous(), table.contiguous(), *cache.tensors()]
        return self.loaders["paged"].run(inputs)[0][:R]


def decode_step(model, cache, load: dict, fallback: bool = False):
    """The decode step for `model` and caches like `cache` (any length), compiled ahead of time once
    per key by a child process, then loaded. load: how the child builds the same model,
    weights.load_for_inference's keyword arguments (generate.load_flags) with dtype as a name.
    fallback: where it cannot be built or loaded, say why in one line and return eager
    decode_one."""
    try:
        return package_step(model, cache, load, retry=not fallback)
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


def package_step(model, cache, load: dict, retry: bool = True) -> AotDecode:
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
    folder, parts = os.path.join(cache_root(), package_key(step)), parts_for(cache)
    try:
        os.makedirs(folder, exist_ok=True)
        lock = open(os.path.join(folder, ".lock"), "w")
    except OSError as e:
        if all(
            os.path.exists(os.path.join(folder, p + ".pt2")) for p in parts
        ):  # built, in a read-only folder
            return kind(folder, step, parts)
        raise AotError(
            f"cannot write the package folder {folder} ({e.strerror}); set LLM_AOT_CACHE to a writable folder"
        ) from e
    start = time.perf_counter()
    with lock:
        fcntl.flock(
            lock, fcntl.LOCK_EX
        )  # a process compiling the same key: wait for it, then use its packages
        todo = [p for p in parts if not os.path.exists(os.path.join(folder, p + ".pt2"))]
        if todo:
            build_once(folder, todo, load, cache, retry)
            log(f"compiled in {time.perf_counter() - start:.1f} s")
            start = time.perf_counter()
    aot = kind(folder, step, parts)
    log(f"ahead-of-time decode step loaded in {time.perf_counter() - start:.2f} s from {folder}")
    return aot


def build_once(folder: str, parts: list, load: dict, cache, retry: bool):
    """build_in_child, a failure remembered in the folder (failed.txt): without retry (--compile
    auto) the next run does not build again, so a machine without a C++ compiler does not pay for a
    failed build every run; --compile aot (retry) builds again."""
    failed = os.path.join(folder, "failed.txt")
    if not retry and os.path.exists(failed):
        with open(failed) as f:
            raise AotError(
                f"the last build into {folder} failed: {f.read().strip()}; delete that folder to build again"
            )
    log(
        f"compiling the decode step ahead of time (package{'s' * (len(parts) > 1)} {', '.join(parts)}) into "
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


def build_in_child(folder: str, parts: list, load: dict, cache):
    spec = {
        "folder": folder,
        "key": os.path.basename(folder),
        "parts": parts,
        "load": load,
        "threads": torch.get_num_threads(),
        "batch_size": getattr(cache, "batch_size", 1),
        "int8_cache": hasattr(cache, "k_scale"),
        "block_size": cache.block_size if isinstance(cache, PagedKVCache) else None,
    }
    log_path = os.path.join(folder, "build.log")
    from tqdm import tqdm

    with open(log_path, "w") as out:
        path = os.pathsep.join(
            [ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p]
        )  # the caller's cwd kept
        child = subprocess.Popen(
            [sys.executable, "-m", "speedups.aot", json.dumps(spec)],
            stdout=out,
            stderr=out,
            env={**os.environ, "PYTHONPATH": path},
        )
        try:  # on a terminal, the time so far: a minute's wait is not a hang
            with tqdm(
                bar_format="{desc} {elapsed}",
                desc="compiling",
                file=sys.stderr,
                leave=False,
                disable=None,
            ) as bar:
                while (code := child.poll()) is None:
                    time.sleep(0.5)
                    bar.refresh()
        # the parent interrupted or failed: the child does not build on alone (a no-op once it
        # exited)
        finally:
            child.kill()
            child.wait()
    if code == 0:
        return
    with open(log_path) as f:
        tail = "".join(f.readlines()[-15:])
    if code < 0:
        why = (
            f"killed by signal {-code}: out of memory? While compiling it holds a second copy of the weights "
            "and the compiler's working memory"
        )
    elif "CppCompileError" in tail or "compiler" in tail.lower():
        why = "a C++ compile failed: Inductor needs a working C++ compiler (g++ or clang, $CXX); or pass --compile off"
    else:  # the last line that says something (Python's exception line)
        why = f"exit {code}: " + next(
            (line.strip()[:300] for line in reversed(tail.splitlines()) if line.strip()), ""
        )
    error = AotError(
        f"compiling the decode step ahead of time failed ({why}); see {log_path}\nits end:\n{tail}"
    )
    error.transient = code < 0
    raise error


def build(spec: dict):
    """The child: load the model as the parent did, check it has the parent's key, then export
    and compile each package of spec["parts"] into spec["folder"]."""
    import torch._inductor.config as config
    from safetensors.torch import save_file
    from torch._inductor.graph import GraphLowering

    import runtime
    from formats import weights
    from kv_cache import StaticKVCache
    from speedups.kv_int8 import Int8KVCache

    load = dict(spec["load"])
    model, _ = weights.load_for_inference(
        device="cpu", dtype=DTYPES[load.pop("dtype")], log=log, **load
    )
    kind = Int8KVCache if spec["int8_cache"] else StaticKVCache
    if spec["block_size"]:
        step = PagedStep(model, PagedKVCache.for_model(model, 64, spec["block_size"]))
    else:
        step = Step(model, kind.for_model(model, spec["batch_size"], 2))
    torch.set_num_threads(spec["threads"])  # Inductor builds its loops for this many threads
    if package_key(step) != spec["key"]:
        raise SystemExit(
            "error: the model built for compiling differs from the one the caller loaded"
        )
    runtime.configure_inductor_cpu()
    config.freezing = False  # the weights stay the package's inputs, not constants folded into it
    config.aot_inductor.package_constants_in_so = False
    made, allocate = {}, GraphLowering.allocate_non_dup_const_name

    def record(graph, name, data):  # Inductor's own constants, which the caller cannot name
        new = allocate(graph, name, data)
        if data.numel() <= 64:
            made[new] = data.detach().clone().contiguous()
        return new

    GraphLowering.allocate_non_dup_const_name = record
    for part in spec["parts"]:
        inputs, dynamic = example(part, step, kind, spec["batch_size"])
        start, made = time.perf_counter(), {}
        tmp = os.path.join(spec["folder"], f".{part}.{os.getpid()}")
        try:
            with torch.no_grad():
                program = torch.export.export(step, inputs, dynamic_shapes=dynamic)
                torch._inductor.aoti_compile_and_package(program, package_path=tmp + ".pt2")
            save_file(made, tmp + ".safetensors")
            wanted = torch._C._aoti.AOTIModelPackageLoader(
                tmp + ".pt2", "model", False, 1, -1
            ).get_constant_fqns()
            lacking = [c for c in wanted if c not in made and c not in named_tensors(step)]
            if lacking:  # a package no caller could load: fail here, not on every load
                raise SystemExit(
                    f"error: Inductor made constants this step cannot supply: {lacking[:5]}"
                )
            os.replace(tmp + ".safetensors", os.path.join(spec["folder"], part + ".safetensors"))
            os.replace(
                tmp + ".pt2", os.path.join(spec["folder"], part + ".pt2")
            )  # last: its presence means done
        finally:
            for leftover in glob.glob(tmp + ".*"):
                os.remove(leftover)
        log(f"{part}: compiled in {time.perf_counter() - start:.1f} s")


def example(part, step, kind, B):
    """A package's example inputs and their dynamic sizes (header)."""
    n_layers = step.model.config.n_layers
    if part == "paged":  # 4 rows of 3 blocks; rows, width and pool size dynamic
        R, W = (
            torch.export.Dim("rows", min=2, max=MAX_ROWS),
            torch.export.Dim("width", min=2, max=MAX_WIDTH),
        )
        N, rows = (
            torch.export.Dim("blocks", min=2, max=MAX_BLOCKS),
            torch.zeros(1, 4, dtype=torch.long),
        )
        inputs = (
            rows,
            rows.clone(),
            torch.ones(4, 3, dtype=torch.long),
            *step.cache.tensors(),
        )  # (never aliased)
        return inputs, ({1: R}, {1: R}, {0: R, 1: W}, ({0: N},) * (2 * n_layers))
    (low, high), attend, slots = PARTS[part]
    cache, token = kind.for_model(step.model, B, slots), torch.zeros(B, 1, dtype=torch.long)
    L, S = (
        torch.export.Dim("attend", min=low, max=high),
        torch.export.Dim("slots", min=low, max=MAX_SLOTS),
    )
    inputs = (
        token,
        token.clone(),
        torch.arange(attend),
        *cache.tensors(),
    )  # token and pos: never one tensor (aliased inputs)
    return inputs, (None, None, {0: L}, ({2: S},) * (len(step.fields) * n_layers))


if __name__ == "__main__":  # the child process decode_step starts
    build(json.loads(sys.argv[1]))
