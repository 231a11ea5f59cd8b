"""Constrained decoding (constrain.py) in the engine, on a tiny random model: the hardest case, as
it never wants to write valid JSON. Sampled at temperature 1 over several seeds, every output of
every schema parses and validates (jsonschema), every regex output matches (re.fullmatch),
every choice is one of the list; where the mask allows the model's argmax, greedy output equals
unconstrained greedy output; n > 1, preemption and a crowd of unconstrained requests change
nothing."""

import json
import re

import jsonschema
import pytest
import torch
from helpers import run_to_end, tiny_checkpoint

from constrain import Constraint, compile_constraint
from engine import Engine, RequestParams
from formats import weights
from formats.tokenizer import load_tokenizer

S = {"type": "string", "maxLength": 6}  # strings a random model closes: it never wants to
SCHEMAS = [
    {
        "type": "object",
        "properties": {"name": S},
        "required": ["name"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["age"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"type": "null"}},
        "required": ["ok", "n"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}},
        "required": ["color"],
        "additionalProperties": False,
    },
    {
        "type": "array",
        "items": {"type": "integer", "minimum": -5, "maximum": 5},
        "minItems": 2,
        "maxItems": 4,
    },
    {"type": "array", "items": S, "minItems": 1, "maxItems": 3},
    {
        "type": "object",
        "properties": {
            "inner": {
                "type": "object",
                "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}},
                "required": ["x"],
                "additionalProperties": False,
            }
        },
        "required": ["inner"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"a": S, "b": S},
        "required": ["a"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"}},
        "required": ["code"],
        "additionalProperties": False,
    },
    {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 99}, {"type": "boolean"}]},
    {
        "type": "object",
        "properties": {"v": {"anyOf": [S, {"type": "integer", "minimum": 0, "maximum": 3}]}},
        "required": ["v"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 3}},
        "required": ["tags"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"k": {"const": "fixed"}},
        "required": ["k"],
        "additionalProperties": False,
    },
    {"type": "integer", "minimum": 100, "maximum": 200},
    {"type": "boolean"},
    {"enum": [1, "two", None, True]},
    {
        "type": "object",
        "properties": {
            "p": {
                "type": "object",
                "properties": {"q": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}},
                "required": ["q"],
                "additionalProperties": False,
            }
        },
        "required": ["p"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 1000},
            "name": S,
            "active": {"type": "boolean"},
        },
        "required": ["id", "name", "active"],
        "additionalProperties": False,
    },
    {
        "type": "array",
        "prefixItems": [{"type": "integer", "minimum": 0, "maximum": 9}, {"enum": ["a", "b"]}],
        "items": False,
    },
    {
        "type": "object",
        "properties": {
            "opt": {"type": "integer", "minimum": 0, "maximum": 5},
            "req": {"type": "boolean"},
        },
        "required": ["req"],
        "additionalProperties": False,
    },
    {"type": "string", "pattern": "^[a-z]{1,5}@[a-z]{1,5}\\.com$"},
    {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
                    "required": ["n"],
                    "additionalProperties": False,
                },
                "minItems": 1,
                "maxItems": 2,
            }
        },
        "required": ["items"],
        "additionalProperties": False,
    },
]
REGEXES = [
    "[0-9]{3}-[0-9]{4}",
    "(cat|dog|bird)s?",
    "[A-Z][a-z]{2,6} [0-9]{1,2}",
    "(ab)+c",
    "0x[0-9a-f]{1,8}",
]
SEEDS = (0, 1, 2)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tiny_checkpoint(
        tmp_path_factory.mktemp("constrain-tiny"), max_position_embeddings=1024
    )
    model, info = weights.load(folder, dtype=torch.float32)
    return model, load_tokenizer(info.source)


def engine(tiny, **kw):
    model, tokenizer = tiny
    return Engine.for_model(
        model,
        num_blocks=kw.pop("num_blocks", 400),
        block_size=8,
        stop_ids=tokenizer.stop_ids,
        tokenizer=tokenizer,
        **kw,
    )


def run(eng, prompts, params):
    return eng.run_batch([eng.tokenizer.encode(p) for p in prompts], params)


def sampled(constraint, seed, n=1):
    return RequestParams(max_new_tokens=200, temperature=1.0, seed=seed, n=n, constraint=constraint)


@pytest.mark.parametrize("schema", SCHEMAS, ids=[f"schema{i}" for i in range(len(SCHEMAS))])
def test_every_sampled_output_validates_against_its_schema(tiny, schema):
    out = run(
        engine(tiny),
        ["Give me JSON:"] * len(SEEDS),
        [sampled(Constraint("json_schema", schema), s) for s in SEEDS],
    )
    for r in out:
        assert r["finish_reason"] == "stop", r
        jsonschema.validate(json.loads(r["text"]), schema)


def test_regexes_choices_json_objects_and_grammars(tiny):
    eng = engine(tiny)
    for regex in REGEXES:
        for r in run(eng, ["Say:"] * 3, [sampled(Constraint("regex", regex), s) for s in SEEDS]):
            assert re.fullmatch(regex, r["text"]), (regex, r["text"])
    choices = ["yes", "no", "maybe so", 'n/a "quoted"']
    for r in run(eng, ["Pick:"] * 3, [sampled(Constraint("choice", choices), s) for s in SEEDS]):
        assert r["text"] in choices
    prefixes = ["a", "ab", "abc"]  # one a prefix of the next: each may end the output or go on
    for r in run(eng, ["Pick:"] * 3, [sampled(Constraint("choice", prefixes), s) for s in SEEDS]):
        assert r["text"] in prefixes
    many = [
        f"c{i}" for i in range(100_000)
    ]  # past llguidance's 2,000 parser alternatives: one terminal
    for r in run(eng, ["Pick:"] * 3, [sampled(Constraint("choice", many), s) for s in SEEDS]):
        assert r["text"] in set(many)
    for r in run(eng, ["Obj:"] * 3, [sampled(Constraint("json_object"), s) for s in SEEDS]):
        assert r["finish_reason"] != "stop" or isinstance(json.loads(r["text"]), dict)
    lark = 'start: "(" num (" + " num)* ")"\nnum: /[1-9]/'
    for r in run(eng, ["Sum:"] * 3, [sampled(Constraint("grammar", lark), s) for s in SEEDS]):
        assert re.fullmatch(r"\([1-9]( \+ [1-9])*\)", r["text"]), r["text"]
    gbnf = 'root ::= "x" [0-9] [0-9]?'
    for r in run(eng, ["G:"] * 3, [sampled(Constraint("grammar", gbnf), s) for s in SEEDS]):
        assert re.fullmatch(r"x[0-9][0-9]?", r["text"]), r["text"]


def test_greedy_takes_the_models_argmax_wherever_the_mask_allows_it(tiny):
    """Constrained greedy decoding, replayed against the raw logits' argmax (logprobs=1 reports it):
    at every step the token is the argmax when the mask allows it, else the best allowed token;
    and with a regex that allows any text, greedy output equals unconstrained greedy output."""
    model, tokenizer = tiny
    eng = engine(tiny)
    agreed = 0
    for c in (Constraint("json_schema", SCHEMAS[17]), Constraint("regex", "[a-z ]{1,30}")):
        req = RequestParams(max_new_tokens=60, temperature=0.0, logprobs=1, constraint=c)
        ids = eng.add_request(tokenizer.encode("Once upon a time"), req)
        seq = run_to_end(eng)[ids].seqs[0]
        replay = compile_constraint(c, tokenizer, model.config.vocab_size, tokenizer.stop_ids)
        for token, (_, top) in zip(seq.output, seq.logprobs):
            argmax = top[0][0]
            allowed = replay.mask_logits(torch.zeros(model.config.vocab_size))[argmax] == 0
            assert token == argmax if allowed else token != argmax
            agreed += bool(allowed)
            if token not in tokenizer.stop_ids:
                replay.advance(token)
    assert agreed >= 1  # the test saw the argmax allowed at least once
    # the same greedy run without and with a regex allowing any text: a bias keeps the random
    # model off tokens that are parts of a character (the regex speaks of text, not of bytes)
    parts = {t: -100 for t in range(model.config.vocab_size) if "\ufffd" in tokenizer.decode([t])}
    free = RequestParams(max_new_tokens=12, temperature=0.0, ignore_eos=True, logit_bias=parts)
    anything = RequestParams(
        max_new_tokens=12,
        temperature=0.0,
        ignore_eos=True,
        logit_bias=parts,
        constraint=Constraint("regex", "(.|\\n)*"),
    )
    prompts = ["Once upon a time", "The quick brown fox", "hello"]
    assert [r["tokens"] for r in run(eng, prompts, anything)] == [
        r["tokens"] for r in run(eng, prompts, free)
    ]


def test_n_samples_preemption_and_a_crowd_change_nothing(tiny):
    """Each sample has its own matcher (copied at the fork); a tight pool preempts and recomputes;
    unconstrained requests beside them keep their exact outputs."""
    schema = SCHEMAS[17]
    c = Constraint("json_schema", schema)
    alone = run(engine(tiny), ["JSON:"], sampled(c, 5, n=3))[0]
    plain = [RequestParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)] * 4
    plain_alone = run(engine(tiny), ["a", "bb", "ccc", "dddd"], plain)
    crowd = run(
        engine(tiny, num_blocks=40, max_num_seqs=8, max_num_batched_tokens=64),
        ["a", "JSON:", "bb", "ccc", "dddd"],
        [plain[0], sampled(c, 5, n=3)] + plain[1:],
    )
    assert crowd[1]["text"] == alone["text"]
    for t in alone["text"]:
        jsonschema.validate(json.loads(t), schema)
    assert [r["tokens"] for i, r in enumerate(crowd) if i != 1] == [
        r["tokens"] for r in plain_alone
    ]


def test_bad_constraints_fail_alone_with_a_reason(tiny):
    eng = engine(tiny)
    model, tokenizer = tiny
    for bad, match in (
        (Constraint("regex", "(unclosed"), "regex"),
        (Constraint("json_schema", {"type": 12}), "json_schema"),
        (Constraint("grammar", "start: missing_rule"), "grammar"),
    ):
        with pytest.raises(ValueError, match=match):
            eng.add_request([1, 2, 3], RequestParams(constraint=bad))
    with pytest.raises(ValueError, match="choice"):
        Constraint("choice", [])
    with pytest.raises(ValueError, match="kind"):
        Constraint("xml", "x")
    assert not eng.has_unfinished()
    m = compile_constraint(
        Constraint("choice", ["ab"]), tokenizer, model.config.vocab_size, tokenizer.stop_ids
    )
    logits = m.mask_logits(torch.zeros(model.config.vocab_size))
    allowed = (logits > float("-inf")).nonzero().flatten().tolist()
    assert allowed and all("ab".startswith(tokenizer.decode([t])) for t in allowed)


def test_generate_cli_flags(tmp_path, capsys):
    """generate.py --json_schema / --regex / --choice / --grammar, a batch of sampled rows each."""
    import generate

    folder = tiny_checkpoint(tmp_path / "m")
    schema_file, grammar_file = tmp_path / "s.json", tmp_path / "g.lark"
    schema_file.write_text(json.dumps(SCHEMAS[17]))
    grammar_file.write_text('start: "<" /[a-c]{2}/ ">"')
    base = [
        "--checkpoint",
        str(folder),
        "--prompt",
        "x",
        "--max_new_tokens",
        "150",
        "--batch_size",
        "3",
        "--seed",
        "1",
        "--temperature",
        "1",
        "--top_k",
        "1000",
        "--json",
        "--dtype",
        "float32",
    ]
    checks = [
        (
            ["--json_schema", str(schema_file)],
            lambda t: jsonschema.validate(json.loads(t), SCHEMAS[17]) is None,
        ),
        (["--regex", "[0-9]{2}:[0-9]{2}"], lambda t: re.fullmatch("[0-9]{2}:[0-9]{2}", t)),
        (["--choice", "alpha,beta"], lambda t: t in ("alpha", "beta")),
        (["--grammar", str(grammar_file)], lambda t: re.fullmatch("<[a-c]{2}>", t)),
    ]
    for flags, ok in checks:
        assert generate.main(base + flags) == 0
        rows = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
        assert len(rows) == 3 and all(ok(r["text"]) for r in rows), (
            flags,
            [r["text"] for r in rows],
        )
    for bad in (
        ["--regex", "a", "--choice", "b"],
        ["--regex", "a", "--interactive"],
        ["--json_schema", "/nope.json"],
    ):
        with pytest.raises(SystemExit) as exit_:
            generate.main(base + bad)
        assert exit_.value.code == 2
    assert generate.main(base + ["--regex", "(unclosed"]) == 2
