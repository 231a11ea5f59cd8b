"""Weights run in a checkpoint's own quantized form: int8 values with a scale (and an offset) per
group of input channels, and the record that carries such a weight from a file reader to the model.

    w[n, k] = q[n, k] * scale[n, g] + offset[n, g]  g = k // groupsize, q int8, scale/offset float32

This one form holds every GGUF block type of the legacy and K families *exactly*
(formats/gguf_weights.py decodes the blocks into it): Q8_0 is q * d; Q4_0 and Q5_0 are d * (q - 8)
and d * (q - 16), stored as the signed q; Q4_1 and Q5_1 add a minimum m; Q4_K and Q5_K have per-32
scales d * sc and offsets -dmin * m; Q6_K per-16 scales d * sc. The arithmetic is float32 in the
order gguf.quants uses, so `dequantize()` equals gguf's dequantization bit for bit (in bf16 on
CPU the layer holds those values with bf16 scales: Int8GroupLinear).

`Packed` is what a checkpoint reader yields for a weight it keeps quantized; weights.build turns it
into a layer: "int4" -> quantize.Int4Linear (the int4 kernels: 4 bits per weight read), "int8g" ->
Int8GroupLinear / Int8GroupEmbedding here. There is no ATen kernel for int8 with group scales. In
bf16 on CPU, Int8GroupLinear splits each int8 value into two nibbles and runs the int4 kernel once
over both halves (its docstring shows the arithmetic). Otherwise eager code dequantizes and runs a
GEMM, and under torch.compile few-row calls (decode) are written as a reduction over each group,
which Inductor fuses so the weight is read once as int8.
"""

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

import cpu_kernels
import moe
import quantize
from memory import release_memory

# The output head is the largest matrix of small models. An int8-group head (Q8_0, Q6_K, ...) runs
# as Int8GroupLinear's two int4 halves where it can (bf16 on CPU, groups up to 128: SmolLM2's
# 49152 x 576 head at batch 1, Xeon AVX-512, 1.9 ms against 2.2 ms for a bf16 F.linear, at half its
# bytes, on an earlier layout of the halves); otherwise dequantized to the activations' dtype: the
# other int8-group paths are slower than a bf16 GEMM there (compiled reduction 2.8 ms, eager
# dequantize + GEMM 30-115 ms). A tied head holds the embedding table's values: where it keeps them
# as the two halves, the embedding reads its rows from there (no second int8 copy). Int4 heads
# (Q4_*) keep the int4 kernel.
HEAD_NOTE = (
    "an int8-group output head runs as two int4 halves in bf16 on CPU, "
    "else in the activations' dtype"
)
FEW_ROWS = 4  # rows up to which a compiled call reduces group by group instead of dequantizing
PAIR_GROUPS = (16, 32, 64, 128)  # G for which a kernel group of 2G exists (the kernel: 32-256)
PACK_ROWS = 1024  # rows packed at a time (quantize.cpu_int4_pack; a multiple of 64-row blocks)


def dequantize_groups(q: torch.Tensor, scales: torch.Tensor, offsets=None) -> torch.Tensor:
    """q int8 [N, K], scales/offsets float32 [N, K/G] -> float32 [N, K], as q * scale + offset."""
    N, K = q.shape
    G = scales.shape[1]
    w = q.reshape(N, G, K // G).float() * scales.float()[..., None]
    if offsets is not None:
        w = w + offsets.float()[..., None]
    return w.reshape(N, K)


def cpu_int4_rows(
    packed: torch.Tensor,
    N: int,
    K: int,
    rows: torch.Tensor,
    block: int = 64,
    pairing: str = "halves",
) -> torch.Tensor:
    """quantize.cpu_int4_unpack(packed, N, K, block, pairing)[rows] -> uint8 [len(rows), K],
    reading only those rows' bytes (an embedding lookup into a tied head kept packed)."""
    flat, full = packed.reshape(-1), N // block * block
    got, high = (
        torch.zeros(rows.shape[0], K, dtype=torch.uint8, device=packed.device),
        rows < 0,
    )  # [T, K], [T] (a size export keeps symbolic)
    if full:  # rows in whole blocks ([blocks, K, block / 2] bytes)
        r = rows.clamp(max=full - 1)
        col, high = (
            (r % block % (block // 2), r % block >= block // 2)
            if pairing == "halves"
            else (r % block // 2, r % 2 == 1)
        )
        got = flat[: full * K // 2].view(N // block, K, block // 2)[r // block, :, col]
    if full < N:  # rows past the last whole block: [K, (N - full) / 2] bytes of neighbouring rows
        t, in_tail = (rows - full).clamp(min=0), rows >= full
        got = torch.where(in_tail[:, None], flat[full * K // 2 :].view(K, -1)[:, t // 2].t(), got)
        high = torch.where(in_tail, t % 2 == 1, high)
    return torch.where(high[:, None], got >> 4, got & 15)


class Int8GroupLinear(nn.Module):
    """y = x @ (q * scale + offset).T with int8 q [N, K] and float32 scale/offset [N, K/G].

    In bf16 on CPU the int8 values are held as nibbles instead (`pair`): one int4 matrix of 2K
    columns for the CPU int4 kernel, whose value v means (v - 8) * scale + zero per kernel group.
    Each group of G inputs becomes one kernel group of 2G columns, its G low nibbles then its G
    high ones, and the input is x_g followed by 16 * x_g (a power of two: exact in bf16):
    - balanced (no offsets, q <= 119: Q6_K, Q5_0): q = lo + 16 * hi, lo and hi in [-8, 7],
      stored + 8; zero 0, so the group sums s * (lo + 16 * hi) = s * q, exactly.
    - otherwise (Q8_0's 127, offsets): lo = q & 15, hi = q >> 4 in [-8, 7] stored + 8; the group
      sums s * (lo - 8 + 16 * hi) + 17 * zero = s * q + offset with zero = (8 * s + offset) / 17,
      which rounds to bf16 as the scales do.
    One kernel call reads 1 byte per weight as int8 does, and (scale, zero) once per G weights.
    The kernel takes bf16: the weights it holds are bf16(s) * q + 17 * bf16(zero) (- 8 * bf16(s)),
    and dequantize() returns those (group_scales), so every row count computes with one set of
    weights; the float32 scales are not kept beside the pair (0.125-0.25 bytes a weight). Float32
    models keep the int8 values (the kernel has no fast float32 path)."""

    compile_autotune = (
        False  # the compiled path is a fused reduction or the int4 kernel, not a GEMM template
    )

    def __init__(self, q, scales, offsets, bias, dtype):
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.groupsize, self.dtype = self.in_features // scales.shape[1], dtype
        self.register_buffer("weight", q.contiguous())
        self.register_buffer("scales", scales.float().contiguous())
        self.register_buffer("offsets", None if offsets is None else offsets.float().contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.to(dtype), requires_grad=False)
        self.register_buffer("pair", None)  # the int4 kernel's [N, 2K] matrix of nibbles (above)
        self.register_buffer("pair_scales", None)  # [K/G, N, 2] bf16 (scale, zero) per 2G columns
        self.layout = None  # the kernel's packed layout (quantize.CPU_INT4_LAYOUTS) with `pair`
        self.balanced = False  # the pair's nibbles (the docstring's two layouts): _pack_pair
        if (
            dtype == torch.bfloat16
            and q.device.type == "cpu"
            and q.shape[0] % 16 == 0
            and self.groupsize in PAIR_GROUPS
        ):  # (the int4 kernel's constraints: group sizes 2G, N a multiple of 16)
            self._pack_pair()

    def _nibbles(self, q: torch.Tensor) -> torch.Tensor:
        """q int8 [R, K] -> the kernel's values uint8 [R, 2K] (the layouts in the docstring)."""
        R, K, G = q.shape[0], self.in_features, self.groupsize
        hi = (q + 8) >> 4 if self.balanced else q >> 4  # arithmetic shifts
        lo = q - 16 * hi + (8 if self.balanced else 0)
        return (
            torch.stack([lo.view(R, -1, G), (hi + 8).view(R, -1, G)], 2)
            .view(R, 2 * K)
            .to(torch.uint8)
        )

    def _pack_pair(self):
        try:
            quantize.check_int4_device(self.weight.device)
        except ValueError:  # no working int4 kernel under this CPU capability: keep int8
            return
        q, N = self.weight, self.weight.shape[0]
        self.balanced = self.offsets is None and int(q.max()) <= 119  # (int8: q >= -128 > -136)
        packed, layout = quantize.cpu_int4_pack(lambda i, j: self._nibbles(q[i:j]), N, PACK_ROWS)
        if layout is None:  # a layout this file cannot read back: keep int8
            return
        s = self.scales
        o = self.offsets if self.offsets is not None else torch.zeros_like(s)
        zero = torch.zeros_like(s) if self.balanced else (8 * s + o) / 17
        self.pair_scales = torch.stack([s, zero], 2).transpose(0, 1).bfloat16().contiguous()
        self.pair, self.layout = packed, layout
        self.weight = self.scales = self.offsets = None

    def group_scales(self) -> tuple:
        """(scales, offsets or None) float32 [N, K/G]: with the pair, those of the bf16 weights the
        kernel holds (see the docstring)."""
        if self.pair is None:
            return self.scales, self.offsets
        s, zero = self.pair_scales.float().transpose(0, 1).unbind(2)  # [N, K/G] each
        return s, None if self.balanced else 17 * zero - 8 * s

    def int8_values(self) -> torch.Tensor:
        """q int8 [N, K], read back from the nibble pair when that is what is stored."""
        if self.pair is None:
            return self.weight
        N, K = self.out_features, self.in_features
        return self._from_nibbles(quantize.cpu_int4_unpack(self.pair, N, 2 * K, *self.layout))

    def int8_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """int8_values()[rows] -> [len(rows), K], unpacking only those rows."""
        if self.pair is None:
            return self.weight[rows]
        return self._from_nibbles(
            cpu_int4_rows(self.pair, self.out_features, 2 * self.in_features, rows, *self.layout)
        )

    def _from_nibbles(self, v: torch.Tensor) -> torch.Tensor:
        """The kernel's values uint8 [R, 2K] -> q int8 [R, K] (inverts _nibbles)."""
        R, K, G = v.shape[0], self.in_features, self.groupsize
        v = v.to(torch.int16).view(R, K // G, 2, G)
        lo = v[:, :, 0] - (8 if self.balanced else 0)
        return (lo + 16 * (v[:, :, 1] - 8)).reshape(R, K).to(torch.int8)

    def forward(self, x):
        x2 = x.reshape(-1, self.in_features)  # [M, K]
        # the kernel over 2K columns meets dense() + GEMM near 128 rows at every size (RESULTS.md)
        if self.pair is not None and x2.shape[0] < quantize.INT4_LARGE_M:
            M, G = x2.shape[0], self.groupsize
            xg = x2.to(torch.bfloat16).view(M, self.in_features // G, 1, G)  # [M, K/G, 1, G]
            xx = torch.cat([xg, 16 * xg], 2).view(
                M, 2 * self.in_features
            )  # each group, then 16x it
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                xx, self.pair, 2 * G, self.pair_scales
            ).to(x.dtype)
        elif self.pair is None and torch.compiler.is_compiling() and x2.shape[0] <= FEW_ROWS:
            G = self.scales.shape[1]
            xg = x2.float().reshape(-1, 1, G, self.groupsize)  # [M, 1, G, g]
            z = (self.weight.reshape(self.out_features, G, self.groupsize).float() * xg).sum(
                -1
            )  # [M, N, G]
            y = (z * self.scales).sum(-1)
            if self.offsets is not None:
                y = (
                    y + xg.sum(-1)[:, 0] @ self.offsets.t()
                )  # sum_g offset[n, g] * sum_{k in g} x[k]
            y = y.to(x.dtype)
        elif x2.shape[0] >= quantize.INT4_LARGE_M:
            y = cpu_kernels.padded_linear(x2, self.dense(x.dtype))
        else:
            y = F.linear(x2, self.dense(x.dtype))
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def dequantize(self) -> torch.Tensor:
        return dequantize_groups(self.int8_values(), *self.group_scales())

    def dense(self, dtype, chunk: int = 256, least: int = 1 << 21) -> torch.Tensor:
        """dequantize().to(dtype), from the pair a block of `chunk` rows at a time where the
        layout keeps such blocks apart: its temporaries stay in cache (as Int4Linear.dense's)."""
        N, K = self.out_features, self.in_features
        if self.pair is None or N * K <= least or chunk % self.layout[0]:
            return self.dequantize().to(dtype)
        out, flat, (s, o) = (
            torch.empty(N, K, dtype=dtype),
            self.pair.reshape(-1),
            self.group_scales(),
        )
        for r in range(0, N, chunk):  # rows [r, r + n): bytes [r * K, (r + n) * K), maybe a tail
            n = min(chunk, N - r)
            v = quantize.cpu_int4_unpack(flat[r * K : (r + n) * K], n, 2 * K, *self.layout)
            rows = slice(r, r + n)
            out[rows] = dequantize_groups(
                self._from_nibbles(v), s[rows], o if o is None else o[rows]
            )
        return out


class Int8GroupEmbedding(nn.Module):
    """An embedding table in the same form: looks up rows of q and their groups, then dequantizes.

    head: the tied output head over the same values, when it keeps them as an int4 nibble pair;
    rows are then read back from its pair (Int8GroupLinear.int8_rows) and q is not kept twice
    (SmolLM2's 49152 x 576 table: 27 MiB). The scales stay float32 here, so the rows are the
    file's values exactly."""

    def __init__(self, q, scales, offsets, dtype, head=None):
        super().__init__()
        self.register_buffer("weight", None if head is not None else q.contiguous())
        self.register_buffer("scales", scales.float().contiguous())
        self.register_buffer("offsets", None if offsets is None else offsets.float().contiguous())
        self.dtype = dtype
        self.__dict__["head"] = (
            head  # a plain reference: the model holds the head as lm_head already
        )

    def forward(self, tokens):  # [B, T] -> [B, T, dim]
        flat = tokens.reshape(-1)
        offsets = None if self.offsets is None else self.offsets[flat]
        q = self.weight[flat] if self.head is None else self.head.int8_rows(flat)
        rows = dequantize_groups(q, self.scales[flat], offsets)
        return rows.reshape(*tokens.shape, -1).to(self.dtype)

    def int8_values(self) -> torch.Tensor:
        return self.weight if self.head is None else self.head.int8_values()

    def dequantize(self) -> torch.Tensor:
        return dequantize_groups(self.int8_values(), self.scales, self.offsets)


@dataclass
class Packed:
    """A weight a checkpoint reader keeps quantized; weights.build makes it a layer.

    kind "int4": tensors = quantize.py's portable int4 {"weight", "scales", "zeros"} (q in [0, 15]);
    kind "int8g": tensors = {"q", "scales", "offsets" (or None)} as in this file's header."""

    kind: str
    tensors: dict
    # [N, K] of the float weight it stands for ([E, N, K] for stacked experts, each tensor [E, N,
    # ...])
    shape: tuple
    groupsize: int
    source: str  # what the file holds, for the load plan: "Q4_1", "gptq int4 g128", ...

    def rows(self, index: torch.Tensor) -> "Packed":
        """The weight's rows `index`, reordered or a subset (every tensor here is per row first)."""
        tensors = {k: None if v is None else v[index] for k, v in self.tensors.items()}
        return Packed(self.kind, tensors, (len(index), self.shape[1]), self.groupsize, self.source)

    def nbytes(self) -> int:
        return sum(v.numel() * v.element_size() for v in self.tensors.values() if v is not None)

    def dequantize(self) -> torch.Tensor:
        t = self.tensors
        if self.kind == "int4":
            return quantize.dequantize_int4(
                quantize.unpack_int4(t["weight"]), t["scales"], t["zeros"]
            )
        return dequantize_groups(t["q"], t["scales"], t["offsets"])

    def int8_tensors(self, device=None):
        """(q int8, scales, offsets) of this weight as int8 groups; int4 is (u - 8) * scale +
        zero."""
        t = {k: None if v is None else v.to(device) for k, v in self.tensors.items()}
        if self.kind == "int4":
            return quantize.unpack_int4(t["weight"]).to(torch.int8) - 8, t["scales"], t["zeros"]
        return t["q"], t["scales"], t["offsets"]

    def layer(self, bias, dtype, device) -> nn.Module:
        bias = None if bias is None else bias.to(device)
        if self.kind == "int4":
            try:
                t = {k: v.to(device) for k, v in self.tensors.items()}
                return quantize.make_layer(t, bias, "int4", self.groupsize, dtype, device)
            except ValueError as e:  # no working int4 kernel here: the same values as int8
                quantize.warn_once(f"{self.source} weights run as int8 groups: {e}")
        return Int8GroupLinear(*self.int8_tensors(device), bias, dtype)

    def embedding(self, dtype, device, head=None) -> nn.Module:
        return Int8GroupEmbedding(*self.int8_tensors(device), dtype, head)

    def float_layer(self, dtype, device) -> nn.Linear:
        """The weight dequantized to `dtype` as a plain linear layer (see HEAD_NOTE)."""
        head = nn.Linear(self.shape[1], self.shape[0], bias=False, device="meta")
        weight = torch.empty(self.shape, device=device, dtype=dtype)
        for i in range(
            0, self.shape[0], 4096
        ):  # in slices: no float32 copy of the whole table at once
            weight[i : i + 4096] = self.rows(
                torch.arange(i, min(i + 4096, self.shape[0]))
            ).dequantize()
        head.weight = nn.Parameter(weight, requires_grad=False)
        return head


def install(model, packed: dict, state: dict, dtype, device, tied: bool, own_bits: dict):
    """Replace the layers whose weights came as Packed ({module name: Packed}; their biases popped
    from `state`); `own_bits` gets what runs at the file's own bits, {layer kind: {"<file type> ->
    <what runs>"}}, for the load line (describe)."""
    for i, name in enumerate(list(packed)):
        if i % 32 == 31:
            release_memory()  # the int4 packing's temporaries, before they pile up
        p = (
            packed[name] if name == "embed_tokens" else packed.pop(name)
        )  # each file copy freed once used
        if name == "embed_tokens" and tied:
            continue  # with its head, below
        if name == "embed_tokens":
            module = p.embedding(dtype, device)
        elif name == "lm_head" and p.kind == "int8g":
            module = _head(p, dtype, device)
        else:
            module = p.layer(state.pop(f"{name}.bias", None), dtype, device)
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, module)
        own_bits.setdefault(leaf, set()).add(f"{p.source} -> {_runs_as(module, p)}")
    if (
        tied and "embed_tokens" in packed
    ):  # the tied head (_head), then the table, read from it where it can
        p = packed["embed_tokens"]
        model.lm_head = head = _head(p, dtype, device)
        shared = (
            isinstance(head, Int8GroupLinear) and head.pair is not None
        )  # the table read from the head's pair
        model.embed_tokens = p.embedding(dtype, device, head if shared else None)
        own_bits["lm_head"] = {f"{p.source} -> {_runs_as(model.lm_head, p)}"}
        own_bits.setdefault("embed_tokens", set()).add(
            f"{p.source} -> {_runs_as(model.embed_tokens, p)}"
            + (" (read from lm_head's halves)" if shared else "")
        )
    release_memory()


def install_experts(model, name: str, parts: dict, dtype, device, own_bits: dict):
    """Stacked experts (moe.py) whose projections came as Packed [E, N, K] (a float tensor for a
    type read as float): a moe.GroupExperts with each projection at the file's own bits."""
    experts, groups = model.get_submodule(name), {}
    for projection, p in parts.items():
        if not isinstance(p, Packed):
            groups[projection] = ("float", p.to(device))
            continue
        t = {k: None if v is None else v.to(device) for k, v in p.tensors.items()}
        bits = {"int4": "int4", "e2m1": "e2m1"}.get(
            p.kind, "int8"
        )  # (e2m1: formats/mxfp4.py's codes and powers of two)
        groups[projection] = (
            bits,
            *(
                (t["weight"], t["scales"], t["zeros"])
                if bits == "int4"
                else (t["q"], t["scales"], t.get("offsets"))
            ),
        )
        own_bits.setdefault(f"experts.{projection}", set()).add(
            f"{p.source} -> {bits} g{p.groupsize}"
        )
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent), leaf, moe.GroupExperts(experts, groups, dtype))


def _head(p: Packed, dtype, device) -> nn.Module:
    """An int8-group output head: the two int4 halves where they run, else float (HEAD_NOTE)."""
    layer = p.layer(None, dtype, device)
    return layer if layer.pair is not None else p.float_layer(dtype, device)


def _runs_as(module, p: Packed) -> str:
    if isinstance(module, nn.Linear):
        return str(module.weight.dtype).removeprefix("torch.")
    if isinstance(module, Int8GroupLinear) and module.pair is not None:
        return f"int8 g{p.groupsize} (two int4 halves)"
    return f"{'int4' if isinstance(module, quantize.Int4Linear) else 'int8'} g{p.groupsize}"


def describe(own_bits: dict) -> str:
    """{layer kind: {route}} -> "Q4_1 -> int4 g32: q_proj, k_proj; Q8_0 -> int8 g32:
    embed_tokens"."""
    by_route = {}
    for leaf, routes in own_bits.items():
        for route in sorted(routes):
            by_route.setdefault(route, []).append(leaf)
    text = "; ".join(f"{route}: {', '.join(leaves)}" for route, leaves in by_route.items())
    if any(
        " -> int8 " in r and "int4" not in r
        for leaf, routes in own_bits.items()
        if leaf != "embed_tokens"
        for r in routes
    ):
        text += (
            " (int8-group matrices run without a fast kernel unless bf16 on CPU: "
            "where they are most of the model, --dequantize may decode faster, in more memory; "
            "benchmarks/RESULTS.md)"
        )
    return text
