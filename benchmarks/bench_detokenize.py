"""Cost per token of streaming detokenization (text_stream.TextStream) against decoding every id so
far.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/bench_detokenize.py [--tokens 8192] [--rounds 5]

On the embedded SmolLM2 tokenizer (its GGUF vocabulary rebuilt as a `tokenizers` BPE), the
public-domain data/declaration.txt is tokenized and repeated to `--tokens` ids, which are streamed
one add() at a time, each timed alone, with one stop string that never matches (so the stop-string
search and its hold-back run on every token). TextStream decodes two short windows of ids per
token (prefix/read offsets); the old method, copied below, decoded all ids so far on every token:
O(n) per token, O(n^2) over a reply. Columns: the time of the first 1,024 adds, of the last 1,024,
their ratio (goal <= 1.5x: a token costs the same wherever it falls), the total and the mean per
token, from each add()'s median time over `--rounds` rounds (the median drops a round in which
another process took the core); and the median round's own sum of all its adds, preemptions
included. Both must release exactly tokenizer.decode(all ids).
"""

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from formats import weights
from formats.tokenizer import load_tokenizer
from text_stream import TextStream

STOP = ["\x00never seen\x00"]
SEGMENT = 1024


class OldTextStream:
    """TextStream before incremental detokenization (reason None only): every token decodes all
    ids so far, cuts the held tail and the partial character, and slices off what was sent."""

    def __init__(self, tokenizer, stop=()):
        self.tokenizer, self.stop, self.ids, self.sent = tokenizer, list(stop), [], ""

    def add(self, token: int) -> str:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        text = text[: len(text) - max((len(s) - 1 for s in self.stop), default=0)]
        if text.endswith("\ufffd"):
            return ""
        new = text[len(self.sent) :]
        self.sent = text if len(text) > len(self.sent) else self.sent
        return new

    def finish(self) -> str:
        new = self.tokenizer.decode(self.ids)[len(self.sent) :]
        self.sent += new
        return new


def stream(make, ids):
    """Seconds of each add() and the text released (all pieces, then finish())."""
    s, times, pieces = make(), [], []
    for t in ids:
        start = time.perf_counter()
        pieces.append(s.add(t))
        times.append(time.perf_counter() - start)
    pieces.append(s.finish())
    return times, "".join(pieces)


def main(tokens: int, rounds: int):
    tok = load_tokenizer(weights.default_checkpoint())
    text = open(os.path.join(ROOT, "data", "declaration.txt")).read()
    one = tok.encode(text, bos=False)
    ids = (one * (tokens // len(one) + 1))[:tokens]
    expected = tok.decode(ids)
    methods = {
        "TextStream (two windows per token)": lambda: TextStream(tok, STOP),
        "old (decode all ids per token)": lambda: OldTextStream(tok, STOP),
    }
    print(
        f"{tokens} tokens (data/declaration.txt, {len(one)} tokens, repeated), stop {STOP!r}, "
        f"each add()'s median of {rounds} rounds"
    )
    print(
        f"| method | first {SEGMENT} ms | last {SEGMENT} ms | last / first | total ms | us per "
        "token | median round ms |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, make in methods.items():
        runs = []
        for _ in range(rounds):
            times, released = stream(make, ids)
            if released != expected:
                raise SystemExit(
                    f"{name}: the released text differs from tokenizer.decode(all ids)"
                )
            runs.append(times)
        times = [statistics.median(t) for t in zip(*runs)]  # (tokens,): each add()'s median
        first, last, total = (sum(t) * 1e3 for t in (times[:SEGMENT], times[-SEGMENT:], times))
        whole = statistics.median(sum(t) for t in runs) * 1e3
        print(
            f"| {name} | {first:.1f} | {last:.1f} | {last / first:.2f}x | {total:.0f} | "
            f"{total / tokens * 1e3:.1f} | {whole:.0f} |"
        )


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    main(args.tokens, args.rounds)
