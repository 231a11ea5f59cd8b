"""Constrained decoding libraries side by side on SmolLM2's 49,152-token vocabulary: llguidance
(what constrain.py uses) and outlines-core, one run, same machine; then what a constraint costs
generate.py's decode loop on the embedded model.

    .venv/bin/pip install -r benchmarks/requirements-bench.txt  # outlines-core, for the comparison
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/bench_constrain.py

Per library and JSON schema: compile time (schema -> a matcher at its start; the vocabulary's
one-time preparation reported apart), then the time to compute one token mask and advance, walking
the tokens of a valid instance of the schema: at batch 1, and for 32 matchers at once (each computed
in turn; llguidance also with its parallel executor). Medians. Finally generate.py's decode tok/s
with and without a --json_schema style constraint (greedy, bf16, eager, batch 1).
"""

import json
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import constrain
import generate
import runtime
from formats import weights
from formats.tokenizer import load_tokenizer
from sampling import SamplingParams

S = {"type": "string"}
SCHEMAS = {
    "flat object": (
        {
            "type": "object",
            "properties": {"name": S, "age": {"type": "integer"}, "admin": {"type": "boolean"}},
            "required": ["name", "age", "admin"],
            "additionalProperties": False,
        },
        {"name": "Ada Lovelace", "age": 36, "admin": True},
    ),
    "nested, arrays": (
        {
            "type": "object",
            "properties": {
                "user": {
                    "type": "object",
                    "properties": {
                        "id": {"type": "integer"},
                        "tags": {"type": "array", "items": S},
                    },
                    "required": ["id", "tags"],
                    "additionalProperties": False,
                },
                "scores": {"type": "array", "items": {"type": "number"}},
            },
            "required": ["user", "scores"],
            "additionalProperties": False,
        },
        {"user": {"id": 7, "tags": ["alpha", "beta", "gamma"]}, "scores": [1.5, 2.25, 3]},
    ),
    "enum + anyOf": (
        {
            "type": "object",
            "properties": {
                "kind": {"enum": ["cat", "dog", "bird"]},
                "value": {"anyOf": [{"type": "integer"}, S]},
            },
            "required": ["kind", "value"],
            "additionalProperties": False,
        },
        {"kind": "dog", "value": "a good one"},
    ),
}


def timed(fn, repeat=1):
    start = time.perf_counter()
    for _ in range(repeat):
        out = fn()
    return (time.perf_counter() - start) / repeat, out


def bench_llguidance(tokenizer, vocab, schema, tokens):
    import llguidance
    import llguidance.torch as lt

    table = constrain.token_table(tokenizer, vocab, tuple(sorted(tokenizer.stop_ids)))
    masks = lt.allocate_token_bitmask(32, table.vocab_size)
    grammar = constrain.grammar_text(constrain.Constraint("json_schema", schema))

    def start():  # the schema to a matcher, and its first mask (parts of the grammar build lazily)
        m = llguidance.LLMatcher(
            table, constrain.grammar_text(constrain.Constraint("json_schema", schema)), log_level=0
        )
        lt.fill_next_token_bitmask(m, masks, 0)
        return m

    compile_s, m = timed(start)
    one = []
    for t in tokens[:-1]:
        s, _ = timed(lambda: (m.consume_token(t), lt.fill_next_token_bitmask(m, masks, 0)))
        one.append(s)
    many, par = [llguidance.LLMatcher(table, grammar, log_level=0) for _ in range(32)], []
    seq_s, executor = [], llguidance.LLExecutor()
    for t in tokens:
        s, _ = timed(lambda: [lt.fill_next_token_bitmask(x, masks, i) for i, x in enumerate(many)])
        seq_s.append(s)
        s, _ = timed(
            lambda: lt.fill_next_token_bitmask_par(
                executor, [(x, i) for i, x in enumerate(many)], masks
            )
        )
        par.append(s)
        for x in many:
            x.consume_token(t)
    return compile_s, statistics.median(one), statistics.median(seq_s), statistics.median(par)


def bench_outlines(tokenizer, vocab, schema, tokens, ovocab):
    from outlines_core import Guide, Index
    from outlines_core.json_schema import build_regex_from_schema

    mask = torch.zeros((vocab + 31) // 32, dtype=torch.int32)

    def start():  # the schema to a regex to an index over the vocabulary, and the first mask
        index = Index(build_regex_from_schema(json.dumps(schema), r"[ ]?"), ovocab)
        guide = Guide(index)
        guide.write_mask_into(mask.data_ptr(), mask.numel(), 4)
        return index, guide

    compile_s, (index, guide) = timed(start)
    one = []
    for t in tokens[:-1]:
        s, _ = timed(
            lambda: (guide.advance(t), guide.write_mask_into(mask.data_ptr(), mask.numel(), 4))
        )
        one.append(s)
    many, seq_s = [Guide(index) for _ in range(32)], []
    for t in tokens:
        s, _ = timed(lambda: [g.write_mask_into(mask.data_ptr(), mask.numel(), 4) for g in many])
        seq_s.append(s)
        for g in many:
            g.advance(t)
    return compile_s, statistics.median(one), statistics.median(seq_s), None


def outlines_vocabulary(table, stop_id):
    from outlines_core import Vocabulary

    pieces = {}
    for i in range(table.vocab_size):
        if i != stop_id and not table.is_special_token(i):
            pieces.setdefault(table.decode_bytes([i]), []).append(i)
    return Vocabulary(stop_id, pieces)


def main():
    model, info = weights.load(None, dtype=torch.bfloat16, dequantize=True)
    tokenizer, vocab = load_tokenizer(info.source), model.config.vocab_size
    stop = min(tokenizer.stop_ids)
    prep_s, table = timed(
        lambda: constrain.token_table(tokenizer, vocab, tuple(sorted(tokenizer.stop_ids)))
    )
    print(
        f"# {runtime.cpu_capability()} | torch {torch.__version__} | {torch.get_num_threads()} "
        f"threads | vocabulary {vocab} | llguidance's vocabulary preparation {prep_s:.2f} s (once "
        "per tokenizer)"
    )
    libs = [("llguidance", bench_llguidance, ())]
    try:
        prep_s, ovocab = timed(lambda: outlines_vocabulary(table, stop))
        print(f"# outlines-core's vocabulary built in {prep_s:.2f} s (once per tokenizer)")
        libs.append(("outlines-core", bench_outlines, (ovocab,)))
    except ImportError:
        print(
            "# outlines-core is not installed (pip install -r benchmarks/requirements-bench.txt): "
            "llguidance only"
        )
    print(
        "\n| schema | library | compile + first mask, ms | advance + mask, ms/token, batch 1 | "
        "mask, batch 32, one by one | "
        "mask, batch 32, parallel |"
    )
    print("|---|---|---|---|---|---|")
    for name, (schema, instance) in SCHEMAS.items():
        tokens = tokenizer.encode(json.dumps(instance), bos=False)
        for lib, fn, extra in libs:
            compile_s, one, seq_s, par = fn(tokenizer, vocab, schema, tokens, *extra)
            par_text = f"{par * 1e3:.2f}" if par is not None else "-"
            print(
                f"| {name} ({len(tokens)} tokens) | {lib} | {compile_s * 1e3:.1f} | "
                f"{one * 1e3:.3f} | {seq_s * 1e3:.2f} | {par_text} |"
            )
    ids = tokenizer.encode_chat([{"role": "user", "content": "Describe Ada Lovelace as JSON."}])
    prompt = torch.tensor([ids])
    schema = SCHEMAS["flat object"][0]
    print("\n| generate.py loop, embedded model, greedy, batch 1 | tokens | decode tok/s |")
    print("|---|---|---|")
    for label in ("unconstrained", "json_schema", "unconstrained", "json_schema"):
        matchers = None
        if label == "json_schema":
            matchers = [
                constrain.compile_constraint(
                    constrain.Constraint("json_schema", schema),
                    tokenizer,
                    vocab,
                    tokenizer.stop_ids,
                )
            ]
        cache = generate.make_cache(model, 1, len(ids) + 64)
        rows, timing = generate.generate(
            model,
            cache,
            prompt,
            64,
            SamplingParams(0.0),
            generate.DecodeOptions(
                generator=None,
                stop_ids=tokenizer.stop_ids,
                ignore_eos=label == "unconstrained",
                matchers=matchers,
            ),
        )
        print(f"| {label} | {len(rows[0])} | {timing['tokens_per_s']:.1f} |")


if __name__ == "__main__":
    main()
