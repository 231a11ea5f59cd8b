"""Speculation inside continuous batching (speedups/prompt_lookup.py drafts, engine.py verifies them
in the step's one forward): greedy, every request's tokens equal the plain engine's (float64: a
mismatch is a bug, never a near-tie) with mixed lengths, n = 2, preemption, prefix hits, stop
strings and a JSON-schema constraint; sampling, the speculative engine's token distribution equals
the plain one's (a chi-square test, with temperature, top-k and a repetition penalty); blocks hold
only kept tokens' K/V when they enter the prefix cache, and blocks taken for rejected drafts are
free at the end of the step."""

import copy
import json
import random
from collections import Counter

import jsonschema
import pytest
import torch
from helpers import check_allocator, tiny_checkpoint

from constrain import Constraint
from engine import Engine, Finished, RequestParams
from formats import weights
from formats.tokenizer import load_tokenizer
from scheduler import blocks_for
from speedups.draft_model import DraftModel
from speedups.prompt_lookup import PromptLookup, find_draft


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tiny_checkpoint(tmp_path_factory.mktemp("spec-tiny"), max_position_embeddings=1024)
    model, info = weights.load(folder, dtype=torch.float64)
    return model, load_tokenizer(info.source)


class Oracle:
    """Drafts the test controls: the plain engine's next tokens for the request, each replaced by
    a wrong one with probability `wrong` (so drafts are kept whole, in part and not at all)."""

    def __init__(self, plain: dict, k: int, wrong: float, seed: int = 0):
        self.plain, self.k, self.wrong, self.rng, self.rejected = (
            plain,
            k,
            wrong,
            random.Random(seed),
            [],
        )

    def propose(self, seqs, max_model_len):
        for s in seqs:
            s.draft = []
            if len(s.tokens) - s.num_computed == 1:
                truth = self.plain[tuple(s.request.prompt)][len(s.output) :][: self.k]
                s.draft = [
                    t if self.rng.random() > self.wrong else 3 + (t + 1) % 250 for t in truth
                ]
                if s.draft != truth:
                    self.rejected.append(
                        s.tokens + s.draft
                    )  # a sequence that must never be hit as cached


def workload(seed=0):
    """Prompts that repeat themselves (so prompt lookup finds matches), of mixed lengths, two of
    them sharing request 0's head (prefix hits), one asking for n = 2."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(10):
        pattern = [rng.randrange(3, 250) for _ in range(rng.randint(2, 9))]
        prompts.append((pattern * 12)[: rng.randint(3, 70)])
    prompts += [prompts[0][:20] + [7, 7, 7], prompts[0][:24] + [9]]
    params = [
        RequestParams(max_new_tokens=rng.randint(1, 40), temperature=0.0, ignore_eos=True)
        for _ in prompts
    ]
    params[3].n = 2
    return prompts, params


def run(model, prompts, params, speculate=None, num_blocks=300, max_num_seqs=8, tokenizer=None):
    """Each request's result, after stepping an engine to the end while checking, after every step,
    that no sequence keeps blocks past its next token and that the pools stay consistent."""
    engine = Engine.for_model(
        model,
        num_blocks=num_blocks,
        block_size=4,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=64,
        speculate=speculate,
        tokenizer=tokenizer,
        stop_ids=tokenizer.stop_ids if tokenizer else (),
    )
    ids, results = [engine.add_request(p, q) for p, q in zip(prompts, params)], {}
    while engine.has_unfinished():
        results.update((e.request_id, e.result) for e in engine.step() if isinstance(e, Finished))
        for s in engine.scheduler.running:
            assert len(s.blocks) <= blocks_for(s.num_computed + 1, 4), (
                "blocks of rejected drafts were kept"
            )
        check_allocator(engine.scheduler.allocator)
    assert engine.metrics()["kv_blocks_used"] == 0
    return [results[i] for i in ids], engine.metrics()


def noisy_copy(model, scale: float, seed: int = 0):
    """A draft for `model`: its copy with every weight moved by noise (so it agrees with it often,
    not always)."""
    draft, g = copy.deepcopy(model), torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return draft


@pytest.fixture(scope="module")
def draft(tiny):
    return noisy_copy(tiny[0], 0.01)


def proposer(name, plain, draft, model, num_blocks):
    if name == "lookup":
        return PromptLookup(k=4, min_n=1, max_n=3)
    if name == "oracle":
        return Oracle(plain, 5, wrong=0.3)
    return DraftModel(draft, model, k=4, num_blocks=num_blocks, block_size=4)


@pytest.fixture(scope="module")
def plain(tiny):
    prompts, params = workload()
    results, _ = run(tiny[0], prompts, params)
    return {
        tuple(p): r["tokens"][0] if q.n > 1 else r["tokens"]
        for p, q, r in zip(prompts, params, results)
    }


@pytest.mark.parametrize("name", ["lookup", "oracle", "draft"])
@pytest.mark.parametrize("num_blocks", [300, 26], ids=["roomy", "tight"])
def test_greedy_tokens_equal_the_plain_engine(tiny, plain, draft, name, num_blocks):
    prompts, params = workload()
    speculate = proposer(name, plain, draft, tiny[0], num_blocks)
    results, m = run(tiny[0], prompts, params, speculate, num_blocks)
    for p, q, r in zip(prompts, params, results):
        assert r["tokens"] == ([plain[tuple(p)]] * q.n if q.n > 1 else plain[tuple(p)]), (
            f"prompt {p}"
        )
    assert 0 < m["draft_tokens_accepted"] < m["draft_tokens"], m
    assert m["prompt_tokens_hit"] > 0, m
    if num_blocks == 26:
        assert m["preemptions"] > 0, m


def test_rejected_drafts_never_reach_the_prefix_cache(tiny, plain):
    """Requests whose prompts are a rejected draft's sequence, run after the drafting ones in the
    same engine, get the plain engine's tokens: a cached block never holds a rejected token."""
    model = tiny[0]
    prompts, params = workload()
    oracle = Oracle(plain, 6, wrong=0.5, seed=1)
    engine = Engine.for_model(
        model, num_blocks=400, block_size=4, max_num_batched_tokens=64, speculate=oracle
    )
    engine.run_batch(prompts, params)
    assert len(oracle.rejected) > 5
    probes = [list(t) for t in {tuple(t) for t in oracle.rejected}][:12]
    oracle.plain = {tuple(p): [] for p in probes}  # (the probes draft nothing)
    news = [RequestParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)] * len(probes)
    hits_before = engine.metrics()["prompt_tokens_hit"]
    got = [r["tokens"] for r in engine.run_batch(probes, news)]
    assert engine.metrics()["prompt_tokens_hit"] > hits_before  # they did share cached blocks
    alone, _ = run(model, probes, news)
    assert got == [r["tokens"] for r in alone]


def test_stop_strings_and_a_json_constraint_cut_where_plain_decoding_does(tiny):
    model, tok = tiny
    schema = {
        "type": "object",
        "properties": {"a": {"type": "string", "maxLength": 6}},
        "required": ["a"],
        "additionalProperties": False,
    }
    head = tok.encode("the quick brown fox jumps over the lazy dog, the quick brown fox jumps")
    free = run(model, [head], [RequestParams(max_new_tokens=40, temperature=0.0)], tokenizer=tok)[
        0
    ][0]
    stop = free["text"][6:9]
    prompts = [head, head[:9], tok.encode('{"a": "fox"} {"a": "dog"} {"a": "')]
    params = [
        RequestParams(max_new_tokens=40, temperature=0.0, stop=[stop]),
        RequestParams(max_new_tokens=30, temperature=0.0, n=2),
        RequestParams(
            max_new_tokens=60, temperature=0.0, constraint=Constraint("json_schema", schema)
        ),
    ]
    want, _ = run(model, prompts, params, tokenizer=tok)
    got, m = run(model, prompts, params, PromptLookup(k=5), tokenizer=tok)
    untimed = lambda results: [
        {k: v for k, v in r.items() if k != "time_to_first_token_s"} for r in results
    ]
    assert untimed(got) == untimed(want)
    assert got[0]["finish_reason"] == "stop" and stop not in got[0]["text"]
    jsonschema.validate(json.loads(got[2]["text"]), schema)
    assert m["draft_tokens_accepted"] > 0, m


def test_find_draft_takes_the_longest_match_and_its_latest_occurrence():
    tokens = [1, 2, 3, 9, 5, 2, 3, 8, 1, 2, 3, 7, 4, 2, 3]
    assert find_draft(tokens, 2, 1, 3) == [7, 4]  # "2 3": its latest occurrence
    assert find_draft([1, 2, 3, 9, 5, 2, 3, 8, 1, 2, 3], 2, 1, 3) == [
        9,
        5,
    ]  # "1 2 3" beats the later "2 3"
    assert find_draft([5, 6, 7], 3, 1, 3) == [] and find_draft([5, 6, 5], 3, 2, 3) == []
    assert find_draft([4, 4, 4, 4], 5, 1, 2) == [4]  # what follows, however little


@pytest.mark.parametrize("k", [0, 17, "4"])
def test_speculate_k_outside_1_to_16_is_refused(k):
    with pytest.raises(ValueError, match="1..16"):
        PromptLookup(k=k)


def chi_square_p(a: Counter, b: Counter) -> float:
    """Two equal-sized samples over the same categories: the p-value of their being one
    distribution."""
    cells = [(a[c], b[c]) for c in set(a) | set(b)]
    stat = sum((x - y) ** 2 / (x + y) for x, y in cells)
    return float(
        torch.special.gammaincc(torch.tensor((len(cells) - 1) / 2.0), torch.tensor(stat / 2.0))
    )


class Resampler:
    """A draft model's stand-in: drafts drawn from the plain engine's own outputs (`want`, those
    that begin with the sequence's output so far), with a random stream of its own."""

    def __init__(self, want: Counter, k: int, seed=0):
        self.outputs, self.k, self.rng = list(want.elements()), k, random.Random(seed)

    def propose(self, seqs, max_model_len):
        for s in seqs:
            out, s.draft = s.output, []
            fits = (
                [t for t in self.outputs if list(t[: len(out)]) == out]
                if len(s.tokens) - s.num_computed == 1
                else []
            )
            s.draft = list(self.rng.choice(fits)[len(out) :][: self.k]) if fits else []


# The tiny model continues this prompt's run of 231s about half the time, so prompt lookup's drafts
# are kept in part (found by appending the plain engine's likeliest 3 tokens to [11, 12, 13, ...]
# six times).
QUOTING = [
    11,
    12,
    13,
    11,
    12,
    13,
    11,
    12,
    2,
    131,
    182,
    224,
    155,
    27,
    40,
    134,
    57,
    27,
    188,
    85,
    126,
    202,
    253,
    231,
    231,
    231,
]


@pytest.mark.parametrize("proposer", ["lookup", "draft", "resampler"])
def test_sampled_tokens_have_the_plain_distribution(tiny, proposer):
    """The first three output tokens, sampled (temperature 0.9, top-k 3, repetition penalty 1.3)
    1,000 times by each engine: their joint distributions agree (chi-square, p > 0.001)."""
    model, count = tiny[0], 1000

    def outputs(speculate, seed0):
        params = [
            RequestParams(
                max_new_tokens=3,
                temperature=0.9,
                top_k=3,
                repetition_penalty=1.3,
                seed=seed0 + i,
                ignore_eos=True,
            )
            for i in range(count)
        ]
        engine = Engine.for_model(
            model, num_blocks=800, block_size=4, max_num_seqs=64, speculate=speculate
        )
        # in waves of 64, each run to the end: drafts take only the budget prompts leave, so none
        # wait
        results = [
            r
            for i in range(0, count, 64)
            for r in engine.run_batch([QUOTING] * len(params[i : i + 64]), params[i : i + 64])
        ]
        return Counter(tuple(r["tokens"]) for r in results), engine.metrics()

    want, _ = outputs(None, 0)
    speculate = {
        "lookup": lambda: PromptLookup(k=3, max_rows=64),
        "resampler": lambda: Resampler(want, 3),
        "draft": lambda: DraftModel(
            noisy_copy(model, 0.02), model, k=3, num_blocks=800, block_size=4, max_rows=64
        ),
    }[proposer]()  # (often rejected: the residual draws count)
    got, m = outputs(speculate, 10_000)
    assert 0.1 * m["draft_tokens"] < m["draft_tokens_accepted"] < m["draft_tokens"], m
    p = chi_square_p(want, got)
    assert p > 1e-3, (p, want.most_common(8), got.most_common(8))


def test_compiled_verify_steps_equal_eager_within_few_graphs(tiny):
    """--compile: steps whose rows all decode or verify drafts run compiled, each row padded to 1 +
    k tokens and the rows to a bucket: the plain eager engine's tokens, from a bounded set of
    graphs."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    rng, model = random.Random(3), tiny[0]
    prompts = [[rng.randrange(3, 250) for _ in range(12)] for _ in range(3)]
    params = [RequestParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)] * 3
    want = Engine.for_model(model, num_blocks=30, block_size=16).run_batch(prompts, params)
    oracle = Oracle({tuple(p): r["tokens"] for p, r in zip(prompts, want)}, 3, wrong=0.3)
    engine = Engine.for_model(model, num_blocks=30, block_size=16, compile=True, speculate=oracle)
    shapes, decode_fn = [], engine.decode_fn
    engine.decode_fn = lambda *a: (
        shapes.append([g[:2] for g in engine.cache.groups]) or decode_fn(*a)
    )
    got = engine.run_batch(prompts, params)
    assert [r["tokens"] for r in got] == [r["tokens"] for r in want]
    assert any(n == 4 for step in shapes for _, n in step), (
        shapes
    )  # verify steps ran compiled, 1 + k wide
    assert 0 < engine.metrics()["draft_tokens_accepted"] < engine.metrics()["draft_tokens"]
    assert counters["stats"]["unique_graphs"] <= 2 * 3 * 2, (
        shapes
    )  # {1, 1 + k} tokens x rows 1..3 x widths 1, 2


def test_a_draft_model_catches_up_a_long_prompt_in_pieces(tiny, plain, draft):
    """With pieces of 8 tokens (512 by default) the prompts of up to 70 tokens take several
    catch-up forwards: the tokens are still the plain engine's, and drafts are kept."""
    prompts, params = workload()
    drafter = DraftModel(draft, tiny[0], k=4, num_blocks=300, block_size=4)
    drafter.catch_up, sizes, forward = 8, [], drafter._forward
    drafter._forward = lambda tokens, *a: sizes.append(len(tokens)) or forward(tokens, *a)
    results, m = run(tiny[0], prompts, params, drafter)
    for p, q, r in zip(prompts, params, results):
        assert r["tokens"] == ([plain[tuple(p)]] * q.n if q.n > 1 else plain[tuple(p)]), (
            f"prompt {p}"
        )
    assert m["draft_tokens_accepted"] > 0 and 8 in sizes


def test_a_draft_model_with_another_vocabulary_is_refused(tiny, tmp_path):
    other, _ = weights.load(tiny_checkpoint(tmp_path, vocab_size=400), dtype=torch.float64)
    with pytest.raises(
        ValueError, match=f"400 tokens and the target's {tiny[0].config.vocab_size}"
    ):
        DraftModel(other, tiny[0])


def test_a_draft_model_failing_mid_run_ends_speculation_not_the_requests(tiny, plain, draft):
    """Its ninth forward raises: one warning, no more drafts, and every request's plain tokens."""
    prompts, params = workload()
    drafter, calls = DraftModel(draft, tiny[0], k=4, num_blocks=300, block_size=4), []
    forward = drafter._forward

    def failing(*args):
        calls.append(1)
        if len(calls) == 9:  # (the third step that drafts: 4 forwards each)
            raise RuntimeError("out of memory (a test's)")
        return forward(*args)

    drafter._forward = failing
    with pytest.warns(UserWarning, match="draft model failed .*out of memory.*speculation is off"):
        results, m = run(tiny[0], prompts, params, drafter)
    for p, q, r in zip(prompts, params, results):
        assert r["tokens"] == ([plain[tuple(p)]] * q.n if q.n > 1 else plain[tuple(p)]), (
            f"prompt {p}"
        )
    assert len(calls) == 9 and m["draft_tokens"] > 0 and not drafter.held


def test_batch_py_speculates_with_a_draft_checkpoint_and_refuses_another_vocabulary(
    tmp_path, capsys
):
    """batch.py --speculate draft: the same lines as without (its own checkpoint as the draft); a
    draft whose vocabulary differs is refused before any request runs, naming both sizes."""
    import batch

    target, other = tiny_checkpoint(tmp_path / "t"), tiny_checkpoint(tmp_path / "o", vocab_size=400)
    lines = [
        {
            "id": i,
            "prompt": "the quick brown fox jumps over the lazy dog " * (i + 1),
            "max_new_tokens": 12,
            "temperature": 0,
        }
        for i in range(3)
    ]
    path = tmp_path / "requests.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    base = [
        "--requests",
        str(path),
        "--checkpoint",
        str(target),
        "--dtype",
        "float32",
        "--num_blocks",
        "64",
    ]
    outputs = []
    for extra in (
        [],
        ["--speculate", "draft", "--draft_checkpoint", str(target), "--speculate_k", "3"],
    ):
        assert batch.main(base + extra) == 0
        outputs.append(sorted(capsys.readouterr().out.splitlines()))
    clean = lambda out: [
        {k: v for k, v in json.loads(o).items() if k not in ("time_to_first_token_s",)} for o in out
    ]
    assert clean(outputs[1]) == clean(outputs[0])
    assert batch.main(base + ["--speculate", "draft", "--draft_checkpoint", str(other)]) == 2
    err = capsys.readouterr().err
    assert "400 tokens" in err and "target's" in err, err


class Recorded(DraftModel):
    """A DraftModel noting every draft it makes, by request, sample and length, and where each
    sequence's first catch-up began; `fresh`: one that recomputes all of its K/V every step, each
    row in 32 blocks of its own (none of the target's ids)."""

    def __init__(self, draft, target, fresh=False, num_blocks=300, **kw):
        super().__init__(draft, target, num_blocks=32 * 17 if fresh else num_blocks, **kw)
        self.fresh, self.drafts, self.first = fresh, {}, {}

    def _valid(self, s):
        start = 0 if self.fresh else super()._valid(s)
        self.first.setdefault(s, start)
        return start

    def _ids(self, s, row):
        return (
            [1 + 32 * row + j for j in range(blocks_for(len(s.tokens) + self.k - 1, 4))]
            if self.fresh
            else super()._ids(s, row)
        )

    def propose(self, seqs, max_model_len):
        super().propose(seqs, max_model_len)
        self.drafts.update(
            ((s.request.id, s.index, len(s.tokens)), s.draft) for s in seqs if s.draft
        )


@pytest.mark.parametrize("num_blocks", [300, 26], ids=["roomy", "tight"])
def test_a_draft_model_keeps_its_kv_in_the_target_blocks_and_trusts_only_what_it_wrote(
    tiny, draft, num_blocks
):
    """The draft's K/V sits in the target's blocks: kept from step to step and found again through
    the target's prefix cache (a request sharing request 0's head starts its catch-up past it), and
    never trusted in a block the target has given to other tokens (the tight pool preempts and
    evicts) or shares (three sampled twins fork mid-block). Every draft equals the one a draft
    recomputing all its K/V at every step makes."""
    prompts, params = workload()
    prompts[10] = prompts[0][:40] + [7, 7, 7]
    twins = RequestParams(max_new_tokens=30, temperature=1.0, n=3, seed=5, ignore_eos=True)
    waves = [
        (prompts[:10], params[:10]),
        (prompts[10:], params[10:]),
        ([prompts[3]], [twins]),
    ]  # 45 tokens: mid-block
    runs = []
    for fresh in (True, False):
        drafter = Recorded(draft, tiny[0], k=4, num_blocks=num_blocks, block_size=4, fresh=fresh)
        engine = Engine.for_model(
            tiny[0],
            num_blocks=num_blocks,
            block_size=4,
            max_num_seqs=8,
            max_num_batched_tokens=64,
            speculate=drafter,
        )
        for wave in waves:  # each after the one before has finished (request 0 is cached)
            ids = [engine.add_request(p, q) for p, q in zip(*wave)]
            while engine.has_unfinished():
                engine.step()
            if len(wave[0]) == 2 and num_blocks == 300:
                assert (
                    drafter.first[next(s for s in drafter.first if s.request.id == ids[0])] >= 40
                    or fresh
                )
        runs.append(drafter)
    fresh, kept = runs
    assert len(kept.drafts) > 50 and kept.drafts == fresh.drafts
    assert engine.metrics()["preemptions" if num_blocks == 26 else "prompt_tokens_hit"] > 0
