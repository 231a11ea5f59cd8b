"""OpenAI's Responses API (`POST /v1/responses`) on serve.py's chat path: the request becomes a
chat request, runs through the same steps (limits, chat template, tool grammar, engine, aborts,
draining), and its reply is written back as output items, whole or as Responses events.

    python -c "from server import responses"     # library only; serve.py routes /v1/responses here

    input items                         chat messages
      "text" or {"role", "content"}       user / assistant / system ("developer" is system)
      {"type": "function_call"}           an assistant message's tool_calls (call_id is the
                                          call's id)
      {"type": "function_call_output"}    a "tool" message answering that call_id
    instructions                        a system message first (not carried to the next response)
    tools [{"type": "function", name, parameters, strict}], tool_choice, parallel_tool_calls
    text.format (json_schema, json_object, text), max_output_tokens, temperature, top_p

Streamed, the events are OpenAI's: response.created, response.in_progress; for each output item
response.output_item.added, then a message's response.content_part.added,
response.output_text.delta ..., response.output_text.done, response.content_part.done, or a
function call's response.function_call_arguments.delta ..., .done; response.output_item.done;
last response.completed (response.incomplete when max_output_tokens cut it, with
incomplete_details.reason "max_output_tokens", or a shutdown, with none; response.failed).
server/response_items.py builds the output items and writes the events.

`previous_response_id` continues a conversation: each reply (unless `store: false`) is kept in
memory with the messages that led to it, the newest `--max_stored_responses` of them; an id never
issued, or evicted, is a 400 naming the field.
"""

import time
from collections import OrderedDict

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import Field, ValidationError

from server.choices import Outputs
from server.delivery import collect
from server.engine_loop import events_of
from server.openai_format import Body, ChatRequest, Refused, field_path
from server.response_items import Events, assistant_message, call_item, ending, message_item, usage
from server.tool_calls import tool_format

ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
TEXT_PARTS = ("input_text", "output_text", "text")


class ResponsesRequest(Body):
    model: str = None
    input: str | list
    instructions: str = None
    max_output_tokens: int = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    stream: bool = False
    # [{"type": "function", "name", "description", "parameters", "strict"}]
    tools: list[dict] = None
    tool_choice: str | dict = None  # "auto" | "none" | "required" | {"type": "function", "name"}
    parallel_tool_calls: bool = True
    # {"format": {"type": "text" | "json_object" | "json_schema", "name", "schema"}}
    text: dict = None
    previous_response_id: str = None
    store: bool = True
    metadata: dict = None
    background: bool = False  # refused: replies here are never run in the background
    conversation: str | dict = None  # refused: conversations here are previous_response_id chains


# -- the request as chat messages ------------------------------------------------------------------
def text_of(content, where: str) -> str:
    """A message item's content (a string or text parts) as one string."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(
            f"{where}.content must be a string or a list of text parts", f"{where}.content"
        )
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise ValueError(
                f"{where}.content[{j}]: only text parts ({', '.join(TEXT_PARTS)}) are supported, "
                f"got type {kind!r}",
                f"{where}.content[{j}].type",
            )
        texts.append(part["text"])
    return "".join(texts)


def input_messages(items, history: list) -> list:
    """The `input` as chat messages after `history`; ValueError (message, param) naming the item."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages, calls = [], {c["id"] for m in history for c in m.get("tool_calls") or ()}
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise ValueError(f"{where} must be an item object, got {type(item).__name__}", where)
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(role_message(item, where))
        elif kind == "function_call":
            call = function_call(item, where)
            calls.add(item["call_id"])
            # the calls of one reply: one message
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append(call_output(item, where, calls))
        # (another model's reasoning, sent back by a client: not for this one)
        elif not isinstance(kind, str) or kind != "reasoning":
            raise ValueError(
                f"{where}.type: unknown input item type {kind!r}; this server takes message, "
                "function_call and function_call_output items",
                f"{where}.type",
            )
    return messages


def role_message(item: dict, where: str) -> dict:
    """A message item (user, assistant, system or developer) as a chat message."""
    if not isinstance(item.get("role"), str) or item["role"] not in ROLES:
        raise ValueError(
            f"{where}.role must be one of {', '.join(ROLES)}, got {item.get('role')!r}",
            f"{where}.role",
        )
    return {"role": ROLES[item["role"]], "content": text_of(item.get("content"), where)}


def function_call(item: dict, where: str) -> dict:
    """A function_call item as a chat tool call (its call_id is the call's id)."""
    for key in ("call_id", "name", "arguments"):
        if not isinstance(item.get(key), str):
            raise ValueError(f"{where}.{key} must be a string", f"{where}.{key}")
    return {
        "id": item["call_id"],
        "type": "function",
        "function": {"name": item["name"], "arguments": item["arguments"]},
    }


def call_output(item: dict, where: str, calls: set) -> dict:
    """A function_call_output item as a "tool" message; its call_id must name a call in `calls`
    (the ids of the calls before it)."""
    if not isinstance(item.get("call_id"), str) or item["call_id"] not in calls:
        raise ValueError(
            f"{where}.call_id: no function_call with call_id {item.get('call_id')!r} comes "
            "before this output (in input, or in previous_response_id's conversation)",
            f"{where}.call_id",
        )
    output = item.get("output")
    if not isinstance(output, (str, list)):
        raise ValueError(
            f"{where}.output must be a string or a list of text parts", f"{where}.output"
        )
    return {
        "role": "tool",
        "tool_call_id": item["call_id"],
        "content": output if isinstance(output, str) else text_of(output, f"{where}.output"),
    }


def chat_tools(tools) -> list:
    """Responses' flat function tools -> chat's {"type": "function", "function": {...}}."""
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else t
            raise ValueError(
                f"tools[{i}]: only function tools are served here, got type {kind!r}",
                f"tools[{i}].type",
            )
        out.append(
            {
                "type": "function",
                "function": {
                    k: t[k]
                    for k in ("name", "description", "parameters", "strict")
                    if t.get(k) is not None
                },
            }
        )
    return out


def chat_fields(body: ResponsesRequest) -> dict:
    """The chat request's fields but its messages; ValueError (message, param)."""
    fields = {
        "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "stream": body.stream,
        "parallel_tool_calls": body.parallel_tool_calls,
    }
    if body.tools:
        fields["tools"] = chat_tools(body.tools)
    choice = body.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function":
            raise ValueError(
                'tool_choice must be "auto", "none", "required" or '
                '{"type": "function", "name": ...}',
                "tool_choice",
            )
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    fields["tool_choice"] = choice
    fmt = (body.text or {}).get("format")
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        fmt = {
            "type": "json_schema",
            "json_schema": {
                k: fmt.get(k) for k in ("name", "schema", "strict") if fmt.get(k) is not None
            },
        }
    if fmt is not None:
        fields["response_format"] = fmt
    return fields


# chat's field names as a Responses client knows them, for errors found on the chat path
RESPONSES_NAMES = {
    "messages": "input",
    "response_format": "text.format",
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
}


def renamed(refused: Refused) -> Refused:
    """A Refused from the chat path, naming the Responses field."""
    param = refused.param and refused.param.split(".")[0]
    if param not in RESPONSES_NAMES:
        return refused
    new = refused.param.replace(param, RESPONSES_NAMES[param], 1)
    return Refused(str(refused).replace(param, RESPONSES_NAMES[param], 1), new)


def chat_request(body: ResponsesRequest, history: list):
    """(ChatRequest, the conversation to keep: history + input, without instructions); Refused."""
    for name in ("background", "conversation"):
        if getattr(body, name):
            raise Refused(
                f"{name} is not served here: replies are answered while the request waits, and a "
                "conversation continues by previous_response_id",
                name,
            )
    try:
        conversation = history + input_messages(body.input, history)
        if not conversation:
            raise ValueError("input holds no message", "input")
        instructions = (
            [{"role": "system", "content": body.instructions}] if body.instructions else []
        )
        return ChatRequest(messages=instructions + conversation, **chat_fields(body)), conversation
    except ValidationError as e:
        first = e.errors()[0]
        where = field_path(first["loc"])
        raise renamed(Refused(f"{where}: {first['msg']}", where)) from None
    except ValueError as e:
        raise Refused(*e.args) from None


class Responses:
    """The /v1/responses route on a completions.Server (its chat_prompt and submit steps, then
    delivery.collect) and the store of recent replies for previous_response_id."""

    def __init__(self, server, max_stored: int):
        self.server, self.max_stored, self.stored = server, max_stored, OrderedDict()

    async def create(self, body: ResponsesRequest, request: Request):
        history = self.history(body.previous_response_id)
        chat, conversation = chat_request(body, history)
        try:
            prompt, tools, constraint = await self.server.chat_prompt(chat)
            rids, events, _ = await self.server.submit(chat, [prompt], True, constraint)
        except Refused as e:
            raise renamed(e) from None
        out = Outputs(
            self.server.tokenizer,
            [prompt],
            1,
            True,
            False,
            False,
            tools,
            chat.parallel_tool_calls,
            channels=tool_format(self.server.tokenizer.chat_template) == "harmony",
        )
        meta = {
            "id": f"resp_{rids[0]}",
            "object": "response",
            "created_at": int(time.time()),
            "model": self.server.model_name,
            **self.echoed(body),
        }
        if body.stream:
            return StreamingResponse(
                self.sse(rids, events, out, meta, conversation, body.store),
                media_type="text/event-stream",
            )
        failed = await collect(self.server.loop, request, rids, events, out)
        if failed:
            return failed
        status, details = ending(out.reasons[0])
        items = self.items(out, status)
        self.keep(meta["id"], conversation + [assistant_message(items)], body.store)
        return JSONResponse(
            {
                **meta,
                "status": status,
                "incomplete_details": details,
                "error": None,
                "output": items,
                "usage": usage(out),
            }
        )

    def history(self, response_id) -> list:
        if response_id is None:
            return []
        if response_id not in self.stored:
            raise Refused(
                f"previous_response_id {response_id!r} was never issued by this server or is no "
                f"longer kept (it keeps the newest {self.max_stored}, --max_stored_responses, and "
                "none sent with store: false)",
                "previous_response_id",
            )
        return self.stored[response_id]

    def keep(self, response_id: str, conversation: list, store: bool):
        if store and self.max_stored:
            self.stored[response_id] = conversation
            while len(self.stored) > self.max_stored:
                self.stored.popitem(last=False)

    @staticmethod
    def echoed(body: ResponsesRequest) -> dict:
        """The request's settings, as a response repeats them."""
        return {
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "tools": body.tools or [],
            "tool_choice": body.tool_choice or "auto",
            "parallel_tool_calls": body.parallel_tool_calls,
            "previous_response_id": body.previous_response_id,
            "store": body.store,
            "text": body.text or {"format": {"type": "text"}},
            "metadata": body.metadata or {},
            "truncation": "disabled",
        }

    @staticmethod
    def items(out: Outputs, status: str) -> list:
        """A whole reply's output items: its text as a message, then its function calls (gpt-oss's
        reasoning is left out: no reasoning items are written)."""
        message, _ = out.message(0)
        content, calls = message["content"], message.get("tool_calls", [])
        items = [message_item(content or "", status)] if content or not calls else []
        return items + [
            call_item(c["id"], c["function"]["name"], c["function"]["arguments"], status)
            for c in calls
        ]

    async def sse(self, rids, events, out: Outputs, meta: dict, conversation: list, store: bool):
        """The reply as Responses events; a client that goes away aborts its request."""
        writer, finished = Events(), False
        response = {
            **meta,
            "status": "in_progress",
            "incomplete_details": None,
            "error": None,
            "output": [],
            "usage": None,
        }
        try:
            yield writer.event("response.created", response=response)
            yield writer.event("response.in_progress", response=response)
            async for event in events_of(rids, events, out):
                if isinstance(event, str):  # the request failed: say so, and end
                    failed = {
                        **response,
                        "status": "failed",
                        "error": {"code": "server_error", "message": event},
                    }
                    yield writer.event("response.failed", response=failed)
                    finished = True
                    return
                _, text, reason = event
                stream = out.streams[0]
                parts = (
                    (stream.feed(text) + (stream.finish() if reason else []))
                    if stream
                    else [("content", text)]
                )
                for e in writer.parts(
                    [p for p in parts if p[0] != "reasoning" and (p[0] != "content" or p[1])]
                ):
                    yield e
            status, details = ending(out.reasons[0])
            # (an empty reply: one empty message)
            for e in writer.parts([] if writer.items else [("content", "")]):
                yield e
            for e in writer.close(status):
                yield e
            finished = True
            self.keep(meta["id"], conversation + [assistant_message(writer.items)], store)
            kind = "response.incomplete" if status == "incomplete" else "response.completed"
            yield writer.event(
                kind,
                response={
                    **response,
                    "status": status,
                    "incomplete_details": details,
                    "output": writer.items,
                    "usage": usage(out),
                },
            )
        finally:
            if not finished:
                for rid in rids:
                    self.server.loop.abort(rid)
