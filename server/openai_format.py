"""OpenAI's wire format for serve.py: the request bodies, the error object, choices, usage, and
log-probabilities in both shapes (completions' legacy arrays, chat's list of token objects).

    python -c "from server import openai_format"     # library only; serve.py is the server

Log-probabilities are the model's own: log_softmax of the raw logits, before temperature,
penalties and top-k/top-p (scoring.token_logprobs), as HF transformers computes them. A token's
text is what it adds in context (the text of the few tokens before it with and without it), so a
SentencePiece token keeps its leading space and the texts of an output's tokens join to its text.

    completions  "logprobs": {"tokens": [str], "token_logprobs": [float | None],
                              "top_logprobs": [{text: logprob} | None], "text_offset": [int]}
    chat         "logprobs": {"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}

With `echo`, a completion's text and arrays start with the prompt's; the first prompt token has
no log-probability (null), and `max_tokens: 0` scores a prompt without generating.
"""

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictInt, model_validator

from runtime import log
from server import harmony
from server.tool_calls import CallStream, call_id, parse_calls

CONTEXT_TOKENS = 4  # tokens decoded before a token to find the text it adds
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
UNKNOWN_LOGGED = (
    set()
)  # unknown field names logged so far (at most 100: a hostile client sends many)


class Body(BaseModel):
    """A request body or part of one. null is absent (OpenAI's spec marks its optional fields
    nullable and clients send them: LangChain's `"seed": null`); unknown fields are ignored, as
    OpenAI's own server ignores them, and each name is logged once."""

    model_config = ConfigDict(extra="ignore")

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
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(None, ge=1)  # an extension
    min_p: float = Field(
        0.0, ge=0, le=1
    )  # an extension, as are top_k and repetition_penalty (sampling.py)
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
    response_format: dict = (
        None  # {"type": "text" | "json_object" | "json_schema", "json_schema": {...}}
    )
    structured_outputs: dict = (
        None  # vLLM's extension: one of json, json_object, regex, choice, grammar
    )


class CompletionRequest(Sampling):
    prompt: (
        str | list[StrictInt] | list[str] | list[list[StrictInt]]
    )  # one prompt, or several (ids: not booleans)
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
    functions: list[dict] = (
        None  # the legacy form of tools and tool_choice (tool_calls.legacy_tools)
    )
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


# -- log-probabilities -----------------------------------------------------------------------------
def token_texts(tokenizer, ids, start: int = 0, alternatives=None):
    """The text each of ids[start:] adds after the tokens before it; with alternatives (per token,
    [(id, logprob)]), also [(text, logprob)] of each alternative in the same place. A token that
    ends inside a character adds "" and the token completing it adds the whole character, so the
    texts join to the decoded text."""

    def complete(text):  # without a trailing incomplete character
        return text.rstrip("\ufffd")

    texts, tops = [], []
    for i in range(start, len(ids)):
        context = list(ids[max(0, i - CONTEXT_TOKENS) : i])
        before = complete(tokenizer.decode(context)) if context else ""

        def added(t):
            full = complete(tokenizer.decode(context + [t]))
            return full[len(before) :] if full.startswith(before) else full

        texts.append(added(ids[i]))
        if alternatives is not None:
            alt = alternatives[i - start]
            tops.append(None if alt is None else [(added(t), lp) for t, lp in alt])
    return texts, tops


def likeliest_per_text(pairs) -> dict:
    """[(text, logprob)] most likely first -> {text: logprob}; two tokens of one text keep the
    first."""
    top = {}
    for text, logprob in pairs:
        top.setdefault(text, logprob)
    return top


def completion_logprobs(tokenizer, ids, entries, start: int = 0, offset: int = 0) -> dict:
    """Completions' arrays for ids[start:], entries [(logprob, [(id, logprob)]) or None] one per
    token; text_offset counts from `offset` in the choice's text."""
    texts, tops = token_texts(tokenizer, ids, start, [e and e[1] for e in entries])
    tops = [None if top is None else likeliest_per_text(top) for top in tops]
    offsets = []
    for t in texts:
        offsets.append(offset)
        offset += len(t)
    return {
        "tokens": texts,
        "token_logprobs": [e and e[0] for e in entries],
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def chat_logprobs(tokenizer, ids, entries, start: int = 0) -> dict:
    """Chat's {"content": [...]} for ids[start:] (output tokens only)."""
    texts, tops = token_texts(tokenizer, ids, start, [e[1] for e in entries])

    def item(text, logprob):
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", "replace"))}

    return {
        "content": [
            {**item(t, e[0]), "top_logprobs": [item(a, lp) for a, lp in top]}
            for t, e, top in zip(texts, entries, tops)
        ]
    }


class TokenizeRequest(Body):  # vLLM's /tokenize: a prompt, or chat messages
    model: str = None
    prompt: str = None
    messages: list[Message] = None
    add_special_tokens: bool = True


class DetokenizeRequest(Body):
    model: str = None
    tokens: list[StrictInt]


# -- one response's choices ------------------------------------------------------------------------
class Outputs:
    """The choices of one response while its tokens arrive: choice i is sample i % n of prompt
    i // n. Holds each choice's text (as the engine decoded it: engine.Token's text), token ids and
    log-probability entries."""

    def __init__(
        self,
        tokenizer,
        prompts,
        n: int,
        chat: bool,
        logprobs: bool,
        echo: bool,
        tools=None,
        parallel: bool = True,
        legacy: bool = False,
        channels: bool = False,
    ):
        self.tokenizer, self.prompts, self.n, self.chat = tokenizer, prompts, n, chat
        self.logprobs, self.echo = logprobs, echo
        self.tools = tools  # (format, tools) when the reply may hold tool calls
        self.parallel, self.legacy = (
            parallel,
            legacy,
        )  # several calls allowed; the legacy function_call form
        self.harmony = (
            channels and chat
        )  # gpt-oss's channels: final -> content, analysis -> reasoning_content
        self.num_choices = len(prompts) * n
        self.streams = [
            harmony.HarmonyStream(bool(tools), parallel)
            if self.harmony
            else CallStream(*tools, parallel)
            if tools
            else None
            for _ in range(self.num_choices)
        ]
        self.calls_sent = [0] * self.num_choices
        self.cached_tokens = 0  # prompt tokens whose K/V came from the prefix cache
        self.pieces = [
            [] for _ in range(self.num_choices)
        ]  # each choice's text, in the pieces that arrived
        self.reasons = [None] * self.num_choices
        self.ids = [[] for _ in range(self.num_choices)]
        self.entries = [[] for _ in range(self.num_choices)]
        self.prompt_logprobs = {}  # prompt index -> its entries, once its request is over
        self.prompt_arrays = {}  # prompt index -> its completions-shaped log-probabilities (echo)
        self.sent = [0] * self.num_choices  # tokens whose log-probabilities were streamed
        self.offset = [0] * self.num_choices  # characters streamed

    def add(self, i: int, token, text: str, reason, entry) -> str:
        """A token (or a sample's end: token None) arrived with the text it made final; returns
        it."""
        if token is not None:
            self.ids[i].append(token)
            self.entries[i].append(entry)
        self.pieces[i].append(text)
        self.reasons[i] = reason or self.reasons[i]
        return text

    def over(self, event):
        """One request (prompt) is over (engine_loop.Over)."""
        self.prompt_logprobs[event.first // self.n] = event.prompt_logprobs
        self.cached_tokens += event.cached_tokens

    def text(self, i: int) -> str:
        return "".join(self.pieces[i])

    def usage(self) -> dict:
        prompt = sum(len(p) for p in self.prompts)
        completion = sum(len(ids) for ids in self.ids)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }

    def _logprobs(self, i: int, first: int, offset: int):
        """Log-probabilities of choice i's output tokens from the first-th on."""
        prompt = self.prompts[i // self.n]
        ids, entries = prompt + self.ids[i], self.entries[i][first:]
        if self.chat:
            return chat_logprobs(self.tokenizer, ids, entries, len(prompt) + first)
        return completion_logprobs(self.tokenizer, ids, entries, len(prompt) + first, offset)

    def choice(self, i: int) -> dict:
        """Choice i of a whole (not streamed) response."""
        if self.chat:
            message, reason = self.message(i)
            body = {
                "message": message,
                "logprobs": self._logprobs(i, 0, 0) if self.logprobs else None,
            }
            return {"index": i, **body, "finish_reason": reason}
        text, logprobs = self.text(i), None
        if self.echo:
            prompt = self.prompts[i // self.n]
            head = self.tokenizer.decode(prompt)
            text = head + text
            if self.logprobs:
                logprobs = {k: list(v) for k, v in self._prompt_logprobs(i // self.n).items()}
                for key, values in self._logprobs(i, 0, len(head)).items():
                    logprobs[key] += values
        elif self.logprobs:
            logprobs = self._logprobs(i, 0, 0)
        return {"index": i, "text": text, "logprobs": logprobs, "finish_reason": self.reasons[i]}

    def _prompt_logprobs(self, p: int) -> dict:
        """Prompt p's arrays, built once for all its n choices (a request aborted while prefilling
        has fewer scores than tokens)."""
        if p not in self.prompt_arrays:
            prompt, scores = self.prompts[p], self.prompt_logprobs.get(p) or [None]
            self.prompt_arrays[p] = completion_logprobs(
                self.tokenizer, prompt, scores + [None] * (len(prompt) - len(scores))
            )
        return self.prompt_arrays[p]

    def message(self, i: int):
        """Choice i's chat message and finish_reason, its tool calls parsed out when tools were
        given (and gpt-oss's reasoning, server/harmony.py)."""
        message, calls = {"role": "assistant", "content": self.text(i)}, []
        if self.harmony:
            reply = harmony.parse(self.text(i))
            message["content"] = reply["content"]
            if reply["reasoning"]:
                message["reasoning_content"] = reply["reasoning"]
            calls = (
                [
                    {
                        "id": call_id(),
                        "type": "function",
                        "function": {"name": name, "arguments": arguments},
                    }
                    for name, arguments in reply["calls"]
                ]
                if self.tools
                else []
            )
            calls = calls if self.parallel else calls[:1]
        elif self.tools:
            message["content"], calls = parse_calls(
                self.text(i), *self.tools, parallel=self.parallel
            )
        if not calls:
            return message, self.reasons[i]
        if self.legacy:  # the one call of the legacy `function_call`
            return {**message, "function_call": calls[0]["function"]}, "function_call"
        return {**message, "tool_calls": calls}, "tool_calls"

    def delta(self, i: int, text: str, reason) -> dict:
        """A streamed chunk's choice: the new text (with tools: its content and tool-call parts) and
        the log-probabilities of the tokens since the last; None when nothing is new."""
        delta = {"content": text}
        if self.chat and self.streams[i] is not None:
            parts = self.streams[i].feed(text) + (self.streams[i].finish() if reason else [])
            delta = self._call_delta(i, parts)
            if reason and self.streams[i].calls:
                reason = "function_call" if self.legacy else "tool_calls"
            if not delta and not reason:
                return None
        logprobs = None
        if self.logprobs:
            logprobs = self._logprobs(i, self.sent[i], self.offset[i])
            self.sent[i] = len(self.ids[i])
        self.offset[i] += len(text)
        if self.chat:
            return {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        return {"index": i, "text": text, "logprobs": logprobs, "finish_reason": reason}

    def _call_delta(self, i: int, parts) -> dict:
        """CallStream parts as one chat delta: content, and OpenAI's tool_calls deltas (a call's id
        and name first, then fragments of its arguments), or the legacy function_call's."""
        delta, calls = {}, []
        for kind, *value in parts:
            if kind in ("content", "reasoning"):  # (reasoning: gpt-oss's analysis channel)
                key = "content" if kind == "content" else "reasoning_content"
                delta[key] = delta.get(key, "") + value[0]
            elif kind == "call":
                self.calls_sent[i] += 1
                calls.append(
                    {
                        "index": self.calls_sent[i] - 1,
                        "id": value[0] or call_id(),
                        "type": "function",
                        "function": {"name": value[1], "arguments": ""},
                    }
                )
            elif calls and calls[-1]["index"] == self.calls_sent[i] - 1:
                calls[-1]["function"]["arguments"] += value[0]
            else:
                calls.append({"index": self.calls_sent[i] - 1, "function": {"arguments": value[0]}})
        if calls and self.legacy:
            first = [c["function"] for c in calls if c["index"] == 0]
            if first:
                delta["function_call"] = {k: "".join(f.get(k, "") for f in first) for k in first[0]}
        elif calls:
            delta["tool_calls"] = calls
        return delta
