"""LoRA adapters' cost in the engine's decode step, and PEFT's own mixed-adapter batch beside it.

    .venv/bin/python benchmarks/bench_lora.py [--rows 16] [--adapters 4] [--rank 16] [--steps 40]

The embedded SmolLM2-135M in bfloat16 (q/k/v and gate/up fused, as serve.py loads it), with
`adapters` random rank-`rank` adapters on all seven projections, written in PEFT's layout and
read back by formats/lora_files.py. `rows` requests (64-token prompts) decode together; a step is
timed once every row decodes (median of `steps`; each engine runner `repeats` times in turn, the
median run kept). Rows of the engine:
- base: no adapter slots at all;
- slots, base rows: the slots resident, no row using one (the mask is None: no extra matmul);
- mixed: the rows spread over the adapters in turn (speedups/lora.py's two matmuls per projection).
Then HF transformers + peft on the same weights (dense bf16) and adapters: one decode step of the
same rows
(a KV cache of the same length), the base and with `adapter_names` (PEFT's mixed-batch
inference), eager. Last, the part of a run-time load that runs on the engine's thread (the copy
into a slot) against one step: serve.py reads and checks the files before that, off the thread.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from engine import Engine, RequestParams
from formats import hf_folder, weights
from formats.lora_files import read_adapter, target_shape
from speedups import lora

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_adapter(folder: Path, config, rank: int, seed: int) -> Path:
    """A random adapter on every projection, as PEFT saves one."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    g, tensors = torch.Generator().manual_seed(seed), {}
    for i in range(config.n_layers):
        for t in TARGETS:
            d_in, d_out = target_shape(config, t)
            part = "mlp" if t in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            key = f"base_model.model.model.layers.{i}.{part}.{t}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, d_in, generator=g) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(d_out, rank, generator=g) * 0.02
    save_file(tensors, folder / "adapter_model.safetensors")
    meta = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": TARGETS}
    (folder / "adapter_config.json").write_text(json.dumps(meta))
    return folder


def step_ms(engine, prompts, names, steps: int) -> float:
    """Median ms of an engine step once every row decodes."""
    for p, name in zip(prompts, names):
        engine.add_request(p, RequestParams(max_new_tokens=steps + 8, temperature=0, adapter=name))
    while any(s.num_computed < len(s.tokens) - 1 for s in engine.scheduler.running) or (
        engine.scheduler.waiting
    ):
        engine.step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    while engine.has_unfinished():
        engine.step()
    return 1000 * statistics.median(times)


def hf_step_ms(hf, prompts, names, steps: int) -> float:
    """Median ms of one decode step of PEFT's model over the rows (names: adapter per row)."""
    ids = torch.tensor(prompts)
    extra = {"adapter_names": names} if names else {}
    with torch.no_grad():
        out = hf(ids, use_cache=True, **extra)
        times = []
        for _ in range(steps):
            cache = out.past_key_values
            t = time.perf_counter()
            hf(ids[:, -1:], past_key_values=cache, use_cache=True, **extra)
            times.append(time.perf_counter() - t)
            cache.crop(-1)  # (the same length each step)
    return 1000 * statistics.median(times)


def peft_twin(folders, dtype):
    """HF transformers on the embedded weights (dense, written as an HF folder) with every
    adapter loaded by peft."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    plain, _ = weights.load(None, dtype=dtype, dequantize=True)
    folder = hf_folder.save_hf_folder(plain, tempfile.mkdtemp(prefix="smollm2-hf-"))
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype)
    wrapped = PeftModel.from_pretrained(hf.eval(), str(folders[0]), adapter_name=folders[0].name)
    for f in folders[1:]:
        wrapped.load_adapter(str(f), adapter_name=f.name)
    return wrapped.eval()


def engine_rows(model, adapters, prompts, names, steps):
    engine = Engine.for_model(model, num_blocks=len(prompts) * 12, max_num_seqs=len(prompts))
    engine.adapters = adapters
    return step_ms(engine, prompts, names, steps)


def engine_runs(model, adapters, prompts, mixed, args) -> list:
    """[(runner, median ms)] of the three engine runners, taken in turn `repeats` times (a slow
    spell of a shared machine then lands on all three)."""
    base, runs = [None] * len(prompts), {}
    for _ in range(args.repeats):
        with adapters.unwrapped():  # the projections as they were: no slots at all
            ms = engine_rows(model, None, prompts, base, args.steps)
        runs.setdefault("engine: base (no slots)", []).append(ms)
        ms = engine_rows(model, adapters, prompts, base, args.steps)
        runs.setdefault("engine: slots, base rows", []).append(ms)
        ms = engine_rows(model, adapters, prompts, mixed, args.steps)
        runs.setdefault("engine: mixed adapters", []).append(ms)
    return [(name, statistics.median(v)) for name, v in runs.items()]


def load_ms(adapters, adapter, repeats: int = 5) -> float:
    """Median ms of the engine-thread part of a run-time load: the copy into a slot."""
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        adapters.load(adapter, replace=True)
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times)


def main():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--repeats", type=int, default=3, help="engine runs of each kind, in turn")
    p.add_argument("--no_hf", action="store_true", help="skip HF transformers + peft")
    args = p.parse_args()
    dtype = torch.bfloat16
    model, _ = weights.load_for_inference(None, dtype=dtype, dequantize=True)
    root = Path(tempfile.mkdtemp(prefix="bench-lora-"))
    folders = [
        write_adapter(root / f"a{i}", model.config, args.rank, i) for i in range(args.adapters)
    ]
    prompts = [[(7 * r + k) % 3000 + 100 for k in range(64)] for r in range(args.rows)]
    mixed = [folders[r % len(folders)].name for r in range(args.rows)]
    adapters = lora.Adapters(model, args.adapters, args.rank)
    loaded = [read_adapter(f, model.config) for f in folders]
    for a in loaded:
        adapters.load(a)
    rows = engine_runs(model, adapters, prompts, mixed, args)
    if not args.no_hf:
        hf = peft_twin(folders, dtype)
        with hf.disable_adapter():
            rows.append(("HF + peft: base", hf_step_ms(hf, prompts, None, args.steps)))
        rows.append(("HF + peft: mixed adapters", hf_step_ms(hf, prompts, mixed, args.steps)))
    first = rows[0][1]
    slots = adapters.nbytes() / 2**20
    print(
        f"\n{args.rows} decoding rows, {args.adapters} adapters of rank {args.rank} on 7 "
        f"projections ({slots:.1f} MiB of slots), bfloat16, {torch.get_num_threads()} threads\n"
    )
    print("| runner | ms / step | tokens/s | vs engine base |")
    print("|---|---|---|---|")
    for name, ms in rows:
        print(f"| {name} | {ms:.2f} | {args.rows * 1000 / ms:.0f} | {ms / first:.2f}x |")
    copy = load_ms(adapters, loaded[0])
    print(f"\nrun-time load, the engine thread's part (copy into a slot): {copy:.2f} ms")


if __name__ == "__main__":
    main()
