"""Prefill shared between requests (scheduler.py: a running request's prefills take at most an
equal share of the step's token budget while others wait to prefill) against each running prefill
taking the whole budget, as before: a short request arriving while a long prompt prefills.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/bench_fair_prefill.py [--long 4000] [--rounds 2]

The embedded model at its own bits (bf16), eager, max_num_batched_tokens 512. A long prompt (a
window of data/declaration.txt) is added and stepped once; then a short one (40 tokens, 16 new).
Prints the short request's time to first token and the long one's, one line per round and way.
"""

import argparse
import os
import sys
import time
from collections import Counter

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

from bench_serving import corpus

from engine import RequestParams, Token
from scheduler import Plan, Scheduler
from server.tp_engine import load_engine


def unshared_schedule(self):
    """The schedule before sharing: every running prefill may take the whole budget."""
    plan = Plan()
    prefilling = {s.request for s in self.running if len(s.tokens) - s.num_computed > 1}
    quota = Counter(dict.fromkeys(prefilling, self.max_num_batched_tokens))
    self._top_up(plan, self._admit(plan, self._schedule_running(plan, quota)))
    self.stats["steps"] += bool(plan.runs)
    return plan


def first_tokens(engine, long_ids, short_ids) -> tuple:
    """(short's time to first token, long's), both from the short one's arrival."""
    long_id = engine.add_request(long_ids, RequestParams(max_new_tokens=1, ignore_eos=True))
    engine.step()
    start, firsts = time.perf_counter(), {}
    short_id = engine.add_request(short_ids, RequestParams(max_new_tokens=16, ignore_eos=True))
    while engine.has_unfinished():
        for e in engine.step():
            if isinstance(e, Token) and e.request_id not in firsts:
                firsts[e.request_id] = time.perf_counter() - start
    return firsts[short_id], firsts[long_id]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--long", type=int, default=4000, help="tokens of the long prompt")
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args(argv)
    engine, tok, _ = load_engine(num_blocks=1024, prefix_caching=False)
    ids = corpus(tok)
    long_ids, short_ids = ids[: args.long], ids[1000:1040]
    print(
        "| prefill | short request's first token, s | long request's first token, s |\n"
        "|---|---|---|"
    )
    for _ in range(args.rounds):
        for shared in (False, True):
            engine.scheduler.schedule = (
                Scheduler.schedule if shared else unshared_schedule
            ).__get__(engine.scheduler)
            short, long = first_tokens(engine, long_ids, short_ids)
            print(
                f"| {'shared' if shared else 'whole budget to the running one'} | "
                f"{short:.2f} | {long:.2f} |"
            )


if __name__ == "__main__":
    main()
