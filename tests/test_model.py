"""model.py against Hugging Face transformers on the same weights, for every architecture."""

import pytest
import torch
from helpers import ARCHS, hf_model, save_hf, to_classic_config

from formats import weights
from kv_cache import NoCache, StaticKVCache

ATOL = 1e-4


@pytest.fixture(scope="module", params=sorted(ARCHS))
def pair(request, tmp_path_factory):
    """(arch, HF model, our model loaded from the HF folder it saved)."""
    arch = request.param
    hf = hf_model(arch)
    folder = save_hf(hf, tmp_path_factory.mktemp(arch))
    model, _ = weights.load(folder, dtype=torch.float32)
    return arch, hf, model, folder


def tokens(n=24, batch=2, seed=1):
    return torch.randint(0, 256, (batch, n), generator=torch.Generator().manual_seed(seed))


def test_prefill_logits_match_hf(pair):
    arch, hf, model, _ = pair
    x = tokens()
    with torch.no_grad():
        ref = hf(x).logits
        ours = model(x, torch.arange(x.shape[1]).expand_as(x), NoCache())
    assert ours.shape == ref.shape
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=0)


def test_decode_through_static_cache_matches_hf(pair):
    arch, hf, model, _ = pair
    x = tokens(n=20)
    B, T = x.shape
    with torch.no_grad():
        ref = hf(x).logits  # [B, T, V]: the logits at every position in one pass
        cache = StaticKVCache.for_model(model, B, 32)
        prompt = 8
        out = [model(x[:, :prompt], torch.arange(prompt).expand(B, prompt), cache)]
        for t in range(prompt, T):  # then one token at a time
            out.append(model(x[:, t : t + 1], torch.full((B, 1), t), cache))
    torch.testing.assert_close(torch.cat(out, dim=1), ref, atol=ATOL, rtol=0)


def test_classic_and_new_rope_config_forms_agree(pair, tmp_path):
    arch, hf, model, folder = pair
    import shutil

    classic = shutil.copytree(folder, tmp_path / "classic")
    to_classic_config(classic)
    model2, _ = weights.load(classic, dtype=torch.float32)
    assert model2.config == model.config
    torch.testing.assert_close(model2.rotary.inv_freq, model.rotary.inv_freq)


def test_switches_come_from_the_config():
    """Each architecture really exercises the switch it is listed for (a guard on the fixtures)."""
    import json

    from formats.weights import config_from_hf

    def args(arch):
        return config_from_hf(json.loads(hf_model(arch).config.to_json_string()), arch)

    assert args("qwen2").qkv_bias and not args("qwen2").o_bias
    assert args("qwen3").qk_norm and args("qwen3").head_dim == 32
    assert args("llama3").rope_scaling["rope_type"] == "llama3"
    assert args("llama3.2").tie_word_embeddings and not args("llama3").tie_word_embeddings
    assert args("tinyllama_mqa").n_kv_heads == 1
    assert args("llama_bias").o_bias and args("llama_bias").mlp_bias
