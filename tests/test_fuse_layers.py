"""formats/fuse_layers.py: q/k/v and gate/up stacked into one layer each give the logits of the
separate layers, in every layer format, eager and compiled."""

import pytest
import torch
from helpers import hf_model, save_hf, write_gguf

import quantize
from formats import fuse_layers, quant_groups, weights
from kv_cache import NoCache


def logits(model, n=12):
    x = torch.arange(n)[None] * 7 % model.config.vocab_size
    with torch.no_grad():
        return model(x, torch.arange(n)[None], NoCache())


def fused_copy(path, dtype, mode=None, **load):
    model, _ = weights.load(path, dtype=dtype, **load)
    if mode:
        quantize.quantize_model(model, mode, 32)
    plain = logits(model)
    assert fuse_layers.fuse_projections(model) == 2 * model.config.n_layers
    a, mlp = model.layers[0].self_attn, model.layers[0].mlp
    assert (
        a.q_proj is None
        and mlp.gate_proj is None
        and a.qkv_proj is not None
        and mlp.gate_up_proj is not None
    )
    return model, plain


def test_fused_float64_equals_separate(tmp_path):
    hf = hf_model("qwen2")  # q/k/v with biases
    model, plain = fused_copy(save_hf(hf, tmp_path / "m"), torch.float64)
    torch.testing.assert_close(logits(model), plain, rtol=0, atol=1e-10)


@pytest.mark.isa
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_fused_quantized_layers_equal_separate(tmp_path, mode):
    hf = hf_model("llama3", hidden_size=64, intermediate_size=128)
    model, plain = fused_copy(save_hf(hf, tmp_path / "m"), torch.bfloat16, mode)
    assert isinstance(
        model.layers[0].self_attn.qkv_proj,
        quantize.Int8Linear if mode == "int8" else quantize.Int4Linear,
    )
    torch.testing.assert_close(logits(model), plain, rtol=0, atol=1e-2 * plain.abs().max().item())


@pytest.mark.isa
@pytest.mark.parametrize(
    "qtype,dtype", [("Q8_0", torch.float32), ("Q8_0", torch.bfloat16), ("Q4_1", torch.float32)]
)
def test_fused_gguf_layers_at_their_bits_equal_separate(tmp_path, qtype, dtype):
    """bf16 Q8_0: the int8 groups as two int4 halves (quant_groups.Int8GroupLinear), fused too."""
    hf = hf_model("llama3", hidden_size=64, intermediate_size=128)
    model, plain = fused_copy(write_gguf(hf, tmp_path / "m.gguf", qtype=qtype), dtype)
    kind = quant_groups.Int8GroupLinear if qtype == "Q8_0" else quantize.Int4Linear
    fused = model.layers[0].mlp.gate_up_proj
    assert isinstance(fused, kind) and (getattr(fused, "pair", None) is not None) == (
        dtype == torch.bfloat16
    )
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(logits(model), plain, rtol=0, atol=tol * plain.abs().max().item())


def test_mixed_formats_stay_separate(tmp_path):
    hf = hf_model("llama3", hidden_size=64, intermediate_size=128)
    model, _ = weights.load(save_hf(hf, tmp_path / "m"))
    a = model.layers[0].self_attn
    a.k_proj = quantize.make_layer(
        quantize.quantize_int8(a.k_proj.weight), None, "int8", 0, torch.float32, "cpu"
    )
    assert fuse_layers.fuse_projections(model) == 2 * model.config.n_layers - 1
    assert a.qkv_proj is None and a.q_proj is not None
