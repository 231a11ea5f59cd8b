r"""A Responses reply (server/responses.py) as output items: a message item for its text, a
function_call item per tool call, its status and usage; whole, or written as OpenAI's Responses
events while it streams (`Events`, each event numbered).

    writer = Events()
    writer.event("response.created", response=response)        # 'event: ...\ndata: {...}\n\n'
    for e in writer.parts([("content", "Hel"), ("content", "lo")]): ...  # item added, deltas
    for e in writer.close("completed"): ...                     # text done, item done
    assistant_message(writer.items)     # the items as the chat message a later turn sees
"""

import json
import uuid

from server.choices import Outputs
from server.tool_calls import call_id


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
        data = json.dumps({"type": kind, "sequence_number": self.seq - 1, **fields})
        return f"event: {kind}\ndata: {data}\n\n"

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
                # (harmony: no id)
                yield from self._add(call_item(value[0] or call_id(), value[1], "", "in_progress"))
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
