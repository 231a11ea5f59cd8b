"""Speculative decoding: a cheap drafter proposes k tokens, the target checks them in one forward.

    python generate.py --draft_layers 8 --speculate_k 3 --temperature 0 --prompt "..."  # LayerSkip
    python generate.py --prompt_lookup 3 --speculate_k 3 --prompt "..."  # no draft model
    python generate.py --draft_checkpoint SMALL_MODEL --speculate_k 3 --prompt "..."

Decode at batch 1 is bound by reading the weights, so scoring k+1 positions costs the target
about as much as scoring one. Each round:
  1. the drafter proposes d_1..d_k with probabilities q_i(x) (one-hot for deterministic drafters);
  2. the target runs once over [last token, d_1..d_k] and gives p_1..p_{k+1};
  3. d_i is accepted with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection the
     token is resampled from norm(max(p_i - q_i, 0)) and the round ends; if all k are accepted,
     a bonus token is sampled from p_{k+1}.
This emits exactly the target's distribution (Leviathan et al. 2023; Chen et al. 2023), whatever
the drafter. At temperature 0 p and q are one-hot argmaxes, so the rule keeps a draft exactly
when it is the target's argmax: output identical to plain greedy decoding.

Rolling back is bookkeeping: the static cache masks every slot after a query's position, so the
K/V written for rejected drafts are never read, and are overwritten by the next round. Each
model only remembers how many tokens of the sequence it has valid K/V for (`valid`), and feeds
the rest at the start of its next forward: the first round's target forward is the prefill.
With c = cost of a draft step / cost of a target step and acceptance rate alpha, the expected
speed-up is (1 - alpha^(k+1)) / ((1 - alpha) (k c + 1)).
"""

import time

import torch

from kv_cache import StaticKVCache
from sampling import SamplingParams, probabilities


def accept(drafts, draft_probs, target_probs, generator=None):
    """The accept/reject rule for one round. drafts [k] (long), draft_probs [k, V],
    target_probs [k+1, V] -> (number of drafts accepted, the next token after them)."""
    k = drafts.shape[0]
    idx = torch.arange(k, device=drafts.device)
    p = target_probs[idx, drafts]  # [k] target probability of each draft
    q = draft_probs[idx, drafts]
    u = torch.rand(k, generator=generator, device=drafts.device)
    ok = u * q < p  # u < p / q without dividing by zero; q > 0 for any token the drafter sampled
    n = int(ok.long().cumprod(0).sum()) if k else 0  # accepted prefix length: one host sync
    if n == k:
        dist = target_probs[k]  # every draft accepted: a bonus token from the last position
    else:
        dist = (target_probs[n] - draft_probs[n]).clamp(min=0)
        dist = dist / dist.sum() if dist.sum() > 0 else target_probs[n]
    return n, int(torch.multinomial(dist, 1, generator=generator))


def draft_forward(model, cache, tokens, input_pos, layers=None):
    """The draft's logits for the last position [B, V]: a whole model, or its first `layers`."""
    if layers is None:
        return model(tokens, input_pos, cache, last_only=True)[:, -1]
    return layer_skip_forward(model, tokens, input_pos, cache, layers)[:, -1]


class ModelDrafter:
    """Drafts by sampling from a smaller model (or the target's own first layers: LayerSkip).

    step_fn: a compiled draft_forward used for the one-token steps (static shapes)."""

    def __init__(self, model, max_seq_len, params, layers=None, step_fn=None):
        self.model, self.params, self.layers, self.step_fn = model, params, layers, step_fn
        self.cache = StaticKVCache.for_model(model, 1, max_seq_len)
        self.valid = 0  # tokens of the sequence whose K/V in self.cache are right

    def logits(self, tokens, start):
        x = torch.tensor([tokens], device=self.cache.slots.device)
        pos = torch.arange(start, start + len(tokens), device=x.device)[None]
        fn = self.step_fn if self.step_fn is not None and len(tokens) == 1 else draft_forward
        with torch.no_grad():
            return fn(self.model, self.cache, x, pos, self.layers)[0]

    def propose(self, tokens, k, generator=None):
        drafts, probs = [], []
        feed, start = tokens[self.valid :], self.valid
        for _ in range(k):
            p = probabilities(
                self.logits(feed, start),
                self.params.temperature,
                self.params.top_k,
                self.params.top_p,
                self.params.min_p,
            )
            d = (
                int(torch.multinomial(p, 1, generator=generator))
                if self.params.temperature > 0
                else int(p.argmax())
            )
            start += len(feed)
            drafts.append(d)
            probs.append(p)
            feed = [d]
        self.valid = start  # the last draft was never fed
        return drafts, torch.stack(probs) if probs else None

    def rollback(self, confirmed):
        self.valid = min(self.valid, confirmed)


def layer_skip_forward(model, tokens, input_pos, cache, n_layers):
    """The target's first n_layers, then its final norm and output head: a draft in the same
    weights."""
    x = model.forward_layers(model.embed(tokens), input_pos, cache, model.layers[:n_layers])
    return model.head(x[:, -1:])


def verify(target, cache, unseen, valid, drafts, draft_probs, params, generator, verify_fns):
    """One forward of the target over the tokens it has not seen (from position `valid`) and the
    drafts -> (n drafts accepted, the token after them): accepted as the rule keeps the target's
    distribution, or, with no drafts, one token sampled from the target's own."""
    device = cache.slots.device
    feed = unseen + drafts  # the target's one forward this round
    T = padded_length(len(feed), valid, verify_fns, cache)
    x = torch.tensor([feed + feed[-1:] * (T - len(feed))], device=device)
    pos = torch.arange(valid, valid + T, device=device)[None]
    with torch.no_grad():
        if T in verify_fns:  # a compiled compiling.verify_step for this length
            logits = verify_fns[T](target, cache, x, pos)
        else:
            logits = target(x, pos, cache)
    logits = logits[0, len(unseen) - 1 : len(feed)]  # [len(drafts) + 1, V]
    p = probabilities(logits, params.temperature, params.top_k, params.top_p, params.min_p)
    if drafts:
        return accept(torch.tensor(drafts, device=device), draft_probs.to(device), p, generator)
    if params.temperature > 0:
        return 0, int(torch.multinomial(p[0], 1, generator=generator))
    return 0, int(p[0].argmax())


def padded_length(n: int, valid: int, verify_fns: dict, cache) -> int:
    """The length a feed of n tokens at positions valid.. runs at: the shortest compiled one of at
    least n whose positions fit the cache, else n (eager). The padding's K/V land past the feed's,
    in slots the next rounds write again before any query sees them, as rejected drafts' do."""
    fits = [t for t in verify_fns if n <= t and valid + t <= getattr(cache, "max_seq_len", 0)]
    return min(fits, default=n)


def speculation_stats(out, counts, target_s, total_s, first_token_s) -> dict:
    """The stats speculative_generate returns: counts (rounds, drafted, accepted, draft_s) and
    rates derived from them; tokens/s counts the tokens after the first, over the time after it."""
    rounds, drafted, decode_s = counts["rounds"], counts["drafted"], total_s - first_token_s
    return {
        **counts,
        "acceptance_rate": counts["accepted"] / drafted if drafted else 0.0,
        "tokens_per_round": len(out) / rounds if rounds else 0.0,
        "target_s": target_s,
        "total_s": total_s,
        "time_to_first_token_s": first_token_s,
        "tokens_per_s": (len(out) - 1) / decode_s if len(out) > 1 and decode_s > 0 else 0.0,
    }


def speculative_generate(
    target,
    cache,
    drafter,
    prompt,
    max_new_tokens,
    params: SamplingParams,
    k=4,
    generator=None,
    stop_ids=(),
    ignore_eos=False,
    on_token=None,
    verify_fns=None,
):
    """Batch-1 speculative decoding. prompt: list of ids. Returns (new tokens, stats).

    verify_fns: {T: compiled compiling.verify_step} for the forward lengths that recur (k + 1
    after the first round, 1 when a drafter proposes nothing); a shorter feed is padded up to one
    of them (padded_length), a longer one (the prompt's) runs eagerly."""
    if params.adjusts_logits:  # p must be the distribution plain decoding samples from
        raise ValueError(
            "speculative decoding here takes no logit_bias or repetition, frequency or presence "
            "penalty"
        )
    verify_fns = verify_fns or {}
    tokens, valid, stop = list(prompt), 0, set() if ignore_eos else set(stop_ids)
    rounds = drafted = accepted = 0
    draft_s = target_s = 0.0
    start = time.perf_counter()
    first_token_s = None
    while len(tokens) - len(prompt) < max_new_tokens:
        t0 = time.perf_counter()
        want = min(k, max_new_tokens - (len(tokens) - len(prompt)) - 1)
        drafts, draft_probs = drafter.propose(tokens, want, generator) if want > 0 else ([], None)
        t1 = time.perf_counter()
        n, nxt = verify(
            target, cache, tokens[valid:], valid, drafts, draft_probs, params, generator, verify_fns
        )
        t2 = time.perf_counter()
        draft_s, target_s = draft_s + (t1 - t0), target_s + (t2 - t1)
        confirmed = len(tokens) + n  # tokens whose K/V the target (and the drafter) hold right
        new = drafts[:n] + [nxt]
        rounds, drafted, accepted = rounds + 1, drafted + len(drafts), accepted + n
        valid = confirmed
        drafter.rollback(confirmed)
        for t in new:
            tokens.append(t)
            if first_token_s is None:
                first_token_s = time.perf_counter() - start
            if on_token:
                on_token(torch.tensor([t]))
            if t in stop or len(tokens) - len(prompt) >= max_new_tokens:
                break
        if tokens[-1] in stop:
            break
    total_s = time.perf_counter() - start
    out = tokens[len(prompt) :]
    counts = dict(rounds=rounds, drafted=drafted, accepted=accepted, draft_s=draft_s)
    stats = speculation_stats(out, counts, target_s, total_s, first_token_s or total_s)
    return out, stats
