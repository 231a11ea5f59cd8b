"""One response's choices while its tokens arrive (`Outputs`): each choice's text, tool calls
(server/tool_calls.py; gpt-oss's channels, server/harmony.py) and log-probabilities, as a whole
choice or as streamed deltas, in OpenAI's completions and chat shapes. server/completions.py
and server/responses.py fill one per response.

    out = Outputs(tokenizer, prompts, n, chat, logprobs, echo)
    out.add(i, token, text, reason, entry)   # each token choice i receives (engine_loop feeds it)
    out.delta(i, text, reason)               # a streamed chunk's choice, or None
    out.choice(i), out.usage()               # a whole response's choice i, its token counts

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

from server import harmony
from server.tool_calls import CallStream, call_id, parse_calls

CONTEXT_TOKENS = 4  # tokens decoded before a token to find the text it adds


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
        # several calls allowed; the legacy function_call form
        self.parallel, self.legacy = parallel, legacy
        # gpt-oss's channels: final -> content, analysis -> reasoning_content
        self.harmony = channels and chat
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
        # each choice's text, in the pieces that arrived
        self.pieces = [[] for _ in range(self.num_choices)]
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
