"""One tensor-parallel rank, started by tests/test_tp.py (generate.py's path) and
tests/test_tp_engine.py (the engine's) with torch.multiprocessing (spawn)."""

import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch._inductor.config
import torch.distributed as dist

PROMPT = [[3, 17, 42, 7, 99, 5, 23, 8]]


def run_rank(
    rank, world, checkpoints, init_file, out_dir, new_tokens, compile_decode=False, quantize=None
):
    torch.set_num_threads(1)  # the ranks share the machine's cores
    # and compile in process: Inductor's pool of compile workers (2 on a 2-core machine) once
    # aborted a rank ("terminate called without an active exception") in a full-suite run
    torch._inductor.config.compile_threads = 1
    out = Path(out_dir)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=90),
    )
    try:
        import compiling
        import generate
        import tp
        from formats import weights
        from kv_cache import NoCache, StaticKVCache
        from sampling import SamplingParams

        model, _ = weights.load(checkpoints[rank], dtype=torch.float32, shard=(rank, world))
        if (
            quantize
        ):  # (mode, groupsize): each rank quantizes its own shard, as generate.py --quantize does
            import quantize as q

            q.quantize_model(model, *quantize)
        tp.check_same_checkpoint(model)
        tp.parallelize(model)
        x = torch.tensor(PROMPT)
        with torch.no_grad():
            logits = model(x, torch.arange(x.shape[1])[None], NoCache())
        cache = StaticKVCache.for_model(model, 1, 64)
        decode_fn = compiling.compile_decode("cpu") if compile_decode else compiling.decode_one
        rows, _ = generate.generate(
            model,
            cache,
            x,
            new_tokens,
            SamplingParams(0.0),
            generate.DecodeOptions(ignore_eos=True, decode_fn=decode_fn),
        )
        torch.save(
            {"logits": logits, "tokens": rows[0], "weight_bytes": model.weight_bytes()},
            out / f"rank{rank}.pt",
        )
    except Exception as e:
        (out / f"rank{rank}.err").write_text(f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
    finally:
        dist.destroy_process_group()


ENGINE = dict(num_blocks=18, block_size=4, max_num_seqs=8, max_num_batched_tokens=32)


def engine_workload(engine, tokenizer) -> dict:
    """Shared prompt heads, n = 2, sampled and greedy rows, a pool tight enough to preempt, and an
    abort after three steps: {request id: (each sample's tokens, finish reasons)}."""
    from engine import Finished, RequestParams

    head = tokenizer.encode("hello world, the quick brown fox")
    ids = [
        engine.add_request(head + tokenizer.encode(tail), RequestParams(**params))
        for tail, params in [
            (" jumps", dict(max_new_tokens=24, temperature=0.0, ignore_eos=True)),
            (" over", dict(max_new_tokens=20, temperature=0.9, seed=4, n=2, ignore_eos=True)),
            (" the lazy", dict(max_new_tokens=30, temperature=0.0, ignore_eos=True)),
            (" dog", dict(max_new_tokens=40, temperature=0.7, seed=1, ignore_eos=True)),
        ]
    ]
    done = {}
    for step in range(10_000):
        if step == 3:
            engine.abort(ids[3])
        if not engine.has_unfinished():
            break
        done.update((e.request_id, e.request) for e in engine.step() if isinstance(e, Finished))
    return {
        rid: ([s.output for s in r.seqs], [s.finish_reason for s in r.seqs])
        for rid, r in done.items()
    }, engine.scheduler.stats["preemptions"]


def run_engine_rank(rank, world, folder, init_file, out_dir, options):
    """tp_engine.build on a float64 model: rank 0 runs engine_workload and saves what it gave."""
    import json

    torch.set_num_threads(1)
    out = Path(out_dir)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )
    try:
        import tp
        from formats import weights
        from formats.tokenizer import load_tokenizer
        from server import tp_engine

        model, info = weights.load(folder, dtype=torch.float64, shard=(rank, world))
        tp_engine.check_same_options(options[rank])
        tp.parallelize(model)
        tokenizer = load_tokenizer(info.source)
        try:
            engine = tp_engine.build(model, tokenizer, **options[rank])
        except SystemExit:  # a follower: rank 0 said stop (and the group is destroyed)
            return
        results, preemptions = engine_workload(engine, tokenizer)
        engine.model.link.stop()  # (atexit does not run in a spawned process); destroys the group
        (out / "rank0.json").write_text(
            json.dumps(
                {
                    "results": {str(k): v for k, v in results.items()},
                    "preemptions": preemptions,
                    "ranks": engine.ranks,
                }
            )
        )
    except Exception as e:
        (out / f"rank{rank}.err").write_text(f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
