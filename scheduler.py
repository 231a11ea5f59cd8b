"""Who runs next: continuous batching's queues and KV-block bookkeeping, host-side only (no torch,
no model; engine.py runs the plans). Requests join and leave the running batch at every step,
long prompts prefill in chunks, and when KV blocks run out the newest sequence is preempted and
recomputed later (vLLM's scheduler; SGLang's longest-prefix-match policy).

Static batching runs a batch until its longest request finishes: the others idle, and waiting
requests wait. Here every `schedule()` returns a Plan for one step:

  1. each running sequence gets its next tokens: decodes 1 token each (first, so they never
     stall), then unfinished prefills a chunk, all within `max_num_batched_tokens`; while other
     requests have prompt tokens to compute, a request's prefills get at most an equal share of
     the budget (the rest after admission), so one huge prompt, or many, cannot hold it;
  2. waiting sequences are admitted (in `fcfs`, `lpm` or `priority` order) while blocks,
     `max_num_seqs` and the token budget allow, reusing the KV blocks of their longest cached
     prefix (paged.py); when every slot is taken, a request with nothing running takes slots
     from one holding more than its fair share (max_num_seqs / requests present), so a large n
     does not starve the others; under `priority`, a request takes the slot or blocks it lacks
     from running ones of a lower priority;
  3. a sequence about to write into a block it shares (a forked sample, a prefix hit's last
     block) gets a private copy: the plan lists (source, destination, pool) blocks to copy first.
If a running sequence needs a block and none is free, the sequence whose request arrived last is
preempted: its blocks are released (full ones stay in the prefix cache) and it waits, in arrival
order, to be recomputed, prompt and generated tokens together. So the queue stays in arrival
order, and a request is admitted before any that came after it (under `fcfs`, a request with
samples running yields to one with none, step 2).

After the forward, `update(plan, results)` appends each sampled token, names the blocks that
filled up in the prefix cache, and frees the blocks of the sequences that finished, and in a pool
of windowed layers (an allocator with a `window`) each block no later query sees (positions below
num_computed - window + 1; its entry becomes the null block 0), so that a sequence holds at most
window / block_size + 2 of them. A hybrid model (Gemma 2/3) has a pool per layer kind: `allocator`
(seq.blocks) for the full layers, `window_allocator` (seq.window_blocks) for the windowed ones.

    scheduler = Scheduler(paged.BlockAllocator(num_blocks=64, block_size=16), max_num_seqs=8)
    scheduler.add(seq)                       # a sequence.Sequence (or anything with its fields)
    plan = scheduler.schedule()              # plan.runs: {seq: tokens to compute}, plan.copies
    scheduler.update(plan, [(seq, token, finish_reason or None), ...])
"""

from collections import Counter, deque
from dataclasses import dataclass, field


def blocks_for(n_tokens: int, block_size: int) -> int:
    return -(-n_tokens // block_size)


@dataclass
class Plan:
    # sequence -> tokens to compute this step (decodes first)
    runs: dict = field(default_factory=dict)
    # (source block, destination block, pool): copy before the forward
    copies: list = field(default_factory=list)
    # sequences finished at "length": alone, they still do not fit
    ended: list = field(default_factory=list)
    # (sequence, its new twins): the engine forks n samples here
    forks: list = field(default_factory=list)
    # decoding sequence -> its draft tokens computed after its last one
    drafts: dict = field(default_factory=dict)
    # a second tier (speedups/kv_tier.py): blocks evicted this step, (hash, parent hash, tokens,
    # block, pool), to copy out before anything writes; (block, (k, v), pool) to load in, each
    # held by the plan until loaded
    saves: list = field(default_factory=list)
    loads: list = field(default_factory=list)


class Scheduler:
    """The waiting and running queues over its BlockAllocators (see the module docstring).

    policy: "fcfs", "lpm" or "priority" (each request's params.priority, lower first, then
    arrival; vLLM's); reserve_tokens: every sequence reserves this many tokens at admission,
    as a static cache would (benchmarks); scores: None, or prompt scoring's hooks (scoring.py):
    `reusable_tokens(request, hashes)` and `must_wait(request, running)`; window_allocator: the
    windowed layers' pool of a hybrid model, or None."""

    def __init__(
        self,
        allocator,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 512,
        policy: str = "fcfs",
        reserve_tokens: int = None,
        scores=None,
        window_allocator=None,
        tier=None,
    ):
        if policy not in ("fcfs", "lpm", "priority"):
            raise ValueError(f"schedule policy must be fcfs, lpm or priority, got {policy!r}")
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= max_num_seqs "
                f"({max_num_seqs}): every running sequence needs a token per step"
            )
        self.allocator, self.block_size, self.policy = allocator, allocator.block_size, policy
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.reserve_tokens, self.scores, self.window_allocator = (
            reserve_tokens,
            scores,
            window_allocator,
        )
        self.pools = [allocator] + (
            [window_allocator] if window_allocator else []
        )  # pool k: table k of a sequence
        self.waiting, self.running = deque(), []
        self.stats = dict(
            steps=0,
            preemptions=0,
            peak_blocks=0,
            prompt_tokens=0,
            prompt_tokens_hit=0,
            peak_running=0,
            tier_tokens_hit=0,
        )
        self.tier = tier  # a second tier for evicted prefix blocks (speedups/kv_tier.py)
        for a in self.pools if tier is not None else ():
            a.evicted = []

    def add(self, seq):
        if self.policy == "priority":  # before every waiting request of a later rank
            self._enqueue(seq)
        else:
            self.waiting.append(seq)

    def _rank(self, seq) -> tuple:
        """Who goes first: the lower priority value (the priority policy only), then the earlier
        arrival, then the lower sample index."""
        priority = seq.request.params.priority if self.policy == "priority" else 0
        return priority, seq.request.arrival, seq.index

    def _enqueue(self, seq):
        """Into the waiting queue at its rank's place."""
        key = self._rank(seq)
        at = next((i for i, w in enumerate(self.waiting) if self._rank(w) > key), None)
        self.waiting.insert(len(self.waiting) if at is None else at, seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Plan:
        """This step's plan, in three phases that share one budget of max_num_batched_tokens:
        1. the running sequences: decodes first, then prompts still prefilling, each within its
           request's share of prompt tokens (preempting the newest when blocks run out);
        2. admission: waiting requests join while blocks, sequence slots and the budget allow;
        3. top-up: what the shares left unused goes to the prefills that want more."""
        plan = Plan()
        quota = self._prompt_quota()
        budget = self._schedule_running(plan, quota)  # phase 1
        budget = self._admit(plan, budget)  # phase 2
        self._top_up(plan, budget)  # phase 3
        plan.drafts = {s: d for s, d in plan.drafts.items() if s in plan.runs}  # not the preempted
        if self.tier is not None:  # what eviction took, to copy out before the step writes
            plan.saves = [(*e, p) for p, a in enumerate(self.pools) for e in a.evicted]
            for a in self.pools:
                a.evicted = []
        if plan.runs:
            self._count_step()
        return plan

    def _prompt_quota(self) -> Counter:
        """Prompt tokens each prefilling request may take before any waiting one is admitted: an
        equal share of the budget among them and the waiting (fair prefill)."""
        prefilling = {s.request for s in self.running if len(s.tokens) - s.num_computed > 1}
        asking = len(prefilling | {s.request for s in self.waiting})
        share = max(1, self.max_num_batched_tokens // max(1, asking))
        return Counter(dict.fromkeys(prefilling, share))

    def _count_step(self):
        stats = self.stats
        stats["steps"] += 1
        stats["peak_blocks"] = max(stats["peak_blocks"], self.blocks_used())
        stats["peak_running"] = max(stats["peak_running"], len(self.running))

    def draft_budget(self) -> int:
        """Drafts take only what decodes and prompts (running or waiting) leave."""
        return (
            self.max_num_batched_tokens
            - sum(len(s.tokens) - s.num_computed for s in self.running)
            - sum(len(s.tokens) for s in self.waiting)
        )

    def _schedule_running(self, plan, quota) -> int:
        """Tokens for the running sequences, decodes first (oldest first), a prefill within its
        request's quota of prompt tokens; returns the budget left."""
        budget, runs, spare = self.max_num_batched_tokens, plan.runs, self.draft_budget()
        for seq in sorted(self.running, key=lambda s: len(s.tokens) - s.num_computed > 1):
            need = len(seq.tokens) - seq.num_computed
            n = min(need, budget, quota[seq.request] if need > 1 else 1)
            if seq not in self.running or n <= 0:
                continue
            # drafts only for a decode (twins copy a forking prompt's state)
            forking = seq.request.needs_fork
            draft = seq.draft[: max(0, spare)] if need == 1 and not forking else []
            draft = draft if draft and self._ensure_blocks(seq, 1 + len(draft), plan) else []
            while not self._ensure_blocks(seq, n, plan):
                victim = self._victim()
                if victim is seq and len(self.running) == 1:  # alone and still does not fit
                    self.finish(seq, "length")
                    plan.ended.append(seq)
                    break
                budget += runs.pop(victim, 0)
                self._preempt(victim)
                if victim is seq:
                    break
            if seq in self.running:
                runs[seq], spare = n + len(draft), spare - len(draft)
                if draft:
                    plan.drafts[seq] = draft
                budget -= n + len(draft)
                if need > 1:  # a prefill spends its request's share
                    quota[seq.request] -= n
        return budget

    def _top_up(self, plan, budget: int):
        """The budget the quotas left unused goes to the prefills that want more, in order."""
        for seq, n in plan.runs.items():
            extra = min(len(seq.tokens) - seq.num_computed - n, budget)
            if extra > 0 and self._ensure_blocks(seq, n + extra, plan):
                plan.runs[seq], budget = n + extra, budget - extra

    def _admit(self, plan, budget: int) -> int:
        while self.waiting and budget > 0:
            seq = self._next_waiting()
            if seq is None:  # all that wait are prompts to score whose head another computes now
                break
            req = seq.request
            need = req.params.n if req.needs_fork else 1  # room for all its samples once it forks
            while len(self.running) + need > self.max_num_seqs and self._outranked(seq):
                budget += self._preempt_for(seq, plan)
            if len(self.running) + need > self.max_num_seqs:
                freed = self._take_fair_share(req, need)
                if freed is None:
                    break
                budget += sum(plan.runs.pop(s, 0) for s in freed)
            self._share_prefix(seq)
            self._from_tier(seq, plan)
            reserve = (self.reserve_tokens or 0) - seq.num_computed
            n = min(len(seq.tokens) - seq.num_computed, budget)
            placed = self._ensure_blocks(seq, n, plan, reserve)
            while not placed and self._outranked(seq):  # blocks from a lower priority
                budget += self._preempt_for(seq, plan)
                n = min(len(seq.tokens) - seq.num_computed, budget)
                placed = self._ensure_blocks(seq, n, plan, reserve)
            if not placed:
                self._release(seq)
                break
            self.waiting.remove(seq)
            self.running.append(seq)
            plan.runs[seq] = n
            budget -= n
            self.stats["prompt_tokens"] += len(seq.tokens)
            self.stats["prompt_tokens_hit"] += seq.num_computed
            req.prompt_tokens_hit += seq.num_computed
        return budget

    def _outranked(self, seq):
        """Under the priority policy, the running sequence a waiting `seq` may preempt: of those
        of a lower priority (a greater value) than its own, the latest arrival; else None."""
        if self.policy != "priority":
            return None
        mine = seq.request.params.priority
        lower = [s for s in reversed(self.running) if s.request.params.priority > mine]
        return max(lower, key=lambda s: self._rank(s)[:2]) if lower else None

    def _preempt_for(self, seq, plan) -> int:
        """Preempt the sequence seq outranks; returns the budget its plan held."""
        victim = self._outranked(seq)
        tokens = plan.runs.pop(victim, 0)
        self._preempt(victim)
        return tokens

    def _share_prefix(self, seq):
        """Give seq the blocks of its longest prefix cached in every pool (a reference each)."""
        bs, most, hits = self.block_size, (len(seq.tokens) - 1) // self.block_size, []
        if seq.request.pools_every_token:  # an embedding of every position: none reused
            most = 0
        for allocator in self.pools:  # each lookup within the last: the hit every pool holds
            blocks, hashes = allocator.lookup_prefix(seq.tokens, most, seq.request.hash_root)
            hits, most = hits + [blocks], len(blocks)
        reused = self.scores.reusable_tokens(seq.request, hashes) if self.scores else most * bs
        tables = [blocks[: blocks_for(reused, bs)] for blocks in hits]
        # prompt scoring can cut a hit below the blocks a window kept: then it is recomputed whole
        if any(
            a.window and not all(t[max(0, reused - a.window + 1) // bs :])
            for a, t in zip(self.pools, tables)
        ):
            reused, tables = 0, [[] for _ in tables]
        for allocator, b in [(a, b) for a, t in zip(self.pools, tables) for b in t if b]:
            allocator.share(b)
        seq.blocks, seq.window_blocks = tables + [[]] * (2 - len(tables))
        seq.hashes, seq.num_computed = hashes[: reused // bs], reused

    def _from_tier(self, seq, plan):
        """The blocks of seq's prefix past the pools' hit that the second tier holds, taken by
        the tier (Tier.extend: new blocks named in the prefix cache, loaded by the engine before
        the forward; the plan holds a reference to each until then)."""
        if self.tier is None or seq.request.scoring or seq.request.pools_every_token:
            return
        self.stats["tier_tokens_hit"] += self.tier.extend(seq, self.pools, plan.loads)

    def loaded(self, plan):
        """After the engine loaded plan.loads and copied plan.saves out: its references go."""
        for block, _, pool in plan.loads:
            self.pools[pool].release(block)
        plan.loads, plan.saves = [], []

    def blocks_used(self) -> int:
        return sum(a.num_used() for a in self.pools)

    def _tables(self, seq):  # (allocator, seq's block table in it) per pool
        return list(
            zip(
                self.pools,
                (seq.blocks, seq.window_blocks) if self.window_allocator else (seq.blocks,),
            )
        )

    def _next_waiting(self):
        """The waiting sequence to admit next, or None (scoring's must_wait may hold some back)."""
        ready = [
            s
            for s in self.waiting
            if not (self.scores and self.scores.must_wait(s.request, self.running))
        ]
        if len(ready) <= 1:
            return ready[0] if ready else None
        if self.policy in ("fcfs", "priority"):  # the first (queue order: arrival, or rank) of
            held = Counter(s.request for s in self.running)  # those with fewest samples running
            priority = (lambda s: s.request.params.priority) if self.policy == "priority" else None
            return min(ready, key=lambda s: (priority(s) if priority else 0, held[s.request]))
        # lpm: the request with the longest cached prefix first (ties: the earliest)
        return max(
            ready,
            key=lambda s: len(
                self.allocator.lookup_prefix(
                    s.tokens, (len(s.tokens) - 1) // self.block_size, s.request.hash_root
                )[0]
            ),
        )

    def _take_fair_share(self, req, need: int):
        """Every sequence slot is taken and req, with none running, waits: preempt the newest
        sequences of the request holding the most slots while it holds more than its fair share
        (max_num_seqs / requests present), so one request with a large n cannot make the others
        wait for all its samples. Returns the preempted sequences, or None if req must wait."""
        if any(s.request is req for s in self.running):
            return None
        present = {s.request for s in self.running} | {s.request for s in self.waiting}
        share = max(1, self.max_num_seqs // len(present))
        # under priority, never from a request that outranks req (it would take the slot back)
        ranked = self.policy == "priority"
        held = Counter(
            s.request
            for s in self.running
            if not ranked or s.request.params.priority >= req.params.priority
        )
        victims = []
        while len(self.running) - len(victims) + need > self.max_num_seqs:
            hog, count = (held.most_common(1) or [(None, 0)])[0]
            if count <= share:
                return None
            victims.append(
                [s for s in reversed(self.running) if s.request is hog and s not in victims][0]
            )
            held[hog] -= 1
        for victim in victims:
            self._preempt(victim)
        return victims

    def _ensure_blocks(self, seq, n: int, plan, reserve: int = 0) -> bool:
        """Blocks for seq's next n tokens (in pool 0 at least `reserve`) in every pool, the block
        written first made private (copy-on-write); all or none."""
        tables, first, bs = self._tables(seq), seq.num_computed // self.block_size, self.block_size
        cows = [first < len(t) and a.ref[t[first]] > 1 for a, t in tables]
        needs = []
        for k, (_, table) in enumerate(tables):
            tokens = max(n, reserve) if k == 0 else n  # the reserve holds in pool 0 only
            need = max(0, blocks_for(seq.num_computed + tokens, bs) - len(table))
            needs.append(need + 1 if cows[k] else need)  # a shared block written first: its copy
        if any(
            need > a.num_available() for (a, _), need in zip(tables, needs)
        ):  # so that no pool evicts for nothing
            return False
        got = [a.allocate_many(need) for (a, _), need in zip(tables, needs)]
        if (
            None in got
        ):  # (num_available counts cached blocks that leaf-first eviction cannot reach yet)
            for (a, _), blocks in zip(tables, got):
                for b in blocks or ():
                    a.release(b)
            return False
        for pool, ((alloc, table), cow, blocks) in enumerate(zip(tables, cows, got)):
            if cow:
                private = blocks.pop(0)
                plan.copies.append((table[first], private, pool))
                alloc.release(table[first])
                table[first] = private
            table += blocks
        return True

    def _release(self, seq, forget: bool = True):
        for alloc, b in [
            (a, b) for a, t in self._tables(seq) for b in t if b
        ]:  # (0: freed behind the window)
            alloc.release(b)
        seq.blocks, seq.window_blocks = [], []
        if forget:
            seq.hashes, seq.num_computed = [], 0

    def _victim(self):
        """The sequence to preempt when blocks run out: the one whose request arrived last (of
        its samples, the last admitted; under the priority policy, of the lowest priority). By
        arrival, not by admission: a request preempted and re-admitted would otherwise be the
        newest again at every shortage and starve behind requests that came after it; the oldest
        request is never preempted for a newer one, so it always progresses."""
        return max(reversed(self.running), key=lambda s: self._rank(s)[:2])

    def _preempt(self, seq):
        self.running.remove(seq)
        self._release(seq)
        self._enqueue(seq)  # recomputed before any request that came after it
        self.stats["preemptions"] += 1

    def finish(self, seq, reason: str):
        """End a sequence (running, waiting or neither) and free its blocks."""
        seq.finish_reason = reason
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        self._release(
            seq, forget=False
        )  # its hashes stay: they name what it computed (prompt scoring remembers by them)

    def _free_outside_window(self, seq, alloc, table):
        """Release the blocks before the window of seq's next query (full ones stay cached until
        evicted), newest first, stopping at the first one already freed."""
        i = min((seq.num_computed - alloc.window + 1) // self.block_size, len(table)) - 1
        while i >= 0 and table[i]:
            alloc.release(table[i])
            table[i], i = 0, i - 1

    def update(self, plan, results):
        """After the step's forward: plan's tokens are computed (a drafted one's: those it kept);
        results [(seq, token or None, finish reason or None)] append the sampled tokens and end the
        finished sequences. A forked sample starts from its sibling's state, sharing every block."""
        bs = self.block_size
        for seq, token, _ in results:
            if token is not None:
                seq.tokens.append(token)
        for seq, n in plan.runs.items():
            if seq.finish_reason:  # a fault ended it during the step: its blocks are gone
                continue
            seq.num_computed += n
            while (
                len(seq.hashes) < seq.num_computed // bs
            ):  # blocks that filled up: into the prefix cache
                i = len(seq.hashes)
                parent, tokens = seq.last_hash, seq.tokens[i * bs : (i + 1) * bs]
                for alloc, table in self._tables(seq):
                    h = alloc.register(table[i], parent, tokens, table[i - 1] if i else None)
                seq.hashes.append(h)
            for alloc, table in self._tables(seq):
                if alloc.window:
                    self._free_outside_window(seq, alloc, table)
                while seq in plan.drafts and len(table) > blocks_for(seq.num_computed + 1, bs):
                    alloc.release(table.pop())  # taken for drafts it did not keep: free at once
        for seq, twins in plan.forks:
            for k, twin in enumerate(t for t in twins if not t.finish_reason):
                twin.num_computed, twin.hashes = seq.num_computed, list(seq.hashes)
                twin.blocks, twin.window_blocks = list(seq.blocks), list(seq.window_blocks)
                for alloc, b in [(a, b) for a, t in self._tables(twin) for b in t if b]:
                    alloc.share(b)
                self.running.insert(self.running.index(seq) + 1 + k, twin)
        for seq, _, reason in results:
            if reason and not seq.finish_reason:
                self.finish(seq, reason)
