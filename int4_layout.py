"""The CPU int4 kernel's packed weight, read back: which rows each byte holds, per CPU capability.

    layout = find_cpu_int4_layout(packed, q)            # (block, pairing), or None: unknown layout
    q = cpu_int4_unpack(packed, N, K, *layout)          # uint8 [N, K], the values packed
    rows = cpu_int4_rows(packed, N, K, index, *layout)  # uint8 [len(index), K], only those rows

`torch._convert_weight_to_int4pack_for_cpu` packs int4 values [N, K] for
`_weight_int4pack_mm_for_cpu` in a layout private to ATen and chosen per CPU capability
(ATEN_CPU_CAPABILITY). quantize.Int4Linear and quant_groups.Int8GroupLinear keep only the packed
weight, so reading their values back (dequantize() for tests and large-row GEMMs, fusing q/k/v,
an embedding tied to a packed head) goes through these readers, and a layout is trusted only
after a round trip on the running machine (find_cpu_int4_layout on the layer's own weight).
"""

import torch

# The CPU int4 kernel's packed layout is private to ATen and chosen per CPU capability. Seen in
# torch 2.13: AVX-512 packs blocks of 64 output rows, each [K, 32] bytes holding rows j (low nibble)
# and j + 32 (high); AVX2 blocks of 32 rows, [K, 16] bytes, rows j and j + 16; the default (no SIMD)
# blocks of 32 rows holding neighbouring rows 2j, 2j + 1; rows past the last full block are stored
# as [K, rows / 2] bytes of neighbouring rows. Int4Linear never trusts this list: it unpacks its own
# packed weight with each candidate and keeps the one that gives its values back (a round trip on
# the running machine), else it keeps the portable values too.
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


def cpu_int4_rows(
    packed: torch.Tensor,
    N: int,
    K: int,
    rows: torch.Tensor,
    block: int = 64,
    pairing: str = "halves",
) -> torch.Tensor:
    """cpu_int4_unpack(packed, N, K, block, pairing)[rows] -> uint8 [len(rows), K], reading only
    those rows' bytes (an embedding lookup into a tied head kept packed)."""
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


def find_cpu_int4_layout(packed: torch.Tensor, q: torch.Tensor):
    """The (block, pairing) of CPU_INT4_LAYOUTS that unpacks `packed` back to `q` [N, K], or
    None."""
    for layout in CPU_INT4_LAYOUTS:
        if torch.equal(cpu_int4_unpack(packed, *q.shape, *layout), q):
            return layout
    return None
