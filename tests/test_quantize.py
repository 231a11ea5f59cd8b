"""quantize.py: each kernel path against the plain dequantized reference, checkpoints,
perplexity."""

import json

import helpers
import numpy as np
import pytest
import torch
from helpers import tiny_checkpoint

import compiling
import generate
import quantize
import runtime
from formats import quant_groups, weights
from kv_cache import NoCache, StaticKVCache
from perplexity import DEFAULT_TEXT, perplexity
from speedups.kv_int8 import Int8KVCache

# a tiny model whose every linear layer the int4 kernels take at group 64 (K % 64, N % 16)
QUANT_SIZES = dict(
    hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny-quant"), **QUANT_SIZES)


def rel_error(y, ref):
    return ((y.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.mark.isa
@pytest.mark.parametrize("mode, bound", [("int8", 0.01), ("int4", 0.12)])
def test_layer_error_is_within_bound(mode, bound):
    # Gaussian weights: int8 per-row steps are ~max/127 (error well under 1%); int4 with 16 levels
    # per group of 64 has steps ~range/15, i.e. an RMS error about 9% of the weights'.
    torch.manual_seed(0)
    w, x = torch.randn(256, 512), torch.randn(8, 512)
    layer = quantize.make_layer(
        quantize.portable_tensors(w, mode, 64), None, mode, 64, torch.float32, "cpu"
    )
    ref = x @ w.T
    assert rel_error(x @ layer.dequantize().T, ref) < bound
    assert rel_error(layer(x), ref) < bound


@pytest.mark.isa
@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("rows", [1, 3, quantize.INT4_LARGE_M + 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_path_equals_dequantized_reference(mode, rows, dtype):
    torch.manual_seed(rows)
    w, b = torch.randn(192, 256) * 0.05, torch.randn(192) * 0.1
    layer = quantize.make_layer(quantize.portable_tensors(w, mode, 64), b, mode, 64, dtype, "cpu")
    x = torch.randn(1, rows, 256).to(
        dtype
    )  # (float32: the kernel for 1 row, unpacking from 2; bf16: from 128)
    ref = x.float() @ layer.dequantize().T + layer.bias.float()
    tol = 1e-4 if dtype == torch.float32 else 3e-2  # bf16: rounding of activations and output
    torch.testing.assert_close(layer(x).float(), ref, atol=tol * ref.abs().max().item(), rtol=0)


@pytest.mark.isa
@pytest.mark.parametrize("n", [16, 48, 64, 96, 192, 208])
def test_cpu_int4_unpack_inverts_the_packing_op(n):
    # the layout is the running capability's; a known one must be found, and must give q back
    q = torch.randint(0, 16, (n, 128), dtype=torch.uint8)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
    layout = quantize.find_cpu_int4_layout(packed, q)
    assert layout is not None, f"no known int4 layout under {runtime.cpu_capability()}"
    assert torch.equal(quantize.cpu_int4_unpack(packed, n, 128, *layout), q)
    # and a lookup of some rows (a tied head read as the embedding), the last ones (a tail past the
    # last whole block where n is not a multiple of it) always among them
    rows = torch.cat(
        [
            torch.randint(0, n, (32,), generator=torch.Generator().manual_seed(n)),
            torch.arange(n - 8, n),
        ]
    )
    assert torch.equal(quant_groups.cpu_int4_rows(packed, n, 128, rows, *layout), q[rows])


def test_int4_layer_with_an_unknown_kernel_layout_keeps_portable_values(monkeypatch, capsys):
    torch.manual_seed(0)
    w, x = (
        torch.randn(64, 128),
        torch.randn(quantize.INT4_LARGE_M + 8, 128),
    )  # the dequantize + GEMM route
    known = quantize.make_layer(
        quantize.portable_tensors(w, "int4", 64), None, "int4", 64, torch.float32, "cpu"
    )
    monkeypatch.setattr(quantize, "CPU_INT4_LAYOUTS", ())
    quantize.warn_once.cache_clear()
    unknown = quantize.make_layer(
        quantize.portable_tensors(w, "int4", 64), None, "int4", 64, torch.float32, "cpu"
    )
    assert "not one this file knows" in capsys.readouterr().err
    assert known.portable_weight is None and unknown.portable_weight is not None
    assert torch.equal(unknown.dequantize(), known.dequantize())
    torch.testing.assert_close(unknown(x), known(x))


def test_int4_is_refused_where_the_cpu_kernel_is_wrong(monkeypatch, tiny, capsys):
    monkeypatch.setattr(quantize, "cpu_int4_kernel_error", lambda capability: "its result differs")
    with pytest.raises(
        ValueError, match=f"under CPU capability {runtime.cpu_capability()} .*use --quantize int8"
    ):
        quantize.check_int4_device("cpu")
    assert (
        generate.main(["--checkpoint", str(tiny), "--quantize", "int4", "--max_new_tokens", "2"])
        == 2
    )
    assert "use --quantize int8" in capsys.readouterr().err


def test_int4_portable_layout_round_trips():
    torch.manual_seed(0)
    w = torch.randn(32, 128)
    p = quantize.quantize_int4(w, 32)
    q = quantize.unpack_int4(p["weight"])
    assert q.shape == (32, 128) and int(q.max()) <= 15
    assert torch.equal(q[:, 0::2], p["weight"] & 15) and torch.equal(q[:, 1::2], p["weight"] >> 4)


def q4_1_blocks(tensor):
    """(values uint8 [N, K], scale d, min m float32 [N, K/32]) of a GGUF Q4_1 tensor, read directly:
    each 20-byte block is d (f16), m (f16), then 16 bytes holding elements j (low) and j+16
    (high)."""
    K = int(tensor.shape[0])  # GGUF lists the fastest dimension first
    raw = torch.from_numpy(np.array(tensor.data, dtype=np.uint8).reshape(-1, 20))
    qs = raw[:, 4:]
    values = torch.cat([qs & 15, qs >> 4], dim=1).reshape(-1, K)
    d = raw[:, 0:2].contiguous().view(torch.float16).float().reshape(values.shape[0], -1)
    m = raw[:, 2:4].contiguous().view(torch.float16).float().reshape(values.shape[0], -1)
    return values, d, m


def test_int4_group32_reproduces_the_embedded_q4_1_weights(embedded):
    import gguf

    from formats import gguf_config

    model, _ = embedded
    reader = gguf_config.read(weights.default_checkpoint())
    tensors = {t.name: t for t in reader.tensors}
    # ffn_down and attn_v are stored as is (llama.cpp permutes only Q and K rows)
    for gguf_name, layer in [
        ("blk.0.ffn_down.weight", model.layers[0].mlp.down_proj),
        ("blk.7.attn_v.weight", model.layers[7].self_attn.v_proj),
    ]:
        t = tensors[gguf_name]
        assert t.tensor_type == gguf.GGMLQuantizationType.Q4_1
        values, d, m = q4_1_blocks(t)
        p = quantize.quantize_int4(layer.weight, 32)
        assert torch.equal(quantize.unpack_int4(p["weight"]), values)
        torch.testing.assert_close(p["scales"], d, rtol=1e-5, atol=1e-9)
        torch.testing.assert_close(p["zeros"] - 8 * p["scales"], m, rtol=1e-5, atol=1e-6)
    for (
        name,
        m,
    ) in model.named_modules():  # and every linear weight of a first, middle and last layer
        if isinstance(m, torch.nn.Linear) and name.startswith(
            ("layers.0.", "layers.15.", "layers.29.")
        ):
            p = quantize.quantize_int4(m.weight, 32)
            w = quantize.dequantize_int4(quantize.unpack_int4(p["weight"]), p["scales"], p["zeros"])
            torch.testing.assert_close(w, m.weight, atol=2e-6, rtol=0, msg=name)


def test_int4_at_the_default_group_size_covers_the_linear_layers(embedded, tiny):
    small = dict(embedded[0].config.__dict__, n_layers=2)  # the embedded model's shapes, 2 layers
    for model in (weights.Transformer(weights.ModelConfig(**small)), weights.load(tiny)[0]):
        report = quantize.quantize_model(model, "int4", 64)
        assert helpers.linear_coverage(model) >= 0.99
        assert report["bytes_after"] < report["bytes_before"]
        assert set(report["kept"]) == {"lm_head", "embed_tokens"}


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantizing_in_pieces_of_rows_equals_the_whole(mode):
    w = torch.randn(20, 128, generator=torch.Generator().manual_seed(0))
    whole = quantize.portable_tensors(w, mode, 32, rows=20)
    pieces = quantize.portable_tensors(w, mode, 32, rows=7)  # 7 + 7 + 6 rows
    assert whole.keys() == pieces.keys() and all(torch.equal(whole[k], pieces[k]) for k in whole)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantizing_keeps_no_autograd_graph(tiny, mode):
    """Quantizing a weight that requires grad (nn.Module's default) once kept every temporary of
    the scale search alive in an autograd graph hanging off the scales: `--quantize int8` peaked
    at 7.3 GiB on the 135M embedded model, int4 at 10.3. Loaded models need no grad at all."""
    assert not any(p.requires_grad for p in weights.load(tiny)[0].parameters())
    model = weights.Transformer(weights.ModelConfig(**dict(weights.load(tiny)[0].config.__dict__)))
    assert all(p.requires_grad for p in model.parameters())  # what a user's own module holds
    quantize.quantize_model(model, mode, 64, head=True, embedding=True)
    held = [
        n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.grad_fn is not None
    ]
    assert not held, f"tensors holding an autograd graph: {held[:5]}"


@pytest.mark.parametrize(
    "shape",
    [
        dict(
            dim=4096,
            n_layers=2,
            n_heads=32,
            n_kv_heads=32,
            intermediate_size=11008,
            vocab_size=32000,
        ),  # Llama-2-7B
        dict(
            dim=4096,
            n_layers=2,
            n_heads=32,
            n_kv_heads=8,
            intermediate_size=14336,
            vocab_size=128256,
        ),  # Llama-3-8B
        dict(
            dim=2048,
            n_layers=2,
            n_heads=32,
            n_kv_heads=8,
            intermediate_size=8192,
            vocab_size=128256,
        ),  # Llama-3.2-1B
    ],
)
def test_int4_plan_covers_llama_shaped_models(shape):
    with torch.device("meta"):
        model = weights.Transformer(weights.ModelConfig(**shape))
    layers = quantize.plan(model, "int4", 64)
    sizes = {
        n: m.weight.numel()
        for n, m in model.layers.named_modules()
        if isinstance(m, torch.nn.Linear)
    }
    covered = sum(n for name, n in sizes.items() if layers[f"layers.{name}"] is None)
    assert covered / sum(sizes.values()) >= 0.99


def greedy(model, n=12, cache_cls=StaticKVCache, decode_fn=compiling.decode_one):
    cache = cache_cls.for_model(model, 1, 64)
    prompt = torch.tensor([[1, 5, 9, 14, 3, 7]])
    rows, _ = generate.generate(
        model,
        cache,
        prompt,
        n,
        generate.SamplingParams(0.0),
        generate.DecodeOptions(ignore_eos=True, decode_fn=decode_fn),
    )
    return rows[0]


@pytest.mark.parametrize(
    "mode, extra", [("int8", ["--quantize_head", "--quantize_embedding"]), ("int4", [])]
)
def test_saved_checkpoint_equals_quantizing_at_load(tiny, tmp_path, mode, extra):
    out = tmp_path / "q"
    assert (
        quantize.main(["--checkpoint", str(tiny), "--mode", mode, "--out", str(out), *extra]) == 0
    )
    loaded, info = weights.load(out)  # float32 activations, as the CLI quantized float32 weights
    assert info.format == f"safetensors {mode}"
    direct, _ = weights.load(tiny)
    quantize.quantize_model(direct, mode, 64, head=bool(extra), embedding=bool(extra))
    tokens = torch.arange(20)[None] * 7 % loaded.config.vocab_size
    with torch.no_grad():
        a = loaded(tokens, torch.arange(20)[None], NoCache())
        b = direct(tokens, torch.arange(20)[None], NoCache())
    assert torch.equal(a, b)
    assert loaded.weight_bytes() == direct.weight_bytes()
    assert (out / "tokenizer.json").exists()  # generate.py runs on the folder as is
    assert (
        generate.main(
            ["--checkpoint", str(out), "--prompt", "hello", "--max_new_tokens", "3", "--json"]
        )
        == 0
    )


def test_quantized_checkpoint_of_a_gguf_keeps_its_tokenizer(tmp_path, embedded):
    out = tmp_path / "q"
    assert quantize.main(["--mode", "int8", "--out", str(out)]) == 0
    from formats.tokenizer import load_tokenizer

    _, tokenizer = embedded
    text = "Quantized checkpoints keep the tokenizer: 12345 ok?"
    assert load_tokenizer(out).encode(text) == tokenizer.encode(text)
    meta = json.loads(
        __import__("safetensors")
        .safe_open(str(out / "model.safetensors"), "pt")
        .metadata()["quantization"]
    )
    assert meta["mode"] == "int8" and len(meta["layers"]) == 7 * 30


@pytest.mark.isa
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_model_compiles_to_the_same_tokens(tiny, mode):
    import torch._dynamo

    # float32 activations: compiled and eager then differ only by summation order, far below any
    # gap between the top two logits (bf16 rounding differs between kernels and can flip ties)
    model, _ = weights.load(tiny)
    quantize.quantize_model(model, mode, 64, head=True)
    eager = greedy(model)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled = greedy(model, decode_fn=compiling.compile_decode("cpu", autotune=False))
    assert compiled == eager
    # bf16, where the CPU kernels run: the compiled step's logits equal eager's within bf16 rounding
    model, _ = weights.load(tiny, dtype=torch.bfloat16)
    quantize.quantize_model(model, mode, 64, head=True)
    torch._dynamo.reset()
    step = compiling.compile_decode("cpu", autotune=False)
    logits = []
    for fn in (compiling.decode_one, step):
        cache = StaticKVCache.for_model(model, 1, 64)
        with torch.no_grad():
            compiling.prefill(model, cache, torch.tensor([[1, 5, 9, 14]]))
            logits.append(fn(model, cache, torch.tensor([[3]]), torch.tensor([[4]])))
    torch.testing.assert_close(
        logits[1], logits[0], atol=0.05 * logits[0].abs().max().item(), rtol=0
    )


@pytest.mark.isa
def test_int8_kv_cache_attention_matches_the_float_cache():
    torch.manual_seed(0)
    B, S, Hkv, H, D = 2, 32, 2, 4, 16
    caches = [StaticKVCache(1, B, Hkv, S, D), Int8KVCache(1, B, Hkv, S, D)]
    outs = [[], []]
    for step, T in enumerate([5, 1, 1, 3]):  # a prefill, decode steps, a multi-token step
        start = sum([5, 1, 1, 3][:step])
        q, k, v = torch.randn(B, T, H, D), torch.randn(B, T, Hkv, D), torch.randn(B, T, Hkv, D)
        pos = torch.arange(start, start + T).expand(B, T)
        for i, c in enumerate(caches):
            outs[i].append(c.attend(0, q, k, v, pos))
    for a, b in zip(*outs):
        assert rel_error(b, a) < 0.02
    assert (
        caches[1].nbytes() < 0.6 * caches[0].nbytes() * 2 / 4 * 2
    )  # int8 + scales vs float32 halved twice


@pytest.mark.isa
def test_compiled_int8_kv_decode_equals_eager(tiny):
    import torch._dynamo

    model, _ = weights.load(tiny)
    eager = greedy(model, cache_cls=Int8KVCache)
    torch._dynamo.reset()
    compiled = greedy(
        model, cache_cls=Int8KVCache, decode_fn=compiling.compile_decode("cpu", autotune=False)
    )
    assert compiled == eager
    assert (
        greedy(model) == eager
    )  # on this tiny model the int8 cache does not change a greedy token


@pytest.fixture(scope="module")
def declaration(embedded):
    _, tokenizer = embedded
    ids = tokenizer.encode(DEFAULT_TEXT.read_text())[:1000]
    assert len(ids) == 1000
    return ids


@pytest.fixture(scope="module")
def float_ppl(embedded, declaration):
    return perplexity(embedded[0], declaration)


def test_perplexity_of_the_embedded_model_is_sane(float_ppl, declaration):
    assert 5 < float_ppl < 60  # a 135M model on plain English prose; uniform would be 49152


@pytest.mark.isa
def test_perplexity_int8_weights_within_1_percent(float_ppl, declaration):
    model, _ = weights.load(None, dequantize=True)
    quantize.quantize_model(model, "int8")
    assert perplexity(model, declaration) < 1.01 * float_ppl


@pytest.mark.isa
def test_perplexity_int8_kv_cache_within_1_percent(embedded, float_ppl, declaration):
    ppl = perplexity(embedded[0], declaration, kv_cache_dtype="int8")
    assert abs(ppl - float_ppl) < 0.01 * float_ppl


@pytest.mark.isa
def test_perplexity_int4(float_ppl, declaration):
    model, _ = weights.load(None, dequantize=True)
    quantize.quantize_model(model, "int4", 32)  # the model's own Q4_1 grid: nothing is lost
    assert abs(perplexity(model, declaration) - float_ppl) < 1e-3 * float_ppl
    model, _ = weights.load(None)  # the file's Q4_1 run as is (gguf_weights.packed)
    assert isinstance(model.layers[0].mlp.up_proj, quantize.Int4Linear)
    assert abs(perplexity(model, declaration) - float_ppl) < 1e-3 * float_ppl


def test_perplexity_int4_regrouped(
    float_ppl, declaration
):  # a quality bound: not rerun under each instruction set
    model, _ = weights.load(None, dequantize=True)
    quantize.quantize_model(model, "int4", 64)
    # Re-quantizing Q4_1 groups of 32 into groups of 64 loses much more than quantizing float
    # weights would (RESULTS.md): a regression bound, not the quality a float model gets.
    assert perplexity(model, declaration) < 1.6 * float_ppl


def test_bad_input_gives_clear_errors(tiny, tmp_path, capsys):
    model, _ = weights.load(tiny)
    with pytest.raises(ValueError, match="unknown quantization mode 'int3'"):
        quantize.quantize_model(model, "int3")
    with pytest.raises(ValueError, match="the int4 kernels take 32, 64, 128, 256"):
        quantize.quantize_model(model, "int4", 48)
    assert quantize.main(["--checkpoint", str(tiny), "--mode", "int4", "--groupsize", "100"]) == 2
    assert "--groupsize 100" in capsys.readouterr().err
    with pytest.raises(ValueError, match="no kernel on device 'meta'"):
        quantize.check_int4_device("meta")
    # a quantized checkpoint whose config no longer matches its tensors
    out = tmp_path / "q"
    assert quantize.main(["--checkpoint", str(tiny), "--mode", "int4", "--out", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "intermediate_size": 512}))
    with pytest.raises(
        weights.CheckpointError,
        match=r"tensor .layers.0.mlp.\w+.\w+. has shape \(\d+, \d+\), expected",
    ):
        weights.load(out)


def test_cli_quantize_and_int8_kv_cache(tiny, capsys):
    argv = [
        "--checkpoint",
        str(tiny),
        "--prompt",
        "hello",
        "--temperature",
        "0",
        "--max_new_tokens",
        "6",
        "--ignore_eos",
        "--json",
        "--max_seq_len",
        "64",
    ]
    assert generate.main(argv) == 0
    plain = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["stats"]
    assert (
        generate.main(argv + ["--quantize", "int4", "--kv_cache_dtype", "int8", "--quantize_head"])
        == 0
    )
    out = capsys.readouterr()
    quant = json.loads(out.out.strip().splitlines()[-1])["stats"]
    assert (
        "quantized 14 layers to int4 (groups of 64)" in out.err
    )  # 2 layers x 7; the head is refused:
    assert "lm_head: 299 output channels are not a multiple of 16 (int4 kernel)" in out.err
    assert quant["model_bytes"] < 0.6 * plain["model_bytes"]
    # head_dim 32: int8 K/V plus one bf16 scale per token and head is (32 + 2) / (32 * 2) of bf16
    assert quant["kv_cache_bytes"] == plain["kv_cache_bytes"] * (32 + 2) // (32 * 2)


@pytest.mark.isa
@pytest.mark.parametrize("N", [256, 144])
def test_int4_packed_by_pieces_equals_one_call(N):
    """cpu_int4_pack packs a block of rows at a time (the load's peak): the bytes of one call to
    the packing op over the whole matrix, tail rows included, and the layout that reads them."""
    q = torch.randint(
        0, 16, (N, 128), dtype=torch.uint8, generator=torch.Generator().manual_seed(N)
    )
    packed, layout = quantize.cpu_int4_pack(lambda i, j: q[i:j], N, rows=64)
    whole = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
    assert layout is not None and torch.equal(packed, whole)
    assert torch.equal(quantize.cpu_int4_unpack(packed, N, 128, *layout), q)
