"""server/harmony.py: gpt-oss's replies split into content, reasoning and tool calls, whole or while
they are written (the same parts however the text is cut), and through serve.py's chat endpoint with
the `openai` client, on a tiny gpt-oss whose tokenizer has harmony's markers and a harmony-shaped
template; the reply is held to a grammar so the random model writes the format."""

import json

import openai
import pytest
import torch
from helpers import HARMONY_SPECIAL, HARMONY_TEMPLATE, tiny_checkpoint
from hypothesis import given, settings
from hypothesis import strategies as st
from test_serve import KEY, serve_checkpoint

from server import harmony

THINK = "<|channel|>analysis<|message|>The user adds 2 and 2.<|end|>"
CALL = (
    "<|start|>assistant to=functions.add<|channel|>commentary json<|message|>"
    '{"a": 2, "b": 2}<|call|>'
)
FINAL = "<|start|>assistant<|channel|>final<|message|>It is 4.<|return|>"


@pytest.mark.parametrize(
    "text, content, reasoning, calls",
    [
        (THINK + FINAL, "It is 4.", "The user adds 2 and 2.", []),
        (THINK + CALL, None, "The user adds 2 and 2.", [("add", '{"a": 2, "b": 2}')]),
        # the recipient after the channel, a constrain marker, and a reply cut by max_tokens
        # mid-answer
        (
            "<|channel|>commentary to=functions.add <|constrain|>json<|message|>{}<|call|>",
            None,
            None,
            [("add", "{}")],
        ),
        (
            THINK + "<|start|>assistant<|channel|>final<|message|>It i",
            "It i",
            "The user adds 2 and 2.",
            [],
        ),
        ("plain text, no format", "plain text, no format", None, []),
        (THINK + "<|start|>assistant<|chan", None, "The user adds 2 and 2.", []),  # cut in a header
    ],
)
def test_a_reply_splits_into_content_reasoning_and_calls(text, content, reasoning, calls):
    assert harmony.parse(text) == {"content": content, "reasoning": reasoning, "calls": calls}


WORDS = st.text(alphabet='abc <|>{}":,.', max_size=12).filter(lambda t: "<|" not in t)
MESSAGES = st.lists(
    st.tuples(st.sampled_from(["analysis", "final", "call"]), WORDS), min_size=1, max_size=4
)


@settings(max_examples=150, deadline=None)
@given(MESSAGES, st.lists(st.integers(1, 200), max_size=8))
def test_the_stream_gives_what_parse_gives_however_the_text_is_cut(messages, cuts):
    text = ""
    for i, (kind, body) in enumerate(messages):
        head = "" if i == 0 else "<|start|>assistant"
        head += (
            " to=functions.f<|channel|>commentary json" if kind == "call" else f"<|channel|>{kind}"
        )
        text += f"{head}<|message|>{body}<|end|>"
    stream, parts, at = harmony.HarmonyStream(), [], 0
    for cut in sorted(cuts) + [len(text)]:
        parts += stream.feed(text[at:cut])
        at = max(at, min(cut, len(text)))
    parts += stream.finish()
    whole = harmony.parse(text)
    joined = {
        kind: "".join(p[1] for p in parts if p[0] == kind) or None
        for kind in ("content", "reasoning")
    }
    assert joined == {"content": whole["content"], "reasoning": whole["reasoning"]}
    streamed_calls, current = [], None
    for kind, *value in parts:
        if kind == "call":
            current = [value[1], ""]
            streamed_calls.append(current)
        elif kind == "arguments":
            current[1] += value[0]
    assert [(n, a.strip()) for n, a in streamed_calls] == whole["calls"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tiny_checkpoint(
        tmp_path_factory.mktemp("harmony"),
        arch="gpt_oss",
        max_position_embeddings=512,
        special=HARMONY_SPECIAL,
        chat_template=HARMONY_TEMPLATE,
    )
    url, stop = serve_checkpoint(folder, dtype=torch.float64, num_blocks=64, block_size=4)
    yield openai.OpenAI(base_url=url + "/v1", api_key=KEY)
    stop()


def grammar(*parts):
    return {"structured_outputs": {"grammar": "start: " + " ".join(parts)}}


REPLY = grammar(
    '<|channel|> "analysis" <|message|> "two and two" <|end|>',
    '<|start|> "assistant" <|channel|> "final" <|message|> "four"',
)
USER = [{"role": "user", "content": "2 + 2?"}]
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]


def test_chat_reply_has_the_final_channel_as_content_and_the_analysis_as_reasoning(server):
    whole = server.chat.completions.create(
        model="tiny", messages=USER, max_tokens=100, extra_body=REPLY
    )
    message = whole.choices[0].message
    assert (message.content, message.reasoning_content) == ("four", "two and two")
    chunks = list(
        server.chat.completions.create(
            model="tiny", messages=USER, max_tokens=100, extra_body=REPLY, stream=True
        )
    )
    deltas = [c.choices[0].delta.model_dump() for c in chunks if c.choices]
    assert "".join(d.get("content") or "" for d in deltas) == "four"
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == "two and two"


def test_a_message_to_a_function_is_a_tool_call(server):
    call = grammar(
        '<|channel|> "analysis" <|message|> "add them" <|end|>',
        (
            '<|start|> "assistant to=functions.add" <|channel|> "commentary json" '
            '<|message|> "{\\"a\\": 2}"'
        ),
    )
    whole = server.chat.completions.create(
        model="tiny", messages=USER, max_tokens=100, tools=TOOLS, extra_body=call
    )
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.reasoning_content == "add them"
    assert [
        (c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls
    ] == [("add", {"a": 2})]
    chunks = list(
        server.chat.completions.create(
            model="tiny", messages=USER, max_tokens=100, tools=TOOLS, extra_body=call, stream=True
        )
    )
    calls = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
    assert calls[0].function.name == "add" and json.loads(
        "".join(t.function.arguments for t in calls)
    ) == {"a": 2}
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_a_forced_tool_choice_is_refused_by_name(server):
    with pytest.raises(openai.BadRequestError, match="not enforced in gpt-oss's reply format") as e:
        server.chat.completions.create(
            model="tiny", messages=USER, max_tokens=4, tools=TOOLS, tool_choice="required"
        )
    assert e.value.body["param"] == "tool_choice"


def test_the_responses_api_answers_with_the_final_channel():
    """server/responses.py's whole reply: the final channel as its message, a call to a function as
    a function_call item (the analysis channel is not written as reasoning items there)."""
    from server.choices import Outputs
    from server.responses import Responses

    reply = (
        "<|channel|>analysis<|message|>two and two<|end|>"
        "<|start|>assistant<|channel|>final<|message|>four<|end|>"
    )
    for tools, items in (
        (None, [("message", "four")]),
        (("harmony", TOOLS), [("message", "four"), ("function_call", "add")]),
    ):
        out = Outputs(None, [[1]], 1, True, False, False, tools, channels=True)
        for piece in (reply + CALL).split("<|end|>"):  # as the engine hands the text on, in pieces
            out.add(0, 5, piece + "<|end|>", None, None)
        got = Responses.items(out, "completed")
        assert [
            (i["type"], i["content"][0]["text"] if i["type"] == "message" else i["name"])
            for i in got
        ] == items


def test_streamed_calls_get_ids_and_only_the_first_without_parallel_tool_calls():
    """A harmony call carries no id of its own: the Responses stream gives it one (the chat path
    too); with parallel_tool_calls false only the first of two calls streams, as the whole reply
    keeps only the first."""
    from server.response_items import Events

    second = CALL.replace("functions.add", "functions.mul")
    parts = harmony.HarmonyStream(True).feed(THINK + CALL + second)
    assert [p[2] for p in parts if p[0] == "call"] == ["add", "mul"]
    events = Events()
    list(events.parts([p for p in parts if p[0] != "reasoning"]))
    assert [(i["name"], bool(i["call_id"])) for i in events.items] == [("add", True), ("mul", True)]
    alone = harmony.HarmonyStream(True, parallel=False).feed(THINK + CALL + second)
    assert [p[2] for p in alone if p[0] == "call"] == ["add"]
    assert "".join(p[1] for p in alone if p[0] == "arguments") == '{"a": 2, "b": 2}'
