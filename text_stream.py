"""Incremental detokenization: a sequence's text released as its tokens arrive, and stop strings.

Decoding all of a sequence's ids at every token costs O(n) per token; decoding only the newest id
loses what a tokenizer does across pieces (a UTF-8 character split over byte tokens, the space
SentencePiece drops at a text's start). TextStream decodes two short windows per token instead:
the new text is decode(ids[prefix_offset:]) minus decode(ids[prefix_offset:read_offset]). The
engine keeps one per sequence (its `text` events), generate.py prints through `Printer`.

    python -c "from text_stream import TextStream"  # library only: any tokenizer with
                                                     # decode(ids) and stop_ids will do
"""

import sys


class TextStream:
    """One sequence's text, decoded as its tokens arrive (incremental detokenization). `add`
    returns only text that is final: it holds back a partial UTF-8 character (U+FFFD until its
    other bytes arrive) and the last (longest stop string - 1) characters, which could begin a
    `stop` string; the text ends just before the first stop string, with reason "stop".
    As in HF's TextStreamer and vLLM, a token costs the same wherever it falls: the new text is
    decode(ids[prefix_offset:]) minus decode(ids[prefix_offset:read_offset]), the ids released
    last (context: SentencePiece drops the space of a text's first piece). Stop strings are
    searched in the new text and the held tail only: each released character had L - 1 after it
    when released (L: the longest), so an occurrence starting in released text was whole, and
    searched, by then. generate.py prints with it, serve.py streams."""

    # a window still ending in U+FFFD after this many tokens is released: the character is real
    HELD_TOKENS = 8

    def __init__(self, tokenizer, stop=()):
        self.tokenizer, self.stop = tokenizer, list(stop)
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop strings must be non-empty strings, got {self.stop!r}")
        self.ids, self.count, self.reason, self.stop_string = [], 0, None, None
        self.prefix_offset = self.read_offset = (
            0  # ids[prefix_offset:read_offset]: the window released last
        )
        self.pieces, self.tail = [], ""  # text released; decoded text held for the stop strings
        self.hold = max(
            (len(s) - 1 for s in self.stop), default=0
        )  # characters that could begin a stop string

    @property
    def sent(self) -> str:  # all text released so far (joined once, then kept as one piece)
        self.pieces[:] = ["".join(self.pieces)]
        return self.pieces[0]

    def add(self, token: int, reason=None) -> str:
        """Record `token` and the sequence's finish reason: None while it goes on; "stop" when it
        ended on a stop token (one in tokenizer.stop_ids is then not text); "length" or any other
        ends it now. Returns the text that is final now; after the end, ""."""
        self.count += 1
        if self.reason is not None:
            return ""
        if not (reason == "stop" and token in self.tokenizer.stop_ids):
            self.ids.append(token)
        return self._release(self._detokenize(final=reason is not None), reason)

    def finish(self, reason="length") -> str:
        """The sequence ended without another token: whatever was held back."""
        return (
            "" if self.reason is not None else self._release(self._detokenize(final=True), reason)
        )

    def _detokenize(self, final: bool) -> str:
        """The text the ids since read_offset add, or "" while it may end in a partial character."""
        before = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
        text = self.tokenizer.decode(self.ids[self.prefix_offset :])
        whole = len(text) > len(before) and not text.endswith("\ufffd")
        if not (whole or final or len(self.ids) - self.read_offset > self.HELD_TOKENS):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return text[len(before) :]

    def _release(self, new: str, reason) -> str:
        """Released text: `new` plus the held tail, cut before the earliest stop string in it,
        less the last `hold` characters while the sequence goes on."""
        text = self.tail + new
        found = min(((i, len(s), s) for s in self.stop if (i := text.find(s)) >= 0), default=None)
        if found:
            out, self.tail, self.reason, self.stop_string = text[: found[0]], "", "stop", found[2]
        elif reason is None:
            cut = max(len(text) - self.hold, 0)
            out, self.tail = text[:cut], text[cut:]
        else:
            out, self.tail, self.reason = text, "", reason
        if out:
            self.pieces.append(out)
        return out


class Printer:
    """Prints row 0's text as its tokens arrive, through TextStream (the incremental
    detokenizer serve.py uses too); after a stop token nothing more is printed."""

    def __init__(self, tokenizer, stop_ids, out=None):
        self.text, self.stop_ids, self.out, self.done = (
            TextStream(tokenizer),
            set(stop_ids),
            out or sys.stdout,
            False,
        )

    def __call__(self, token):
        if not self.done:
            t = int(token[0])  # a host sync, only when streaming to a terminal
            self.done = t in self.stop_ids
            self.write(self.text.add(t, "stop" if self.done else None))

    def flush(self):
        self.write(self.text.finish())

    def write(self, text: str):
        self.out.write(text)
        self.out.flush()
