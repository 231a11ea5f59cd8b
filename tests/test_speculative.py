"""speculative.py: greedy output equals plain greedy decoding for every drafter, one target
forward per round, and the accept/reject rule samples exactly the target distribution."""

import pytest
import torch
from helpers import hf_model, save_hf

import compiling
import generate
from formats import weights
from kv_cache import StaticKVCache
from sampling import SamplingParams
from speculative import ModelDrafter, accept, speculative_generate
from speedups.prompt_lookup import PromptLookupDrafter

GREEDY = SamplingParams(0.0)
PROMPT = [5, 9, 11, 3, 5, 9, 11, 3, 5, 9]  # repetitive, so prompt lookup finds matches
NEW = 24


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    model, _ = weights.load(save_hf(hf_model("llama3"), tmp_path_factory.mktemp("target")))
    return model


@pytest.fixture(scope="module")
def reference(target):
    rows, _ = generate.generate(
        target,
        StaticKVCache.for_model(target, 1, 64),
        torch.tensor([PROMPT]),
        NEW,
        GREEDY,
        generate.DecodeOptions(ignore_eos=True),
    )
    return rows[0]


class Counting:
    """The target model, counting its forwards."""

    def __init__(self, model):
        self.model, self.calls = model, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.model(*args, **kwargs)


class ScriptedDrafter:
    """Proposes the reference continuation (all accepted) or a wrong token everywhere (all
    rejected)."""

    def __init__(self, reference, right, vocab):
        self.reference, self.right, self.vocab = reference, right, vocab

    def propose(self, tokens, k, generator=None):
        done = len(tokens) - len(PROMPT)
        drafts = [
            t if self.right else (t + 1) % self.vocab for t in self.reference[done : done + k]
        ]
        return drafts, torch.nn.functional.one_hot(torch.tensor(drafts), self.vocab).float()

    def rollback(self, confirmed):
        pass


def run(target, drafter, k=4, slots=64, verify_fns=None):
    counting = Counting(target)
    out, stats = speculative_generate(
        counting,
        StaticKVCache.for_model(target, 1, slots),
        drafter,
        PROMPT,
        NEW,
        GREEDY,
        k=k,
        ignore_eos=True,
        verify_fns=verify_fns,
    )
    assert counting.calls == stats["rounds"]  # exactly one target forward per round
    return out, stats


def test_draft_model_greedy_equals_plain(target, reference, tmp_path):
    other, _ = weights.load(save_hf(hf_model("llama3", seed=5), tmp_path / "draft"))
    out, stats = run(target, ModelDrafter(other, 64, GREEDY))
    assert out == reference
    assert stats["drafted"] > 0


def test_same_model_as_draft_accepts_everything(target, reference):
    out, stats = run(target, ModelDrafter(target, 64, GREEDY))
    assert out == reference and stats["acceptance_rate"] == 1.0
    assert stats["rounds"] < NEW / 3  # 5 tokens per round of k=4


def test_layer_skip_draft_greedy_equals_plain(target, reference):
    out, stats = run(target, ModelDrafter(target, 64, GREEDY, layers=1), k=3)
    assert out == reference and stats["drafted"] > 0


def test_prompt_lookup_greedy_equals_plain(target, reference):
    out, stats = run(target, PromptLookupDrafter(3, target.config.vocab_size))
    assert out == reference and stats["drafted"] > 0


@pytest.mark.parametrize("right", [True, False])
def test_every_draft_accepted_or_every_draft_rejected(target, reference, right):
    out, stats = run(target, ScriptedDrafter(reference, right, target.config.vocab_size))
    assert out == reference
    assert stats["acceptance_rate"] == (1.0 if right else 0.0) and stats["drafted"] > 0


def chi_square(counts, probs):
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def wrong_accept(drafts, draft_probs, target_probs, generator=None):
    """A plausible bug: on rejection, sample from p instead of norm(max(p - q, 0))."""
    n, _ = accept(drafts, draft_probs, target_probs, generator)
    if n == drafts.shape[0]:
        return n, int(torch.multinomial(target_probs[n], 1, generator=generator))
    return n, int(torch.multinomial(target_probs[n], 1, generator=generator))


@pytest.mark.parametrize("rule, should_pass", [(accept, True), (wrong_accept, False)])
def test_accept_rule_emits_the_target_distribution(rule, should_pass):
    """First emitted token of a k=2 round, over many rounds with synthetic p and q on 6 tokens:
    chi-square against p at p-value 0.001 (critical value 20.52 for 5 degrees of freedom)."""
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([0.30, 0.05, 0.25, 0.10, 0.20, 0.10])
    q = torch.tensor([0.05, 0.40, 0.05, 0.30, 0.10, 0.10])  # a poor drafter: most drafts rejected
    target_probs, draft_probs = torch.stack([p, p, p]), torch.stack([q, q])
    counts = torch.zeros(6)
    for _ in range(12000):
        drafts = torch.multinomial(q, 2, replacement=True, generator=g)
        n, nxt = rule(drafts, draft_probs, target_probs, g)
        counts[int(drafts[0]) if n > 0 else nxt] += 1
    assert (chi_square(counts, p) < 20.52) == should_pass


@pytest.fixture(scope="module")
def chat_checkpoint(tmp_path_factory):
    from helpers import tiny_checkpoint

    return tiny_checkpoint(tmp_path_factory.mktemp("tiny-chat"), arch="llama3")


@pytest.mark.parametrize(
    "flags",
    [
        ["--prompt_lookup", "2"],
        ["--draft_layers", "1"],
        ["--draft_checkpoint", "SELF"],
        ["--draft_checkpoint", "SELF", "--draft_quantize", "int8"],
    ],
)
def test_cli_speculative_greedy_equals_plain(chat_checkpoint, capsys, flags):
    import json

    flags = [str(chat_checkpoint) if f == "SELF" else f for f in flags]
    argv = [
        "--checkpoint",
        str(chat_checkpoint),
        "--prompt",
        "the quick brown fox the quick brown",
        "--temperature",
        "0",
        "--max_new_tokens",
        "16",
        "--ignore_eos",
        "--dtype",
        "float32",
        "--json",
    ]
    assert generate.main(argv) == 0
    plain = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert generate.main(argv + flags + ["--speculate_k", "3"]) == 0
    captured = capsys.readouterr()
    spec = json.loads(captured.out.strip().splitlines()[-1])
    assert spec["tokens"] == plain["tokens"] and spec["stats"]["rounds"] >= 1
    assert "acceptance" in captured.err


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--draft_layers", "2"], "--draft_layers must be between 1 and 1"),
        (["--prompt_lookup", "2", "--batch_size", "2"], "batch_size 1"),
        (["--prompt_lookup", "2", "--speculate_k", "0"], "--speculate_k must be >= 1"),
        (
            ["--draft_layers", "1", "--draft_quantize", "int8"],
            "--draft_quantize applies to a --draft_checkpoint",
        ),
    ],
)
def test_cli_speculative_bad_input(chat_checkpoint, capsys, flags, message):
    assert generate.main(["--checkpoint", str(chat_checkpoint), "--prompt", "hello", *flags]) == 2
    assert message in capsys.readouterr().err


def test_cache_after_rejections_equals_a_plain_run(target, reference, tmp_path):
    """Rejected drafts leave nothing behind: the next logits from the speculative run's cache
    equal those from the plain run's cache."""
    other, _ = weights.load(save_hf(hf_model("llama3", seed=5), tmp_path / "draft"))
    spec_cache, plain_cache = (
        StaticKVCache.for_model(target, 1, 64),
        StaticKVCache.for_model(target, 1, 64),
    )
    out, stats = speculative_generate(
        target,
        spec_cache,
        ModelDrafter(other, 64, GREEDY),
        PROMPT,
        NEW,
        GREEDY,
        k=4,
        ignore_eos=True,
    )
    assert 0 < stats["accepted"] < stats["drafted"]  # some drafts were rejected
    generate.generate(
        target,
        plain_cache,
        torch.tensor([PROMPT]),
        NEW,
        GREEDY,
        generate.DecodeOptions(ignore_eos=True),
    )
    last, pos = torch.tensor([[out[-1]]]), torch.tensor([[len(PROMPT) + NEW - 1]])
    with torch.no_grad():
        torch.testing.assert_close(
            target(last, pos, spec_cache), target(last, pos, plain_cache), atol=1e-5, rtol=0
        )


def test_end_to_end_sampling_follows_the_target(target, tmp_path):
    """Temperature 1 with top-k 8 on a tiny model: the first token of speculative runs (a
    different random draft model) against the target's own first-token distribution."""
    other, _ = weights.load(save_hf(hf_model("llama3", seed=5), tmp_path / "draft"))
    params = SamplingParams(1.0, top_k=8)
    with torch.no_grad():
        logits = target(
            torch.tensor([PROMPT]),
            torch.arange(len(PROMPT))[None],
            StaticKVCache.for_model(target, 1, 64),
        )
    from sampling import probabilities

    p = probabilities(logits[0, -1], 1.0, 8)
    support = torch.nonzero(p).flatten()
    g = torch.Generator().manual_seed(0)
    cache, drafter = StaticKVCache.for_model(target, 1, 64), ModelDrafter(other, 64, params)
    counts = torch.zeros_like(p)
    for _ in range(2000):  # two new tokens: one drafted, verified, and the next one
        out, _ = speculative_generate(
            target, cache, drafter, PROMPT, 2, params, k=2, generator=g, ignore_eos=True
        )
        drafter.rollback(0)
        counts[out[0]] += 1
    assert counts.sum() == counts[support].sum()  # nothing outside the target's top-k
    assert chi_square(counts[support], p[support]) < 24.32  # 7 degrees of freedom, p-value 0.001


def test_min_p_limits_the_verified_tokens_and_penalties_are_refused(target):
    """min_p is part of the distribution p that the accept rule keeps (no emitted token falls
    outside the target's min-p set); a bias or penalty, which plain decoding would apply, is
    refused rather than silently dropped."""
    from sampling import probabilities

    params = SamplingParams(1.0, min_p=0.2)
    with torch.no_grad():
        logits = target(
            torch.tensor([PROMPT]),
            torch.arange(len(PROMPT))[None],
            StaticKVCache.for_model(target, 1, 64),
        )
    support = set(torch.nonzero(probabilities(logits[0, -1], 1.0, min_p=0.2)).flatten().tolist())
    assert (
        1 < len(support) and probabilities(logits[0, -1], 1.0)[list(support)].sum() < 0.95
    )  # min_p cuts real mass
    g = torch.Generator().manual_seed(0)
    cache, drafter = (
        StaticKVCache.for_model(target, 1, 64),
        ModelDrafter(target, 64, params, layers=1),
    )
    firsts = set()
    for _ in range(300):
        out, _ = speculative_generate(
            target, cache, drafter, PROMPT, 2, params, k=2, generator=g, ignore_eos=True
        )
        drafter.rollback(0)
        firsts.add(out[0])
    assert firsts <= support
    for bad in (dict(repetition_penalty=1.2), dict(presence_penalty=0.5), dict(logit_bias={3: 5})):
        with pytest.raises(ValueError, match="speculative decoding here takes no"):
            speculative_generate(target, cache, drafter, PROMPT, 2, SamplingParams(1.0, **bad), k=2)


def test_cli_draft_with_another_vocabulary_is_refused(chat_checkpoint, tmp_path, capsys):
    draft = save_hf(
        hf_model("llama3"), tmp_path / "draft"
    )  # 256 tokens; the target's tokenizer has more
    assert (
        generate.main(
            [
                "--checkpoint",
                str(chat_checkpoint),
                "--prompt",
                "hello",
                "--draft_checkpoint",
                str(draft),
            ]
        )
        == 2
    )
    assert "a draft must share the target's tokenizer" in capsys.readouterr().err


def test_compiled_draft_and_verify_steps_equal_plain(target, reference):
    """Layer-skip with the draft step and the (k + 1)-token verification compiled, static shapes:
    same tokens as plain decoding, and no recompilation across rounds."""
    import torch._dynamo

    from speculative import draft_forward

    verify = torch.compile(compiling.verify_step, fullgraph=True, dynamic=False)
    step = torch.compile(draft_forward, fullgraph=True, dynamic=False)
    drafter = ModelDrafter(target, 64, GREEDY, layers=1, step_fn=step)
    with torch._dynamo.config.patch(error_on_recompile=True):
        out, stats = speculative_generate(
            target,
            StaticKVCache.for_model(target, 1, 64),
            drafter,
            PROMPT,
            NEW,
            GREEDY,
            k=3,
            ignore_eos=True,
            verify_fns={4: verify},
        )
    assert out == reference and stats["rounds"] > 2


class Cycling:
    """Proposes 0, 1, 2, 3, 0, ... tokens a round: the reference continuation (all kept), or wrong
    tokens (all rejected)."""

    def __init__(self, reference, right):
        self.reference, self.right, self.lengths = reference, right, []

    def propose(self, tokens, k, generator=None):
        done, n = len(tokens) - len(PROMPT), min(k, len(self.lengths) % 4)
        self.lengths.append(n)
        drafts = [t if self.right else (t + 1) % 256 for t in self.reference[done : done + n]]
        return drafts, torch.nn.functional.one_hot(torch.tensor(drafts, dtype=torch.long), 256)

    def rollback(self, confirmed):
        pass


@pytest.mark.parametrize("right", [True, False])
def test_short_feeds_are_padded_to_a_compiled_length(target, reference, right):
    """A round verifying fewer than 1 + k tokens runs at the compiled length, padded (the pad's K/V
    land where later rounds write again, after kept or rejected drafts); a round whose pad would
    pass the cache's end, and the prompt's, run eager at their own length. Tokens equal plain
    decoding's."""
    from speculative import padded_length

    full = StaticKVCache.for_model(target, 1, 64)
    assert [padded_length(n, 10, {1: 0, 4: 0}, full) for n in (1, 2, 4, 5)] == [1, 4, 4, 5]
    assert padded_length(2, 61, {4: 0}, full) == 2  # positions 61..64: past the last slot
    seen = []

    def verify4(model, cache, tokens, pos):
        seen.append(tokens.shape[1])
        return compiling.verify_step(model, cache, tokens, pos)

    drafter = Cycling(reference, right)  # a cache with no slot past the last token:
    out, stats = run(target, drafter, k=3, slots=len(PROMPT) + NEW, verify_fns={4: verify4})
    assert out == reference and set(drafter.lengths) == {0, 1, 2, 3}
    assert stats["accepted"] == (stats["drafted"] if right else 0) and stats["drafted"] > 0
    assert set(seen) == {4} and stats["rounds"] - 3 <= len(seen) < stats["rounds"]


# Inductor's vector width follows ATEN_CPU_CAPABILITY (runtime.inductor_vector_bits)
@pytest.mark.isa
@pytest.mark.parametrize("kv", ["model", "int8"])
def test_default_packages_verify_and_equal_eager(
    chat_checkpoint, capsys, monkeypatch, tmp_path, kv
):
    """generate.py's speculation by default (--compile auto; aot here, which fails loudly): the
    decode package and a verify package of 1 + k tokens (speedups/aot.py) give plain eager
    decoding's greedy tokens on an int4 model, over the static and the int8 KV cache, and their
    logits and K/V writes equal the eager steps' at several attend lengths."""
    import copy
    import json

    from cli import generate_flags, speculate
    from speedups.kv_int8 import Int8KVCache

    monkeypatch.setenv("LLM_AOT_CACHE", str(tmp_path))
    argv = ["--checkpoint", str(chat_checkpoint), "--prompt", "the quick brown fox the quick"]
    argv += ["--temperature", "0", "--max_new_tokens", "24", "--ignore_eos", "--json"]
    argv += ["--dtype", "float32", "--quantize", "int4", "--groupsize", "32"]
    argv += ["--kv_cache_dtype", kv]
    assert generate.main(argv + ["--compile", "off"]) == 0
    plain = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    flags = ["--prompt_lookup", "2", "--speculate_k", "3", "--compile", "aot"]
    assert generate.main(argv + flags) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out.strip().splitlines()[-1])["tokens"] == plain["tokens"]
    assert f"packages {'any' if kv == 'int8' else 'short'}, verify4" in captured.err

    args = generate.parse_args(argv + flags)
    model, _ = weights.load_for_inference(
        device="cpu", dtype=torch.float32, **generate_flags.load_flags(args)
    )
    cache = (Int8KVCache if kv == "int8" else StaticKVCache).for_model(model, 1, 512)
    fns = speculate.verify_steps(args, model, cache, "cpu", False)  # loaded, not built again
    assert set(fns) == {1, 4} and "compiling" not in capsys.readouterr().err
    torch.manual_seed(0)
    with torch.no_grad():
        compiling.prefill(model, cache, torch.randint(3, 200, (1, 320)))
        for p, T in ((3, 4), (150, 4), (200, 1), (300, 4)):  # attend lengths 128, 192, 256, 384
            twin = copy.deepcopy(cache)
            tokens, pos = torch.randint(3, 200, (1, T)), torch.arange(p, p + T)[None]
            ours = fns[T](model, cache, tokens, pos)
            eager = compiling.verify_step(model, twin, tokens, pos)
            torch.testing.assert_close(ours, eager, rtol=1e-4, atol=1e-4)
            for a, b in zip(cache.tensors(), twin.tensors()):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
            assert cache.attend_len == 512  # restored: the prompt's eager forward reads every slot
