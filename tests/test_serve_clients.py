"""serve.py through the clients people point at it: the `openai` SDK's Responses API (streamed and
not, function tools and their outputs, previous_response_id, structured text), models.retrieve,
null for optional fields, legacy functions, tool calls streamed as they are written; LangChain's
OpenAI and ChatOpenAI; the OpenAI Agents SDK's default (Responses) model with a function tool.
One server on a tiny model (float64, so batching never changes a greedy token) for the module."""

import asyncio
import json
import time
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
import torch
from helpers import tiny_checkpoint
from test_serve import AUTH, KEY, client, start_server
from test_tool_calls import ADD, PARAMS, TOOLS, USER, WEATHER, check_call

from engine import Engine
from formats import weights
from formats.tokenizer import load_tokenizer
from serve import Limits

FLAT = [{"type": "function", **t["function"]} for t in TOOLS]  # the Responses API's tool shape
POINT = {
    "type": "object",
    "properties": {
        "x": {"type": "integer", "minimum": 0, "maximum": 9},
        "label": {"enum": ["a", "b"]},
    },
    "required": ["x", "label"],
    "additionalProperties": False,
}


LOOPS = {}  # url -> the server's EngineLoop


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tiny_checkpoint(tmp_path_factory.mktemp("clients-tiny"), max_position_embeddings=2048)
    model, info = weights.load(folder, dtype=torch.float64)
    tokenizer = load_tokenizer(info.source)
    engine = Engine.for_model(
        model,
        num_blocks=800,
        block_size=16,
        max_num_seqs=8,
        max_num_batched_tokens=1024,
        stop_ids=tokenizer.stop_ids,
        tokenizer=tokenizer,
    )
    limits = Limits(max_n=4, max_stored_responses=3, max_logprob_entries=50_000)
    url, app, stop = start_server(engine, tokenizer, limits)
    LOOPS[url] = app.state.engine_loop
    yield url
    stop()


def post(url, path, body):
    return httpx.post(url + path, json=body, headers=AUTH, timeout=60)


# -- the Responses API -----------------------------------------------------------------------------
def test_responses_text_equals_chat_whole_and_streamed(server):
    c = client(server)
    chat = c.chat.completions.create(
        model="tiny",
        max_tokens=12,
        temperature=0,
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hello there"},
        ],
    )
    r = c.responses.create(
        model="tiny",
        instructions="Be brief.",
        input="Hello there",
        max_output_tokens=12,
        temperature=0,
    )
    assert r.output_text == chat.choices[0].message.content
    assert (
        r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    )  # 12 tokens, no stop
    assert [item.status for item in r.output] == ["incomplete"]
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == 12
    events = list(
        c.responses.create(
            model="tiny",
            instructions="Be brief.",
            input="Hello there",
            max_output_tokens=12,
            temperature=0,
            stream=True,
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-1] == "response.incomplete" and "response.output_text.done" in kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == r.output_text == events[-1].response.output_text


def test_a_function_call_round_trip_by_previous_response_id_or_by_items(server):
    c = client(server)
    first = c.responses.create(
        model="tiny",
        input="What is the weather in Paris?",
        tools=FLAT,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
    )
    calls = [item for item in first.output if item.type == "function_call"]
    assert first.status == "completed" and len(calls) == 1
    call = calls[0]
    jsonschema.validate(json.loads(call.arguments), PARAMS[call.name])
    answer = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}
    chained = c.responses.create(
        model="tiny",
        previous_response_id=first.id,
        input=[answer],
        tools=FLAT,
        max_output_tokens=8,
        temperature=0,
    )
    resent = c.responses.create(
        model="tiny",
        tools=FLAT,
        max_output_tokens=8,
        temperature=0,
        input=[
            {"role": "user", "content": "What is the weather in Paris?"},
            {
                "type": "function_call",
                "call_id": call.call_id,
                "name": call.name,
                "arguments": call.arguments,
            },
            answer,
        ],
    )
    assert chained.output_text == resent.output_text  # the kept conversation is the one resent
    assert chained.usage.input_tokens == resent.usage.input_tokens > first.usage.input_tokens
    streamed = list(
        c.responses.create(
            model="tiny",
            input="What is the weather in Paris?",
            tools=FLAT,
            tool_choice="required",
            parallel_tool_calls=False,
            temperature=0,
            stream=True,
        )
    )
    fragments = [e.delta for e in streamed if e.type == "response.function_call_arguments.delta"]
    assert len(fragments) > 1  # written as they are generated, not at the end
    done = streamed[-1].response.output[-1]
    assert (done.name, json.loads("".join(fragments))) == (call.name, json.loads(call.arguments))


def test_structured_text_and_a_named_function(server):
    c = client(server)
    r = c.responses.create(
        model="tiny",
        input="A point, please",
        temperature=0,
        max_output_tokens=60,
        text={"format": {"type": "json_schema", "name": "point", "schema": POINT, "strict": True}},
    )
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), POINT)
    with c.responses.stream(
        model="tiny",
        input="A point, please",
        temperature=0,
        max_output_tokens=60,
        text={"format": {"type": "json_schema", "name": "point", "schema": POINT}},
    ) as stream:  # the SDK's accumulation
        final = stream.get_final_response()
    assert (
        len(final.output) == 1
        and len(final.output[0].content) == 1
        and final.output_text == r.output_text
    )
    named = c.responses.create(
        model="tiny",
        input="Add 2 and 3",
        tools=FLAT,
        temperature=0,
        tool_choice={"type": "function", "name": "add"},
    )
    assert [item.name for item in named.output if item.type == "function_call"] == ["add"]


def test_a_client_that_leaves_a_streamed_response_aborts_it(server):
    long = {
        "type": "object",
        "properties": {"s": {"type": "string", "minLength": 1000}},
        "required": ["s"],
    }
    loop, body = (
        LOOPS[server],
        {
            "model": "tiny",
            "input": "Tell me everything",
            "max_output_tokens": 1500,
            "temperature": 0,
            "stream": True,  # a format that forbids stopping early
            "text": {"format": {"type": "json_schema", "name": "long", "schema": long}},
        },
    )
    whole = client(server).responses.create(**{**body, "stream": False})
    assert whole.usage.output_tokens > 400  # long enough that leaving early shows
    before = loop.tokens_generated
    with httpx.Client(base_url=server, headers=AUTH) as h:
        with h.stream("POST", "/v1/responses", json=body) as r:
            assert any(
                line.startswith("data: ") and "output_text.delta" in line for line in r.iter_lines()
            )
    deadline = time.time() + 10
    while loop.engine.requests or loop.engine.scheduler.allocator.num_used():
        assert time.time() < deadline, "the abandoned response kept running"
        time.sleep(0.02)
    assert loop.tokens_generated - before < whole.usage.output_tokens // 2


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": [{"type": "input_audio", "data": "..."}]}, "input[0].type"),
        ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0].type",
        ),
        (
            {"input": [{"type": "function_call_output", "call_id": "call_never", "output": "x"}]},
            "input[0].call_id",
        ),
        ({"input": "hi", "previous_response_id": "resp_never_issued"}, "previous_response_id"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": "hi", "tool_choice": {"type": "allowed_tools"}}, "tool_choice"),
        ({"input": [{"role": ["user"], "content": "hi"}]}, "input[0].role"),
        ({"input": [1]}, "input[0]"),
        ({"input": []}, "input"),
        (
            {
                "input": [
                    {"type": "function_call", "call_id": "c1", "name": "add", "arguments": "{}"},
                    {"type": "function_call_output", "call_id": "c1"},
                ]
            },
            "input[1].output",
        ),
        ({"input": "hi", "text": {"format": "json"}}, "text.format"),
        (
            {"input": "hi", "tools": FLAT, "tool_choice": {"type": "function", "name": "nope"}},
            "tool_choice",
        ),
        ({"input": "hi", "background": True}, "background"),
        ({"input": "hi", "conversation": "conv_1"}, "conversation"),
        ({"input": "hi", "max_output_tokens": 10**9}, "max_output_tokens"),
        ({"input": "word " * 3000}, "input"),
        ({"input": 5}, "input"),
        ({"input": "hi", "temperature": 2.5}, "temperature"),
    ],
)
def test_bad_responses_requests_get_400_naming_the_field(server, body, param):
    """Named as a Responses client knows its fields (the request is checked on the chat path,
    whose names, max_tokens or messages, never reach the client)."""
    r = post(server, "/v1/responses", {"model": "tiny", **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    assert not {"max_tokens", "messages", "max_completion_tokens"} & set(
        error["message"].replace(",", " ").replace(":", " ").split()
    ), error


def test_concurrent_continuations_of_one_response_each_get_their_own(server):
    """Four requests continue the same previous_response_id at once: each is answered from that
    conversation, with its own id, and equals the same conversation sent whole, alone (float64:
    greedy tokens do not depend on the batch)."""
    from concurrent.futures import ThreadPoolExecutor

    c = client(server)
    first = c.responses.create(model="tiny", input="one", max_output_tokens=3, temperature=0)

    def follow(text):
        return c.responses.create(
            model="tiny",
            input=text,
            previous_response_id=first.id,
            max_output_tokens=3,
            temperature=0,
        )

    texts = ["two", "three", "four", "five"]
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(follow, texts))
    assert len({r.id for r in together}) == 4
    assert all(r.previous_response_id == first.id for r in together)
    for text, r in zip(texts, together):  # the conversation sent whole instead (the store
        history = [  # keeps 3 responses: `first` is gone by now)
            {"role": "user", "content": "one"},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": text},
        ]
        alone = c.responses.create(model="tiny", input=history, max_output_tokens=3, temperature=0)
        assert alone.output_text == r.output_text, text


def test_a_priority_on_a_server_that_admits_in_arrival_order_is_refused(server):
    """vLLM's `priority` extension is served with --schedule_policy priority; under fcfs a non-zero
    one is a 400 naming it (a zero is the default, accepted)."""
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
    r = post(server, "/v1/completions", {**body, "priority": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority", r.text
    assert "--schedule_policy priority" in r.json()["error"]["message"]
    assert post(server, "/v1/completions", {**body, "priority": 0}).status_code == 200


NOT_FINITE = [
    ("temperature", "1e400"),
    ("temperature", "NaN"),
    ("top_p", "-Infinity"),
    ("frequency_penalty", "1e400"),
    ("presence_penalty", "NaN"),
    ("repetition_penalty", "Infinity"),
    ("min_p", "NaN"),
]
HEADS = {
    "/v1/completions": '"prompt": "hi", "max_tokens": 2',
    "/v1/chat/completions": '"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2',
    "/v1/responses": '"input": "hi", "max_output_tokens": 2',
}


@pytest.mark.parametrize(
    "path, field, value",
    [(path, f, v) for path in list(HEADS)[:2] for f, v in NOT_FINITE]
    # the Responses API samples with temperature and top_p only
    + [("/v1/responses", f, v) for f, v in NOT_FINITE if f in ("temperature", "top_p")],
)
def test_every_endpoint_refuses_a_float_that_is_not_finite(server, path, field, value):
    """JSON's 1e400 parses as infinity (and Python's parser takes NaN and Infinity): each is a 400
    naming the field on every endpoint, never noise sampled at an infinite temperature."""
    r = httpx.post(
        server + path,
        content=f'{{"model": "tiny", {HEADS[path]}, "{field}": {value}}}',
        headers={**AUTH, "Content-Type": "application/json"},
        timeout=60,
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field, r.text


def test_only_the_newest_responses_are_kept(server):
    c = client(server)
    ids = [
        c.responses.create(model="tiny", input=f"turn {i}", max_output_tokens=2, temperature=0).id
        for i in range(4)
    ]  # the server keeps 3
    c.responses.create(
        model="tiny", input="again", previous_response_id=ids[1], max_output_tokens=2
    )
    with pytest.raises(openai.BadRequestError, match="no longer kept"):
        c.responses.create(
            model="tiny", input="again", previous_response_id=ids[0], max_output_tokens=2
        )
    unstored = c.responses.create(model="tiny", input="x", store=False, max_output_tokens=2)
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        c.responses.create(
            model="tiny", input="again", previous_response_id=unstored.id, max_output_tokens=2
        )


# -- what else clients send ------------------------------------------------------------------------
NULLS = [
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "n",
    "stop",
    "stream",
    "stream_options",
    "logit_bias",
    "seed",
    "frequency_penalty",
    "presence_penalty",
    "response_format",
    "user",
]


def test_null_is_absent_and_unknown_fields_are_ignored(server):
    plain = post(
        server, "/v1/completions", {"prompt": "Hi", "max_tokens": 5, "temperature": 0}
    ).json()
    nulls = post(
        server,
        "/v1/completions",
        {
            "prompt": "Hi",
            **dict.fromkeys(NULLS + ["logprobs", "echo"]),
            "max_tokens": 5,
            "temperature": 0,
            "not_a_field": {"x": 1},
        },
    )
    assert nulls.status_code == 200, nulls.text
    assert nulls.json()["choices"][0]["text"] == plain["choices"][0]["text"]
    chat = {
        "messages": [{"role": "user", "content": "Hi", "name": None, "tool_calls": None}],
        "max_tokens": 5,
    }
    r = post(
        server,
        "/v1/chat/completions",
        {
            **chat,
            **dict.fromkeys(
                NULLS
                + ["max_completion_tokens", "logprobs", "top_logprobs", "tools", "tool_choice"]
            ),
            "max_tokens": 5,
        },
    )
    assert r.status_code == 200, r.text
    assert post(server, "/v1/completions", {"prompt": None}).json()["error"]["param"] == "prompt"
    booleans = post(
        server, "/v1/completions", {"prompt": [True, False], "max_tokens": 2}
    )  # not token ids
    assert booleans.status_code == 400 and booleans.json()["error"]["param"].startswith("prompt")
    for field, value in (("logit_bias", {"99999999": 1}), ("suffix", "and then"), ("best_of", 3)):
        bad = post(
            server, "/v1/completions", {"prompt": "Hi", field: value}
        )  # known fields still checked
        assert bad.status_code == 400 and bad.json()["error"]["param"] == field
    tool = {"type": "function", "function": {"name": "f", "description": None, "parameters": None}}
    r = post(
        server,
        "/v1/chat/completions",
        {**chat, "tools": [tool], "tool_choice": "required", "max_tokens": 40},
    )
    assert r.status_code == 200, (
        r.text
    )  # (its arguments: any object, which a random model may not end in 40 tokens)
    message = r.json()["choices"][0]["message"]
    assert message.get("tool_calls") or message["content"].startswith(
        '<tool_call>{"name": "f", "arguments": {'
    )


def test_a_response_holding_too_many_logprobs_is_refused_up_front(server):
    body = {
        "prompt": [3 + i % 250 for i in range(1500)],
        "max_tokens": 0,
        "echo": True,
        "logprobs": 20,
        "n": 2,
    }
    r = post(server, "/v1/completions", body)  # 2 x 1,500 tokens x 21 = 63,000 > 50,000
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs" and "63000" in r.text
    ok = post(server, "/v1/completions", {**body, "n": 1, "logprobs": 5})  # 1,500 x 6 = 9,000
    assert ok.status_code == 200, ok.text
    choice = ok.json()["choices"][0]
    assert ok.status_code == 200 and len(choice["logprobs"]["tokens"]) == 1500


def test_models_retrieve_and_endpoints_not_served(server):
    c = client(server)
    assert c.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError, match="does not exist") as e:
        c.models.retrieve("gpt-nothing")
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError, match="does not serve embeddings"):
        c.embeddings.create(model="tiny", input="hello")  # (tests/test_serve_embeddings.py does)
    r = httpx.get(server + "/v1/nothing", headers=AUTH)
    assert r.status_code == 404 and "/v1/responses" in r.json()["error"]["message"]


def test_chat_tool_calls_stream_as_written_and_equal_the_whole_reply(server):
    c = client(server)
    args = dict(
        model="tiny", messages=USER, tools=TOOLS, tool_choice="required", max_tokens=200, seed=5
    )
    whole = c.chat.completions.create(**args).choices[0]
    calls, fragments = {}, 0
    for chunk in c.chat.completions.create(**args, stream=True):
        for d in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            entry = calls.setdefault(d.index, {"name": d.function.name, "arguments": ""})
            entry["arguments"] += d.function.arguments or ""
            fragments += bool(d.function.arguments)
    assert fragments > 1 and whole.finish_reason == "tool_calls"
    assert [(v["name"], json.loads(v["arguments"])) for _, v in sorted(calls.items())] == [
        (t.function.name, json.loads(t.function.arguments)) for t in whole.message.tool_calls
    ]
    for t in whole.message.tool_calls:
        check_call(t)


def test_legacy_functions_are_answered_in_their_form(server):
    legacy = {
        "model": "tiny",
        "messages": USER,
        "functions": [WEATHER["function"], ADD["function"]],
        "function_call": {"name": "add"},
        "max_tokens": 100,
        "seed": 1,
    }
    r = post(server, "/v1/chat/completions", legacy).json()["choices"][0]
    assert r["finish_reason"] == "function_call" and r["message"]["function_call"]["name"] == "add"
    jsonschema.validate(json.loads(r["message"]["function_call"]["arguments"]), PARAMS["add"])
    both = post(server, "/v1/chat/completions", {**legacy, "tools": TOOLS})
    assert both.status_code == 400 and both.json()["error"]["param"] == "functions"


# -- LangChain and the OpenAI Agents SDK -----------------------------------------------------------
def test_langchain_openai_llm_and_chat_model(server):
    from langchain_openai import ChatOpenAI, OpenAI
    from pydantic import BaseModel, Field

    llm = OpenAI(
        base_url=server + "/v1",
        api_key=KEY,
        model="tiny",
        max_tokens=6,
        temperature=0,
        max_retries=0,
    )
    text = llm.invoke("Once upon a time")  # sends "seed": null and "logprobs": null
    assert text and "".join(llm.stream("Once upon a time")) == text
    chat = ChatOpenAI(
        base_url=server + "/v1",
        api_key=KEY,
        model="tiny",
        max_tokens=6,
        temperature=0,
        max_retries=0,
    )
    reply = chat.invoke("Hello")
    assert reply.content and "".join(c.content for c in chat.stream("Hello")) == reply.content
    tooled = chat.bind_tools([WEATHER], tool_choice="get_weather").invoke(
        "Weather in Paris?", max_tokens=120
    )
    assert tooled.tool_calls[0]["name"] == "get_weather"
    jsonschema.validate(tooled.tool_calls[0]["args"], PARAMS["get_weather"])

    class Point(BaseModel):
        x: int = Field(ge=0, le=9)
        label: str = Field(pattern="^[ab]$")

    point = chat.with_structured_output(Point).invoke("A point", max_tokens=60)
    assert isinstance(point, Point)


def test_openai_agents_sdk_runs_a_function_tool_and_a_structured_answer(server):
    """Agents on the SDK's Responses model: one calls a tool (the run stops at its result), one
    answers in its output_type, run streamed. (A random model under "auto" may call tools every
    turn, so the two are run apart.)"""
    from agents import (
        Agent,
        ModelSettings,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from pydantic import BaseModel

    set_tracing_disabled(True)
    asked = []

    @function_tool
    def get_weather(city: Literal["Paris", "Oslo"]) -> str:
        """The weather in a city."""
        asked.append(city)
        return "sunny"

    class Report(BaseModel):  # a closed answer, so the tiny model's reply ends within max_tokens
        sky: Literal["sunny", "rainy"]

    model = OpenAIResponsesModel(
        "tiny", openai.AsyncOpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0)
    )
    settings = ModelSettings(
        tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=200
    )
    caller = Agent(
        name="weather",
        instructions="Answer with the weather.",
        tools=[get_weather],
        model=model,
        model_settings=settings,
        tool_use_behavior="stop_on_first_tool",
    )
    reporter = Agent(
        name="report",
        instructions="Report the sky.",
        model=model,
        output_type=Report,
        model_settings=ModelSettings(temperature=0, max_tokens=60),
    )

    async def both():  # one event loop: the client's connections belong to it
        result = await Runner.run(caller, "What is the weather in Paris?", max_turns=2)
        run = Runner.run_streamed(reporter, "Is it sunny?", max_turns=1)
        kinds = {event.type async for event in run.stream_events()}
        return result.final_output, run.final_output, kinds

    answer, report, kinds = asyncio.run(both())
    assert (
        asked in (["Paris"], ["Oslo"]) and answer == "sunny"
    )  # the call parsed into the tool's arguments
    assert isinstance(report, Report) and "raw_response_event" in kinds
