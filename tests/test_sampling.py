"""sampling.py: top-k and top-p keep exactly the right tokens, seeds reproduce, temperature 0 is argmax."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sampling import SamplingParams, check_sampling, filter_logits, probabilities, sample


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
    expected = {i for i in range(len(values)) if probs[probs > probs[i]].sum() < p or probs[i] == probs.max()}
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


@pytest.mark.parametrize("temperature, top_k, top_p, message", [
    (-0.1, None, 1.0, "temperature"), (1.0, 0, 1.0, "top_k"), (1.0, None, 0.0, "top_p"), (1.0, None, 1.5, "top_p"),
])
def test_bad_sampling_values_are_rejected(temperature, top_k, top_p, message):
    with pytest.raises(ValueError, match=message):
        check_sampling(temperature, top_k, top_p)
