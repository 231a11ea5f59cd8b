"""Prompt scoring in the engine: the log-probability of every prompt token (what `echo` with
`logprobs` and lm-evaluation-harness's loglikelihood requests ask for), computed in the prefill
the prompt needs anyway, and cached by prefix like the KV blocks themselves.

    prompt   t0  t1  t2 ... t(L-1)        the logits at position p score token p + 1;
    scores   --  s1  s2 ... s(L-1)        t0 has no score (nothing predicts it)

The score of token p depends on tokens 0..p only, so the scores of a full block's own tokens
(positions [iB, (i+1)B) for block size B) are cached under the block's chained hash (paged.py's
prefix cache), content-addressed: an entry stays right after its block is evicted and needs no
invalidation, only a bound on how many are kept. A request reusing n scored blocks takes their
KV and scores, and recomputes the last cached position (position nB - 1, copy-on-write), whose
logits score its first token after them. A multiple-choice question's answers therefore compute
the shared question once:

    "Q: ... A: blue"    computes every block, caches its blocks' KV and scores
    "Q: ... A: green"   reuses the question's full blocks and their scores, computes the rest
Answers sent together would each compute the question side by side, so the scheduler holds back
a prompt to score while another running request is scoring the same first block.

Scores are the model's own log-softmax (sampling.token_logprobs), turned into float32 [rows,
vocab] LOGPROB_ROWS positions at a time, so a long prompt never holds [prompt_len, vocab].
"""
from collections import OrderedDict

from sampling import token_logprobs

LOGPROB_ROWS = 64  # prompt positions turned into log-probabilities at a time: float32 [64, vocab]


class PromptScores:
    """Scores per prefix block (LRU, at most `capacity` blocks) and the per-step bookkeeping."""

    def __init__(self, block_size: int, capacity: int):
        self.block_size, self.capacity = block_size, capacity
        self.cached = OrderedDict()  # block hash -> (top count, [score entry] * block_size)

    def usable_hits(self, req, hashes) -> int:
        """How many of the cached prefix blocks (with these hashes) also have scores for req: the
        prefix it may reuse. Fills req.prompt_logprobs from them."""
        k, n = req.params.prompt_logprobs, 0
        for h in hashes:
            entry = self.cached.get(h)
            if entry is None or entry[0] < k:
                break
            self.cached.move_to_end(h)
            n += 1
        bs = self.block_size
        for i in range(n):  # block i holds the scores of tokens i*bs ... (i+1)*bs - 1; take those not known yet
            have = len(req.prompt_logprobs)
            if (i + 1) * bs > have:
                req.prompt_logprobs += [e and (e[0], e[1][:k]) for e in self.cached[hashes[i]][1][have - i * bs:]]
        return n

    def positions(self, order, ends, batch):
        """[(request, flat index of position p, prompt token p + 1)]: the rows of this step whose
        logits score a prompt token, each token once even if its sequence is recomputed."""
        scored = []
        for s, end in zip(order, ends):
            req = s.request
            if req.scoring and s.index == 0:
                last = s.num_computed + batch[s] - 1  # the chunk's last position, at flat index `end`
                for p in range(max(s.num_computed, len(req.prompt_logprobs) - 1), min(last + 1, len(req.prompt) - 1)):
                    scored.append((req, end - (last - p), req.prompt[p + 1]))
        return scored

    def score(self, scored, logits):
        """logits [len(scored), V]: append each prompt token's score to its request."""
        for start in range(0, len(scored), LOGPROB_ROWS):
            part = scored[start:start + LOGPROB_ROWS]
            entries = token_logprobs(logits[start:start + len(part)], [t for _, _, t in part],
                                     [req.params.prompt_logprobs for req, _, _ in part])
            for (req, _, _), entry in zip(part, entries):
                req.prompt_logprobs.append(entry)

    def remember(self, req, block_index: int, block_hash):
        """Block block_index of req's prompt was just registered: cache its tokens' scores if known."""
        bs = self.block_size
        scores = req.prompt_logprobs
        if scores is None or len(scores) < (block_index + 1) * bs or not self.capacity:
            return
        entry = self.cached.get(block_hash)
        if entry is None or entry[0] < req.params.prompt_logprobs:
            self.cached[block_hash] = (req.params.prompt_logprobs, scores[block_index * bs:(block_index + 1) * bs])
        self.cached.move_to_end(block_hash)
        while len(self.cached) > self.capacity:
            self.cached.popitem(last=False)
