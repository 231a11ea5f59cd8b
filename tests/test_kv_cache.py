"""kv_cache.py: attending over the prefix of the slots in use gives the logits of attending over the
whole cache; compiled steps keep one graph per attend length and pick the right one mid-loop."""

import pytest
import torch
from helpers import tiny_checkpoint

import compiling
import generate
from formats import weights
from kv_cache import StaticKVCache, attend_len_for
from sampling import SamplingParams
from speedups.kv_int8 import Int8KVCache

CAPACITY = 1024  # large against the positions the tests use, so the prefix is what they read


@pytest.fixture(scope="module")
def tiny64(tmp_path_factory):
    """The tiny model in float64 with a 1024-token context: exact comparisons never flip on
    near-ties."""
    folder = tiny_checkpoint(tmp_path_factory.mktemp("kv-tiny"), max_position_embeddings=CAPACITY)
    model, _ = weights.load(folder, dtype=torch.float64)
    return model


def test_attend_len_is_a_bucket_covering_the_positions():
    assert [attend_len_for(n, 4096) for n in (1, 128, 129, 193, 1000, 1025, 4096)] == [
        128,
        128,
        192,
        256,
        1024,
        1536,
        4096,
    ]
    assert (
        attend_len_for(130, 192) == 192
        and attend_len_for(150, 200) == 192
        and attend_len_for(199, 200) == 200
        and attend_len_for(9000, 8192) == 8192
    )
    cache = StaticKVCache(1, 1, 1, 300, 8)
    assert cache.attend_len == 300  # no call yet: the whole cache
    assert cache.use_positions(5) == 128 == cache.attend_len and cache.use_positions(None) == 300


@pytest.mark.isa
@pytest.mark.parametrize("cache_cls", [StaticKVCache, Int8KVCache])
def test_prefix_attention_equals_whole_cache_logits(tiny64, cache_cls):
    """Prefill chunks and decode steps, batch 2, at attend lengths 128, 192 and 384 of 1024 slots
    (compiled steps' buckets) and at multiples of 256 (eager steps'): every logit
    equals the same step attending over all 1024 slots (float64)."""
    model = tiny64
    g = torch.Generator().manual_seed(0)
    prefix, eager, whole = (cache_cls.for_model(model, 2, CAPACITY) for _ in range(3))
    # (start, tokens): a prefill, decode steps across 128, a chunk reaching past 256, decode steps
    steps = (
        [(0, 40)] + [(p, 1) for p in range(40, 44)] + [(44, 84)] + [(p, 1) for p in range(128, 132)]
    )
    steps += [(132, 170)] + [(p, 1) for p in range(302, 306)]
    lengths = set()
    with torch.no_grad():
        for start, T in steps:
            tokens = torch.randint(3, 250, (2, T), generator=g)
            pos = torch.arange(start, start + T).expand(2, T)
            lengths.add(prefix.use_positions(start + T))
            assert eager.use_positions(start + T, round_up=False) == (
                256 if start + T <= 256 else 512
            )
            a, b, c = (
                model(tokens, pos, prefix),
                model(tokens, pos, eager),
                model(tokens, pos, whole),
            )
            torch.testing.assert_close(a, c, rtol=0, atol=1e-10)
            torch.testing.assert_close(b, c, rtol=0, atol=1e-10)
    assert whole.attend_len == CAPACITY and lengths == {128, 192, 384}


def greedy_across_a_boundary(model, cache_cls, decode_fn, prompt, n):
    cache = cache_cls.for_model(model, 2, CAPACITY)
    rows, _ = generate.generate(
        model,
        cache,
        prompt,
        n,
        SamplingParams(0.0),
        generate.DecodeOptions(ignore_eos=True, decode_fn=decode_fn),
    )
    assert (
        cache.attend_len == CAPACITY
    )  # generate hands the cache back attending over all its slots
    return rows


@pytest.mark.isa
@pytest.mark.parametrize("cache_cls", [StaticKVCache, Int8KVCache])
def test_compiled_decode_across_attend_lengths_equals_eager(tiny64, cache_cls):
    """A 120-token prompt and 20 new tokens: decode moves from the 128-slot prefix to the 192-slot
    one mid-loop, where generate's skip_guards must not rerun the 128-slot graph. Compiled gives
    eager's tokens (float64), with exactly two graphs; a second run recompiles nothing."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, 250, (2, 120), generator=g)
    eager = greedy_across_a_boundary(tiny64, cache_cls, compiling.decode_one, prompt, 20)
    torch._dynamo.reset()
    before = counters["stats"]["unique_graphs"]
    step = compiling.compile_decode("cpu", autotune=False)
    compiled = greedy_across_a_boundary(tiny64, cache_cls, step, prompt, 20)
    assert counters["stats"]["unique_graphs"] - before == 2  # one per attend length: 128, 192
    with torch._dynamo.config.patch(error_on_recompile=True):
        again = greedy_across_a_boundary(tiny64, cache_cls, step, prompt, 20)
    assert compiled == eager == again and len(eager[0]) == 20
