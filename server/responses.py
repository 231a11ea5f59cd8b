"""OpenAI's Responses API (`POST /v1/responses`) on serve.py's chat path: the request becomes a
chat request, runs through the same steps (limits, chat template, tool grammar, engine, aborts,
draining), and its reply is written back as output items, whole or as Responses events.

    python -c "from server import responses"     # library only; serve.py routes /v1/responses here

    input items                         chat messages
      "text" or {"role", "content"}       user / assistant / system ("developer" is system)
      {"type": "function_call"}           an assistant message's tool_calls (call_id is the call's id)
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

`previous_response_id` continues a conversation: each reply (unless `store: false`) is kept in
memory with the messages that led to it, the newest `--max_stored_responses` of them; an id never
issued, or evicted, is a 400 naming the field.
"""

import json
import time
import uuid
from collections import OrderedDict

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import Field, ValidationError

from server.engine_loop import events_of
from server.openai_format import Body, ChatRequest, Outputs, Refused
from server.tool_calls import call_id, tool_format

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
    tools: list[dict] = (
        None  # [{"type": "function", "name", "description", "parameters", "strict"}]
    )
    tool_choice: str | dict = None  # "auto" | "none" | "required" | {"type": "function", "name"}
    parallel_tool_calls: bool = True
    text: dict = (
        None  # {"format": {"type": "text" | "json_object" | "json_schema", "name", "schema"}}
    )
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
            if not isinstance(item.get("role"), str) or item["role"] not in ROLES:
                raise ValueError(
                    f"{where}.role must be one of {', '.join(ROLES)}, got {item.get('role')!r}",
                    f"{where}.role",
                )
            messages.append(
                {"role": ROLES[item["role"]], "content": text_of(item.get("content"), where)}
            )
        elif kind == "function_call":
            for key in ("call_id", "name", "arguments"):
                if not isinstance(item.get(key), str):
                    raise ValueError(f"{where}.{key} must be a string", f"{where}.{key}")
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            calls.add(item["call_id"])
            if (
                messages and messages[-1]["role"] == "assistant"
            ):  # the calls of one reply: one message
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
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
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": item["call_id"],
                    "content": output
                    if isinstance(output, str)
                    else text_of(output, f"{where}.output"),
                }
            )
        elif (
            not isinstance(kind, str) or kind != "reasoning"
        ):  # (another model's reasoning, sent back by a client: not for this one)
            raise ValueError(
                f"{where}.type: unknown input item type {kind!r}; this server takes message, "
                "function_call and function_call_output items",
                f"{where}.type",
            )
    return messages


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
                'tool_choice must be "auto", "none", "required" or {"type": "function", "name": ...}',
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
        where = ".".join(str(p) for p in first["loc"])
        raise renamed(Refused(f"{where}: {first['msg']}", where)) from None
    except ValueError as e:
        raise Refused(*e.args) from None


# -- the reply as output items ---------------------------------------------------------------------
def text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(text: str = None, status: str = "completed") -> dict:
    """A message item: with its text, or (text None) with no content part yet, as streaming adds
    it."""
    return {
        "type": "message",
        "id": f"msg_{uuid.uuid4().hex}",
        "status": status,
        "role": "assistant",
        "content": [] if text is None else [text_part(text)],
    }


def call_item(call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {
        "type": "function_call",
        "id": f"fc_{uuid.uuid4().hex}",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def assistant_message(items) -> dict:
    """Output items as the chat message a later turn's template sees."""
    text = "".join(p["text"] for it in items if it["type"] == "message" for p in it["content"])
    calls = [
        {
            "id": it["call_id"],
            "type": "function",
            "function": {"name": it["name"], "arguments": it["arguments"]},
        }
        for it in items
        if it["type"] == "function_call"
    ]
    return {"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}


def usage(out: Outputs) -> dict:
    prompt, output = len(out.prompts[0]), len(out.ids[0])
    return {
        "input_tokens": prompt,
        "output_tokens": output,
        "total_tokens": prompt + output,
        "input_tokens_details": {
            "cached_tokens": out.cached_tokens,
            "cache_write_tokens": prompt - out.cached_tokens,
        },
        "output_tokens_details": {"reasoning_tokens": 0},
    }


def ending(reason) -> tuple:
    """(status, incomplete_details) for a finish_reason."""
    if reason in ("length", "abort"):  # cut by max_output_tokens, or by the server shutting down
        return "incomplete", {"reason": "max_output_tokens"} if reason == "length" else None
    return "completed", None


class Events:
    """Responses' server-sent events for one streamed reply: the output items as CallStream parts
    arrive (server/tool_calls.py), each event numbered."""

    def __init__(self):
        self.seq, self.items, self.open = 0, [], None  # the item being written, if any

    def event(self, kind: str, **fields) -> str:
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': self.seq - 1, **fields})}\n\n"

    def parts(self, parts):
        """Events for ("content", text), ("call", id, name) and ("arguments", fragment) parts."""
        for kind, *value in parts:
            if kind == "content" and (self.open is None or self.open["type"] != "message"):
                yield from self.close()
                yield from self._add(message_item(None, "in_progress"))
                self.open["content"].append(text_part(""))
                yield self.event(
                    "response.content_part.added", **self._at(), content_index=0, part=text_part("")
                )
            if kind == "content":
                self.open["content"][0]["text"] += value[0]
                yield self.event(
                    "response.output_text.delta",
                    **self._at(),
                    content_index=0,
                    delta=value[0],
                    logprobs=[],
                )
            elif kind == "call":
                yield from self.close()
                yield from self._add(
                    call_item(value[0] or call_id(), value[1], "", "in_progress")
                )  # (harmony: no id)
            elif self.open is not None and self.open["type"] == "function_call":
                self.open["arguments"] += value[0]
                yield self.event(
                    "response.function_call_arguments.delta", **self._at(), delta=value[0]
                )

    def close(self, status: str = "completed"):
        """Events that end the item being written, with its status."""
        item, self.open = self.open, None
        if item is None:
            return
        at = {"item_id": item["id"], "output_index": len(self.items) - 1}
        if item["type"] == "message":
            part = item["content"][0]
            yield self.event(
                "response.output_text.done", **at, content_index=0, text=part["text"], logprobs=[]
            )
            yield self.event("response.content_part.done", **at, content_index=0, part=part)
        else:
            yield self.event(
                "response.function_call_arguments.done",
                **at,
                name=item["name"],
                arguments=item["arguments"],
            )
        item["status"] = status
        yield self.event("response.output_item.done", output_index=len(self.items) - 1, item=item)

    def _add(self, item):
        self.items.append(item)
        self.open = item
        yield self.event("response.output_item.added", output_index=len(self.items) - 1, item=item)

    def _at(self) -> dict:
        return {"item_id": self.open["id"], "output_index": len(self.items) - 1}


class Responses:
    """The /v1/responses route on a serve.Server (its chat_prompt, submit and collect steps) and
    the store of recent replies for previous_response_id."""

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
        failed = await self.server.collect(request, rids, events, out)
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
                f"previous_response_id {response_id!r} was never issued by this server or is no longer "
                f"kept (it keeps the newest {self.max_stored}, --max_stored_responses, and none sent "
                "with store: false)",
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
            for e in writer.parts(
                [] if writer.items else [("content", "")]
            ):  # (an empty reply: one empty message)
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
