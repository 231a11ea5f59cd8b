"""Embedding throughput: the engine's prefill-only requests (sequence.py's pooling) against
sentence-transformers' `encode` on the same weights, in one process.

    .venv/bin/python benchmarks/bench_embeddings.py [--dtypes float32 bfloat16]
                                                    [--lengths 32 128 512] [--tokens 16384]

The weights are the embedded SmolLM2-135M's, written as an HF folder with sentence-transformers'
files (last-token pooling, Normalize) and the GGUF's tokenizer as tokenizer.json, so both runners
tokenize alike. Inputs are windows of data/declaration.txt decoded to text, about `length` tokens
each, `tokens` tokens in all per length. Runners, in turn: sentence-transformers' `encode`
(batch_size 32, its default; padded batches), then engine.Engine with every input added at once
(eager steps, q/k/v and gate/up fused as serve.py loads it, 2,048 tokens a step). Inputs/s and
tokens/s over the whole run (tokenizing included for both); "vs ST" compares with
sentence-transformers in the same dtype, "vs ST float32" with its default (float32 on CPU, where
serve.py's default is bfloat16); "max |diff|" is the largest difference between the two runners'
normalized vectors.
"""

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from bench_serving import corpus, window

import runtime
from engine import Engine, RequestParams
from formats import fuse_layers, hf_folder, pooling, weights
from formats.tokenizer import load_tokenizer


def st_folder(model, tokenizer) -> Path:
    """The model as an HF folder with sentence-transformers' pipeline files beside it."""
    folder = hf_folder.save_hf_folder(model, tempfile.mkdtemp(prefix="smollm2-st-"))
    tokenizer.backend.tok.save(str(folder / "tokenizer.json"))
    pad = tokenizer.decode([tokenizer.eos_id])  # padding: sentence-transformers' batches need one
    (folder / "tokenizer_config.json").write_text(json.dumps({"pad_token": pad}))
    types = ["Transformer", "Pooling", "Normalize"]
    modules = [
        {"idx": i, "name": str(i), "path": p, "type": f"sentence_transformers.models.{t}"}
        for i, (t, p) in enumerate(zip(types, ["", "1_Pooling", "2_Normalize"]))
    ]
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir()
    config = {"word_embedding_dimension": model.config.dim, "pooling_mode_lasttoken": True}
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(config))
    return folder


def run_st(st, texts):
    start = time.perf_counter()
    out = st.encode(texts, batch_size=32, convert_to_tensor=True)
    return time.perf_counter() - start, out.float()


def run_ours(model, tokenizer, spec, texts):
    engine = Engine.for_model(
        model, num_blocks=4096, max_num_seqs=256, max_num_batched_tokens=2048, tokenizer=tokenizer
    )
    start = time.perf_counter()
    ids = [pooling.encode_input(tokenizer, t, spec.chat) for t in texts]
    results = engine.run_batch(ids, RequestParams(pooling=spec.pooling))
    vectors = pooling.finish(torch.tensor([r["embedding"] for r in results]), spec.normalize)
    return time.perf_counter() - start, vectors, sum(map(len, ids))


def main():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=runtime.DTYPES)
    p.add_argument("--lengths", nargs="+", type=int, default=[32, 128, 512])
    p.add_argument("--tokens", type=int, default=16384, help="tokens embedded per length")
    args = p.parse_args()
    from sentence_transformers import SentenceTransformer

    model, info = weights.load(None, dtype=torch.float32, dequantize=True)
    tokenizer = load_tokenizer(info.source)
    folder, ids = st_folder(model, tokenizer), corpus(tokenizer)
    spec = pooling.read_spec(folder)
    del model
    print(
        f"# {runtime.cpu_capability()} | torch {torch.__version__} | "
        f"{torch.get_num_threads()} threads | SmolLM2-135M, last-token pooling"
    )
    print(
        "\n| dtype | tokens/input | inputs | runner | inputs/s | tokens/s | vs ST | vs ST float32 "
        "| max |diff| |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    base = {}  # length -> sentence-transformers' float32 seconds
    for dtype in args.dtypes:
        ours = weights.load(folder, dtype=runtime.DTYPES[dtype])[0]
        fuse_layers.fuse_projections(ours)
        st = SentenceTransformer(str(folder), device="cpu", model_kwargs={"dtype": dtype})
        run_st(st, ["warm up"] * 4)
        run_ours(ours, tokenizer, spec, ["warm up"] * 4)
        rng = random.Random(0)  # the same texts for every dtype
        for length in args.lengths:
            texts = [
                tokenizer.decode(window(ids, length, rng))
                for _ in range(max(1, args.tokens // length))
            ]
            st_s, want = run_st(st, texts)
            our_s, got, n_tokens = run_ours(ours, tokenizer, spec, texts)
            diff = (got - want).abs().max().item()
            base.setdefault(length, st_s if dtype == "float32" else None)
            for name, secs in (("sentence-transformers encode", st_s), ("ours: Engine", our_s)):
                print(
                    f"| {dtype} | {n_tokens // len(texts)} | {len(texts)} | {name} | "
                    f"{len(texts) / secs:.1f} | {n_tokens / secs:.0f} | {st_s / secs:.2f}x | "
                    + (f"{base[length] / secs:.2f}x" if base[length] else "-")
                    + f" | {diff:.1e} |",
                    flush=True,
                )
        del ours, st


if __name__ == "__main__":
    main()
