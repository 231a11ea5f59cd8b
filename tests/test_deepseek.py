"""DeepSeek-V2 / V3 (model.MLAttention, moe.py's routers, formats/deepseek.py) against HF
transformers. The whole model: greedy tokens for 32 through generate.py's static cache, whose
latent cache holds exactly (kv_lora_rank + qk_rope_head_dim) values a token (the memory plan
says what expanded heads would take); compiled equals eager; int8 weights stay close (the
absorbed up-projection kept float); the engine's paged latents give the static cache's tokens;
the int8 cache's latent at two scales; LoRA and quantized folders refuse it by name; the published
parameter counts; GGUF deepseek2 files as llama.cpp writes them (tests/deepseek_gguf.py) against
their HF twin. Tensor parallelism: tests/test_tp.py; packages compiled ahead of time:
tests/test_aot.py.
tests/test_model.py runs the three tiny configs (tests/helpers.py's ARCHS) through its prefill
and static-cache logit checks. The experts alone, against HF's own DeepseekV2Moe and
DeepseekV3MoE blocks: V2's softmax router greedy and group-limited, V3's sigmoid router with a
correction bias (noaux_tc), shared experts added ungated, the routed scaling factor; both expert
paths; the dense layers a config keeps; bad configs named."""

from dataclasses import replace

import pytest
import torch
from helpers import hf_model, prefill_then_decode, save_hf
from transformers import DeepseekV2Config, DeepseekV3Config
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

import compiling
import generate
import memory
import quantize
from engine import Engine
from formats import weights
from formats.deepseek import deepseek_experts
from kv_cache import NoCache, StaticKVCache
from model import MLP, ModelConfig, apply_rope
from moe import SparseMoE
from runtime import CheckpointError
from sampling import SamplingParams
from speedups.kv_int8 import Int8KVCache

SIZES = dict(hidden_size=64, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=3,
             n_shared_experts=2, num_hidden_layers=2, num_attention_heads=4)  # fmt: skip
CASES = {
    "v2 greedy": (DeepseekV2Config, DeepseekV2Moe, dict(routed_scaling_factor=1.5)),
    "v2 group-limited": (
        DeepseekV2Config,
        DeepseekV2Moe,
        dict(topk_method="group_limited_greedy", n_group=4, topk_group=2),
    ),
    "v3 noaux_tc": (
        DeepseekV3Config,
        DeepseekV3MoE,
        dict(n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True),
    ),
}


def moe_pair(case: str):
    """(HF's block with random weights, ours with the same, our MoEConfig)."""
    config_class, block_class, extra = CASES[case]
    hf_config = config_class(**SIZES, **extra)
    torch.manual_seed(0)
    hf = block_class(hf_config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(0.3 * torch.randn_like(p))
        if hasattr(hf.gate, "e_score_correction_bias"):  # large enough to move choices
            hf.gate.e_score_correction_bias.copy_(0.5 * torch.randn(8))
    cfg = {**hf_config.to_dict(), "model_type": hf_config.model_type}
    moe = deepseek_experts(cfg)
    config = ModelConfig(256, 64, 2, 4, 4, intermediate_size=96, moe=moe)
    ours = SparseMoE(config, torch.nn.functional.silu, MLP(config, moe.shared_expert_size)).eval()
    with torch.no_grad():
        ours.gate.weight.copy_(hf.gate.weight)
        if moe.correction_bias:
            ours.gate.e_score_correction_bias.copy_(hf.gate.e_score_correction_bias)
        gate, up = hf.experts.gate_up_proj.chunk(2, dim=1)
        ours.experts.gate_proj.copy_(gate)
        ours.experts.up_proj.copy_(up)
        ours.experts.down_proj.copy_(hf.experts.down_proj)
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(ours.shared_expert, name).weight.copy_(getattr(hf.shared_experts, name).weight)
    return hf, ours, moe


@pytest.mark.parametrize("case", CASES)
def test_the_block_equals_hf(case):
    hf, ours, moe = moe_pair(case)
    x = torch.randn(2, 20, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = hf(x), ours(x)
        flat = x.reshape(-1, 64)
        idx, w = ours.route(flat)
        gathered = ours.experts.gathered(flat, idx, w) + ours.shared_expert(flat)
    assert ours.shared_expert_gate is None and moe.shared_expert_size == 64
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gathered.view_as(want), want, atol=1e-4, rtol=1e-4)  # (sum order)


def test_groups_and_the_correction_bias_change_the_choice():
    """The switch bites: without the group limit some token picks other experts; with it, every
    token's experts lie in at most topk_group (2) groups of 8 / 4 = 2."""
    for case in ("v2 group-limited", "v3 noaux_tc"):
        _, ours, moe = moe_pair(case)
        x = torch.randn(40, 64, generator=torch.Generator().manual_seed(2))
        with torch.no_grad():
            idx = ours.route(x)[0].sort(dim=-1).values
            ours.moe = replace(moe, topk_method="greedy")
            free = ours.route(x)[0].sort(dim=-1).values
        assert not torch.equal(idx, free), case
        assert all(len(set((row // 2).tolist())) <= 2 for row in idx), case


def test_dense_layers_follow_first_k_dense_replace_and_moe_layer_freq():
    cfg = dict(model_type="deepseek_v2", num_hidden_layers=6, n_routed_experts=8,
               num_experts_per_tok=2, moe_intermediate_size=16, first_k_dense_replace=1,
               moe_layer_freq=2)  # fmt: skip
    moe = deepseek_experts(cfg)
    assert moe.dense_layers == (0, 1, 3, 5)  # MoE where i >= 1 and i % 2 == 0
    v3 = deepseek_experts({**cfg, "model_type": "deepseek_v3", "n_group": 2, "topk_group": 1})
    assert (v3.scoring, v3.topk_method, v3.correction_bias) == ("sigmoid", "noaux_tc", True)
    assert v3.routed_scaling_factor == 2.5 and v3.norm_topk_prob


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(topk_method="best"), "topk_method 'best' is not supported: greedy, group_limited"),
        (dict(scoring_func="relu"), "scoring 'relu' is not supported: softmax, sigmoid"),
        (dict(n_routed_experts=None), "needs n_routed_experts"),
        (dict(topk_method="noaux_tc", n_group=3, topk_group=1), "n_group \\(3\\) to divide"),
        (dict(topk_method="noaux_tc", n_group=4, topk_group=1), "to hold the 3 experts"),
    ],
)
def test_bad_router_configs_are_named(change, message):
    with pytest.raises(CheckpointError, match=message):
        deepseek_experts({"model_type": "deepseek_v2", **SIZES, **change})


@pytest.fixture(scope="module", params=["deepseek_v2", "deepseek_v2_q_lora", "deepseek_v3"])
def pair(request, tmp_path_factory):
    hf = hf_model(request.param)
    model, _ = weights.load(save_hf(hf, tmp_path_factory.mktemp(request.param)))
    return request.param, hf, model


def greedy(model, prompt, n, decode_fn=compiling.decode_one):
    cache = StaticKVCache.for_model(model, prompt.shape[0], 64)
    options = generate.DecodeOptions(ignore_eos=True, decode_fn=decode_fn)
    return generate.generate(model, cache, prompt, n, SamplingParams(0.0), options)[0]


def test_greedy_tokens_match_hf(pair):
    _, hf, model = pair
    prompt = torch.randint(3, 256, (1, 8), generator=torch.Generator().manual_seed(3))
    hf.generation_config.eos_token_id = None  # (V3's is token 1, which these weights pick)
    with torch.no_grad():
        ref = hf.generate(prompt, max_new_tokens=32, do_sample=False, pad_token_id=0)[0, 8:]
    assert len(ref) == 32 and greedy(model, prompt, 32)[0] == ref.tolist()


def test_the_cache_keeps_the_latent_and_says_what_heads_would_take(pair):
    """2 layers x (32 + 8) values x 4 bytes a token; expanded: 4 heads x (16 + 8 + 16) values."""
    _, _, model = pair
    cache = StaticKVCache.for_model(model, 2, 64)
    assert cache.nbytes() == 2 * 64 * 2 * (32 + 8) * 4 and cache.v == []
    line = memory.memory_plan(model, cache)
    assert "KV cache 320 B/token" in line, line
    assert "expanded heads: 1.2 KiB/token" in line, line  # 2 * 4 * 40 * 4 = 1,280 bytes


def test_compiled_decode_equals_eager(pair):
    import torch._dynamo

    _, _, model = pair
    torch._dynamo.reset()
    prompt = torch.randint(3, 256, (2, 12), generator=torch.Generator().manual_seed(4))
    jit = compiling.compile_decode("cpu", autotune=False)
    assert greedy(model, prompt, 16, jit) == greedy(model, prompt, 16)


def test_absorbed_attention_equals_expanded_heads(pair):
    """MLAttention's absorbed form (q and the output through kv_b_proj, attention over the latent)
    against every head's K = [W_uk c | k_pe] and V = W_uv c expanded and attended the plain way,
    a prefill then two decode steps through the static latent cache."""
    _, _, model = pair
    attn, m = model.layers[0].self_attn, model.layers[0].self_attn.m
    H, R, N = attn.n_heads, m.kv_lora_rank, m.qk_nope_head_dim
    x = torch.randn(2, 12, 64, generator=torch.Generator().manual_seed(6))
    pos = torch.arange(12).expand(2, 12)
    cos, sin = model.rotary(pos, torch.float32)
    with torch.no_grad():
        cache = StaticKVCache.for_model(model, 2, 16)
        ours = [attn(x[:, :10], cos[:, :10], sin[:, :10], pos[:, :10], cache)]
        ours += [attn(x[:, t : t + 1], cos[:, t : t + 1], sin[:, t : t + 1], pos[:, t : t + 1],
                      cache) for t in (10, 11)]  # fmt: skip
        q = attn.q_proj(x) if attn.q_proj is not None else attn.q_b_proj(
            attn.q_a_layernorm(attn.q_a_proj(x)))  # fmt: skip
        q_nope, q_pe = q.view(2, 12, H, -1).split([N, m.qk_rope_head_dim], -1)
        c, k_pe = attn.kv_a_proj_with_mqa(x).split([R, m.qk_rope_head_dim], -1)
        kv = (attn.kv_a_layernorm(c) @ attn.kv_b_proj.weight.T).view(2, 12, H, -1)  # expanded
        k_nope, v = kv.split([N, m.v_head_dim], -1)
        k_pe = apply_rope(k_pe[:, :, None], cos, sin).expand(-1, -1, H, -1)
        q = torch.cat((q_nope, apply_rope(q_pe, cos, sin)), -1).transpose(1, 2)
        k = torch.cat((k_nope, k_pe), -1).transpose(1, 2)
        y = torch.nn.functional.scaled_dot_product_attention(
            q, k, v.transpose(1, 2), is_causal=True, scale=m.softmax_scale
        )
        expanded = attn.o_proj(y.transpose(1, 2).reshape(2, 12, -1))
    torch.testing.assert_close(torch.cat(ours, 1), expanded, atol=1e-5, rtol=1e-5)


def test_generate_py_s_package_over_a_latent_cache_equals_eager(tmp_path):
    """The default decode step of generate.py (speedups/aot.py's static package) over a latent
    cache, whose inputs are K alone, equals the eager step and writes the same latents."""
    from helpers import tiny_checkpoint
    from test_aot import fill, load

    from speedups import aot

    model, spec = load(tiny_checkpoint(tmp_path, arch="deepseek_v2"))
    step = aot.decode_step(model, StaticKVCache.for_model(model, 2, 256), spec)
    cache = StaticKVCache.for_model(model, 2, 256)
    fill(model, cache, 200)
    for p in (3, 130, 200):
        twin = StaticKVCache.for_model(model, 2, 256)
        twin.k, twin.attend_len = [t.clone() for t in cache.k], cache.use_positions(p + 1)
        token, pos = torch.tensor([[5], [9]]), torch.full((2, 1), p)
        with torch.no_grad():
            ours, eager = (
                step(model, cache, token, pos),
                compiling.decode_one(model, twin, token, pos),
            )
        torch.testing.assert_close(ours, eager, rtol=1e-4, atol=1e-4)
        assert cache.v == [] and all(
            torch.allclose(a, b, atol=1e-5) for a, b in zip(cache.k, twin.k)
        )


def test_int8_weights_stay_close_and_keep_the_up_projection_float(tmp_path):
    """The latent up-projection is read as a matrix (absorbed): kept float; the rest int8, the
    logits within 1.5x the relative error of a dense Llama quantized the same way."""

    def error(arch):
        model, _ = weights.load(save_hf(hf_model(arch), tmp_path / arch))
        x = torch.randint(3, 256, (1, 24), generator=torch.Generator().manual_seed(2))
        with torch.no_grad():
            ref = model(x, torch.arange(24)[None], NoCache())
            report = quantize.quantize_model(model, "int8")
            got = model(x, torch.arange(24)[None], NoCache())
        return float((got - ref).norm() / ref.norm()), report

    (mine, report), (dense, _) = error("deepseek_v3"), error("llama3")
    assert "layers.0.self_attn.kv_b_proj" in report["kept"]
    assert "layers.0.self_attn.q_a_proj" in report["quantized"]
    assert mine < 1.5 * dense, (mine, dense)


def test_the_int8_cache_keeps_a_latent_and_its_rotary_key_each_at_its_own_scale(pair):
    """K = [c | k_pe] as int8 with one scale per part: each part within half its own scale step
    even where k_pe is 100x c; R + P bytes and two scales a token and layer; the logits of a
    prefill and 15 decode steps equal those of a float cache holding the same rounded values."""
    from speedups.kv_int8 import quantize_per_token

    _, _, model = pair
    cache = Int8KVCache.for_model(model, 2, 64)
    k = torch.randn(2, 5, 1, 40) * torch.cat((torch.ones(32), 100 * torch.ones(8)))
    cache.attend(0, torch.randn(2, 5, 4, 40), k, None, torch.arange(5).expand(2, 5))
    stored = cache.k[0][:, :, :5].float()  # [2, 1, 5, 40]
    scale = cache.k_scale[0][:, :, :5].float()  # [2, 1, 5, 2]
    back = torch.cat((stored[..., :32] * scale[..., :1], stored[..., 32:] * scale[..., 1:]), -1)
    error = (back - k.transpose(1, 2)).abs()
    assert (error[..., :32] <= scale[..., :1] / 2 + 1e-6).all() and (scale[..., :1] < 0.1).all()
    assert (error[..., 32:] <= scale[..., 1:] / 2 + 1e-4).all()
    assert cache.nbytes() == 2 * 64 * 2 * (40 + 2 * 4) and cache.v == []

    class Rounded(StaticKVCache):  # the slow twin: float K holding what the int8 cache keeps
        def attend(self, layer, q, k, v, input_pos, window=0, softcap=0.0, sinks=None):
            parts = [quantize_per_token(x) for x in (k[..., :32], k[..., 32:])]
            k = torch.cat([values.to(k.dtype) * s for values, s in parts], dim=-1)
            return super().attend(layer, q, k, k[..., :32], input_pos, window, softcap, sinks)

    seq = torch.randint(3, 256, (2, 28), generator=torch.Generator().manual_seed(5))

    def run(kind):  # the logits of a 12-token prefill's last token and of 15 decode steps
        c = kind.for_model(model, 2, 64)
        with torch.no_grad():
            out = [model(seq[:, :12], torch.arange(12).expand(2, 12), c)[:, -1]]
            out += [
                model(seq[:, t : t + 1], torch.full((2, 1), t), c)[:, -1] for t in range(12, 27)
            ]
        return torch.stack(out)

    torch.testing.assert_close(run(Int8KVCache), run(Rounded), atol=1e-4, rtol=0)


def test_a_config_without_its_latent_sizes_is_named(tmp_path):
    import json

    folder = save_hf(hf_model("deepseek_v2"), tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["kv_lora_rank"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="deepseek_v2 needs kv_lora_rank"):
        weights.load(folder)


def test_parameter_counts_match_the_published_totals():
    """Model cards: DeepSeek-V3 671B parameters, 37B active; DeepSeek-V2-Lite 15.7B (its card's
    2.4B active leaves out the embedding table, which the others count)."""
    from model import MLAConfig

    def config(kind, dims, mla, **experts):
        vocab, dim, layers, heads, ff = dims
        cfg = dict(model_type=kind, num_hidden_layers=layers, **experts)
        return ModelConfig(vocab, dim, layers, heads, 1, ff, 576, rotary_dim=64, mla=mla,
                           moe=deepseek_experts(cfg))  # fmt: skip

    v3 = config("deepseek_v3", (129280, 7168, 61, 128, 18432), MLAConfig(512, 128, 64, 128, 1536),
                n_routed_experts=256, num_experts_per_tok=8, moe_intermediate_size=2048,
                n_shared_experts=1, first_k_dense_replace=3, n_group=8, topk_group=4)  # fmt: skip
    lite = config("deepseek_v2", (102400, 2048, 27, 16, 10944), MLAConfig(512, 128, 64, 128),
                  n_routed_experts=64, num_experts_per_tok=6, moe_intermediate_size=1408,
                  n_shared_experts=2, first_k_dense_replace=1)  # fmt: skip
    total, active = (n / 1e9 for n in v3.moe.parameter_counts(v3))
    assert (total, active) == pytest.approx((671, 37), rel=0.02)
    assert lite.moe.parameter_counts(lite)[0] / 1e9 == pytest.approx(15.7, rel=0.01)


def test_a_bf16_load_keeps_the_router_in_float32_and_skips_the_mtp_layer(tmp_path):
    """V3's correction bias stays float32 (HF keeps it so; bf16 would move close choices), the
    router's logits are float32; a multi-token-prediction layer past num_hidden_layers (as V3's
    published folders carry) is left out, as transformers does."""
    from safetensors.torch import load_file, save_file

    folder = save_hf(hf_model("deepseek_v3"), tmp_path)
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.2.eh_proj.weight"] = torch.zeros(64, 128)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    model, _ = weights.load(folder, dtype=torch.bfloat16)
    gate = model.layers[1].mlp.gate
    assert gate.e_score_correction_bias.dtype == torch.float32
    want = tensors["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert torch.equal(gate.e_score_correction_bias, want)
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    idx, w = model.layers[1].mlp.route(x)
    scores = torch.sigmoid(x.float() @ gate.weight.float().T)
    chosen = scores.gather(1, idx)
    assert w.dtype == torch.float32
    torch.testing.assert_close(w, chosen / chosen.sum(-1, keepdim=True) * 2.5)  # (V3's scaling)


def test_quantized_folders_and_lora_refuse_by_name(tmp_path):
    import json

    from speedups.lora import Adapters

    folder = save_hf(hf_model("deepseek_v2"), tmp_path)
    model, _ = weights.load(folder)
    with pytest.raises(ValueError, match="LoRA adapters on DeepSeek's latent attention"):
        Adapters(model)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="a quantized deepseek_v2 folder"):
        weights.load(folder)


def test_the_engine_s_paged_latents_equal_the_static_cache(pair):
    """batch.py's engine (paged latents, prefix caching, chunked prefill, requests of different
    lengths in one step) gives each prompt the static cache's greedy tokens; a request sharing a
    cached head reuses its blocks."""
    from engine import RequestParams

    _, _, model = pair
    gen = torch.Generator().manual_seed(5)
    head = torch.randint(3, 256, (20,), generator=gen).tolist()
    prompts = [head + torch.randint(3, 256, (n,), generator=gen).tolist() for n in (3, 9, 14)]
    engine = Engine.for_model(model, num_blocks=64, max_num_seqs=3, max_num_batched_tokens=24)
    got = engine.run_batch(prompts, RequestParams(max_new_tokens=12, temperature=0))
    for prompt, result in zip(prompts, got):
        want = greedy(model, torch.tensor([prompt]), 12)[0]
        assert result["tokens"] == want
    assert engine.metrics()["prompt_tokens_hit"] >= 16  # the head's first block, shared
    assert engine.cache.v[0].numel() == 0  # V read from K's latent: nothing stored


def test_the_kv_tier_keeps_latent_blocks_across_a_restart(tmp_path):
    """Latent blocks (K only: V's pools are empty) go to disk and come back after a restart: every
    head loaded, the tokens those computed without the tier."""
    from engine import RequestParams
    from speedups.kv_disk import DiskTier
    from speedups.kv_tier import fingerprint, keep_pool

    model, _ = weights.load(save_hf(hf_model("deepseek_v3"), tmp_path / "m"))
    prompts = [list(range(10 + i, 74 + i)) + [200] for i in range(4)]  # four 4-block heads
    params = RequestParams(max_new_tokens=4, temperature=0)

    def engine(tier=None, blocks=12):
        limits = dict(max_num_seqs=2, max_num_batched_tokens=64)
        return Engine.for_model(model, num_blocks=blocks, tier=tier, **limits)

    def disk():
        return DiskTier(tmp_path / "kv", 2**30, fingerprint(model, 16, torch.float32))

    want = [engine(blocks=400).run_batch([p], params)[0]["tokens"] for p in prompts]
    first = engine(disk())
    assert [first.run_batch([p], params)[0]["tokens"] for p in prompts] == want
    keep_pool(first)
    again = engine(disk())
    assert [again.run_batch([p], params)[0]["tokens"] for p in prompts] == want
    assert again.metrics()["tier_tokens_hit"] == 4 * 64


@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3"])
def test_a_deepseek2_gguf_equals_its_hf_twin(arch, tmp_path):
    """llama.cpp's layout (tests/deepseek_gguf.py): kv_b_proj from attn_k_b and attn_v_b, the
    rotary rows reordered, V2's grouped softmax router and V3's sigmoid one with its correction
    bias read from expert_* metadata, YaRN's mscale_all_dim from yarn_log_multiplier; prefill then
    token-by-token decode against HF, and a file with one attn_kv_b (older converters) the same."""
    from deepseek_gguf import write_deepseek2

    hf = hf_model(arch)
    model, _ = weights.load(write_deepseek2(hf, tmp_path / "m.gguf"), dtype=torch.float32)
    twin, _ = weights.load(save_hf(hf, tmp_path / "hf"), dtype=torch.float32)
    assert model.config.moe == twin.config.moe and model.config.mla.kv_lora_rank == 32
    torch.testing.assert_close(model.config.mla.softmax_scale, twin.config.mla.softmax_scale)
    x = torch.randint(3, 256, (1, 24), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        ref = hf(x).logits
        legacy, _ = weights.load(write_deepseek2(hf, tmp_path / "kv_b.gguf", split_kv_b=False))
        old = legacy(x, torch.arange(24)[None], NoCache())
    torch.testing.assert_close(prefill_then_decode(model, x, 16), ref, atol=1e-4, rtol=0)
    torch.testing.assert_close(old, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("split", [True, False], ids=["k_b v_b", "kv_b"])
def test_a_q8_0_deepseek2_gguf_runs_at_its_bits_near_its_dequantized_twin(split, tmp_path):
    """The projections stay 8-bit groups (q_a_proj, kv_a_proj_with_mqa with its rotary rows
    reordered, o_proj, the experts); kv_b_proj is float whatever the file holds (an 8-bit attn_kv_b
    too)."""
    from deepseek_gguf import write_deepseek2

    hf = hf_model("deepseek_v3")
    path = write_deepseek2(hf, tmp_path / "q8.gguf", qtype="Q8_0", split_kv_b=split)
    model, info = weights.load(path, dtype=torch.float32)
    plain, _ = weights.load(path, dtype=torch.float32, dequantize=True)
    attn = model.layers[1].self_attn
    # (the embedding first: it is built as it arrives)
    assert "Q8_0 -> int8 g32: embed_tokens, q_a_proj, kv_a_proj_with_mqa, o_proj" in info.own_bits
    assert type(attn.kv_a_proj_with_mqa) is not torch.nn.Linear
    assert type(attn.kv_b_proj) is torch.nn.Linear
    x = torch.randint(3, 256, (2, 12), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        ours, ref = (m(x, torch.arange(12).expand(2, 12), NoCache()) for m in (model, plain))
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)


def test_a_deepseek2_gguf_missing_a_size_or_with_a_bad_half_is_named(tmp_path):
    import numpy as np
    from deepseek_gguf import tensors, write_deepseek2

    hf = hf_model("deepseek_v2")
    path = write_deepseek2(hf, tmp_path / "a.gguf", drop=("attention.kv_lora_rank",))
    with pytest.raises(CheckpointError, match="deepseek2.attention.kv_lora_rank is missing"):
        weights.load(path)
    import deepseek_gguf

    def short_k_b(c, name, a, split):  # attn_k_b one latent row short
        out = tensors(c, name, a, split)
        return [(n, np.ascontiguousarray(t[:, :-1]) if "k_b" in n else t) for n, t in out]

    deepseek_gguf.tensors, saved = short_k_b, deepseek_gguf.tensors
    try:
        path = write_deepseek2(hf, tmp_path / "b.gguf")
    finally:
        deepseek_gguf.tensors = saved
    with pytest.raises(CheckpointError, match=r"blk.0.attn_k_b.weight has shape \[4, 31, 16\]"):
        weights.load(path)
