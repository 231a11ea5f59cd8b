"""Tokenizers: text <-> token ids for every checkpoint format, plus stop tokens and chat templates.

One `Tokenizer` wraps whichever library the checkpoint's files call for:
- `tokenizer.json` (Hugging Face `tokenizers`), the most common today;
- `tokenizer.model` as SentencePiece (Llama 2, TinyLlama, Mistral) or as tiktoken ranks
  (Llama 3: one "base64-token rank" per line);
- the vocabulary inside a GGUF file: `gpt2` byte-level BPE (the default SmolLM2 model, Llama 3,
  Qwen) is rebuilt as a `tokenizers` BPE; `llama` SentencePiece vocabularies (tokens and scores)
  as a byte-fallback BPE whose merges are ordered by score, as SentencePiece ranks them.

Special tokens written in the text (`<|im_start|>`) become their single ids, except in a chat
message's content, where they are text (encode_rendered: a user cannot write the template's
control tokens). BOS/EOS and the stop tokens come from the checkpoint's metadata
(generation_config.json may list several). Chat
templates come from tokenizer_config.json, chat_template.jinja or the GGUF metadata, and are
rendered by formats/chat_template.py in a sandbox that also bounds what a template may build and how
long it may run, since a template is code from the checkpoint.

    python -m formats.tokenizer [CHECKPOINT] "Some text"      # prints the ids and their pieces
"""

import base64
import json
import re
import sys
from pathlib import Path

from formats.chat_template import render_chat_template
from formats.gguf_tokenizer import LLAMA3_PATTERN, from_gguf
from runtime import TokenizerError

LLAMA3_SPECIAL = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>",
    "<|step_id|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
]


class Tokenizer:
    """encode/decode over one backend, with bos_id, stop_ids and an optional chat template."""

    def __init__(
        self,
        backend,
        bos_id=None,
        stop_ids=(),
        add_bos=False,
        chat_template=None,
        special=None,
        source=None,
    ):
        self.backend, self.source = (
            backend,
            source,
        )  # encode(text) -> ids, decode(ids) -> str; the checkpoint
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
        return next((t for t, i in self.special.items() if i == token_id), None) or self.decode(
            [token_id]
        )

    def apply_chat_template(self, messages, add_generation_prompt=True, **extra) -> str:
        """extra: more template variables, e.g. tools (as HF's apply_chat_template passes them)."""
        if not self.chat_template:
            raise TokenizerError("this checkpoint has no chat template; run without --chat")
        return render_chat_template(
            self.chat_template,
            messages,
            add_generation_prompt,
            bos_token=self.token_text(self.bos_id) if self.bos_id is not None else "",
            eos_token=self.token_text(self.eos_id) if self.eos_id is not None else "",
            **extra,
        )

    def encode_chat(self, messages, add_generation_prompt=True) -> list:
        # The template writes BOS itself where the model wants it, so nothing is added here.
        return self.encode_rendered(
            self.apply_chat_template(messages, add_generation_prompt), messages
        )

    def encode_rendered(self, text: str, messages) -> list:
        """A rendered chat's ids, without BOS. A special token's literal that a message's content
        spells (a user typing `<|im_end|>`) is text, as HF's split_special_tokens would make it;
        the template's own markup keeps its special ids. Content without such a literal (nearly
        all) is encoded as encode(text) does."""
        spans = self._spelled_specials(text, messages)
        if not spans:
            return self.encode(text, bos=False)
        ids, start = [], 0
        for m in self._special_pattern().finditer(text):
            if any(a <= m.start() and m.end() <= b for a, b in spans):
                continue  # a content's: stays in the text around it
            ids += self.backend.encode_plain(text[start : m.start()]) + [self.special[m.group()]]
            start = m.end()
        return ids + self.backend.encode_plain(text[start:])

    def _special_pattern(self):
        if (
            getattr(self, "_pattern", None) is None
        ):  # longest first, so no literal is cut by a shorter one
            self._pattern = re.compile(
                "|".join(map(re.escape, sorted(self.special, key=len, reverse=True)))
            )
        return self._pattern

    def _spelled_specials(self, text: str, messages) -> list:
        """[(start, end)] in the rendered text of each message content that spells a special
        token."""
        if not self.special:
            return []
        pattern, spans, at = self._special_pattern(), [], 0
        for m in messages:
            content = m.get("content") if isinstance(m, dict) else None
            parts = (
                [content]
                if isinstance(content, str)
                else [
                    p.get("text")
                    for p in (content if isinstance(content, list) else [])
                    if isinstance(p, dict)
                ]
            )
            parts = [p for p in parts if isinstance(p, str)]
            for part in parts:
                if not part or not pattern.search(part):
                    continue
                span = _locate(text, part, at) or _locate(
                    text, part.strip(), at
                )  # (templates may strip it)
                if span is None:  # the template changed it: where the literal now is cannot be told
                    raise TokenizerError(
                        f"a message's content spells the special token "
                        f"{pattern.search(part).group()!r}, and the chat template alters that "
                        "content, so it cannot be kept as text; remove the token from the message"
                    )
                spans.append(span)
                at = span[1]
        return spans


def _locate(text: str, part: str, at: int):
    """(start, end) of `part` in text, searched from `at` on (then from the start), or None."""
    i = text.find(part, at)
    i = text.find(part) if i < 0 else i
    return (i, i + len(part)) if i >= 0 else None


# --- backends -------------------------------------------------------------------------------


class HFBackend:
    """A `tokenizers.Tokenizer`; its added special tokens are matched in the text."""

    def __init__(self, tok):
        self.tok = tok

    def encode(self, text, tok=None):
        tok = tok or self.tok
        if (
            len(text) > 10_000
        ):  # encode_batch releases the GIL, so a server's other threads run meanwhile
            return tok.encode_batch([text], add_special_tokens=False)[0].ids
        return tok.encode(text, add_special_tokens=False).ids

    def encode_plain(self, text):
        """Special tokens' literals as text: a copy of the tokenizer with encode_special_tokens set
        (the flag is the tokenizer's own, so the shared one is never switched under other
        threads)."""
        if getattr(self, "plain", None) is None:
            from tokenizers import Tokenizer as HFTokenizer

            plain = HFTokenizer.from_str(self.tok.to_str())
            plain.encode_special_tokens = True
            self.plain = plain
        return self.encode(text, self.plain) if text else []

    def decode(self, ids):
        return self.tok.decode(ids, skip_special_tokens=False)


class SentencePieceBackend:
    """sentencepiece, with special-token strings in the text split out first."""

    def __init__(self, path, special):
        import sentencepiece

        self.sp = sentencepiece.SentencePieceProcessor(model_file=str(path))
        self.special = special
        self.split = re.compile("(" + "|".join(map(re.escape, special)) + ")") if special else None

    def encode_plain(self, text):
        return self.sp.encode(text) if text else []

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
        self.enc = tiktoken.Encoding(
            Path(path).name, pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks, special_tokens=special
        )

    def encode(self, text):
        return self.enc.encode(text, allowed_special="all")

    def encode_plain(self, text):
        return self.enc.encode(text, allowed_special=set(), disallowed_special=())

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
    process can load it again: server/constraint_check.py)."""
    path = Path(path)
    # a GGUF file, or a folder quantize.py wrote from one (its tokenizer kept as tokenizer.gguf)
    gguf_file = path if path.is_file() and path.suffix == ".gguf" else path / "tokenizer.gguf"
    if gguf_file.is_file():
        parts = from_gguf(gguf_file)
        return Tokenizer(
            HFBackend(parts["tokenizer"]),
            parts["bos_id"],
            parts["stop_ids"],
            parts["add_bos"],
            parts["chat_template"],
            parts["special"],
            str(path),
        )
    config = _json(path / "tokenizer_config.json")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: take the default one
        template = next(
            (t["template"] for t in template if t.get("name") == "default"), template[0]["template"]
        )
    if (path / "chat_template.jinja").exists():
        template = (path / "chat_template.jinja").read_text()
    special = {
        t["content"]: int(i)
        for i, t in config.get("added_tokens_decoder", {}).items()
        if t.get("special")
    }
    backend, default_bos = _backend(path, config, special)
    bos, stops = _bos_and_stops(path, backend, config, special)
    # tokenizer.json's post-processor says whether BOS is added; other formats use the config.
    add_bos = (
        default_bos
        if isinstance(backend, HFBackend)
        else bool(config.get("add_bos_token", default_bos))
    )
    return Tokenizer(backend, bos, stops, add_bos, template, special, str(path))


def _backend(path: Path, config: dict, special: dict):
    """(backend, whether it adds BOS by default) for the folder's tokenizer file. Adds the file's
    own special tokens to `special`, and to a bare Llama 3 folder's `config` its BOS/EOS names."""
    if (path / "tokenizer.json").exists():
        from tokenizers import Tokenizer as HFTokenizer

        try:  # the file is someone else's: any failure to read it is this tokenizer's error
            tok = HFTokenizer.from_file(str(path / "tokenizer.json"))
            special.update(
                {t.content: i for i, t in tok.get_added_tokens_decoder().items() if t.special}
            )
            return HFBackend(tok), _post_processor_adds_bos(path / "tokenizer.json")
        except Exception as e:
            raise TokenizerError(f"{path / 'tokenizer.json'}: cannot be read ({e})") from None
    model_file = path / "tokenizer.model"
    if not model_file.exists():
        raise TokenizerError(
            f"{path}: no tokenizer found (expected tokenizer.json or tokenizer.model)"
        )
    if not is_tiktoken_file(model_file):
        backend = SentencePieceBackend(model_file, special)
        special.update(
            {
                backend.sp.id_to_piece(i): i
                for i in (backend.sp.bos_id(), backend.sp.eos_id())
                if i >= 0
            }
        )
        return backend, True
    if not special:  # a bare Llama 3 folder: its 256 special tokens follow the ranks
        n = len([line for line in model_file.read_bytes().splitlines() if line])
        names = LLAMA3_SPECIAL + [
            f"<|reserved_special_token_{i}|>" for i in range(2, 256 - len(LLAMA3_SPECIAL) + 2)
        ]
        special.update({name: n + i for i, name in enumerate(names)})
    backend = TiktokenBackend(model_file, special)
    llama3_defaults = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
    config.update({k: v for k, v in llama3_defaults.items() if v in special and k not in config})
    return backend, True


def _bos_and_stops(path: Path, backend, config: dict, special: dict):
    """BOS and the stop ids, from generation_config.json, config.json, then
    tokenizer_config.json."""

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
    if isinstance(
        backend, TiktokenBackend
    ):  # Llama 3 ends a turn with <|eot_id|>, a text with <|end_of_text|>
        stops += [special.get(t) for t in ("<|end_of_text|>", "<|eot_id|>", "<|eom_id|>")]
    if isinstance(backend, SentencePieceBackend):
        stops.append(backend.sp.eos_id() if backend.sp.eos_id() >= 0 else None)
        bos = backend.sp.bos_id() if bos is None and backend.sp.bos_id() >= 0 else bos
    return bos, stops


def _post_processor_adds_bos(path: Path) -> bool:
    post = json.loads(path.read_text()).get("post_processor") or {}
    processors = post.get("processors", [post]) if post.get("type") == "Sequence" else [post]
    for p in processors:
        if p.get("type") == "TemplateProcessing":
            single = p.get("single", [])
            return bool(single) and "SpecialToken" in single[0]
    return False


if __name__ == "__main__":
    from formats import weights

    args = sys.argv[1:]
    checkpoint, text = (
        (args[0], args[1]) if len(args) > 1 else (None, args[0] if args else "Hello, world!")
    )
    tok = load_tokenizer(weights.resolve(checkpoint))
    ids = tok.encode(text)
    print(ids)
    print([tok.decode([i]) for i in ids])
