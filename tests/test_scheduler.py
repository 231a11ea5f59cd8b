"""scheduler.py without a model: a stand-in runs each plan by writing every computed token id into
its KV slot (pool, block, offset), copying blocks first as the plan says, and "samples" a fixed
function of what the slots hold. A sequence that reads back anything but its own tokens where its
queries look (a block shared wrongly, a copy missed, a preempted sequence's stale blocks, a prefix
hit on the wrong blocks, a windowed block freed too soon) fails at once; outputs must equal the
function run alone."""

import random

import pytest
from helpers import check_allocator

from paged import BlockAllocator
from scheduler import Scheduler
from sequence import Request, RequestParams


def next_token(tokens, index: int = 0) -> int:
    """The stand-in's "model": depends on every token so far (and on the sample's index)."""
    return 3 + (sum((i + 1) * t for i, t in enumerate(tokens)) + 7 * index) % 97


def alone(prompt, n_new: int, index: int = 0) -> list:
    tokens = list(prompt)
    for _ in range(n_new):
        tokens.append(next_token(tokens, index))
    return tokens[len(prompt) :]


class StandIn:
    """The engine's place: runs plans against fake KV slots; `copies=False` skips copy-on-write."""

    def __init__(self, scheduler, copies: bool = True):
        self.s, self.kv, self.copies, self.requests, self.computed = scheduler, {}, copies, {}, 0
        self.most_windowed = 0

    def add(self, prompt, n_new: int, n: int = 1, priority: int = 0):
        params = RequestParams(max_new_tokens=n_new, n=n, seed=0, priority=priority)
        req = Request(len(self.requests), prompt, params, "cpu")
        self.requests[req.id] = req
        self.s.add(req.seqs[0])
        return req

    def step(self):
        plan, bs, results = self.s.schedule(), self.s.block_size, []
        for src, dst, pool in plan.copies if self.copies else ():
            self.kv[pool, dst] = dict(self.kv.get((pool, src), {}))
        for seq, n in plan.runs.items():  # every token's K/V written first, as each layer does
            for pool, (_, table) in enumerate(self.s._tables(seq)):
                for p in range(seq.num_computed, seq.num_computed + n):
                    assert table[p // bs], "a token is written to the null block"
                    self.kv.setdefault((pool, table[p // bs]), {})[p % bs] = seq.tokens[p]
            self.computed += n
        for seq, n in plan.runs.items():  # what the step's queries see: all, or their windows
            for pool, (allocator, table) in enumerate(self.s._tables(seq)):
                low, end = (
                    max(0, seq.num_computed - allocator.window + 1) if allocator.window else 0,
                    seq.num_computed + n,
                )
                seen = [
                    self.kv.get((pool, table[p // bs]), {}).get(p % bs) for p in range(low, end)
                ]
                assert seen == seq.tokens[low:end], (
                    f"request {seq.request.id} sample {seq.index} reads back other tokens"
                )
            if seq.num_computed + n < len(seq.tokens):
                continue
            samples = [seq]
            if seq.request.needs_fork:  # as the engine forks: at the prompt's end, from its row
                twins = [seq.fork(k) for k in range(1, seq.request.params.n)]
                seq.request.seqs, seq.request.needs_fork = seq.request.seqs + twins, False
                plan.forks.append((seq, twins))
                samples += twins
            for s in samples:
                done = len(s.output) + 1 >= s.request.params.max_new_tokens
                results.append((s, next_token(s.tokens, s.index), "length" if done else None))
        self.s.update(plan, results)
        for allocator in self.s.pools:
            check_allocator(allocator)
        held = [sum(map(bool, t)) for s in self.s.running for a, t in self.s._tables(s) if a.window]
        self.most_windowed = max(
            [self.most_windowed, *held]
        )  # blocks a sequence holds in a windowed pool
        return plan

    def run(self):
        while self.s.has_unfinished():
            self.step()
        assert self.s.blocks_used() == 0, "blocks leaked"


def scheduler(
    num_blocks=400,
    block_size=4,
    max_num_seqs=8,
    max_num_batched_tokens=512,
    window=0,
    window_blocks=0,
    **kw,
):
    """window: every layer's (one pool); with window_blocks, a hybrid's windowed layers' (two
    pools)."""
    windows = BlockAllocator(window_blocks, block_size, window=window) if window_blocks else None
    return Scheduler(
        BlockAllocator(num_blocks, block_size, window=0 if windows else window),
        max_num_seqs,
        max_num_batched_tokens,
        window_allocator=windows,
        **kw,
    )


def random_workload(count: int, seed: int):
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 250) for _ in range(rng.randint(1, 60))] for _ in range(count)]
    shared = prompts[0][:30]
    prompts += [shared + [7, 7, 7], shared + [9]]  # prefix hits on request 0's blocks
    return prompts, [rng.randint(1, 24) for _ in prompts]


@pytest.mark.parametrize(
    "num_blocks, max_batched, policy",
    [(400, 512, "fcfs"), (30, 512, "fcfs"), (400, 8, "fcfs"), (26, 12, "fcfs"), (26, 12, "lpm")],
)
def test_every_sequence_reads_back_exactly_its_own_tokens(num_blocks, max_batched, policy):
    prompts, news = random_workload(12, seed=0)
    stand_in = StandIn(scheduler(num_blocks, max_num_batched_tokens=max_batched, policy=policy))
    reqs = [stand_in.add(p, n) for p, n in zip(prompts, news)]
    stand_in.run()
    for req, prompt, n in zip(reqs, prompts, news):
        assert req.seqs[0].output == alone(prompt, n) and req.seqs[0].finish_reason == "length"
    stats = stand_in.s.stats
    assert stats["prompt_tokens_hit"] > 0
    if num_blocks < 100:
        assert stats["preemptions"] > 0
    if max_batched < 100:
        assert stats["steps"] > sum(map(len, prompts)) / max_batched


@pytest.mark.parametrize(
    "num_blocks, window_blocks, max_batched",
    [(400, 0, 512), (12, 0, 12), (400, 400, 512), (400, 12, 12), (30, 20, 8)],
)
def test_windowed_pools_free_what_no_query_sees_and_keep_what_they_do(
    num_blocks, window_blocks, max_batched
):
    """Window 8, blocks of 4, on every layer (one pool) or on a hybrid's windowed layers (a pool of
    their own): every query reads back its window's tokens, n = 2 samples and prefix hits
    included, roomy and tight (preemptions); a sequence never holds more windowed blocks than its
    window and its chunk span, (8 + chunk) / 4 + 2, however long it grows."""
    prompts, news = random_workload(12, seed=1)
    stand_in = StandIn(
        scheduler(
            num_blocks, max_num_batched_tokens=max_batched, window=8, window_blocks=window_blocks
        )
    )
    reqs = [stand_in.add(p, n, n=1 + (k == 3)) for k, (p, n) in enumerate(zip(prompts, news))]
    stand_in.run()
    for req, prompt, n in zip(reqs, prompts, news):
        assert [s.output for s in req.seqs] == [alone(prompt, n, k) for k in range(req.params.n)]
    assert 0 < stand_in.most_windowed <= (8 + min(max_batched, 64)) // 4 + 2
    stats = stand_in.s.stats
    assert stats["preemptions"] > 0 if max_batched < 100 else stats["prompt_tokens_hit"] > 0


def test_n_samples_fork_share_the_prompt_and_copy_only_the_block_they_write():
    """n = 3 of a 10-token prompt (block size 4): the prompt's blocks shared three ways, the half-
    full third block copied by two samples; each sample equals its own run alone."""
    stand_in = StandIn(scheduler())
    req = stand_in.add(list(range(30, 40)), 12, n=3)
    stand_in.step()
    blocks = [s.blocks for s in req.seqs]
    assert len(blocks) == 3 and blocks[0][:2] == blocks[1][:2] == blocks[2][:2]
    assert stand_in.s.allocator.ref[blocks[0][0]] == 3
    third = blocks[0][2]
    copies = stand_in.step().copies
    assert len(copies) == 2 and {src for src, _, _ in copies} == {third}
    stand_in.run()
    assert [s.output for s in req.seqs] == [alone(range(30, 40), 12, k) for k in range(3)]


def test_a_missed_copy_is_caught():
    """The stand-in can fail: skipping the plan's copies makes the samples read each other's
    tokens."""
    stand_in = StandIn(scheduler(), copies=False)
    stand_in.add(list(range(30, 40)), 12, n=3)
    with pytest.raises(AssertionError, match="reads back other tokens"):
        stand_in.run()


def test_a_prefix_hit_reuses_exactly_the_full_shared_blocks():
    shared = list(range(20, 34))  # 14 tokens: 3 full blocks of 4
    stand_in = StandIn(scheduler(100))
    stand_in.add(shared + [40, 41, 42], 5)
    stand_in.run()
    before = stand_in.computed
    second = stand_in.add(shared + [50, 51], 5)
    stand_in.run()
    assert second.prompt_tokens_hit == 12 and stand_in.computed - before == (16 - 12) + 4
    assert second.seqs[0].output == alone(shared + [50, 51], 5)


def test_preemption_takes_the_newest_sequence_and_recomputes_it():
    """4 usable blocks, two 7-token prompts: at position 8 the newer one is preempted (its blocks
    freed, first in the queue) and later recomputed; both outputs are still their alone-runs."""
    stand_in = StandIn(scheduler(5, max_num_seqs=2))
    old, new = (
        stand_in.add([5, 6, 7, 8, 9, 10, 11], 6),
        stand_in.add([12, 13, 14, 15, 16, 17, 18], 6),
    )
    stand_in.step()
    stand_in.step()
    assert stand_in.s.stats["preemptions"] == 0
    stand_in.step()
    s = stand_in.s
    assert (
        s.stats["preemptions"] == 1
        and [q.request for q in s.running] == [old]
        and s.waiting[0].request is new
    )
    assert s.waiting[0].blocks == [] and s.waiting[0].num_computed == 0
    stand_in.run()
    assert old.seqs[0].output == alone(old.prompt, 6) and new.seqs[0].output == alone(new.prompt, 6)


def test_a_short_request_is_served_before_every_request_that_came_after_it():
    """A tight pool, six long requests running and a new long one arriving every other step; a
    short request arrives among them. Requests are first scheduled in arrival order, and the
    short one finishes before any request that came after it: a preempted request waits in
    arrival order, and preemption takes the latest arrival, never the short one for a newer."""
    stand_in = StandIn(scheduler(40, max_num_seqs=6, max_num_batched_tokens=32))
    for k in range(6):
        stand_in.add([3 + k] * 9, 40)
    for _ in range(3):
        stand_in.step()
    short, later, first_run = stand_in.add([5, 6, 7], 4), [], []
    for step in range(3000):
        if step % 2 == 0 and len(later) < 40:
            later.append(stand_in.add([10 + step % 80] * 9, 40))
        for seq in stand_in.step().runs:
            if seq.request.id not in first_run:
                first_run.append(seq.request.id)
        if short.finished:
            break
    assert short.finished, f"after {step} steps the short request still runs"
    assert first_run == sorted(first_run), "a request was scheduled before an earlier one"
    assert not [r.id for r in later if r.finished], "a later request finished first"
    assert stand_in.s.stats["preemptions"] > 0  # the pool was tight enough to preempt
    stand_in.run()
    assert short.seqs[0].output == alone(short.prompt, 4)


def test_the_priority_policy_admits_and_keeps_the_lower_value_first():
    """One slot: requests of priority 0, 5 and -1 (arriving in that order) run -1, 0, 5; two equal
    priorities run in arrival order. A tight pool preempts the lowest priority even when it
    arrived first, and every output is still its alone-run."""
    stand_in = StandIn(scheduler(400, max_num_seqs=1, policy="priority"))
    reqs = [stand_in.add([3 + k, 4, 5], 3, priority=p) for k, p in enumerate([0, 5, -1, 0])]
    order = []
    while stand_in.s.has_unfinished():
        for seq in stand_in.step().runs:
            order += [] if seq.request.id in order else [seq.request.id]
    assert order == [2, 0, 3, 1]
    assert [r.seqs[0].output for r in reqs] == [alone(r.prompt, 3) for r in reqs]

    tight = StandIn(scheduler(5, max_num_seqs=2, policy="priority"))
    low = tight.add([5, 6, 7, 8, 9, 10, 11], 6, priority=1)
    high = tight.add([12, 13, 14, 15, 16, 17, 18], 6)
    for _ in range(3):  # position 8 needs a fifth block: the older but lower-priority one goes
        tight.step()
    assert tight.s.stats["preemptions"] == 1 and tight.s.waiting[0].request is low
    tight.run()
    assert low.seqs[0].output == alone(low.prompt, 6) and high.seqs[0].output == alone(
        high.prompt, 6
    )


def test_a_higher_priority_arrival_preempts_a_lower_one_for_its_slot_or_its_blocks():
    """Priority policy: a request of priority 0 arriving while one of priority 5 holds the only
    slot, or the blocks it needs, takes them at once (the lower one waits and is recomputed);
    one of equal priority waits its turn. Every output is still its alone-run."""
    for num_blocks, seqs in ((400, 1), (6, 2)):  # the slot; the blocks (5 usable, 4 tokens each)
        stand_in = StandIn(scheduler(num_blocks, max_num_seqs=seqs, policy="priority"))
        low = stand_in.add(list(range(3, 17)), 6, priority=5)  # 14 tokens: 4 blocks
        stand_in.step()
        same = stand_in.add(list(range(20, 30)), 3, priority=5)  # 10 tokens: 3 blocks
        stand_in.step()
        assert stand_in.s.stats["preemptions"] == 0 and same.seqs[0] in stand_in.s.waiting
        high = stand_in.add(list(range(30, 40)), 3)  # 10 tokens: 3 blocks
        plan = stand_in.step()
        assert high.seqs[0] in plan.runs and low.seqs[0] not in plan.runs, num_blocks
        assert stand_in.s.stats["preemptions"] == 1
        assert [w.request for w in stand_in.s.waiting] == [low, same]  # ranks kept
        stand_in.run()
        for r in (low, same, high):
            assert r.seqs[0].output == alone(r.prompt, r.params.max_new_tokens)


def test_a_fair_share_never_takes_a_slot_from_a_higher_priority():
    """Priority policy, two slots both held by the samples of a priority -1 request (n = 2): a
    priority 0 arrival waits. (Taking a slot by the fair share, it was outranked at once by the
    sample it preempted, which took the slot back: schedule() never returned.)"""
    stand_in = StandIn(scheduler(400, max_num_seqs=2, policy="priority"))
    high = stand_in.add([3, 4, 5], 20, n=2, priority=-1)
    for _ in range(3):
        stand_in.step()
    low = stand_in.add([6, 7, 8], 5)
    stand_in.step()
    assert stand_in.s.stats["preemptions"] == 0 and low.seqs[0] in stand_in.s.waiting
    stand_in.run()
    assert [s.output for s in sorted(high.seqs, key=lambda s: s.index)] == [
        alone(high.prompt, 20, k) for k in range(2)
    ]
    assert low.seqs[0].output == alone(low.prompt, 5)


def test_alone_and_too_big_for_the_pool_ends_at_length():
    stand_in = StandIn(scheduler(5))
    req = stand_in.add(list(range(20, 30)), 100)
    stand_in.run()
    assert req.seqs[0].finish_reason == "length" and len(req.seqs[0].output) == 16 - 10 + 1


def test_chunked_prefill_never_stalls_decodes():
    stand_in = StandIn(scheduler(600, block_size=16, max_num_batched_tokens=128))
    small = [stand_in.add([3 + i, 4, 5], 40) for i in range(4)]
    stand_in.step()
    big = stand_in.add([random.Random(1).randrange(3, 250) for _ in range(2000)], 2)
    while big.seqs[0].num_computed < 2000:
        before = [len(r.seqs[0].tokens) for r in small]
        plan = stand_in.step()
        assert [len(r.seqs[0].tokens) for r in small] == [n + 1 for n in before]
        assert sum(plan.runs.values()) <= 128
    stand_in.run()


def test_a_large_n_yields_a_slot_to_a_newcomer_but_never_below_the_fair_share():
    stand_in = StandIn(scheduler(200, max_num_seqs=8, max_num_batched_tokens=64))
    big = stand_in.add(list(range(20, 33)), 30, n=8)
    for _ in range(3):
        stand_in.step()
    assert len(stand_in.s.running) == 8
    small = stand_in.add([5, 6, 7], 2)
    stand_in.step()
    stand_in.step()
    assert small.finished and stand_in.s.stats["preemptions"] >= 1
    stand_in.run()
    assert [s.output for s in sorted(big.seqs, key=lambda s: s.index)] == [
        alone(big.prompt, 30, k) for k in range(8)
    ]

    fair = StandIn(scheduler(200, max_num_seqs=8))
    for k in range(8):
        fair.add([1 + k, 2, 3], 20)
    fair.step()
    ninth = fair.add([7, 8], 3)
    fair.step()
    assert fair.s.stats["preemptions"] == 0 and ninth.seqs[0] in fair.s.waiting
    fair.run()


def test_prefill_tokens_are_shared_between_requests_and_the_budget_still_fills():
    stand_in = StandIn(scheduler(2000, max_num_seqs=8, max_num_batched_tokens=64))
    rng = random.Random(2)
    huge = stand_in.add([rng.randrange(3, 250) for _ in range(1000)], 2)
    stand_in.step()
    small = stand_in.add([5, 6, 7, 8, 9], 3)
    plan = stand_in.step()  # a newcomer's prompt goes in at once, beside the huge prefill
    assert plan.runs[small.seqs[0]] == 5 and plan.runs[huge.seqs[0]] == 64 - 5
    many = [stand_in.add([rng.randrange(3, 250) for _ in range(100)], 2) for _ in range(3)]
    while huge.seqs[0].num_computed < 1000:
        need = sum(
            len(s.tokens) - s.num_computed for s in stand_in.s.running + list(stand_in.s.waiting)
        )
        plan = stand_in.step()
        assert sum(plan.runs.values()) == min(64, need)  # quotas never leave the budget idle
    assert all(
        r.seqs[0].num_computed >= 100 for r in many
    )  # not held until the huge prompt is done
    stand_in.run()
    for req in [huge, small] + many:
        assert req.seqs[0].output == alone(req.prompt, req.params.max_new_tokens)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="fcfs, lpm or priority"):
        scheduler(policy="random")
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        scheduler(max_num_seqs=8, max_num_batched_tokens=4)
