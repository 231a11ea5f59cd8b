"""The embedded SmolLM2-135M GGUF: our loader, tokenizer and generate.py against HF transformers."""

import json

import pytest
import torch

import generate
from kv_cache import NoCache, StaticKVCache
from sampling import SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
NEW_TOKENS = 32


def hf_greedy(hf, ids, n):
    """HF's greedy decoding with its own KV cache, never stopping at EOS (like --ignore_eos).

    A loop rather than hf.generate: its ways of ignoring EOS (min_new_tokens) forbid the EOS
    token."""
    out, past, x = [], None, torch.tensor([ids])
    with torch.no_grad():
        for _ in range(n):
            result = hf(input_ids=x, past_key_values=past, use_cache=True)
            past = result.past_key_values
            out.append(int(result.logits[0, -1].argmax()))
            x = torch.tensor([[out[-1]]])
    return out


def test_gguf_logits_match_hf_transformers(embedded, hf_embedded):
    model, tok = embedded
    x = torch.tensor([tok.encode(PROMPTS[0] + " Paris, and the capital of Italy is Rome.")])
    with torch.no_grad():
        ours = model(x, torch.arange(x.shape[1])[None], NoCache())
        ref = hf_embedded(x).logits
    torch.testing.assert_close(ours, ref, atol=1e-3, rtol=0)


@pytest.mark.parametrize("prompt", PROMPTS[1:])
def test_greedy_tokens_match_hf_generate(embedded, hf_embedded, prompt):
    model, tok = embedded
    ids = tok.encode(prompt)
    cache = StaticKVCache.for_model(model, 1, 128)
    rows, _ = generate.generate(
        model,
        cache,
        torch.tensor([ids]),
        NEW_TOKENS,
        SamplingParams(0.0),
        generate.DecodeOptions(ignore_eos=True),
    )
    assert rows[0] == hf_greedy(hf_embedded, ids, NEW_TOKENS)


def test_generate_cli_greedy_matches_hf(embedded, hf_embedded, capsys):
    _, tok = embedded
    code = generate.main(
        [
            "--prompt",
            PROMPTS[0],
            "--max_new_tokens",
            str(NEW_TOKENS),
            "--temperature",
            "0",
            "--ignore_eos",
            "--dtype",
            "float32",
            "--json",
        ]
    )
    assert code == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["prompt_tokens"] == tok.encode(PROMPTS[0])
    assert out["tokens"] == hf_greedy(hf_embedded, out["prompt_tokens"], NEW_TOKENS)
    assert out["text"] == tok.decode(out["tokens"])
    for key in (
        "tokens_per_s",
        "bandwidth_gb_s",
        "time_to_first_token_s",
        "peak_memory_bytes",
        "model_bytes",
        "compile_s",
    ):
        assert key in out["stats"]
    assert out["stats"]["tokens_per_s"] > 0
    assert (
        100e6 < out["stats"]["model_bytes"] < 300e6
    )  # the file's own bits (float32 would be 538 MB)
