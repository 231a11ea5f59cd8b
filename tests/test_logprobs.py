"""Log-probabilities from the engine (engine.py) against their definition: log_softmax of one
plain forward over the whole text (no cache), in float64, at every prompt and output position,
with the true top-k; the same whether prompts are chunked, preempted, batched, or share a
cached prefix with an earlier request."""

import random

import pytest
import torch
from helpers import run_to_end, tiny_checkpoint

from engine import Engine, RequestParams
from formats import weights
from kv_cache import NoCache
from scoring import token_logprobs


@pytest.fixture(scope="module")
def tiny64(tmp_path_factory):
    folder = tiny_checkpoint(tmp_path_factory.mktemp("logprob-tiny"), max_position_embeddings=512)
    model, _ = weights.load(folder, dtype=torch.float64)
    return model


def reference(model, ids):
    """log_softmax [len(ids), V] of a forward over ids without any cache: row p predicts ids[p +
    1]."""
    with torch.no_grad():
        return model(torch.tensor([ids]), torch.arange(len(ids))[None], NoCache())[0].log_softmax(
            -1
        )


def assert_entries(entries, logp, ids, k):
    """entries[i] scores ids[i + 1] from logp[i]: its log-probability and the true top-k."""
    assert len(entries) == len(ids) - 1
    for p, (lp, top) in enumerate(entries):
        assert lp == pytest.approx(logp[p, ids[p + 1]].item(), abs=1e-9)
        values, order = logp[p].topk(k)
        assert [t for t, _ in top] == order.tolist()
        assert [v for _, v in top] == pytest.approx(values.tolist(), abs=1e-9)


def run(engine, prompts, params):
    ids = [engine.add_request(p, params) for p in prompts]
    done = run_to_end(engine)
    return [done[i] for i in ids]


def test_token_logprobs_is_log_softmax_and_topk():
    logits = torch.randn(3, 50, dtype=torch.float64)
    entries = token_logprobs(logits, [4, 0, 49], [2, 0, 5])
    logp = logits.log_softmax(-1)
    assert [e[0] for e in entries] == pytest.approx(
        [logp[0, 4].item(), logp[1, 0].item(), logp[2, 49].item()]
    )
    assert [len(e[1]) for e in entries] == [2, 0, 5]
    assert [t for t, _ in entries[2][1]] == logp[2].topk(5).indices.tolist()


@pytest.mark.parametrize("max_batched", [512, 16])  # whole prompts, or chunks of 16 tokens
def test_prompt_and_output_logprobs_equal_a_plain_forward(tiny64, max_batched):
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 250) for _ in range(n)] for n in (1, 7, 40, 90)]
    engine = Engine.for_model(
        tiny64, num_blocks=200, block_size=4, max_num_seqs=8, max_num_batched_tokens=max_batched
    )
    params = RequestParams(
        max_new_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3, prompt_logprobs=5
    )
    for prompt, req in zip(prompts, run(engine, prompts, params)):
        seq = req.seqs[0]
        logp = reference(tiny64, seq.tokens)
        assert req.prompt_logprobs[0] is None
        assert_entries(req.prompt_logprobs[1:], logp, prompt, 5)
        out = [(lp, top) for lp, top in seq.logprobs]
        assert_entries(out, logp[len(prompt) - 1 :], seq.tokens[len(prompt) - 1 :], 3)
    assert engine.scheduler.allocator.num_used() == 0


def test_batched_prompts_equal_one_at_a_time_and_zero_new_tokens(tiny64):
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 250) for _ in range(rng.randint(2, 60))] for _ in range(6)]
    params = RequestParams(max_new_tokens=0, prompt_logprobs=1)
    together = run(
        Engine.for_model(
            tiny64, num_blocks=200, block_size=4, max_num_seqs=8, max_num_batched_tokens=48
        ),
        prompts,
        params,
    )
    for prompt, req in zip(prompts, together):
        alone = run(Engine.for_model(tiny64, num_blocks=200, block_size=4), [prompt], params)[0]
        assert [s.output for s in req.seqs] == [[]] and req.seqs[0].finish_reason == "length"
        assert len(req.prompt_logprobs) == len(prompt)
        for a, b in zip(req.prompt_logprobs[1:], alone.prompt_logprobs[1:]):
            assert a[0] == pytest.approx(b[0], abs=1e-9) and [t for t, _ in a[1]] == [
                t for t, _ in b[1]
            ]


def test_scores_come_from_the_prefix_cache_only_where_cached_and_survive_preemption(tiny64):
    """A prompt whose prefix blocks were scored before reuses their KV and scores (a multiple-
    choice question's answers share the question); blocks cached without scores, or with fewer
    alternatives than asked, are computed again. A pool so small that requests are preempted
    still scores each token once."""
    rng = random.Random(2)
    head = [rng.randrange(3, 250) for _ in range(32)]
    engine = Engine.for_model(tiny64, num_blocks=200, block_size=4)
    plain = run(engine, [head + [5]], RequestParams(max_new_tokens=2, temperature=0.0))[0]
    first = run(engine, [head + [6, 7]], RequestParams(max_new_tokens=0, prompt_logprobs=2))[0]
    second = run(engine, [head + [8, 9, 10]], RequestParams(max_new_tokens=0, prompt_logprobs=1))[0]
    more = run(engine, [head + [11]], RequestParams(max_new_tokens=0, prompt_logprobs=3))[0]
    assert (
        plain.prompt_tokens_hit == 0 and first.prompt_tokens_hit == 0
    )  # cached KV, but no scores yet
    assert (
        second.prompt_tokens_hit == 31 and more.prompt_tokens_hit == 0
    )  # position 31 is recomputed
    for req, k in ((first, 2), (second, 1), (more, 3)):
        assert_entries(req.prompt_logprobs[1:], reference(tiny64, req.prompt), req.prompt, k)


def test_scores_survive_preemption(tiny64):
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 250) for _ in range(30)] for _ in range(5)]
    small = Engine.for_model(
        tiny64, num_blocks=30, block_size=4, max_num_seqs=8, max_num_batched_tokens=24
    )
    params = RequestParams(
        max_new_tokens=20, temperature=0.0, ignore_eos=True, logprobs=1, prompt_logprobs=1
    )
    for prompt, req in zip(prompts, run(small, prompts, params)):
        logp = reference(tiny64, req.seqs[0].tokens)
        assert_entries(req.prompt_logprobs[1:], logp, prompt, 1)
        assert_entries(
            req.seqs[0].logprobs, logp[len(prompt) - 1 :], req.seqs[0].tokens[len(prompt) - 1 :], 1
        )
    assert small.scheduler.stats["preemptions"] > 0


def test_sampled_tokens_report_the_models_logprobs_not_the_tempered_ones(tiny64):
    """temperature and top-k change what is sampled, not the log-probabilities reported."""
    prompt = [10, 20, 30]
    params = RequestParams(
        max_new_tokens=8, temperature=1.7, top_k=3, seed=5, ignore_eos=True, logprobs=2, n=2
    )
    req = run(Engine.for_model(tiny64, num_blocks=100, block_size=4), [prompt], params)[0]
    for seq in req.seqs:
        logp = reference(tiny64, seq.tokens)
        assert_entries(seq.logprobs, logp[len(prompt) - 1 :], seq.tokens[len(prompt) - 1 :], 2)


def test_bad_logprob_counts_are_refused(tiny64):
    engine = Engine.for_model(tiny64, num_blocks=100, block_size=4)
    for bad in (
        dict(logprobs=21),
        dict(logprobs=-1),
        dict(prompt_logprobs=True),
        dict(max_new_tokens=0),
    ):
        with pytest.raises(ValueError, match="logprobs|max_new_tokens"):
            engine.add_request([1, 2], RequestParams(**bad))
    assert not engine.has_unfinished()


def test_a_long_echo_never_holds_prompt_by_vocab_logits(tmp_path, monkeypatch):
    """A 1,500-token prompt scored with 256 tokens per step: every step's logits have at most 256
    rows (never [prompt_len, vocab]), and every score equals the plain forward's."""
    import engine as engine_module

    rows = []

    def recording(model, cache, tokens, input_pos, keep=None):
        out = flat_forward(model, cache, tokens, input_pos, keep)
        rows.append(out.shape[0])
        return out

    flat_forward = engine_module.flat_forward
    monkeypatch.setattr(engine_module, "flat_forward", recording)
    model, _ = weights.load(
        tiny_checkpoint(tmp_path, max_position_embeddings=2048), dtype=torch.float64
    )
    rng = random.Random(4)
    prompt = [rng.randrange(3, 250) for _ in range(1500)]
    engine = Engine.for_model(
        model, num_blocks=500, block_size=8, max_num_seqs=8, max_num_batched_tokens=256
    )
    req = run(engine, [prompt], RequestParams(max_new_tokens=0, prompt_logprobs=2))[0]
    assert max(rows) <= 256 and len(rows) >= 1500 // 256
    assert_entries(req.prompt_logprobs[1:], reference(model, prompt), prompt, 2)


def test_answers_sent_together_compute_their_question_once(tiny64):
    """Four prompts sharing a 40-token question, queued at once: the first is scored while the
    others wait for its blocks, which they then reuse (KV and scores); every score is right."""
    rng = random.Random(5)
    question = [rng.randrange(3, 250) for _ in range(40)]
    prompts = [
        question + [rng.randrange(3, 250) for _ in range(rng.randint(1, 4))] for _ in range(4)
    ]
    engine = Engine.for_model(tiny64, num_blocks=200, block_size=4)
    reqs = run(engine, prompts, RequestParams(max_new_tokens=1, temperature=0.0, prompt_logprobs=1))
    assert [r.prompt_tokens_hit for r in reqs] == [
        0,
        39,
        39,
        39,
    ]  # 10 blocks, less the recomputed last position
    for prompt, req in zip(prompts, reqs):
        assert_entries(req.prompt_logprobs[1:], reference(tiny64, prompt), prompt, 1)
