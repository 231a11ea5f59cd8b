"""sampling.py: top-k, top-p and min-p keep exactly the right tokens, logit bias and the penalties
follow their definitions (and transformers' processors), seeds reproduce, temperature 0 is
argmax."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sampling import (
    SamplingParams,
    apply_penalties,
    check_sampling,
    filter_logits,
    parse_logit_bias,
    probabilities,
    sample,
)


def kept(logits, **kw):
    return set(torch.nonzero(torch.isfinite(filter_logits(logits, **kw))).flatten().tolist())


def test_top_k_keeps_the_k_largest():
    logits = torch.tensor([0.1, 3.0, -1.0, 2.0, 0.5])
    assert kept(logits, top_k=1) == {1}
    assert kept(logits, top_k=3) == {1, 3, 4}
    assert kept(logits, top_k=5) == {0, 1, 2, 3, 4}


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([0.05, 0.5, 0.1, 0.3, 0.05])
    logits = probs.log()
    assert kept(logits, top_p=0.5) == {1}  # 0.5 alone reaches 0.5
    assert kept(logits, top_p=0.51) == {1, 3}
    assert kept(logits, top_p=0.79) == {1, 3}  # 0.5 + 0.3 reaches it
    assert kept(logits, top_p=0.85) == {1, 3, 2}
    assert kept(logits, top_p=1.0) == {0, 1, 2, 3, 4}
    assert kept(logits, top_p=1e-6) == {1}  # the most likely token always stays


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(-100, 100), min_size=2, max_size=40, unique=True), st.floats(0.01, 1.0))
def test_top_p_matches_its_definition(values, p):
    """Kept set = tokens whose strictly-more-likely predecessors sum to less than p."""
    logits = torch.tensor(values, dtype=torch.float64) / 10  # distinct logits: no ties to break
    probs = logits.softmax(-1)
    expected = {
        i
        for i in range(len(values))
        if probs[probs > probs[i]].sum() < p or probs[i] == probs.max()
    }
    assert kept(logits, top_p=p) == expected


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(-100, 100), min_size=1, max_size=40, unique=True), st.integers(1, 50))
def test_top_k_matches_its_definition(values, k):
    logits = torch.tensor(values) / 10
    expected = set(sorted(range(len(values)), key=lambda i: -values[i])[:k])
    assert kept(logits, top_k=k) == expected


def test_temperature_zero_is_argmax():
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(0))
    assert torch.equal(sample(logits, SamplingParams(0.0)), logits.argmax(-1))
    assert torch.equal(probabilities(logits, 0.0).argmax(-1), logits.argmax(-1))


def test_seed_makes_sampling_reproducible_and_rows_independent():
    logits = torch.zeros(8, 50)  # uniform: every row free to differ
    params = SamplingParams(1.0)
    a = [sample(logits, params, torch.Generator().manual_seed(7)) for _ in range(2)]
    assert torch.equal(a[0], a[1])
    assert len(set(a[0].tolist())) > 1  # rows are sampled independently
    b = sample(logits, params, torch.Generator().manual_seed(8))
    assert not torch.equal(a[0], b)


def test_sampling_follows_the_filtered_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).expand(20000, 4)
    draws = sample(logits, SamplingParams(1.0, top_k=2), torch.Generator().manual_seed(0))
    assert set(draws.tolist()) == {0, 1}
    frac = (draws == 0).float().mean().item()
    assert abs(frac - torch.tensor([2.0, 1.0]).softmax(0)[0].item()) < 0.02


@pytest.mark.parametrize(
    "temperature, top_k, top_p, message",
    [
        (-0.1, None, 1.0, "temperature"),
        (1.0, 0, 1.0, "top_k"),
        (1.0, None, 0.0, "top_p"),
        (1.0, None, 1.5, "top_p"),
        (float("inf"), None, 1.0, "temperature"),
        (float("nan"), None, 1.0, "temperature"),
        (1.0, None, float("nan"), "top_p"),
    ],
)
def test_bad_sampling_values_are_rejected(temperature, top_k, top_p, message):
    with pytest.raises(ValueError, match=message):
        check_sampling(temperature, top_k, top_p)


# -- min-p, logit bias and the penalties (sampling.py's steps 1-3 and min-p)
# ------------------------


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(-100, 100), min_size=1, max_size=40), st.floats(0.0, 1.0))
def test_min_p_keeps_the_tokens_at_least_min_p_times_the_top_probability(values, min_p):
    logits = torch.tensor(values, dtype=torch.float64) / 10
    probs = logits.softmax(-1)
    expected = {i for i in range(len(values)) if probs[i] >= min_p * probs.max()}
    assert kept(logits, min_p=min_p) == expected


@pytest.mark.parametrize("min_p, temperature", [(0.05, 1.0), (0.1, 0.7), (0.3, 1.5), (1.0, 1.0)])
def test_min_p_matches_transformers_min_p_warper(min_p, temperature):
    from transformers import MinPLogitsWarper, TemperatureLogitsWarper

    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(1)) * 3
    hf = MinPLogitsWarper(min_p)(None, TemperatureLogitsWarper(temperature)(None, logits)).softmax(
        -1
    )
    ours = probabilities(logits, temperature, min_p=min_p)
    assert torch.equal(ours > 0, hf > 0)
    assert torch.allclose(ours, hf, atol=1e-6)


def test_min_p_acts_on_the_tempered_probabilities():
    """p = softmax(logits / T): a higher temperature flattens p, so min_p keeps more tokens."""
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0])
    assert kept(logits, min_p=0.3) == {0, 1}  # exp(-1) = 0.37 >= 0.3 > exp(-2)
    assert set(torch.nonzero(probabilities(logits, 2.0, min_p=0.3)).flatten().tolist()) == {0, 1, 2}


def plain_penalties(logits, prompt, output, repetition=1.0, frequency=0.0, presence=0.0, bias=None):
    """The definitions written out one token at a time, on one row (a list of floats)."""
    out = list(logits)
    for j, b in (bias or {}).items():
        out[j] += min(100.0, max(-100.0, b))
    for j in set(prompt) | set(output):
        out[j] = out[j] / repetition if out[j] > 0 else out[j] * repetition
    for j in set(output):
        out[j] -= frequency * output.count(j) + presence * 1
    return out


@settings(max_examples=100, deadline=None)
@given(
    st.integers(0, 2**31),
    st.floats(0.1, 3.0),
    st.floats(-2, 2),
    st.floats(-2, 2),
    st.dictionaries(st.integers(0, 19), st.floats(-300, 300), max_size=4),
)
def test_penalties_and_bias_match_their_definitions(seed, repetition, frequency, presence, bias):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 20, generator=g, dtype=torch.float64) * 2
    prompts = [torch.randint(0, 20, (n,), generator=g).tolist() for n in (0, 5, 9)]
    outputs = [torch.randint(0, 20, (n,), generator=g).tolist() for n in (4, 0, 12)]
    params = SamplingParams(
        1.0,
        repetition_penalty=repetition,
        frequency_penalty=frequency,
        presence_penalty=presence,
        logit_bias=bias,
    )
    got = apply_penalties(logits, params, prompts, outputs)
    for row in range(3):
        expected = plain_penalties(
            logits[row].tolist(), prompts[row], outputs[row], repetition, frequency, presence, bias
        )
        assert torch.allclose(got[row], torch.tensor(expected, dtype=torch.float64), atol=1e-9)


@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
def test_repetition_penalty_matches_transformers_processor(penalty):
    """HF's processor sees one id sequence, prompt and output together: so does our penalty."""
    from transformers import RepetitionPenaltyLogitsProcessor

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 50, generator=g)
    prompt, output = (
        torch.randint(0, 50, (2, 7), generator=g),
        torch.randint(0, 50, (2, 5), generator=g),
    )
    hf = RepetitionPenaltyLogitsProcessor(penalty)(torch.cat([prompt, output], 1), logits.clone())
    ours = apply_penalties(logits, SamplingParams(1.0, repetition_penalty=penalty), prompt, output)
    assert torch.equal(ours, hf)


def test_frequency_and_presence_count_only_generated_tokens():
    logits = torch.zeros(1, 6)
    params = SamplingParams(1.0, frequency_penalty=0.5, presence_penalty=1.0)
    got = apply_penalties(
        logits, params, prompt_tokens=[[0, 0, 0, 1]], output_tokens=[[1, 2, 2, 2]]
    )
    # token 0: prompt only, untouched; 1: once (0.5 + 1); 2: three times (1.5 + 1); 3..5: never
    assert got[0].tolist() == [0.0, -1.5, -2.5, 0.0, 0.0, 0.0]


def test_logit_bias_is_clamped_to_100_and_accepts_json_string_keys():
    params = SamplingParams(1.0, logit_bias={"3": 500, 4: -1e9, "5": 2.5, 0: 10**400})
    assert params.logit_bias == {3: 100.0, 4: -100.0, 5: 2.5, 0: 100.0}
    got = apply_penalties(torch.ones(2, 6), params, None, None)
    assert got.tolist() == [[101.0, 1.0, 1.0, 101.0, -99.0, 3.5]] * 2


def test_bias_comes_before_the_repetition_penalty_and_greedy_is_the_argmax_after_them():
    logits = torch.tensor([[4.0, 3.0, -1.0]])
    params = SamplingParams(0.0, repetition_penalty=2.0, logit_bias={2: 3.0})
    assert apply_penalties(logits, params, [[0]], [[2]]).tolist() == [
        [2.0, 3.0, 1.0]
    ]  # (-1 + 3) / 2 = 1
    assert sample(logits, params, None, [[0]], [[2]]).tolist() == [
        1
    ]  # token 0, seen, fell below token 1
    forced = SamplingParams(0.7, top_k=1, logit_bias={2: 100})
    assert sample(logits, forced, torch.Generator().manual_seed(0)).tolist() == [2]


def test_penalties_return_a_new_tensor_and_accept_tensor_or_ragged_rows():
    logits = torch.randn(2, 30, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    params = SamplingParams(1.0, repetition_penalty=1.5, frequency_penalty=0.3, logit_bias={1: 2.0})
    as_tensor = apply_penalties(
        logits, params, torch.tensor([[1, 2], [3, 4]]), torch.tensor([[5, 5, 6], [7, 8, 9]])
    )
    as_lists = apply_penalties(
        logits, params, [[1, 2], [3, 4]], [torch.tensor([5, 5, 6]), [7, 8, 9]]
    )
    assert torch.equal(as_tensor, as_lists) and torch.equal(logits, before)
    with pytest.raises(ValueError, match="output_tokens"):
        apply_penalties(logits, params)


def test_all_controls_off_adjust_nothing():
    off = SamplingParams(1.0)
    assert not off.adjusts_logits and not off.needs_history
    assert (
        SamplingParams(1.0, logit_bias={1: 1}).adjusts_logits
        and not SamplingParams(1.0, logit_bias={1: 1}).needs_history
    )
    assert SamplingParams(1.0, presence_penalty=0.1).needs_history


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("min_p", -0.1, r"min_p must be in \[0, 1\]"),
        ("min_p", 1.5, r"min_p must be in \[0, 1\]"),
        ("min_p", float("nan"), "min_p"),
        ("repetition_penalty", 0.0, "repetition_penalty must be in \\[0.001, 1000\\]"),
        ("repetition_penalty", -1.0, "repetition_penalty"),
        ("repetition_penalty", float("inf"), "repetition_penalty"),
        ("frequency_penalty", 2.5, r"frequency_penalty must be in \[-2, 2\]"),
        ("presence_penalty", -2.1, r"presence_penalty must be in \[-2, 2\]"),
        ("presence_penalty", "1", "presence_penalty"),
        ("logit_bias", {"x": 1}, "logit_bias keys must be token ids"),
        ("logit_bias", {-1: 1}, "logit_bias keys"),
        ("logit_bias", {True: 1}, "logit_bias keys"),
        ("logit_bias", {1: float("nan")}, "logit_bias values"),
        ("logit_bias", {1: "high"}, "logit_bias values"),
        ("logit_bias", [1, 2], "logit_bias must be an object"),
    ],
)
def test_bad_control_values_are_rejected_naming_the_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(1.0, **{field: value})


def test_logit_bias_ids_are_checked_against_the_vocabulary():
    assert parse_logit_bias({"9": 1}, vocab_size=10) == {9: 1.0}
    with pytest.raises(
        ValueError, match=r"logit_bias keys must be token ids in \[0, 10\), got '10'"
    ):
        parse_logit_bias({"10": 1}, vocab_size=10)
