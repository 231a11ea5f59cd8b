"""engine.py on scheduler.py: continuous batching gives every request exactly the tokens it gets
alone - with preemption, chunked prefill, prefix-cache hits and copy-on-write forks - and the engine
really does change its batch mid-run, chunk long prompts and prefer cached prefixes under `lpm`.
Exact comparisons run in float64, so a mismatch is a bug, never a near-tie."""

import random
import re
import time

import pytest
import torch
from helpers import alone, check_allocator, run_to_end, tiny_checkpoint

import generate
from engine import Engine, Finished, RequestParams
from formats import weights
from kv_cache import StaticKVCache
from sampling import SamplingParams


@pytest.fixture(scope="module")
def tiny64(tmp_path_factory):
    folder = tiny_checkpoint(tmp_path_factory.mktemp("sched-tiny"), max_position_embeddings=2304)
    model, _ = weights.load(folder, dtype=torch.float64)
    return model


def greedy(n):
    return RequestParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)


def random_requests(count, seed, max_prompt=60, max_new=24):
    rng = random.Random(seed)
    prompts = [
        [rng.randrange(3, 250) for _ in range(rng.randint(1, max_prompt))] for _ in range(count)
    ]
    return prompts, [rng.randint(1, max_new) for _ in prompts]


@pytest.fixture(scope="module")
def workload(tiny64):
    prompts, news = random_requests(12, seed=0)
    shared = prompts[0][:30]
    prompts += [shared + [7, 7, 7], shared + [9]]  # two prefix-cache hits on request 0's blocks
    news += [10, 10]
    return prompts, news, [alone(tiny64, p, n) for p, n in zip(prompts, news)]


@pytest.mark.parametrize(
    "num_blocks, max_batched, expect",
    [
        (400, 512, "roomy"),  # everything fits: one batch, whole prompts
        (30, 512, "preempt"),  # 29 usable blocks of 4 tokens for 14 requests: preemptions
        (400, 8, "chunks"),  # 8 tokens per step: prompts prefill in chunks
        (26, 12, "preempt"),  # both
    ],
)
def test_batched_equals_alone(tiny64, workload, num_blocks, max_batched, expect):
    prompts, news, reference = workload
    engine = Engine.for_model(
        tiny64,
        num_blocks=num_blocks,
        block_size=4,
        max_num_seqs=8,
        max_num_batched_tokens=max_batched,
    )
    out = engine.run_batch(prompts, [greedy(n) for n in news])
    for i, (o, ref) in enumerate(zip(out, reference)):
        assert o["tokens"] == ref, f"request {i} differs from its alone-run"
        assert o["finish_reason"] == "length"
    assert engine.scheduler.stats["prompt_tokens_hit"] > 0  # the shared-prefix requests hit
    if expect == "preempt":
        assert engine.scheduler.stats["preemptions"] > 0
    if expect == "chunks":
        assert engine.scheduler.stats["steps"] > sum(len(p) for p in prompts) / 8
    check_allocator(engine.scheduler.allocator)
    assert engine.scheduler.allocator.num_used() == 0, "blocks leaked"


def test_padded_steps_equal_unpadded(tiny64, workload, monkeypatch):
    """Steps of 128 tokens or more are padded to a multiple of 16 (cpu_kernels.gemm_padding; in bf16
    on CPU, where each row count is a new oneDNN kernel): forced here in float64, every request
    still gets its alone-run tokens, and the padded forwards really ran."""
    import cpu_kernels
    import engine as engine_module

    widths, forward = [], engine_module.flat_forward

    def counting(model, cache, tokens, pos, keep=None):
        widths.append(tokens.shape[1])
        return forward(model, cache, tokens, pos, keep)

    monkeypatch.setattr(cpu_kernels, "GEMM_PAD_DTYPES", (torch.float64,))
    monkeypatch.setattr(engine_module, "flat_forward", counting)
    prompts, news, reference = workload
    engine = Engine.for_model(
        tiny64, num_blocks=400, block_size=4, max_num_seqs=8, max_num_batched_tokens=200
    )
    out = engine.run_batch(prompts, [greedy(n) for n in news])
    assert [o["tokens"] for o in out] == reference
    assert any(w >= 128 for w in widths) and all(w % 16 == 0 for w in widths if w >= 128), widths
    check_allocator(engine.scheduler.allocator)
    assert engine.scheduler.allocator.num_used() == 0


def test_preemption_takes_the_newest_request(tiny64):
    """4 usable blocks of 4 tokens, two 7-token prompts: when the older request needs a fifth
    block, the newer one is preempted (blocks freed, back to the front of the queue), and both
    still produce their alone-run tokens."""
    engine = Engine.for_model(tiny64, num_blocks=5, block_size=4, max_num_seqs=2)
    old, new = [
        engine.add_request(p, greedy(6))
        for p in ([5, 6, 7, 8, 9, 10, 11], [12, 13, 14, 15, 16, 17, 18])
    ]
    engine.step()  # both prefill (2 blocks each) and sample their first token
    engine.step()  # position 7: both still fit
    assert engine.scheduler.stats["preemptions"] == 0
    engine.step()  # position 8 needs a fifth block
    assert engine.scheduler.stats["preemptions"] == 1
    assert [s.request.id for s in engine.scheduler.running] == [old] and engine.scheduler.waiting[
        0
    ].request.id == new
    assert (
        engine.scheduler.waiting[0].blocks == [] and engine.scheduler.waiting[0].num_computed == 0
    )
    done = run_to_end(engine)
    for rid, prompt in ((old, [5, 6, 7, 8, 9, 10, 11]), (new, [12, 13, 14, 15, 16, 17, 18])):
        assert done[rid].result()["tokens"] == alone(tiny64, prompt, 6)


def test_queue_time_and_the_oldest_wait_are_measured(tiny64):
    """One request at a time (max_num_seqs=1), four queued at once: each waits for those before
    it, in arrival order. metrics() gives the time in the queue (p50, p99) over those admitted and
    the oldest wait now; the last request's queue time is the sum of the others' runs."""
    engine = Engine.for_model(tiny64, num_blocks=64, block_size=4, max_num_seqs=1)
    ids = [engine.add_request([5 + k, 6, 7], greedy(4)) for k in range(4)]
    engine.step()
    time.sleep(0.05)  # the three waiting have waited at least this long
    assert engine.metrics()["oldest_waiting_s"] >= 0.05
    done = run_to_end(engine)
    admitted = [done[rid].admitted for rid in ids]
    assert admitted == sorted(admitted), "admitted out of arrival order"
    queued = sorted(done[rid].admitted - done[rid].arrival for rid in ids)
    m = engine.metrics()
    assert m["queue_time_p50_s"] == queued[2] and m["queue_time_p99_s"] == queued[3]
    assert queued[3] >= 0.05 and m["oldest_waiting_s"] == 0.0


def test_a_priority_needs_the_priority_policy(tiny64):
    fcfs = Engine.for_model(tiny64, num_blocks=16, block_size=4)
    with pytest.raises(ValueError, match="--schedule_policy priority"):
        fcfs.add_request([5, 6, 7], RequestParams(max_new_tokens=2, priority=1))
    with pytest.raises(ValueError, match="priority must be an integer"):
        fcfs.add_request([5, 6, 7], RequestParams(max_new_tokens=2, priority=0.5))
    ranked = Engine.for_model(tiny64, num_blocks=16, block_size=4, policy="priority")
    rid = ranked.add_request([5, 6, 7], RequestParams(max_new_tokens=2, temperature=0, priority=3))
    assert run_to_end(ranked)[rid].result()["tokens"] == alone(tiny64, [5, 6, 7], 2)


def test_running_set_changes_mid_run(tiny64):
    """Short requests finish and leave while long ones continue, and waiting ones join."""
    engine = Engine.for_model(
        tiny64, num_blocks=200, block_size=4, max_num_seqs=2, max_num_batched_tokens=64
    )
    for prompt, n in [([5, 6, 7], 30), ([8, 9], 3), ([10, 11, 12], 3), ([13], 3)]:
        engine.add_request(prompt, greedy(n))
    history = []
    while engine.has_unfinished():
        engine.step()
        history.append({s.request.id for s in engine.scheduler.running})
    assert history[0] == {0, 1}
    changed = [
        i
        for i in range(1, len(history))
        if history[i] != history[i - 1] and 0 in history[i] and 0 in history[i - 1]
    ]
    assert any(history[i] - history[i - 1] for i in changed), (
        "no request joined while request 0 ran"
    )
    assert {2, 3} <= set().union(*history[:-1]) and 0 in history[-2]


def test_chunked_prefill_never_stalls_decodes(tiny64):
    """While a 2,000-token prompt prefills in chunks of at most 128 - 4 tokens, each of 4 running
    decodes gains exactly one token per step."""
    engine = Engine.for_model(
        tiny64, num_blocks=600, block_size=16, max_num_seqs=8, max_num_batched_tokens=128
    )
    small = [engine.add_request([3 + i, 4, 5], greedy(40)) for i in range(4)]
    engine.step()  # the four prompts prefill together
    big = engine.add_request([random.Random(1).randrange(3, 250) for _ in range(2000)], greedy(2))
    steps = 0
    while engine.requests[big].seqs[0].num_computed < 2000:
        before = {r: len(engine.requests[r].seqs[0].tokens) for r in small}
        events = engine.step()
        steps += 1
        for r in small:
            assert len(engine.requests[r].seqs[0].tokens) == before[r] + 1
        assert sum(1 for e in events if e[0] in small) == 4
    assert steps >= 2000 // 124


def test_prefix_cache_reuses_exactly_the_full_shared_blocks(tiny64):
    """Prompts sharing 3.5 blocks (14 tokens, block size 4): the second reuses exactly 3 blocks and
    the model computes only the other tokens; a request arriving after both finished still hits;
    outputs equal prefix caching off."""
    shared = list(range(20, 34))  # 14 tokens
    prompts = [shared + [40, 41, 42], shared + [50, 51], shared + [60]]
    results = {}
    for caching in (True, False):
        engine = Engine.for_model(tiny64, num_blocks=100, block_size=4, prefix_caching=caching)
        computed = []
        hook = tiny64.register_forward_pre_hook(lambda m, args: computed.append(args[0].shape[1]))
        try:
            first = engine.run_batch(prompts[:1], greedy(5))
            n_before = sum(computed)
            second = engine.run_batch(prompts[1:2], greedy(5))
            n_second = sum(computed) - n_before
            third = engine.run_batch(
                prompts[2:], greedy(5)
            )  # the earlier requests have all finished
        finally:
            hook.remove()
        results[caching] = (first + second + third, n_second, engine)
    outs, n_second, engine = results[True]
    assert n_second == (16 - 12) + 4  # its prompt beyond 3 cached blocks, then 4 decode steps
    assert engine.scheduler.stats["prompt_tokens_hit"] == 12 + 12
    assert [o["tokens"] for o in outs] == [o["tokens"] for o in results[False][0]]
    assert results[False][2].scheduler.stats["prompt_tokens_hit"] == 0


def test_lpm_gets_more_prefix_hits_than_fcfs(tiny64):
    """Two groups of prompts with different 16-token heads arrive interleaved (A B A B ...), one
    runs at a time, and the pool holds only one head: fcfs evicts the other head every time,
    lpm runs each group together."""
    heads = [list(range(10, 26)), list(range(100, 116))]
    prompts = [heads[i % 2] + [200 + i] for i in range(8)]
    hits = {}
    for policy in ("fcfs", "lpm"):
        engine = Engine.for_model(
            tiny64,
            num_blocks=8,
            block_size=4,
            max_num_seqs=1,
            max_num_batched_tokens=64,
            policy=policy,
        )
        out = engine.run_batch(prompts, greedy(4))
        hits[policy] = engine.scheduler.stats["prompt_tokens_hit"]
        assert [o["tokens"] for o in out] == [alone(tiny64, p, 4) for p in prompts]
    assert hits["lpm"] > hits["fcfs"], hits
    assert hits["lpm"] == 6 * 16  # all but the first of each group hit the whole head


def test_n_samples_share_prompt_blocks_copy_on_write(tiny64):
    """n = 3 samples of a 10-token prompt (block size 4): one prefill, the prompt's blocks shared,
    the half-full last block copied per sample; sample k equals a request of n = 1 seeded seed +
    k."""
    prompt = list(range(30, 40))
    params = dict(max_new_tokens=12, temperature=1.0, top_k=50, seed=7, ignore_eos=True)
    engine = Engine.for_model(tiny64, num_blocks=100, block_size=4)
    copies = []
    engine.cache.copy_block = lambda src, dst, pool, f=engine.cache.copy_block: (
        copies.append((src, dst)),
        f(src, dst, pool),
    )
    rid = engine.add_request(prompt, RequestParams(n=3, **params))
    engine.step()  # prefill, fork, first token of each sample
    blocks = [s.blocks for s in engine.requests[rid].seqs]
    assert len(blocks) == 3 and blocks[0][:2] == blocks[1][:2] == blocks[2][:2]
    assert engine.scheduler.allocator.ref[blocks[0][0]] == 3
    done = run_to_end(engine)
    forked = done[rid].result()["tokens"]
    assert len(copies) == 2  # two samples copied the shared half-full block; the third owns it
    assert len({tuple(t) for t in forked}) == 3  # they diverged
    for k in range(3):
        single = Engine.for_model(tiny64, num_blocks=100, block_size=4).run_batch(
            [prompt], RequestParams(**{**params, "seed": 7 + k})
        )
        assert single[0]["tokens"] == forked[k]
    assert engine.scheduler.allocator.num_used() == 0


def test_sampled_output_does_not_depend_on_the_batch(tiny64):
    """Each sequence samples with its own generator: the same seeded request gives the same tokens
    alone and in a crowd."""
    params = RequestParams(max_new_tokens=15, temperature=0.9, top_p=0.9, seed=3, ignore_eos=True)
    solo = Engine.for_model(tiny64, num_blocks=100, block_size=4).run_batch([[5, 6, 7]], params)[0][
        "tokens"
    ]
    prompts, news = random_requests(6, seed=5)
    crowd = Engine.for_model(tiny64, num_blocks=100, block_size=4).run_batch(
        prompts[:3] + [[5, 6, 7]] + prompts[3:],
        [greedy(n) for n in news[:3]] + [params] + [greedy(n) for n in news[3:]],
    )
    assert crowd[3]["tokens"] == solo


# -- sampling controls (sampling.py): per sequence, over its own tokens
# -----------------------------
def penalised_alone(model, prompt, n_new, params):
    """The slow twin with penalties: generate.py's loop on a static cache."""
    cache = StaticKVCache.for_model(model, 1, len(prompt) + n_new)
    rows, _ = generate.generate(
        model, cache, torch.tensor([prompt]), n_new, params, generate.DecodeOptions(ignore_eos=True)
    )
    return rows[0]


def test_a_logit_bias_of_100_forces_its_token_and_leaves_the_neighbours_alone(tiny64):
    forced = RequestParams(
        max_new_tokens=6, temperature=1.0, seed=0, logit_bias={"7": 100}, ignore_eos=True
    )
    banned = RequestParams(
        max_new_tokens=6, temperature=0.0, logit_bias={177: -100}, ignore_eos=True
    )
    engine = Engine.for_model(tiny64, num_blocks=100, block_size=4)
    out = engine.run_batch([[5, 6, 7], [30, 31, 32, 33], [9, 10]], [forced, banned, greedy(6)])
    assert out[0]["tokens"] == [7] * 6
    assert 177 in alone(tiny64, [30, 31, 32, 33], 6) and 177 not in out[1]["tokens"]
    assert out[2]["tokens"] == alone(tiny64, [9, 10], 6)


def test_greedy_penalised_requests_in_a_crowd_equal_generate_alone(tiny64):
    """Repetition (over prompt and output) and frequency/presence (over the output) penalties count
    each sequence's own tokens, through chunked prefill and preemption: every penalised request
    gives generate.py's tokens with the same penalties, which differ from its unpenalised ones."""
    prompts, news = random_requests(8, seed=11, max_prompt=30, max_new=16)
    controls = [
        dict(repetition_penalty=1.5),
        dict(frequency_penalty=1.0, presence_penalty=0.5),
        dict(repetition_penalty=0.8, logit_bias={3: 2.0}, min_p=0.5),
    ]
    prompts += [
        [30, 31, 32, 33, 61, 50, 42, 205, 177, 177]
    ] * 3  # its greedy continuation is 177 again
    news += [16] * 3
    params = [greedy(n) for n in news[:8]] + [
        RequestParams(max_new_tokens=16, temperature=0.0, ignore_eos=True, **c) for c in controls
    ]
    engine = Engine.for_model(
        tiny64, num_blocks=20, block_size=4, max_num_seqs=6, max_num_batched_tokens=16
    )
    out = engine.run_batch(prompts, params)
    assert engine.scheduler.stats["preemptions"] > 0
    for i, c in enumerate(controls):
        expected = penalised_alone(tiny64, prompts[8 + i], 16, SamplingParams(0.0, **c))
        assert out[8 + i]["tokens"] == expected, c
    assert out[8]["tokens"] != alone(tiny64, prompts[8], 16)
    for i in range(8):
        assert out[i]["tokens"] == alone(tiny64, prompts[i], news[i])


def test_penalised_samples_stay_independent_of_their_siblings_and_the_batch(tiny64):
    """n = 3 penalised samples: sample k equals a request of n = 1 seeded seed + k (so each counts
    only its own output), and the request gives the same samples in a crowd."""
    prompt = list(range(30, 40))
    params = dict(
        max_new_tokens=12,
        temperature=1.0,
        seed=7,
        ignore_eos=True,
        repetition_penalty=1.3,
        frequency_penalty=0.8,
        presence_penalty=0.4,
        min_p=0.05,
    )
    forked = Engine.for_model(tiny64, num_blocks=100, block_size=4).run_batch(
        [prompt], RequestParams(n=3, **params)
    )[0]["tokens"]
    assert len({tuple(t) for t in forked}) == 3
    for k in range(3):
        single = Engine.for_model(tiny64, num_blocks=100, block_size=4).run_batch(
            [prompt], RequestParams(**{**params, "seed": 7 + k})
        )
        assert single[0]["tokens"] == forked[k]
    others, news = random_requests(5, seed=4)
    crowd = Engine.for_model(
        tiny64, num_blocks=100, block_size=4, max_num_seqs=8, max_num_batched_tokens=24
    ).run_batch(
        others[:2] + [prompt] + others[2:],
        [greedy(n) for n in news[:2]]
        + [RequestParams(n=3, **params)]
        + [greedy(n) for n in news[2:]],
    )
    assert crowd[2]["tokens"] == forked


def test_penalties_never_write_the_steps_logits(tiny64, monkeypatch):
    """_sample computes penalised rows as new tensors: the raw logits survive every step."""
    engine = Engine.for_model(tiny64, num_blocks=100, block_size=4)
    real, checked = engine._sample, []

    def checking(plan, done, logits, events):
        before = logits.clone()
        events = real(plan, done, logits, events)
        checked.append(torch.equal(logits, before))
        return events

    monkeypatch.setattr(engine, "_sample", checking)
    params = RequestParams(
        max_new_tokens=5,
        temperature=0.0,
        repetition_penalty=2.0,
        frequency_penalty=1.0,
        logit_bias={3: 50.0},
        ignore_eos=True,
    )
    engine.run_batch(
        [[5, 6, 7], [8, 9]],
        [params, RequestParams(**{**params.__dict__, "temperature": 1.0, "seed": 1})],
    )
    assert checked and all(checked)


def test_bad_sampling_controls_are_refused_at_add_request(tiny64):
    engine = Engine.for_model(tiny64, num_blocks=100, block_size=4)
    vocab = tiny64.config.vocab_size
    for bad, message in [
        (dict(min_p=1.5), "min_p"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(frequency_penalty=-3), "frequency_penalty"),
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(logit_bias={str(vocab): 1}), rf"logit_bias keys must be token ids in \[0, {vocab}\)"),
        (dict(logit_bias={"one": 1}), "logit_bias keys"),
    ]:
        with pytest.raises(ValueError, match=message):
            engine.add_request([5, 6], RequestParams(**bad))
    assert not engine.has_unfinished() and not engine.requests


def test_soak_random_arrivals_and_aborts(tiny64):
    """200 random requests arriving over time, 1 in 10 aborted mid-run, 40 blocks of 4 tokens for
    up to 6 sequences: the allocator's invariants hold after every step, no block leaks, and a
    sample of the completed requests equals their alone-runs."""
    rng = random.Random(2)
    prompts, news = random_requests(200, seed=3, max_prompt=40, max_new=16)
    engine = Engine.for_model(
        tiny64, num_blocks=40, block_size=4, max_num_seqs=6, max_num_batched_tokens=32
    )
    pending, results, aborted = list(range(200)), {}, set()
    while pending or engine.has_unfinished():
        for _ in range(rng.randint(0, 3)):
            if pending:
                i = pending.pop(0)
                engine.add_request(prompts[i], greedy(news[i]), request_id=i)
        if engine.scheduler.running and rng.random() < 0.05:
            victim = rng.choice(engine.scheduler.running).request.id
            engine.abort(victim)
            aborted.add(victim)
        for event in engine.step():
            if isinstance(event, Finished):
                results[event.request_id] = event.result
        check_allocator(engine.scheduler.allocator)
        owners = {}
        for s in engine.scheduler.running:
            for b in s.blocks:
                owners[b] = owners.get(b, 0) + 1
        assert all(engine.scheduler.allocator.ref[b] == n for b, n in owners.items())
    assert engine.scheduler.allocator.num_used() == 0 and len(results) == 200
    assert engine.scheduler.stats["preemptions"] > 0 and aborted
    assert all(results[i]["finish_reason"] == "abort" for i in aborted)
    done = [i for i in range(200) if i not in aborted]
    for i in rng.sample(done, 10):
        assert results[i]["tokens"] == alone(tiny64, prompts[i], news[i]), f"request {i}"


def test_compiled_decode_buckets_equal_eager(tiny64):
    """Decode-only steps run compiled, padded to power-of-two batch sizes and block-table widths:
    the eager engine's tokens, and no more graphs than buckets."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    prompts, news = random_requests(5, seed=9, max_prompt=20, max_new=12)
    eager = Engine.for_model(tiny64, num_blocks=100, block_size=4).run_batch(
        prompts, [greedy(n) for n in news]
    )
    engine = Engine.for_model(tiny64, num_blocks=100, block_size=4, compile=True)
    compiled = engine.run_batch(prompts, [greedy(n) for n in news])
    assert [o["tokens"] for o in compiled] == [o["tokens"] for o in eager]
    assert 1 <= counters["stats"]["unique_graphs"] <= 3 * 4  # batch buckets 1, 2, 4 x widths 1..8


def test_bad_requests_fail_alone(tmp_path, capsys):
    """Each bad line gets an error naming its problem; the good ones still complete."""
    import json

    import batch

    folder = tiny_checkpoint(tmp_path / "ckpt")  # context 256
    lines = [
        {"id": "ok1", "prompt": "hello world", "max_new_tokens": 4, "temperature": 0},
        "{not json",
        {"id": "ctx", "prompt": [5] * 300, "max_new_tokens": 4},
        {"id": "pool", "prompt": [6] * 200, "max_new_tokens": 4},
        {"id": "temp", "prompt": "hello", "temperature": -0.5},
        {"id": "topp", "prompt": "hello", "top_p": 1.5},
        {"id": "empty", "prompt": ""},
        {"id": "field", "prompt": "hello", "max_tokens": 3},
        {"id": "n", "prompt": "hello", "n": 0},
        {"id": "minp", "prompt": "hello", "min_p": 2},
        {
            "id": "bias",
            "prompt": "hello",
            "max_new_tokens": 3,
            "logit_bias": {"5": 100},
            "ignore_eos": True,
        },
        {"id": "ok2", "prompt": "the quick brown fox", "max_new_tokens": 6, "n": 2, "seed": 1},
        {"id": "prio", "prompt": "hi", "priority": 1},  # under fcfs: refused by name
    ]
    path = tmp_path / "requests.jsonl"
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    assert (
        batch.main(
            [
                "--requests",
                str(path),
                "--checkpoint",
                str(folder),
                "--dtype",
                "float32",
                "--num_blocks",
                "10",
                "--block_size",
                "16",
            ]
        )
        == 0
    )
    captured = capsys.readouterr()
    out = {o["id"]: o for o in map(json.loads, captured.out.strip().splitlines())}
    assert len(out) == len(lines)
    assert re.search(r"time in queue p50 \d+ ms, p99 \d+ ms", captured.err), captured.err[-500:]
    errors = {
        "ctx": "context is 256",
        "pool": "whole KV pool holds 144",
        "temp": "temperature",
        "topp": "top_p",
        "empty": "empty",
        "field": "unknown field",
        "n": "n must be",
        2: "not valid JSON",
        "minp": "min_p",
        "prio": "--schedule_policy priority",
    }
    for rid, text in errors.items():
        assert text in out[rid]["error"], (rid, out[rid])
    assert len(out["ok1"]["tokens"]) <= 4 and "error" not in out["ok1"]
    assert len(out["ok2"]["tokens"]) == 2 and len(out["ok2"]["text"]) == 2
    assert out["bias"]["tokens"] == [5, 5, 5]


def test_a_request_larger_than_the_pool_stops_at_length_instead_of_hanging(tiny64):
    """4 usable blocks of 4 tokens: a 10-token prompt asking for 100 tokens stops with "length"
    once the pool is full (16 tokens), its tokens still the alone-run's, and the pool is freed."""
    engine = Engine.for_model(tiny64, num_blocks=5, block_size=4)
    out = engine.run_batch([list(range(20, 30))], greedy(100))[0]
    assert out["finish_reason"] == "length" and len(out["tokens"]) == 16 - 10 + 1
    assert out["tokens"] == alone(tiny64, list(range(20, 30)), len(out["tokens"]))
    assert engine.scheduler.allocator.num_used() == 0


def test_a_fault_while_sampling_one_request_ends_only_that_request(tiny64, monkeypatch):
    engine = Engine.for_model(tiny64, num_blocks=64, block_size=4, max_num_seqs=8)
    real = engine._next_token

    def faulty(seq, *args):
        if seq.request.id == 1 and len(seq.output) == 3:
            raise RuntimeError("detokenizer exploded")
        return real(seq, *args)

    monkeypatch.setattr(engine, "_next_token", faulty)
    prompts = [[5, 6, 7], [8, 9, 10, 11], [12, 13]]
    out = engine.run_batch(
        prompts, [greedy(8), RequestParams(max_new_tokens=8, n=2, temperature=1.0), greedy(8)]
    )
    assert "exploded" in out[1]["error"] and engine.scheduler.allocator.num_used() == 0
    assert [out[0]["tokens"], out[2]["tokens"]] == [
        alone(tiny64, prompts[0], 8),
        alone(tiny64, prompts[2], 8),
    ]


def test_a_request_with_many_samples_shares_the_slots_fairly(tiny64):
    """n = 8 samples fill all 8 slots; a 2-token request arriving later takes a slot from them at
    its first step instead of waiting for all 8 to end, and neither request's output changes."""
    sampled = dict(max_new_tokens=30, temperature=1.0, top_k=50, seed=11, ignore_eos=True)
    big_prompt, small_prompt = list(range(20, 33)), [5, 6, 7]
    engine = Engine.for_model(
        tiny64, num_blocks=200, block_size=4, max_num_seqs=8, max_num_batched_tokens=64
    )
    big = engine.add_request(big_prompt, RequestParams(n=8, **sampled))
    for _ in range(3):
        engine.step()
    assert len(engine.scheduler.running) == 8
    small = engine.add_request(small_prompt, greedy(2))
    steps, done = 0, {}
    while small not in done:
        done.update((e.request_id, e.request) for e in engine.step() if isinstance(e, Finished))
        steps += 1
    assert steps == 2  # one prefill step (with the first token), one decode step
    assert engine.scheduler.stats["preemptions"] >= 1
    done.update(run_to_end(engine))
    assert done[small].result()["tokens"] == alone(tiny64, small_prompt, 2)
    crowded = done[big].result()["tokens"]
    solo = Engine.for_model(tiny64, num_blocks=200, block_size=4, max_num_seqs=8).run_batch(
        [big_prompt], RequestParams(n=8, **sampled)
    )
    assert crowded == solo[0]["tokens"]
    assert engine.scheduler.allocator.num_used() == 0


def test_fair_share_never_preempts_a_request_down_to_nothing(tiny64):
    """Eight requests of one sample fill 8 slots: none holds more than one slot, so a ninth waits
    for a slot to free instead of preempting anyone."""
    engine = Engine.for_model(tiny64, num_blocks=200, block_size=4, max_num_seqs=8)
    for k in range(8):
        engine.add_request([1 + k, 2, 3], greedy(20))
    engine.step()
    ninth = engine.add_request([7, 8], greedy(3))
    engine.step()
    assert engine.scheduler.stats["preemptions"] == 0 and not any(
        s.request.id == ninth for s in engine.scheduler.running
    )


@pytest.fixture(scope="module")
def with_tokenizer(tmp_path_factory):
    from formats.tokenizer import load_tokenizer

    folder = tiny_checkpoint(tmp_path_factory.mktemp("engine-tok"))
    model, info = weights.load(folder, dtype=torch.float32)
    return model, load_tokenizer(info.source)


def test_streamed_text_is_the_output_text_and_stop_strings_end_it(with_tokenizer):
    """The Token events' text joins to the result's text (one decode, not two), which is the
    output's decode cut before the first stop string; an end token's text is never in it."""
    model, tok = with_tokenizer
    engine = Engine.for_model(
        model, num_blocks=200, block_size=8, tokenizer=tok, stop_ids=tok.stop_ids
    )
    free = engine.run_batch(
        [tok.encode("hello world")], RequestParams(max_new_tokens=40, temperature=0.0)
    )[0]
    stop = free["text"][5:8]
    assert len(stop) == 3, free
    rids = [
        engine.add_request(
            tok.encode("hello world"),
            RequestParams(max_new_tokens=40, temperature=0.0, stop=[stop]),
        ),
        engine.add_request(tok.encode("the quick"), RequestParams(max_new_tokens=30, seed=3, n=2)),
    ]
    texts, results = {}, {}
    while engine.has_unfinished():
        for e in engine.step():
            if isinstance(e, Finished):
                results[e.request_id] = e
            else:
                texts[e.request_id, e.index] = texts.get((e.request_id, e.index), "") + e.text
    cut = results[rids[0]].result
    assert (
        cut["finish_reason"] == "stop" and cut["text"] == free["text"][: free["text"].index(stop)]
    )
    assert texts[rids[0], 0] == cut["text"]
    sampled = results[rids[1]].result
    for k, seq in enumerate(results[rids[1]].request.seqs):
        assert texts[rids[1], k] == sampled["text"][k]
        ids = [t for t in seq.output if t not in tok.stop_ids]
        assert sampled["text"][k] == tok.decode(ids)


def test_abort_and_unknown_ids(tiny64):
    """abort ends a request at once, every sample (forked or not yet) gets an "abort" event and
    the request its Finished at the next step; a second abort does nothing; an id the engine
    does not hold is named in the error."""
    engine = Engine.for_model(tiny64, num_blocks=100, block_size=4)
    rid = engine.add_request(
        list(range(10, 60)), RequestParams(max_new_tokens=5, n=3), request_id="a"
    )
    with pytest.raises(ValueError, match="'b'"):
        engine.abort("b")
    engine.abort(rid)
    engine.abort(rid)
    assert engine.scheduler.allocator.num_used() == 0
    events = engine.step()
    assert sorted((e.index, e.finish_reason) for e in events if not isinstance(e, Finished)) == [
        (0, "abort"),
        (1, "abort"),
        (2, "abort"),
    ]
    assert [e.result["finish_reason"] for e in events if isinstance(e, Finished)] == [["abort"]]
    assert not engine.has_unfinished()
    with pytest.raises(ValueError, match="'a'"):
        engine.abort(rid)


def test_an_engine_built_by_hand(tiny64):
    """Engine(model, cache, Scheduler(allocator)): runs; prompt scoring needs the scheduler's
    scores; a cache and an allocator of different pools are refused."""
    from paged import BlockAllocator, PagedKVCache
    from scheduler import Scheduler

    cache = PagedKVCache.for_model(tiny64, 64, 4)
    engine = Engine(
        tiny64, cache, Scheduler(BlockAllocator(64, 4), max_num_seqs=4, max_num_batched_tokens=32)
    )
    out = engine.run_batch([[5, 6, 7], [8, 9]], greedy(6))
    assert [o["tokens"] for o in out] == [alone(tiny64, [5, 6, 7], 6), alone(tiny64, [8, 9], 6)]
    with pytest.raises(ValueError, match="scores no prompts"):
        engine.add_request([5, 6, 7], RequestParams(max_new_tokens=0, prompt_logprobs=1))
    with pytest.raises(ValueError, match="blocks"):
        Engine(tiny64, cache, Scheduler(BlockAllocator(32, 4)))


def test_a_step_that_raises_loses_no_abort_event(tiny64, monkeypatch):
    """engine_loop aborts everything when a step raises: the abort events queued before the
    failing step still come with the next one, and every block is freed."""
    engine = Engine.for_model(tiny64, num_blocks=100, block_size=4)
    first, second = engine.add_request([5, 6, 7], greedy(9)), engine.add_request([8, 9], greedy(9))
    engine.step()
    engine.abort(first)
    real = engine._forward
    monkeypatch.setattr(
        engine, "_forward", lambda plan: (_ for _ in ()).throw(RuntimeError("a bug in the step"))
    )
    with pytest.raises(RuntimeError, match="a bug"):
        engine.step()
    monkeypatch.setattr(engine, "_forward", real)
    engine.abort(second, error="the engine failed during a step")
    events = engine.step()
    assert sorted(
        (e.request_id, e.finish_reason) for e in events if not isinstance(e, Finished)
    ) == [(first, "abort"), (second, "abort")]
    results = {e.request_id: e.result for e in events if isinstance(e, Finished)}
    assert (
        results[first]["finish_reason"] == "abort"
        and "failed during a step" in results[second]["error"]
    )
    assert engine.scheduler.allocator.num_used() == 0 and not engine.has_unfinished()
