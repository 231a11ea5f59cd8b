"""A draft model as the engine's proposer: a smaller checkpoint with the target's tokenizer guesses
the next k tokens of every decoding sequence, and the target verifies them in the step it runs
anyway (engine.py: a draft is kept only where it is the token plain decoding would have produced,
so the output is exactly the target's, greedy or sampled).

    drafter = DraftModel(draft, target, k=4, num_blocks=512, block_size=16)  # the engine's pool
    engine = Engine.for_model(target, num_blocks=512, speculate=drafter)
    batch.py --speculate draft --draft_checkpoint small/ --speculate_k 4

The draft's paged KV pool (paged.PagedKVCache) uses the target's block ids: a sequence's draft K/V
sits in the blocks the target's scheduler gave it, so the draft has no allocator of its own, a
finished or preempted sequence frees both pools at once, and a prompt that hits the target's
prefix cache finds the draft's K/V for those blocks too. A full block's draft K/V is known by the
chain key of the tokens it was written for, so a block the target has since given to other tokens
is never trusted. Positions the target has no block for yet (the last token's, the guesses') go
to a few scratch blocks per row past the target's ids. Before each engine step, one flat forward
catches every drafting row up (the tokens it has not seen: the prompt at first, then the last
step's kept tokens) and gives each its first guess; k - 1 one-token steps of every row give the
rest. A greedy request's guesses are the draft's argmax; a sampled request's are drawn (with the
proposer's own generator) from the draft's distribution q at the request's temperature and
top-k/p, and q goes with them: the engine keeps a guess d with probability min(1, p(d)/q(d)) and
else draws from max(p - q, 0) (sampling.sample), so every token is distributed exactly as the
target's p. K/V written for a guess the target rejected is stale and is recomputed next time.

With more than `max_rows` decoding rows the step drafts nothing; a row whose last block is still
shared (the samples of one request just forked, before the target copies the block) waits a step.
A draft that raises mid-run turns speculation off with one warning; the requests go on without it.
"""

import warnings
from collections import Counter

import torch

from paged import PagedKVCache
from sampling import probabilities
from scheduler import blocks_for
from speedups.prompt_lookup import check_k


class DraftModel:
    def __init__(
        self,
        draft,
        target,
        k: int = 4,
        num_blocks: int = 512,
        block_size: int = 16,
        max_rows: int = 16,
        seed: int = 0,
    ):
        check_k(k)
        mine, theirs = draft.config.vocab_size, target.config.vocab_size
        if mine != theirs:
            raise ValueError(
                f"the draft model's vocabulary has {mine} tokens and the target's {theirs}: a "
                "draft model must share the target's tokenizer"
            )
        self.model, self.k, self.max_rows, self.failed = draft, k, max_rows, None
        self.catch_up = (
            512  # most tokens per row in one catch-up forward (as the engine chunks a prefill)
        )
        self.num_blocks, self.scratch = (
            num_blocks,
            (k - 1) // block_size + 2,
        )  # scratch: per row, positions len-1 .. len+k-2
        self.cache = PagedKVCache.for_model(draft, num_blocks + max_rows * self.scratch, block_size)
        # sequence -> (tokens whose draft K/V it holds, the guesses written after them, block ids
        # used)
        self.held = {}
        self.keys = {}  # sequence -> chain key of each of its full blocks (its tokens never change)
        self.filled = {}  # target block id -> the chain key of the tokens whose draft K/V fills it
        self.generator = torch.Generator(device=draft.norm.weight.device).manual_seed(
            seed
        )  # its own: never the target's

    def propose(self, seqs, max_model_len: int):
        """Set seq.draft for each of `seqs` (the scheduler's running sequences, with their target
        blocks)."""
        for s in seqs:
            s.draft, s.draft_probs = [], None
        running = set(seqs)
        for gone in [s for s in self.held if s not in running]:  # finished or preempted
            self._forget(gone)
        bs = self.cache.block_size
        rows = [s for s in seqs if len(s.tokens) - s.num_computed == 1 and not self.failed]
        last = Counter(
            s.blocks[-1] for s in rows if s.blocks and len(s.blocks) * bs >= len(s.tokens)
        )
        limit = min(max_model_len, self.model.config.max_position_embeddings)
        room = {
            s: min(
                self.k,
                s.request.params.max_new_tokens - len(s.output) - 1,
                limit - len(s.tokens) - 1,
            )
            for s in rows
        }
        rows = [
            s
            for s in rows
            if room[s] > 0 and 0 not in s.blocks and last[s.blocks[-1] if s.blocks else 0] < 2
        ]
        if not rows or len(rows) > self.max_rows:
            return
        try:
            with torch.no_grad():
                guesses, probs = self._guess(rows, limit)
        except Exception as e:  # noqa: BLE001
            # any fault of the draft ends speculation, never a request
            self.failed = f"{type(e).__name__}: {e}"
            warnings.warn(
                f"the draft model failed ({self.failed}); speculation is off from here on"
            )
            self.held, self.keys, self.filled = {}, {}, {}
            return
        for s, g, q in zip(rows, guesses, probs):
            s.draft, s.draft_probs = g[: room[s]], q if q is None else q[: room[s]]

    def _guess(self, rows, limit: int):
        """k guesses per row: a catch-up forward (each row its unseen tokens), then k - 1 one-token
        steps -> ([R, k] tokens, per row the [k, V] distributions they were drawn from, or None:
        argmax)."""
        ids = [self._ids(s, r) for r, s in enumerate(rows)]
        starts, width = [self._valid(s) for s in rows], max(len(b) for b in ids)
        for s, b, a in zip(rows, ids, starts):
            self._wrote(s, b, a)
        while any(
            len(s.tokens) - a > self.catch_up for s, a in zip(rows, starts)
        ):  # a long prompt in pieces
            part = [
                (b, s, a) for b, s, a in zip(ids, rows, starts) if len(s.tokens) - a > self.catch_up
            ]
            self._forward(
                [t for _, s, a in part for t in s.tokens[a : a + self.catch_up]],
                [p for _, _, a in part for p in range(a, a + self.catch_up)],
                [(1, self.catch_up, self._table([b], width)) for b, _, _ in part],
                torch.tensor([0]),
            )
            starts = [
                a + self.catch_up * (len(s.tokens) - a > self.catch_up)
                for s, a in zip(rows, starts)
            ]
        tokens = [t for s, a in zip(rows, starts) for t in s.tokens[a:]]
        pos = [p for s, a in zip(rows, starts) for p in range(a, len(s.tokens))]
        groups = [
            (1, len(s.tokens) - a, self._table([b], width)) for b, s, a in zip(ids, rows, starts)
        ]
        ends = torch.tensor([len(s.tokens) - a for s, a in zip(rows, starts)]).cumsum(0) - 1
        last, qs = self._draw(
            rows, self._forward(tokens, pos, groups, ends)
        )  # [R], R x ([V] or None)
        guesses, probs, table = [last], [qs], self._table(ids, width)
        for j in range(1, self.k):
            pos = [min(len(s.tokens) + j, limit) - 1 for s in rows]  # (past its room: never kept)
            last, qs = self._draw(
                rows,
                self._forward(last.tolist(), pos, [(len(rows), 1, table)], torch.arange(len(rows))),
            )
            guesses.append(last)
            probs.append(qs)
        guesses = torch.stack(guesses, 1).tolist()
        for s, b, g in zip(rows, ids, guesses):
            self.held[s] = (
                len(s.tokens),
                g[: self.k - 1],
                b,
            )  # K/V written for its tokens, then these guesses
        return guesses, [None if q[0] is None else torch.stack(q) for q in zip(*probs)]

    def _draw(self, rows, logits):
        """Each row's guess from its logits [R, V]: the argmax for a greedy request, else a draw
        from the draft's distribution at the request's temperature, top-k, top-p and min-p (kept,
        for the rule)."""
        tokens, qs = logits.argmax(-1), []
        for i, s in enumerate(rows):
            t = s.request.sampling
            q = (
                None
                if t.temperature == 0
                else probabilities(logits[i], t.temperature, t.top_k, t.top_p, t.min_p)
            )
            if q is not None:
                tokens[i] = torch.multinomial(q, 1, generator=self.generator)[0]
            qs.append(q)
        return tokens, qs

    def _forward(self, tokens, pos, groups, keep):
        device = self.cache.slots.device
        with self.cache.step_groups(groups):
            return self.model(
                torch.tensor([tokens], device=device),
                torch.tensor([pos], device=device),
                self.cache,
                keep=keep.to(device),
            )[0]

    def _ids(self, s, row: int) -> list:
        """Row `row`'s draft block ids: s's target blocks, then scratch up to position len + k -
        2."""
        if any(b >= self.num_blocks for b in s.blocks):
            raise ValueError(
                f"block id {max(s.blocks)} is past the draft's pool of {self.num_blocks} blocks: "
                "give the draft model the engine's num_blocks"
            )
        more = blocks_for(len(s.tokens) + self.k - 1, self.cache.block_size) - len(s.blocks)
        return s.blocks + [self.num_blocks + row * self.scratch + j for j in range(more)]

    def _valid(self, s) -> int:
        """How many of s's tokens the draft's K/V holds in its current blocks (at most all but the
        last, which it feeds): those it wrote (its guesses since kept), while the block ids are the
        same, or else the full blocks whose tokens' chain key is the one the draft filled them
        for."""
        bs, (n, guesses, ids) = self.cache.block_size, self.held.get(s, (0, [], []))
        kept = next(
            (i for i, (g, t) in enumerate(zip(guesses, s.tokens[n:])) if g != t),
            min(len(guesses), len(s.tokens) - n),
        )
        same = next(
            (i for i, (a, b) in enumerate(zip(ids, s.blocks)) if a != b),
            min(len(ids), len(s.blocks)),
        )
        held, keys = min(n + kept, same * bs), self._keys(s)
        full = (
            held // bs
        )  # whole blocks it holds; then those filled for the same tokens (a prefix hit)
        while full < len(keys) and self.filled.get(s.blocks[full]) == keys[full]:
            full += 1
        return min(max(held, full * bs), len(s.tokens) - 1)

    def _keys(self, s) -> list:
        """The chain key of each of s's full blocks: a key names every token up to the block's
        end."""
        bs, keys = self.cache.block_size, self.keys.setdefault(s, [])
        for i in range(len(keys), len(s.tokens) // bs):
            keys.append(hash((keys[-1] if keys else None, tuple(s.tokens[i * bs : (i + 1) * bs]))))
        return keys

    def _wrote(self, s, ids, start: int):
        """Record the draft K/V this step writes for s from position `start` on in its target blocks
        (and the guesses it kept since): a block then full of its tokens gets their key; one holding
        guesses, none."""
        bs, keys = self.cache.block_size, self._keys(s)
        for i in range(
            max(0, start - self.k) // bs, min(len(ids), len(s.blocks))
        ):  # (and those kept guesses filled)
            if i < len(keys):
                self.filled[ids[i]] = keys[i]
            else:
                self.filled.pop(ids[i], None)

    def _table(self, ids, width: int):
        return torch.tensor(
            [b + [0] * (width - len(b)) for b in ids], device=self.cache.slots.device
        )

    def _forget(self, s):
        self.held.pop(s, None)
        self.keys.pop(s, None)
