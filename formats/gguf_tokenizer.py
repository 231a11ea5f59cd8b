"""The tokenizer stored inside a GGUF file, rebuilt as a Hugging Face `tokenizers` object.

A GGUF file keeps its vocabulary as metadata: `tokenizer.ggml.tokens` (the pieces, in id order),
`tokenizer.ggml.token_type` (1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte),
and then by kind (`tokenizer.ggml.model`):
- `gpt2`: byte-level BPE with `tokenizer.ggml.merges` ("a b" per merge, best first) and a
  pre-tokenizer named by `tokenizer.ggml.pre`, which decides how text is split into words first;
- `llama`: SentencePiece BPE with `tokenizer.ggml.scores`; a merge's rank is the score of the
  piece it makes, and unknown characters fall back to the <0xXX> byte pieces.
Control tokens are added as special tokens, so `<|im_start|>` in a chat prompt becomes one id.
`from_gguf` returns the pieces (the `tokenizers` object, BOS and stop ids, chat template);
formats/tokenizer.py wraps them in its Tokenizer.
"""

from pathlib import Path

from formats.gguf_config import field, read
from runtime import TokenizerError

# Pre-tokenizer regexes (split text into words before BPE), as the models were trained.
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_PATTERN = LLAMA3_PATTERN.replace(r"\p{N}{1,3}", r"\p{N}")
O200K_PATTERN = "|".join(
    [  # tiktoken's o200k (gpt-oss; llama.cpp's "gpt-4o" pre-tokenizer): case runs, then the rest
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"""
        r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"""
        r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)

# DeepSeek-V3's (`deepseek-v3`): three splits in turn, each match its own piece (llama.cpp's
# llama-vocab.cpp, as DeepSeek's tokenizer.json): digits in threes, CJK runs, then words
DEEPSEEK_V3_SPLITS = (
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
    r"""| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""",
)
KNOWN_PRE = ("gpt2", "default", "llama-bpe", "llama3", "qwen2", "gpt-4o", "deepseek-v3")

CONTROL, USER_DEFINED = 3, 4
# `tokenizer.ggml.pre` values whose models split every digit into its own word.
SINGLE_DIGIT_PRE = ("smollm", "starcoder", "refact", "codeshell", "command-r")


def _pre_tokenizer(pre: str):
    from tokenizers import Regex, pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in SINGLE_DIGIT_PRE:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in ("llama-bpe", "llama3", "qwen2", "gpt-4o", "deepseek-v3"):
        pattern = {"qwen2": QWEN2_PATTERN, "gpt-4o": O200K_PATTERN}.get(pre, LLAMA3_PATTERN)
        patterns = DEEPSEEK_V3_SPLITS if pre == "deepseek-v3" else (pattern,)
        splits = [
            pre_tokenizers.Split(Regex(p), behavior="isolated", invert=False) for p in patterns
        ]
        return pre_tokenizers.Sequence(
            [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    if pre not in KNOWN_PRE:
        from runtime import log

        log(
            f"tokenizer.ggml.pre {pre!r} has no pre-tokenizer here: GPT-2's regex splits the text, "
            "so digits, CJK or code may become other tokens than the model was trained on"
        )
    return byte_level  # "gpt2", "default" and unknown kinds: GPT-2's own regex


def _gpt2(tokens, merges, pre):
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models

    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) if isinstance(m, str) else () for m in merges]
    for i, pair in enumerate(
        pairs
    ):  # each merge joins two tokens into a third, all in the vocabulary
        if len(pair) != 2 or not all(p in vocab for p in pair) or "".join(pair) not in vocab:
            raise TokenizerError(
                f"tokenizer.ggml.merges[{i}] ({merges[i]!r}) is not two tokens of the "
                f"vocabulary ({len(tokens)} tokens) that join into a third"
            )
    tok = HFTokenizer(
        models.BPE(vocab, pairs, ignore_merges=pre in ("llama-bpe", "llama3", "gpt-4o"))
    )
    tok.pre_tokenizer = _pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()
    return tok


def sentencepiece_merges(tokens, scores):
    """BPE merges from a SentencePiece vocabulary: every split of a piece into two known pieces,
    ranked by the score of the piece it makes (higher first)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = []
    for piece, score in zip(tokens, scores):
        local = [
            (piece[:k], piece[k:], score)
            for k in range(1, len(piece))
            if piece[:k] in vocab and piece[k:] in vocab
        ]
        merges += sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]]))
    merges.sort(key=lambda m: m[2], reverse=True)  # stable: ties keep the order above
    return [(a, b) for a, b, _ in merges]


def _llama(tokens, scores, unk_id, add_space_prefix):
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, normalizers

    vocab = {t: i for i, t in enumerate(tokens)}
    unk = tokens[unk_id] if unk_id is not None else None
    tok = HFTokenizer(
        models.BPE(
            vocab,
            sentencepiece_merges(tokens, scores),
            unk_token=unk,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    steps = [normalizers.Prepend("▁")] if add_space_prefix else []
    tok.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", "▁")])
    parts = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(
        parts + ([decoders.Strip(" ", 1, 0)] if add_space_prefix else [])
    )
    return tok


def from_gguf(path: Path) -> dict:
    """{"tokenizer": a tokenizers.Tokenizer, "bos_id", "stop_ids", "add_bos", "chat_template",
    "special"}."""
    reader = read(path)
    kind = field(reader, "tokenizer.ggml.model")
    tokens, types, scores = _vocabulary(reader, kind, path)
    tok = _bpe(reader, kind, tokens, scores, path)
    special = _add_special_tokens(tok, tokens, types)
    bos, stops = _bos_and_stops(reader, len(tokens), path)
    add_bos = field(reader, "tokenizer.ggml.add_bos_token", kind == "llama")
    return {
        "tokenizer": tok,
        "bos_id": bos,
        "stop_ids": stops,
        "add_bos": add_bos,
        "chat_template": field(reader, "tokenizer.chat_template"),
        "special": special,
    }


def _vocabulary(reader, kind, path):
    """(tokens, token types, scores) of the vocabulary, each list as long as the tokens (the
    scores only for the `llama` kind, which needs them)."""
    tokens = field(reader, "tokenizer.ggml.tokens")
    if not tokens:
        raise TokenizerError(
            f"{path}: no tokenizer in this GGUF file (tokenizer.ggml.tokens is missing)"
        )
    types = field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    scores = field(reader, "tokenizer.ggml.scores")
    for key, values in (("token_type", types), ("scores", scores if kind == "llama" else None)):
        if values is not None and len(values) != len(tokens):
            raise TokenizerError(
                f"{path}: tokenizer.ggml.{key} has {len(values)} entries for {len(tokens)} tokens"
            )
    return tokens, types, scores


def _bpe(reader, kind, tokens, scores, path):
    """The tokenizers.Tokenizer of the file's kind: `gpt2` byte-level BPE or `llama`
    SentencePiece."""
    if kind == "gpt2":
        try:
            return _gpt2(
                tokens,
                field(reader, "tokenizer.ggml.merges") or [],
                field(reader, "tokenizer.ggml.pre", "gpt2"),
            )
        except TokenizerError as e:
            raise TokenizerError(f"{path}: {e}") from None
    if kind == "llama":
        return _llama(
            tokens,
            scores,
            field(reader, "tokenizer.ggml.unknown_token_id"),
            field(reader, "tokenizer.ggml.add_space_prefix", True),
        )
    raise TokenizerError(
        f"{path}: tokenizer kind {kind!r} is not supported (supported: gpt2, llama)"
    )


def _add_special_tokens(tok, tokens, types) -> dict:
    """Control tokens added as special tokens (so `<|im_start|>` is one id), user-defined ones as
    added tokens; returns {control token: id}."""
    from tokenizers import AddedToken

    special = {t: i for i, (t, k) in enumerate(zip(tokens, types)) if k == CONTROL}
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tok.add_tokens(
        [AddedToken(t, normalized=False) for t, k in zip(tokens, types) if k == USER_DEFINED]
    )
    return special


def _bos_and_stops(reader, n_tokens: int, path):
    """(BOS id, [EOS, EOT, EOM ids]), each None or a token of the vocabulary."""
    bos = field(reader, "tokenizer.ggml.bos_token_id")
    stops = [field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    for key, value in zip(("bos", "eos", "eot", "eom"), [bos] + stops):
        if value is not None and not (isinstance(value, int) and 0 <= value < n_tokens):
            raise TokenizerError(
                f"{path}: tokenizer.ggml.{key}_token_id {value!r} is not a token of its {n_tokens}"
            )
    return bos, stops
