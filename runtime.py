"""Devices, dtypes, errors and the CPU: what every file of the project shares.

    device = pick_device(None)              # "cuda" where a GPU is, else "cpu"
    dtype = DTYPES["bfloat16"]              # --dtype's names
    cpu_capability()                        # "AVX512", "AVX2" or "DEFAULT": what ATen dispatches to
    raise CheckpointError(f"{path}: ...")   # a checkpoint that cannot be used, and why

ATen's kernels and Inductor's C++ code both depend on the CPU's instruction set (AVX2, AVX-512,
AMX), which ATEN_CPU_CAPABILITY=default|avx2|avx512 lowers; inductor_vector_bits keeps the two in
step (compiling.py uses it). The model's steps and compiling them are compiling.py's; memory is
memory.py's.

This file imports only torch, so any other file of the project can use it.
"""

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
            f"--device {name}: CUDA is not available on this machine (no GPU or a CPU-only "
            f"PyTorch); use --device cpu"
        )
    if not name.startswith(("cpu", "cuda")):
        raise ValueError(f"--device {name}: expected cpu or cuda")
    return name


def cpu_capability() -> str:
    """The instruction set ATen dispatches to on this CPU ("AVX512", "AVX2", "DEFAULT", ...); set
    ATEN_CPU_CAPABILITY=default|avx2|avx512 to choose a lower one."""
    return torch.backends.cpu.get_cpu_capability()


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
