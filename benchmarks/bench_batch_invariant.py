"""What --batch_invariant costs and what it buys (batch_invariant.py): the engine on the embedded
model at its own bits (bf16, eager, the server's default), with the mode off and on, in one process.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/bench_batch_invariant.py [--rounds 12]
                                                                          [--dequantize]

--dequantize runs the model's weights as dense bf16 matrices (F.linear), which the mode runs in
blocks of batch_invariant.ROWS rows.

Prints, per mode: prefill tokens/s of one 1,000-token prompt; decode tokens/s of 1, 8 and 32
requests (20-token prompts, 64 new tokens each, timed from the step after their first token); and
how many of `--rounds` mixed batches changed a fixed greedy request's text from the text it has
alone (batches of 1-32 random requests, a 700-token prompt in every other round). Each mode gets a
fresh engine, so neither reads K/V the other computed from the prefix cache.
"""

import argparse
import os
import random
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

from bench_serving import corpus, window

import batch_invariant
from engine import Finished, RequestParams
from server.tp_engine import load_engine


def greedy(new):
    return RequestParams(max_new_tokens=new, temperature=0.0, ignore_eos=True)


def prefill_rate(engine, prompt) -> float:
    start = time.perf_counter()
    engine.run_batch([prompt], greedy(1))
    return len(prompt) / (time.perf_counter() - start)


def decode_rate(engine, prompts, new=64) -> float:
    for p in prompts:
        engine.add_request(p, greedy(new))
    engine.step()  # every prompt prefilled, first tokens sampled (20 tokens each: one step)
    start, steps = time.perf_counter(), 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    return steps * len(prompts) / (time.perf_counter() - start)


def flips(engine, ids, rounds, rng) -> int:
    """Rounds in which the probe's greedy text differed from its text alone."""
    probe = window(ids, 60, rng)
    alone = engine.run_batch([probe], greedy(32))[0]["tokens"]
    changed = 0
    for r in range(rounds):
        engine.add_request(probe, greedy(32), request_id="probe")
        for j in range(rng.randint(0, 31)):
            engine.add_request(
                window(ids, rng.randint(5, 200), rng),
                greedy(rng.randint(4, 40)),
                request_id=f"o{j}",
            )
        if r % 2:
            engine.add_request(window(ids, 700, rng), greedy(4), request_id="long")
        while engine.has_unfinished():
            for e in engine.step():
                if isinstance(e, Finished) and e.request_id == "probe":
                    changed += e.result["tokens"] != alone
    return changed


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=12, help="mixed batches for the invariance count")
    p.add_argument(
        "--dequantize",
        action="store_true",
        help="dense bf16 weights (F.linear) instead of the file's bits",
    )
    args = p.parse_args(argv)
    print(
        f"{'mode':<16}{'prefill tok/s':>14}"
        + "".join(f"{f'decode B={b} tok/s':>20}" for b in (1, 8, 32))
        + f"{'texts changed':>16}"
    )
    for on in (False, True):
        engine, tokenizer, _ = load_engine(
            num_blocks=2000, batch_invariant=on, dequantize=args.dequantize
        )
        ids, rng = corpus(tokenizer), random.Random(0)
        prefill_rate(engine, window(ids, 1000, rng))  # warm-up: oneDNN builds its kernels
        row = [prefill_rate(engine, window(ids, 1000, rng))]
        row += [decode_rate(engine, [window(ids, 20, rng) for _ in range(b)]) for b in (1, 8, 32)]
        changed = flips(engine, ids, args.rounds, rng)
        print(
            f"{'batch_invariant' if on else 'default':<16}{row[0]:>14.0f}"
            + "".join(f"{x:>20.1f}" for x in row[1:])
            + f"{f'{changed} of {args.rounds}':>16}"
        )
        del engine
        batch_invariant.disable()


if __name__ == "__main__":
    main()
