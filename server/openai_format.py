"""OpenAI's wire format for serve.py: the request bodies (null is absent, unknown fields
ignored), what their fields cannot check alone (refusal, constraint_of, logprob_counts), the
error object, and prompts to token ids. A response's choices, usage and log-probabilities in both
shapes (completions' legacy arrays, chat's list of token objects) are server/choices.py's.

    python -c "from server import openai_format"     # library only; serve.py is the server
"""

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictInt, model_validator

from runtime import log

# Fields of OpenAI's API accepted and ignored without a log line: they change nothing here.
IGNORED = {
    "user",
    "store",
    "metadata",
    "service_tier",
    "reasoning_effort",
    "reasoning",
    "prompt_cache_key",
    "safety_identifier",
    "include",
    "truncation",
    "verbosity",
    "modalities",
    "prediction",
}
# unknown field names logged so far (at most 100: a hostile client sends many)
UNKNOWN_LOGGED = set()


class Body(BaseModel):
    """A request body or part of one. null is absent (OpenAI's spec marks its optional fields
    nullable and clients send them: LangChain's `"seed": null`); unknown fields are ignored, as
    OpenAI's own server ignores them, and each name is logged once."""

    # allow_inf_nan: JSON's 1e400 parses as infinity, and Python's parser takes NaN and Infinity
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data):
        if not isinstance(data, dict):
            return data
        known = cls.model_fields
        for key in sorted(data.keys() - known.keys() - IGNORED - UNKNOWN_LOGGED)[
            : 100 - len(UNKNOWN_LOGGED)
        ]:
            UNKNOWN_LOGGED.add(key)
            log(f"ignoring the unknown request field {str(key)[:80]!r} (logged once)")
        return {k: v for k, v in data.items() if v is not None or k not in known}


class Sampling(Body):
    """Fields both endpoints share."""

    model: str = None
    max_tokens: int = Field(None, ge=0)  # 0 only with echo (completions): score the prompt
    temperature: float = Field(1.0, ge=0, le=2)  # OpenAI's range, as /v1/responses has it
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(None, ge=1)  # an extension
    # an extension, as are top_k and repetition_penalty (sampling.py)
    min_p: float = Field(0.0, ge=0, le=1)
    repetition_penalty: float = Field(1.0, gt=0)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: dict[str, float] = None  # {"token id": bias}; JSON keys are strings
    n: int = Field(1, ge=1)
    stop: str | list[str] = None
    seed: int = Field(None, ge=-(2**63), lt=2**63)  # what torch.Generator takes
    stream: bool = False
    stream_options: dict = None
    ignore_eos: bool = False  # an extension, for benchmarks
    priority: int = 0  # vLLM's extension: lower first, with --schedule_policy priority
    # {"type": "text" | "json_object" | "json_schema", "json_schema": {...}}
    response_format: dict = None
    # vLLM's extension: one of json, json_object, regex, choice, grammar
    structured_outputs: dict = None


class CompletionRequest(Sampling):
    # one prompt, or several (ids: not booleans)
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    logprobs: int = Field(None, ge=0, le=20)  # the chosen token's and this many alternatives
    echo: bool = False  # the prompt's text and log-probabilities first
    suffix: str = None  # refused unless empty: text after the completion (insertion) is not served
    best_of: int = None  # refused above 1: the best of several samples is not picked here (n is)


class TextPart(Body):
    type: str
    text: str = None


class Message(Body):
    role: str
    content: str | list[TextPart] = ""
    tool_calls: list[dict] = None  # an assistant's earlier calls
    tool_call_id: str = None  # a tool's reply: the call it answers
    name: str = None
    function_call: dict = None  # the legacy form of one tool call (read as tool_calls)

    def text(self) -> str:
        """content as one string; a list of parts must be all text."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        if any(p.type != "text" or p.text is None for p in self.content):
            raise ValueError(
                'only text content parts ({"type": "text", "text": ...}) are supported'
            )
        return "".join(p.text for p in self.content)


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int = Field(None, ge=1)  # the newer name of max_tokens
    logprobs: bool = False
    top_logprobs: int = Field(None, ge=0, le=20)
    tools: list[dict] = None  # OpenAI function tools (server/tool_calls.py)
    tool_choice: str | dict = None
    parallel_tool_calls: bool = True  # "required" may then write several calls
    # the legacy form of tools and tool_choice (tool_calls.legacy_tools)
    functions: list[dict] = None
    function_call: str | dict = None


def template_messages(body) -> list:
    """The chat messages as the template sees them (dicts, content as text); ValueError if bad.
    The legacy forms become today's: an assistant's `function_call` its one tool call, a
    "function" message a "tool" message."""
    messages = []
    for m in body.messages:
        message = m.model_dump(exclude_none=True, exclude={"function_call"}) | {"content": m.text()}
        if m.function_call is not None:
            message["tool_calls"] = [
                {"id": "call_legacy", "type": "function", "function": m.function_call}
            ]
        if m.role == "function":
            message |= {"role": "tool", "tool_call_id": "call_legacy"}
        messages.append(message)
    return messages


def refusal(body, chat: bool):
    """What the models' field checks cannot say: (message, param) or None."""
    if chat:
        if body.top_logprobs is not None and not body.logprobs:
            return "top_logprobs needs logprobs: true", "top_logprobs"
        if body.max_tokens == 0:
            return "max_tokens must be >= 1", "max_tokens"
        return None
    if body.suffix:
        return (
            "suffix (text after the completion) is not supported; send the prompt alone",
            "suffix",
        )
    if body.best_of is not None and body.best_of > 1:
        return "best_of is not supported; n returns several samples", "best_of"
    if body.echo and body.stream:
        return "echo is not supported with stream; send the request without stream", "echo"
    if body.max_tokens == 0 and not body.echo:
        return (
            "max_tokens 0 generates nothing; it is allowed only with echo (to score the prompt)",
            "max_tokens",
        )
    if body.prompt == [] or body.prompt == [[]]:
        return "the prompt list is empty", "prompt"
    return None


def constraint_of(body):
    """The request's output constraint (constrain.Constraint) or None; ValueError (message,
    param)."""
    from constrain import Constraint

    fmt, extra = body.response_format, body.structured_outputs
    if fmt and extra:
        raise ValueError("send response_format or structured_outputs, not both", "response_format")
    try:
        if fmt:
            kind = fmt.get("type")
            if kind == "text":
                return None
            if kind == "json_object":
                return Constraint("json_object")
            if kind == "json_schema":
                spec = fmt.get("json_schema")
                if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
                    raise ValueError(
                        'json_schema must be {"name": ..., "schema": {...}, "strict": ...}'
                    )
                return Constraint("json_schema", spec.get("schema", {}))
            raise ValueError(
                f"response_format type must be text, json_object or json_schema, got {kind!r}"
            )
        if extra:
            given = {k: v for k, v in extra.items() if v is not None and v is not False}
            if len(given) != 1 or next(iter(given)) not in STRUCTURED:
                raise ValueError(f"structured_outputs takes exactly one of {', '.join(STRUCTURED)}")
            key, value = next(iter(given.items()))
            return Constraint(STRUCTURED[key], None if key == "json_object" else value)
    except ValueError as e:
        raise ValueError(str(e), "response_format" if fmt else "structured_outputs") from None
    return None


STRUCTURED = {
    "json": "json_schema",
    "json_object": "json_object",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
}  # vLLM's structured_outputs keys -> constrain.py's kinds


def logprob_counts(body, chat: bool):
    """(alternatives per output token or None, alternatives per prompt token or None)."""
    if chat:
        return (body.top_logprobs or 0) if body.logprobs else None, None
    return body.logprobs, ((body.logprobs or 0) if body.echo else None)


class Refused(Exception):
    """An error response (400 unless given) before anything is queued: a step raises it, the app
    sends it."""

    def __init__(self, message: str, param: str = None, response=None):
        super().__init__(message)
        self.param = param
        self.response = response if response is not None else error(400, message, param=param)


# pydantic's names for the member of a union a value failed ("input.str", "prompt.list[int]")
UNION_MEMBERS = {"str", "int", "float", "bool", "dict", "list", "none", "bytes"}


def field_path(loc) -> str:
    """A validation error's location as the request's field path: "messages.0.role", "input"
    (never "input.str": the union member pydantic tried is not a field)."""
    return ".".join(
        str(p)
        for p in loc
        if isinstance(p, int) or not ("[" in p or "-" in p or p in UNION_MEMBERS)
    )


def error(
    status: int,
    message: str,
    kind: str = "invalid_request_error",
    param: str = None,
    headers=None,
    code: str = None,
):
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def unavailable(message: str):
    return error(503, message, "service_unavailable", headers={"Retry-After": "1"})


def prompt_list(prompt) -> list:
    """A completions `prompt` (text, ids, or a list of either) -> a list of prompts."""
    return (
        list(prompt)
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list))
        else [prompt]
    )


def encode(tokenizer, text: str, bos: bool = None, messages=None) -> list:
    """The ids of a prompt, or of a rendered chat (messages: what it was rendered from; a special
    token's literal in their content stays text: tokenizer.encode_rendered)."""
    try:
        text.encode("utf-8")
    except (
        UnicodeEncodeError
    ) as e:  # a lone surrogate ("\ud800") that JSON allows and UTF-8 does not
        raise ValueError(
            f"the text is not valid Unicode ({e.reason} at character {e.start})"
        ) from None
    return (
        tokenizer.encode(text, bos=bos)
        if messages is None
        else tokenizer.encode_rendered(text, messages)
    )


class TokenizeRequest(Body):  # vLLM's /tokenize: a prompt, or chat messages
    model: str = None
    prompt: str = None
    messages: list[Message] = None
    add_special_tokens: bool = True


class DetokenizeRequest(Body):
    model: str = None
    tokens: list[StrictInt]
