"""Continuous batching over the paged KV cache: requests join and leave the running batch at every
step, long prompts prefill in chunks, and when KV blocks run out the newest request is preempted
and recomputed later (vLLM's scheduler; SGLang's longest-prefix-match policy).

    python batch.py --requests requests.jsonl            # one JSON request per line, '-' for stdin
    echo '{"prompt": "The sea is", "max_new_tokens": 20}' | python batch.py --requests -

Static batching runs a batch until its longest request finishes: the others idle, and waiting
requests wait. Here every `step()`:

  1. gives each running sequence its next tokens: decodes 1 token each (first, so they never
     stall), then unfinished prefills a chunk, all within `max_num_batched_tokens`;
  2. admits waiting requests (in `fcfs` or `lpm` order) while blocks, `max_num_seqs` and the
     token budget allow, reusing the KV blocks of their longest cached prefix (paged.py); when
     every slot is taken, a request with nothing running takes slots from one holding more than
     its fair share (max_num_seqs / requests present), so a large n does not starve the others;
  3. runs ONE forward over all scheduled tokens, flattened to [1, N] (paged.py explains why);
  4. samples each sequence that reached its end, frees the blocks of any that finished.
If a running sequence needs a block and none is free, the most recently admitted sequence is
preempted: its blocks are released (full ones stay in the prefix cache) and it waits at the
front of the queue to be recomputed, prompt and generated tokens together.

Each sequence samples with its own torch.Generator (seeded from the request's seed), and its
penalties (sampling.py) count its own tokens, so its output does not depend on what it was
batched with. A request with n > 1 prefills once; its samples then share the prompt's blocks
and copy only the block they write (copy-on-write).

The engine is incremental (`add_request`, `abort`, `step`), so a server can drive it; `generate`
runs a list of prompts offline. Output lines: {"id", "tokens", "text", "finish_reason",
"time_to_first_token_s"} or {"id", "error"}; a summary goes to stderr.
"""
import itertools
import time
from collections import Counter, deque

import torch

from cpu_kernels import gemm_padding
from paged import BlockAllocator, NoFreeBlocks, PagedKVCache, blocks_for, bucket
from runtime import compile_decode
from sampling import parse_logit_bias, sample, token_logprobs
from scoring import PromptScores
from sequence import Request, RequestParams, Sequence  # noqa: F401 (RequestParams: the engine's API)


def flat_forward(model, cache, tokens, input_pos, keep=None):
    """tokens, input_pos [1, N] -> logits [len(keep) or N, V]: the step's one forward."""
    return model(tokens, input_pos, cache, keep=keep)[0]


class Engine:
    """The continuous-batching loop over one model and one paged KV pool (see the module docstring).

    num_blocks, block_size: the pool (paged.plan_blocks sizes it from memory); max_num_seqs: most
    sequences running at once; max_num_batched_tokens: most tokens per step, so also the prefill
    chunk; policy: "fcfs" or "lpm"; stop_ids: the model's end tokens; tokenizer: needed for stop
    strings; compile: compile decode-only steps (one graph per batch bucket); reserve_tokens: make
    every sequence reserve this many tokens at admission, as a static cache would (benchmarks)."""

    def __init__(self, model, num_blocks: int, block_size: int = 16, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 512, prefix_caching: bool = True, policy: str = "fcfs",
                 stop_ids=(), tokenizer=None, compile: bool = False, reserve_tokens: int = None):
        if policy not in ("fcfs", "lpm"):
            raise ValueError(f"schedule policy must be fcfs or lpm, got {policy!r}")
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= max_num_seqs "
                             f"({max_num_seqs}): every running sequence needs a token per step")
        self.model, self.tokenizer, self.policy = model, tokenizer, policy
        self.device = model.norm.weight.device
        self.cache = PagedKVCache.for_model(model, num_blocks, block_size)
        self.allocator = BlockAllocator(num_blocks, block_size, prefix_caching and not reserve_tokens)
        self.block_size, self.max_num_seqs, self.max_num_batched_tokens = block_size, max_num_seqs, max_num_batched_tokens
        self.reserve_tokens = reserve_tokens  # set: reserve this many tokens per sequence at admission, like a static cache
        self.max_model_len = model.config.max_position_embeddings
        self.stop_ids = set(stop_ids)
        self.waiting, self.running, self.requests = deque(), [], {}
        self.next_id = 0
        # prompt scores by prefix block: host memory (~40 KB a block at top-20), so bounded apart from the pool
        self.scores = PromptScores(block_size, capacity=min(num_blocks, 8192) if self.allocator.prefix_caching else 0)
        self.stats = dict(steps=0, preemptions=0, peak_blocks=0, prompt_tokens=0, prompt_tokens_hit=0, peak_running=0)
        self.decode_fn = compile_decode(str(self.device), flat_forward, autotune=False) if compile else None

    # -- the incremental API -------------------------------------------------------------------
    def add_request(self, prompt, params: RequestParams = None, request_id=None):
        """Queue a request; returns its id. Raises ValueError (and queues nothing) if it is bad."""
        params = params or RequestParams()
        params.check()
        vocab = self.model.config.vocab_size
        if len(prompt) == 0:
            raise ValueError("the prompt is empty")
        if not all(isinstance(t, int) and 0 <= t < vocab for t in prompt):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        parse_logit_bias(params.logit_bias, vocab)  # its ids in the vocabulary
        if len(prompt) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(prompt)} tokens; the model's context is {self.max_model_len}, "
                             "which leaves no room to generate")
        usable = self.allocator.num_blocks - 1
        if blocks_for(max(len(prompt) + 1, self.reserve_tokens or 0), self.block_size) > usable:
            raise ValueError(f"the prompt has {len(prompt)} tokens but the whole KV pool holds "
                             f"{usable * self.block_size}; give more --num_blocks or --kv_cache_memory")
        if params.n > self.max_num_seqs:
            raise ValueError(f"n = {params.n} samples exceed max_num_seqs = {self.max_num_seqs}")
        if request_id is None:
            request_id, self.next_id = self.next_id, self.next_id + 1
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        req = Request(request_id, prompt, params, self.device)
        if params.constraint is not None:  # compiled now, so a bad grammar fails here, alone
            if self.tokenizer is None:
                raise ValueError("a constrained request needs the engine's tokenizer")
            from constrain import compile_constraint
            req.seqs[0].matcher = compile_constraint(params.constraint, self.tokenizer, vocab,
                                                     self.stop_ids | set(params.stop_token_ids))
        self.requests[request_id] = req
        self.waiting.append(req.seqs[0])
        return request_id

    def abort(self, request_id):
        """Stop a request now; its blocks are free at once."""
        req = self.requests.get(request_id)
        for seq in req.seqs if req else ():
            if seq in self.waiting:
                self.waiting.remove(seq)
            if not seq.finish_reason:
                self._finish(seq, "abort")

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self):
        """One iteration. Returns [(request_id, sample index, new token id, finish_reason or None)];
        the token is None when a request asked for none (max_new_tokens = 0, scoring its prompt)."""
        batch = self._schedule()
        if not batch:
            return []
        self.stats["steps"] += 1
        self.stats["peak_blocks"] = max(self.stats["peak_blocks"], self.allocator.num_used())
        self.stats["peak_running"] = max(self.stats["peak_running"], len(self.running))
        return self._run(batch)

    def generate(self, prompts, params):
        """Offline: every prompt (a list of ids) with its params (one, or one per prompt) -> results."""
        params = params if isinstance(params, list) else [params] * len(prompts)
        ids = [self.add_request(p, q) for p, q in zip(prompts, params)]
        while self.has_unfinished():
            self.step()
        return [self.requests.pop(i).result(self.tokenizer) for i in ids]

    # -- scheduling ----------------------------------------------------------------------------
    def _schedule(self) -> dict:
        budget, batch = self.max_num_batched_tokens, {}  # sequence -> tokens to compute this step
        # decodes (one token left) first, so a long prefill never stalls them; oldest first
        for seq in sorted(self.running, key=lambda s: len(s.tokens) - s.num_computed > 1):
            if seq not in self.running or budget == 0:
                continue
            n = min(len(seq.tokens) - seq.num_computed, budget)
            while not self._ensure_blocks(seq, n):
                victim = self.running[-1]  # the most recently admitted
                if victim is seq and len(self.running) == 1:  # alone and still does not fit
                    self._finish(seq, "length")
                    break
                budget += batch.pop(victim, 0)
                self._preempt(victim)
                if victim is seq:
                    break
            if seq in self.running:
                batch[seq] = n
                budget -= n
        while self.waiting and budget > 0:
            seq = self._next_waiting()
            if seq is None:  # all that wait are prompts to score whose head another request computes now
                break
            req = seq.request
            need = 1 if req.forked else req.params.n  # room for all its samples once it forks
            if len(self.running) + need > self.max_num_seqs:
                freed = self._take_fair_share(req, need)
                if freed is None:
                    break
                budget += sum(batch.pop(s, 0) for s in freed)
            hit, hashes = self.allocator.lookup_prefix(seq.tokens, (len(seq.tokens) - 1) // self.block_size)
            if req.scoring:  # only the cached blocks whose prompt scores are cached too
                usable = self.scores.usable_hits(req, hashes)
                hit, hashes = hit[:usable], hashes[:usable]
            for b in hit:
                self.allocator.share(b)
            seq.blocks, seq.hashes, seq.num_computed = hit, hashes, len(hit) * self.block_size
            if req.scoring and hit:  # the last cached position's logits score the next token
                seq.num_computed -= 1
            n = min(len(seq.tokens) - seq.num_computed, budget)
            reserve = max(n, (self.reserve_tokens or 0) - seq.num_computed)
            if not self._ensure_blocks(seq, reserve):
                self._release(seq)
                break
            self.waiting.remove(seq)
            self.running.append(seq)
            batch[seq] = n
            budget -= n
            self.stats["prompt_tokens"] += len(seq.tokens)
            self.stats["prompt_tokens_hit"] += seq.num_computed
            req.prompt_tokens_hit += seq.num_computed
        return batch

    def _next_waiting(self):
        """The waiting sequence to admit next, or None. A prompt to score whose first block a
        running request is scoring now waits for it (scoring.py caches that prefix's KV and scores
        once it is done), so a question's answers compute the question once, not side by side."""
        bs = self.block_size
        computing = {tuple(s.request.prompt[:bs]) for s in self.running if s.request.scoring}
        ready = [s for s in self.waiting if not (s.request.scoring and self.allocator.prefix_caching
                                                  and len(s.request.prompt) > bs
                                                  and tuple(s.request.prompt[:bs]) in computing)]
        if len(ready) <= 1:
            return ready[0] if ready else None
        if self.policy == "fcfs":  # the oldest of the requests with the fewest sequences running
            held = Counter(s.request for s in self.running)
            return min(ready, key=lambda s: held[s.request])  # min keeps the first of ties
        # lpm: the request with the longest cached prefix first (ties: the earliest)
        return max(ready, key=lambda s: len(self.allocator.lookup_prefix(
            s.tokens, (len(s.tokens) - 1) // bs)[0]))

    def _take_fair_share(self, req, need: int):
        """Every sequence slot is taken and req, with none running, waits: preempt the newest
        sequences of the request holding the most slots while it holds more than its fair share
        (max_num_seqs / requests present), so one request with a large n cannot make the others
        wait for all its samples. Returns the preempted sequences, or None if req must wait."""
        if any(s.request is req for s in self.running):
            return None
        present = {s.request for s in self.running} | {s.request for s in self.waiting}
        share = max(1, self.max_num_seqs // len(present))
        held = Counter(s.request for s in self.running)
        victims = []
        while len(self.running) - len(victims) + need > self.max_num_seqs:
            hog, count = held.most_common(1)[0]
            if count <= share:
                return None
            victims.append([s for s in reversed(self.running) if s.request is hog and s not in victims][0])
            held[hog] -= 1
        for victim in victims:
            self._preempt(victim)
        return victims

    def _ensure_blocks(self, seq, n: int) -> bool:
        """Blocks for seq's next n tokens, the block written first made private (copy-on-write)."""
        alloc = self.allocator
        first = seq.num_computed // self.block_size
        cow = first < len(seq.blocks) and alloc.ref[seq.blocks[first]] > 1
        need = max(0, blocks_for(seq.num_computed + n, self.block_size) - len(seq.blocks)) + cow
        if need > alloc.num_available():
            return False
        got = []
        try:
            while len(got) < need:
                got.append(alloc.allocate())
        except NoFreeBlocks:  # num_available also counted cached blocks that eviction cannot reach yet
            for b in got:
                alloc.release(b)
            return False
        if cow:
            private = got.pop(0)
            self.cache.copy_block(seq.blocks[first], private)
            alloc.release(seq.blocks[first])
            seq.blocks[first] = private
        seq.blocks += got
        return True

    def _release(self, seq):
        for b in seq.blocks:
            self.allocator.release(b)
        seq.blocks, seq.hashes, seq.num_computed = [], [], 0

    def _preempt(self, seq):
        self.running.remove(seq)
        self._release(seq)
        self.waiting.appendleft(seq)  # recomputed first when blocks free up
        self.stats["preemptions"] += 1

    def _finish(self, seq, reason: str):
        seq.finish_reason = reason
        if seq in self.running:
            self.running.remove(seq)
        self._release(seq)

    # -- running a step ------------------------------------------------------------------------
    def _run(self, batch: dict):
        ones = [s for s, n in batch.items() if n == 1]  # decodes (and one-token prefill tails): one group
        chunks = [s for s, n in batch.items() if n > 1]  # prefill chunks: a group each
        compiled = self.decode_fn is not None and not chunks and not any(s.request.scoring for s in ones)
        tokens, pos, groups, ends = [], [], [], []  # ends: flat index of each sequence's last token
        if compiled:  # one group, its rows padded to a bucket so that few graphs are compiled
            decode_groups = [ones]
        else:  # rows of similar context together, so each group's gather is close to its own length
            ones.sort(key=lambda s: -len(s.blocks))
            decode_groups = [list(g) for _, g in itertools.groupby(ones, key=lambda s: bucket(len(s.blocks)))]
        for group in decode_groups:
            width = bucket(max(len(s.blocks) for s in group))
            pad = bucket(len(group)) - len(group) if compiled else 0  # padding rows: position 0 of the null block
            table = [s.blocks + [0] * (width - len(s.blocks)) for s in group] + [[0] * width] * pad
            ends += [len(tokens) + i for i in range(len(group))]
            tokens += [s.tokens[s.num_computed] for s in group] + [0] * pad
            pos += [s.num_computed for s in group] + [0] * pad
            groups.append((len(group) + pad, 1, torch.tensor(table, device=self.device)))
        for s in chunks:
            n, start = batch[s], s.num_computed
            width = bucket(len(s.blocks))
            groups.append((1, n, torch.tensor([s.blocks + [0] * (width - len(s.blocks))], device=self.device)))
            tokens += s.tokens[start:start + n]
            pos += range(start, start + n)
            ends.append(len(tokens) - 1)
        # eager steps' token count padded as every layer's GEMMs want it (runtime.gemm_padding: few
        # shapes, few cached oneDNN kernels); compiled steps are padded to a bucket above
        pad = 0 if compiled else gemm_padding(len(tokens), self.model.norm.weight.dtype, self.device)
        if pad:  # padding rows: one-token rows at position 0 of the null block, never sampled
            groups.append((pad, 1, torch.zeros(pad, 1, dtype=torch.long, device=self.device)))
            tokens += [0] * pad
            pos += [0] * pad
        self.cache.groups = groups
        tokens = torch.tensor([tokens], device=self.device)
        pos = torch.tensor([pos], device=self.device)
        order = ones + chunks
        done = [s for s in order if s.num_computed + batch[s] == len(s.tokens)]  # these sample a token
        scored = self.scores.positions(order, ends, batch)  # (request, flat index, token): prompt scores
        with torch.no_grad():
            if compiled:
                logits = self.decode_fn(self.model, self.cache, tokens, pos)[: len(ones)]
            else:
                keep = [e for s, e in zip(order, ends) if s in done] + [e for _, e, _ in scored]
                logits = flat_forward(self.model, self.cache, tokens, pos, torch.tensor(keep, dtype=torch.long, device=self.device))
        if compiled:
            logits = logits[[i for i, s in enumerate(order) if s in done]]
        self.cache.groups = None
        self.scores.score(scored, logits[len(done):])
        for s in order:
            s.num_computed += batch[s]
            self._register_full_blocks(s)
        return self._sample(done, logits[: len(done)])

    def _register_full_blocks(self, seq):
        bs = self.block_size
        while len(seq.hashes) < seq.num_computed // bs:
            i = len(seq.hashes)
            parent = seq.hashes[-1] if seq.hashes else None
            seq.hashes.append(self.allocator.register(seq.blocks[i], parent, seq.tokens[i * bs:(i + 1) * bs]))
            if seq.index == 0 and seq.request.prompt_logprobs is not None:
                self.scores.remember(seq.request, i, seq.hashes[-1])

    def _sample(self, done, logits):
        now, events = time.perf_counter(), []
        rows = []  # (sequence, its logits row)
        for i, seq in enumerate(done):
            req = seq.request
            if not req.forked:  # the prompt is in the cache: its samples fork here, sharing every block
                for k in range(1, req.params.n):
                    twin = Sequence(req, k, req.seed + k)
                    twin.tokens, twin.num_computed = list(seq.tokens), seq.num_computed
                    twin.blocks, twin.hashes = list(seq.blocks), list(seq.hashes)
                    twin.matcher = seq.matcher and seq.matcher.copy()
                    for b in twin.blocks:
                        self.allocator.share(b)
                    req.seqs.append(twin)
                    self.running.insert(self.running.index(seq) + k, twin)
                    rows.append((twin, logits[i]))
                req.forked = True
            rows.append((seq, logits[i]))
        greedy = logits.argmax(-1).tolist() if len(done) else []
        row_of = {id(s): i for i, s in enumerate(done)}
        for seq, row in rows:
            if seq.finish_reason:  # its request failed on an earlier row
                continue
            req = seq.request
            if req.params.max_new_tokens == 0:  # only the prompt's scores were asked for
                self._finish(seq, "length")
                events.append((req.id, seq.index, None, "length"))
                continue
            try:  # a fault here (sampling, detokenizing for stop strings) ends this request only
                plain = seq.matcher is None and not req.sampling.adjusts_logits
                if req.sampling.temperature == 0 and id(seq) in row_of and plain:
                    token = greedy[row_of[id(seq)]]
                else:  # the constraint's mask, bias and penalties make new tensors: `logits` stays raw
                    allowed = row if seq.matcher is None else seq.matcher.mask_logits(row)
                    token = int(sample(allowed[None], req.sampling, seq.generator, [req.prompt], [seq.output]))
                if req.params.logprobs is not None:  # the model's own distribution: before any of that
                    seq.logprobs += token_logprobs(row[None], [token], [req.params.logprobs])
                seq.tokens.append(token)
                seq.token_times.append(now)
                reason = self._stop_reason(seq, token)
                if seq.matcher is not None and not reason:
                    seq.matcher.advance(token)
                    if seq.matcher.error:
                        raise ValueError(f"the constraint failed: {seq.matcher.error}")
                    reason = "stop" if seq.matcher.finished else None
            except Exception as e:
                self._fail(req, e)
                continue
            if reason:
                self._finish(seq, reason)
            events.append((seq.request.id, seq.index, token, reason))
        return events

    def _fail(self, req, exc):
        req.error = f"{type(exc).__name__}: {exc}"
        for seq in req.seqs:
            if seq in self.waiting:
                self.waiting.remove(seq)
            if not seq.finish_reason:
                self._finish(seq, "error")

    def _stop_reason(self, seq, token):
        p = seq.request.params
        if token in p.stop_token_ids or (token in self.stop_ids and not p.ignore_eos):
            return "stop"
        if p.stop and self.tokenizer:
            text = self.tokenizer.decode(seq.output)
            cut = min((i for i in (text.find(s) for s in p.stop) if i >= 0), default=-1)
            if cut >= 0:
                seq.text = text[:cut]
                return "stop"
        if len(seq.output) >= p.max_new_tokens or len(seq.tokens) >= self.max_model_len:
            return "length"
        return None

