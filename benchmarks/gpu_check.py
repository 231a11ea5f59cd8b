"""One command that checks, then times, the GPU paths: CUDA Graph decode, the int8/int4 kernels,
the paged cache and the engine. Random weights of real shapes, so nothing has to travel.

    python benchmarks/gpu_check.py --device cuda --out $OUT              # on a GPU: ~10 min
    python benchmarks/gpu_check.py --device cpu --tiny --out /tmp/check  # tiny shapes (the test
                                                                         # suite runs this)

Correctness first, in float32 on the embedded model's shape (tiny shapes with --tiny): compiled
decode = eager decode (greedy tokens); CUDA Graph replay = compiled without graphs; every int8 /
int4 layer = its dequantized reference within rounding; paged cache = static cache (logits);
and CUDA Graphs really replayed (cudaGraphLaunch events counted by torch.profiler).

Then timings, CUDA events (host clock on CPU), median of --repeats runs after a warm-up: batch-1
decode tokens/s and GB/s (weight bytes read per token x tokens/s) for a Llama-2-7B-shaped model
(bf16, int8, int4; compiled with CUDA Graphs) and the embedded model's shape (bf16: eager,
compiled, compiled + CUDA Graphs), each also as a fraction of the device's measured copy
bandwidth; compile times. Then the engine (benchmarks/gpu_engine.py): its CUDA-graph decode steps
equal to eager steps at every batch bucket, over the gathered pool and FlexAttention in place,
graph launches per step counted; and nano-vllm's workload on --requests requests against HF
transformers' continuous batching on the same weights. Each timing section has a time box
(--section_s) and the JSON and Markdown results are rewritten after every section, so a run cut
short still returns what it finished.
"""

import argparse
import json
import os
import statistics
import sys
import time
import traceback

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import compiling
import generate
import quantize
from kv_cache import StaticKVCache
from model import ModelConfig, Transformer
from paged import PagedKVCache
from sampling import SamplingParams

SHAPES = {  # name -> (ModelConfig, tiny stand-in)
    "smollm2-135m": ModelConfig(
        vocab_size=49152,
        dim=576,
        n_layers=30,
        n_heads=9,
        n_kv_heads=3,
        intermediate_size=1536,
        rope_theta=100000.0,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
    ),
    "llama3.2-1b": ModelConfig(  # its RoPE unscaled: the weights are random
        vocab_size=128256,
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        intermediate_size=8192,
        rope_theta=500000.0,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
    ),
    "llama2-7b": ModelConfig(
        vocab_size=32000,
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=32,
        intermediate_size=11008,
        max_position_embeddings=4096,
    ),
}
TINY = ModelConfig(
    vocab_size=512,
    dim=128,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    intermediate_size=256,
    max_position_embeddings=1024,
)
GREEDY = SamplingParams(0.0)


def random_model(args: ModelConfig, device, dtype, seed=0):
    """A model of this shape with weights ~ N(0, 0.02) (norms 1), built directly on the device."""
    torch.manual_seed(seed)
    with torch.device(device):
        m = Transformer(args)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0, 0.02)
    return m.to(dtype).eval()


class Clock:
    """Elapsed seconds of a block: CUDA events on a GPU, the host clock on CPU."""

    def __init__(self, device):
        self.cuda = str(device).startswith("cuda")

    def __call__(self, fn):
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / 1e3
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t


def copy_bandwidth(device, nbytes) -> float:
    """GB/s of a device-to-device copy (bytes read + bytes written), best of 5."""
    x = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).fill_(1)
    y = torch.empty_like(x)
    clock = Clock(device)
    return max(2 * nbytes / clock(lambda: y.copy_(x)) for _ in range(5)) / 1e9


def decode_tokens(model, fn, device, steps, prompt_len=16):
    """Greedy tokens of `steps` decode steps with decode function fn (batch 1, static cache)."""
    cache = StaticKVCache.for_model(model, 1, 256)
    prompt = torch.arange(1, prompt_len + 1, device=device)[None]
    rows, _ = generate.generate(
        model, cache, prompt, steps, GREEDY, generate.DecodeOptions(ignore_eos=True, decode_fn=fn)
    )
    return rows[0]


def time_decode(model, fn, device, steps, repeats) -> float:
    """Decode tokens/s at batch 1: median over repeats of `steps` steps, after a warm-up."""
    cache = StaticKVCache.for_model(model, 1, 256)
    token = torch.ones(1, 1, dtype=torch.long, device=device)
    clock = Clock(device)

    def run():
        with torch.no_grad():
            for i in range(steps):
                fn(model, cache, token, torch.full((1, 1), 16 + i, device=device))

    run()  # warm-up (compiles, records graphs)
    return steps / statistics.median(clock(run) for _ in range(repeats))


def compiled(device, graphs: bool, autotune=True):
    """generate.py's compiled decode step; on CUDA with or without CUDA Graphs."""
    if str(device).startswith("cuda") and not graphs:
        return torch.compile(compiling.decode_one, fullgraph=True, dynamic=False)
    return compiling.compile_decode(str(device), autotune=autotune)


def graph_launches(model, fn, device, steps=5) -> int:
    """cudaGraphLaunch calls seen by the profiler while decoding: proof that graphs replayed."""
    cache = StaticKVCache.for_model(model, 1, 256)
    token = torch.ones(1, 1, dtype=torch.long, device=device)
    with torch.no_grad(), torch.profiler.profile() as prof:
        for i in range(steps):
            fn(model, cache, token, torch.full((1, 1), 16 + i, device=device))
    return sum(e.count for e in prof.key_averages() if "cudaGraphLaunch" in e.key)


def portable_dequantized(portable, mode) -> torch.Tensor:
    """The weight from the portable tensors (quantize.py's own formulas, no device kernel): the
    reference for the int8 / int4 kernels (on CUDA Int4Linear.dequantize goes through the kernel
    itself)."""
    if mode == "int8":
        return portable["weight"].float() * portable["scales"].float()[:, None]
    return quantize.dequantize_int4(
        quantize.unpack_int4(portable["weight"]), portable["scales"], portable["zeros"]
    )


def check_correctness(device, tiny, report):
    args = TINY if tiny else SHAPES["smollm2-135m"]
    model = random_model(args, device, torch.float32)
    cuda = str(device).startswith("cuda")
    eager = decode_tokens(model, compiling.decode_one, device, 24)
    plain = compiled(device, graphs=False, autotune=False)
    report["compiled_equals_eager"] = decode_tokens(model, plain, device, 24) == eager
    if cuda:
        graphs = compiled(device, graphs=True)
        report["cuda_graphs_equal_no_graphs"] = decode_tokens(model, graphs, device, 24) == eager
        report["cuda_graph_launches_in_5_steps"] = graph_launches(model, graphs, device)
        report["cuda_graphs_replayed"] = (
            report["cuda_graph_launches_in_5_steps"] > 0
        )  # 0: Inductor skipped them
    else:
        report["cuda_graphs_equal_no_graphs"] = "n/a (no CUDA)"
    xb = torch.randn(3, args.dim, device=device, dtype=torch.bfloat16)
    for mode in ("int8", "int4"):
        qmodel = random_model(args, device, torch.bfloat16, seed=1)
        portable = quantize.portable_tensors(qmodel.layers[0].mlp.gate_proj.weight, mode, 64)
        quantize.quantize_model(qmodel, mode, 64, head=True)
        layer = qmodel.layers[0].mlp.gate_proj
        ref = torch.nn.functional.linear(xb.double(), portable_dequantized(portable, mode).double())
        err = ((layer(xb).double() - ref).norm() / ref.norm()).item()
        report[f"{mode}_kernel_rel_error_vs_portable_dequantized"] = err
        report[f"{mode}_kernel_ok"] = err < 1e-2
    tokens = torch.randint(0, args.vocab_size, (2, 40), device=device)
    pos = torch.arange(40, device=device).expand(2, 40)
    with torch.no_grad():
        a = model(tokens, pos, StaticKVCache.for_model(model, 2, 64))
        b = model(tokens, pos, PagedKVCache.for_batch(model, 2, 64, 16))
    report["paged_equals_static_max_abs_diff"] = (a - b).abs().max().item()
    report["paged_equals_static"] = report["paged_equals_static_max_abs_diff"] < 1e-4


def time_models(device, tiny, report, repeats, deadline):
    cuda = str(device).startswith("cuda")
    steps = 16 if tiny else 128
    bandwidth = report["copy_bandwidth_gb_s"]
    rows = report.setdefault("decode", [])
    # the rows that matter most first: the time box drops the rest
    plan = [
        ("smollm2-135m", "bf16", m) for m in (["eager"] + (["compiled+graphs"] if cuda else []))
    ]
    plan += [
        ("llama2-7b", q, "compiled+graphs" if cuda else "compiled")
        for q in ("bf16", "int4", "int8")
    ]
    plan += [("smollm2-135m", "bf16", "compiled")]
    for shape, q, mode in plan:
        if time.time() > deadline:
            rows.append({"model": shape, "weights": q, "mode": mode, "skipped": "time box"})
            continue
        try:
            rows.append(time_row(device, tiny, shape, q, mode, steps, repeats, bandwidth))
        except Exception as e:  # noqa: BLE001 (one row's failure must not lose the others)
            traceback.print_exc()
            rows.append(
                {
                    "model": shape,
                    "weights": q,
                    "mode": mode,
                    "skipped": f"{type(e).__name__}: {e}"[:200],
                }
            )
        if cuda:
            torch.cuda.empty_cache()


def time_row(device, tiny, shape, q, mode, steps, repeats, bandwidth) -> dict:
    model = random_model(TINY if tiny else SHAPES[shape], device, torch.bfloat16)
    if q != "bf16":
        quantize.quantize_model(model, q, 64, head=True)
    start = time.perf_counter()
    fn = (
        compiling.decode_one
        if mode == "eager"
        else compiled(
            device,
            graphs=mode == "compiled+graphs",
            autotune=compiling.autotune(model) and not tiny,
        )
    )
    decode_tokens(model, fn, device, 4)  # compile and warm up
    compile_s = time.perf_counter() - start
    tps = time_decode(model, fn, device, steps, repeats)
    gbs = model.bytes_read_per_token() * tps / 1e9
    return {
        "model": shape + (" (tiny stand-in)" if tiny else ""),
        "weights": q,
        "mode": mode,
        "tokens_per_s": tps,
        "gb_s": gbs,
        "fraction_of_copy_bandwidth": gbs / bandwidth,
        "compile_s": 0.0 if mode == "eager" else compile_s,
        "weight_bytes_per_token": model.bytes_read_per_token(),
    }


def markdown(report) -> str:
    lines = [
        f"device: {report['device_name']} | torch {report['torch']} | copy bandwidth "
        f"{report['copy_bandwidth_gb_s']:.0f} GB/s",
        "",
        "| check | result |",
        "|---|---|",
    ]
    lines += [f"| {k} | {v} |" for k, v in report.get("checks", {}).items()]
    lines += [
        "",
        "| model | weights | mode | tok/s | GB/s | of copy bandwidth | compile s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in report.get("decode", []):
        if "skipped" in r:
            lines.append(
                f"| {r['model']} | {r['weights']} | {r['mode']} | skipped ({r['skipped']}) | | | |"
            )
        else:
            lines.append(
                f"| {r['model']} | {r['weights']} | {r['mode']} | {r['tokens_per_s']:.1f} | "
                f"{r['gb_s']:.1f} | {r['fraction_of_copy_bandwidth']:.0%} | {r['compile_s']:.1f} |"
            )
    lines += [f"error in {name}: {error}" for name, error in report.get("errors", {}).items()]
    if report.get("engine_vs_hf"):
        lines += [
            "",
            "| engine on nano-vllm's workload | requests | ours tok/s | HF generate_batch tok/s | "
            "ratio | TTFT p50 s | per output token p50 ms | graphs captured |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in report["engine_vs_hf"]:
            lines.append(
                f"| {r['shape']} | {r['requests']} | {r['ours_tok_s']:.0f} | "
                f"{r['hf_continuous_tok_s']:.0f} | {r['ratio']:.2f}x | "
                f"{r['ours_ttft_p50_s']:.2f} | {r['ours_time_per_output_token_p50_s'] * 1e3:.1f} | "
                f"{r['graphs']['captures']} |"
            )
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--tiny",
        action="store_true",
        help="tiny shapes (a quick run that checks the script itself)",
    )
    p.add_argument(
        "--out",
        default=os.environ.get("OUT", "."),
        help="folder for gpu_check.json and gpu_check.md",
    )
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--section_s", type=float, default=240, help="time box of each timing section")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    device = args.device
    report = {
        "device": device,
        "torch": torch.__version__,
        "tiny": args.tiny,
        "device_name": torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu",
    }

    def save(section):
        report.setdefault("sections_done", []).append(section)
        with open(os.path.join(args.out, "gpu_check.json"), "w") as f:
            json.dump(report, f, indent=1, default=str)
        with open(os.path.join(args.out, "gpu_check.md"), "w") as f:
            f.write(markdown(report))
        print(f"[{section} done]", flush=True)

    def section(
        name, fn, *fn_args
    ):  # a section that fails is reported, and the next one still runs
        try:
            fn(*fn_args)
        except Exception as e:  # noqa: BLE001 (one lease, one run: keep every section's result)
            traceback.print_exc()
            report.setdefault("errors", {})[name] = f"{type(e).__name__}: {e}"
        save(name)

    report["copy_bandwidth_gb_s"] = copy_bandwidth(device, (64 if args.tiny else 1024) << 20)
    save("bandwidth")
    run_sections(args, report, section)
    print(markdown(report))
    return report


def run_sections(args, report, section):
    """Every section after the bandwidth, in turn, each with its time box."""
    import gpu_engine  # (it imports this file's shapes)

    device, tiny, checks = args.device, args.tiny, report.setdefault("checks", {})
    box = lambda: time.time() + args.section_s  # noqa: E731 (each section's own, from its start)
    section("correctness", check_correctness, device, tiny, checks)
    section("decode", time_models, device, tiny, report, args.repeats, box())
    section("engine_graphs", gpu_engine.check_buckets, device, tiny, checks, box())
    n = min(args.requests, 4) if tiny else args.requests
    section("engine_vs_hf", gpu_engine.engine_vs_hf, device, tiny, report, n, box())


if __name__ == "__main__":
    main()
