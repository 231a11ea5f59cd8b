"""A draft model as the engine's proposer: a smaller checkpoint with the target's tokenizer guesses
the next k tokens of every decoding sequence, and the target verifies them in the step it runs
anyway (engine.py: a draft is kept only where it is the token plain decoding would have produced,
so the output is exactly the target's, greedy or sampled).

    drafter = DraftModel(draft, target, k=4, num_blocks=512, block_size=16)
    engine = Engine.for_model(target, num_blocks=512, speculate=drafter)
    batch.py --speculate draft --draft_checkpoint small/ --speculate_k 4

The draft keeps its own paged KV pool (paged.PagedKVCache, its own block ids and BlockAllocator, no
prefix cache), a block table per sequence and the tokens whose K/V it holds. Before each engine
step, one flat forward catches every drafting row up (the tokens it has not seen: the prompt at
first, then the last step's kept tokens) and gives each its first guess; k - 1 one-token steps of
every row give the rest. A greedy request's guesses are the draft's argmax; a sampled request's are
drawn (with the proposer's own generator) from the draft's distribution q at the request's
temperature and top-k/p, and q goes with them: the engine keeps a guess d with probability
min(1, p(d)/q(d)) and else draws from max(p - q, 0) (sampling.sample), so every token is
distributed exactly as the target's p. K/V written for a guess the target rejected is stale and
is recomputed next time (the tokens held are compared).

A sequence that leaves the running set frees its draft blocks. With more than `max_rows`
decoding rows, or no free draft blocks for a row, that row (or step) drafts nothing. A draft that
raises mid-run turns speculation off with one warning; the requests go on without it.
"""
import warnings

import torch

from paged import BlockAllocator, PagedKVCache
from prompt_lookup import check_k
from sampling import probabilities
from scheduler import blocks_for


class DraftModel:
    def __init__(self, draft, target, k: int = 4, num_blocks: int = 512, block_size: int = 16, max_rows: int = 16,
                 seed: int = 0):
        check_k(k)
        mine, theirs = draft.config.vocab_size, target.config.vocab_size
        if mine != theirs:
            raise ValueError(f"the draft model's vocabulary has {mine} tokens and the target's {theirs}: a draft "
                             f"model must share the target's tokenizer")
        self.model, self.k, self.max_rows, self.failed = draft, k, max_rows, None
        self.catch_up = 512  # most tokens per row in one catch-up forward (as the engine chunks a prefill)
        self.cache = PagedKVCache.for_model(draft, num_blocks, block_size)
        self.allocator = BlockAllocator(num_blocks, block_size, prefix_caching=False)
        self.blocks, self.held = {}, {}  # sequence -> its draft block ids; the tokens whose K/V they hold
        self.generator = torch.Generator(device=draft.norm.weight.device).manual_seed(seed)  # its own: never the target's

    def propose(self, seqs, max_model_len: int):
        """Set seq.draft for each of `seqs` (the scheduler's running sequences)."""
        for s in seqs:
            s.draft, s.draft_probs = [], None
        running = set(seqs)
        for gone in [s for s in self.blocks if s not in running]:  # finished or preempted
            self._forget(gone)
        rows = [s for s in seqs if len(s.tokens) - s.num_computed == 1 and not self.failed]
        limit = min(max_model_len, self.model.config.max_position_embeddings)
        room = {s: min(self.k, s.request.params.max_new_tokens - len(s.output) - 1, limit - len(s.tokens) - 1) for s in rows}
        rows = [s for s in rows if room[s] > 0 and self._ensure(s, len(s.tokens) + self.k - 1)]
        if not rows or len(rows) > self.max_rows:
            return
        try:
            with torch.no_grad():
                guesses, probs = self._guess(rows, limit)
        except Exception as e:  # noqa: BLE001 (any fault of the draft ends speculation, never a request)
            self.failed = f"{type(e).__name__}: {e}"
            warnings.warn(f"the draft model failed ({self.failed}); speculation is off from here on")
            for s in list(self.blocks):
                self._forget(s)
            return
        for s, g, q in zip(rows, guesses, probs):
            s.draft, s.draft_probs = g[:room[s]], q if q is None else q[:room[s]]
            self.held[s] = (len(s.tokens), g[:min(self.k - 1, room[s])])  # K/V written for its tokens, then these

    def _guess(self, rows, limit: int):
        """k guesses per row: a catch-up forward (each row its unseen tokens), then k - 1 one-token
        steps -> ([R, k] tokens, per row the [k, V] distributions they were drawn from, or None: argmax)."""
        starts, width = [self._valid(s) for s in rows], max(len(self.blocks[s]) for s in rows)
        while any(len(s.tokens) - a > self.catch_up for s, a in zip(rows, starts)):  # a long prompt in pieces
            part = [(s, a) for s, a in zip(rows, starts) if len(s.tokens) - a > self.catch_up]
            self._forward([t for s, a in part for t in s.tokens[a:a + self.catch_up]],
                          [p for _, a in part for p in range(a, a + self.catch_up)],
                          [(1, self.catch_up, self._table([s], width)) for s, _ in part], torch.tensor([0]))
            starts = [a + self.catch_up * (len(s.tokens) - a > self.catch_up) for s, a in zip(rows, starts)]
        tokens = [t for s, a in zip(rows, starts) for t in s.tokens[a:]]
        pos = [p for s, a in zip(rows, starts) for p in range(a, len(s.tokens))]
        groups = [(1, len(s.tokens) - a, self._table([s], width)) for s, a in zip(rows, starts)]
        ends = torch.tensor([len(s.tokens) - a for s, a in zip(rows, starts)]).cumsum(0) - 1
        last, qs = self._draw(rows, self._forward(tokens, pos, groups, ends))  # [R], R x ([V] or None)
        guesses, probs, table = [last], [qs], self._table(rows, width)
        for j in range(1, self.k):
            pos = [min(len(s.tokens) + j, limit) - 1 for s in rows]  # (past its room: never kept)
            last, qs = self._draw(rows, self._forward(last.tolist(), pos, [(len(rows), 1, table)], torch.arange(len(rows))))
            guesses.append(last)
            probs.append(qs)
        probs = [None if q[0] is None else torch.stack(q) for q in zip(*probs)]
        return torch.stack(guesses, 1).tolist(), probs

    def _draw(self, rows, logits):
        """Each row's guess from its logits [R, V]: the argmax for a greedy request, else a draw from
        the draft's distribution at the request's temperature, top-k, top-p and min-p (kept, for the rule)."""
        tokens, qs = logits.argmax(-1), []
        for i, s in enumerate(rows):
            t = s.request.sampling
            q = None if t.temperature == 0 else probabilities(logits[i], t.temperature, t.top_k, t.top_p, t.min_p)
            if q is not None:
                tokens[i] = torch.multinomial(q, 1, generator=self.generator)[0]
            qs.append(q)
        return tokens, qs

    def _forward(self, tokens, pos, groups, keep):
        device = self.cache.slots.device
        with self.cache.step_groups(groups):
            return self.model(torch.tensor([tokens], device=device), torch.tensor([pos], device=device), self.cache,
                              keep=keep.to(device))[0]

    def _valid(self, s) -> int:
        """How many of s's tokens the draft's K/V still holds (at most all but the last, which it
        feeds): those it had, and its guesses since kept (a sequence's tokens never change)."""
        n, guesses = self.held.get(s, (0, []))
        kept = next((i for i, (g, t) in enumerate(zip(guesses, s.tokens[n:])) if g != t), min(len(guesses), len(s.tokens) - n))
        return min(n + kept, len(s.tokens) - 1)

    def _ensure(self, s, length: int) -> bool:
        """Draft blocks for s's positions below `length`; False (none taken) when the pool is short."""
        have = self.blocks.setdefault(s, [])
        more = self.allocator.allocate_many(max(0, blocks_for(length, self.cache.block_size) - len(have)))
        if more is None:
            return False
        have += more
        return True

    def _table(self, seqs, width: int):
        return torch.tensor([self.blocks[s] + [0] * (width - len(self.blocks[s])) for s in seqs],
                            device=self.cache.slots.device)

    def _forget(self, s):
        for b in self.blocks.pop(s, []):
            self.allocator.release(b)
        self.held.pop(s, None)
