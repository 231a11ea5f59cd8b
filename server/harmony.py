"""gpt-oss's reply format (harmony): messages on channels, split into what a chat client shows.

gpt-oss writes its reply as messages, each a header and a body between special tokens; the
prompt ends with `<|start|>assistant`, so the first header continues that one:

    reasoning:    <|channel|>analysis<|message|>The user asks for 2 + 2.<|end|>
    the answer:   <|start|>assistant<|channel|>final<|message|>4<|return|>
    a tool call:
        <|start|>assistant to=functions.add<|channel|>commentary json<|message|>{"a": 2}<|call|>

A header names the role, the channel (analysis, commentary, final) and perhaps a recipient
(`to=functions.NAME`, before or after the channel); `<|end|>` closes a message, `<|return|>` and
`<|call|>` close the reply (they are stop tokens, so the text seldom holds them). Chat clients get
the final channel as `content`, the analysis channel as `reasoning_content` (as vLLM and SGLang
name it), and messages to `functions.NAME` as tool calls. A reply with no markers at all (the
model off its format, or held to a grammar) is all content.

    python -c "from server import harmony; print(harmony.parse('<|channel|>final<|message|>hi'))"
"""

import re

START, MESSAGE, CHANNEL = "<|start|>", "<|message|>", "<|channel|>"
ENDS = ("<|end|>", "<|return|>", "<|call|>")
RECIPIENT = re.compile(r"to=(\S+?)(?=<\||\s|$)")


def marker_start(text: str) -> int:
    """Where a marker (`<|name|>`, 16 characters at most) may be starting at the end of text, else
    len(text)."""
    cut = text.rfind("<", max(0, len(text) - 16))
    tail = text[cut:]
    return (
        cut
        if cut >= 0 and "|>" not in tail and (tail == "<" or tail.startswith("<|"))
        else len(text)
    )


def header_of(header: str):
    """(channel, recipient or None) of a message header, e.g. "assistant
    to=functions.f<|channel|>commentary json"."""
    words = header.partition(CHANNEL)[2].replace("<|", " <|").split()
    channel = words[0] if words and not words[0].startswith(("<|", "to=")) else ""
    m = RECIPIENT.search(header)
    return channel, m.group(1) if m else None


def function_of(recipient) -> str:
    """The function a message calls ("functions.get_weather" -> "get_weather"), or None."""
    return (
        recipient.removeprefix("functions.")
        if recipient and recipient.startswith("functions.")
        else None
    )


def parse(text: str) -> dict:
    """The whole reply -> {"content", "reasoning", "calls": [(function, arguments text)]} (None if
    empty)."""
    if MESSAGE not in text:
        return {"content": text, "reasoning": None, "calls": []}
    content, reasoning, calls = [], [], []
    for chunk in text.split(START):
        if MESSAGE not in chunk:
            continue  # a header the reply ended in
        header, _, body = chunk.partition(MESSAGE)
        for end in ENDS:
            body = body.split(end, 1)[0]
        channel, recipient = header_of(header)
        if function_of(recipient):
            calls.append((function_of(recipient), body.strip()))
        elif channel == "analysis":
            reasoning.append(body)
        elif channel == "final" or not channel:
            content.append(body)
    return {
        "content": "".join(content) or None,
        "reasoning": "".join(reasoning) or None,
        "calls": calls,
    }


class HarmonyStream:
    """The reply while it is written, for streaming: feed(text) and finish() return parts as
    tool_calls.CallStream's ("content", text), ("call", None, name) (the caller gives the call its
    id), ("arguments", text), and ("reasoning", text). A body's text is passed on as it arrives;
    what may be the start of a marker (`<|...`) waits until it is one or is not."""

    def __init__(self, calls: bool = True, parallel: bool = True):
        self.pending, self.in_body, self.kind, self.calls, self.any_marker = (
            "",
            False,
            "content",
            0,
            False,
        )
        self.want_calls = calls  # False: messages to functions are not shown (no tools were given)
        self.parallel = parallel  # False: the first call only (parallel_tool_calls false)

    def feed(self, text: str) -> list:
        self.pending += text
        parts = []
        while self._step(parts):
            pass
        return parts

    def finish(self) -> list:
        parts = []
        if self.pending and (self.in_body or not self.any_marker):
            self._emit(parts, self.pending)
        self.pending = ""
        return parts

    def _step(self, parts) -> bool:
        if not self.in_body:  # a header: wait for <|message|>
            at = self.pending.find(MESSAGE)
            if at < 0:
                head = self.pending.lstrip()
                header = head.startswith(("to=", "<")) or "to=".startswith(
                    head
                )  # (the first header may be " to=...")
                if not self.any_marker and not header:  # no format: content as it comes
                    keep = marker_start(self.pending)
                    self._emit(parts, self.pending[:keep])
                    self.pending = self.pending[keep:]
                return False
            self.any_marker = True
            channel, recipient = header_of(self.pending[:at].rpartition(START)[2])
            self.kind = (
                "arguments"
                if function_of(recipient)
                else {"analysis": "reasoning"}.get(channel, "content")
            )
            if self.kind == "arguments" and self.want_calls and (self.parallel or not self.calls):
                self.calls += 1
                parts.append(("call", None, function_of(recipient)))
            elif self.kind == "arguments" or channel not in ("analysis", "final", ""):
                self.kind = None  # another channel (commentary to no function): not shown
            self.pending, self.in_body = self.pending[at + len(MESSAGE) :], True
            return True
        ends = [(self.pending.find(e), e) for e in ENDS if e in self.pending]
        if ends:
            at, end = min(ends)
            self._emit(parts, self.pending[:at])
            self.pending, self.in_body = self.pending[at + len(end) :], False
            return True
        keep = marker_start(self.pending)  # a marker may be starting: hold it back
        self._emit(parts, self.pending[:keep])
        self.pending = self.pending[keep:]
        return False

    def _emit(self, parts, text: str):
        if text and self.kind:
            parts.append((self.kind, text))
