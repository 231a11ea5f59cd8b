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
    with adapters.rows([slot, -1, slot]):                 # per flat token; -1: the base
        logits = model(tokens, input_pos, cache)
    adapters.use(slot)                                     # generate.py: every row, any shape

Run `python -m pytest tests/test_lora.py` to see it checked against the `peft` package.
"""

import contextlib
import time

import torch
import torch.nn.functional as F
from torch import nn

from formats.lora_files import TARGETS, Adapter, projection_shapes, target_shape  # noqa: F401
from model import MLP


class UnknownAdapter(ValueError):
    """A request names an adapter that is not loaded (a server's 404)."""


class SlotsBusy(ValueError):
    """Every slot has requests running: an adapter cannot be placed now (a server's 503)."""


class LoraLinear(nn.Module):
    """A projection (any weight format: float, int8, int4, GGUF groups) plus the resident
    adapters' deltas. parts: the projections its outputs stack, [(name, width)]."""

    # compiling.autotune: no max-autotune search with adapters (their thin GEMMs multiply its
    # compile time: benchmarks/RESULTS.md, "LoRA adapters")
    compile_autotune = False

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
    """The adapters of one model: every loaded one kept on the host, at most max_loras of them
    (rank <= max_rank) resident in the slots every projection shares. A request for one not
    resident takes a free slot, or the least recently used one no request runs on (SlotsBusy when
    every slot is busy); unloading one in use lets its requests finish first (no new ones)."""

    def __init__(self, model, max_loras: int = 4, max_rank: int = 16):
        if max_loras < 1 or max_rank < 1:
            raise ValueError(f"max_loras and max_rank must be >= 1, got {max_loras}, {max_rank}")
        if any(isinstance(m, LoraLinear) for m in model.modules()):
            raise ValueError("this model already carries adapter slots (one Adapters per model)")
        if model.config.mla:
            raise ValueError("LoRA adapters on DeepSeek's latent attention are not served yet")
        self.max_loras, self.max_rank, self.config = max_loras, max_rank, model.config
        self.names = [None] * max_loras  # each slot's adapter name
        self.host, self.last_used, self.draining = {}, {}, set()  # host: name -> Adapter
        self.onehot, self._masks = None, {}
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
        self.modules = list({id(m): m for m in self.where.values()}.values())

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
        return sum(m.lora_A.nbytes + m.lora_B.nbytes for m in self.modules)

    # -- which rows use which slot -------------------------------------------------------------
    @contextlib.contextmanager
    def rows(self, slots):
        """A forward whose flat tokens use these slots (-1: the base model's own output); after
        it, no row uses any (another forward of the model is the base's)."""
        onehot = None
        if any(s >= 0 for s in slots):
            ids = torch.tensor(slots, device=self.modules[0].lora_A.device)
            onehot = ids[:, None] == torch.arange(self.max_loras, device=ids.device)  # [N, S]
        self._set(onehot)
        try:
            yield
        finally:
            self._set(None)

    def use(self, slot):
        """Every row, whatever its shape, through `slot` from now on (None: the base)."""
        device = self.modules[0].lora_A.device
        self._set(None if slot is None else torch.arange(self.max_loras, device=device) == slot)

    def _set(self, onehot):
        """The masks each layer's k parts keep, [N, k*S*R] (or [k*S*R]), built before the forward
        (a compiled step reads them as inputs)."""
        self.onehot, self._masks = onehot, {}
        if onehot is not None:
            cols = onehot.to(self.modules[0].lora_A.dtype).repeat_interleave(self.max_rank, -1)
            for k in {m.k for m in self.modules}:  # part-major, as lora_A's rows
                self._masks[k] = cols.repeat(*[1] * (cols.dim() - 1), k)

    def mask(self, k: int):
        """The columns a layer of k parts keeps this forward, or None (no row on an adapter)."""
        return self._masks.get(k)

    # -- loading and unloading -----------------------------------------------------------------
    def served(self) -> list:
        """The adapters taking requests, in the order they were loaded."""
        return [n for n in self.host if n not in self.draining]

    def slot_of(self, name: str, requests=()) -> int:
        """The slot of adapter `name` for a new request, placing it if it is not resident;
        requests: the unfinished ones (their adapters are never evicted). UnknownAdapter naming
        those served; SlotsBusy if every slot has requests running."""
        if name not in self.host or name in self.draining:
            known = ", ".join(sorted(self.served()))
            raise UnknownAdapter(f"no adapter {name!r} is loaded (loaded: {known or 'none'})")
        self.last_used[name] = time.monotonic()
        if name in self.names:
            return self.names.index(name)
        return self._place(name, {r.params.adapter for r in requests})

    def load(self, adapter: Adapter, requests=(), replace: bool = False) -> int:
        """Keep `adapter` (checked) and place it in a slot if one is free or idle -> its slot, or
        -1 (placed when a request asks for it). replace: a loaded one of that name gives way,
        unless requests still run on it (SlotsBusy). ValueError if the name is taken."""
        self.check(adapter)
        in_use = {r.params.adapter for r in requests}
        if adapter.name in self.host:
            if not replace or adapter.name in self.draining:
                raise ValueError(f"an adapter named {adapter.name!r} is already loaded")
            if adapter.name in in_use:
                raise SlotsBusy(f"adapter {adapter.name!r} has requests running; retry later")
            self._drop(adapter.name)
        self.host[adapter.name] = adapter
        self.last_used[adapter.name] = time.monotonic()
        try:
            return self._place(adapter.name, in_use)
        except SlotsBusy:
            return -1

    def unload(self, name: str, requests=()):
        """Take no new requests for `name`; it goes once none of `requests` runs on it."""
        self.slot_of(name)  # (UnknownAdapter)
        self.draining.add(name)
        self._sweep({r.params.adapter for r in requests})

    def _sweep(self, in_use: set):
        for name in [n for n in self.draining if n not in in_use]:  # unloaded, requests over
            self._drop(name)

    def _place(self, name: str, in_use: set) -> int:
        """Write `name` into a free slot, or the least recently used idle one's -> the slot."""
        self._sweep(in_use)
        if None not in self.names:
            idle = [n for n in self.names if n not in in_use]
            if not idle:
                raise SlotsBusy(
                    f"all {self.max_loras} adapter slots have requests running "
                    f"({', '.join(self.names)}); retry later, or raise --max_loras"
                )
            self._clear(self.names.index(min(idle, key=lambda n: self.last_used[n])))
        slot = self.names.index(None)
        try:
            for (layer, target), (a, b) in self.host[name].weights.items():
                row = 0
                for p in TARGETS[target]:  # a fused target's B split over its projections
                    m = self.where[layer, p]
                    m.write(slot, p, a, b[row : row + m.offsets[p][2]])
                    row += m.offsets[p][2]
        except BaseException:  # nothing half written stays
            self._clear(slot)
            raise
        self.names[slot] = name
        return slot

    def _clear(self, slot: int):
        for m in self.modules:
            m.clear(slot)
        self.names[slot] = None

    def _drop(self, name: str):
        if name in self.names:
            self._clear(self.names.index(name))
        self.host.pop(name, None)
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


def _weight_rows(model, i: int, p: str):
    """(the float layer holding projection p of layer i, p's first row in it); ValueError if the
    layer is quantized."""
    shapes, layer = projection_shapes(model.config), model.layers[i]
    parent = layer.self_attn if p in ("q", "k", "v", "o") else layer.mlp
    qkv = p in ("q", "k", "v")
    fused, order = ("qkv_proj", ("q", "k", "v")) if qkv else ("gate_up_proj", ("gate", "up"))
    lin, start = getattr(parent, fused, None) if p in order else None, 0
    if lin is not None:  # a fused layer: p's rows after the parts before it
        start = sum(shapes[o][1] for o in order[: order.index(p)])
    else:
        lin = getattr(parent, f"{p}_proj")
    if not isinstance(lin, nn.Linear):
        raise ValueError(
            f"--merge_lora needs float weights; {p}_proj of layer {i} is {type(lin).__name__} "
            "(leave out --merge_lora: the adapter runs on the fly)"
        )
    return lin, start


def merge_into(model, adapter: Adapter, scale: float = 1.0):
    """W += scale * B A in place, for float weights only (generate.py --merge_lora): the merged
    model runs at the base's speed and equals the adapter applied on the fly. Every layer is
    checked before any changes."""
    shapes = projection_shapes(model.config)
    places = {(i, p): _weight_rows(model, i, p) for i, t in adapter.weights for p in TARGETS[t]}
    for (i, target), (a, b) in adapter.weights.items():
        row = 0
        for p in TARGETS[target]:
            (lin, start), width = places[i, p], shapes[p][1]
            delta = scale * (b[row : row + width].float() @ a.float())
            with torch.no_grad():
                w = lin.weight[start : start + width]
                w.copy_((w.float() + delta.to(w.device)).to(w.dtype))
            row += width


def apply(model, path, scale: float = 1.0, merge: bool = False) -> str:
    """generate.py --lora: the adapter in `path`, times `scale`, merged into the float weights
    (merge_into) or applied on the fly to every row (one slot of Adapters) -> a line to log."""
    from formats.lora_files import read_adapter

    adapter = read_adapter(path, model.config)
    if merge:
        merge_into(model, adapter, scale)
        return f"LoRA adapter {path} (rank {adapter.rank}) merged into the weights, scale {scale}"
    adapter.weights = {k: (a, b * scale) for k, (a, b) in adapter.weights.items()}
    adapters = Adapters(model, 1, adapter.rank)
    adapters.use(adapters.load(adapter))
    return f"LoRA adapter {path} (rank {adapter.rank}) applied on the fly, scale {scale}"
