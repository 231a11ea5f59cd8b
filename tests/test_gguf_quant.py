"""GGUF weights at their own bits (gguf_weights.decode_blocks, formats/quant_groups.py): every
mapped block type decodes bit for bit as gguf.quants does, the layers built from it equal a float
model of that decoding, and the embedded Q4_1 model runs as quantize.py's int4 group-32 path
does."""

import numpy as np
import pytest
import torch
from helpers import GGUF_NAMES, hf_model, write_gguf

import compiling
import quantize
import runtime
from formats import gguf_weights, quant_groups, weights
from kv_cache import NoCache

TYPES = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"]
# byte offsets of each type's float16 fields: (scale fields, minimum fields)
F16_FIELDS = {
    "Q8_0": ((0,), ()),
    "Q4_0": ((0,), ()),
    "Q5_0": ((0,), ()),
    "Q4_1": ((0,), (2,)),
    "Q5_1": ((0,), (2,)),
    "Q4_K": ((0,), (2,)),
    "Q5_K": ((0,), (2,)),
    "Q6_K": ((208,), ()),
}


def random_blocks(kind: str, rows: int, cols: int, seed: int, small: bool = False) -> np.ndarray:
    """Random bytes (any bytes are valid blocks) with finite float16 scales of a weight's size
    (100x smaller scales if `small`)."""
    size, per = gguf_weights.BLOCKS[kind]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, cols // per, size), dtype=np.uint8)
    scales, minimums = F16_FIELDS[kind]
    low_min, high_min = (1e-3, 3e-2) if kind.endswith("_K") else (-0.3, 0.3)  # K-quants: dmin, as d
    low, high = (1e-5, 3e-4) if small else (1e-3, 3e-2)
    for offsets, low, high in ((scales, low, high), (minimums, low_min, high_min)):
        for at in offsets:
            value = rng.uniform(low, high, size=raw.shape[:2]).astype(np.float16)
            raw[:, :, at : at + 2] = value.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(rows, -1)


def gguf_reference(raw: np.ndarray, kind: str) -> torch.Tensor:
    import gguf
    from gguf.quants import dequantize

    return torch.from_numpy(dequantize(raw, getattr(gguf.GGMLQuantizationType, kind)).copy())


@pytest.mark.parametrize("kind", TYPES)
def test_decoded_blocks_equal_gguf_quants_bit_for_bit(kind):
    raw = random_blocks(kind, 24, 512, seed=1)
    q, scales, offsets = gguf_weights.decode_blocks(torch.from_numpy(raw), kind)
    assert q.dtype == torch.int8 and q.shape == (24, 512)
    assert torch.equal(
        quant_groups.dequantize_groups(q, scales, offsets), gguf_reference(raw, kind)
    )


def write_random_gguf(tmp_path, kind: str, small: bool = False):
    """A tiny llama (every matrix a multiple of 256 wide, for the K-quants) whose matrices are
    random blocks of `kind`; returns the path and {model.py name: gguf.quants' float weight}."""
    hf = hf_model("llama3", hidden_size=256, intermediate_size=512, num_hidden_layers=1)
    raw, expected = {}, {}
    for i, (name, t) in enumerate(hf.state_dict().items()):
        if t.ndim != 2:
            continue
        parts = name.split(".")
        if parts[1] == "layers":
            gname, ours = (
                f"blk.{parts[2]}.{GGUF_NAMES['.'.join(parts[3:-1])]}.weight",
                ".".join(parts[1:]),
            )
        else:
            gname = {
                "model.embed_tokens.weight": "token_embd.weight",
                "lm_head.weight": "output.weight",
            }[name]
            ours = name.removeprefix("model.")
        raw[gname] = (kind, random_blocks(kind, *t.shape, seed=i, small=small))
        w = gguf_reference(raw[gname][1], kind)
        if gname.endswith(("attn_q.weight", "attn_k.weight")):  # stored in llama.cpp's row order
            w = gguf_weights.unpermute(
                w,
                hf.config.num_attention_heads
                if "attn_q" in gname
                else hf.config.num_key_value_heads,
            )
        expected[ours] = w
    return write_gguf(hf, tmp_path / f"{kind}.gguf", raw_blocks=raw), expected


def logits(model, n=12):
    x = torch.arange(n)[None] * 7 % model.config.vocab_size
    with torch.no_grad():
        return model(x, torch.arange(n)[None], NoCache())


@pytest.mark.isa
@pytest.mark.parametrize("kind", TYPES)
def test_kept_layers_equal_the_gguf_decoding_and_a_float_model_of_it(tmp_path, kind):
    path, expected = write_random_gguf(tmp_path, kind)
    at_bits, info = weights.load(path)
    ref, _ = weights.load(path, dequantize=True)
    int4 = kind in gguf_weights.INT4_TYPES
    for name, w in expected.items():
        module = at_bits.get_submodule(name.removesuffix(".weight"))
        assert torch.equal(ref.state_dict()[name], w), (
            name
        )  # the float path decodes the same values
        if (
            name == "lm_head.weight" and not int4
        ):  # an int8-group head runs in the activations' dtype
            assert isinstance(module, torch.nn.Linear) and torch.equal(module.weight, w)
            continue
        if name != "embed_tokens.weight":  # the int4 route wherever its zero is exact (always here)
            assert isinstance(
                module, quantize.Int4Linear if int4 else quant_groups.Int8GroupLinear
            ), name
        got = (
            module.dequantize()
            if hasattr(module, "dequantize")
            else quant_groups.dequantize_groups(module.weight, module.scales, module.offsets)
        )
        assert torch.equal(got, w), name
    assert kind in info.own_bits and at_bits.weight_bytes() < 0.5 * ref.weight_bytes()
    a, b = logits(at_bits), logits(ref)
    torch.testing.assert_close(a, b, rtol=0, atol=2e-4 * b.abs().max().item())


@pytest.mark.isa
@pytest.mark.parametrize("offsets", [False, True])
def test_int8_group_linear_equals_its_dequantized_reference(offsets):
    """Eager (dequantize + GEMM) at several row counts, and compiled few-row decode (a fused
    per-group reduction) against x @ dequantize().T."""
    g = torch.Generator().manual_seed(0)
    N, K, G = 48, 128, 32
    q = torch.randint(-128, 128, (N, K), generator=g, dtype=torch.int8)
    scales = torch.rand(N, K // G, generator=g) * 0.02
    layer = quant_groups.Int8GroupLinear(
        q, scales, torch.randn(N, K // G, generator=g) if offsets else None, None, torch.float32
    )
    w = layer.dequantize()
    for rows in (1, 3, 40):
        x = torch.randn(rows, K, generator=g)
        torch.testing.assert_close(layer(x), x @ w.T, rtol=1e-5, atol=1e-5)
        xb = (
            x.bfloat16()
        )  # the weight rounded to bfloat16 once: within a few bf16 steps of the output's size
        ref = xb.float() @ w.T
        torch.testing.assert_close(
            layer(xb).float(), ref, rtol=0, atol=2e-2 * ref.abs().max().item()
        )
    # as generate.py --compile does (Inductor's vector width per capability)
    compiling.configure_inductor_cpu()
    compiled = torch.compile(layer, dynamic=False)
    x = torch.randn(2, K, generator=g)
    torch.testing.assert_close(compiled(x), x @ w.T, rtol=1e-5, atol=1e-5)


@pytest.mark.isa
@pytest.mark.parametrize("offsets", [False, True])
@pytest.mark.parametrize("G", [16, 32, 64])
def test_int8_group_linear_in_bf16_runs_two_int4_halves_of_the_same_values(offsets, G, monkeypatch):
    """bf16 on CPU: the int8 values stored as nibbles (lo, hi) for the int4 kernel read back
    exactly, the layer holds q * bf16(scale) + the offset its bf16 zero gives (exactly the file's
    where balanced), and its output at 1 and 3 rows (kernel), INT4_LARGE_M + 8 (dequantize + GEMM)
    and compiled equals x @ those weights.T. Every group size the kernel can double takes the
    pair, with offsets too; int8 values up to 119 without offsets take the balanced nibbles."""
    g = torch.Generator().manual_seed(G)
    N, K = 80, 256
    q = torch.randint(
        -32 if G == 16 else -128, 32 if G == 16 else 128, (N, K), generator=g, dtype=torch.int8
    )
    scales, offs = (
        torch.rand(N, K // G, generator=g) * 0.02,
        torch.randn(N, K // G, generator=g) * 0.1,
    )
    monkeypatch.setattr(quant_groups, "PACK_ROWS", 64)  # packed in two pieces, 64 and 16 rows
    layer = quant_groups.Int8GroupLinear(q, scales, offs if offsets else None, None, torch.bfloat16)
    assert layer.pair is not None and layer.weight is None, runtime.cpu_capability()
    assert layer.balanced == (G == 16 and not offsets) and layer.scales is None
    assert torch.equal(layer.int8_values(), q)
    idx = torch.tensor(
        [0, 79, 64, 5, 5]
    )  # rows of both packed pieces, the 16-row tail, repeated (an embedding's lookup)
    assert torch.equal(layer.int8_rows(idx), q[idx]) and layer.int8_rows(idx[:0]).shape == (0, K)
    s = scales.bfloat16().float()
    if layer.balanced:  # the file's values, with the scales the kernel takes
        o = None
    else:  # zero = (8 s + offset) / 17 in bf16: the offset it stands for, within bf16's rounding
        o = 17 * ((8 * scales + (offs if offsets else 0)) / 17).bfloat16().float() - 8 * s
        ref_o = offs if offsets else torch.zeros_like(scales)
        torch.testing.assert_close(o, ref_o, rtol=0, atol=2**-7 * (8 * scales + ref_o.abs()).max())
    w = quant_groups.dequantize_groups(q, s, o)
    assert torch.equal(layer.dequantize(), w)
    for rows in (1, 3, quantize.INT4_LARGE_M + 8):
        x = torch.randn(rows, K, generator=g).bfloat16()
        ref = x.float() @ w.T
        torch.testing.assert_close(
            layer(x).float(), ref, rtol=0, atol=1e-2 * ref.abs().max().item()
        )
    compiling.configure_inductor_cpu()
    compiled = torch.compile(layer, dynamic=False)
    x = torch.randn(1, K, generator=g).bfloat16()
    torch.testing.assert_close(compiled(x), layer(x), rtol=0, atol=0)
    float32 = quant_groups.Int8GroupLinear(q, scales, None, None, torch.float32)
    assert (
        float32.pair is None and float32.weight is not None
    )  # the kernel has no fast float32 path
    odd = quant_groups.Int8GroupLinear(
        q[:72], scales[:72], None, None, torch.bfloat16
    )  # 72 rows: not for the kernel
    x = torch.randn(2, K, generator=g).bfloat16()
    ref = x.float() @ odd.dequantize().T
    assert odd.pair is None
    torch.testing.assert_close(odd(x).float(), ref, rtol=0, atol=1e-2 * ref.abs().max().item())


@pytest.mark.isa
@pytest.mark.parametrize(
    "G, low, high, offsets", [(16, -32, 32, False), (32, -128, 120, False), (32, -128, 128, True)]
)
def test_int8_group_dense_by_row_blocks_equals_dequantize(G, low, high, offsets):
    """Many-row calls unpack the nibble pair a block of rows at a time (Int8GroupLinear.dense),
    the last block ending in the layout's tail rows (144 = 2 x 64 + 16): the same weights as
    dequantize(), the int8 values back exactly (the balanced nibbles' extremes -128 and 119
    included), and the layer at 128 rows (dense's route) gives x @ them.T."""
    g = torch.Generator().manual_seed(1)
    N, K = 144, 256
    q = torch.randint(low, high, (N, K), generator=g, dtype=torch.int8)
    q[0, :2] = torch.tensor([low, high - 1])
    offs = torch.randn(N, K // G, generator=g) * 0.1 if offsets else None
    scales = torch.rand(N, K // G, generator=g) * 0.02
    layer = quant_groups.Int8GroupLinear(q, scales, offs, None, torch.bfloat16)
    assert layer.balanced == (not offsets) and torch.equal(layer.int8_values(), q)
    assert layer.pair is not None
    w = layer.dequantize()
    assert torch.equal(layer.dense(torch.float32, chunk=64, least=0), w)
    x = torch.randn(quantize.INT4_LARGE_M, K, generator=g).bfloat16()
    ref = x.float() @ w.T
    torch.testing.assert_close(layer(x).float(), ref, rtol=0, atol=1e-2 * ref.abs().max().item())


@pytest.mark.isa
@pytest.mark.parametrize("kind", ["Q8_0", "Q5_1", "Q6_K"])
def test_bf16_int8_group_matrices_and_head_run_as_int4_halves(tmp_path, kind):
    """In bf16 the int8-group types run as two int4 halves, the output head included
    (quant_groups.HEAD_NOTE). Values still the file's within bf16's rounding, logits those of the
    float model of the same decoding within twice the error of the same model with its weights
    rounded to bf16 (Q6_K's scales kept small: its random weights would reach +-120, where bf16
    sums cancel too much)."""
    path, expected = write_random_gguf(tmp_path, kind, small=kind == "Q6_K")
    at_bits, info = weights.load(path, dtype=torch.bfloat16)
    ref, _ = weights.load(path, dtype=torch.float32, dequantize=True)
    for name in ("layers.0.mlp.up_proj", "lm_head"):
        module = at_bits.get_submodule(name)
        assert isinstance(module, quant_groups.Int8GroupLinear) and module.pair is not None, name
        w = expected[f"{name}.weight"]  # the values the layer holds: the file's with bf16 scales
        rounding = (w.bfloat16().float() - w).abs().max()  # what rounding the weights would cost
        assert (module.dequantize() - w).abs().max() <= 2 * rounding, name
    assert "two int4 halves" in info.own_bits
    bf16, _ = weights.load(
        path, dtype=torch.bfloat16, dequantize=True
    )  # the weights rounded to bf16 instead
    exact = logits(ref)
    error, bf16_error = ((logits(m).float() - exact).abs().max().item() for m in (at_bits, bf16))
    assert error <= 2 * bf16_error, (
        error,
        bf16_error,
    )  # bf16 scales cost no more than bf16 weights, within 2x


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1"])
def test_layers_with_biases_at_their_bits_equal_the_float_model(tmp_path, qtype):
    """qwen2's q/k/v carry biases: a layer whose bias comes later in the file is built once it is
    there (weights.build builds the others as they arrive, so decoded copies never pile up)."""
    hf = hf_model("qwen2")
    path = write_gguf(hf, tmp_path / "q.gguf", arch="qwen2", qtype=qtype)
    at_bits, info = weights.load(path)
    ref, _ = weights.load(path, dequantize=True)
    q = at_bits.layers[0].self_attn.q_proj
    assert isinstance(
        q, quant_groups.Int8GroupLinear if qtype == "Q8_0" else quantize.Int4Linear
    ), info.own_bits
    assert torch.equal(q.bias, ref.layers[0].self_attn.q_proj.bias)
    a, b = logits(at_bits), logits(ref)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-4 * b.abs().max().item())


def test_embedded_q4_1_runs_as_int4_group_32(embedded):
    """The default model at its own bits: every decoder matrix an Int4Linear of groups of 32 whose
    values are the file's (the float reference is the same file dequantized), and the logits of
    the int4 kernels those of quantize.py's int4 group-32 path on the float weights."""
    float_model = embedded[0]
    at_bits, info = weights.load(None)
    assert "Q4_1 -> int4 g32" in info.own_bits
    requantized, _ = weights.load(None, dequantize=True)
    quantize.quantize_model(requantized, "int4", 32)
    for name, m in at_bits.layers.named_modules():
        if isinstance(m, quantize.Int4Linear):
            assert m.groupsize == 32
            assert torch.equal(m.dequantize(), float_model.layers.get_submodule(name).weight), name
    a, b = logits(at_bits, 24), logits(requantized, 24)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-3 * b.abs().max().item())


@pytest.mark.isa
def test_a_tied_embedding_reads_its_rows_from_the_heads_int4_halves(embedded):
    """bf16: the embedded file's Q8_0 table is also its output head, run as two int4 halves; the
    embedding reads its rows back from those halves (no second int8 copy), each value the file's."""
    model, info = weights.load(None, dtype=torch.bfloat16)
    emb, head = model.embed_tokens, model.lm_head
    if (
        isinstance(head, quant_groups.Int8GroupLinear) and head.pair is not None
    ):  # the int4 kernel runs here
        assert (
            emb.weight is None
            and emb.head is head
            and "read from lm_head's halves" in info.own_bits
        )
        assert model.weight_bytes() < 105 * 2**20  # 127.5 MiB with the int8 copy
    else:
        assert emb.weight is not None and emb.head is None
    table = embedded[0].embed_tokens.weight  # the same file dequantized, float32
    assert torch.equal(emb.dequantize(), table)
    ids = torch.randint(0, table.shape[0], (3, 50), generator=torch.Generator().manual_seed(0))
    assert torch.equal(emb(ids), table[ids].to(torch.bfloat16))


class Record:  # a stand-in for one GGUF tensor record
    def __init__(self, kind, data, name="blk.0.ffn_up.weight"):
        import gguf

        self.name, self.tensor_type, self.data = (
            name,
            getattr(gguf.GGMLQuantizationType, kind),
            data,
        )
        self.shape = np.array(
            [
                data.shape[1] // gguf_weights.BLOCKS[kind][0] * gguf_weights.BLOCKS[kind][1],
                data.shape[0],
            ]
        )


def test_an_int4_group_whose_zero_is_not_exact_keeps_int8_groups(tmp_path):
    """int4 computes (q - 8) * d + (m + 8d): where m + 8d rounds in float32 the tensor stays in
    int8 groups (q * d + m), so no weight ever differs from the file's."""
    raw = random_blocks("Q4_1", 16, 64, seed=3)
    block = raw.reshape(16, 2, 20)[0, 0]
    block[0:2], block[2:4] = (
        np.array([v], dtype=np.float16).view(np.uint8) for v in (1.0, 3e-7)
    )  # 8d + m: 28 bits
    p = gguf_weights.packed(Record("Q4_1", raw), "layers.0.mlp.up_proj.weight", tmp_path / "x.gguf")
    assert p.kind == "int8g" and torch.equal(p.dequantize(), gguf_reference(raw, "Q4_1"))
    block[2:4] = np.array([-4.0], dtype=np.float16).view(np.uint8)
    p = gguf_weights.packed(Record("Q4_1", raw), "layers.0.mlp.up_proj.weight", tmp_path / "x.gguf")
    assert p.kind == "int4" and torch.equal(p.dequantize(), gguf_reference(raw, "Q4_1"))


def test_block_data_shorter_than_its_shape_is_named(tmp_path):
    record = Record("Q4_1", np.zeros((8, 20 * 16), dtype=np.uint8))
    record.data = record.data[:, : 20 * 15]  # 15 of the 16 blocks each row's shape implies
    with pytest.raises(
        weights.CheckpointError, match=r"blk\.0\.ffn_up\.weight.*Q4_1.*truncated or corrupt"
    ):
        gguf_weights.packed(record, "layers.0.mlp.up_proj.weight", tmp_path / "x.gguf")


def test_quantize_refuses_an_already_quantized_model():
    model, _ = weights.load(None)
    with pytest.raises(ValueError, match="already quantized"):
        quantize.quantize_model(model, "int8")


def test_a_type_without_a_kernel_says_what_it_costs(tmp_path):
    """Q3_K tensors have no kernel at their bits: they are dequantized to the dtype asked for,
    and the load says which and what they hold in memory against the file (by hand: v_proj
    128 x 256 and down_proj 256 x 512 in bf16, 320 KiB; 640 blocks of 110 bytes, 68.8 KiB)."""
    import gguf

    hf = hf_model("llama3", hidden_size=256, intermediate_size=512, num_hidden_layers=1)
    per, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q3_K]
    rng, raw = np.random.default_rng(0), {}
    shapes = {"blk.0.attn_v.weight": (128, 256), "blk.0.ffn_down.weight": (256, 512)}
    for gname, (rows, cols) in shapes.items():
        blocks = rng.integers(0, 256, size=(rows, cols // per, size), dtype=np.uint8)
        d = np.full(blocks.shape[:2], 0.01, dtype=np.float16).view(np.uint8)
        blocks[:, :, size - 2 :] = d.reshape(*blocks.shape[:2], 2)  # its scale, finite
        raw[gname] = ("Q3_K", blocks.reshape(rows, -1))
    path = write_gguf(hf, tmp_path / "q3k.gguf", raw_blocks=raw)
    model, info = weights.load(path, dtype=torch.bfloat16)
    assert (
        "Q3_K -> bfloat16, no kernel at its bits (320.0 KiB in memory against 68.8 KiB in the "
        "file): v_proj, down_proj" in info.own_bits
    ), info.own_bits
    v = model.layers[0].self_attn.v_proj
    assert isinstance(v, torch.nn.Linear)
    want = gguf_reference(raw["blk.0.attn_v.weight"][1], "Q3_K").to(torch.bfloat16)
    assert torch.equal(v.weight, want)
