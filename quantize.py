"""Weight-only quantization: int8 per output channel and int4 per group, with fast kernels.

    python quantize.py --mode int8       # the embedded model -> ./SmolLM2-135M-Instruct-int8
    python quantize.py --checkpoint PATH --mode int4 --groupsize 64 --out DIR
    python generate.py --checkpoint DIR                              # loads the quantized folder
    python generate.py --quantize int4 --groupsize 64                # or quantize at load time

Decode at batch 1 reads every weight once per token, so the bytes per weight set the speed
limit. Weight-only quantization stores weights in fewer bits and multiplies with activations
kept in bf16 (or float32):

    int8: w[n, k] ~= q[n, k] * scale[n]                 q in [-127, 127], one scale per output row
    int4: w[n, k] ~= (q[n, k] - 8) * scale[n, g] + zero[n, g]    q in [0, 15], g = k // groupsize

int4 is asymmetric (min/max per group, like GGUF's Q4_1) with groups of 32..256 input channels.
On disk and in tensor parallelism the weights are *portable*: int8 as is, int4 as two values per
byte in row order (q[2i] low nibble, q[2i+1] high) plus float32 scales and zeros. At load time
they are converted for the device's kernels: on CPU `_weight_int8pack_mm` and
`_weight_int4pack_mm_for_cpu` (weights packed by `_convert_weight_to_int4pack_for_cpu`); on CUDA
a dequantizing matmul Inductor fuses, and the tinygemm `_weight_int4pack_mm`.

The CPU int4 kernel is a matrix-vector product at heart: its time grows with the number of rows,
so many-row calls (prefill, speculative verification of many tokens) take another route: the
layer is dequantized on the fly and multiplied with a regular GEMM. The kernel's packed layout is
private to ATen and differs by instruction set (AVX-512, AVX2, none), so each layer checks at load,
on the running CPU, which known layout unpacks its weight back to its values (cpu_int4_pack,
packing 1,024 rows at a time); if none does, it keeps its portable values as well. The kernel
itself is checked once per process on a probe matrix (cpu_int4_kernel_error); where it is
wrong or missing, int4 is refused with a message, never run. `dequantize()` on every layer is the
plain reference path tests compare the kernels against.
"""

import functools
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import moe
from cpu_kernels import cpu_int4_kernel_error, padded_linear

MODES = ("int8", "int4")
GROUP_SIZES = (32, 64, 128, 256)
# rows from which the CPU int4 path dequantizes and runs a GEMM instead: the kernel's time grows
# with the rows, unpacking its layout costs the same at any, and the two meet near this many rows
# (benchmarks/RESULTS.md, "The engine at a GGUF's own bits")
INT4_LARGE_M = 128
INT4_LARGE_M_FLOAT32 = (
    2  # the kernel's float32 path is 20x its bf16 one: unpacking wins from 2 rows (RESULTS.md)
)


def int4_large_m(out_features: int, in_features: int, dtype) -> int:
    """Rows from which a CPU int4 layer of this size dequantizes and runs a GEMM instead of the
    kernel. Unpacking costs more per weight once a matrix no longer stays in cache, so larger
    layers switch later, even unpacked a row block at a time (Int4Linear.dense): INT4_LARGE_M up
    to 8M weights, 256 past (benchmarks/RESULTS.md, "Prefill at a GGUF's own bits, 1B")."""
    if dtype == torch.float32:
        return INT4_LARGE_M_FLOAT32
    # (max: batch_invariant.one_int4_route raises INT4_LARGE_M to keep every row on the kernel)
    return INT4_LARGE_M if out_features * in_features <= 1 << 23 else max(256, INT4_LARGE_M)


# ---- quantizing one weight to portable tensors ---------------------------------------------


@torch.no_grad()  # a weight that requires grad would keep every temporary alive in a graph
def quantize_int8(w: torch.Tensor, ratios=torch.linspace(0.7, 1.0, 16)) -> dict:
    """w [N, K] float -> {"weight": int8 [N, K], "scales": float32 [N]} (symmetric, per row).

    Each row's scale is the one, among ratio * max|w| / 127 for a few clipping ratios, with the
    least squared error: clipping a few outliers buys finer steps for all other weights."""
    w = w.float()
    amax = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-10)  # [N, 1]
    best_scale, best_err = None, None
    for r in ratios.tolist():
        scale = amax * (r / 127)
        err = (
            (torch.round(w / scale).clamp(-127, 127) * scale - w).square().sum(dim=1, keepdim=True)
        )
        better = err < best_err if best_err is not None else torch.ones_like(err, dtype=torch.bool)
        best_scale = scale if best_scale is None else torch.where(better, scale, best_scale)
        best_err = err if best_err is None else torch.where(better, err, best_err)
    q = torch.round(w / best_scale).clamp(-127, 127).to(torch.int8)
    return {"weight": q, "scales": best_scale[:, 0]}


@torch.no_grad()
def quantize_int4(w: torch.Tensor, groupsize: int, refine_steps: int = 4) -> dict:
    """w [N, K] float -> {"weight": uint8 [N, K/2], "scales", "zeros": float32 [N, K/groupsize]}.

    Starts from each group's min/max, then alternates: round to the grid, refit scale and offset
    by least squares to the rounded values (each step can only lower the squared error). A group
    already on a 16-level grid, like GGUF Q4_1 at the same group size, is reproduced exactly."""
    N, K = w.shape
    x = w.float().reshape(N, K // groupsize, groupsize)
    lo, hi = x.amin(dim=2, keepdim=True), x.amax(dim=2, keepdim=True)
    scale = ((hi - lo) / 15).clamp(min=1e-10)
    for _ in range(refine_steps):
        q = torch.round((x - lo) / scale).clamp(0, 15)
        q_mean, x_mean = q.mean(dim=2, keepdim=True), x.mean(dim=2, keepdim=True)
        var = (q - q_mean).square().sum(dim=2, keepdim=True)
        fit = ((q - q_mean) * (x - x_mean)).sum(dim=2, keepdim=True) / var.clamp(min=1e-20)
        scale = torch.where(var > 0, fit, scale).clamp(min=1e-10)
        lo = x_mean - scale * q_mean
    q = torch.round((x - lo) / scale).clamp(0, 15).to(torch.uint8).reshape(N, K)
    scale, lo = scale[..., 0], lo[..., 0]
    return {"weight": q[:, 0::2] | (q[:, 1::2] << 4), "scales": scale, "zeros": lo + 8 * scale}


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Portable uint8 [N, K/2] -> values uint8 [N, K] in [0, 15]."""
    return torch.stack([packed & 15, packed >> 4], dim=2).reshape(packed.shape[0], -1)


def dequantize_int4(q, scales, zeros) -> torch.Tensor:
    """q [N, K] in [0, 15], scales/zeros [N, K/G] -> float32 [N, K]."""
    N, K = q.shape
    G = scales.shape[1]
    w = (q.reshape(N, G, K // G).float() - 8) * scales.float()[..., None] + zeros.float()[..., None]
    return w.reshape(N, K)


# ---- the CPU int4 kernel's packed weight, read back ----------------------------------------
# `torch._convert_weight_to_int4pack_for_cpu` packs int4 values [N, K] for
# `_weight_int4pack_mm_for_cpu` in a layout private to ATen and chosen per CPU capability
# (ATEN_CPU_CAPABILITY). Int4Linear and formats/quant_groups.Int8GroupLinear keep only the packed
# weight, so reading their values back (dequantize() for tests and large-row GEMMs, fusing q/k/v,
# an embedding tied to a packed head) goes through these readers, and a layout is trusted only
# after a round trip on the running machine (find_cpu_int4_layout on the layer's own weight).
# formats/quant_groups.py reads single rows (cpu_int4_rows), formats/fuse_layers.py stacks layers'
# bytes (cpu_int4_concat):
#
#     packed, layout = cpu_int4_pack(values, N)   # packed by pieces of rows, the layout found
#     q = cpu_int4_unpack(packed, N, K, *layout)  # uint8 [N, K], the values packed

# Seen in torch 2.13: AVX-512 packs blocks of 64 output rows, each [K, 32] bytes holding rows j
# (low nibble) and j + 32 (high); AVX2 blocks of 32 rows, [K, 16] bytes, rows j and j + 16; the
# default (no SIMD) blocks of 32 rows holding neighbouring rows 2j, 2j + 1; rows past the last full
# block are stored as [K, rows / 2] bytes of neighbouring rows. Int4Linear never trusts this list:
# it unpacks its own packed weight with each candidate and keeps the one that gives its values back
# (a round trip on the running machine), else it keeps the portable values too.
CPU_INT4_LAYOUTS = ((64, "halves"), (32, "halves"), (32, "neighbours"))


def cpu_int4_unpack(
    packed: torch.Tensor, N: int, K: int, block: int = 64, pairing: str = "halves"
) -> torch.Tensor:
    """Values uint8 [N, K] from `_convert_weight_to_int4pack_for_cpu`'s layout (see
    CPU_INT4_LAYOUTS)."""
    flat, full = packed.reshape(-1), N // block * block
    b = flat[: full * K // 2].view(N // block, K, block // 2)  # [blocks, K, block / 2]
    if pairing == "halves":  # byte j holds rows j and j + block / 2
        q = torch.cat([b & 15, b >> 4], dim=2)  # [blocks, K, block]
    else:  # byte j holds rows 2j and 2j + 1
        q = torch.stack([b & 15, b >> 4], dim=3).reshape(N // block, K, block)
    q = q.transpose(1, 2).reshape(full, K)
    if full == N:
        return q
    b = flat[full * K // 2 :].view(K, (N - full) // 2)
    tail = torch.stack([b & 15, b >> 4], dim=2).reshape(K, N - full).t()
    return torch.cat([q, tail], dim=0)


def find_cpu_int4_layout(packed: torch.Tensor, q: torch.Tensor):
    """The (block, pairing) of CPU_INT4_LAYOUTS that unpacks `packed` back to `q` [N, K], or
    None."""
    for layout in CPU_INT4_LAYOUTS:
        if torch.equal(cpu_int4_unpack(packed, *q.shape, *layout), q):
            return layout
    return None


def cpu_int4_pack(values, N: int, rows: int = 1024):
    """(packed uint8 [N, K/2], layout) of int4 values [N, K] for `_weight_int4pack_mm_for_cpu`,
    `rows` rows at a time (the op takes int32: 4 bytes a weight for a moment, a large matrix's
    worth would be the load's peak); values(i, j) gives rows i..j-1 as uint8 in [0, 15]. The
    layout is found on the first piece and checked on the last; where none is known it is None
    and the whole matrix is packed at once (pieces follow on only in a known layout)."""
    packed, layout = None, None
    for i in range(0, N, rows):
        v = values(i, min(i + rows, N))
        piece = torch.ops.aten._convert_weight_to_int4pack_for_cpu(v.to(torch.int32), 1)
        if packed is None:  # filled in place: no second copy at the end
            packed = torch.empty(N, piece.shape[1], dtype=torch.uint8, device=piece.device)
        packed[i : i + rows] = piece
        layout = layout or find_cpu_int4_layout(piece, v)
        if layout is None:
            break
    if layout is None or not torch.equal(cpu_int4_unpack(piece, *v.shape, *layout), v):
        whole = values(0, N)
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(whole.to(torch.int32), 1), None
    return packed, layout


# ---- layers ----------------------------------------------------------------------------------


class Int8Linear(nn.Module):
    """y = (x @ q.T) * scale, q int8 [N, K].

    CPU with bf16/fp16 activations: `_weight_int8pack_mm`; under torch.compile with max-autotune
    (generate.py's CPU default) Inductor swaps in its own C++ GEMM template for it where that
    measures faster. Otherwise (float32, CUDA) a dequantize-then-matmul, which Inductor fuses on
    CUDA so the weight is read as int8."""

    def __init__(self, portable: dict, bias, dtype):
        super().__init__()
        self.out_features, self.in_features = portable["weight"].shape
        self.register_buffer("weight", portable["weight"].contiguous())
        self.register_buffer("scales", portable["scales"].to(dtype))
        self.bias = None if bias is None else nn.Parameter(bias.to(dtype), requires_grad=False)

    def forward(self, x):
        if x.device.type == "cpu" and x.dtype != torch.float32:
            y = torch.ops.aten._weight_int8pack_mm(
                x.reshape(-1, self.in_features), self.weight, self.scales
            )
            y = y.reshape(*x.shape[:-1], self.out_features)
        else:
            y = F.linear(x, self.weight.to(x.dtype)) * self.scales
        return y if self.bias is None else y + self.bias

    def dequantize(self) -> torch.Tensor:
        return self.weight.float() * self.scales.float()[:, None]


@functools.cache
def warn_once(message: str):
    print(f"warning: {message}", file=sys.stderr)


def check_int4_device(device) -> None:
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 0):
        raise ValueError(
            "int4 needs a CUDA GPU of compute capability 8.0 or newer (tinygemm kernel); use int8"
        )
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"int4 has no kernel on device {device.type!r}; use int8, or cpu or cuda")
    capability = torch.backends.cpu.get_cpu_capability()  # what ATEN_CPU_CAPABILITY may lower
    if device.type == "cpu" and (error := cpu_int4_kernel_error(capability)):
        raise ValueError(
            f"the CPU int4 kernel does not work under CPU capability {capability} "
            f"({error}); use --quantize int8"
        )


class Int4Linear(nn.Module):
    """y = x @ ((q - 8) * scale + zero).T per group of input channels, with the device's int4 kernel
    for few rows and, on CPU, dequantize + GEMM from int4_large_m's rows up."""

    compile_autotune = (
        False  # max-autotune does not speed its kernel and takes many GiB (compiling.autotune)
    )

    def __init__(self, portable: dict, bias, dtype, groupsize: int, device):
        """portable: the int4 tensors above, or {"cpu_packed": (bytes, layout), "scales", "zeros"}
        with the bytes already in the CPU kernel's layout (formats/fuse_layers.stack_int4)."""
        super().__init__()
        check_int4_device(device)
        self.groupsize, self.cpu = groupsize, torch.device(device).type == "cpu"
        self.layout = None
        self.register_buffer("portable_weight", None)
        if "cpu_packed" in portable:
            packed, self.layout = portable["cpu_packed"]
            self.out_features, self.in_features = packed.shape[0], 2 * packed.shape[1]
        else:
            weight = portable["weight"].to(device)  # [N, K/2], two values a byte
            self.out_features, self.in_features = weight.shape[0], 2 * weight.shape[1]
            packed = self._pack(weight)
        self.register_buffer("weight", packed)
        sz = torch.stack([portable["scales"], portable["zeros"]], dim=2).transpose(
            0, 1
        )  # [K/G, N, 2]
        kernel_dtype = dtype if self.cpu else torch.bfloat16  # tinygemm reads bf16 scales only
        self.register_buffer(
            "scales_and_zeros", sz.to(device=device, dtype=kernel_dtype).contiguous()
        )
        self.bias = None if bias is None else nn.Parameter(bias.to(dtype), requires_grad=False)

    def _pack(self, portable_weight: torch.Tensor) -> torch.Tensor:
        """Portable uint8 [N, K/2] -> the device kernel's packed weight (self.layout set on CPU)."""
        N = portable_weight.shape[0]
        if self.cpu:
            packed, self.layout = cpu_int4_pack(lambda i, j: unpack_int4(portable_weight[i:j]), N)
            if self.layout is None:  # an unknown layout: keep the portable values (N * K / 2 more)
                warn_once(
                    f"int4: the CPU kernel's packed layout under "
                    f"{torch.backends.cpu.get_cpu_capability()} is not one this "
                    "file knows; each layer keeps a second, portable copy of its values for prefill"
                )
                self.portable_weight = portable_weight.contiguous()
            return packed
        q = unpack_int4(portable_weight)
        # tinygemm: bf16, 2 values per byte (high nibble first), K a multiple of 16 x its inner k
        # tiles (SmolLM2's 576: 4)
        tiles = max(t for t in (2, 4, 8) if q.shape[1] % (16 * t) == 0)
        return torch.ops.aten._convert_weight_to_int4pack(
            (q[:, 0::2] << 4 | q[:, 1::2]).contiguous(), tiles
        )

    def forward(self, x):
        x2 = x.reshape(-1, self.in_features)
        if self.cpu and x2.shape[0] >= int4_large_m(self.out_features, self.in_features, x.dtype):
            y = padded_linear(x2, self.dense(x.dtype))
        elif self.cpu:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x2, self.weight, self.groupsize, self.scales_and_zeros
            )
        else:
            y = torch.ops.aten._weight_int4pack_mm(
                x2.to(torch.bfloat16), self.weight, self.groupsize, self.scales_and_zeros
            ).to(x.dtype)
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def dense(self, dtype, chunk: int = 256, least: int = 1 << 21) -> torch.Tensor:
        """dequantize().to(dtype), a block of `chunk` rows at a time where the kernel's layout
        keeps such blocks apart (rows of one layout block are contiguous): the float32 temporaries
        then stay in cache, several times faster on a large matrix (RESULTS.md, as above)."""
        N, K = self.out_features, self.in_features
        if self.layout is None or N * K <= least or chunk % self.layout[0]:
            return self.dequantize().to(dtype)
        out, flat = torch.empty(N, K, dtype=dtype), self.weight.reshape(-1)
        sz = self.scales_and_zeros.transpose(0, 1)  # [N, K / G, 2]
        for r in range(0, N, chunk):  # rows [r, r + n): bytes [r * K / 2, (r + n) * K / 2)
            n = min(chunk, N - r)  # (the last block may end in the layout's tail rows)
            q = cpu_int4_unpack(flat[r * K // 2 : (r + n) * K // 2], n, K, *self.layout)
            out[r : r + n] = dequantize_int4(q, sz[r : r + n, :, 0], sz[r : r + n, :, 1])
        return out

    def dequantize(self) -> torch.Tensor:
        N, K = self.out_features, self.in_features
        if self.cpu:
            q = (
                unpack_int4(self.portable_weight)
                if self.layout is None
                else cpu_int4_unpack(self.weight, N, K, *self.layout)
            )
        else:  # the kernel on the identity matrix returns W.T; a reference, not a fast path
            eye = torch.eye(K, device=self.weight.device, dtype=torch.bfloat16)
            return (
                torch.ops.aten._weight_int4pack_mm(
                    eye, self.weight, self.groupsize, self.scales_and_zeros
                )
                .t()
                .float()
            )
        sz = self.scales_and_zeros.transpose(0, 1)
        return dequantize_int4(q, sz[..., 0], sz[..., 1])


class Int8Embedding(nn.Module):
    """An embedding table stored int8 per row: looks up rows, then rescales them."""

    def __init__(self, portable: dict, dtype):
        super().__init__()
        self.register_buffer("weight", portable["weight"].contiguous())
        self.register_buffer("scales", portable["scales"].to(dtype))

    def forward(self, tokens):
        return (
            F.embedding(tokens, self.weight).to(self.scales.dtype) * self.scales[tokens][..., None]
        )


# ---- which layers, and the whole model -------------------------------------------------------


def check_mode(mode: str, groupsize: int):
    if mode not in MODES:
        raise ValueError(f"unknown quantization mode {mode!r}; choose from {', '.join(MODES)}")
    if mode == "int4" and groupsize not in GROUP_SIZES:
        raise ValueError(
            f"--groupsize {groupsize}: the int4 kernels take {', '.join(map(str, GROUP_SIZES))}"
        )


def plan(
    model, mode: str, groupsize: int = 64, head: bool = False, embedding: bool = False
) -> dict:
    """{module name: None if it gets quantized, else why it stays in higher precision}."""
    check_mode(mode, groupsize)
    out = {}
    for name, m in model.named_modules():
        if type(m) is moe.Experts:  # moe.py's stacked experts, each expert's rows as a layer's
            out[name] = m.int4_refusal(groupsize) if mode == "int4" else None
        if not isinstance(m, nn.Linear):
            continue
        N, K = m.weight.shape
        if name.endswith(("mlp.gate", "shared_expert_gate")):
            out[name] = "router (it picks the experts; a few KiB)"
        elif name.endswith("kv_b_proj"):  # model.MLAttention multiplies by its rows, per head
            out[name] = "latent attention's up-projection (read as a matrix, absorbed)"
        elif name == "lm_head" and not head:
            out[name] = "output head (--quantize_head to include it)"
        elif mode == "int4" and K % groupsize:
            out[name] = f"{K} input channels are not a multiple of the group size {groupsize}"
        elif mode == "int4" and N % 16:
            out[name] = f"{N} output channels are not a multiple of 16 (int4 kernel)"
        else:
            out[name] = None
    out["embed_tokens"] = None if embedding else "embedding (--quantize_embedding to store it int8)"
    return out


def portable_tensors(weight, mode: str, groupsize: int, rows: int = 4096) -> dict:
    """quantize_int8/int4 of `weight`, `rows` rows at a time (each row's result is its own, so the
    same tensors): their float32 temporaries are several times the weight, and SmolLM2's 49152-row
    head in one piece set the load's peak (benchmarks/RESULTS.md, "Weight-only quantization and
    the int8 KV cache (CPU)")."""
    one = quantize_int8 if mode == "int8" else lambda w: quantize_int4(w, groupsize)
    parts = [one(weight[i : i + rows]) for i in range(0, weight.shape[0], rows)]
    return {name: torch.cat([part[name] for part in parts]) for name in parts[0]}


def make_layer(portable: dict, bias, mode: str, groupsize: int, dtype, device):
    portable = {k: v.to(device) for k, v in portable.items()}
    bias = None if bias is None else bias.to(device)
    return (
        Int8Linear(portable, bias, dtype)
        if mode == "int8"
        else Int4Linear(portable, bias, dtype, groupsize, device)
    )


def _set(model, name: str, module):
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, module)


def quantize_model(
    model, mode: str, groupsize: int = 64, head: bool = False, embedding: bool = False
) -> dict:
    """Replace the planned layers in place; returns {"quantized": [...], "kept": {...}, bytes
    before/after}."""
    if any(hasattr(m, "dequantize") for m in model.modules()):
        raise ValueError(
            "the checkpoint is already quantized; drop --quantize, or quantize its float original"
        )
    if mode == "int4":
        check_int4_device(model.norm.weight.device)
    layers = plan(model, mode, groupsize, head, embedding)
    before = model.weight_bytes()
    tied = getattr(model.lm_head, "weight", None) is model.embed_tokens.weight
    for name, reason in layers.items():
        if reason is not None:
            continue
        m = model.get_submodule(name)
        if isinstance(m, moe.Experts):  # each expert's projection quantized as one layer's weight
            _set(
                model, name, moe.quantized(m, mode, lambda w: portable_tensors(w, mode, groupsize))
            )
            continue
        dtype, device = m.weight.dtype, m.weight.device
        if name == "embed_tokens":
            if (
                tied and mode == "int8" and isinstance(model.lm_head, Int8Linear)
            ):  # one int8 table serves both
                portable = {"weight": model.lm_head.weight, "scales": model.lm_head.scales}
            else:
                portable = quantize_int8(m.weight)
            _set(model, name, Int8Embedding(portable, dtype))
        else:
            _set(
                model,
                name,
                make_layer(
                    portable_tensors(m.weight, mode, groupsize),
                    m.bias,
                    mode,
                    groupsize,
                    dtype,
                    device,
                ),
            )
    report = {
        "mode": mode,
        "groupsize": groupsize if mode == "int4" else None,
        "quantized": [n for n, r in layers.items() if r is None],
        "kept": {n: r for n, r in layers.items() if r is not None},
        "bytes_before": before,
        "bytes_after": model.weight_bytes(),
    }
    return report  # quant_files.describe(report) says it in a line


def main(
    argv=None,
) -> int:  # the command line lives with the checkpoint writers (formats/hf_folder.py)
    from formats import hf_folder

    return hf_folder.main(argv)


if __name__ == "__main__":
    sys.exit(main())
