"""Constrained decoding: output that must match a JSON schema, a regex, one of a list of choices,
or a grammar, whatever the model would rather say.

    python generate.py --json_schema person.json --prompt "A person:"
    python generate.py --regex "[0-9]{3}-[0-9]{4}" --prompt "A phone number:"
    python generate.py --choice yes,no --prompt "Is the sea wet?"

The idea: the constraint becomes an automaton over the tokenizer's vocabulary (llguidance, the
library vLLM, SGLang and llama.cpp use, compiles it: an Earley parser over a lexer, with a
token trie, so a mask costs about a millisecond, not a pass over 50,000 token strings). Each
step, before sampling:

    allowed = matcher.mask()                  # [V] bool: the tokens that keep the output valid
    logits[~allowed] = -inf                   # the model's choice, among valid tokens only
    token = sample(logits); matcher.advance(token)

When the grammar is complete and allows nothing more, the output ends ("stop"); the model's end
token is allowed exactly where the grammar may end. Greedy output equals unconstrained greedy
output wherever the model's own argmax is allowed. Rows without a constraint pay nothing.

One interface: `Constraint(kind, value)` (json_schema | json_object | regex | choice | grammar),
`compile_constraint(constraint, tokenizer, vocab_size, stop_ids) -> Matcher`; a Matcher has
mask_logits(row), advance(token), copy(), and the flags `finished` and `error`.
"""

import functools
import json
from dataclasses import dataclass

import torch

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
# JSON written as json.dumps writes it: without free whitespace, which a model could otherwise
# repeat until max_tokens (a schema's "x-guidance" key may ask for other options)
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
BITS = torch.arange(32, dtype=torch.int32)


@dataclass(frozen=True)
class Constraint:
    kind: str  # one of KINDS
    value: object = (
        None  # schema (dict or JSON text), regex, list of strings, or a Lark / GBNF grammar
    )

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(
                f"constraint kind must be one of {', '.join(KINDS)}, got {self.kind!r}"
            )
        if self.kind == "choice" and (
            not isinstance(self.value, (list, tuple))
            or not self.value
            or not all(isinstance(c, str) and c for c in self.value)
        ):
            raise ValueError("choice must be a non-empty list of non-empty strings")
        if self.kind in ("regex", "grammar") and (
            not isinstance(self.value, str) or not self.value
        ):
            raise ValueError(f"{self.kind} must be a non-empty string")


def grammar_text(c: Constraint) -> str:
    """The constraint as llguidance's grammar text."""
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import any_to_lark

    if c.kind == "json_schema":
        schema = json.loads(c.value) if isinstance(c.value, str) else c.value
        if not isinstance(schema, dict):
            raise ValueError("a JSON schema must be a JSON object")
        return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)
    if c.kind == "json_object":
        return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_LAYOUT)
    if c.kind == "regex":
        return LLMatcher.grammar_from_regex(c.value)
    if (
        c.kind == "choice"
    ):  # one lexer terminal (Lark string literals take JSON's escapes): as parser
        # alternatives, 2,001 choices broke llguidance's row limit and 100,000 took 9 s (0.4 s so)
        return LLMatcher.grammar_from_lark(
            "start: CHOICE\nCHOICE: " + " | ".join(json.dumps(s) for s in c.value)
        )
    return LLMatcher.grammar_from_lark(
        any_to_lark(c.value)
    )  # Lark as it is; GBNF (llama.cpp's) converted


@functools.lru_cache(maxsize=4)
def token_table(tokenizer, vocab_size: int, stop_ids: tuple):
    """llguidance's view of the vocabulary (each token's bytes), built once per tokenizer (~1 s)."""
    import llguidance

    backend, eos = tokenizer.backend, list(stop_ids) or None
    if hasattr(backend, "tok"):  # tokenizer.json / GGUF: a `tokenizers` object
        return llguidance.LLTokenizer(backend.tok.to_str(), n_vocab=vocab_size, eos_token=eos)
    if hasattr(backend, "enc"):  # tiktoken
        from llguidance.tiktoken import lltokenizer_from_encoding

        return lltokenizer_from_encoding(backend.enc, n_vocab=vocab_size, eos_token=eos)
    return llguidance.LLTokenizer(
        llguidance.TokenizerWrapper(_SentencePieceTokens(backend.sp, eos)),
        n_vocab=vocab_size,
        eos_token=eos,
    )


class _SentencePieceTokens:
    """What llguidance's TokenizerWrapper reads from a tokenizer: each token's bytes and
    encode()."""

    def __init__(self, sp, eos):
        self.sp = sp
        self.eos_token_id, self.bos_token_id = eos[0] if eos else sp.eos_id(), sp.bos_id()
        self.tokens, self.special_token_ids = [], []
        for i in range(sp.get_piece_size()):
            piece = sp.id_to_piece(i)
            if sp.is_byte(i):
                self.tokens.append(bytes([int(piece[3:5], 16)]))  # <0xAB>
            elif sp.is_control(i) or sp.is_unknown(i):
                self.tokens.append(piece.encode())
                self.special_token_ids.append(i)
            else:
                self.tokens.append(piece.replace("\u2581", " ").encode())

    def __call__(self, text):
        return self.sp.encode(text.decode() if isinstance(text, bytes) else text)


class Matcher:
    """One sample's position in its constraint."""

    def __init__(self, matcher, vocab: int):
        self.m, self.vocab = matcher, vocab  # vocab: the tokenizer's, which the mask covers
        self.mask = torch.full(((vocab + 31) // 32,), -1, dtype=torch.int32)  # one bit per token

    def mask_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [V] -> a new tensor with every token that breaks the constraint at -inf."""
        self.m.unsafe_compute_mask_ptr(self.mask.data_ptr(), self.mask.numel() * 4)
        allowed = (
            ((self.mask[:, None] >> BITS) & 1).bool().flatten()[: min(self.vocab, logits.shape[-1])]
        )
        if (
            len(allowed) < logits.shape[-1]
        ):  # the model's padding rows past the tokenizer: never allowed
            allowed = torch.cat([allowed, allowed.new_zeros(logits.shape[-1] - len(allowed))])
        return logits.masked_fill(~allowed.to(logits.device), float("-inf"))

    def advance(self, token: int):
        self.m.consume_token(token)

    def copy(self) -> "Matcher":
        return Matcher(self.m.deep_copy(), self.vocab)

    @property
    def finished(self) -> bool:  # complete, and nothing more may follow
        return self.m.is_stopped()

    @property
    def error(self):  # its first line: llguidance appends its parser's whole state
        return (
            (self.m.get_error().strip().splitlines() or ["failed"])[0][:300]
            if self.m.is_error()
            else None
        )


@dataclass(frozen=True)
class Compiled:
    """A constraint already compiled, for one request (serve.py compiles off the engine thread,
    since llguidance releases the GIL while it works): compile_constraint hands back its matcher."""

    constraint: Constraint
    matcher: Matcher


def compile_constraint(c: Constraint, tokenizer, vocab_size: int, stop_ids=()) -> Matcher:
    """A Matcher at the start of the constraint; ValueError naming what is wrong with it."""
    import llguidance

    if isinstance(c, Compiled):
        return c.matcher

    try:
        grammar = grammar_text(c)
    except Exception as e:  # the GBNF converter raises plain Exceptions for a missing rule
        raise ValueError(f"invalid {c.kind}: {e}") from None
    table = token_table(tokenizer, vocab_size, tuple(sorted(stop_ids)))
    m = llguidance.LLMatcher(table, grammar, log_level=0)
    if m.is_error():
        raise ValueError(f"invalid {c.kind}: {m.get_error()}")
    return Matcher(m, table.vocab_size)


# -- generate.py's flags and its decode loop (a batch of rows, one matcher each)
# --------------------
def add_args(p):
    g = p.add_argument_group("constrained output (constrain.py)")
    g.add_argument(
        "--json_schema",
        metavar="FILE",
        help="the output is JSON valid against this JSON schema file",
    )
    g.add_argument("--regex", help="the output matches this regular expression")
    g.add_argument("--choice", help="a,b,c: the output is one of these")
    g.add_argument(
        "--grammar",
        metavar="FILE",
        help="the output follows this Lark or GBNF (llama.cpp) grammar file",
    )


def from_args(args):
    """The constraint generate.py's flags ask for, or None; ValueError with what is wrong."""
    given = [k for k in ("json_schema", "regex", "choice", "grammar") if getattr(args, k)]
    if len(given) > 1:
        raise ValueError(f"give one constraint, not {' and '.join('--' + k for k in given)}")
    if not given:
        return None
    if args.interactive or args.draft_checkpoint or args.draft_layers or args.prompt_lookup:
        raise ValueError(
            f"--{given[0]} works on a plain run (not with --interactive or speculative decoding)"
        )
    kind, value = given[0], getattr(args, given[0])
    if kind in ("json_schema", "grammar"):
        try:
            with open(value) as f:
                value = json.load(f) if kind == "json_schema" else f.read()
        except (OSError, ValueError) as e:
            raise ValueError(f"--{kind} {value}: {e}") from None
    return Constraint(kind, value.split(",") if kind == "choice" else value)


def row_matchers(c: Constraint, tokenizer, vocab_size: int, rows: int):
    """A fresh matcher per batch row for generate.py's loop, or None without a constraint."""
    return c and [
        compile_constraint(c, tokenizer, vocab_size, tokenizer.stop_ids) for _ in range(rows)
    ]


def masked(matchers, logits: torch.Tensor) -> torch.Tensor:
    """logits [B, V] with each row's disallowed tokens at -inf (unchanged without matchers)."""
    return (
        logits
        if matchers is None
        else torch.stack([m.mask_logits(r) for m, r in zip(matchers, logits)])
    )


def advance(matchers, tokens: torch.Tensor):
    """Each row's matcher takes its row's token [B]; a finished one takes nothing more."""
    for m, t in zip(matchers or (), tokens.tolist()):
        if not m.finished:
            m.advance(t)
