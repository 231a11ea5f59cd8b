"""Sliding windows, Gemma 2 / 3, YaRN, LongRoPE, dynamic NTK and Phi-3 against HF transformers
(tests/test_model.py also runs every one of them through its prefill and static-cache checks):
greedy tokens, decoding past the window and past the original context, compiled == eager, the
paged cache == the static one, and a windowed request's KV blocks bounded by its window."""

import json

import numpy as np
import pytest
import torch
from helpers import alone, check_allocator, hf_model, save_hf

import compiling
import generate
import memory
from engine import Engine, RequestParams
from formats import weights
from kv_cache import StaticKVCache
from paged import PagedKVCache
from sampling import SamplingParams

NEW = [
    "mistral_window",
    "qwen2_windows",
    "qwen2_yarn",
    "llama_dynamic",
    "phi3_longrope",
    "gemma2",
    "gemma3",
]
WINDOWED = ["mistral_window", "qwen2_windows", "gemma2", "gemma3"]
ATOL = 1e-4


@pytest.fixture(scope="module", params=NEW)
def pair(request, tmp_path_factory):
    hf = hf_model(request.param)
    model, _ = weights.load(
        save_hf(hf, tmp_path_factory.mktemp(request.param)), dtype=torch.float32
    )
    return request.param, hf, model


def config_of(arch):
    return weights.config_from_hf(json.loads(hf_model(arch).config.to_json_string()), arch)


def test_each_family_sets_its_switches():
    """A guard on the fixtures: each config really exercises what it is listed for."""
    c = config_of("mistral_window")
    assert [c.window(i) for i in range(2)] == [8, 8]
    c = config_of("qwen2_windows")
    assert [c.window(i) for i in range(2)] == [0, 8]  # max_window_layers=1: layer 0 sees everything
    c = config_of("gemma2")
    assert (
        [c.window(i) for i in range(2)] == [8, 0]
        and c.attn_softcap == 2.0
        and c.logit_softcap == 3.0
    )
    assert c.norm_offset == 1.0 and c.embed_scale and c.sandwich_norms and c.mlp_act == "gelu_tanh"
    assert c.query_scale == 24 and c.tie_word_embeddings
    c = config_of("gemma3")
    assert [c.window(i) for i in range(2)] == [8, 0] and c.qk_norm and c.local_rope_theta == 10000.0
    assert c.rope_theta == 1e6 and c.rope_scaling["rope_type"] == "linear" and not c.attn_softcap
    c = config_of("phi3_longrope")
    assert (
        c.rope_scaling["rope_type"] == "longrope"
        and c.rope_scaling["original_max_position_embeddings"] == 32
    )
    assert c.rotary_dim == 8 and c.head_dim == 16
    assert config_of("qwen2_yarn").rope_scaling["rope_type"] == "yarn"
    assert config_of("llama_dynamic").rope_scaling["rope_type"] == "dynamic"


def hf_greedy(hf, prompt, n):
    """Hugging Face's forward fed one token at a time, argmax each step."""
    from transformers import DynamicCache

    past, out, x = DynamicCache(config=hf.config), [], prompt
    with torch.no_grad():
        for _ in range(n):
            out.append(int(hf(x, past_key_values=past, use_cache=True).logits[0, -1].argmax()))
            x = torch.tensor([[out[-1]]])
    return out


def test_greedy_tokens_match_hf(pair):
    """32 tokens from an 8-token prompt: past the windows of 8 and the original contexts of 32.
    Phi-3's generate() in transformers drops its cache when a sequence first passes the original
    context and recomputes it under the long factors; rope.py keeps each key as it was written
    (its docstring), which is Hugging Face's forward fed token by token: that is the reference."""
    arch, hf, model = pair
    prompt = torch.randint(3, 256, (1, 8), generator=torch.Generator().manual_seed(3))
    if arch == "phi3_longrope":
        ref = hf_greedy(hf, prompt, 32)
    else:
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


@pytest.mark.parametrize("arch", ["llama_dynamic", "phi3_longrope", "qwen2_yarn"])
def test_decoding_past_the_original_context_matches_hf_token_by_token(arch, tmp_path):
    """Hugging Face's dynamic NTK and LongRoPE decide per forward; fed one token at a time (a fresh
    model: its rotary state grows), each token is rotated as rope.py rotates it."""
    from transformers import DynamicCache

    hf = hf_model(arch)
    model, _ = weights.load(save_hf(hf, tmp_path / arch), dtype=torch.float32)
    x = torch.randint(3, 256, (1, 48), generator=torch.Generator().manual_seed(5))
    cache, past = StaticKVCache.for_model(model, 1, 64), DynamicCache(config=hf.config)
    with torch.no_grad():
        ref = [hf(x[:, :24], past_key_values=past, use_cache=True).logits]
        ours = [model(x[:, :24], torch.arange(24)[None], cache)]
        for t in range(24, 48):  # past the original context of 32
            ref.append(hf(x[:, t : t + 1], past_key_values=past, use_cache=True).logits)
            ours.append(model(x[:, t : t + 1], torch.full((1, 1), t), cache))
    torch.testing.assert_close(torch.cat(ours, 1), torch.cat(ref, 1), atol=ATOL, rtol=0)


def test_compiled_decode_equals_eager(pair):
    arch, _, model = pair
    import torch._dynamo

    torch._dynamo.reset()
    prompt = torch.randint(3, 256, (2, 12), generator=torch.Generator().manual_seed(4))
    eager, _ = generate.generate(
        model,
        StaticKVCache.for_model(model, 2, 64),
        prompt,
        30,
        SamplingParams(0.0),
        generate.DecodeOptions(ignore_eos=True),
    )
    compiled, _ = generate.generate(
        model,
        StaticKVCache.for_model(model, 2, 64),
        prompt,
        30,
        SamplingParams(0.0),
        generate.DecodeOptions(
            ignore_eos=True, decode_fn=compiling.compile_decode("cpu", autotune=False)
        ),
    )
    assert compiled == eager


@pytest.mark.parametrize("arch", WINDOWED)
def test_paged_cache_equals_static_on_windowed_models(arch, tmp_path):
    model, _ = weights.load(save_hf(hf_model(arch), tmp_path / arch), dtype=torch.float32)
    x = torch.randint(3, 256, (2, 40), generator=torch.Generator().manual_seed(6))
    out = []
    for cache in (
        StaticKVCache.for_model(model, 2, 48),
        PagedKVCache.for_batch(model, 2, 48, block_size=4),
    ):
        with torch.no_grad():
            steps = [model(x[:, :20], torch.arange(20).expand(2, 20), cache)]
            steps += [model(x[:, t : t + 1], torch.full((2, 1), t), cache) for t in range(20, 40)]
        out.append(torch.cat(steps, 1))
    torch.testing.assert_close(out[1], out[0], atol=ATOL, rtol=0)


@pytest.fixture(scope="module")
def float64_models(tmp_path_factory):
    """arch -> our model of the tiny HF config, in float64 (exact comparisons), loaded once."""
    cache = {}

    def get(arch):
        if arch not in cache:
            cache[arch] = weights.load(
                save_hf(hf_model(arch), tmp_path_factory.mktemp(arch)), dtype=torch.float64
            )[0]
        return cache[arch]

    return get


@pytest.mark.parametrize("arch", ["mistral_window", "gemma3"])
def test_a_request_4x_its_window_holds_a_bounded_number_of_blocks(arch, float64_models):
    """window 8, blocks of 4: a sequence holds at most 8 / 4 + 2 blocks of its windowed layers
    however long it runs (Mistral: every layer; Gemma 3: its windowed layer's own pool, while the
    full layer keeps all 11), its tokens equal a static cache's, and a later request sharing its
    prompt still hits the cache. Tight windowed pools run it too (Mistral: those 4 blocks and the
    null one; Gemma 3: 7, the least memory.pools allows for a window and a 4-token chunk): the
    blocks freed behind the window are taken again, though cached."""
    model, bs, hybrid = float64_models(arch), 4, arch == "gemma3"
    prompts = [[5 + i % 200 for i in range(10)], [5 + i % 200 for i in range(9)] + [77]]
    params = RequestParams(
        max_new_tokens=32, temperature=0.0, ignore_eos=True
    )  # 42 tokens: > 4 windows
    expected = [alone(model, p, 32) for p in prompts]
    for pools in (
        dict(num_blocks=40),
        dict(num_blocks=40, window_blocks=7) if hybrid else dict(num_blocks=5),
    ):
        engine = Engine.for_model(
            model, block_size=bs, max_num_seqs=4, max_num_batched_tokens=4, **pools
        )
        most, full, results = 0, 0, {}
        for k, prompt in enumerate(
            prompts
        ):  # the second after the first, whose prompt blocks are cached
            engine.add_request(prompt, params, request_id=k)
            while engine.has_unfinished():
                results.update(
                    (e.request_id, e.result) for e in engine.step() if hasattr(e, "result")
                )
                for seq in engine.scheduler.running:
                    most = max(
                        most, sum(1 for b in (seq.window_blocks if hybrid else seq.blocks) if b)
                    )
                    full = max(full, len(seq.blocks) if hybrid else 0)
        assert most <= 8 // bs + 2, (
            f"a sequence held {most} blocks of its windowed layers ({pools})"
        )
        assert full == (10 if hybrid else 0), (
            full
        )  # the full layer keeps all: 10 blocks at 40 tokens, last seen running
        assert [results[k]["tokens"] for k in range(2)] == expected, pools
        for allocator in engine.scheduler.pools:
            check_allocator(allocator)
            assert allocator.num_used() == 0
        if pools["num_blocks"] == 40 and "window_blocks" not in pools:
            assert engine.scheduler.stats["prompt_tokens_hit"] == 8
    assert [k.shape[0] for k in engine.cache.k] == (
        [7, 40] if hybrid else [5, 5]
    )  # Gemma 3: layer 0 windowed
    if (
        hybrid
    ):  # a windowed pool too small for one window and chunk is refused, saying what would do
        with pytest.raises(
            ValueError,
            match=(
                "cannot hold one sequence's window of 8 tokens and a 4-token chunk: give at least 7"
            ),
        ):
            Engine.for_model(
                model,
                num_blocks=40,
                block_size=bs,
                max_num_seqs=4,
                max_num_batched_tokens=4,
                window_blocks=6,
            )


def test_a_hybrid_model_keeps_a_pool_per_layer_kind(float64_models):
    """Gemma 3's windowed layers get their own pool (as large as they can use, at most the full
    layers'); with window_blocks=0 they share the full layers' blocks and keep them all. Each equals
    the static cache, eager and with compiled decode steps, n = 2 samples forking included."""
    model = float64_models("gemma3")
    prompt = list(range(5, 25))
    params = RequestParams(max_new_tokens=20, temperature=0.0, ignore_eos=True)
    ref = alone(model, prompt, 20)
    for window_blocks, pools in ((None, 2), (0, 1)):
        engine = Engine.for_model(model, num_blocks=40, block_size=4, window_blocks=window_blocks)
        assert len(engine.scheduler.pools) == pools and engine.cache.window_blocks == (
            40 if pools == 2 else 0
        )
        out = engine.run_batch(
            [prompt, prompt],
            [params, RequestParams(max_new_tokens=20, temperature=0.0, ignore_eos=True, n=2)],
        )
        assert out[0]["tokens"] == ref and out[1]["tokens"] == [ref, ref]
        assert engine.scheduler.blocks_used() == 0
    # compiled: decodes at 17-20, past the window, all 6 blocks wide (one graph); window_blocks
    # reads 8 // 4 + 2
    compiled = Engine.for_model(model, num_blocks=40, block_size=4, compile=True)
    short = RequestParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    assert compiled.run_batch([prompt[:17]], short)[0]["tokens"] == alone(model, prompt[:17], 4)


@pytest.mark.parametrize(
    "arch, gguf_arch",
    [
        ("gemma3", "gemma3"),
        ("gemma2", "gemma2"),
        ("phi3_longrope", "phi3"),
        ("qwen2_yarn", "qwen2"),
    ],
)
def test_gguf_written_as_llama_cpp_does_equals_its_hf_twin(arch, gguf_arch, tmp_path):
    """Gemma's norms stored as 1 + w, Phi-3's fused attn_qkv / ffn_up and rope_factors_* tensors,
    the window pattern as a list, YaRN's rope.scaling.* keys. llama.cpp keeps no
    query_pre_attn_scalar: it is head_dim here."""
    from helpers import write_gguf

    hf = hf_model(arch, **({"query_pre_attn_scalar": 16} if arch.startswith("gemma") else {}))
    model, _ = weights.load(
        write_gguf(hf, tmp_path / f"{arch}.gguf", arch=gguf_arch), dtype=torch.float32
    )
    x = torch.randint(3, 256, (1, 40), generator=torch.Generator().manual_seed(7))
    cache = StaticKVCache.for_model(model, 1, 48)
    with torch.no_grad():
        # (Phi-3: a one-shot forward past its original context of 32 rotates every key by the long
        # factors)
        ref = hf(x[:, :30] if arch == "phi3_longrope" else x).logits
        ours = [model(x[:, :30], torch.arange(30)[None], cache)]
        ours += [model(x[:, t : t + 1], torch.full((1, 1), t), cache) for t in range(30, 40)]
    torch.testing.assert_close(torch.cat(ours, 1)[:, : ref.shape[1]], ref, atol=ATOL, rtol=0)


def test_gguf_window_metadata_that_contradicts_the_file_is_named(tmp_path):
    import gguf
    from helpers import write_gguf

    from runtime import CheckpointError

    hf = hf_model("gemma3", query_pre_attn_scalar=16)
    path = write_gguf(hf, tmp_path / "g.gguf", arch="gemma3")
    reader = gguf.GGUFReader(str(path))
    bad = tmp_path / "bad.gguf"
    w = gguf.GGUFWriter(str(bad), "gemma3")
    for key, f in reader.fields.items():
        if key.startswith(("GGUF.", "general.architecture")):
            continue
        if key == "gemma3.attention.sliding_window_pattern":
            w.add_sliding_window_pattern([True, False, True])  # three layers' types, two layers
            continue
        sub = gguf.GGUFValueType(f.types[-1]) if len(f.types) > 1 else None
        w.add_key_value(key, f.contents(), gguf.GGUFValueType(f.types[0]), sub_type=sub)
    for t in reader.tensors:
        w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CheckpointError, match="sliding_window_pattern lists 3 layers"):
        weights.load(bad)


def quantization_errors(arch, tmp_path) -> dict:
    """{mode: |logits(quantized) - logits(float)| / |logits(float)|} for a tiny `arch` model."""
    import copy

    import quantize
    from kv_cache import NoCache

    model, _ = weights.load(save_hf(hf_model(arch), tmp_path / arch), dtype=torch.float32)
    x = torch.randint(3, 256, (1, 24), generator=torch.Generator().manual_seed(8))
    pos, errors = torch.arange(24)[None], {}
    with torch.no_grad():
        ref = model(x, pos, NoCache())
        for mode in ("int8", "int4"):
            q = copy.deepcopy(model)
            assert (
                len(quantize.quantize_model(q, mode, groupsize=32)["quantized"])
                == 7 * model.config.n_layers
            )
            errors[mode] = float((q(x, pos, NoCache()) - ref).norm() / ref.norm())
    return errors


@pytest.mark.parametrize("arch", ["gemma2", "gemma3", "phi3_longrope"])
def test_int8_and_int4_weights_err_as_much_as_on_llama(arch, tmp_path):
    """quantize.py's layers in these families: logits as close to float as a Llama's of the same
    sizes."""
    errors, llama = quantization_errors(arch, tmp_path), quantization_errors("llama2", tmp_path)
    for mode in errors:
        assert 0 < errors[mode] < 1.5 * llama[mode], (
            f"{mode}: {errors[mode]:.4f} (Llama: {llama[mode]:.4f})"
        )


@pytest.mark.parametrize("softcap, kernels", [(0.0, False), (0.0, True), (2.0, True)])
def test_window_paths_equal_masked_attention_over_every_slot(softcap, kernels):
    """The fast paths (a decode step reads only its window: the paged cache's window blocks,
    speedups/kv_window.py's ring, through the reference attention or the CPU kernels) against their
    slow twin, kv_cache.attention over every slot written under the window's mask."""
    import cpu_kernels
    from kv_cache import attention, visible
    from speedups.kv_window import WindowedKVCache

    torch.manual_seed(0)
    B, H, Hkv, D, S, window = 3, 4, 2, 16, 256, 10
    decode = cpu_kernels.static_decode if kernels else None
    static = StaticKVCache(1, B, Hkv, S, D, decode=decode)
    ring = WindowedKVCache(1, B, Hkv, S, D, decode=decode, windows=[window])
    assert ring.k[0].shape[2] == 128  # window + 64, rounded up to 64: half the slots
    paged = PagedKVCache(
        1, 1 + B * S // 4, 4, Hkv, D, decode=cpu_kernels.PagedDecodeInPlace() if kernels else None
    )
    paged.block_tables = 1 + torch.arange(B * S // 4).view(B, S // 4)
    k, v = torch.randn(B, 50, Hkv, D), torch.randn(B, 50, Hkv, D)
    for cache in (static, ring, paged):
        cache.attend(
            0, torch.randn(B, 50, H, D), k, v, torch.arange(50).expand(B, 50), window, softcap
        )
    pos = torch.tensor([[50], [31], [7]])  # past the window, past it less, within it
    q, k1, v1 = torch.randn(B, 1, H, D), torch.randn(B, 1, Hkv, D), torch.randn(B, 1, Hkv, D)
    want = []
    for b in range(B):  # the slow twin, row by row over every slot written so far
        ks = torch.cat([k[b : b + 1, : pos[b, 0]], k1[b : b + 1]], 1).transpose(1, 2)
        vs = torch.cat([v[b : b + 1, : pos[b, 0]], v1[b : b + 1]], 1).transpose(1, 2)
        mask = visible(torch.arange(ks.shape[2]), pos[b : b + 1], window)
        want.append(attention(q[b : b + 1], ks, vs, mask, softcap))
    for cache in (static, ring, paged):
        got = cache.attend(0, q, k1, v1, pos, window, softcap)
        torch.testing.assert_close(got, torch.cat(want), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["mistral_window", "gemma3", "gemma2"])
def test_ring_buffers_equal_the_static_cache_through_long_prefills_and_decodes(arch, tmp_path):
    """speedups/kv_window.py against kv_cache.py on whole models (window 8, rings of 128 slots): a
    prefill longer than the ring, a short chunk written before it attends, decodes, and 110 tokens
    greedy past the ring's end, eager against compiled."""
    import torch._dynamo

    from speedups.kv_window import WindowedKVCache

    model, _ = weights.load(
        save_hf(hf_model(arch, max_position_embeddings=512), tmp_path / arch), dtype=torch.float32
    )
    x = torch.randint(3, 256, (2, 150), generator=torch.Generator().manual_seed(10))
    out = []
    for cache in (StaticKVCache.for_model(model, 2, 160), WindowedKVCache.for_model(model, 2, 160)):
        with torch.no_grad():
            steps = [
                model(
                    x[:, :130], torch.arange(130).expand(2, 130), cache
                ),  # longer than the ring (128)
                model(x[:, 130:140], torch.arange(130, 140).expand(2, 10), cache),
            ]
            steps += [model(x[:, t : t + 1], torch.full((2, 1), t), cache) for t in range(140, 150)]
        out.append(torch.cat(steps, 1))
    assert (
        any(r for r in cache.ring)
        and cache.nbytes() < StaticKVCache.for_model(model, 2, 160).nbytes()
    )
    torch.testing.assert_close(out[1], out[0], atol=ATOL, rtol=0)
    if (
        arch == "gemma2"
    ):  # (compiled on the other two: every layer a ring, and rings beside full layers)
        return
    torch._dynamo.reset()
    prompt, params = x[:, :40], SamplingParams(0.0)
    eager, _ = generate.generate(
        model,
        StaticKVCache.for_model(model, 2, 160),
        prompt,
        110,
        params,
        generate.DecodeOptions(ignore_eos=True),
    )
    ring, _ = generate.generate(
        model,
        WindowedKVCache.for_model(model, 2, 160),
        prompt,
        110,
        params,
        generate.DecodeOptions(
            ignore_eos=True, decode_fn=compiling.compile_decode("cpu", autotune=False)
        ),
    )
    assert ring == eager


def test_unknown_rope_and_layer_types_name_themselves_and_the_supported_ones(tmp_path):
    from runtime import CheckpointError

    for arch, change, message in (
        (
            "llama3",
            {"rope_parameters": {"rope_type": "ntk-by-parts", "rope_theta": 1e4, "factor": 2.0}},
            r"RoPE scaling type 'ntk-by-parts' is not supported \(supported: default, linear, "
            r"llama3, yarn, longrope",
        ),
        (
            "gemma3",
            {"layer_types": ["chunked_attention", "full_attention"]},
            r"one of sliding_attention, full_attention; got \['chunked_attention'\]",
        ),
    ):
        folder = save_hf(hf_model(arch), tmp_path / arch)
        cfg = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**cfg, **change}))
        with pytest.raises(CheckpointError, match=message):
            weights.load(folder)


def test_a_window_larger_than_the_context_is_no_window(tmp_path):
    from kv_cache import NoCache

    wide, _ = weights.load(
        save_hf(hf_model("mistral_window", sliding_window=4096), tmp_path / "w"),
        dtype=torch.float32,
    )
    plain, _ = weights.load(save_hf(hf_model("mistral"), tmp_path / "p"), dtype=torch.float32)
    x = torch.randint(3, 256, (1, 40), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        torch.testing.assert_close(
            wide(x, torch.arange(40)[None], NoCache()), plain(x, torch.arange(40)[None], NoCache())
        )
    assert wide.config.window(0) == 4096 > wide.config.max_position_embeddings


def test_the_memory_plan_gives_a_hybrid_windowed_pool_only_what_it_can_use(float64_models):
    """Gemma 3's layer 0 (window 8) and layer 1 (full), blocks of 4: the windowed pool grows with
    the full one up to what 2 sequences' windows and an 8-token chunk can hold, 1 + 2 * (8 / 4 + 3)
    + 2 = 13 blocks; the rest of the budget is the full layers'."""
    model = float64_models("gemma3")
    c, sizes = model.config, dict(max_num_seqs=2, max_num_batched_tokens=8)
    per_layer = (
        2 * 4 * c.n_kv_heads * c.head_dim * 8
    )  # one layer's block: K and V, 4 tokens, float64
    assert memory.window_pool_cap(c, 4, **sizes) == 13
    num_blocks, window_blocks, lines = memory.plan_blocks(
        model, 4, memory_bytes=100 * per_layer, **sizes
    )
    assert (num_blocks, window_blocks) == (87, 13) and "their own pool of 13 blocks" in lines
    assert memory.plan_blocks(model, 4, memory_bytes=20 * per_layer, **sizes)[:2] == (10, 10)
    assert memory.plan_blocks(model, 4, num_blocks=7, **sizes)[:2] == (7, 7)


def test_the_memory_plan_says_what_windows_save():
    from memory import window_lines

    line = window_lines(config_of("mistral_window"), 4, 100, 0, 1024)
    assert "every layer: a sequence holds at most 4 blocks (0.0 MiB)" in line
    line = window_lines(config_of("gemma3"), 4, 100, 40, 2**20)
    assert (
        "on 1 of 2 layers: their own pool of 40 blocks" in line
        and "would take 60.0 MiB more" in line
    )
    assert window_lines(config_of("qwen2_yarn"), 4, 100, 0, 1024) == ""


# Gemma's turn format: "model" for the assistant, a system turn folded into the first user turn
GEMMA_SHAPED_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{% set prefix = messages[0]['content'] + '\\n\\n' %}"
    "{% set turns = messages[1:] %}{% else %}{% set prefix = '' %}"
    "{% set turns = messages %}{% endif %}"
    "{% for m in turns %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else m['role']) + '\\n' "
    "+ (prefix if loop.first else '') }}"
    "{% if m['content'] is string %}{{ m['content'] | trim }}{% else %}"
    "{% for part in m['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] | trim }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<end_of_turn>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)


def test_a_gemma_shaped_chat_template_renders_in_the_sandbox():
    from formats.chat_template import render_chat_template

    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": " Hi "},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": [{"type": "text", "text": "Again"}]},
    ]
    assert render_chat_template(GEMMA_SHAPED_TEMPLATE, messages, bos_token="<bos>") == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
        "<start_of_turn>model\nHello<end_of_turn>\n"
        "<start_of_turn>user\nAgain<end_of_turn>\n<start_of_turn>model\n"
    )
    with pytest.raises(ValueError, match="roles must alternate"):
        render_chat_template(GEMMA_SHAPED_TEMPLATE, messages[1:2] * 2, bos_token="<bos>")


def test_generate_cli_on_a_windowed_model_static_rings_equal_paged(tmp_path, capsys):
    """generate.py end to end on a windowed checkpoint with a tokenizer: its static cache (rings)
    and --cache paged give the same tokens, 200 of them past a window of 8, and the plan says what
    the rings keep."""
    from helpers import tiny_checkpoint

    folder = tiny_checkpoint(
        tmp_path / "mistral", arch="mistral_window", max_position_embeddings=512
    )
    outs = []
    for extra in ([], ["--cache", "paged"]):
        argv = [
            "--checkpoint",
            str(folder),
            "--prompt",
            "hello world",
            "--max_new_tokens",
            "200",
            "--dtype",
            "float32",
            "--temperature",
            "0",
            "--ignore_eos",
            "--json",
            *extra,
        ]
        assert generate.main(argv) == 0
        out, err = capsys.readouterr()
        outs.append(json.loads(out.strip().splitlines()[-1]))
        assert ("kept as rings of 128 slots" in err) == (not extra)
    assert outs[0]["tokens"] == outs[1]["tokens"] and len(outs[0]["tokens"]) == 200


def test_a_used_ring_cache_gives_a_new_sequence_the_fresh_caches_logits(tmp_path):
    """generate.py reuses a cache (the compile warm-up, --num_samples, speculative warm-up): ring
    entries left from the last sequence are never keys of the next, in a long prefill or after."""
    from speedups.kv_window import WindowedKVCache

    model, _ = weights.load(
        save_hf(hf_model("mistral_window", max_position_embeddings=512), tmp_path / "m"),
        dtype=torch.float32,
    )
    first, second = (
        torch.randint(3, 256, (1, 200), generator=torch.Generator().manual_seed(s))
        for s in (11, 12)
    )
    used = WindowedKVCache.for_model(model, 1, 256)
    out = []
    for cache, runs in (
        (used, (first, second)),
        (StaticKVCache.for_model(model, 1, 256), (second,)),
    ):
        for x in runs:
            with torch.no_grad():
                steps = [
                    model(x[:, :190], torch.arange(190)[None], cache)
                ]  # longer than the ring (128)
                steps += [
                    model(x[:, t : t + 1], torch.full((1, 1), t), cache) for t in range(190, 200)
                ]
        out.append(torch.cat(steps, 1))
    torch.testing.assert_close(out[0], out[1], atol=ATOL, rtol=0)


@pytest.mark.parametrize("arch", ["gemma2", "gemma3", "mistral_window", "qwen2_windows"])
def test_hf_folders_written_back_keep_the_family(arch, tmp_path):
    """save_hf_folder (and quantize.py's folders) write each family's keys: our loader gets the same
    config back, and Hugging Face transformers the same logits."""
    from transformers import AutoModelForCausalLM

    from formats import hf_folder

    model, _ = weights.load(save_hf(hf_model(arch), tmp_path / "in"), dtype=torch.float32)
    out = hf_folder.save_hf_folder(model, tmp_path / "out")
    again, _ = weights.load(out, dtype=torch.float32)
    assert again.config == model.config
    x = torch.randint(3, 256, (1, 24), generator=torch.Generator().manual_seed(13))
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()(x).logits
        from kv_cache import NoCache

        torch.testing.assert_close(
            again(x, torch.arange(24)[None], NoCache()), ref, atol=ATOL, rtol=0
        )


def test_phi3_models_are_not_written_as_a_folder_they_would_not_load_as(tmp_path):
    from formats import hf_folder

    model, _ = weights.load(
        save_hf(hf_model("phi3_longrope"), tmp_path / "in"), dtype=torch.float32
    )
    with pytest.raises(ValueError, match="Phi-3 style model"):
        hf_folder.save_hf_folder(model, tmp_path / "out")


@pytest.mark.parametrize(
    "arch, older",
    [("qwen2_windows", {}), ("gemma2", {}), ("gemma3", {"sliding_window_pattern": 2})],
)
def test_older_configs_without_layer_types_give_the_same_layers(arch, older, tmp_path):
    """Hub configs from before `layer_types`: max_window_layers (Qwen2), every 2nd layer full
    (Gemma 2), sliding_window_pattern (Gemma 3)."""
    cfg = json.loads(hf_model(arch).config.to_json_string())
    old = {k: v for k, v in cfg.items() if k != "layer_types"} | older
    assert weights.config_from_hf(old, arch) == weights.config_from_hf(cfg, arch)


def test_an_embedding_gemma_is_refused_by_name():
    from runtime import CheckpointError

    cfg = json.loads(hf_model("gemma3").config.to_json_string()) | {
        "use_bidirectional_attention": True
    }
    with pytest.raises(
        CheckpointError, match="use_bidirectional_attention makes an embedding model"
    ):
        weights.config_from_hf(cfg, "config.json")
