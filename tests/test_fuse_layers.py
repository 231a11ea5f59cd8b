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


def _layers(kind, rows, K=256):
    g = torch.Generator().manual_seed(len(rows))
    out = []
    for n in rows:
        if kind == "int4":
            w = torch.randn(n, K, generator=g)
            portable = quantize.portable_tensors(w, "int4", 32)
            out.append(quantize.make_layer(portable, None, "int4", 32, torch.bfloat16, "cpu"))
        else:  # Q8_0-like (general nibbles) or Q6_K-like (balanced), groups of 32 / 16
            low, G = (-128, 32) if kind == "int8 groups" else (-32, 16)
            q = torch.randint(low, -low, (n, K), generator=g, dtype=torch.int8)
            s = torch.rand(n, K // G, generator=g) * 0.02
            out.append(quant_groups.Int8GroupLinear(q, s, None, None, torch.bfloat16))
    return out


@pytest.mark.isa
@pytest.mark.parametrize("kind", ["int4", "int8 groups", "int8 groups balanced"])
@pytest.mark.parametrize("rows", [(128, 64, 64), (48, 64)])
def test_stacked_kernel_bytes_equal_packing_the_stacked_values(kind, rows, monkeypatch):
    """Fusing stacks the int4 kernel's packed bytes where every layer but the last fills whole
    layout blocks (128, 64, 64 rows): the same bytes and scales as unpacking the layers' values
    and packing them again (the slow twin), and the outputs of the separate layers; a first layer
    of 48 rows ends inside a block and takes the twin."""
    layers = _layers(kind, rows)
    assert all(getattr(m, "layout", None) for m in layers), "no known int4 layout here"
    fused = fuse_layers.concat_rows(layers)
    stack = "stack_int4" if kind == "int4" else "stack_pairs"
    stacked = getattr(fuse_layers, stack)(layers, None)
    assert (stacked is not None) == (rows[0] != 48)  # stacked, not the twin
    monkeypatch.setattr(fuse_layers, stack, lambda layers, bias: None)
    twin = fuse_layers.concat_rows(layers)
    names = ("weight", "scales_and_zeros") if kind == "int4" else ("pair", "pair_scales")
    for name in names:
        assert torch.equal(getattr(fused, name), getattr(twin, name)), name
    packed = [getattr(m, names[0]) for m in layers]
    stacks = fuse_layers.cpu_int4_concat(packed, list(rows), *layers[0].layout) is not None
    assert stacks == (rows[0] != 48)
    x = torch.randn(3, 256).bfloat16()
    assert torch.equal(fused(x), torch.cat([m(x) for m in layers], -1))
