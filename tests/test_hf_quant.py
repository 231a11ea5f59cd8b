"""formats/hf_quant.py: folders quantized by GPTQ, AWQ and compressed-tensors, written here in each
format's published packing, load as int4 layers whose weights are exactly the format's own
dequantization.

The GPTQ and AWQ folders are packed by this file, following AutoGPTQ's QuantLinear.pack and
AutoAWQ's WQLinear_GEMM.from_linear line by line (those packages need CUDA builds that cannot
install here); the compressed-tensors folders are packed by the compressed-tensors package itself
and are also loaded by HF transformers, which dequantizes them through that package.
"""

import json

import pytest
import torch
from helpers import hf_model, save_hf
from safetensors.torch import load_file, save_file

import quantize
from formats import hf_quant, weights
from formats.quant_groups import Int8GroupLinear
from formats.weights import CheckpointError
from kv_cache import NoCache

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ's order_map


@pytest.fixture(scope="module")
def hf():
    return hf_model(
        "llama3"
    )  # TINY: K in {64, 96}, N in {32, 64, 96}: groups of 32 fit every layer


def logits(model, n=16):
    with torch.no_grad():
        return model(
            torch.arange(n)[None] * 7 % model.config.vocab_size, torch.arange(n)[None], NoCache()
        )


def random_layers(hf, group, zeros=(0, 16), seed=0, scale_dtype=torch.float16):
    """{"model.layers.i.….proj": (q [N, K], z [N, K/G], s [N, K/G])}: 4-bit q in [0, 15], the real
    zero point z in `zeros`, scales in scale_dtype (a group of -1 is one group over all of K)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, w in hf.state_dict().items():
        if name.startswith("model.layers.") and name.endswith("proj.weight"):
            N, K = w.shape
            groups = 1 if group == -1 else K // group
            q = torch.randint(0, 16, (N, K), generator=g)
            z = torch.randint(*zeros, (N, groups), generator=g)
            s = (0.005 + 0.02 * torch.rand(N, groups, generator=g)).to(scale_dtype)
            out[name.removesuffix(".weight")] = (q, z, s)
    return out


def dequantized(q, z, s):
    """The formats' definition w = s * (q - z), in float32: exact for fp16/bf16 scales (|q - z| <=
    16)."""
    G = q.shape[1] // s.shape[1]
    return s.float().repeat_interleave(G, 1) * (q - z.repeat_interleave(G, 1)).float()


def as_int32(words):  # uint32 bit patterns held in int64 -> int32, as numpy's astype(np.int32)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_gptq(q, z, s, zero_offset):
    """AutoGPTQ's pack: qweight [K/8, N] with q[8r + j] << 4j, qzeros [K/G, N/8] with (z -
    offset)[8c + j] << 4j."""
    intweight, zeros = q.t(), (z - zero_offset).t()  # [K, N], [K/G, N]
    qweight = sum(intweight[j::8] << (4 * j) for j in range(8))
    qzeros = sum(zeros[:, j::8] << (4 * j) for j in range(8))
    return {"qweight": as_int32(qweight), "qzeros": as_int32(qzeros), "scales": s.t().contiguous()}


def pack_awq(q, z, s):
    """AutoAWQ's WQLinear_GEMM: qweight[:, col] |= intweight[:, col * 8 + order_map[i]] << 4i,
    qzeros alike."""
    intweight, zeros = q.t(), z.t()  # [K, N], [K/G, N]
    qweight = sum(intweight[:, AWQ_ORDER[i] :: 8] << (4 * i) for i in range(8))
    qzeros = sum(zeros[:, AWQ_ORDER[i] :: 8] << (4 * i) for i in range(8))
    return {"qweight": as_int32(qweight), "qzeros": as_int32(qzeros), "scales": s.t().contiguous()}


def write_folder(hf, folder, quant_config, tensors_of, layers, shards=1):
    """The HF folder of `hf` with each layer's weight replaced by tensors_of(q, z, s), in `shards`
    files that split every layer's tensors between them."""
    save_hf(hf, folder)
    state = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    for prefix, (q, z, s) in layers.items():
        del state[f"{prefix}.weight"]
        state.update({f"{prefix}.{k}": v.contiguous() for k, v in tensors_of(q, z, s).items()})
    names = sorted(state)
    files = (
        [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
        if shards > 1
        else ["model.safetensors"]
    )
    for i, file in enumerate(files):
        save_file({n: state[n] for n in names[i::shards]}, folder / file, metadata={"format": "pt"})
    if shards > 1:
        index = {"metadata": {}, "weight_map": {n: files[i % shards] for i, n in enumerate(names)}}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    config = json.loads((folder / "config.json").read_text())
    if quant_config is not None:
        config["quantization_config"] = quant_config
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def float_folder(hf, folder, layers):
    """The same model with each quantized layer's dequantized float32 weight: the slow twin."""
    return write_folder(hf, folder, None, lambda q, z, s: {"weight": dequantized(q, z, s)}, layers)


def gptq_config(group=32, fmt="gptq", sym=True, **kw):
    return {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": group,
        "desc_act": False,
        "sym": sym,
        "true_sequential": True,
        "damp_percent": 0.01,
        "static_groups": False,
        "checkpoint_format": fmt,
        **kw,
    }


def gptq_tensors(fmt, group=32):
    def tensors(q, z, s):
        K = q.shape[1]
        g_idx = torch.arange(K, dtype=torch.int32) // (K if group == -1 else group)
        return {
            **pack_gptq(q, z, s, {"gptq": 1, "gptq_v2": 0}[fmt]),
            "g_idx": g_idx,
        }  # v1 stores z - 1

    return tensors


AWQ_CONFIG = {
    "quant_method": "awq",
    "zero_point": True,
    "group_size": 32,
    "bits": 4,
    "version": "gemm",
    "modules_to_not_convert": None,
}

# name: (quant_config, tensors_of, zero points), as each tool writes them. Classic GPTQ stores z -
# 1, so its zeros are 1..15 (a stored -1 would spill into the next nibble); symmetric means z = 8.
FORMATS = {
    "gptq_sym": (gptq_config(), gptq_tensors("gptq"), (8, 9)),
    "gptq_asym": (gptq_config(sym=False), gptq_tensors("gptq"), (1, 16)),
    "gptq_v2_asym": (gptq_config(fmt="gptq_v2", sym=False), gptq_tensors("gptq_v2"), (0, 16)),
    "awq_gemm": (AWQ_CONFIG, pack_awq, (0, 16)),
}


def check_layers(model, layers, kind=quantize.Int4Linear):
    for prefix, (q, z, s) in layers.items():
        layer = model.get_submodule(prefix.removeprefix("model."))
        assert isinstance(layer, kind), (prefix, type(layer))
        torch.testing.assert_close(layer.dequantize(), dequantized(q, z, s), rtol=0, atol=0)


@pytest.mark.isa  # the int4 kernel's packed layout differs by instruction set
@pytest.mark.parametrize("name", sorted(FORMATS))
def test_gptq_and_awq_layers_are_int4_and_equal_the_formats_dequantization(hf, tmp_path, name):
    quant_config, tensors_of, zeros = FORMATS[name]
    layers = random_layers(hf, 32, zeros)
    folder = write_folder(
        hf, tmp_path / name, quant_config, tensors_of, layers, shards=2 if name == "gptq_sym" else 1
    )
    model, info = weights.load(folder)
    check_layers(model, layers)
    assert info.format == f"safetensors {quant_config['quant_method']}"
    assert (
        info.own_bits.startswith(f"{quant_config['quant_method']} int4 g32 -> int4 g32: ")
        and "q_proj" in info.own_bits
    )
    reference, _ = weights.load(float_folder(hf, tmp_path / "float", layers))
    torch.testing.assert_close(logits(model), logits(reference), rtol=0, atol=1e-4)


def test_gptq_one_group_over_all_of_k_runs_at_the_largest_kernel_group(hf, tmp_path):
    layers = random_layers(hf, -1, (1, 16))
    model, info = weights.load(
        write_folder(hf, tmp_path, gptq_config(-1, sym=False), gptq_tensors("gptq", -1), layers)
    )
    check_layers(
        model, layers
    )  # exact: each scale repeated over K / 64 (or K / 32 for K = 96) groups
    assert (
        model.layers[0].self_attn.q_proj.groupsize == 64
        and model.layers[0].mlp.down_proj.groupsize == 32
    )
    assert "gptq int4 g96 -> int4 g32: down_proj" in info.own_bits


def test_a_group_size_the_kernels_lack_runs_as_int8_groups(hf, tmp_path, capsys):
    layers = random_layers(hf, 16, (1, 16))
    model, _ = weights.load(
        write_folder(
            hf, tmp_path / "g16", gptq_config(16, sym=False), gptq_tensors("gptq", 16), layers
        )
    )
    check_layers(model, layers, Int8GroupLinear)
    assert "group size 16" in capsys.readouterr().err
    reference, _ = weights.load(float_folder(hf, tmp_path / "float", layers))
    torch.testing.assert_close(logits(model), logits(reference), rtol=0, atol=1e-4)


def test_dequantize_gives_float_layers(hf, tmp_path):
    layers = random_layers(hf, 32, (0, 16))
    model, info = weights.load(
        write_folder(hf, tmp_path, AWQ_CONFIG, pack_awq, layers), dequantize=True
    )
    assert type(model.layers[0].self_attn.q_proj) is torch.nn.Linear and not info.own_bits
    torch.testing.assert_close(
        model.layers[1].mlp.up_proj.weight,
        dequantized(*layers["model.layers.1.mlp.up_proj"]),
        rtol=0,
        atol=0,
    )


# ---- compressed-tensors, packed by the package, loaded by transformers too --------------------


def write_compressed_tensors(hf, folder, layers, strategy, symmetric):
    """An llm-compressor-style folder: each layer compressed by the package's
    PackedQuantizationCompressor (its own quantize + pack_to_int32), the config written by its
    ModelCompressor."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.compressors.pack_quantized import PackedQuantizationCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
    )

    args = QuantizationArgs(
        num_bits=4,
        type="int",
        strategy=strategy,
        symmetric=symmetric,
        group_size=32 if strategy == "group" else None,
    )
    scheme = QuantizationScheme(targets=["Linear"], weights=args)

    def compress(q, z, s):  # the package stores signed values: q - 8 in [-8, 7], zero point z - 8
        state = {
            "weight": dequantized(q, z, s),
            "weight_scale": s,
            "weight_zero_point": (z - 8).to(torch.int8),
        }
        return PackedQuantizationCompressor.compress(state, scheme)

    write_folder(hf, folder, None, compress, layers)
    config = QuantizationConfig(
        config_groups={"group_0": scheme},
        format="pack-quantized",
        ignore=["lm_head"],
        quantization_status="compressed",
    )
    ModelCompressor(quantization_config=config).update_config(str(folder))
    return folder


# (strategy, symmetric, scale dtype). llm-compressor writes scales in the model's dtype: float32
# scales here hold bf16 values, so the package's float32 dequantization is exact too.
CT_CASES = {
    "group_sym": ("group", True, torch.float32),
    "group_asym": ("group", False, torch.float32),
    "channel_asym": ("channel", False, torch.float32),
    "group_asym_bf16": ("group", False, torch.bfloat16),
}


@pytest.mark.parametrize("name", sorted(CT_CASES))
def test_compressed_tensors_equal_the_package_and_transformers(hf, tmp_path, name):
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    strategy, symmetric, dtype = CT_CASES[name]
    layers = random_layers(
        hf,
        32 if strategy == "group" else -1,
        (8, 9) if symmetric else (0, 16),
        scale_dtype=torch.bfloat16,
    )
    layers = {k: (q, z, s.to(dtype)) for k, (q, z, s) in layers.items()}
    folder = write_compressed_tensors(hf, tmp_path / name, layers, strategy, symmetric)
    stored = load_file(folder / "model.safetensors")
    assert ("model.layers.0.self_attn.q_proj.weight_zero_point" in stored) is not symmetric
    model, info = weights.load(folder)
    check_layers(model, layers)
    assert "compressed-tensors int4" in info.own_bits
    # transformers, through compressed-tensors, on the same folder. Its default route (kept
    # compressed, decompressed at the first forward) fails on asymmetric pack-quantized with
    # transformers 5.23 and compressed-tensors 0.20.1 (it expects the zero point unpacked, [N, K/G],
    # and refuses the packed [N/8, K/G] the package itself wrote); `dequantize=True` decompresses
    # with the package at load.
    theirs = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, quantization_config=CompressedTensorsConfig(dequantize=True)
    ).eval()
    for (
        prefix
    ) in layers:  # the package computes (q - z) * s in the scale's dtype: one rounding for bf16
        expected = model.get_submodule(prefix.removeprefix("model.")).dequantize().to(dtype).float()
        torch.testing.assert_close(theirs.get_submodule(prefix).weight, expected, rtol=0, atol=0)
    if dtype == torch.float32:
        with torch.no_grad():
            hf_logits = theirs(torch.arange(16)[None] * 7 % hf.config.vocab_size).logits
        torch.testing.assert_close(logits(model), hf_logits, rtol=0, atol=1e-4)


def test_a_layer_split_over_files_in_any_order_with_an_unpacked_zero_point(hf):
    """Older compressed-tensors writers stored the asymmetric zero point unpacked, signed [N,
    K/G]."""
    from compressed_tensors.compressors.pack_quantized import pack_to_int32

    q, z, s = random_layers(hf, 32, (0, 16), scale_dtype=torch.bfloat16)[
        "model.layers.0.mlp.down_proj"
    ]
    config = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32},
            }
        },
    }
    layer, norm = "layers.0.mlp.down_proj", torch.ones(64)
    stream = [
        ("b", f"{layer}.weight_zero_point", (z - 8).to(torch.int8)),
        ("a", "norm.weight", norm),
        ("a", f"{layer}.weight_scale", s),
        ("b", f"{layer}.weight_packed", pack_to_int32((q - 8).to(torch.int8), 4)),
    ]
    out = list(hf_quant.packed_tensors(config, iter(stream), "test"))
    assert [(f, n) for f, n, _ in out] == [("a", "norm.weight"), ("b", f"{layer}.weight")]
    torch.testing.assert_close(out[1][2].dequantize(), dequantized(q, z, s), rtol=0, atol=0)


# ---- refused with a message that names the problem --------------------------------------------


def quantized_folder(hf, tmp_path, config=None, edit=None):
    """A GPTQ folder (group 32) whose tensors `edit` may change: {"<layer>.<part>": tensor or
    None}."""
    layers = random_layers(hf, 32, (1, 16))

    def tensors_of(q, z, s):
        out = gptq_tensors("gptq")(q, z, s)
        prefix = next(p for p, v in layers.items() if v[0] is q)
        for key, value in (edit or {}).items():
            layer, _, part = key.rpartition(".")
            if prefix == f"model.{layer}":
                out.pop(part) if value is None else out.__setitem__(part, value)
        return out

    return write_folder(hf, tmp_path / "bad", config or gptq_config(), tensors_of, layers)


@pytest.mark.parametrize("method", ["fp8", "bitsandbytes", "hqq"])
def test_other_quant_methods_are_refused_by_name(hf, tmp_path, method):
    folder = quantized_folder(hf, tmp_path, {"quant_method": method, "bits": 4})
    with pytest.raises(
        CheckpointError, match=rf"quant_method '{method}' is not supported; this loader reads gptq"
    ):
        weights.load(folder)


@pytest.mark.parametrize(
    "config, message",
    [
        (gptq_config(bits=8), "gptq with 8 bits"),
        (gptq_config(fmt="marlin"), "checkpoint_format 'marlin'"),
        ({**AWQ_CONFIG, "version": "gemv"}, "awq version 'gemv'"),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "float-quantized",
                "config_groups": {},
            },
            "format 'float-quantized'",
        ),
    ],
)
def test_unsupported_bits_and_packings_are_refused_before_reading_tensors(
    hf, tmp_path, config, message
):
    folder = quantized_folder(hf, tmp_path, config)
    for f in folder.glob("*.safetensors"):
        f.write_bytes(b"not read")  # check() refuses from config.json alone
    with pytest.raises(CheckpointError, match=message):
        weights.load(folder)


def test_act_order_with_a_shuffled_g_idx_is_refused(hf, tmp_path):
    g_idx = torch.randperm(64, generator=torch.Generator().manual_seed(0)).to(torch.int32) // 32
    folder = quantized_folder(
        hf, tmp_path, gptq_config(desc_act=True), {"layers.0.self_attn.q_proj.g_idx": g_idx}
    )
    with pytest.raises(CheckpointError, match=r"layers.0.self_attn.q_proj.g_idx .*act-order"):
        weights.load(folder)


def test_mis_shaped_scales_are_named_with_both_shapes(hf, tmp_path):
    folder = quantized_folder(
        hf, tmp_path, edit={"layers.1.mlp.down_proj.scales": torch.ones(2, 64, dtype=torch.float16)}
    )
    with pytest.raises(
        CheckpointError,
        match=r"layers.1.mlp.down_proj.scales has shape \(2, 64\), but qweight's "
        r"shape \(12, 64\) with group size 32 needs \(3, 64\)",
    ):
        weights.load(folder)


def test_a_missing_qzeros_is_named(hf, tmp_path):
    folder = quantized_folder(hf, tmp_path, edit={"layers.0.mlp.up_proj.qzeros": None})
    with pytest.raises(CheckpointError, match=r"layer 'layers.0.mlp.up_proj' has .* but no qzeros"):
        weights.load(folder)


def test_tensor_parallelism_is_refused(hf, tmp_path):
    with pytest.raises(CheckpointError, match="tensor parallelism"):
        weights.load(quantized_folder(hf, tmp_path), shard=(0, 2))
