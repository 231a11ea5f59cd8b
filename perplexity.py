"""Perplexity: how well a model predicts a text, the yardstick for every quantization mode.

    python perplexity.py                       # the embedded model on data/declaration.txt
    python perplexity.py --quantize int4 --groupsize 64 --kv_cache_dtype int8
    python perplexity.py --checkpoint PATH --file my.txt --max_tokens 4000

    perplexity = exp(mean over positions t of -log p(token[t] | tokens[< t]))

The text is tokenized once (with BOS where the model adds one) and cut into windows of
`--window` tokens scored independently. Each window runs through the same KV cache generation
uses, fed in chunks of `--chunk` tokens, so later chunks attend to K/V read back from the cache:
with `--kv_cache_dtype int8` every attention read goes through the int8 cache. The shipped text
is the opening of the US Declaration of Independence (1776, public domain).
"""

import argparse
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from kv_cache import StaticKVCache
from runtime import DTYPES, pick_device
from speedups.kv_int8 import Int8KVCache

DEFAULT_TEXT = Path(__file__).parent / "data" / "declaration.txt"
KV_CACHES = {"model": StaticKVCache, "int8": Int8KVCache}


@torch.no_grad()
def perplexity(
    model, ids: list, window: int = 512, chunk: int = 128, kv_cache_dtype: str = "model"
) -> float:
    """exp(mean NLL) of ids under the model, in independent windows, each fed chunk by chunk."""
    device = model.norm.weight.device
    cache = KV_CACHES[kv_cache_dtype].for_model(model, 1, window)
    nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        piece = torch.tensor(ids[start : start + window], device=device)[None]  # [1, T]
        if piece.shape[1] < 2:
            break
        cache.reset()
        logits = []
        for c in range(0, piece.shape[1], chunk):
            tokens = piece[:, c : c + chunk]
            pos = torch.arange(c, c + tokens.shape[1], device=device)[None]
            logits.append(model(tokens, pos, cache))  # [1, t, V] float32
        logits = torch.cat(logits, dim=1)[0, :-1]  # predictions for tokens 1..T-1
        nll += F.cross_entropy(logits, piece[0, 1:], reduction="sum").item()
        count += piece.shape[1] - 1
    return math.exp(nll / count)


def parse_args(argv):

    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--checkpoint",
        default=None,
        help="HF folder, .gguf file or Hub id (default: embedded SmolLM2-135M)",
    )
    p.add_argument("--file", default=str(DEFAULT_TEXT), help="a UTF-8 text file")
    p.add_argument("--max_tokens", type=int, default=None, help="score only the first N tokens")
    p.add_argument("--window", type=int, default=512, help="tokens per independently scored window")
    p.add_argument("--chunk", type=int, default=128, help="tokens fed to the cache per forward")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--quantize", default=None, help="int8 or int4 (quantize.py) at load time")
    p.add_argument("--groupsize", type=int, default=64, help="int4 group size")
    p.add_argument(
        "--dequantize",
        action="store_true",
        help="a GGUF file's weights as --dtype (default: its own bits)",
    )
    p.add_argument(
        "--kv_cache_dtype",
        default="model",
        choices=sorted(KV_CACHES),
        help="int8: quantized KV cache",
    )
    p.add_argument("--device", default=None, help="cpu or cuda")
    return p.parse_args(argv)


def main(argv=None) -> int:
    from formats import weights
    from formats.tokenizer import load_tokenizer

    args = parse_args(argv)
    try:
        device = pick_device(args.device)
        text = Path(args.file).read_text(encoding="utf-8")
        model, info = weights.load_for_inference(
            args.checkpoint,
            device,
            DTYPES[args.dtype],
            args.quantize,
            args.groupsize,
            dequantize=args.dequantize,
            log=lambda s: print(s, file=sys.stderr),
        )
        ids = load_tokenizer(info.source).encode(text)[: args.max_tokens]
        if len(ids) < 2:
            raise ValueError(f"{args.file}: fewer than 2 tokens to score")
        start = time.perf_counter()
        ppl = perplexity(model, ids, args.window, args.chunk, args.kv_cache_dtype)
    except (ValueError, FileNotFoundError, UnicodeDecodeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    mode = args.quantize or args.dtype
    print(
        f"perplexity {ppl:.4f} | {len(ids)} tokens of {args.file} | weights {mode} | KV cache "
        f"{args.kv_cache_dtype} | {time.perf_counter() - start:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
