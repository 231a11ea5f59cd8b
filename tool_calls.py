"""Tool calling for serve.py's chat endpoint: the request's `tools` reach the model through its
chat template, the calls it writes are parsed back into OpenAI's `message.tool_calls`, and
`tool_choice` "required" or a named function is enforced with a grammar (constrain.py), so the
call always parses.

    python -c "import tool_calls"     # library only; serve.py uses it

Two output formats, told apart by the chat template:
  hermes   (Qwen2.5, Hermes, and the default)   <tool_call>{"name": ..., "arguments": {...}}</tool_call>
  llama3   (a template that speaks of ipython)  {"name": ..., "parameters": {...}}   (the whole reply)
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
    """ValueError (message) unless tools are OpenAI function tools and tool_choice names one."""
    if not isinstance(tools, list) or not tools:
        raise ValueError("tools must be a non-empty list")
    for t in tools:
        f = t.get("function") if isinstance(t, dict) else None
        if t.get("type") != "function" or not isinstance(f, dict) or not isinstance(f.get("name"), str):
            raise ValueError('each tool must be {"type": "function", "function": {"name": ..., "parameters": {...}}}')
        if not isinstance(f.get("parameters", {}), dict):
            raise ValueError(f"tool {f['name']}: parameters must be a JSON schema object")
    if isinstance(tool_choice, dict):
        function = tool_choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if name not in names(tools):
            raise ValueError(f"tool_choice names {name!r}, which is not among the tools")
    elif tool_choice not in (None, "auto", "none", "required"):
        raise ValueError('tool_choice must be "auto", "none", "required" or {"type": "function", "function": {"name"}}')


def names(tools):
    return [t["function"]["name"] for t in tools]


def tool_format(chat_template: str) -> str:
    return "llama3" if chat_template and "ipython" in chat_template else "hermes"


def render_args(messages, tools, tool_choice, chat_template):
    """(messages, extra template variables) for the chat template."""
    if not tools or tool_choice == "none":
        return messages, {}
    if chat_template and "tools" in chat_template:
        return messages, {"tools": tools}
    listing = "\n".join(json.dumps(t["function"]) for t in tools)
    system = ("You can call these functions:\n" + listing + "\nTo call one, reply with "
              '<tool_call>{"name": <function name>, "arguments": <arguments as JSON>}</tool_call>')
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": messages[0]["content"] + "\n\n" + system}] + messages[1:], {}
    return [{"role": "system", "content": system}] + messages, {}


def call_constraint(tools, tool_choice, fmt: str):
    """The grammar a "required" or named tool_choice imposes, or None."""
    if tool_choice != "required" and not isinstance(tool_choice, dict):
        return None
    chosen = [t for t in tools if not isinstance(tool_choice, dict) or t["function"]["name"] == tool_choice["function"]["name"]]
    key = "parameters" if fmt == "llama3" else "arguments"
    calls = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                               key: t["function"].get("parameters") or {"type": "object"}},
              "required": ["name", key], "additionalProperties": False} for t in chosen]
    schema = {"x-guidance": JSON_LAYOUT, **(calls[0] if len(calls) == 1 else {"anyOf": calls})}
    if fmt == "llama3":
        return Constraint("json_schema", schema)
    return Constraint("grammar", 'start: "<tool_call>" call "</tool_call>"\ncall: %json ' + json.dumps(schema))


def parse_calls(text: str, fmt: str, tools):
    """The reply -> (content or None, [OpenAI tool_call]); text that does not parse stays content."""
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
    return (rest.strip() or None) if found else text, found


def _call(name, arguments) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}
