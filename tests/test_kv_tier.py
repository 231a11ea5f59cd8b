"""The second tier under the prefix cache (speedups/kv_tier.py): evicted blocks kept in host
memory or on disk and loaded back instead of recomputed. Greedy float32 outputs with the tier
equal the outputs without it under eviction pressure (n = 1 and 2) and across a restart; bad files
(corrupt, truncated, another model's) are skipped with one warning each and their requests
computed right; a folder that cannot be written, or a disk that fills, leaves the engine serving
without the tier; a slow disk never holds a step; the flags refuse what the tier cannot serve."""

import json
import threading
import time
from pathlib import Path

import pytest
import torch
from helpers import hf_model, save_hf, tiny_checkpoint

import batch
from engine import Engine, RequestParams
from formats import weights
from speedups import kv_disk, kv_tier
from speedups.kv_disk import DiskTier
from speedups.kv_tier import HostTier, fingerprint

GREEDY = RequestParams(max_new_tokens=6, temperature=0)
SAMPLED = RequestParams(max_new_tokens=5, temperature=0.8, n=2, seed=3)
HEADS = [list(range(10 + i, 74 + i)) for i in range(6)]  # six 64-token heads: 4 blocks each
PROMPTS = [h + [200 + j] for h in HEADS for j in range(2)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tiny_checkpoint(tmp_path_factory.mktemp("tier"), arch="llama3")
    model, _ = weights.load(folder, dtype=torch.float32)
    reference = Engine.for_model(model, num_blocks=400).run_batch(PROMPTS, GREEDY)
    return folder, model, [r["tokens"] for r in reference]


def small_engine(model, tier):
    """A pool of 11 usable blocks: two requests of five blocks each fit, the six heads do not."""
    return Engine.for_model(
        model, num_blocks=12, max_num_seqs=2, max_num_batched_tokens=64, tier=tier
    )


def one_by_one(engine, prompts, params=GREEDY) -> list:
    return [engine.run_batch([p], params)[0]["tokens"] for p in prompts]


def disk(model, folder, **kw):
    return DiskTier(folder, 2**30, fingerprint(model, 16, torch.float32), **kw)


@pytest.mark.parametrize("kind", ["host", "disk"])
def test_outputs_equal_with_the_tier_under_eviction_pressure(tiny, tmp_path, kind):
    """Twice through the six heads, one request at a time: the pool keeps about two, so the second
    pass finds the rest in the tier (loaded, not computed) and gives the same tokens."""
    _, model, want = tiny
    tier = HostTier(2**30) if kind == "host" else disk(model, tmp_path)
    engine = small_engine(model, tier)
    first = one_by_one(engine, PROMPTS)
    hit_before = engine.metrics()["tier_tokens_hit"]
    getattr(tier, "flush", lambda: None)()
    second = one_by_one(engine, PROMPTS)
    assert first == want and second == want
    m = engine.metrics()
    assert m["tier_tokens_hit"] - hit_before >= 4 * 64, m  # at least four heads came back
    assert m["tier_blocks_written"] > 0 and m["tier_blocks_read"] > 0


def test_host_memory_over_disk(tiny, tmp_path):
    """--kv_host_cache with --kv_disk_cache: fetches try host memory first (the disk is read
    only after a restart), every block goes to the folder too."""
    _, model, want = tiny
    both = kv_tier.HostOverDisk(HostTier(2**30), disk(model, tmp_path))
    engine = small_engine(model, both)
    assert one_by_one(engine, PROMPTS) + one_by_one(engine, PROMPTS) == want + want
    assert both.host.stats["tier_blocks_read"] > 0 and both.disk.stats["tier_blocks_read"] == 0
    m = engine.metrics()
    assert (
        m["tier_blocks_read"] == m["tier_host_blocks_read"] == both.host.stats["tier_blocks_read"]
    )
    kv_tier.keep_pool(engine)
    again = small_engine(model, kv_tier.HostOverDisk(HostTier(2**30), disk(model, tmp_path)))
    assert one_by_one(again, PROMPTS) == want
    assert again.metrics()["tier_disk_blocks_read"] == 6 * 4


def test_samples_of_n_2_equal_with_the_tier(tiny, tmp_path):
    _, model, _ = tiny
    sampled = SAMPLED
    plain = Engine.for_model(model, num_blocks=400)
    want = [plain.run_batch([p], sampled)[0]["tokens"] for p in PROMPTS]
    tier = disk(model, tmp_path)
    engine = small_engine(model, tier)
    one_by_one(engine, PROMPTS, sampled)
    tier.flush()
    assert one_by_one(engine, PROMPTS, sampled) == want
    assert engine.metrics()["tier_tokens_hit"] > 0


def test_a_draft_model_recomputes_what_the_tier_loads(tiny, tmp_path):
    """--speculate draft beside the tier: the draft's own pool is not loaded, and it trusts a
    block only for the tokens it filled it with, so it recomputes; the tokens stay the target's."""
    from speedups.draft_model import DraftModel

    _, model, want = tiny
    drafter = DraftModel(model, model, k=3, num_blocks=12, block_size=16)
    engine = Engine.for_model(model, num_blocks=12, max_num_seqs=2, max_num_batched_tokens=64,
                              tier=HostTier(2**30), speculate=drafter)  # fmt: skip
    first, second = one_by_one(engine, PROMPTS), one_by_one(engine, PROMPTS)
    assert first == want and second == want
    m = engine.metrics()
    assert m["tier_tokens_hit"] > 0 and m["draft_tokens_accepted"] > 0, m


def test_a_restart_reloads_every_head_from_disk(tiny, tmp_path):
    _, model, want = tiny
    tier = disk(model, tmp_path)
    engine = small_engine(model, tier)
    one_by_one(engine, PROMPTS)
    kv_tier.keep_pool(engine)  # what the pool still holds goes to disk too, as batch.py's end
    again = small_engine(model, disk(model, tmp_path))  # a new pool, the same folder
    assert one_by_one(again, PROMPTS) == want
    assert again.metrics()["tier_tokens_hit"] == 6 * 64  # every head, its first time


def test_a_waiting_request_s_prefix_is_read_ahead(tiny, tmp_path, monkeypatch):
    """After a restart, each request's prefix is read from disk by the reader thread while it
    waits; its admission then reads no file (the step's own reads made to fail), and the outputs
    are those computed without the tier."""
    _, model, want = tiny
    engine = small_engine(model, disk(model, tmp_path))
    one_by_one(engine, PROMPTS)
    kv_tier.keep_pool(engine)
    tier = disk(model, tmp_path)
    again = small_engine(model, tier)
    ids = [again.add_request(p, GREEDY) for p in PROMPTS]  # all queued: 2 run at a time
    deadline = time.time() + 30
    while len(tier.ahead) < 6 * 4 and time.time() < deadline:  # six heads of four blocks
        time.sleep(0.01)
    assert len(tier.ahead) == 6 * 4
    engine_thread, read, on_engine_thread = threading.current_thread(), kv_disk._read, []

    def recorded(path):
        on_engine_thread.append(threading.current_thread() is engine_thread)
        return read(path)

    monkeypatch.setattr(kv_disk, "_read", recorded)
    done = {e.request_id: e.result["tokens"] for e in run_all(again)}
    assert not any(on_engine_thread), "a step read a file"
    assert [done[i] for i in ids] == want
    stats = again.metrics()
    assert stats["tier_blocks_read_ahead"] == stats["tier_blocks_read"] == 6 * 4


def test_two_processes_on_one_folder_keep_it_within_its_size(tmp_path):
    """Two tiers on one folder (two servers): each re-reads the folder as it writes, so their
    files together stay within the size; the other's blocks are read back whole."""
    k, v = torch.ones(2, 3, 4, 16), torch.ones(2, 16, 3, 4)
    size = len(kv_disk._bytes(k)) + len(kv_disk._bytes(v)) + 1024  # a block's file, and room
    a = DiskTier(tmp_path, 5 * size, "fp", rescan_every=1)
    b = DiskTier(tmp_path, 5 * size, "fp", rescan_every=1)
    for h in range(1, 5):
        a.put(h, None, [h] * 16, k, v)
    a.flush()
    for h in range(5, 9):
        b.put(h, None, [h] * 16, k * h, v)
    b.flush()
    held = sum(p.stat().st_size for p in (tmp_path / "fp").glob("*.safetensors"))
    assert held <= 5 * size and len(list((tmp_path / "fp").glob("*.safetensors"))) < 8
    a._rescan()
    got = a.fetch(8, None, [8] * 16)  # b's newest, read by a
    assert got is not None and torch.equal(got[0], k * 8)


def run_all(engine) -> list:
    events = []
    while engine.has_unfinished():
        events += [e for e in engine.step() if hasattr(e, "result")]
    return events


def test_bad_files_are_skipped_with_one_warning_each(tiny, tmp_path, capfd):
    """Corrupt bytes, a truncated file, another model's file under this name: each a miss (the
    request computes its head and gives the same tokens), said once, the file removed (and
    written again, whole, when the recomputed block is evicted)."""
    _, model, want = tiny
    engine = small_engine(model, disk(model, tmp_path))
    one_by_one(engine, PROMPTS)
    kv_tier.keep_pool(engine)
    tier = engine.scheduler.tier
    files = sorted(tier.root.glob("*.safetensors"))
    assert len(files) >= 12
    corrupt, short, foreign = files[:3]
    data = bytearray(corrupt.read_bytes())
    data[-8:] = bytes(8)
    corrupt.write_bytes(bytes(data))
    short.write_bytes(short.read_bytes()[:100])
    other = DiskTier(tmp_path / "other", 2**30, "0" * 16)  # another fingerprint's file
    k, v = small_engine(model, None).cache.block_kv(1)
    meta_src = kv_disk._read(foreign)[2]
    other._write(
        int(foreign.stem, 16), int(meta_src["parent"]), json.loads(meta_src["tokens"]), k, v
    )
    foreign.write_bytes((other.root / foreign.name).read_bytes())
    capfd.readouterr()
    again = small_engine(model, disk(model, tmp_path))
    assert one_by_one(again, PROMPTS) == want
    err = capfd.readouterr().err
    for kind in ("corrupt", "unreadable", "foreign"):
        assert err.count(f": {kind}") == 1, err
    for path in (corrupt, short, foreign):  # removed, or written again whole when re-evicted
        assert not path.exists() or kv_disk._read(path)[2]["fingerprint"] == tier.fp


def test_a_folder_that_cannot_be_written_or_fills_up_leaves_the_engine_serving(
    tiny, tmp_path, capfd, monkeypatch
):
    _, model, want = tiny
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    tier = disk(model, blocked)  # its folder cannot be made
    assert one_by_one(small_engine(model, tier), PROMPTS) == want
    assert "the KV disk tier is off" in capfd.readouterr().err
    assert tier.stats["tier_blocks_written"] == 0

    def full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("safetensors.torch.save_file", full)
    tier = disk(model, tmp_path / "full")
    engine = small_engine(model, tier)
    assert one_by_one(engine, PROMPTS) == want
    tier.flush()
    assert one_by_one(engine, PROMPTS) == want
    assert "No space left on device" in capfd.readouterr().err and tier.broken


def test_a_slow_disk_never_holds_a_step(tiny, tmp_path, monkeypatch):
    """Each write takes 0.3 s: the engine's run does not wait for them (the writer's queue of 2
    drops what it cannot take, counted)."""
    _, model, want = tiny
    slow = DiskTier._write

    def crawl(self, *a):
        time.sleep(0.3)
        slow(self, *a)

    monkeypatch.setattr(DiskTier, "_write", crawl)
    tier = disk(model, tmp_path, max_queued=2)
    engine = small_engine(model, tier)
    start = time.perf_counter()
    assert one_by_one(engine, PROMPTS) + one_by_one(engine, PROMPTS) == want + want
    took = time.perf_counter() - start
    written = tier.stats["tier_blocks_written"] + tier.stats["tier_blocks_dropped"]
    assert tier.stats["tier_blocks_dropped"] > 0 and took < 0.3 * written, (took, tier.stats)
    tier.close()


def test_what_the_tier_cannot_serve_is_refused_by_name(tiny):
    folder, _, _ = tiny
    args = ["--requests", "-", "--checkpoint", str(folder)]
    with pytest.raises(SystemExit):
        batch.parse_args(args + ["--kv_disk_cache", "x", "--no_prefix_caching"])


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """Gemma 2 with a window of 24 on layer 0 (of 16-token blocks: a 64-token head's last two are
    in the window of the token after it) and full attention on layer 1: two pools."""
    folder = save_hf(hf_model("gemma2", sliding_window=24), tmp_path_factory.mktemp("hybrid"))
    model, _ = weights.load(folder, dtype=torch.float32)
    plain = Engine.for_model(model, num_blocks=400, window_blocks=400)
    greedy = [r["tokens"] for r in plain.run_batch(PROMPTS, GREEDY)]
    return model, greedy, [plain.run_batch([p], SAMPLED)[0]["tokens"] for p in PROMPTS[:4]]


def hybrid_engine(model, tier, num_blocks=12):
    """Pools of 11 full blocks (as small_engine's) and 9 windowed ones (one window and chunk);
    engine.pools_loaded records which pool each block the tier loads goes to."""
    engine = Engine.for_model(model, num_blocks=num_blocks, window_blocks=9, max_num_seqs=2,
                              max_num_batched_tokens=64, tier=tier)  # fmt: skip
    engine.pools_loaded, load = [], engine.cache.load_block

    def recorded(block, k, v, pool):
        engine.pools_loaded.append(pool)
        load(block, k, v, pool)

    engine.cache.load_block = recorded
    return engine


@pytest.mark.parametrize("kind", ["host", "disk"])
def test_a_hybrid_model_s_two_pools_come_back_from_the_tier(hybrid, tmp_path, kind):
    """Both pools evict under pressure; the second pass loads the full layers' blocks of each
    head and the windowed layers' of its last window, and the tokens (greedy, then n = 2
    sampled) are those computed without the tier."""
    model, greedy, sampled = hybrid
    tier = HostTier(2**30) if kind == "host" else disk(model, tmp_path)
    engine = hybrid_engine(model, tier)
    assert engine.scheduler.window_allocator is not None  # (a hybrid's two pools)
    assert one_by_one(engine, PROMPTS) == greedy
    getattr(tier, "flush", lambda: None)()
    hit = engine.metrics()["tier_tokens_hit"]
    assert one_by_one(engine, PROMPTS) == greedy
    assert engine.metrics()["tier_tokens_hit"] - hit >= 4 * 64
    assert one_by_one(engine, PROMPTS[:4], SAMPLED) == sampled
    assert set(engine.pools_loaded) == {0, 1}


def test_a_hybrid_s_windowed_blocks_alone_come_from_the_tier(hybrid, tmp_path):
    """A full pool that holds every head beside a windowed pool that keeps none: a hit shares
    the full pool's blocks and loads only the windowed layers' last window."""
    model, greedy, _ = hybrid
    engine = hybrid_engine(model, HostTier(2**30), num_blocks=400)
    assert one_by_one(engine, PROMPTS) + one_by_one(engine, PROMPTS) == greedy + greedy
    assert engine.metrics()["tier_tokens_hit"] >= 4 * 64
    assert set(engine.pools_loaded) == {1}


def test_a_hybrid_restart_loads_each_head_up_to_a_missing_windowed_block(hybrid, tmp_path):
    """After a restart every head comes from disk, read ahead while it waits (four full blocks
    and two windowed ones each), except that the windowed file of head 0's last block is gone:
    its hit ends a block earlier (three full blocks, and the windowed blocks 1 and 2 of their
    window)."""
    model, greedy, _ = hybrid
    engine = hybrid_engine(model, disk(model, tmp_path))
    one_by_one(engine, PROMPTS)
    kv_tier.keep_pool(engine)
    tier = disk(model, tmp_path)
    tier.expected = engine.cache.block_shapes()
    h, _, _ = kv_tier.prefix_chain(HEADS[0], None, 16, 4)[3]
    (tier.root / f"{tier.name(h, 1):032x}.safetensors").unlink()
    tier._rescan()
    again = hybrid_engine(model, tier)
    ids = [again.add_request(p, GREEDY) for p in PROMPTS]
    deadline = time.time() + 30
    while len(tier.ahead) < 6 * 6 - 1 and time.time() < deadline:
        time.sleep(0.01)
    assert len(tier.ahead) == 5 * 6 + 3 + 2
    done = {e.request_id: e.result["tokens"] for e in run_all(again)}
    assert [done[i] for i in ids] == greedy
    m = again.metrics()
    assert m["tier_tokens_hit"] == 6 * 64 - 16
    assert m["tier_blocks_read"] == m["tier_blocks_read_ahead"] == 5 * 6 + 3 + 2


def test_batch_py_finds_a_previous_runs_heads_on_disk(tiny, tmp_path, capsys, monkeypatch):
    """batch.py --kv_disk_cache twice over the same heads: the second run's requests load them."""
    folder, _, want = tiny
    lines = [json.dumps({"id": i, "prompt": p, "max_new_tokens": 6, "temperature": 0})
             for i, p in enumerate(PROMPTS)]  # fmt: skip
    path = tmp_path / "requests.jsonl"
    path.write_text("\n".join(lines) + "\n")
    cache = tmp_path / "kv"
    argv = ["--requests", str(path), "--checkpoint", str(folder), "--dtype", "float32"]
    argv += ["--num_blocks", "12", "--max_num_seqs", "2", "--max_num_batched_tokens", "64"]
    argv += ["--kv_disk_cache", str(cache), "--compile", "off"]
    for run in range(2):
        assert batch.main(argv) == 0
        out = capsys.readouterr()
        got = {o["id"]: o["tokens"] for o in map(json.loads, out.out.strip().splitlines())}
        assert [got[i] for i in range(len(PROMPTS))] == want
    assert "KV tier: 384 prompt tokens not recomputed" in out.err, out.err[-400:]  # 6 heads x 64
    assert any(Path(cache).rglob("*.safetensors"))


def test_keep_pool_waits_for_the_writer_and_metrics_report_the_tier(tiny, tmp_path):
    """keep_pool blocks rather than drop (a queue of 1 here); serve.py's /metrics has the tier's
    lines."""
    import httpx
    from test_serve import start_server

    from formats.tokenizer import load_tokenizer

    folder, model, want = tiny
    tier = disk(model, tmp_path, max_queued=1)
    engine = small_engine(model, tier)
    one_by_one(engine, PROMPTS)
    cached = len(engine.scheduler.allocator.hash_of)
    kv_tier.keep_pool(engine)
    held = {int(p.stem, 16) for p in tier.root.glob("*.safetensors")}
    assert set(engine.scheduler.allocator.cached) <= held and cached > 0
    tok = load_tokenizer(folder)
    served = Engine.for_model(model, num_blocks=12, max_num_seqs=2, max_num_batched_tokens=64,
                              tokenizer=tok, tier=HostTier(2**30))  # fmt: skip
    url, _, stop = start_server(served, tok)
    try:
        for p in PROMPTS[:4]:
            r = httpx.post(url + "/v1/completions", json={"prompt": p, "max_tokens": 2},
                           headers={"Authorization": "Bearer test-key"}, timeout=60)  # fmt: skip
            assert r.status_code == 200, r.text
        text = httpx.get(url + "/metrics", headers={"Authorization": "Bearer test-key"}).text
    finally:
        stop()
    assert "llm_kv_tier_blocks_written_total" in text and "llm_kv_tier_bytes " in text, text


def test_generate_py_keeps_its_prompt_on_disk_for_the_next_run(tmp_path, capsys):
    """generate.py --cache paged --kv_disk_cache: the second run loads the prompt's whole blocks
    (all but the one holding its last token) and prefills the rest; its tokens equal the first
    run's and the static cache's."""
    import generate

    folder = tiny_checkpoint(tmp_path / "ckpt", arch="llama3")
    argv = ["--checkpoint", str(folder), "--dtype", "float32", "--temperature", "0", "--json"]
    argv += ["--prompt", "hello world, the quick brown fox jumps over the lazy dog " * 4]
    argv += ["--max_new_tokens", "8", "--ignore_eos", "--compile", "off"]
    disk = ["--cache", "paged", "--kv_disk_cache", str(tmp_path / "kv")]

    def run(*extra):
        assert generate.main([*argv, *extra]) == 0
        out, err = capsys.readouterr()
        return json.loads(out.strip().splitlines()[-1]), err

    static, _ = run()
    first, log1 = run(*disk)
    second, log2 = run(*disk)
    n = len(static["prompt_tokens"])
    assert f"first 0 of {n} tokens loaded" in log1
    assert f"first {(n - 1) // 16 * 16} of {n} tokens loaded" in log2 and n > 32
    assert first["tokens"] == second["tokens"] == static["tokens"]
    with pytest.raises(SystemExit):
        generate.main([*argv, "--kv_disk_cache", str(tmp_path / "kv")])  # a static cache
