"""LoRA adapters (speedups/lora.py, formats/lora_files.py): logits equal the `peft` package's on
tiny random models and adapters built here (prefill and token-by-token decode, float32), fused
targets (Phi-3's qkv_proj, gate_up_proj) included; one engine step mixing rows of three adapters and
the base equals each row run alone, on float, int8, int4 and GGUF base weights; prefixes never
shared across adapters; merged equals on the fly; loading and unloading while requests run fails
none; bad adapters and bad requests refused by name."""

import json

import pytest
import torch
from helpers import hf_model, save_hf, tiny_checkpoint, write_gguf
from lora_adapters import KINDS, adapter_folders, edit_config, peft_model, save_adapter

from engine import Engine, RequestParams
from formats import weights
from formats.lora_files import read_adapter
from kv_cache import StaticKVCache
from runtime import CheckpointError
from speedups import lora
from speedups.lora import apply

GREEDY = dict(max_new_tokens=8, temperature=0)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """(base folder, [(adapter folder, its PEFT model)] of the three KINDS) over llama3."""
    root = tmp_path_factory.mktemp("lora")
    return save_hf(hf_model("llama3"), root / "base"), adapter_folders(root)


def prefill_and_decode(model, tokens):
    """Logits [T, V] of tokens [T]: the first half in one prefill, then one token at a time."""
    cache, half = StaticKVCache.for_model(model, 1, len(tokens)), len(tokens) // 2
    with torch.no_grad():
        out = [model(tokens[None, :half], torch.arange(half)[None], cache)[0]]
        for t in range(half, len(tokens)):
            out.append(model(tokens[None, t : t + 1], torch.tensor([[t]]), cache)[0])
    return torch.cat(out)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
@pytest.mark.parametrize("kind", range(len(KINDS)))
def test_logits_equal_peft(base, kind, fused):
    folder, adapters = base
    path, wrapped = adapters[kind]
    load = weights.load_for_inference if fused else weights.load
    model, _ = load(folder, dtype=torch.float32)
    assert (model.layers[0].self_attn.qkv_proj is not None) == fused
    tokens = torch.randint(0, 256, (20,), generator=torch.Generator().manual_seed(kind))
    plain = prefill_and_decode(model, tokens)
    apply(model, path)
    ours = prefill_and_decode(model, tokens)
    with torch.no_grad():
        want = wrapped(tokens[None]).logits[0]
    assert (plain - want).abs().max() > 1e-2, "the adapter must change the logits"
    torch.testing.assert_close(ours, want, atol=1e-4, rtol=1e-4)


def test_fused_targets_of_phi3_equal_peft(tmp_path):
    """Phi-3's adapters target its fused qkv_proj and gate_up_proj: B spans each part's rows."""
    wrapped = peft_model("phi3_longrope", 4, ["qkv_proj", "gate_up_proj", "down_proj"], 7)
    base_hf = hf_model("phi3_longrope")
    model, _ = weights.load_for_inference(save_hf(base_hf, tmp_path / "base"), dtype=torch.float32)
    apply(model, save_adapter(wrapped, tmp_path / "adapter"))
    tokens = torch.randint(0, 256, (16,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = wrapped(tokens[None]).logits[0]
    torch.testing.assert_close(prefill_and_decode(model, tokens), want, atol=1e-4, rtol=1e-4)


def test_greedy_tokens_through_the_engine_equal_peft(base):
    folder, adapters = base
    model, _ = weights.load_for_inference(folder, dtype=torch.float32)
    engine = Engine.for_model(model, num_blocks=64)
    engine.adapters = lora.Adapters(model, 3, 8)
    prompt = list(range(30, 42))
    for path, wrapped in adapters:
        engine.adapters.load(read_adapter(path, model.config))
        params = RequestParams(max_new_tokens=32, temperature=0, ignore_eos=True, adapter=path.name)
        got = engine.run_batch([prompt], params)[0]["tokens"]
        with torch.no_grad():
            out = wrapped.generate(
                torch.tensor([prompt]), max_new_tokens=32, do_sample=False, min_new_tokens=32
            )
        assert got == out[0, len(prompt) :].tolist()


def _engine(model, folders, slots=4, **kw):
    """An engine over `model` with the adapters of `folders` resident, in the model's one
    lora.Adapters (a second would wrap the wrapped projections: refused)."""
    engine = Engine.for_model(model, num_blocks=96, **kw)
    adapters = getattr(model, "test_adapters", None) or lora.Adapters(model, slots, 8)
    model.test_adapters = engine.adapters = adapters
    for path in folders:
        if path.name not in adapters.served():
            adapters.load(read_adapter(path, model.config))
    return engine


def _mixed_requests():
    """Eight prompts of several lengths over the three adapters and the base."""
    prompts = [[5 + j + k for k in range(9 + 7 * j)] for j in range(8)]
    names = [None, "adapter0", "adapter1", "adapter2"] * 2
    return prompts, [RequestParams(**GREEDY, adapter=n) for n in names]


def _load_base(folder, form, tmp_path):
    if form == "gguf":
        path = write_gguf(hf_model("llama3"), tmp_path / "base.gguf", qtype="Q8_0")
        return weights.load_for_inference(path, dtype=torch.float32)[0]
    quantize = None if form == "float" else form  # (float32 activations: sums the batch keeps)
    return weights.load_for_inference(folder, dtype=torch.float32, quantize=quantize)[0]


@pytest.mark.isa  # (the int4 and GGUF group kernels follow the instruction set)
@pytest.mark.parametrize("form", ["float", "int8", "int4", "gguf"])
def test_a_mixed_batch_equals_each_request_alone(base, form, tmp_path):
    folder, adapters = base
    model = _load_base(folder, form, tmp_path)
    engine = _engine(model, [p for p, _ in adapters])
    prompts, params = _mixed_requests()
    mixed = engine.run_batch(prompts, params)
    alone = [
        _engine(model, [p for p, _ in adapters]).run_batch([p], [q])[0]
        for p, q in zip(prompts, params)
    ]
    assert [m["tokens"] for m in mixed] == [a["tokens"] for a in alone]
    under = {q.adapter: engine.run_batch([prompts[0]], q)[0]["tokens"] for q in params[:4]}
    assert len({tuple(t) for t in under.values()}) == 4, "each adapter changes the tokens"


def test_rows_of_an_adapter_differ_from_the_base_and_a_prefix_is_not_shared(base):
    """The same prompt under the base, then adapter0, then adapter0 again: the second run reuses
    the first adapter0 run's prefix blocks; nothing computed under the base serves adapter0."""
    folder, adapters = base
    model, _ = weights.load_for_inference(folder, dtype=torch.float32)
    engine = _engine(model, [p for p, _ in adapters])
    prompt = list(range(40, 90))  # three full blocks of 16
    hits, outs = [], []
    for name in (None, "adapter0", "adapter0", "adapter1"):
        before = engine.metrics()["prompt_tokens_hit"]
        outs.append(engine.run_batch([prompt], RequestParams(**GREEDY, adapter=name))[0]["tokens"])
        hits.append(engine.metrics()["prompt_tokens_hit"] - before)
    assert hits == [0, 0, 48, 0]
    assert outs[1] == outs[2] and outs[0] != outs[1] and outs[1] != outs[3]
    fresh = _engine(model, [p for p, _ in adapters])
    assert (
        fresh.run_batch([prompt], RequestParams(**GREEDY, adapter="adapter1"))[0]["tokens"]
        == (outs[3])
    )


def test_merged_equals_on_the_fly(base):
    folder, adapters = base
    path = adapters[1][0]
    fly, _ = weights.load_for_inference(folder, dtype=torch.float32)
    merged, _ = weights.load_for_inference(folder, dtype=torch.float32)
    apply(fly, path, scale=0.5)
    apply(merged, path, scale=0.5, merge=True)
    tokens = torch.arange(3, 23)
    torch.testing.assert_close(
        prefill_and_decode(merged, tokens), prefill_and_decode(fly, tokens), atol=1e-4, rtol=1e-4
    )


def test_merge_refuses_quantized_weights(base):
    folder, adapters = base
    model, _ = weights.load_for_inference(folder, dtype=torch.bfloat16, quantize="int8")
    with pytest.raises(ValueError, match="--merge_lora needs float weights"):
        apply(model, adapters[0][0], merge=True)


def test_load_and_unload_while_requests_run(base):
    """Two slots, adapter0 and adapter1 in them with requests running: adapter2 loads onto the
    host only, and a request for it is refused (SlotsBusy) until a slot has no requests; adapter0
    unloaded mid-run lets its requests finish, takes no new ones, then frees its slot, which
    adapter2 takes; the evicted adapter1 comes back when asked for. Every request's tokens equal
    its run alone."""
    folder, adapters = base
    model, _ = weights.load_for_inference(folder, dtype=torch.float32)
    paths = [p for p, _ in adapters]
    prompts, params = _mixed_requests()
    reference = weights.load_for_inference(folder, dtype=torch.float32)[0]
    want = [
        _engine(reference, paths).run_batch([p], q)[0]["tokens"] for p, q in zip(prompts, params)
    ]
    engine = _engine(model, paths[:2], slots=2, max_num_seqs=4)
    slots = engine.adapters
    keep = [i for i, q in enumerate(params) if q.adapter != "adapter2"]
    ids = [engine.add_request(prompts[i], params[i]) for i in keep]
    events = engine.step()
    assert slots.load(read_adapter(paths[2], model.config), engine.requests.values()) == -1
    with pytest.raises(lora.SlotsBusy, match="all 2 adapter slots have requests running"):
        engine.add_request(prompts[3], params[3])
    with pytest.raises(ValueError, match="already loaded"):
        slots.load(read_adapter(paths[2], model.config))
    slots.unload("adapter0", engine.requests.values())
    assert "adapter0" in slots.names and slots.served() == ["adapter1", "adapter2"]
    with pytest.raises(lora.UnknownAdapter, match="no adapter 'adapter0' is loaded"):
        engine.add_request([1, 2, 3], RequestParams(**GREEDY, adapter="adapter0"))
    while engine.has_unfinished():
        events += engine.step()
    results = {e.request_id: e.result for e in events if hasattr(e, "result")}
    assert [results[rid]["tokens"] for rid in ids] == [want[i] for i in keep]
    assert engine.run_batch([prompts[3]], params[3])[0]["tokens"] == want[3]  # adapter2 placed
    assert "adapter0" not in slots.names and "adapter0" not in slots.host
    slots.load(read_adapter(paths[0], model.config))  # evicts the least recently used: adapter1
    assert slots.names == ["adapter0", "adapter2"] or slots.names == ["adapter2", "adapter0"]
    assert engine.run_batch([prompts[2]], params[2])[0]["tokens"] == want[2]  # adapter1 again


def test_unknown_adapter_names_the_loaded_ones(base):
    folder, adapters = base
    model, _ = weights.load_for_inference(folder, dtype=torch.float32)
    engine = _engine(model, [adapters[0][0]])
    with pytest.raises(ValueError, match=r"no adapter 'nope' is loaded \(loaded: adapter0\)"):
        engine.add_request([1, 2], RequestParams(adapter="nope"))
    plain = Engine.for_model(model, num_blocks=16)
    with pytest.raises(ValueError, match="serves no adapters"):
        plain.add_request([1, 2], RequestParams(adapter="adapter0"))
    assert engine.run_batch([[1, 2, 3]], RequestParams(**GREEDY))[0]["tokens"]


def _copy(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


@pytest.mark.parametrize(
    "change, match",
    [
        ({"use_dora": True}, "DoRA"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"target_modules": ["q_proj", "wq"]}, "unknown target module 'wq'"),
        ({"target_modules": ["lm_head"]}, "adapters on lm_head are not supported"),
        ({"peft_type": "IA3"}, "only LORA runs here"),
        ({"r": 8}, r"has shape \[4, 64\].*rank 8 needs \[8, 64\]"),
        ({"bias": "all"}, "trained biases"),
    ],
)
def test_bad_adapter_configs_are_refused_by_name(base, tmp_path, change, match):
    folder, adapters = base
    model, _ = weights.load(folder, dtype=torch.float32)
    bad = edit_config(_copy(adapters[0][0], tmp_path / "bad"), **change)
    with pytest.raises(CheckpointError, match=match):
        read_adapter(bad, model.config)


def test_bad_adapter_files_are_refused_by_name(base, tmp_path):
    folder, adapters = base
    model, _ = weights.load(folder, dtype=torch.float32)
    config = model.config
    with pytest.raises(CheckpointError, match="no such adapter folder"):
        read_adapter(tmp_path / "missing", config)
    cut = _copy(adapters[0][0], tmp_path / "cut")
    data = (cut / "adapter_model.safetensors").read_bytes()
    (cut / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        read_adapter(cut, config)
    (cut / "adapter_model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no adapter_model.safetensors"):
        read_adapter(cut, config)
    # an adapter for another model: a wider one's shapes
    from peft import LoraConfig, get_peft_model

    wide = hf_model("llama3", hidden_size=96)
    wide_adapter = get_peft_model(wide, LoraConfig(r=4, target_modules=["q_proj"]))
    path = save_adapter(wide_adapter, tmp_path / "wide")
    with pytest.raises(CheckpointError, match="an adapter for another model"):
        read_adapter(path, config)
    big = read_adapter(adapters[1][0], config)
    with pytest.raises(ValueError, match="rank 8; the slots hold ranks up to 4"):
        lora.Adapters(model, 1, 4).load(big)
    odd = edit_config(_copy(adapters[0][0], tmp_path / "odd"), alpha_pattern={"q_proj": "x"})
    with pytest.raises(CheckpointError, match="alpha_pattern must map module names"):
        read_adapter(odd, config)


def test_flags_refuse_what_adapters_cannot_run():
    import batch

    with pytest.raises(SystemExit):
        batch.parse_args(["--requests", "x", "--lora", "a=p", "--batch_invariant"])
    with pytest.raises(SystemExit):
        batch.parse_args(["--requests", "x", "--lora", "no-equals-sign"])
    with pytest.raises(SystemExit):
        batch.parse_args(["--requests", "x", "--lora", "a=p", "--lora", "b=q", "--max_loras", "1"])


def test_batch_py_takes_an_adapter_per_line(base, tmp_path, capsys):
    import batch

    _, adapters = base
    folder = tiny_checkpoint(tmp_path / "base", arch="llama3")  # (with a tokenizer)
    lines = [
        {"id": "base", "prompt": [5, 6, 7, 8], **GREEDY},
        {"id": "a0", "prompt": [5, 6, 7, 8], "lora": "sql", **GREEDY},
        {"id": "a1", "prompt": [5, 6, 7, 8], "model": "chat", **GREEDY},
        {"id": "bad", "prompt": [5, 6, 7, 8], "lora": "nope", **GREEDY},
    ]
    requests = tmp_path / "r.jsonl"
    requests.write_text("\n".join(json.dumps(x) for x in lines))
    sql, chat = adapters[0][0], adapters[1][0]
    code = batch.main(
        [
            "--requests",
            str(requests),
            "--checkpoint",
            str(folder),
            "--dtype",
            "float32",
            "--lora",
            f"sql={sql}",
            "--lora",
            f"chat={chat}",
            "--compile",
            "off",
        ]
    )
    assert code == 0
    out = {r["id"]: r for r in map(json.loads, capsys.readouterr().out.splitlines())}
    assert "no adapter 'nope' is loaded (loaded: chat, sql)" in out["bad"]["error"]
    model, _ = weights.load_for_inference(folder, dtype=torch.float32)
    for rid, path in (("a0", sql), ("a1", chat), ("base", None)):
        engine = _engine(model, [sql, chat])
        name = path.name if path else None
        want = engine.run_batch([[5, 6, 7, 8]], RequestParams(**GREEDY, adapter=name))[0]
        assert out[rid]["tokens"] == want["tokens"]


def test_generate_py_lora_on_the_fly_and_merged_equal_the_engine(base, tmp_path, capsys):
    """generate.py --lora (eager: the ahead-of-time package has no adapter; and compiled), then
    --merge_lora: the greedy tokens of the engine with that adapter; --lora_scale 0 gives the
    base's."""
    import generate

    _, adapters = base
    folder, path = tiny_checkpoint(tmp_path / "base", arch="llama3"), adapters[1][0]
    argv = ["--checkpoint", str(folder), "--dtype", "float32", "--temperature", "0"]
    argv += ["--prompt", "hello world", "--max_new_tokens", "8", "--ignore_eos", "--json"]

    def tokens(*extra):
        assert generate.main([*argv, *extra]) == 0
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])["tokens"]

    model, info = weights.load_for_inference(folder, dtype=torch.float32)
    from formats.tokenizer import load_tokenizer

    prompt = load_tokenizer(info.source).encode("hello world")
    engine = _engine(model, [path])
    params = RequestParams(max_new_tokens=8, temperature=0, ignore_eos=True, adapter=path.name)
    want = engine.run_batch([prompt], params)[0]["tokens"]
    assert tokens("--lora", str(path)) == want
    assert tokens("--lora", str(path), "--compile") == want  # torch.compile traces the adapter
    assert tokens("--lora", str(path), "--merge_lora") == want
    params.adapter = None
    plain = engine.run_batch([prompt], params)[0]
    assert tokens("--lora", str(path), "--lora_scale", "0") == plain["tokens"] != want
    with pytest.raises(SystemExit):
        generate.main([*argv, "--merge_lora"])  # without --lora


@pytest.mark.parametrize("drafter", ["prompt_lookup", "draft_model"])
def test_speculation_verifies_under_each_rows_adapter(base, drafter):
    """Drafts (prompt lookup on repetitive prompts; or a draft model, the base without adapters)
    verified in steps that mix adapters: the greedy tokens of plain decoding, adapter by adapter."""
    from speedups.draft_model import DraftModel
    from speedups.prompt_lookup import PromptLookup

    folder, adapters = base
    model, _ = weights.load_for_inference(folder, dtype=torch.float32)
    prompts = [[7, 8, 9, 10] * 6 + [7 + i] for i in range(4)]
    names = [None, "adapter0", "adapter1", "adapter2"]
    params = [RequestParams(max_new_tokens=16, temperature=0, adapter=n) for n in names]
    plain = _engine(model, [p for p, _ in adapters]).run_batch(prompts, params)
    if drafter == "prompt_lookup":
        proposer = PromptLookup(4, 1, 3)
    else:
        draft, _ = weights.load_for_inference(folder, dtype=torch.float32)
        proposer = DraftModel(draft, model, k=4, num_blocks=96, block_size=16)
    engine = _engine(model, [], speculate=proposer)
    spec = engine.run_batch(prompts, params)
    assert [s["tokens"] for s in spec] == [p["tokens"] for p in plain]
    assert engine.metrics()["draft_tokens"] > 0
