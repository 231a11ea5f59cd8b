"""LoRA adapters: many fine-tunes of one base model served in the same batch.

A LoRA fine-tune leaves the base weight W [out, in] alone and learns two thin matrices per
projection, A [r, in] and B [out, r], so the tuned layer is

    y = W x + s * B (A x),        s = alpha / r (alpha / sqrt(r) with rsLoRA)

Its files hold only A and B (formats/lora_files.py reads PEFT's). Serving many adapters over one
base means a step whose rows use different adapters, and the base. Each wrapped projection keeps
the adapters now resident in S slots, stacked: A [S * k * R, in] and B [out, S * k * R] (k: the
parts of a fused layer, q/k/v or gate/up; R: the largest rank, a smaller one zero-padded; s folded
into B). A step's adapter per row becomes a mask [N, S * k * R] keeping each row's own columns:

    y = base(x) + ((x @ A.T) * mask) @ B.T      # x [N, in]: two matmuls, whatever the mix

Why stacked slots and not each row's A and B gathered (the S-LoRA / Punica kernels)? Without a
kernel of our own, torch's gather copies N * R * (in + out) values per layer and step before
multiplying; the stacked form reads each resident adapter once, S * R * (in + out) values, and
spends N * S * R * (in + out) multiply-adds. At S * R = 64 (4 slots of rank 16) that is under a
fifth of the base's N * in * out at SmolLM2's sizes; bench_lora.py measures the step. A step where
no row uses an adapter skips both matmuls (mask None).

    adapters = Adapters(model, max_loras=4, max_rank=16)  # wraps every projection, slots empty
    slot = adapters.load(adapter)                         # a formats/lora_files.read_adapter one
    adapters.set_rows([slot, -1, slot])                   # per flat token; -1: the base
    logits = model(tokens, input_pos, cache)
    adapters.use(slot)                                     # generate.py: every row, any shape

Run `python -m pytest tests/test_lora.py` to see it checked against the `peft` package.
"""

import contextlib
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from model import MLP

# what a PEFT target names -> the projections it covers (a fused one covers several, in order)
TARGETS = {
    "q_proj": ("q",),
    "k_proj": ("k",),
    "v_proj": ("v",),
    "o_proj": ("o",),
    "gate_proj": ("gate",),
    "up_proj": ("up",),
    "down_proj": ("down",),
    "qkv_proj": ("q", "k", "v"),  # Phi-3's
    "gate_up_proj": ("gate", "up"),
}


class UnknownAdapter(ValueError):
    """A request names an adapter that is not loaded (a server's 404)."""


@dataclass
class Adapter:
    """One fine-tune, read from its files: weights {(layer, target): (A [r, in], B [out, r] times
    its scale)} in float32; key: a 128-bit fingerprint of them, the root of its prefix-cache
    hashes (a prefix computed under one adapter never serves another)."""

    name: str
    weights: dict
    rank: int
    key: int
    path: str = ""


def projection_shapes(config) -> dict:
    """{projection: (in, out)} of every decoder layer, from the config alone."""
    q, kv = config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
    d, f = config.dim, config.intermediate_size
    return {
        "q": (d, q),
        "k": (d, kv),
        "v": (d, kv),
        "o": (q, d),
        "gate": (d, f),
        "up": (d, f),
        "down": (f, d),
    }


def target_shape(config, target: str) -> tuple:
    """(in, out) of a PEFT target: a fused one's outputs are its parts' stacked."""
    shapes = projection_shapes(config)
    parts = TARGETS[target]
    return shapes[parts[0]][0], sum(shapes[p][1] for p in parts)


class LoraLinear(nn.Module):
    """A projection (any weight format: float, int8, int4, GGUF groups) plus the resident
    adapters' deltas. parts: the projections its outputs stack, [(name, width)]."""

    def __init__(self, base, slots, parts, in_features: int, dtype, device):
        super().__init__()
        self.base, self.slots, self.parts = base, slots, parts
        self.k, self.offsets = len(parts), {}
        row = 0
        for j, (name, width) in enumerate(parts):
            self.offsets[name] = (j, row, width)
            row += width
        self.sr = slots.max_loras * slots.max_rank  # one part's columns: S slots of R
        # A's rows part-major [k, S, R]; B [out, k*S*R]: a part's rows use its own columns only
        a = torch.zeros(self.k * self.sr, in_features, dtype=dtype, device=device)
        self.register_buffer("lora_A", a)
        b = torch.zeros(row, self.k * self.sr, dtype=dtype, device=device)
        self.register_buffer("lora_B", b)

    def forward(self, x):
        y = self.base(x)
        mask = self.slots.mask(self.k)  # [N, k*S*R], or [k*S*R] for every row, or None
        if mask is None:
            return y
        h = F.linear(x, self.lora_A) * mask  # [..., k*S*R]: each row's own slot's columns
        return y + F.linear(h, self.lora_B)

    def write(self, slot: int, name: str, a, b):
        """Projection `name`'s A [r, in] and scaled B [width, r] into `slot`."""
        j, row, width = self.offsets[name]
        r, col = a.shape[0], j * self.sr + slot * self.slots.max_rank  # part j's, slot's columns
        self.lora_A[col : col + r] = a.to(self.lora_A.dtype)
        self.lora_B[row : row + width, col : col + r] = b.to(self.lora_B.dtype)

    def clear(self, slot: int):
        R = self.slots.max_rank
        for j in range(self.k):
            self.lora_A[j * self.sr + slot * R : j * self.sr + (slot + 1) * R] = 0
            self.lora_B[:, j * self.sr + slot * R : j * self.sr + (slot + 1) * R] = 0


def _wrap(parent, names, slots, config, dtype, device) -> list:
    """parent's projection(s) wrapped: a fused one (qkv_proj, gate_up_proj) if present, else each
    of `names`. -> [(projection, LoraLinear)]; slots.wrapped records where each went."""
    shapes = projection_shapes(config)
    fused = {"q": "qkv_proj", "gate": "gate_up_proj"}.get(names[0])
    if fused and getattr(parent, fused, None) is not None:
        groups = [(fused, names)]
    else:
        groups = [(f"{n}_proj", (n,)) for n in names]
    out = []
    for attr, parts in groups:
        widths = [(p, shapes[p][1]) for p in parts]
        layer = LoraLinear(getattr(parent, attr), slots, widths, shapes[parts[0]][0], dtype, device)
        setattr(parent, attr, layer)
        slots.wrapped.append((parent, attr, layer))
        out += [(p, layer) for p in parts]
    return out


class Adapters:
    """The resident adapters of one model: at most max_loras, each of rank <= max_rank, in slots
    every projection shares. Loading past max_loras evicts the least recently used adapter no
    request uses; unloading one in use lets its requests finish first (it takes no new ones)."""

    def __init__(self, model, max_loras: int = 4, max_rank: int = 16):
        if max_loras < 1 or max_rank < 1:
            raise ValueError(f"max_loras and max_rank must be >= 1, got {max_loras}, {max_rank}")
        if any(isinstance(m, LoraLinear) for m in model.modules()):
            raise ValueError("this model already carries adapter slots (one Adapters per model)")
        self.max_loras, self.max_rank, self.config = max_loras, max_rank, model.config
        self.names = [None] * max_loras  # each slot's adapter name
        self.adapters, self.last_used, self.draining = {}, {}, set()
        self.onehot = self.everywhere = None
        self._masks = {}
        dtype, device = model.norm.weight.dtype, model.norm.weight.device
        self.where, self.wrapped = {}, []  # (layer, projection) -> its LoraLinear
        for i, layer in enumerate(model.layers):
            mlp = layer.mlp
            groups = [(layer.self_attn, ("q", "k", "v")), (layer.self_attn, ("o",))]
            if isinstance(mlp, MLP):  # a mixture's experts are not wrapped
                groups += [(mlp, ("gate", "up")), (mlp, ("down",))]
            for parent, names in groups:
                for p, m in _wrap(parent, names, self, model.config, dtype, device):
                    self.where[i, p] = m

    @contextlib.contextmanager
    def unwrapped(self):
        """The model as it was, for a while: a compiled step exported from the checkpoint binds
        the base layers' tensors by their own names (server/tp_engine.py's ahead-of-time step,
        which serves the steps no adapter row is in)."""
        for parent, attr, layer in self.wrapped:
            setattr(parent, attr, layer.base)
        try:
            yield
        finally:
            for parent, attr, layer in self.wrapped:
                setattr(parent, attr, layer)

    def nbytes(self) -> int:
        mods = {id(m): m for m in self.where.values()}.values()
        return sum(m.lora_A.nbytes + m.lora_B.nbytes for m in mods)

    # -- which rows use which slot -------------------------------------------------------------
    def set_rows(self, slots):
        """This step's slot per flat token (-1: the base model's own output)."""
        self._masks, self.everywhere = {}, None
        used = [s for s in slots if s >= 0]
        self.onehot = None
        if used:
            dtype, device = self._dtype_device()
            ids = torch.tensor(slots, device=device)
            self.onehot = (ids[:, None] == torch.arange(self.max_loras, device=device)).to(dtype)

    def use(self, slot):
        """Every row, whatever its shape, through `slot` (None: the base)."""
        self._masks, self.onehot, self.everywhere = {}, None, slot

    def mask(self, k: int):
        """The columns [N, k * S * R] (or [k * S * R]) a layer of k parts keeps (part-major), or
        None."""
        if self.onehot is None and self.everywhere is None:
            return None
        if k not in self._masks:
            if self.onehot is not None:
                self._masks[k] = self.onehot.repeat_interleave(self.max_rank, dim=1).repeat(1, k)
            else:
                dtype, device = self._dtype_device()
                m = torch.zeros(self.max_loras, self.max_rank, dtype=dtype, device=device)
                m[self.everywhere] = 1
                self._masks[k] = m.flatten().repeat(k)
        return self._masks[k]

    def _dtype_device(self):
        t = next(iter(self.where.values())).lora_A
        return t.dtype, t.device

    # -- loading and unloading -----------------------------------------------------------------
    def slot_of(self, name: str) -> int:
        """The slot of a resident adapter taking requests; UnknownAdapter naming the known ones."""
        if name not in self.adapters or name in self.draining:
            known = ", ".join(sorted(n for n in self.adapters if n not in self.draining))
            raise UnknownAdapter(f"no adapter {name!r} is loaded (loaded: {known or 'none'})")
        self.last_used[name] = time.monotonic()
        return self.names.index(name)

    def load(self, adapter: Adapter, in_use=frozenset()) -> int:
        """Make `adapter` resident (replacing one of the same name) -> its slot. in_use: the names
        requests still run under; those are never evicted."""
        self.check(adapter)
        in_use = set(in_use)
        if adapter.name in self.adapters:
            if adapter.name in in_use:
                raise RuntimeError(
                    f"adapter {adapter.name!r} is in use by running requests; unload it first"
                )
            self._free(self.names.index(adapter.name))
        slot = self._free_slot(in_use)
        for (layer, target), (a, b) in adapter.weights.items():
            row = 0
            for p in TARGETS[target]:  # a fused target's B split over the projections it covers
                m = self.where[layer, p]
                width = m.offsets[p][2]
                m.write(slot, p, a, b[row : row + width])
                row += width
        self.names[slot], self.adapters[adapter.name] = adapter.name, adapter
        self.last_used[adapter.name] = time.monotonic()
        return slot

    def unload(self, name: str, in_use=frozenset()):
        """Take no new requests for `name`; its slot frees once no request in `in_use` uses it."""
        self.slot_of(name)
        self.draining.add(name)
        if name not in in_use:
            self._free(self.names.index(name))

    def _free_slot(self, in_use: set) -> int:
        for slot, name in enumerate(self.names):  # drained adapters whose requests are over
            if name in self.draining and name not in in_use:
                self._free(slot)
        if None in self.names:
            return self.names.index(None)
        idle = [n for n in self.names if n not in in_use]
        if not idle:
            raise RuntimeError(
                f"all {self.max_loras} adapter slots are in use by running requests "
                f"({', '.join(self.names)}); retry later, unload one, or raise --max_loras"
            )
        victim = min(idle, key=lambda n: self.last_used[n])
        slot = self.names.index(victim)
        self._free(slot)
        return slot

    def _free(self, slot: int):
        name = self.names[slot]
        for m in {id(m): m for m in self.where.values()}.values():
            m.clear(slot)
        self.names[slot] = None
        self.adapters.pop(name, None)
        self.draining.discard(name)

    def check(self, adapter: Adapter):
        """ValueError if the slots cannot hold it: too large a rank, a projection not wrapped."""
        if adapter.rank > self.max_rank:
            raise ValueError(
                f"adapter {adapter.name!r} has rank {adapter.rank}; the slots hold ranks up to "
                f"{self.max_rank} (raise --max_lora_rank)"
            )
        for layer, target in adapter.weights:
            missing = [p for p in TARGETS[target] if (layer, p) not in self.where]
            if missing:
                raise ValueError(
                    f"adapter {adapter.name!r} targets {target} of layer {layer}, a mixture of "
                    "experts' projection: adapters on experts are not supported"
                )

    def resident(self) -> list:
        """The names taking requests, in slot order."""
        return [n for n in self.names if n is not None and n not in self.draining]


def merge(model, adapter: Adapter, scale: float = 1.0):
    """W += scale * B A in place, for float weights only (generate.py --merge_lora): the merged
    model runs at the base's speed and equals the adapter applied on the fly."""
    shapes = projection_shapes(model.config)
    for (i, target), (a, b) in adapter.weights.items():
        layer, row = model.layers[i], 0
        for p in TARGETS[target]:
            width = shapes[p][1]
            parent = layer.self_attn if p in ("q", "k", "v", "o") else layer.mlp
            fused = {"q": "qkv_proj", "k": "qkv_proj", "v": "qkv_proj"}.get(p)
            fused = fused or {"gate": "gate_up_proj", "up": "gate_up_proj"}.get(p)
            lin, start = getattr(parent, fused, None) if fused else None, 0
            if lin is not None:  # a fused layer: p's rows after the parts before it
                order = ("q", "k", "v") if fused == "qkv_proj" else ("gate", "up")
                start = sum(shapes[o][1] for o in order[: order.index(p)])
            else:
                lin = getattr(parent, f"{p}_proj")
            if not isinstance(lin, nn.Linear):
                raise ValueError(
                    f"--merge_lora needs float weights; {p}_proj of layer {i} is "
                    f"{type(lin).__name__} (leave out --merge_lora: the adapter runs on the fly)"
                )
            delta = scale * (b[row : row + width].float() @ a.float())
            with torch.no_grad():
                w = lin.weight[start : start + width]
                w.copy_((w.float() + delta.to(w.device)).to(w.dtype))
            row += width
