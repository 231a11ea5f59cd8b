"""Tool calling (server/tool_calls.py) through serve.py and the real `openai` client: "required" and
named tool_choice always produce calls that parse and validate against the tool's parameters (a
random model included), streamed as OpenAI's tool-call deltas or not; the two output formats parse;
tools reach a template that knows them, and a system message otherwise; a conversation with the call
and the tool's answer continues; bad tools get 400."""

import json

import httpx
import jsonschema
import pytest
from helpers import tiny_checkpoint
from hypothesis import given, settings
from hypothesis import strategies as st
from test_serve import AUTH, client, serve_checkpoint

from constrain import compile_constraint
from formats.tokenizer import load_tokenizer, render_chat_template
from server import tool_calls

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 8},
                "unit": {"enum": ["c", "f"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "minimum": 0, "maximum": 99},
                "b": {"type": "integer", "minimum": 0, "maximum": 99},
            },
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, ADD]
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """serve.py on a tiny model with room for the tools' system message (its tokenizer is nearly
    byte-level, so the listing takes ~600 tokens)."""
    folder = tiny_checkpoint(tmp_path_factory.mktemp("tools-tiny"), max_position_embeddings=2048)
    url, stop = serve_checkpoint(
        folder, num_blocks=600, block_size=16, max_num_seqs=8, max_num_batched_tokens=1024
    )
    yield (url,)
    stop()


def check_call(call, name=None):
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in PARAMS and (name is None or call.function.name == name)
    jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])


def test_parse_both_formats_and_leave_what_does_not_parse():
    content, calls = tool_calls.parse_calls(
        'Sure. <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>',
        "hermes",
        TOOLS,
    )
    assert content == "Sure." and calls[0]["function"] == {
        "name": "add",
        "arguments": '{"a": 1, "b": 2}',
    }
    assert (
        tool_calls.parse_calls(
            '<tool_call>{"name": "nope", "arguments": {}}</tool_call>', "hermes", TOOLS
        )[1]
        == []
    )
    assert tool_calls.parse_calls("<tool_call>{broken</tool_call>", "hermes", TOOLS) == (
        "<tool_call>{broken</tool_call>",
        [],
    )
    content, calls = tool_calls.parse_calls(
        '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "c"}}', "llama3", TOOLS
    )
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {
        "city": "Oslo",
        "unit": "c",
    }
    assert tool_calls.parse_calls("hello", "llama3", TOOLS) == ("hello", [])


def streamed(text: str, cuts, fmt="hermes", parallel=True):
    """CallStream fed `text` in pieces cut at `cuts`: (content, [(name, arguments as parsed JSON)],
    fragments)."""
    stream, parts, at = tool_calls.CallStream(fmt, TOOLS, parallel), [], 0
    for cut in sorted(cuts) + [len(text)]:
        parts += stream.feed(text[at:cut])
        at = max(at, cut)
    parts += stream.finish()
    calls = []
    for kind, *value in parts:
        if kind == "call":
            calls.append([value[1], ""])
        elif kind == "arguments":
            calls[-1][1] += value[0]
    content = "".join(v[0] for kind, *v in parts if kind == "content")
    return (
        content,
        [(name, json.loads(args)) for name, args in calls],
        sum(kind == "arguments" for kind, *_ in parts),
    )


def whole(text: str, fmt="hermes", parallel=True):
    content, calls = tool_calls.parse_calls(text, fmt, TOOLS, parallel)
    return content, [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


ARGUMENTS = st.fixed_dictionaries({"a": st.integers(0, 99), "city": st.text(max_size=6)})
PROSE = st.text(st.sampled_from('ab <>{}"\n\\_/lt'), max_size=12)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(PROSE, st.sampled_from(["add", "get_weather", "nope"]), ARGUMENTS),
        min_size=1,
        max_size=3,
    ),
    PROSE,
    st.lists(st.integers(0, 400), max_size=12),
    st.booleans(),
)
def test_streamed_calls_equal_the_whole_parse_however_the_text_is_cut(pieces, tail, cuts, parallel):
    """Prose around calls (known and unknown names, strings holding braces, quotes and tags),
    cut anywhere: the streamed calls are parse_calls' calls, the streamed content its content
    up to the whitespace around calls."""
    text = (
        "".join(
            f'{prose}<tool_call>{{"name": "{name}", "arguments": {json.dumps(args)}}}</tool_call>'
            for prose, name, args in pieces
        )
        + tail
    )
    content, calls, _ = streamed(text, cuts, parallel=parallel)
    want_content, want_calls = whole(text, parallel=parallel)
    assert calls == want_calls
    assert (
        content.split() == (want_content or "").split()
        or not want_calls
        and content == want_content
    )


def test_streamed_calls_arrive_in_pieces_and_other_forms_still_parse():
    text = 'Let me see. <tool_call>{"name": "add", "arguments": {"a": 1, "b": 22}}</tool_call>'
    content, calls, fragments = streamed(text, range(0, len(text), 3))
    assert (content, calls) == ("Let me see.", [("add", {"a": 1, "b": 22})]) and fragments > 3
    reordered = (
        '<tool_call>{"arguments": {"a": 5}, "name": "add"}</tool_call>'  # parsed whole at its close
    )
    assert streamed(reordered, [7, 20])[:2] == ("", [("add", {"a": 5})])
    llama = '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "c"}}'
    assert streamed(llama, [5, 30], fmt="llama3")[:2] == (
        "",
        [("get_weather", {"city": "Oslo", "unit": "c"})],
    )
    assert streamed("hello {x", [3], fmt="llama3")[:2] == ("hello {x", [])
    # cut by max_tokens before its head: content, as parse_calls
    cut = '<tool_call>{"name": "add", "argu'
    assert streamed(cut, [4])[:2] == (cut, [])
    # unclosed JSON ends at CLOSE
    broken = '<tool_call>{"name": "add", "arguments": {"a": 1</tool_call> and more'
    stream = tool_calls.CallStream("hermes", TOOLS)
    parts = [
        p for k in range(0, len(broken), 5) for p in stream.feed(broken[k : k + 5])
    ] + stream.finish()
    assert "".join(v[0] for kind, *v in parts if kind == "content") == " and more"
    assert (
        "".join(v[0] for kind, *v in parts if kind == "arguments").strip() == '{"a": 1'
    )  # as far as it got
    html = tool_calls.CallStream(
        "llama3", TOOLS
    )  # a reply opening with "<" that is not the python tag
    assert html.feed("<b>bold") == [("content", "<b>bold")]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    folder = tiny_checkpoint(tmp_path_factory.mktemp("grammar-tiny"))
    with open(folder / "config.json") as f:
        return load_tokenizer(folder), json.load(f)["vocab_size"]


def accepts(constraint, tokenizer, text: str) -> bool:
    """Whether `text` (tokenized) is a complete output of the constraint."""
    tokenizer, vocab = tokenizer
    matcher = compile_constraint(constraint, tokenizer, vocab, tokenizer.stop_ids)
    for t in tokenizer.encode(text, bos=False):
        matcher.advance(t)
        if matcher.error:
            return False
    return matcher.m.is_accepting()


def test_required_allows_parallel_calls_and_strict_tools_allow_no_extra_keys(tokenizer):
    one = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    two = (
        one
        + "\n"
        + (
            '<tool_call>{"name": "get_weather", "arguments": '
            '{"city": "Rome", "unit": "c"}}</tool_call>'
        )
    )
    parallel = tool_calls.call_constraint(TOOLS, "required", "hermes", parallel=True)
    single = tool_calls.call_constraint(TOOLS, "required", "hermes", parallel=False)
    assert accepts(parallel, tokenizer, one) and accepts(parallel, tokenizer, two)
    assert accepts(single, tokenizer, one) and not accepts(single, tokenizer, two)
    loose = {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}},
        },
    }
    extra = '<tool_call>{"name": "f", "arguments": {"x": 1, "y": 2}}</tool_call>'
    strict = {"type": "function", "function": {**loose["function"], "strict": True}}
    assert accepts(tool_calls.call_constraint([loose], "required", "hermes"), tokenizer, extra)
    assert not accepts(tool_calls.call_constraint([strict], "required", "hermes"), tokenizer, extra)
    assert accepts(
        tool_calls.call_constraint([strict], "required", "hermes"),
        tokenizer,
        extra.replace(', "y": 2', ""),
    )


def test_auto_with_a_json_format_allows_calls_or_the_json_answer(tokenizer):
    from constrain import Constraint

    answer = Constraint(
        "json_schema",
        {
            "type": "object",
            "properties": {"ok": {"type": "boolean"}},
            "required": ["ok"],
            "additionalProperties": False,
        },
    )
    assert tool_calls.call_constraint(TOOLS, "auto", "hermes") is None  # free text: nothing to hold
    either = tool_calls.call_constraint(TOOLS, "auto", "hermes", parallel=True, text=answer)
    call = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    assert accepts(either, tokenizer, call) and accepts(either, tokenizer, '{"ok": true}')
    assert not accepts(either, tokenizer, '{"ok": 1}') and not accepts(
        either, tokenizer, "plain words"
    )
    llama = tool_calls.call_constraint(TOOLS, "auto", "llama3", text=answer)
    assert accepts(llama, tokenizer, '{"name": "add", "parameters": {"a": 1, "b": 2}}')
    assert accepts(llama, tokenizer, '{"ok": false}')


def test_tools_reach_the_template_or_a_system_message():
    knows = (
        "{% for t in tools %}[{{ t.function.name }}]{% endfor %}"
        "{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    messages, extra = tool_calls.render_args(USER, TOOLS, "auto", knows)
    assert render_chat_template(knows, messages, **extra).startswith("[get_weather][add]")
    messages, extra = tool_calls.render_args(
        USER, TOOLS, "auto", "{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    assert (
        extra == {}
        and messages[0]["role"] == "system"
        and '"name": "add"' in messages[0]["content"]
    )
    assert tool_calls.render_args(USER, TOOLS, "none", knows) == (USER, {})
    assert (
        tool_calls.tool_format("... ipython ...") == "llama3"
        and tool_calls.tool_format(knows) == "hermes"
    )


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_required_and_named_tool_choice_always_give_valid_calls(server, seed):
    url = server[0]
    out = client(url).chat.completions.create(
        model="tiny", messages=USER, tools=TOOLS, tool_choice="required", max_tokens=120, seed=seed
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    check_call(choice.message.tool_calls[0])
    named = client(url).chat.completions.create(
        model="tiny",
        messages=USER,
        tools=TOOLS,
        max_tokens=120,
        seed=seed,
        tool_choice={"type": "function", "function": {"name": "add"}},
    )
    check_call(named.choices[0].message.tool_calls[0], "add")


def test_streamed_tool_call_deltas_and_a_conversation_that_continues(server):
    url = server[0]
    stream = client(url).chat.completions.create(
        model="tiny",
        messages=USER,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=120,
        seed=3,
        stream=True,
        logprobs=True,
        stream_options={"include_usage": True},
    )
    calls, reasons, logprobs, used = {}, [], 0, None
    for chunk in stream:
        used = chunk.usage or used
        for c in chunk.choices:
            reasons.append(c.finish_reason)
            logprobs += len(c.logprobs.content) if c.logprobs else 0
            for d in c.delta.tool_calls or []:
                calls.setdefault(d.index, {"id": d.id, "name": d.function.name, "arguments": ""})
                calls[d.index]["arguments"] += d.function.arguments or ""
    assert reasons[-1] == "tool_calls" and len(calls) == 1
    assert logprobs == used.completion_tokens  # every token's log-probability, in the one delta
    call = calls[0]
    jsonschema.validate(json.loads(call["arguments"]), PARAMS[call["name"]])
    turn = USER + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call["id"],
                    "type": "function",
                    "function": {"name": call["name"], "arguments": call["arguments"]},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call["id"], "content": "sunny, 21 C"},
    ]
    reply = client(url).chat.completions.create(
        model="tiny", messages=turn, tools=TOOLS, max_tokens=8, seed=1
    )
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")
    plain = client(url).chat.completions.create(
        model="tiny", messages=USER, tools=TOOLS, tool_choice="none", max_tokens=8, seed=1
    )
    assert plain.choices[0].message.tool_calls is None


@pytest.mark.parametrize(
    "body",
    [
        {"tools": [{"type": "function"}]},
        {"tools": [{"type": "retrieval", "function": {"name": "x"}}]},
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "missing"}}},
        {"tools": TOOLS, "tool_choice": "sometimes"},
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": "add"}},
        {"tool_choice": "required"},
    ],
)
def test_bad_tools_get_400(server, body):
    url = server[0]
    r = httpx.post(
        url + "/v1/chat/completions", json={"model": "tiny", "messages": USER, **body}, headers=AUTH
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] in ("tools", "tool_choice")
