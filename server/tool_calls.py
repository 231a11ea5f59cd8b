"""Tool calling for serve.py's chat endpoint: the request's `tools` reach the model through its
chat template, the calls it writes are parsed back into OpenAI's `message.tool_calls`, and
`tool_choice` "required" or a named function is enforced with a grammar (constrain.py), so the
call always parses.

    python -c "from server import tool_calls"     # library only; serve.py uses it

Three output formats, told apart by the chat template:
  hermes   (Qwen2.5, Hermes, and the default)
           <tool_call>{"name": ..., "arguments": {...}}</tool_call>
  llama3   (a template that speaks of ipython)
           {"name": ..., "parameters": {...}}   (the whole reply)
  harmony  (gpt-oss: <|channel|>)
           a message to=functions.NAME (server/harmony.py parses it)
A template that never mentions `tools` (e.g. SmolLM2's) still gets them: a system message lists
them and asks for the hermes format. tool_choice "none" renders no tools; "auto" lets the model
choose and parses what it wrote.
"""

import json
import re
import uuid

from constrain import JSON_LAYOUT, Constraint

CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def check_tools(tools, tool_choice):
    """ValueError (message, param: "tools" unless given) unless tools are OpenAI function tools
    and tool_choice names one."""
    if not isinstance(tools, list) or not tools:
        raise ValueError("tools must be a non-empty list")
    for t in tools:
        f = t.get("function") if isinstance(t, dict) else None
        if (
            t.get("type") != "function"
            or not isinstance(f, dict)
            or not isinstance(f.get("name"), str)
        ):
            raise ValueError(
                'each tool must be {"type": "function", "function": '
                '{"name": ..., "parameters": {...}}}'
            )
        if not isinstance(f.get("parameters") or {}, dict):
            raise ValueError(f"tool {f['name']}: parameters must be a JSON schema object")
    if isinstance(tool_choice, dict):
        function = tool_choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if name not in names(tools):
            raise ValueError(
                f"tool_choice names {name!r}, which is not among the tools", "tool_choice"
            )
    elif tool_choice not in (None, "auto", "none", "required"):
        raise ValueError(
            'tool_choice must be "auto", "none", "required" or '
            '{"type": "function", "function": {"name"}}',
            "tool_choice",
        )


def names(tools):
    return [t["function"]["name"] for t in tools]


def tool_format(chat_template: str) -> str:
    if chat_template and "<|channel|>" in chat_template:
        return "harmony"  # gpt-oss: calls are messages to functions.NAME (server/harmony.py)
    return "llama3" if chat_template and "ipython" in chat_template else "hermes"


def render_args(messages, tools, tool_choice, chat_template):
    """(messages, extra template variables) for the chat template."""
    if not tools or tool_choice == "none":
        return messages, {}
    if chat_template and "tools" in chat_template:
        return messages, {"tools": tools}
    listing = "\n".join(json.dumps(t["function"]) for t in tools)
    system = (
        "You can call these functions:\n" + listing + "\nTo call one, reply with "
        '<tool_call>{"name": <function name>, "arguments": <arguments as JSON>}</tool_call>'
    )
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": messages[0]["content"] + "\n\n" + system}] + messages[
            1:
        ], {}
    return [{"role": "system", "content": system}] + messages, {}


def legacy_tools(functions, function_call):
    """The legacy `functions` and `function_call` as (tools, tool_choice)."""
    tools = [{"type": "function", "function": f} for f in functions or []]
    if isinstance(function_call, dict):
        return tools, {"type": "function", "function": {"name": function_call.get("name")}}
    return tools, function_call


SCHEMA_MAPS, SCHEMA_LISTS = (
    ("properties", "patternProperties", "$defs", "definitions"),
    ("anyOf", "oneOf", "allOf", "prefixItems"),
)


def strict(schema):
    """A `strict` tool's parameters: no keys beyond the schema's in any object (OpenAI's strict
    mode). Only subschemas are visited: a property named "properties" or an enum's values stay."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: strict(sub) for name, sub in out[key].items()}
    for key in SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [strict(sub) for sub in out[key]]
    for key in ("items", "not", "if", "then", "else", "contains", "additionalItems"):
        if isinstance(out.get(key), dict):
            out[key] = strict(out[key])
    if out.get("type") == "object" or "properties" in out:
        out.setdefault("additionalProperties", False)
    return out


def call_schemas(tools, fmt: str) -> list:
    """One JSON schema per tool for a call to it: {"name": its name, "arguments": its
    parameters}."""
    key = "parameters" if fmt == "llama3" else "arguments"

    def schema_of(f):
        params = f.get("parameters") or {"type": "object"}
        return strict(params) if f.get("strict") else params

    return [
        {
            "type": "object",
            "properties": {"name": {"const": t["function"]["name"]}, key: schema_of(t["function"])},
            "required": ["name", key],
            "additionalProperties": False,
        }
        for t in tools
    ]


def call_constraint(tools, tool_choice, fmt: str, parallel: bool = False, text: Constraint = None):
    """The grammar of what the reply may be, or None. A "required" or named tool_choice: one call
    (with `parallel`, "required" allows one or more: hermes; Llama 3.1's reply is one call).
    "auto" with a JSON text format (`text`, response_format's constraint): calls, or that JSON
    (else the format's grammar would leave no room for a call)."""
    forced = tool_choice == "required" or isinstance(tool_choice, dict)
    if fmt == "harmony" and forced:
        raise ValueError(
            "tool_choice 'required' or a named function is not enforced in gpt-oss's reply format "
            "(harmony); send tool_choice 'auto'",
            "tool_choice",
        )
    if (
        fmt == "harmony"
        or not forced
        and (text is None or text.kind not in ("json_schema", "json_object"))
    ):
        return None
    chosen = [
        t
        for t in tools
        if not isinstance(tool_choice, dict)
        or t["function"]["name"] == tool_choice["function"]["name"]
    ]
    calls = call_schemas(chosen, fmt)
    answer = None
    if not forced:
        answer = json.loads(text.value) if isinstance(text.value, str) else text.value or {}
        answer = answer if text.kind == "json_schema" else {"type": "object"}
    if fmt == "llama3":
        options = calls + ([answer] if answer is not None else [])
        return Constraint(
            "json_schema",
            {
                "x-guidance": JSON_LAYOUT,
                **(options[0] if len(options) == 1 else {"anyOf": options}),
            },
        )
    schema = {"x-guidance": JSON_LAYOUT, **(calls[0] if len(calls) == 1 else {"anyOf": calls})}
    several = parallel and not isinstance(tool_choice, dict)
    grammar = ('start: one ("\\n" one)*' if several else "start: one") + (
        " | answer" if answer is not None else ""
    )
    grammar += '\none: "<tool_call>" call "</tool_call>"\ncall: %json ' + json.dumps(schema)
    if answer is not None:
        grammar += "\nanswer: %json " + json.dumps({"x-guidance": JSON_LAYOUT, **answer})
    return Constraint("grammar", grammar)


def parse_calls(text: str, fmt: str, tools, parallel: bool = True):
    """The reply -> (content or None, [OpenAI tool_call]); text that does not parse stays content.
    Without `parallel`, the first call only (the others are dropped from the content too)."""
    known, found, rest = set(names(tools)), [], text
    if fmt == "llama3":
        try:
            obj = json.loads(text.strip().removeprefix("<|python_tag|>"))
        except ValueError:
            return text, []
        if isinstance(obj, dict) and obj.get("name") in known:
            return None, [_call(obj["name"], obj.get("parameters", obj.get("arguments", {})))]
        return text, []
    for m in CALL.finditer(text):
        try:
            obj = json.loads(m.group(1))
        except ValueError:
            continue
        if isinstance(obj, dict) and obj.get("name") in known:
            found.append(_call(obj["name"], obj.get("arguments", {})))
            rest = rest.replace(m.group(0), "", 1)
    return (rest.strip() or None) if found else text, found if parallel else found[:1]


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call(name, arguments) -> dict:
    return {
        "id": call_id(),
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


OPEN, CLOSE, PYTHON_TAG = "<tool_call>", "</tool_call>", "<|python_tag|>"
HEAD = {
    "hermes": re.compile(r'\s*\{\s*"name"\s*:\s*"([^"\\]*)"\s*,\s*"arguments"\s*:\s*'),
    "llama3": re.compile(
        r'\s*(?:<\|python_tag\|>)?\s*\{\s*"name"\s*:\s*"([^"\\]*)"\s*,'
        r'\s*"(?:parameters|arguments)"\s*:\s*'
    ),
}


class CallStream:
    """A reply's tool calls while it is written, for streaming. feed(text), and finish() when the
    reply ends, return parts: ("content", text), ("call", id, name) when a call's head
    `{"name": ..., "arguments": ` is written, then ("arguments", fragment): the raw text of its
    arguments until their JSON value closes. A call written otherwise (keys in another order) is
    parsed whole when it closes, as parse_calls does; text that never parses stays content.
    Whitespace after content is held until more content follows, so the calls' surroundings trim."""

    def __init__(self, fmt: str, tools, parallel: bool = True):
        self.fmt, self.tools, self.known, self.parallel = fmt, tools, set(names(tools)), parallel
        self.state = "start" if fmt == "llama3" else "text"
        self.pending, self.held, self.calls = (
            "",
            "",
            0,
        )  # text not yet passed on; whitespace after content
        self.depth, self.in_string, self.escaped = 0, False, False  # the arguments' JSON scanner

    def feed(self, text: str) -> list:
        self.pending += text
        parts = []
        while getattr(self, "_" + self.state)(parts):
            pass
        return parts

    def finish(self) -> list:
        parts = []
        if self.state in ("head", "raw"):  # a call that never streamed: parsed whole, or content
            self._whole(parts, self.pending if self.fmt == "llama3" else OPEN + self.pending)
        elif self.state in ("start", "text"):
            self._content(parts, self.pending)
        if not self.calls and self.held:
            parts.append(("content", self.held))
        self.pending, self.held = "", ""
        return parts

    def _content(self, parts, text: str):
        text, self.held = self.held + text, ""
        body = text.rstrip()
        if body:
            parts.append(("content", body))
        self.held = text[len(body) :]

    def _whole(self, parts, text: str):
        content, calls = parse_calls(text, self.fmt, self.tools)
        if content:
            self._content(parts, content)
        for call in calls[: None if self.parallel else 1 - self.calls]:
            self.calls += 1
            parts += [
                ("call", call["id"], call["function"]["name"]),
                ("arguments", call["function"]["arguments"]),
            ]

    def _start(
        self, parts
    ) -> bool:  # llama3: a reply that opens with JSON (or the python tag) may be a call
        head = self.pending.lstrip()
        if not head or PYTHON_TAG.startswith(head) and head != PYTHON_TAG:
            return False
        self.state = "head" if head[0] == "{" or head.startswith(PYTHON_TAG) else "text"
        return True

    def _text(self, parts) -> bool:
        if self.fmt == "llama3":
            self._content(parts, self.pending)
            self.pending = ""
            return False
        at = self.pending.find(OPEN)
        if at < 0:  # keep what may be the start of OPEN
            keep = next(
                (k for k in range(len(OPEN) - 1, 0, -1) if self.pending.endswith(OPEN[:k])), 0
            )
            self._content(parts, self.pending[: len(self.pending) - keep])
            self.pending = self.pending[len(self.pending) - keep :]
            return False
        self._content(parts, self.pending[:at])
        self.pending = self.pending[at + len(OPEN) :]
        self.state = "head"
        return True

    def _head(self, parts) -> bool:
        m = HEAD[self.fmt].match(self.pending)
        if (
            m and m.group(1) in self.known and self.calls and not self.parallel
        ):  # a second call: dropped
            self.state = "tail"
            return True
        if m and m.group(1) in self.known:
            self.calls += 1
            parts.append(("call", call_id(), m.group(1)))
            self.pending, self.state = self.pending[m.end() :], "arguments"
            self.depth, self.in_string, self.escaped = 0, False, False
            return True
        if m or CLOSE in self.pending:
            self.state = "raw"
            return True
        return False

    def _arguments(self, parts) -> bool:
        end, held = None, len(self.pending)
        for j, c in enumerate(self.pending):
            if (
                c == "<" and not self.in_string and self.fmt == "hermes"
            ):  # malformed: the call closes here
                if self.pending.startswith(CLOSE, j):
                    end = j
                    break
                if CLOSE.startswith(self.pending[j:]):  # maybe CLOSE, cut by the feed
                    held = j
                    break
            if self.escaped:
                self.escaped = False
            elif self.in_string:
                self.escaped, self.in_string = c == "\\", c != '"'
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]" or (c == "," and self.depth == 0):
                self.depth -= c != ","
                if self.depth <= 0:
                    end = j + (c != "," and self.depth == 0)
                    break
        fragment = self.pending[:held] if end is None else self.pending[:end]
        if fragment:
            parts.append(("arguments", fragment))
        self.pending = self.pending[held:] if end is None else self.pending[end:]
        if end is not None:
            self.state = "tail"
        return end is not None

    def _tail(self, parts) -> bool:  # the rest of the call, up to and with its CLOSE
        at = -1 if self.fmt == "llama3" else self.pending.find(CLOSE)
        if at < 0:
            self.pending = self.pending[-len(CLOSE) :] if self.fmt == "hermes" else ""
            return False
        self.pending, self.state = self.pending[at + len(CLOSE) :], "text"
        return True

    def _raw(self, parts) -> bool:
        at = self.pending.find(CLOSE)
        if at < 0:
            return False
        self._whole(parts, OPEN + self.pending[: at + len(CLOSE)])
        self.pending, self.state = self.pending[at + len(CLOSE) :], "text"
        return True
