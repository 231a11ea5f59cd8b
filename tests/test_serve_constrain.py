"""Structured output through serve.py and the real `openai` client: response_format (json_object,
json_schema), `client.chat.completions.parse` with a pydantic model, vLLM's structured_outputs
(regex, choice, grammar), streamed or not; 32 concurrent requests with different schemas beside
unconstrained ones; a stream's pace beside a 5,000-value enum with n = 8 and a prompt scored with
echo; bad constraints get 400 while the server keeps serving. The model is the tiny random one: it
never writes valid JSON on its own."""

import asyncio
import json
import re
import statistics
import time
from multiprocessing.pool import ThreadPool

import httpx
import jsonschema
import pydantic
import pytest
from test_constrain import SCHEMAS
from test_serve import AUTH, client, server, tiny  # noqa: F401 (fixtures)

USER = [{"role": "user", "content": "Describe a person as JSON."}]


def as_format(schema, name="out"):
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def test_response_format_json_schema_and_object_streamed_or_not(server):
    url = server[0]
    schema = SCHEMAS[17]
    for seed in (0, 1):
        out = client(url).chat.completions.create(
            model="tiny",
            messages=USER,
            max_tokens=200,
            seed=seed,
            response_format=as_format(schema),
        )
        assert out.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.choices[0].message.content), schema)
        chunks = client(url).chat.completions.create(
            model="tiny",
            messages=USER,
            max_tokens=200,
            seed=seed,
            response_format=as_format(schema),
            stream=True,
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == out.choices[0].message.content
    obj = client(url).completions.create(
        model="tiny",
        prompt="JSON:",
        max_tokens=300,
        seed=3,
        extra_body={"response_format": {"type": "json_object"}},
    )
    if (
        obj.choices[0].finish_reason == "stop"
    ):  # an object whose strings a random model may never close
        assert isinstance(json.loads(obj.choices[0].text), dict)


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=6)
    age: int = pydantic.Field(ge=0, le=120)
    admin: bool


def test_parse_with_a_pydantic_model(server):
    out = client(server[0]).chat.completions.parse(
        model="tiny", messages=USER, response_format=Person, max_tokens=200, seed=4
    )
    person = out.choices[0].message.parsed
    assert isinstance(person, Person) and 0 <= person.age <= 120 and len(person.name) <= 6


def test_vllm_structured_outputs_regex_choice_grammar(server):
    url = server[0]
    cases = [
        ({"regex": "[0-9]{3}-[a-z]{2}"}, lambda t: re.fullmatch("[0-9]{3}-[a-z]{2}", t)),
        ({"choice": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue")),
        ({"grammar": 'start: "(" /[0-9]/ ")"'}, lambda t: re.fullmatch(r"\([0-9]\)", t)),
    ]
    for spec, ok in cases:
        for seed in (0, 1):
            out = client(url).completions.create(
                model="tiny",
                prompt="Answer:",
                max_tokens=40,
                seed=seed,
                extra_body={"structured_outputs": spec},
            )
            assert ok(out.choices[0].text), (spec, out.choices[0].text)
    chat = client(url).chat.completions.create(
        model="tiny",
        messages=USER,
        max_tokens=20,
        n=3,
        seed=2,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )
    assert len(chat.choices) == 3 and all(c.message.content in ("yes", "no") for c in chat.choices)


def test_32_concurrent_schemas_beside_unconstrained_requests(server):
    url, model, tokenizer, engine, _ = server
    plain = dict(
        model="tiny",
        prompt="Once upon",
        max_tokens=16,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    expected = client(url).completions.create(**plain).choices[0].text

    async def main():
        c = client(url, cls=__import__("openai").AsyncOpenAI)
        constrained = [
            c.chat.completions.create(
                model="tiny",
                messages=USER,
                max_tokens=200,
                seed=i,
                response_format=as_format(SCHEMAS[i % len(SCHEMAS)], f"s{i}"),
            )
            for i in range(32)
        ]
        free = [c.completions.create(**plain) for _ in range(4)]
        return await asyncio.gather(*constrained, *free)

    results = asyncio.run(main())
    for i, out in enumerate(results[:32]):
        jsonschema.validate(json.loads(out.choices[0].message.content), SCHEMAS[i % len(SCHEMAS)])
    assert [r.choices[0].text for r in results[32:]] == [expected] * 4


async def stream_times(h, tokens=300) -> list:
    """The times (s) a greedy stream's chunks arrive."""
    times, body = (
        [],
        {
            "prompt": "Once upon a time",
            "max_tokens": tokens,
            "stream": True,
            "ignore_eos": True,
            "temperature": 0,
        },
    )
    async with h.stream("POST", "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                times.append(time.perf_counter())
    return times


def test_a_stream_keeps_its_pace_beside_a_huge_enum_with_n_and_a_long_echo(server):
    """Eight rows writing one of 5,000 long enum values (a mask each per step) and a 220-token
    prompt scored with echo + logprobs share the steps with a stream: while they run, its mean gap
    stays within 2x its gap beside eight unconstrained rows, and no gap reaches half a second (their
    compile and scoring once stalled every stream for 10-43 s)."""
    url, _, _, engine, _ = server
    values = [f"v{i} " + "abc def " * 12 for i in range(5000)]
    enum = {"type": "json_schema", "json_schema": {"name": "e", "schema": {"enum": values}}}

    async def timed(request):
        return await request, time.perf_counter()

    async def beside(h, body, echo: bool):
        sent = [asyncio.ensure_future(timed(h.post("/v1/chat/completions", json=body)))]
        deadline = time.perf_counter() + 60
        while not any(
            r.params.n == 8 for r in list(engine.requests.values())
        ):  # compiled and admitted
            assert time.perf_counter() < deadline and not sent[0].done(), "the 8 rows never started"
            await asyncio.sleep(0.005)
        if echo:
            sent.append(
                asyncio.ensure_future(
                    timed(
                        h.post(
                            "/v1/completions",
                            json={
                                "prompt": "word " * 220,
                                "max_tokens": 1,
                                "echo": True,
                                "logprobs": 5,
                            },
                        )
                    )
                )
            )
        times = await stream_times(h)
        replies = await asyncio.gather(*sent)
        return [b - a for a, b in zip(times, times[1:]) if b <= replies[0][1]], replies

    async def main():
        async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=120) as h:
            plain = await beside(
                h, {"messages": USER, "n": 8, "max_tokens": 100, "ignore_eos": True}, echo=False
            )
            return plain, await beside(
                h, {"messages": USER, "n": 8, "max_tokens": 200, "response_format": enum}, True
            )

    (plain, _), (during, replies) = asyncio.run(main())
    assert [r.status_code for r, _ in replies] == [200, 200]
    assert all(
        json.loads(c["message"]["content"]) in values for c in replies[0][0].json()["choices"]
    )
    assert len(replies[1][0].json()["choices"][0]["logprobs"]["tokens"]) > 220
    assert len(during) >= 20 and len(plain) >= 20, "the stream ended before the other rows"
    print(
        f"beside plain rows {statistics.mean(plain) * 1e3:.2f} ms, beside the enum and echo "
        f"{statistics.mean(during) * 1e3:.2f} ms over {len(during)} gaps, "
        f"longest {max(during) * 1e3:.1f} ms"
    )
    assert statistics.mean(during) < 2 * statistics.mean(plain) and max(during) < 0.5, (
        plain,
        during,
    )


@pytest.mark.parametrize(
    "extra",
    [
        {"response_format": {"type": "xml"}},
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": 12}},
            }
        },
        {"response_format": {"type": "json_schema", "json_schema": "not an object"}},
        {"structured_outputs": {"regex": "(unclosed"}},
        {"structured_outputs": {"regex": "a", "choice": ["b"]}},
        {"structured_outputs": {"choice": []}},
        {"structured_outputs": {"grammar": "start: nowhere"}},
        {
            "structured_outputs": {"grammar": "root ::= missing_rule"}
        },  # GBNF errors are plain Exceptions
        {"structured_outputs": {"grammar": "hello world"}},
        {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
    ],
)
def test_bad_constraints_get_400_and_the_server_keeps_serving(server, extra):
    url = server[0]
    r = httpx.post(
        url + "/v1/chat/completions",
        json={"model": "tiny", "messages": USER, **extra},
        headers=AUTH,
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] in ("response_format", "structured_outputs", None)
    ok = client(url).chat.completions.create(model="tiny", messages=USER, max_tokens=3)
    assert ok.choices[0].finish_reason in ("length", "stop")


def lark_chain(n: int) -> str:
    """n rules, each naming the next: 3,000 of them segfault llguidance's grammar compiler."""
    return "start: r0\n" + "\n".join(f'r{i}: r{i + 1} | "a"' for i in range(n)) + f'\nr{n}: "b"'


@pytest.mark.parametrize("rules", [3_000, 30_000])
def test_a_grammar_that_crashes_the_compiler_is_a_400_and_the_server_lives(server, rules):
    url = server[0]
    r = httpx.post(
        url + "/v1/completions",
        headers=AUTH,
        timeout=120,
        json={"prompt": "x", "max_tokens": 4, "structured_outputs": {"grammar": lark_chain(rules)}},
    )
    error = r.json()["error"]
    assert r.status_code == 400 and "crashed the grammar compiler" in error["message"], r.text
    assert error["param"] == "structured_outputs" and "Traceback" not in error["message"]
    assert httpx.get(url + "/health").json()["status"] == "ok"
    out = client(url).completions.create(
        model="tiny",
        prompt="x",
        max_tokens=8,
        seed=1,
        extra_body={"structured_outputs": {"choice": ["red", "blue"]}},
    )
    assert out.choices[0].text in ("red", "blue")  # the checker came back for the next one


def parser_alternatives(n: int) -> str:
    """A Lark grammar of n literal alternatives as parser rules (a choice compiles them as one
    terminal): past 2,000 llguidance fails at the second token ("max is 2000" items in a row), and
    100,000 take seconds to compile."""
    return "start: " + " | ".join(json.dumps(f"option number {i}") for i in range(n))


def test_the_checker_refuses_slow_empty_and_first_mask_failures(tiny):
    from constrain import Constraint
    from server.constraint_check import ConstraintChecker

    _, model, tokenizer = tiny
    checker = ConstraintChecker(
        tokenizer.source, model.config.vocab_size, tokenizer.stop_ids, deadline_s=1.0
    )
    checker.check(Constraint("choice", ["yes", "no"]))
    with pytest.raises(ValueError, match="within 1 s"):
        checker.check(Constraint("grammar", parser_alternatives(100_000)))
    looping = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}
    with pytest.raises(ValueError, match="no output|invalid constraint"):
        checker.check(Constraint("json_schema", looping))
    checker.check(Constraint("regex", "[a-z]+"))  # a new child after the one killed at the deadline
    assert len(checker.passed) == 2


def test_a_checker_child_killed_or_stalled_is_replaced(tiny):
    """The child killed while idle: the next check starts another and passes. Stopped (SIGSTOP)
    mid-check: that constraint is refused at the deadline and the child replaced. Killed mid-check:
    that constraint is refused as a crash. Each time the next constraint is served."""
    import os
    import signal
    import threading

    from constrain import Constraint
    from server.constraint_check import ConstraintChecker

    _, model, tokenizer = tiny
    checker = ConstraintChecker(
        tokenizer.source, model.config.vocab_size, tokenizer.stop_ids, deadline_s=2.0
    )
    checker.check(Constraint("choice", ["yes", "no"]))
    os.kill(checker.process.pid, signal.SIGKILL)
    checker.process.join(timeout=5)
    checker.check(Constraint("regex", "[a-z]+"))  # served by a new child
    os.kill(checker.process.pid, signal.SIGSTOP)  # stalls before it reads the next one
    with pytest.raises(ValueError, match="within 2 s"):
        checker.check(Constraint("regex", "[0-9]+"))
    checker.check(Constraint("regex", "[0-9]+"))
    os.kill(checker.process.pid, signal.SIGSTOP)
    pid = checker.process.pid
    threading.Timer(0.5, os.kill, (pid, signal.SIGKILL)).start()  # dies mid-check
    with pytest.raises(ValueError, match="crashed"):
        checker.check(Constraint("regex", "[A-Z]+"))
    checker.check(Constraint("regex", "[A-Z]+"))
    assert len(checker.passed) == 4
    checker.close()


def test_a_checker_that_cannot_start_is_a_503_and_the_next_request_is_served(server, monkeypatch):
    """The checker's child does not start in time (its startup allowed no time): that request
    gets a 503 with Retry-After, never a 500; the next one starts a child and is served."""
    import gc

    from server import constraint_check

    url = server[0]
    checker = next(o for o in gc.get_objects() if isinstance(o, constraint_check.ConstraintChecker))
    checker.close()  # no child: the next check starts one
    monkeypatch.setattr(constraint_check, "STARTUP_S", 0.0)
    body = {"prompt": "x", "max_tokens": 3, "structured_outputs": {"regex": "[a-c]{2}[d-f]"}}
    r = httpx.post(url + "/v1/completions", headers=AUTH, timeout=120, json=body)
    assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
    assert "constraint checker is unavailable" in r.json()["error"]["message"]
    assert checker.process is None  # the failed child is gone
    monkeypatch.setattr(constraint_check, "STARTUP_S", 60.0)
    r = httpx.post(url + "/v1/completions", headers=AUTH, timeout=120, json=body)
    assert r.status_code == 200 and re.fullmatch("[a-c]{2}[d-f]", r.json()["choices"][0]["text"])


def test_constraints_reach_the_engine_compiled_and_late_failures_are_400s(server, monkeypatch):
    """The engine thread gets a constrain.Compiled (compiled on the two threads kept for it,
    llguidance releasing the GIL), so it never compiles; 20,000 parser alternatives, which pass
    their first mask and fail at the next ("max is 2000" items), are a 400 at admission, not a 500
    mid-stream."""
    import threading

    from constrain import Compiled
    from server import completions

    url, _, _, engine, _ = server
    seen, add, threads = [], engine.add_request, set()
    compile_constraint = completions.compile_constraint

    def recorded(prompt, params=None, request_id=None):
        seen.append(type(params.constraint))
        return add(prompt, params, request_id)

    def compiled_where(*args):  # a deep schema leaves megabytes of stack on each thread it ran on
        threads.add(threading.current_thread().name)
        return compile_constraint(*args)

    monkeypatch.setattr(engine, "add_request", recorded)
    monkeypatch.setattr(completions, "compile_constraint", compiled_where)
    out = client(url).completions.create(
        model="tiny",
        prompt="x",
        max_tokens=8,
        seed=2,
        extra_body={"structured_outputs": {"regex": "[a-c]{3}"}},
    )
    assert re.fullmatch("[a-c]{3}", out.choices[0].text) and seen == [Compiled]
    r = httpx.post(
        url + "/v1/completions",
        headers=AUTH,
        timeout=120,
        json={
            "prompt": "x",
            "max_tokens": 4,
            "structured_outputs": {"grammar": parser_alternatives(20_000)},
        },
    )
    assert r.status_code == 400 and "max is 2000" in r.json()["error"]["message"], r.text[:300]
    assert "\n" not in r.json()["error"]["message"] and seen == [Compiled]  # one line; never queued
    with ThreadPool(4) as pool:  # concurrent compiles: still the lane's two threads
        pool.map(
            lambda i: client(url).completions.create(
                model="tiny",
                prompt="x",
                max_tokens=2,
                extra_body={"structured_outputs": {"regex": f"[a-c]{{{i + 1}}}"}},
            ),
            range(8),
        )
    assert threads <= {"constraint-compile_0", "constraint-compile_1"}, threads
