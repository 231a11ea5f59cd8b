"""The ahead-of-time decode step's export side (speedups/aot.py loads and runs what this builds):
the step as an nn.Module over a cache given as tensors (`Step`, the engine's `PagedStep`), the
key naming its folder, and the child process that exports and compiles each package.

    step = Step(model, StaticKVCache.for_model(model, 1, 256))
    key = package_key(step)          # torch, CPU, model structure, cache class, traced source
    build_in_child(folder, ["short"], load_flags, cache)   # python -m speedups.aot_export SPEC

The child loads the checkpoint as the caller did (`load`: weights.load_for_inference's keyword
arguments), checks it has the caller's key, then exports each part at its example sizes with two
sizes dynamic (`example`) and compiles it by AOTInductor into FOLDER/PART.pt2, with Inductor's own
small constants beside it (PART.safetensors).
"""

import glob
import hashlib
import inspect
import json
import os
import subprocess
import sys
import time

import torch

import quantize
from compiling import decode_one, verify_step
from cpu_kernels import FUSED_DECODE_MAX_SLOTS
from paged import PagedKVCache
from runtime import DTYPES, cpu_capability, log

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


class AotError(ValueError):
    """The ahead-of-time step cannot be built or used here, and why."""

    transient = False  # a build killed by a signal: not remembered as failed (build_once)


class AotRefusal(AotError):
    """The model itself rules a package out (sliding windows): --compile auto runs eager without a
    word."""


class Step(torch.nn.Module):
    """decode_one over a cache given as tensors: what is exported. `cache` gives the class, the
    batch size and the one-token kernel (`decode`); each call builds the cache object around the
    input tensors. Given T > 1 tokens a row (a "verifyT" package: generate.py's speculation) it is
    compiling.verify_step instead, logits at every position [B, T, V]."""

    def __init__(self, model, cache):
        super().__init__()
        self.model, self.kind, self.decode = model, type(cache), cache.decode
        self.fields = [f for f in CACHE_FIELDS if getattr(cache, f, None)]  # a latent's V: none
        self.latent = cache.latent  # (0 but for model.MLAttention's cache)
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
        cache.decode, cache.latent = self.decode, self.latent
        if self.latent:
            cache.v = []
        if token.shape[1] > 1:  # (a size export fixes: each package traces one branch)
            return verify_step(self.model, cache, token, pos)
        return decode_one(self.model, cache, token, pos)


class PagedStep(torch.nn.Module):
    """The engine's decode-only step (engine.flat_forward, its one-token rows padded to a bucket in
    one group) over a paged cache given as tensors, rows, table width and pool size left dynamic:

        logits [R, V] = step(tokens [1, R], pos [1, R], table [R, W], *pools)  # pools [N, ...]

    or a verify step of speculative decoding, T = 1 + k tokens a row (a package per T: "verifyT"),
    logits [R * T, V] from tokens and pos [1, R * T]. `cache` gives the block size and the decode
    kernel; its tensors are swapped for the inputs."""

    def __init__(self, model, cache):
        super().__init__()
        self.model, self.kind, self.cache = model, type(cache), cache
        self.signature = f"block_size {cache.block_size}"

    def forward(self, tokens, pos, table, *pools):
        c = self.cache
        n = len(c.k)  # pools: cache.tensors(), K's then V's (a latent's: none)
        saved = c.k, c.v, c.slots, c.groups
        T = tokens.shape[1] // table.shape[0]  # tokens a row: 1, or a verify package's 1 + k
        c.k, c.v, c.groups = list(pools[:n]), list(pools[n:]) or c.v, [(table.shape[0], T, table)]
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
        for key, value in vars(module).items():
            if key.startswith("__"):  # (Dynamo installs "__import_..." globals in what it traced)
                continue
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
            [sys.executable, "-m", "speedups.aot_export", json.dumps(spec)],
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
    if code != 0:
        raise build_failure(code, log_path)


def build_failure(code: int, log_path: str) -> AotError:
    """The child's exit code and log turned into one error that says what to do."""
    with open(log_path) as f:
        tail = "".join(f.readlines()[-15:])
    if code < 0:
        why = (
            f"killed by signal {-code}: out of memory? While compiling it holds a second copy of "
            "the weights and the compiler's working memory"
        )
    elif "CppCompileError" in tail or "compiler" in tail.lower():
        why = (
            "a C++ compile failed: Inductor needs a working C++ compiler (g++ or clang, $CXX); "
            "or pass --compile off"
        )
    else:  # the last line that says something (Python's exception line)
        why = f"exit {code}: " + next(
            (line.strip()[:300] for line in reversed(tail.splitlines()) if line.strip()), ""
        )
    error = AotError(
        f"compiling the decode step ahead of time failed ({why}); see {log_path}\nits end:\n{tail}"
    )
    error.transient = code < 0
    return error


def build(spec: dict):
    """The child: load the model as the parent did, check it has the parent's key, then export
    and compile each package of spec["parts"] into spec["folder"]."""
    import torch._inductor.config as config

    import compiling

    step, kind = rebuilt_step(spec)
    compiling.configure_inductor_cpu()
    config.freezing = False  # the weights stay the package's inputs, not constants folded into it
    config.aot_inductor.package_constants_in_so = False
    made = record_constants()
    for part in spec["parts"]:
        made.clear()
        inputs, dynamic = example(part, step, kind, spec["batch_size"])
        start = time.perf_counter()
        package_part(step, inputs, dynamic, spec["folder"], part, made)
        log(f"{part}: compiled in {time.perf_counter() - start:.1f} s")


def rebuilt_step(spec: dict):
    """(the step, the static cache's class) over the model loaded as the caller loaded it; the
    child exits if its key differs from the caller's."""
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
    return step, kind


def record_constants() -> dict:
    """A dict that collects the small constants Inductor makes of its own while compiling (the
    caller cannot name them, so they are stored beside the package)."""
    from torch._inductor.graph import GraphLowering

    made, allocate = {}, GraphLowering.allocate_non_dup_const_name

    def record(graph, name, data):
        new = allocate(graph, name, data)
        if data.numel() <= 64:
            made[new] = data.detach().clone().contiguous()
        return new

    GraphLowering.allocate_non_dup_const_name = record
    return made


def package_part(step, inputs, dynamic, folder: str, part: str, made: dict):
    """Export the step at the example inputs and compile it into FOLDER/PART.pt2, with Inductor's
    own constants in PART.safetensors; written under temporary names, the .pt2 renamed last."""
    from safetensors.torch import save_file

    tmp = os.path.join(folder, f".{part}.{os.getpid()}")
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
        os.replace(tmp + ".safetensors", os.path.join(folder, part + ".safetensors"))
        os.replace(tmp + ".pt2", os.path.join(folder, part + ".pt2"))  # last: it means done
    finally:
        for leftover in glob.glob(tmp + ".*"):
            os.remove(leftover)


def part_rows(part: str) -> tuple:
    """(tokens a row T, fewest rows, most rows) of a paged package: its rows' R * T tokens never
    cross a layer's switch of kernel by row count (quantize.INT4_LARGE_M's 128 in bf16: float32's
    2 lies below 2T; quant_groups.FEW_ROWS's 4), where export refuses a range a branch splits."""
    from formats.quant_groups import FEW_ROWS

    T = 1 if part == "paged" else int(part.removeprefix("verify"))
    if T == 1:
        return 1, 2, MAX_ROWS
    return T, max(2, FEW_ROWS // T + 1), min(MAX_ROWS, (quantize.INT4_LARGE_M - 1) // T)


def example(part, step, kind, B):
    """A package's example inputs and their dynamic sizes (header)."""
    n_layers = step.model.config.n_layers
    if isinstance(step, PagedStep):  # 4 rows of 3 blocks, T tokens a row
        T, low, high = part_rows(part)
        R, W = (
            torch.export.Dim("rows", min=low, max=high),
            torch.export.Dim("width", min=2, max=MAX_WIDTH),
        )
        N, rows = (
            torch.export.Dim("blocks", min=2, max=MAX_BLOCKS),
            torch.zeros(1, 4 * T, dtype=torch.long),
        )
        inputs = (
            rows,
            rows.clone(),
            torch.ones(4, 3, dtype=torch.long),
            *step.cache.tensors(),
        )  # (never aliased)
        flat = R * T if T > 1 else R  # rows, width and pool size dynamic
        return inputs, ({1: flat}, {1: flat}, {0: R, 1: W}, ({0: N},) * (len(inputs) - 3))
    # a static cache's verify step (T tokens, multi-token attention) serves every attend length
    T = 1 if part in PARTS else int(part.removeprefix("verify"))
    (low, high), attend, slots = PARTS[part if T == 1 else "any"]
    cache, token = kind.for_model(step.model, B, slots), torch.zeros(B, T, dtype=torch.long)
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
