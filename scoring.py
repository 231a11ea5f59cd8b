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
a prompt to score while another running request is scoring the same first block (must_wait).
The engine (engine.py) calls the rest: positions and score around the forward, remember after.

Scores are the model's own log-softmax (token_logprobs, which the engine also uses for sampled
tokens), turned into float32 [rows, vocab] LOGPROB_ROWS positions at a time, so a long prompt
never holds [prompt_len, vocab].
"""

from collections import OrderedDict

import torch

LOGPROB_ROWS = 64  # prompt positions turned into log-probabilities at a time: float32 [64, vocab]


def token_logprobs(logits: torch.Tensor, tokens, top: list) -> list:
    """logits [R, V], tokens [R] ids, top [R] counts -> per row (log-probability of its token,
    [(id, log-probability)] of the top[r] most likely tokens, most likely first)."""
    logp = logits.float().log_softmax(-1)  # [R, V]
    chosen = logp.gather(-1, torch.as_tensor(tokens, device=logp.device)[:, None])[:, 0].tolist()
    k = max(top, default=0)
    values, ids = logp.topk(k, dim=-1) if k else (logp[:, :0], logp[:, :0].long())  # [R, k]
    values, ids = values.tolist(), ids.tolist()
    return [(c, list(zip(i[:n], v[:n]))) for c, i, v, n in zip(chosen, ids, values, top)]


class PromptScores:
    """Scores per prefix block (LRU, at most `capacity` blocks) and the per-step bookkeeping."""

    def __init__(self, block_size: int, capacity: int):
        self.block_size, self.capacity = block_size, capacity
        self.cached = OrderedDict()  # block hash -> (top count, [score entry] * block_size)

    def reusable_tokens(self, req, hashes) -> int:
        """The Scheduler's hook: how many tokens of a cached prefix (blocks with these hashes) req
        may reuse. A request scoring its prompt reuses only blocks whose scores are cached too
        (taking those scores), less their last position, whose logits score the next token."""
        bs = self.block_size
        if not req.scoring:
            return len(hashes) * bs
        k, n = req.params.prompt_logprobs, 0
        for h in hashes:
            entry = self.cached.get(h)
            if entry is None or entry[0] < k:
                break
            self.cached.move_to_end(h)
            n += 1
        for i in range(
            n
        ):  # block i holds the scores of tokens i*bs ... (i+1)*bs - 1; take those not known yet
            have = len(req.prompt_logprobs)
            if (i + 1) * bs > have:
                req.prompt_logprobs += [
                    e and (e[0], e[1][:k]) for e in self.cached[hashes[i]][1][have - i * bs :]
                ]
        return max(0, n * bs - 1)

    def must_wait(self, req, running) -> bool:
        """The Scheduler's hook: a prompt to score whose first block a running request scores now
        waits for it (its KV and scores are cached once done), so a question's answers compute
        the question once, not side by side."""
        bs = self.block_size
        if not (req.scoring and self.capacity and len(req.prompt) > bs):
            return False
        return any(s.request.scoring and s.request.prompt[:bs] == req.prompt[:bs] for s in running)

    def positions(self, order, ends, batch):
        """[(request, flat index of position p, prompt token p + 1)]: the rows of this step whose
        logits score a prompt token, each token once even if its sequence is recomputed."""
        scored = []
        for s, end in zip(order, ends):
            req = s.request
            if req.scoring and s.index == 0:
                last = (
                    s.num_computed + batch[s] - 1
                )  # the chunk's last position, at flat index `end`
                for p in range(
                    max(s.num_computed, len(req.prompt_logprobs) - 1),
                    min(last + 1, len(req.prompt) - 1),
                ):
                    scored.append((req, end - (last - p), req.prompt[p + 1]))
        return scored

    def score(self, scored, logits):
        """logits [len(scored), V]: append each prompt token's score to its request."""
        for start in range(0, len(scored), LOGPROB_ROWS):
            part = scored[start : start + LOGPROB_ROWS]
            entries = token_logprobs(
                logits[start : start + len(part)],
                [t for _, _, t in part],
                [req.params.prompt_logprobs for req, _, _ in part],
            )
            for (req, _, _), entry in zip(part, entries):
                req.prompt_logprobs.append(entry)

    def remember(self, seq):
        """After a step: cache the scores of seq's prompt blocks that are full and scored."""
        req, bs, k = seq.request, self.block_size, seq.request.params.prompt_logprobs
        if k is None or seq.index or not self.capacity:
            return
        full = min(len(seq.hashes), len(req.prompt_logprobs) // bs)
        for i in range(req.blocks_remembered, full):
            entry = self.cached.get(seq.hashes[i])
            if entry is None or entry[0] < k:
                self.cached[seq.hashes[i]] = (k, req.prompt_logprobs[i * bs : (i + 1) * bs])
            self.cached.move_to_end(seq.hashes[i])
        req.blocks_remembered = max(req.blocks_remembered, full)
        while len(self.cached) > self.capacity:
            self.cached.popitem(last=False)
