"""Embeddings through the engine (sequence.py's RequestParams.pooling, formats/pooling.py) against
sentence-transformers on tiny random qwen3 checkpoints with its own files: last-token, mean and
first-token pooling, the published layout and sentence-transformers 6's, float32 within 1e-5;
a batch equal to each input alone, prefix caching (last token) and preemption, embeddings beside
generation in the same steps, batch.py --embed, and the bad inputs each refused by name."""

import json

import pytest
import torch
from embedding_folders import TEXTS, causal_folder, embedding_folder, reference
from helpers import run_to_end

import batch
from engine import Engine, RequestParams
from formats import pooling, weights
from formats.tokenizer import load_tokenizer
from model import NO_HEAD
from runtime import CheckpointError

CASES = [("published", "lasttoken"), ("published", "mean_tokens"), ("published", "cls_token")]
CASES += [("st6", "lasttoken")]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("embeddings")
    return {(lay, mode): embedding_folder(root / f"{lay}-{mode}", mode, lay) for lay, mode in CASES}


def engine_for(folder, **options):
    model, _ = weights.load(folder, dtype=torch.float32)
    options = {"num_blocks": 64, "max_num_seqs": 4, "max_num_batched_tokens": 16} | options
    return Engine.for_model(model, **options), load_tokenizer(folder)


def embed(engine, tokenizer, spec, texts) -> torch.Tensor:
    """The engine's finished embeddings of `texts` [n, dim], all queued at once."""
    ids = [pooling.encode_input(tokenizer, t, spec.chat) for t in texts]
    results = engine.run_batch(ids, RequestParams(pooling=spec.pooling))
    return pooling.finish(torch.tensor([r["embedding"] for r in results]), spec.normalize)


@pytest.mark.parametrize("layout,mode", CASES)
def test_embeddings_equal_sentence_transformers_batched_and_alone(folders, layout, mode):
    """Chunked prefill (16 tokens a step, 4 running): the engine's batch equals
    sentence-transformers' padded batch and each text encoded alone (padding never leaks into a
    row), and each text alone through a fresh engine."""
    folder = folders[layout, mode]
    spec = pooling.read_spec(folder)
    assert spec.pooling == {"lasttoken": "last", "mean_tokens": "mean", "cls_token": "cls"}[mode]
    assert spec.chat == (layout == "st6") and spec.normalize
    engine, tok = engine_for(folder)
    got = embed(engine, tok, spec, TEXTS)
    padded = reference(folder, TEXTS)
    single = torch.cat([reference(folder, [t]) for t in TEXTS])
    assert got.shape == padded.shape == (len(TEXTS), 64)
    torch.testing.assert_close(got, padded, rtol=0, atol=1e-5)
    torch.testing.assert_close(got, single, rtol=0, atol=1e-5)
    for i, text in enumerate(TEXTS):
        fresh, _ = engine_for(folder)
        torch.testing.assert_close(embed(fresh, tok, spec, [text])[0], got[i], rtol=0, atol=1e-5)


@pytest.mark.parametrize("mode", ["lasttoken", "mean_tokens"])
def test_last_token_reuses_the_cached_prefix_and_mean_recomputes_it(folders, mode):
    """Two texts sharing 40 tokens: the second's last-token embedding takes the first's blocks
    (a prefix hit) and still equals a fresh engine's; a mean needs every position: it takes
    none."""
    folder = folders["published", mode]
    spec, (engine, tok) = pooling.read_spec(folder), engine_for(folder)
    head = "the quick brown fox jumps over the lazy dog " * 5
    first, second = head + "hello", head + "world, the dog"
    embed(engine, tok, spec, [first])
    hit_before = engine.metrics()["prompt_tokens_hit"]
    got = embed(engine, tok, spec, [second])[0]
    hit = engine.metrics()["prompt_tokens_hit"] - hit_before
    assert (hit >= 32) if mode == "lasttoken" else hit == 0, hit
    fresh, _ = engine_for(folder)
    torch.testing.assert_close(got, embed(fresh, tok, spec, [second])[0], rtol=0, atol=1e-5)


def test_preempted_mean_embeddings_start_over_and_equal_sentence_transformers(folders):
    """A pool of 9 blocks of 16 tokens for six 50-token texts prefilled 16 tokens a step: running
    requests are preempted for blocks; each restarts its sum from its first position."""
    folder = folders["published", "mean_tokens"]
    spec = pooling.read_spec(folder)
    engine, tok = engine_for(folder, num_blocks=9, max_num_seqs=4, max_num_batched_tokens=16)
    texts = [f"{w} " * 40 for w in ("hello", "world", "fox", "dog", "lazy", "quick")]
    got = embed(engine, tok, spec, texts)
    assert engine.metrics()["preemptions"] > 0
    torch.testing.assert_close(got, reference(folder, texts), rtol=0, atol=1e-5)


def test_embeddings_and_generation_share_steps_without_changing_either(tmp_path):
    """A causal model, --pooling mean: greedy generations queued with embeddings in the same
    steps give the tokens they give alone; the embeddings equal HF's mean of last_hidden_state."""
    from transformers import AutoModel

    folder = causal_folder(tmp_path / "causal")
    spec = pooling.read_spec(folder, "mean")
    assert (spec.pooling, spec.normalize) == ("mean", True)
    engine, tok = engine_for(folder, max_num_batched_tokens=32)
    greedy = RequestParams(max_new_tokens=8, temperature=0, ignore_eos=True)
    prompts = [tok.encode(t) for t in ("hello world", "the lazy dog")]
    alone = [engine.run_batch([p], greedy)[0]["tokens"] for p in prompts]
    fresh, _ = engine_for(folder, max_num_batched_tokens=32)
    ids = [pooling.encode_input(tok, t) for t in TEXTS]
    gen = [fresh.add_request(p, greedy) for p in prompts]
    emb = [fresh.add_request(i, RequestParams(pooling="mean")) for i in ids]
    done = run_to_end(fresh)
    assert [done[r].seqs[0].output for r in gen] == alone
    hf = AutoModel.from_pretrained(folder, dtype=torch.float32)
    for rid, i in zip(emb, ids):
        want = hf(torch.tensor([i])).last_hidden_state[0].mean(0)
        torch.testing.assert_close(done[rid].pooled, want, rtol=0, atol=1e-5)


def test_an_aborted_embedding_ends_without_a_vector_and_the_rest_go_on(folders):
    """Aborted halfway through its prompt: its result says "abort" and holds no (partial) mean;
    the embedding beside it is unchanged."""
    folder = folders["published", "mean_tokens"]
    spec = pooling.read_spec(folder)
    engine, tok = engine_for(folder)
    ids = [pooling.encode_input(tok, t) for t in TEXTS[1:3]]
    cut, kept = (engine.add_request(i, RequestParams(pooling="mean")) for i in ids)
    engine.step()
    engine.abort(cut)
    done = run_to_end(engine)
    assert done[cut].result() | {"id": 0} == {
        "id": 0,
        "embedding": None,
        "prompt_tokens": len(ids[0]),
        "finish_reason": "abort",
    }
    got = pooling.finish(done[kept].embedding[None], spec.normalize)[0]
    torch.testing.assert_close(got, reference(folder, TEXTS[2:3])[0], rtol=0, atol=1e-5)


@pytest.mark.parametrize("kind", ["LAST", "MEAN"])
def test_a_gguf_embedding_model_pools_as_its_pooling_type_says(tmp_path, kind):
    """A GGUF with llama.cpp's pooling_type: pooled as it says, normalized, equal to HF's
    last_hidden_state pooled the same way; without one, a CheckpointError naming --pooling."""
    import gguf
    from helpers import hf_model, write_gguf

    hf = hf_model("llama3")
    path = write_gguf(hf, tmp_path / f"{kind}.gguf", pooling_type=gguf.PoolingType[kind])
    spec = pooling.read_spec(path)
    assert (spec.pooling, spec.normalize) == (kind.lower(), True)
    model, _ = weights.load(path, dtype=torch.float32)
    engine = Engine.for_model(model, num_blocks=32, max_num_seqs=4, max_num_batched_tokens=16)
    prompts = [list(range(3, 40)), [5, 6, 7]]
    got = engine.run_batch(prompts, RequestParams(pooling=spec.pooling))
    for prompt, r in zip(prompts, got):
        states = hf.model(torch.tensor([prompt])).last_hidden_state[0]
        want = states[-1] if kind == "LAST" else states.mean(0)
        torch.testing.assert_close(torch.tensor(r["embedding"]), want, rtol=0, atol=1e-4)
    plain = write_gguf(hf, tmp_path / "plain.gguf")
    with pytest.raises(CheckpointError, match="no pooling_type .* give --pooling"):
        pooling.read_spec(plain)


def test_int8_embeddings_stay_close_to_float(folders):
    """The headless base model quantized at load (int8 weights): every embedding within cosine
    0.99 of the float one."""
    folder = folders["published", "lasttoken"]
    spec = pooling.read_spec(folder)
    model, _ = weights.load_for_inference(folder, "cpu", torch.float32, "int8")
    engine = Engine.for_model(model, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=16)
    tok = load_tokenizer(folder)
    got, want = embed(engine, tok, spec, TEXTS), reference(folder, TEXTS)
    assert (got * want).sum(-1).min() > 0.99


def test_bad_embedding_requests_are_refused_by_name(folders):
    folder = folders["published", "lasttoken"]
    engine, tok = engine_for(folder)
    with pytest.raises(ValueError, match=NO_HEAD[:40]):  # a headless model generates nothing
        engine.add_request([1, 2, 3], RequestParams(max_new_tokens=4))
    with pytest.raises(ValueError, match="pooling must be one of last, mean, cls"):
        engine.add_request([1, 2, 3], RequestParams(pooling="max"))
    with pytest.raises(ValueError, match="n 1"):
        engine.add_request([1, 2, 3], RequestParams(pooling="last", n=2))
    with pytest.raises(ValueError, match="the prompt is empty"):
        engine.add_request([], RequestParams(pooling="last"))
    assert not engine.has_unfinished()
    ok = engine.run_batch([[5] * 256], RequestParams(pooling="last"))[0]  # the whole context
    assert len(ok["embedding"]) == 64 and ok["prompt_tokens"] == 256


def test_an_untied_causal_config_without_its_head_loads_for_embeddings(folders, tmp_path):
    """A sentence-transformers folder whose config says Qwen3ForCausalLM (untied) but holds no
    lm_head.weight loads without a head, and embeds as before; cut inputs keep their closing
    special token, as sentence-transformers' truncation does; a tensor-parallel engine refuses."""
    import shutil

    folder = tmp_path / "causal-named"
    shutil.copytree(folders["published", "lasttoken"], folder)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["Qwen3ForCausalLM"]
    (folder / "config.json").write_text(json.dumps(config))
    engine, tok = engine_for(folder)
    assert engine.model.lm_head is None
    spec = pooling.read_spec(folder)
    torch.testing.assert_close(
        embed(engine, tok, spec, TEXTS), reference(folder, TEXTS), atol=1e-5, rtol=0
    )
    long = TEXTS[1]
    cut = pooling.encode_input(tok, long, max_len=16)
    assert len(cut) == 16 and cut[-1] == pooling.encode_input(tok, long)[-1]
    got = engine.run_batch([cut], RequestParams(pooling="last"))[0]["embedding"]
    got = pooling.finish(torch.tensor([got]), True)[0]
    torch.testing.assert_close(got, reference(folder, [long], max_len=16)[0], rtol=0, atol=1e-5)
    engine.ranks = 2
    with pytest.raises(ValueError, match="one process"):
        engine.add_request(cut, RequestParams(pooling="last"))


def test_pipelines_this_project_cannot_run_are_named(folders, tmp_path):
    """No modules.json and no --pooling; a Dense layer; max pooling; a corrupt config; a
    classifier head: each a CheckpointError naming the file and what to do."""
    causal = causal_folder(tmp_path / "causal")
    with pytest.raises(CheckpointError, match="give --pooling"):
        pooling.read_spec(causal)
    assert pooling.read_spec(causal, "cls").pooling == "cls"
    folder = tmp_path / "edited"
    for name in ("modules.json", "1_Pooling"):
        src = folders["published", "mean_tokens"] / name
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            (folder / name).mkdir(exist_ok=True)
            (folder / name / "config.json").write_text((src / "config.json").read_text())
        else:
            (folder / name).write_text(src.read_text())
    modules = json.loads((folder / "modules.json").read_text())
    dense = {"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"}
    (folder / "modules.json").write_text(json.dumps(modules + [dense]))
    with pytest.raises(CheckpointError, match="the pipeline has Dense"):
        pooling.read_spec(folder)
    (folder / "modules.json").write_text(json.dumps(modules))
    config = json.loads((folder / "1_Pooling" / "config.json").read_text())
    config |= {"pooling_mode_mean_tokens": False, "pooling_mode_max_tokens": True}
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"pooling \['max_tokens'\]"):
        pooling.read_spec(folder)
    assert pooling.read_spec(folder, "mean").pooling == "mean"  # the flag overrides
    (folder / "1_Pooling" / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="1_Pooling/config.json: not valid JSON"):
        pooling.read_spec(folder)
    config = json.loads((causal / "config.json").read_text())
    (causal / "config.json").write_text(
        json.dumps(config | {"architectures": ["Qwen3ForSequenceClassification"]})
    )
    with pytest.raises(CheckpointError, match="a classifier"):
        weights.load(causal)
    (causal / "config.json").write_text(json.dumps(config | {"is_causal": False}))
    with pytest.raises(CheckpointError, match="is_causal false"):
        weights.load(causal)


def test_batch_embed_writes_each_line_and_fails_bad_ones_alone(folders, tmp_path, capsys):
    folder = folders["published", "lasttoken"]
    tok = load_tokenizer(folder)
    lines = [
        {"id": "a", "prompt": TEXTS[0]},
        {"id": "ids", "prompt": pooling.encode_input(tok, TEXTS[1])},
        {"id": "cut", "prompt": TEXTS[3], "dimensions": 16},
        {"id": "bad", "prompt": "x", "max_new_tokens": 3},
        {"id": "empty", "prompt": ""},
    ]
    path = tmp_path / "inputs.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    argv = ["--embed", "--requests", str(path), "--checkpoint", str(folder), "--dtype", "float32"]
    assert batch.main(argv) == 0
    out = {o["id"]: o for o in map(json.loads, capsys.readouterr().out.strip().splitlines())}
    want = reference(folder, [TEXTS[0], TEXTS[1], TEXTS[3]])
    torch.testing.assert_close(torch.tensor(out["a"]["embedding"]), want[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(torch.tensor(out["ids"]["embedding"]), want[1], rtol=0, atol=1e-5)
    cut = torch.nn.functional.normalize(want[2, :16], dim=0)
    torch.testing.assert_close(torch.tensor(out["cut"]["embedding"]), cut, rtol=0, atol=1e-5)
    assert "unknown field" in out["bad"]["error"] and "empty" in out["empty"]["error"]
