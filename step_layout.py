"""A step's plan laid out as the engine's one flat forward: the scheduler says which sequences
run and how many tokens each (scheduler.Plan); this file decides where each token sits in the
flat [1, N] batch and which block table each group of rows reads (paged.py's `step_groups`).

    layout = Layout(block_size=16, n_pools=1, model=model)
    order, tokens, pos, groups, ends, slots = layout(plan, compiled=False)
    # order: the sequences, in the order their rows were laid out
    # tokens, pos: N token ids and positions; ends: each sequence's last flat index
    # slots: N LoRA adapter slots (speedups/lora.py; -1: the base)
    # groups: [(rows R, tokens per row T, block table [R, W] or a hybrid's [2, R, W])]

Rows that decode one token (and drafted rows, 1 + k tokens each) come first, grouped: one group
when the step is compiled (a bucket of rows, so few graphs), else rows of similar context length
together, so each group gathers about its own length of K/V. Then the prefill chunks, those of
one length and width bucket as one group of rows (many short prompts: one gather and one SDPA
call, not one each), then (eager steps) padding rows, so every layer's GEMMs see few row counts
(cpu_kernels.gemm_padding). Under batch_invariant (batch_invariant.py) a row attends over the
blocks its own position needs, and a chunk is cut where its queries' width changes, so a row's
arithmetic never depends on its neighbours.
"""

import itertools
from dataclasses import dataclass, field

import torch

from cpu_kernels import gemm_padding
from kv_cache import bucket


@dataclass
class Flat:
    """A step's rows as they are laid out: token ids, positions, groups for paged.py (rows, tokens
    per row, block table), each sequence's last flat index, each token's adapter slot."""

    tokens: list = field(default_factory=list)
    pos: list = field(default_factory=list)
    groups: list = field(default_factory=list)
    ends: list = field(default_factory=list)
    slots: list = field(default_factory=list)

    def pad_slots(self):
        """Rows laid out without a sequence (padding) use no adapter."""
        self.slots += [-1] * (len(self.tokens) - len(self.slots))


class Layout:
    """block_size: the paged cache's; n_pools: 2 for a hybrid cache (a windowed layers' pool),
    else 1; pieces: batch_invariant.pieces when that mode is on, else None. The model's dtype and
    device are read once: a layout serves one engine's model and cache."""

    def __init__(self, block_size: int, n_pools: int, model, pieces=None):
        self.block_size, self.n_pools, self.pieces = block_size, n_pools, pieces
        self.dtype, self.device = model.norm.weight.dtype, model.norm.weight.device
        self.batch_invariant = pieces is not None

    def __call__(self, plan, compiled: bool, k: int = 0):
        """The plan's tokens flattened: (order, tokens, positions, groups for paged.py, ends: flat
        index of each sequence's last token, slots: each token's adapter). Decodes (and 1-token
        tails), drafted rows, then prefill chunks, then padding rows. k: tokens drafted per row
        (the proposer's), if any."""
        rects = self._decode_groups(plan, compiled, k)
        chunks = [
            s
            for s, n in plan.runs.items()
            if n > 1 and (self.batch_invariant or s not in plan.drafts)
        ]
        flat = Flat()
        for group, n in rects:
            self._lay_decode_group(flat, plan, group, n, compiled)
        if self.batch_invariant:
            for s in chunks:
                self._lay_prefill_chunk(flat, plan, s)
        else:  # chunks of one length and width as one group: one gather and SDPA call for all
            shape = lambda s: (plan.runs[s], bucket(len(s.blocks)))  # noqa: E731
            chunks.sort(key=shape)
            for _, group in itertools.groupby(chunks, key=shape):
                self._lay_prefill_rows(flat, plan, list(group))
        if not compiled:  # compiled steps were padded to a bucket by their decode group
            self._pad_for_gemm(flat)
        order = [s for group, _ in rects for s in group] + chunks
        flat.pad_slots()
        return order, flat.tokens, flat.pos, flat.groups, flat.ends, flat.slots

    def _blocks_needed(self, s) -> int:
        """The blocks a row attends: its sequence's, or (batch_invariant) those its own position
        needs."""
        if self.batch_invariant:
            return s.num_computed // self.block_size + 1
        return len(s.blocks)

    def _decode_groups(self, plan, compiled: bool, k: int) -> list:
        """[(sequences, tokens per row)]: one-token rows and drafted rows, grouped. Compiled: one
        group (few graphs). Eager: rows of similar context together, so each group's gather is
        close to its own length; drafted rows by their length."""
        ones = [s for s, n in plan.runs.items() if n == 1]
        drafted = [] if self.batch_invariant else sorted(plan.drafts, key=lambda s: plan.runs[s])
        if compiled:
            return [(ones + drafted, 1 + k if drafted else 1)]
        ones.sort(key=lambda s: -self._blocks_needed(s))
        by_width = itertools.groupby(ones, key=lambda s: bucket(self._blocks_needed(s)))
        by_length = itertools.groupby(drafted, key=lambda s: plan.runs[s])
        return [(list(g), 1) for _, g in by_width] + [(list(g), n) for n, g in by_length]

    def _lay_decode_group(self, flat, plan, group, n: int, compiled: bool):
        """Each row: [its next token, its drafts, padding whose K/V no query sees yet]; compiled,
        the group padded to a bucket of rows (the null block's first slots)."""
        bs = self.block_size
        need = (max(self._blocks_needed(s), (s.num_computed + n - 1) // bs + 1) for s in group)
        width = bucket(max(need))
        pad = bucket(len(group)) - len(group) if compiled else 0
        for s in group:
            d = plan.drafts.get(s, [])
            flat.slots += [s.request.lora_slot] * n
            flat.tokens += [s.tokens[s.num_computed]] + d + [0] * (n - 1 - len(d))
            flat.pos += range(s.num_computed, s.num_computed + n)
            flat.ends.append(len(flat.tokens) - n + len(d))
        flat.tokens += [0] * pad * n
        flat.pos += [*range(n)] * pad
        flat.pad_slots()
        flat.groups.append((len(group) + pad, n, self._table(group, width, pad)))

    def _lay_prefill_chunk(self, flat, plan, s):
        """Under batch_invariant: a group of its own, cut where its queries' width changes."""
        n, start = plan.runs[s], s.num_computed
        for m, width in self.pieces(start, n, self.block_size):
            flat.groups.append((1, m, self._table([s], width)))
        flat.slots += [s.request.lora_slot] * n
        flat.tokens += (s.tokens[start:] + plan.drafts.get(s, []))[:n]
        flat.pos += range(start, start + n)
        flat.ends.append(len(flat.tokens) - 1)

    def _lay_prefill_rows(self, flat, plan, group):
        """Prefill chunks of one length n and width bucket: a group of len(group) rows of n
        tokens, each row at its own positions (paged.py masks by position)."""
        n = plan.runs[group[0]]
        for s in group:
            start = s.num_computed
            flat.slots += [s.request.lora_slot] * n
            flat.tokens += s.tokens[start : start + n]
            flat.pos += range(start, start + n)
            flat.ends.append(len(flat.tokens) - 1)
        width = bucket(max(len(s.blocks) for s in group))
        flat.groups.append((len(group), n, self._table(group, width)))

    def _pad_for_gemm(self, flat):
        """An eager step's token count padded as every layer's GEMMs want it
        (cpu_kernels.gemm_padding: few shapes, few cached oneDNN kernels): one-token rows at
        position 0 of the null block, never sampled."""
        pad = gemm_padding(len(flat.tokens), self.dtype, self.device)
        if pad:
            zeros = torch.zeros(pad, 1, dtype=torch.long, device=self.device)
            flat.groups.append((pad, 1, zeros))
            flat.tokens += [0] * pad
            flat.pos += [0] * pad

    def _table(self, seqs, width: int, pad: int = 0):
        """seqs' block table [R, width] (and pad rows of the null block), or a hybrid's two: [2, R,
        width]."""
        per_pool = ([s.blocks for s in seqs], [s.window_blocks for s in seqs])[: self.n_pools]
        tables = [
            [t[:width] + [0] * (width - len(t)) for t in ts] + [[0] * width] * pad
            for ts in per_pool
        ]
        return torch.tensor(tables if len(tables) == 2 else tables[0], device=self.device)


def pooled_rows(plan, order, ends):
    """The embeddings' rows of a laid-out step: (flat indices whose final states they need,
    [(sequence, first, count)] of each among them): every row of a "mean", the prompt's first of
    a "cls", its last of a "last"."""
    rows, spans = [], []
    for s, end in zip(order, ends):
        n, kind = plan.runs[s], s.request.params.pooling
        if kind is None:
            continue
        first = end - n + 1  # a chunk's rows are consecutive, its last at `end`
        if kind == "mean":
            take = range(first, end + 1)
        elif kind == "cls":
            take = [first] if s.num_computed == 0 else []
        else:
            take = [end] if s.num_computed + n == len(s.tokens) else []
        spans.append((s, len(rows), len(take)))
        rows += take
    return rows, spans
