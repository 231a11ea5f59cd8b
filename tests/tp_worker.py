"""One tensor-parallel rank, started by tests/test_tp.py with torch.multiprocessing (spawn)."""
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch._inductor.config
import torch.distributed as dist

PROMPT = [[3, 17, 42, 7, 99, 5, 23, 8]]


def run_rank(rank, world, checkpoints, init_file, out_dir, new_tokens, compile_decode=False, quantize=None):
    torch.set_num_threads(1)  # the ranks share the machine's cores
    # and compile in process: Inductor's pool of compile workers (2 on a 2-core machine) once
    # aborted a rank ("terminate called without an active exception") in a full-suite run
    torch._inductor.config.compile_threads = 1
    out = Path(out_dir)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=90))
    try:
        import generate
        import runtime
        import tp
        import weights
        from kv_cache import NoCache, StaticKVCache
        from sampling import SamplingParams

        model, _ = weights.load(checkpoints[rank], dtype=torch.float32, shard=(rank, world))
        if quantize:  # (mode, groupsize): each rank quantizes its own shard, as generate.py --quantize does
            import quantize as q

            q.quantize_model(model, *quantize)
        tp.check_same_checkpoint(model)
        tp.parallelize(model)
        x = torch.tensor(PROMPT)
        with torch.no_grad():
            logits = model(x, torch.arange(x.shape[1])[None], NoCache())
        cache = StaticKVCache.for_model(model, 1, 64)
        decode_fn = runtime.compile_decode("cpu") if compile_decode else runtime.decode_one
        rows, _ = generate.generate(model, cache, x, new_tokens, SamplingParams(0.0), ignore_eos=True, decode_fn=decode_fn)
        torch.save({"logits": logits, "tokens": rows[0], "weight_bytes": model.weight_bytes()}, out / f"rank{rank}.pt")
    except Exception as e:
        (out / f"rank{rank}.err").write_text(f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
    finally:
        dist.destroy_process_group()
