"""Mixtures of experts (moe.py) against HF transformers and against themselves: Mixtral, Qwen2-MoE
(a gated shared expert, norm_topk_prob false, a dense layer) and Qwen3-MoE (tests/test_model.py
also runs each through its prefill and static-cache logit checks); the gather and grouped expert
paths against a plain loop over experts, at float and at 8 / 4 bits; compiled == eager; the
engine's batched requests == each alone; int8 / int4 experts within bounds; bad checkpoints."""

import copy
import json
import re

import pytest
import torch
import torch.nn.functional as F
from helpers import alone, hf_model, save_hf

import compiling
import generate
import memory
import moe
import quantize
import runtime
from engine import Engine, RequestParams
from formats import weights
from kv_cache import NoCache, StaticKVCache
from moe import Experts, MoEConfig
from runtime import CheckpointError
from sampling import SamplingParams

MOE = ["mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss"]


@pytest.fixture(scope="module", params=MOE)
def pair(request, tmp_path_factory):
    hf = hf_model(request.param)
    model, _ = weights.load(
        save_hf(hf, tmp_path_factory.mktemp(request.param)), dtype=torch.float32
    )
    return request.param, hf, model


def test_each_family_sets_its_switches():
    def config(arch):
        return weights.config_from_hf(json.loads(hf_model(arch).config.to_json_string()), arch)

    assert config("mixtral").moe == MoEConfig(4, 2, 32, norm_topk_prob=True)
    c = config("qwen2_moe")
    assert (
        c.moe == MoEConfig(4, 2, 32, norm_topk_prob=False, shared_expert_size=48, dense_layers=(1,))
        and c.qkv_bias
    )
    c = config("qwen3_moe")
    assert c.moe == MoEConfig(8, 3, 32, norm_topk_prob=True) and c.qk_norm
    c = config("gpt_oss")
    assert c.moe == MoEConfig(
        4, 2, 32, router_bias=True, expert_bias=True, glu_limit=1.5, glu_alpha=1.702
    )
    assert (
        c.attn_sinks
        and c.qkv_bias
        and c.o_bias
        and c.layer_types == ("sliding_attention", "full_attention")
    )
    assert c.rope_scaling["rope_type"] == "yarn" and c.rope_scaling["truncate"] is False


def test_greedy_tokens_match_hf(pair):
    arch, hf, model = pair
    prompt = torch.randint(3, 256, (1, 8), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf.generate(
            prompt, max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=0
        )[0, 8:]
    ours, _ = generate.generate(
        model,
        StaticKVCache.for_model(model, 1, 48),
        prompt,
        32,
        SamplingParams(0.0),
        generate.DecodeOptions(ignore_eos=True),
    )
    assert ours[0] == list(ref)


def loop_over_experts(experts: Experts, x, idx, w, weight):
    """The slow twin: every token through each of its chosen experts, one at a time, in float64."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            xe = x[t].double()
            h = experts.act(weight("gate_proj", e) @ xe) * (weight("up_proj", e) @ xe)
            out[t] += float(w[t, j]) * (weight("down_proj", e) @ h)
    return out


def random_experts(E=6, dim=64, ff=32, dtype=torch.float64):
    torch.manual_seed(0)
    experts = Experts(E, dim, ff, F.silu)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(0.2 * torch.randn_like(p))
    return experts.to(dtype)


@pytest.mark.parametrize("T", [1, 3, 40])
def test_gather_and_grouped_paths_equal_a_loop_over_experts(T):
    experts = random_experts()
    x = torch.randn(T, 64, dtype=torch.float64)
    w, idx = torch.rand(T, 2, dtype=torch.float64).softmax(-1), torch.randint(0, 6, (T, 2))
    idx[:, 1] = (
        idx[:, 0] + 1 + idx[:, 1] % 5
    ) % 6  # two different experts per token, as topk gives
    ref = loop_over_experts(experts, x, idx, w, lambda name, e: getattr(experts, name)[e].double())
    torch.testing.assert_close(experts.gathered(x, idx, w), ref, atol=1e-12, rtol=0)
    torch.testing.assert_close(experts.grouped(x, idx, w), ref, atol=1e-12, rtol=0)


@pytest.mark.isa  # Int8Experts runs bf16 on the CPU int8 kernel
@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_experts_paths_equal_their_dequantized_loop(mode, dtype):
    experts = random_experts(dtype=torch.float32)
    q = moe.quantized(
        copy.deepcopy(experts).to(dtype), mode, lambda w: quantize.portable_tensors(w, mode, 32)
    )
    x = torch.randn(40, 64).to(dtype)
    w, idx = (
        torch.rand(40, 2).softmax(-1),
        torch.stack([torch.arange(40) % 6, (torch.arange(40) + 2) % 6], 1),
    )

    def dequantized(name, e):
        return q.weights(name, torch.tensor([e]), torch.float64)[0]

    if (
        mode == "int4"
    ):  # weights() against the layout written out by hand: byte j = values 2j (low), 2j + 1 (high)
        packed, scales, offsets = (
            q.gate_proj[1],
            q.gate_proj_scales[1].double(),
            q.gate_proj_offsets[1].double(),
        )
        values = (
            torch.stack([packed % 16, packed // 16], dim=-1).reshape(packed.shape[0], -1).double()
        )
        by_hand = (
            (values - 8).view(values.shape[0], -1, 32) * scales[..., None] + offsets[..., None]
        ).flatten(1)
        torch.testing.assert_close(dequantized("gate_proj", 1), by_hand, atol=1e-12, rtol=0)
    ref = loop_over_experts(q, x, idx, w, dequantized)
    tol = 1e-4 if dtype == torch.float32 else 0.1  # bf16 activations: the product's own rounding
    torch.testing.assert_close(q.gathered(x, idx, w).double(), ref, atol=tol, rtol=0.02)
    torch.testing.assert_close(q.grouped(x, idx, w).double(), ref, atol=tol, rtol=0.02)
    # and the quantized weights near the float ones
    exact = loop_over_experts(
        experts, x.float(), idx, w, lambda name, e: getattr(experts, name)[e].double()
    )
    error = (ref - exact).norm() / exact.norm()
    assert error < (0.02 if mode == "int8" else 0.15), f"{mode} experts: relative error {error:.3f}"


def quantized_logit_error(arch, mode, folder):
    """(relative logit error of the model quantized by quantize_model, the model, its report)."""
    model, _ = weights.load(save_hf(hf_model(arch), folder), dtype=torch.float32)
    x = torch.randint(3, 256, (1, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = model(x, torch.arange(24)[None], NoCache())
        report = quantize.quantize_model(model, mode, 32)
        ours = model(x, torch.arange(24)[None], NoCache())
    return float((ours - ref).norm() / ref.norm()), model, report


def projection_bytes(experts):  # (biases stay float)
    return sum(
        t.numel() * t.element_size()
        for n, t in experts.state_dict().items()
        if not n.endswith("_bias")
    )


@pytest.mark.parametrize("arch", ["qwen2_moe", "gpt_oss"])
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_moe_model_stays_as_close_as_a_dense_one(mode, arch, tmp_path):
    """The logits' error at 8 / 4 bits within 1.5x that of a dense Llama of the same size quantized
    the same way (gpt-oss's expert biases stay float beside the quantized projections)."""
    float_bytes = projection_bytes(
        weights.load(save_hf(hf_model(arch), tmp_path / "f"))[0].layers[0].mlp.experts
    )
    error, model, report = quantized_logit_error(arch, mode, tmp_path / "m")
    dense, _, _ = quantized_logit_error("llama3", mode, tmp_path / "d")
    assert "layers.0.mlp.experts" in report["quantized"] and "layers.0.mlp.gate" in report["kept"]
    assert projection_bytes(model.layers[0].mlp.experts) < float_bytes / (
        3.5 if mode == "int8" else 5
    )
    assert error < 1.5 * dense, (
        f"{arch} {mode}: relative logit error {error:.3f}, a dense Llama's {dense:.3f}"
    )


def test_compiled_decode_equals_eager(pair):
    arch, _, model = pair
    import torch._dynamo

    torch._dynamo.reset()
    prompt = torch.randint(3, 256, (2, 12), generator=torch.Generator().manual_seed(4))
    eager, _ = generate.generate(
        model,
        StaticKVCache.for_model(model, 2, 64),
        prompt,
        20,
        SamplingParams(0.0),
        generate.DecodeOptions(ignore_eos=True),
    )
    compiled, _ = generate.generate(
        model,
        StaticKVCache.for_model(model, 2, 64),
        prompt,
        20,
        SamplingParams(0.0),
        generate.DecodeOptions(
            ignore_eos=True, decode_fn=compiling.compile_decode("cpu", autotune=False)
        ),
    )
    assert compiled == eager


@pytest.mark.parametrize("arch", ["qwen2_moe", "gpt_oss"])
def test_engine_batches_equal_each_request_alone(arch, tmp_path):
    """Different prompts in one flat step route their tokens to different experts (gpt-oss: its
    sinks and windows through the paged cache): float64, exact."""
    model, _ = weights.load(save_hf(hf_model(arch), tmp_path / "m"), dtype=torch.float64)
    engine = Engine.for_model(
        model, num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=24
    )
    prompts = [[5 + (i * 7 + j) % 200 for j in range(6 + 5 * i)] for i in range(4)]
    out = engine.run_batch(
        prompts, RequestParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    )
    assert [r["tokens"] for r in out] == [alone(model, p, 12) for p in prompts]


def test_active_bytes_count_only_the_chosen_experts(pair):
    """By hand from the config: each sparse layer's E - k unchosen experts, 3 projections of ff x
    dim float32 values (and gpt-oss's biases, ff + ff + dim of them), are not read."""
    _, _, model = pair
    c, m = model.config, model.config.moe
    per_expert = 4 * (
        3 * m.intermediate_size * c.dim + m.expert_bias * (2 * m.intermediate_size + c.dim)
    )
    unused = (c.n_layers - len(m.dense_layers)) * (m.n_experts - m.n_experts_per_tok) * per_expert
    dense_read = model.weight_bytes() - model.embed_tokens.weight.numel() * 4 * (
        not c.tie_word_embeddings
    )
    assert model.bytes_read_per_token() == dense_read - unused


def test_missing_or_misshapen_experts_are_named(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = save_hf(hf_model("mixtral"), tmp_path / "m")
    tensors = load_file(folder / "model.safetensors")
    name = "model.layers.1.block_sparse_moe.experts.3.w2.weight"
    broken = {k: v for k, v in tensors.items() if k != name}
    save_file(broken, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        CheckpointError, match=r"layers\.1\.mlp\.experts\.down_proj is missing experts \[3\]"
    ):
        weights.load(folder)
    broken[name] = tensors[name][:, :16].contiguous()
    save_file(broken, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        CheckpointError,
        match=r"expert 3 of layers\.1\.mlp\.experts\.down_proj has shape \(64, 16\)",
    ):
        weights.load(folder)
    broken[name] = tensors[name]
    broken[name.replace(".3.", ".7.")] = tensors[name].clone()
    save_file(broken, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="is expert 7, but the config has 4 experts"):
        weights.load(folder)


def test_folders_written_back_load_in_transformers_and_here(pair, tmp_path):
    """save_hf_folder writes the family's config and one tensor per expert, as published: HF
    transformers and weights.load read it to the same logits."""
    from transformers import AutoModelForCausalLM

    from formats import hf_folder

    arch, _, model = pair
    folder = hf_folder.save_hf_folder(model, tmp_path / "back")
    x = torch.randint(3, 256, (1, 10), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = model(x, torch.arange(10)[None], NoCache())
        hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
        torch.testing.assert_close(hf(x).logits, ref, atol=1e-4, rtol=0)
        again, _ = weights.load(folder)
        assert again.config == model.config
        torch.testing.assert_close(again(x, torch.arange(10)[None], NoCache()), ref, atol=0, rtol=0)


@pytest.mark.parametrize("arch", ["qwen2_moe", "gpt_oss"])
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_folders_hold_the_experts_at_their_bits(mode, arch, tmp_path):
    """quantize.py's folder of a MoE: each projection stacked over the experts (and gpt-oss's
    biases), read back to the layers quantize_model makes in memory (same logits)."""
    from formats import hf_folder

    model, _ = weights.load(save_hf(hf_model(arch), tmp_path / "m"), dtype=torch.float32)
    report = hf_folder.save_quantized(model, tmp_path / mode, mode, 32)
    assert "layers.0.mlp.experts" in report["quantized"]
    loaded, info = weights.load(tmp_path / mode)
    quantize.quantize_model(model, mode, 32)
    kind = moe.Int8Experts if mode == "int8" else moe.GroupExperts
    assert type(loaded.layers[0].mlp.experts) is kind and type(model.layers[0].mlp.experts) is kind
    x = torch.randint(3, 256, (1, 10), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        ours, ref = (m(x, torch.arange(10)[None], NoCache()) for m in (loaded, model))
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=0)


def test_parameter_counts_match_the_published_totals():
    """Model cards: Mixtral-8x7B 46.7B parameters, 12.9B active; Qwen3-30B-A3B 30.5B, 3.3B
    active."""
    from model import ModelConfig

    mixtral = ModelConfig(
        vocab_size=32000,
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        intermediate_size=14336,
        moe=MoEConfig(8, 2, 14336),
    )
    qwen3 = ModelConfig(
        vocab_size=151936,
        dim=2048,
        n_layers=48,
        n_heads=32,
        n_kv_heads=4,
        intermediate_size=6144,
        head_dim=128,
        moe=MoEConfig(128, 8, 768),
    )
    for c, total, active in ((mixtral, 46.7, 12.9), (qwen3, 30.5, 3.3)):
        counted = [n / 1e9 for n in c.moe.parameter_counts(c)]
        assert counted == pytest.approx([total, active], rel=0.02)  # the cards round to one decimal


def test_the_memory_plan_prints_total_and_active_parameters(pair):
    _, _, model = pair
    c = model.config
    total, active = c.moe.parameter_counts(c)
    line = memory.memory_plan(model, StaticKVCache.for_model(model, 1, 16))
    assert f"{total / 1e9:.2f}B parameters, {active / 1e9:.2f}B active per token" in line
    assert f"({c.moe.n_experts_per_tok} of {c.moe.n_experts} experts)" in line
    assert runtime.human(model.bytes_read_per_token()) + " read per step" in line


GGUF_ARCH = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}


@pytest.mark.parametrize("arch", GGUF_ARCH)
def test_gguf_written_as_llama_cpp_does_equals_its_hf_twin(arch, tmp_path):
    """Stacked ffn_*_exps [E, out, in], the router ffn_gate_inp, Qwen2-MoE's *_shexp tensors and its
    dense layer (no router tensor), expert_* metadata; prefill then token-by-token decode."""
    from helpers import prefill_then_decode, write_gguf

    hf = hf_model(arch)
    model, _ = weights.load(
        write_gguf(hf, tmp_path / f"{arch}.gguf", arch=GGUF_ARCH[arch]), dtype=torch.float32
    )
    twin, _ = weights.load(save_hf(hf, tmp_path / "hf"), dtype=torch.float32)
    assert model.config.moe == twin.config.moe
    x = torch.randint(3, 256, (1, 24), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        ref = hf(x).logits
    torch.testing.assert_close(prefill_then_decode(model, x, 16), ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q5_1"])
def test_gguf_experts_at_their_own_bits_equal_gguf_dequantization(qtype, tmp_path):
    """Each expert projection kept at the file's bits (GroupExperts: 4-bit where Q4_* is exact, else
    8-bit groups) dequantizes to gguf.quants' own values, and the model equals its dequantized
    twin."""
    import gguf
    from helpers import write_gguf

    path = write_gguf(
        hf_model("qwen2_moe"), tmp_path / f"{qtype}.gguf", arch="qwen2moe", qtype=qtype
    )
    model, info = weights.load(path, dtype=torch.float32)
    experts = model.layers[0].mlp.experts
    assert (
        type(experts) is moe.GroupExperts
        and f"{qtype} -> {'int4' if qtype.startswith('Q4') else 'int8'} g32" in info.own_bits
    )
    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    for name, projection in (
        ("gate_exps", "gate_proj"),
        ("up_exps", "up_proj"),
        ("down_exps", "down_proj"),
    ):
        t = tensors[f"blk.0.ffn_{name}.weight"]
        reference = torch.from_numpy(
            gguf.quants.dequantize(t.data, t.tensor_type).copy()
        )  # [E, N, K]
        ours = experts.weights(projection, torch.arange(experts.n_experts), torch.float32)
        assert torch.equal(ours, reference), (
            f"{qtype} {projection}: {(ours - reference).abs().max()}"
        )
    plain, _ = weights.load(path, dtype=torch.float32, dequantize=True)
    x = torch.randint(3, 256, (2, 12), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        ours, ref = (m(x, torch.arange(12).expand(2, 12), NoCache()) for m in (model, plain))
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)


def rewrite_gguf(src, dst, keys=None, rename=None):
    """A copy of GGUF file `src` with metadata `keys` set ({key: value} as uint32 where new) and the
    tensors in `rename` replaced ({name: [(new name, array), ...]})."""
    import gguf
    import numpy as np

    reader, keys = gguf.GGUFReader(str(src)), dict(keys or {})
    w = gguf.GGUFWriter(str(dst), str(reader.fields["general.architecture"].contents()))
    for key, f in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        sub = gguf.GGUFValueType(f.types[-1]) if len(f.types) > 1 else None
        w.add_key_value(
            key, keys.pop(key, f.contents()), gguf.GGUFValueType(f.types[0]), sub_type=sub
        )
    for key, value in keys.items():
        w.add_uint32(key, value)
    for t in reader.tensors:
        for name, data in (rename or {}).get(t.name, [(t.name, np.asarray(t.data))]):
            w.add_tensor(name, data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


@pytest.mark.parametrize(
    "keys, message",
    [
        ({"qwen3moe.expert_used_count": 0}, "experts per token (0) <= experts (8)"),
        ({"qwen3moe.expert_used_count": 9}, "experts per token (9) <= experts (8)"),
        ({"qwen3moe.expert_count": 0}, "expert_count is missing or 0"),
        ({"qwen3moe.expert_feed_forward_length": 7}, "expected (8, 7, 64)"),
    ],
)
def test_gguf_expert_counts_that_contradict_are_named(tmp_path, keys, message):
    """Each a CheckpointError naming the metadata or the tensor (an expert_used_count above the
    experts raised a bare ValueError)."""
    from helpers import write_gguf

    path = write_gguf(hf_model("qwen3_moe"), tmp_path / "m.gguf", arch="qwen3moe")
    with pytest.raises(CheckpointError, match=re.escape(message)):
        weights.load(rewrite_gguf(path, tmp_path / "bad.gguf", keys=keys))


def test_bad_gguf_experts_are_named(tmp_path):
    """Metadata that contradicts the expert tensors, sigmoid routing, and experts one tensor
    each."""
    import gguf
    import numpy as np
    from helpers import write_gguf

    path = write_gguf(hf_model("qwen3_moe"), tmp_path / "m.gguf", arch="qwen3moe")
    bad = rewrite_gguf(path, tmp_path / "count.gguf", keys={"qwen3moe.expert_count": 16})
    with pytest.raises(
        CheckpointError,
        match=r"tensor 'layers\.0\.mlp\.experts\.gate_proj' has shape \(8, 32, 64\), "
        r"expected \(16, 32, 64\)",
    ):
        weights.load(bad)
    bad = rewrite_gguf(path, tmp_path / "gating.gguf", keys={"qwen3moe.expert_gating_func": 2})
    with pytest.raises(CheckpointError, match="expert_gating_func 2 is not supported"):
        weights.load(bad)
    stacked = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}["blk.0.ffn_gate_exps.weight"]
    per_expert = [(f"blk.0.ffn_gate.{e}.weight", np.asarray(stacked.data)[e]) for e in range(8)]
    old = rewrite_gguf(
        path, tmp_path / "old.gguf", rename={"blk.0.ffn_gate_exps.weight": per_expert}
    )
    with pytest.raises(CheckpointError, match="an older llama.cpp layout"):
        weights.load(old)


@pytest.mark.parametrize("qtype", ["F32", "MXFP4"])
def test_gpt_oss_gguf_equals_its_hf_twin_and_gguf_dequantization(qtype, tmp_path):
    """A gpt-oss GGUF as llama.cpp lays it out: attn_sinks, post_attention_norm, expert and router
    biases, windows on every other layer, YaRN's beta keys (llama.cpp keeps the SwiGLU limit in its
    code: 7, so the twin has 7). F32: the HF twin's logits, prefill then decode. MXFP4 experts: kept
    at 4 bits, equal to gguf.quants' dequantization, the model to its dequantized twin."""
    import gguf
    from helpers import write_gguf

    hf = hf_model("gpt_oss", swiglu_limit=7.0)
    path = write_gguf(hf, tmp_path / f"{qtype}.gguf", arch="gpt-oss", qtype=qtype)
    model, info = weights.load(path, dtype=torch.float32)
    twin, _ = weights.load(save_hf(hf, tmp_path / "hf"), dtype=torch.float32)
    assert (model.config.moe, model.config.layer_types, model.config.attn_sinks) == (
        twin.config.moe,
        twin.config.layer_types,
        True,
    )
    x = torch.randint(3, 256, (1, 24), generator=torch.Generator().manual_seed(8))
    cache = StaticKVCache.for_model(model, 1, 32)
    with torch.no_grad():
        ours = [model(x[:, :16], torch.arange(16)[None], cache)]
        ours += [model(x[:, t : t + 1], torch.full((1, 1), t), cache) for t in range(16, 24)]
        ours = torch.cat(ours, 1)
        if qtype == "F32":
            torch.testing.assert_close(ours, hf(x).logits, atol=1e-4, rtol=0)
            return
        plain, _ = weights.load(path, dtype=torch.float32, dequantize=True)
        torch.testing.assert_close(
            ours, plain(x, torch.arange(24)[None], NoCache()), atol=1e-4, rtol=0
        )
    assert (
        "MXFP4 -> e2m1 g32: experts.gate_proj, experts.up_proj, experts.down_proj" in info.own_bits
    )
    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    experts = model.layers[1].mlp.experts
    for name, projection in (
        ("gate_exps", "gate_proj"),
        ("up_exps", "up_proj"),
        ("down_exps", "down_proj"),
    ):
        t = tensors[f"blk.1.ffn_{name}.weight"]
        reference = torch.from_numpy(
            gguf.quants.dequantize(t.data, t.tensor_type).copy()
        )  # [E, N, K]
        assert torch.equal(
            experts.weights(projection, torch.arange(experts.n_experts), torch.float32), reference
        )


def test_a_misshapen_gpt_oss_gate_up_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = save_hf(hf_model("gpt_oss"), tmp_path / "m")
    tensors = load_file(folder / "model.safetensors")
    name = "model.layers.0.mlp.experts.gate_up_proj"
    tensors[name] = tensors[name][
        ..., :-1
    ].contiguous()  # an odd width: gate and up cannot interleave
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        CheckpointError, match=r"layers\.0\.mlp\.experts\.gate_up_proj' has shape \(4, 64, 63\)"
    ):
        weights.load(folder)
