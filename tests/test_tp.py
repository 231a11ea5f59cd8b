"""tp.py: ranks spawned here with gloo on CPU give the logits and tokens of one process."""

import time

import pytest
import torch
import torch.multiprocessing as mp
from helpers import hf_model, save_hf
from tp_worker import PROMPT, run_rank

import generate
import tp
from formats import weights
from kv_cache import NoCache, StaticKVCache
from sampling import SamplingParams

NEW_TOKENS = 12


def start_ranks(fn, args, world: int, timeout_s: float):
    """fn(rank, *args) on `world` spawned processes, joined within timeout_s (else killed, failing
    the test)."""
    ctx = mp.start_processes(fn, args=args, nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"tensor-parallel ranks did not finish within {timeout_s} s")


def spawn(
    checkpoints, tmp_path, new_tokens=NEW_TOKENS, timeout_s=300, compile_decode=False, quantize=None
):
    """Run one rank per checkpoint (file rendezvous, no port); return each rank's result or
    error."""
    world = len(checkpoints)
    start_ranks(
        run_rank,
        (
            world,
            [str(c) if c else None for c in checkpoints],
            str(tmp_path / "rendezvous"),
            str(tmp_path),
            new_tokens,
            compile_decode,
            quantize,
        ),
        world,
        timeout_s,
    )
    results = []
    for rank in range(world):
        err = tmp_path / f"rank{rank}.err"
        results.append(
            err.read_text()
            if err.exists()
            else torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        )
    return results


def single_process(checkpoint):
    model, _ = weights.load(checkpoint, dtype=torch.float32)
    x = torch.tensor(PROMPT)
    with torch.no_grad():
        logits = model(x, torch.arange(x.shape[1])[None], NoCache())
    rows, _ = generate.generate(
        model,
        StaticKVCache.for_model(model, 1, 64),
        x,
        NEW_TOKENS,
        SamplingParams(0.0),
        generate.DecodeOptions(ignore_eos=True),
    )
    return model, logits, rows[0]


def check_ranks(results, model, logits, tokens, world, atol):
    weights = [*model.named_parameters(), *model.named_buffers()]  # a router's correction bias
    replicated = sum(
        p.numel() * p.element_size()
        for n, p in weights
        if not any(k in n for k in tp.COLUMN_PARALLEL + tp.ROW_PARALLEL + ("rotary",))
    )
    sharded = model.weight_bytes() - replicated
    row_biases = sum(
        p.numel() * p.element_size()
        for n, p in model.named_parameters()  # (zeros but on rank 0)
        if n.endswith(("o_proj.bias", "down_proj.bias", "down_proj_bias"))
    )
    for r in results:
        assert isinstance(r, dict), r  # an error text otherwise
        torch.testing.assert_close(r["logits"], logits, atol=atol, rtol=0)
        assert r["tokens"] == tokens
        assert (
            r["weight_bytes"] <= sharded / world + replicated + row_biases
        )  # each rank holds those whole


def test_tiny_gqa_model_on_two_ranks_equals_one_process(tmp_path):
    """4 heads, 2 KV heads, biases on q/k/v, o_proj and the MLP (row-parallel biases added once)."""
    folder = save_hf(hf_model("llama_bias"), tmp_path / "ckpt")
    model, logits, tokens = single_process(folder)
    check_ranks(spawn([folder, folder], tmp_path), model, logits, tokens, 2, atol=1e-5)


def test_compiled_decode_on_two_ranks_equals_one_process(tmp_path):
    """The compiled decode step (fullgraph, with the all-reduces inside) on each rank."""
    folder = save_hf(hf_model("llama3"), tmp_path / "ckpt")
    model, logits, tokens = single_process(folder)
    check_ranks(
        spawn([folder, folder], tmp_path, compile_decode=True, timeout_s=600),
        model,
        logits,
        tokens,
        2,
        atol=1e-5,
    )


def test_embedded_model_on_three_ranks_equals_one_process(embedded, tmp_path):
    model, _ = embedded
    x = torch.tensor(PROMPT)
    with torch.no_grad():
        logits = model(x, torch.arange(x.shape[1])[None], NoCache())
    rows, _ = generate.generate(
        model,
        StaticKVCache.for_model(model, 1, 64),
        x,
        NEW_TOKENS,
        SamplingParams(0.0),
        generate.DecodeOptions(ignore_eos=True),
    )
    check_ranks(spawn([None] * 3, tmp_path), model, logits, rows[0], 3, atol=1e-4)


def test_world_size_that_does_not_divide_the_heads_names_the_ones_that_do(embedded):
    model, _ = embedded
    with pytest.raises(ValueError, match=r"9 heads, 3 KV heads.*world sizes that work: \[1, 3\]"):
        tp.shard_config(model.config, 2)


def test_mismatched_checkpoints_fail_on_every_rank_without_hanging(tmp_path):
    a = save_hf(hf_model("llama3", seed=0), tmp_path / "a")
    b = save_hf(hf_model("llama3", seed=1), tmp_path / "b")
    results = spawn([a, b], tmp_path, timeout_s=200)
    for r in results:
        assert isinstance(r, str) and "loaded a different checkpoint from rank 0" in r


def test_int4_quantized_shards_equal_one_process(tmp_path):
    """--quantize under torchrun: each rank quantizes its shard. With groups of 32 and shards of 64
    or 128 input channels, every group lies inside one shard, so the ranks together hold exactly
    the single process's int4 weights; only the all-reduce's summation order differs."""
    import quantize

    ckpt = save_hf(hf_model("llama3", hidden_size=128, intermediate_size=256), tmp_path / "ckpt")
    results = spawn([ckpt, ckpt], tmp_path, quantize=("int4", 32))
    model, _ = weights.load(ckpt)
    quantize.quantize_model(model, "int4", 32)
    x = torch.tensor(PROMPT)
    with torch.no_grad():
        logits = model(x, torch.arange(x.shape[1])[None], NoCache())
    rows, _ = generate.generate(
        model,
        StaticKVCache.for_model(model, 1, 64),
        x,
        NEW_TOKENS,
        SamplingParams(0.0),
        generate.DecodeOptions(ignore_eos=True),
    )
    for r in results:
        assert not isinstance(r, str), r
        torch.testing.assert_close(r["logits"], logits, atol=1e-4, rtol=1e-4)
        assert r["tokens"] == rows[0]


def test_gemma2_on_two_ranks_equals_one_process(tmp_path):
    """Soft-capping, sandwich norms, (1 + w) norms and windows, each rank holding half the heads."""
    folder = save_hf(hf_model("gemma2"), tmp_path / "ckpt")
    model, logits, tokens = single_process(folder)
    check_ranks(spawn([folder, folder], tmp_path), model, logits, tokens, 2, atol=1e-5)


def test_moe_on_two_ranks_equals_one_process(tmp_path):
    """Qwen2-MoE: each expert's width and the shared expert split, the router replicated (every rank
    picks the same experts), one all-reduce after the sparse layer; its dense layer as before."""
    folder = save_hf(hf_model("qwen2_moe"), tmp_path / "ckpt")
    model, logits, tokens = single_process(folder)
    check_ranks(spawn([folder, folder], tmp_path), model, logits, tokens, 2, atol=1e-5)


def test_gpt_oss_on_two_ranks_equals_one_process(tmp_path):
    """Attention sinks split with their heads, expert biases split with the experts' width (down's
    added once), the router and its bias replicated."""
    folder = save_hf(hf_model("gpt_oss"), tmp_path / "ckpt")
    model, logits, tokens = single_process(folder)
    check_ranks(spawn([folder, folder], tmp_path), model, logits, tokens, 2, atol=1e-5)


def test_deepseek_v3_on_two_ranks_equals_one_process(tmp_path):
    """Latent attention: each rank its half of the heads (q_b_proj, kv_b_proj, o_proj), the latent
    computed and cached whole on both; sigmoid routing with a correction bias, replicated."""
    folder = save_hf(hf_model("deepseek_v3"), tmp_path / "ckpt")
    model, logits, tokens = single_process(folder)
    check_ranks(spawn([folder, folder], tmp_path), model, logits, tokens, 2, atol=1e-5)
