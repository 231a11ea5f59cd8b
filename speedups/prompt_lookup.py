"""Prompt lookup: draft tokens by copying them from the sequence itself, with no draft model.

Text that quotes its prompt (an edited code file, an answer copied from a passage, a summary)
repeats runs of tokens the sequence already holds. If the last n tokens (min_n <= n <= max_n)
also occur earlier, the tokens that followed them there are a good guess at what follows now;
the target model checks the guess in the step it runs anyway (engine.py verifies, exactly: a
draft is kept only where it is the token plain decoding would have produced).

    lookup = PromptLookup(k=4, min_n=1, max_n=3)
    lookup.propose(seqs, max_model_len)     # seq.draft for each: the tokens to verify this step
    find_draft([5, 6, 7, 1, 5, 6], k=2, min_n=1, max_n=3)   # [7, 1]: what followed "5 6"

The longest matching n wins, and among those the latest occurrence. Each sequence keeps an index
of where every min_n-gram starts (NgramIndex), extended as tokens arrive, so a step looks up the
candidates instead of scanning the whole context. Host-side only: no torch.
"""

MAX_CANDIDATES = 64  # the latest occurrences of the last min_n tokens tried per step


class NgramIndex:
    """Where each n-gram of a token list starts, for the n-grams followed by at least one token."""

    def __init__(self, n: int):
        self.n, self.starts, self.upto = n, {}, 0

    def extend(self, tokens):
        for i in range(self.upto, len(tokens) - self.n):  # tokens only grow: index the new starts
            self.starts.setdefault(tuple(tokens[i : i + self.n]), []).append(i)
        self.upto = max(self.upto, len(tokens) - self.n)


def find_draft(tokens, k: int, min_n: int, max_n: int, index: NgramIndex = None) -> list:
    """Up to k tokens that followed the latest earlier occurrence of the longest n-gram
    (min_n <= n <= max_n) ending `tokens`; [] when none occurs. index: tokens' NgramIndex(min_n)."""
    if len(tokens) <= min_n or k < 1:
        return []
    index = index or NgramIndex(min_n)
    index.extend(tokens)
    tail, best, longest = len(tokens) - min_n, None, 0
    for start in reversed(index.starts.get(tuple(tokens[tail:]), [])[-MAX_CANDIDATES:]):
        n = min_n  # grow the match backwards, up to max_n
        while (
            n < max_n
            and start > n - min_n
            and tokens[start - (n - min_n) - 1] == tokens[tail - (n - min_n) - 1]
        ):
            n += 1
        if n > longest:
            best, longest = start, n
            if n == max_n:
                break
    return [] if best is None else tokens[best + min_n : best + min_n + k]


def check_k(k):
    """--speculate_k, for every proposer: drafts per sequence and step."""
    if not (isinstance(k, int) and 1 <= k <= 16):
        raise ValueError(f"--speculate_k must be an integer in 1..16, got {k!r}")


class PromptLookup:
    """The engine's proposer: before each step, a draft of up to k tokens for every running
    sequence that decodes. Off for a step with more than `max_rows` decoding sequences: a large
    batch is no longer bound by reading the weights, so verifying drafts costs more than it saves
    (benchmarks/RESULTS.md, "Speculation in the engine")."""

    def __init__(self, k: int = 4, min_n: int = 1, max_n: int = 3, max_rows: int = 16):
        check_k(k)
        if not (isinstance(min_n, int) and isinstance(max_n, int) and 1 <= min_n <= max_n):
            raise ValueError(
                f"prompt lookup needs 1 <= --prompt_lookup_min <= --prompt_lookup_max, got {min_n} "
                f"and {max_n}"
            )
        self.k, self.min_n, self.max_n, self.max_rows = k, min_n, max_n, max_rows

    def propose(self, seqs, max_model_len: int):
        """Set seq.draft for each of `seqs` (the scheduler's running sequences)."""
        decoding = [s for s in seqs if len(s.tokens) - s.num_computed == 1]
        for s in seqs:
            s.draft = []
        if len(decoding) > self.max_rows:
            return
        for s in decoding:  # the tokens it may still emit, less the one the step adds anyway
            room = min(
                self.k,
                s.request.params.max_new_tokens - len(s.output) - 1,
                max_model_len - len(s.tokens) - 1,
            )
            if room > 0:
                s.ngrams = s.ngrams or NgramIndex(self.min_n)
                s.draft = find_draft(s.tokens, room, self.min_n, self.max_n, s.ngrams)


class PromptLookupDrafter:
    """speculative.py's drafter for generate.py (batch 1): find_draft's tokens, and their one-hot
    q."""

    def __init__(self, max_ngram, vocab_size):
        self.max_ngram, self.vocab_size = max_ngram, vocab_size

    def propose(self, tokens, k, generator=None):
        import torch  # (the engine's proposer above needs none)

        drafts = find_draft(tokens, k, 1, self.max_ngram)
        return drafts, torch.nn.functional.one_hot(
            torch.tensor(drafts), self.vocab_size
        ).float() if drafts else None

    def rollback(self, confirmed):
        pass
