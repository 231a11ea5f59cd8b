"""formats/mxfp4.py: gpt-oss folders whose experts are MXFP4 blocks, written here in the published
layout, decode to the values transformers' own dequantization gives, and the model equals
transformers'."""

import json
import re

import pytest
import torch
from helpers import hf_model, save_hf
from safetensors.torch import load_file, save_file

import moe
from formats import weights
from kv_cache import NoCache, StaticKVCache
from runtime import CheckpointError


def mxfp4_values(E, N, K, seed):
    """Random codes and exponents, and the weights [E, N, K] they stand for (so packing loses
    nothing)."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (E, N, K), generator=g, dtype=torch.uint8)
    scales = torch.randint(
        121, 126, (E, N, K // 32), generator=g, dtype=torch.uint8
    )  # 2^-6 .. 2^-2
    values = moe.E2M1[codes.long()] * torch.exp2(scales.float() - 127).repeat_interleave(32, dim=-1)
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).reshape(
        E, N, K // 32, 16
    )  # code 2j low, 2j + 1 high
    return values, blocks, scales


def mxfp4_folder(tmp_path, dim=64, ff=32):
    """A tiny gpt-oss folder laid out as openai/gpt-oss-20b: experts as *_blocks / *_scales [E, out,
    ...] (gate_up rows interleaved), everything else float, quantization_config mxfp4."""
    hf = hf_model("gpt_oss", hidden_size=dim, intermediate_size=ff)
    folder = save_hf(hf, tmp_path / "float")
    tensors = load_file(folder / "model.safetensors")
    E = hf.config.num_local_experts
    for layer in range(hf.config.num_hidden_layers):
        prefix = f"model.layers.{layer}.mlp.experts."
        for i, (name, (N, K)) in enumerate(
            (("gate_up_proj", (2 * ff, dim)), ("down_proj", (dim, ff)))
        ):
            values, blocks, scales = mxfp4_values(E, N, K, seed=10 * layer + i)
            del tensors[prefix + name]
            tensors[prefix + name + "_blocks"], tensors[prefix + name + "_scales"] = blocks, scales
    out = tmp_path / "mxfp4"
    out.mkdir()
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_blocks_decode_to_transformers_dequantization(tmp_path):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    folder = mxfp4_folder(tmp_path)
    model, info = weights.load(folder, dtype=torch.float32)
    assert "mxfp4 -> e2m1 g32" in info.own_bits
    tensors = load_file(folder / "model.safetensors")
    for layer in range(2):
        experts = model.layers[layer].mlp.experts
        assert type(experts) is moe.GroupExperts and experts.kinds["gate_proj"] == "e2m1"
        prefix = f"model.layers.{layer}.mlp.experts."
        ids = torch.arange(experts.n_experts)
        for name, ours in (
            (
                "gate_up_proj",
                torch.stack(
                    [
                        experts.weights("gate_proj", ids, torch.float32),
                        experts.weights("up_proj", ids, torch.float32),
                    ],
                    2,
                ),
            ),
            ("down_proj", experts.weights("down_proj", ids, torch.float32)),
        ):
            # transformers: [E, in, out], gate and up columns interleaved
            ref = convert_moe_packed_tensors(
                tensors[prefix + name + "_blocks"],
                tensors[prefix + name + "_scales"],
                dtype=torch.float32,
            )
            assert torch.equal(
                ours.flatten(1, 2) if name == "gate_up_proj" else ours, ref.transpose(1, 2)
            )


def test_mxfp4_model_equals_transformers_on_the_same_folder(tmp_path):
    """transformers dequantizes the blocks on CPU; ours keeps them at 4 bits: prefill and decode
    logits."""
    from transformers import AutoModelForCausalLM

    folder = mxfp4_folder(tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    model, _ = weights.load(folder, dtype=torch.float32)
    plain, _ = weights.load(folder, dtype=torch.float32, dequantize=True)
    assert type(plain.layers[0].mlp.experts) is moe.Experts
    x = torch.randint(3, 256, (1, 24), generator=torch.Generator().manual_seed(3))
    cache = StaticKVCache.for_model(model, 1, 32)
    with torch.no_grad():
        ref = hf(x).logits
        ours = [model(x[:, :16], torch.arange(16)[None], cache)]
        ours += [model(x[:, t : t + 1], torch.full((1, 1), t), cache) for t in range(16, 24)]
        torch.testing.assert_close(torch.cat(ours, 1), ref, atol=1e-4, rtol=0)
        torch.testing.assert_close(
            plain(x, torch.arange(24)[None], NoCache()), ref, atol=1e-4, rtol=0
        )


def test_incomplete_or_misshapen_blocks_are_named(tmp_path):
    folder = mxfp4_folder(tmp_path)
    tensors = load_file(folder / "model.safetensors")
    name = "model.layers.1.mlp.experts.down_proj_scales"
    broken = {k: v for k, v in tensors.items() if k != name}
    save_file(broken, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        CheckpointError,
        match=r"layers\.1\.mlp\.experts\.down_proj_blocks has no "
        r"layers\.1\.mlp\.experts\.down_proj_scales",
    ):
        weights.load(folder)
    broken[name] = tensors[name].to(torch.int32)
    save_file(broken, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="are not MXFP4"):
        weights.load(folder)


BLOCKS, SCALES = (
    "model.layers.0.mlp.experts.gate_up_proj_blocks",
    "model.layers.0.mlp.experts.gate_up_proj_scales",
)
MISSHAPEN = {  # blocks [E, N, K/32, 16], scales [E, N, K/32]: each cut, and what the error names
    "bytes per block": ({BLOCKS: lambda t: t[..., :8]}, "are not MXFP4"),
    "experts in the blocks": ({BLOCKS: lambda t: t[1:]}, "(3, 64, 2, 16)"),
    "experts in the scales": ({SCALES: lambda t: t[1:]}, "(3, 64, 2)"),
    "groups in the scales": ({SCALES: lambda t: t[..., :-1]}, "(4, 64, 1)"),
    "scales without experts": ({SCALES: lambda t: t[0]}, "are not MXFP4"),
    "groups in both": (
        {BLOCKS: lambda t: t[..., :-1, :], SCALES: lambda t: t[..., :-1]},
        "has shape (4, 32, 32), expected (4, 32, 64)",
    ),
    "rows in both": (
        {BLOCKS: lambda t: t[:, ::2], SCALES: lambda t: t[:, ::2]},
        "has shape (4, 16, 64), expected (4, 32, 64)",
    ),
}


@pytest.mark.parametrize("cut", sorted(MISSHAPEN))
def test_misshapen_blocks_and_scales_are_named(tmp_path, cut):
    """gpt-oss's published layout with one size wrong: a CheckpointError naming the tensors and
    their shapes, or the expert weight they decode to and the shape the config asks for."""
    folder = mxfp4_folder(tmp_path)
    tensors = load_file(folder / "model.safetensors")
    change, message = MISSHAPEN[cut]
    tensors.update({name: f(tensors[name]).contiguous() for name, f in change.items()})
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=re.escape(message)):
        weights.load(folder)
