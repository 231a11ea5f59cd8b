"""Tokenizers: text <-> token ids for every checkpoint format, plus stop tokens and chat templates.

One `Tokenizer` wraps whichever library the checkpoint's files call for:
- `tokenizer.json` (Hugging Face `tokenizers`), the most common today;
- `tokenizer.model` as SentencePiece (Llama 2, TinyLlama, Mistral) or as tiktoken ranks
  (Llama 3: one "base64-token rank" per line);
- the vocabulary inside a GGUF file: `gpt2` byte-level BPE (the default SmolLM2 model, Llama 3,
  Qwen) is rebuilt as a `tokenizers` BPE; `llama` SentencePiece vocabularies (tokens and scores)
  as a byte-fallback BPE whose merges are ordered by score, as SentencePiece ranks them.

Special tokens written in the text (`<|im_start|>`) become their single ids. BOS/EOS and the
stop tokens come from the checkpoint's metadata (generation_config.json may list several). Chat
templates come from tokenizer_config.json, chat_template.jinja or the GGUF metadata, and are
rendered in a subclass of jinja2's ImmutableSandboxedEnvironment that also bounds what a template
may build (repetition, output size, widths) and how long it may run, since a template is code
from the checkpoint.

    python tokenizer.py [CHECKPOINT] "Some text"      # prints the ids and their pieces
"""
import base64
import json
import re
import sys
import time
from pathlib import Path

from gguf_tokenizer import LLAMA3_PATTERN, from_gguf
from runtime import TokenizerError

LLAMA3_SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                  "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|step_id|>",
                  "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"]


class Tokenizer:
    """encode/decode over one backend, with bos_id, stop_ids and an optional chat template."""

    def __init__(self, backend, bos_id=None, stop_ids=(), add_bos=False, chat_template=None, special=None, source=None):
        self.backend, self.source = backend, source  # encode(text) -> ids, decode(ids) -> str; the checkpoint
        self.bos_id, self.add_bos = bos_id, add_bos
        self.stop_ids = set(i for i in stop_ids if i is not None)
        self.chat_template = chat_template
        self.special = special or {}  # special token text -> id
        self.eos_id = min(self.stop_ids) if self.stop_ids else None

    def encode(self, text: str, bos: bool = None) -> list:
        ids = self.backend.encode(text)
        add = self.add_bos if bos is None else bos
        if add and self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids) -> str:
        return self.backend.decode(list(ids))

    def token_text(self, token_id: int) -> str:
        return next((t for t, i in self.special.items() if i == token_id), None) or self.decode([token_id])

    def apply_chat_template(self, messages, add_generation_prompt=True, **extra) -> str:
        """extra: more template variables, e.g. tools (as HF's apply_chat_template passes them)."""
        if not self.chat_template:
            raise TokenizerError("this checkpoint has no chat template; run without --chat")
        return render_chat_template(self.chat_template, messages, add_generation_prompt,
                                    bos_token=self.token_text(self.bos_id) if self.bos_id is not None else "",
                                    eos_token=self.token_text(self.eos_id) if self.eos_id is not None else "", **extra)

    def encode_chat(self, messages, add_generation_prompt=True) -> list:
        # The template writes BOS itself where the model wants it, so nothing is added here.
        return self.encode(self.apply_chat_template(messages, add_generation_prompt), bos=False)


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
    HELD_TOKENS = 8  # a window still ending in U+FFFD after this many tokens is released: the character is real

    def __init__(self, tokenizer, stop=()):
        self.tokenizer, self.stop = tokenizer, list(stop)
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop strings must be non-empty strings, got {self.stop!r}")
        self.ids, self.count, self.reason, self.stop_string = [], 0, None, None
        self.prefix_offset = self.read_offset = 0  # ids[prefix_offset:read_offset]: the window released last
        self.pieces, self.tail = [], ""  # text released; decoded text held for the stop strings
        self.hold = max((len(s) - 1 for s in self.stop), default=0)  # characters that could begin a stop string

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
        return "" if self.reason is not None else self._release(self._detokenize(final=True), reason)

    def _detokenize(self, final: bool) -> str:
        """The text the ids since read_offset add, or "" while it may end in a partial character."""
        before = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset])
        text = self.tokenizer.decode(self.ids[self.prefix_offset:])
        whole = len(text) > len(before) and not text.endswith("\ufffd")
        if not (whole or final or len(self.ids) - self.read_offset > self.HELD_TOKENS):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return text[len(before):]

    def _release(self, new: str, reason) -> str:
        """Released text: `new` plus the held tail, cut before the earliest stop string in it,
        less the last `hold` characters while the sequence goes on."""
        text = self.tail + new
        found = min(((i, len(s), s) for s in self.stop if (i := text.find(s)) >= 0), default=None)
        if found:
            out, self.tail, self.reason, self.stop_string = text[:found[0]], "", "stop", found[2]
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
        self.text, self.stop_ids, self.out, self.done = TextStream(tokenizer), set(stop_ids), out or sys.stdout, False

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


# What one render of a chat template may build and spend. A template is code from a file written
# by someone else: jinja2's sandbox stops attribute walks (__class__, __globals__) but not
# `'a' * 10**10`, `range(99999)` nested in itself, or `'{:>9999999999}'.format(1)`.
TEMPLATE_MAX_CHARS = 2**24  # of any string or list the template builds, and of its output
TEMPLATE_MAX_SECONDS = 2.0


def _bounded_sandbox():
    import math

    from jinja2.exceptions import SecurityError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def check_size(value):
        if isinstance(value, (str, list, tuple, bytes)) and len(value) > TEMPLATE_MAX_CHARS:
            raise SecurityError(f"the template built a value of {len(value)} items (limit {TEMPLATE_MAX_CHARS})")
        return value

    def check_args(args, kwargs):  # widths, counts and repeats beyond what any output may hold
        for a in list(args) + list(kwargs.values()):
            if isinstance(a, int) and not isinstance(a, bool) and abs(a) > TEMPLATE_MAX_CHARS:
                raise SecurityError(f"the template passed {a}, beyond the limit of {TEMPLATE_MAX_CHARS}")

    def bounded_filter(f):
        def wrapper(*args, **kwargs):
            check_args(args, kwargs)
            return check_size(f(*args, **kwargs))
        wrapper.__dict__.update(getattr(f, "__dict__", {}))  # keeps jinja's pass_context / pass_environment marks
        return wrapper

    class BoundedSandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset(["*", "**", "+", "%"])

        def __init__(self, **kw):
            super().__init__(**kw)
            self.filters = {name: bounded_filter(f) for name, f in self.filters.items()}

        def unsafe_undefined(self, obj, attribute):  # an attribute walk fails now, not silently as ""
            raise SecurityError(f"access to attribute {attribute!r} of a {type(obj).__name__} is unsafe")

        def call_binop(self, context, operator, left, right):
            if operator == "*":
                for seq, times in ((left, right), (right, left)):
                    if isinstance(seq, (str, list, tuple)) and isinstance(times, int) and \
                            len(seq) * times > TEMPLATE_MAX_CHARS:
                        raise SecurityError(f"the template repeats a value {times} times (limit {TEMPLATE_MAX_CHARS} items)")
            if operator == "**" and isinstance(left, (int, float)) and isinstance(right, (int, float)) and \
                    abs(left) > 1 and right * math.log2(abs(left)) > 4096:
                raise SecurityError(f"the template computes {left} ** {right}, a number over 4096 bits")
            if operator == "%" and isinstance(left, str):
                check_args(right if isinstance(right, tuple) else (right,), {})
            return check_size(super().call_binop(context, operator, left, right))

        def call(__self, __context, __obj, *args, **kwargs):
            check_args(args, kwargs)
            bound_to = getattr(getattr(__obj, "__wrapped__", __obj), "__self__", None)  # the sandbox wraps str.format
            if isinstance(bound_to, str) and re.search(r"\d{7,}", bound_to):
                raise SecurityError("the template formats with a width beyond any output")
            try:
                return check_size(super().call(__context, __obj, *args, **kwargs))
            except OverflowError as e:  # the sandbox's own range() limit
                raise SecurityError(str(e)) from None

    return BoundedSandbox


def _with_deadline(render, seconds: float):
    """render() stopped after `seconds`: a trace on the template's own frames (their code is
    named "<template>") checks the clock every 1024 lines, loops without output included."""
    from jinja2.exceptions import SecurityError

    deadline, lines = time.monotonic() + seconds, 0

    def on_line(frame, event, arg):
        nonlocal lines
        lines += 1
        if lines % 1024 == 0 and time.monotonic() > deadline:
            raise SecurityError(f"the template ran for more than {seconds:g} s")
        return on_line

    def on_call(frame, event, arg):
        return on_line if frame.f_code.co_filename == "<template>" else None

    previous = sys.gettrace()
    sys.settrace(on_call)
    try:
        return render()
    finally:
        sys.settrace(previous)


def render_chat_template(template: str, messages, add_generation_prompt=True, **extra) -> str:
    """The template rendered in a sandbox that also bounds what it may build and how long it may
    run; any failure is a TokenizerError."""
    from jinja2.exceptions import TemplateError

    def raise_exception(message):
        raise TemplateError(message)

    env = _bounded_sandbox()(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = raise_exception

    def render():
        out, size = [], 0
        for part in env.from_string(template).generate(messages=messages, add_generation_prompt=add_generation_prompt,
                                                       **extra):
            out.append(part)
            size += len(part)
            if size > TEMPLATE_MAX_CHARS:
                raise TemplateError(f"the template's output exceeds {TEMPLATE_MAX_CHARS} characters")
        return "".join(out)

    try:
        return _with_deadline(render, TEMPLATE_MAX_SECONDS)
    except (TemplateError, OverflowError, MemoryError, RecursionError) as e:
        raise TokenizerError(f"chat template failed: {e}") from None


# --- backends -------------------------------------------------------------------------------

class HFBackend:
    """A `tokenizers.Tokenizer`; its added special tokens are matched in the text."""

    def __init__(self, tok):
        self.tok = tok

    def encode(self, text):
        if len(text) > 10_000:  # encode_batch releases the GIL, so a server's other threads run meanwhile
            return self.tok.encode_batch([text], add_special_tokens=False)[0].ids
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids):
        return self.tok.decode(ids, skip_special_tokens=False)


class SentencePieceBackend:
    """sentencepiece, with special-token strings in the text split out first."""

    def __init__(self, path, special):
        import sentencepiece

        self.sp = sentencepiece.SentencePieceProcessor(model_file=str(path))
        self.special = special
        self.split = re.compile("(" + "|".join(map(re.escape, special)) + ")") if special else None

    def encode(self, text):
        if not self.split:
            return self.sp.encode(text)
        ids = []
        for part in self.split.split(text):
            if part in self.special:
                ids.append(self.special[part])
            elif part:
                ids.extend(self.sp.encode(part))
        return ids

    def decode(self, ids):
        return self.sp.decode(ids)


class TiktokenBackend:
    def __init__(self, path, special):
        import tiktoken

        ranks = {}
        for n, line in enumerate(Path(path).read_bytes().splitlines()):
            if line:
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
        self.enc = tiktoken.Encoding(Path(path).name, pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks, special_tokens=special)

    def encode(self, text):
        return self.enc.encode(text, allowed_special="all")

    def decode(self, ids):
        return self.enc.decode(ids)


def is_tiktoken_file(path: Path) -> bool:
    head = path.read_bytes()[:256].split(b"\n")[0]
    return re.fullmatch(rb"[A-Za-z0-9+/=]+ \d+", head) is not None


# --- loading from a checkpoint --------------------------------------------------------------

def _json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text()) if path.exists() else {}
    except (ValueError, UnicodeDecodeError) as e:
        raise TokenizerError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise TokenizerError(f"{path}: not a JSON object")
    return value


def load_tokenizer(path) -> Tokenizer:
    """The tokenizer of a checkpoint: a .gguf file or an HF-style folder (its `source`, so another
    process can load it again: constraint_check.py)."""
    path = Path(path)
    # a GGUF file, or a folder quantize.py wrote from one (its tokenizer kept as tokenizer.gguf)
    gguf_file = path if path.is_file() and path.suffix == ".gguf" else path / "tokenizer.gguf"
    if gguf_file.is_file():
        parts = from_gguf(gguf_file)
        return Tokenizer(HFBackend(parts["tokenizer"]), parts["bos_id"], parts["stop_ids"], parts["add_bos"],
                         parts["chat_template"], parts["special"], str(path))
    config = _json(path / "tokenizer_config.json")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: take the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), template[0]["template"])
    if (path / "chat_template.jinja").exists():
        template = (path / "chat_template.jinja").read_text()
    special = {t["content"]: int(i) for i, t in config.get("added_tokens_decoder", {}).items() if t.get("special")}
    backend, default_bos = _backend(path, config, special)
    bos, stops = _bos_and_stops(path, backend, config, special)
    # tokenizer.json's post-processor says whether BOS is added; other formats use the config.
    add_bos = default_bos if isinstance(backend, HFBackend) else bool(config.get("add_bos_token", default_bos))
    return Tokenizer(backend, bos, stops, add_bos, template, special, str(path))


def _backend(path: Path, config: dict, special: dict):
    """(backend, whether it adds BOS by default) for the folder's tokenizer file. Adds the file's own
    special tokens to `special`, and to a bare Llama 3 folder's `config` its BOS/EOS names."""
    if (path / "tokenizer.json").exists():
        from tokenizers import Tokenizer as HFTokenizer

        try:  # the file is someone else's: any failure to read it is this tokenizer's error
            tok = HFTokenizer.from_file(str(path / "tokenizer.json"))
            special.update({t.content: i for i, t in tok.get_added_tokens_decoder().items() if t.special})
            return HFBackend(tok), _post_processor_adds_bos(path / "tokenizer.json")
        except Exception as e:
            raise TokenizerError(f"{path / 'tokenizer.json'}: cannot be read ({e})") from None
    model_file = path / "tokenizer.model"
    if not model_file.exists():
        raise TokenizerError(f"{path}: no tokenizer found (expected tokenizer.json or tokenizer.model)")
    if not is_tiktoken_file(model_file):
        backend = SentencePieceBackend(model_file, special)
        special.update({backend.sp.id_to_piece(i): i for i in (backend.sp.bos_id(), backend.sp.eos_id()) if i >= 0})
        return backend, True
    if not special:  # a bare Llama 3 folder: its 256 special tokens follow the ranks
        n = len([line for line in model_file.read_bytes().splitlines() if line])
        names = LLAMA3_SPECIAL + [f"<|reserved_special_token_{i}|>" for i in range(2, 256 - len(LLAMA3_SPECIAL) + 2)]
        special.update({name: n + i for i, name in enumerate(names)})
    backend = TiktokenBackend(model_file, special)
    llama3_defaults = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
    config.update({k: v for k, v in llama3_defaults.items() if v in special and k not in config})
    return backend, True


def _bos_and_stops(path: Path, backend, config: dict, special: dict):
    """BOS and the stop ids, from generation_config.json, config.json, then tokenizer_config.json."""
    def token_id(value):
        text = value.get("content") if isinstance(value, dict) else value
        return special.get(text) if isinstance(text, str) else None

    model_config, generation = _json(path / "config.json"), _json(path / "generation_config.json")
    bos = generation.get("bos_token_id", model_config.get("bos_token_id"))
    bos = token_id(config.get("bos_token")) if bos is None else bos
    stops = []
    for source in (generation.get("eos_token_id"), model_config.get("eos_token_id")):
        stops += source if isinstance(source, list) else [source]
    stops.append(token_id(config.get("eos_token")))
    if isinstance(backend, TiktokenBackend):  # Llama 3 ends a turn with <|eot_id|>, a text with <|end_of_text|>
        stops += [special.get(t) for t in ("<|end_of_text|>", "<|eot_id|>", "<|eom_id|>")]
    if isinstance(backend, SentencePieceBackend):
        stops.append(backend.sp.eos_id() if backend.sp.eos_id() >= 0 else None)
        bos = backend.sp.bos_id() if bos is None and backend.sp.bos_id() >= 0 else bos
    return bos, stops


def _post_processor_adds_bos(path: Path) -> bool:
    post = (json.loads(path.read_text()).get("post_processor") or {})
    processors = post.get("processors", [post]) if post.get("type") == "Sequence" else [post]
    for p in processors:
        if p.get("type") == "TemplateProcessing":
            single = p.get("single", [])
            return bool(single) and "SpecialToken" in single[0]
    return False


if __name__ == "__main__":
    import weights

    args = sys.argv[1:]
    checkpoint, text = (args[0], args[1]) if len(args) > 1 else (None, args[0] if args else "Hello, world!")
    tok = load_tokenizer(weights.resolve(checkpoint))
    ids = tok.encode(text)
    print(ids)
    print([tok.decode([i]) for i in ids])
