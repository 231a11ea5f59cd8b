"""The serving engine: one step of continuous batching, run on the model. scheduler.py decides who
runs; the Engine turns its Plan into ONE forward over every scheduled token, flattened to [1, N]
(paged.py says why; step_layout.py lays the rows out), samples, decides stops once and returns
the step's events. It owns the requests: batch.py and server/engine_loop.py call only
add_request, abort, step, has_unfinished, metrics.

    engine = Engine.for_model(model, num_blocks=512, tokenizer=tok, stop_ids=tok.stop_ids)
    rid = engine.add_request(tok.encode("The sea is"), RequestParams(max_new_tokens=32))
    while engine.has_unfinished():
        for event in engine.step():       # Token(...) per new token, Finished(...) once per request
            print(event)

Each sequence samples with its own torch.Generator (seeded from the request's seed), and its
penalties (sampling.py) count its own tokens, so its sampling does not depend on what it was
batched with; its logits can (bf16), unless batch_invariant (batch_invariant.py). A request with
n > 1 prefills once; its samples fork when the prompt is computed.
Each token's text is decoded once, incrementally (text_stream.TextStream, which finds stop strings
too): the events carry the text a server streams. A fault while sampling one request ends that
request alone. Prompt scoring (scoring.py) is opt-in: the scheduler's hooks, then `positions`,
`score` and `remember` around the forward.
"""

import contextlib
import time
from collections import deque
from typing import NamedTuple

import torch

from memory import pools
from sampling import sample
from scheduler import Scheduler
from scoring import PromptScores, token_logprobs

# RequestParams: the engine's API, imported from here by its callers
from sequence import Request, RequestParams, check_request  # noqa: F401
from step_layout import Layout, pooled_rows
from text_stream import TextStream

QUEUE_TIMES = 1000  # the admitted requests metrics() takes queue-time percentiles over


class Token(NamedTuple):
    request_id: object
    index: int  # the sample, 0 .. n-1
    token: int  # None when a sample ends without one ("abort"; "length" after scoring the prompt)
    text: str  # the text this token makes final (TextStream; None when the engine has no tokenizer)
    finish_reason: str  # None while the sample goes on
    logprob: tuple  # its entry (scoring.token_logprobs) when logprobs were asked for, else None


class Finished(NamedTuple):
    request_id: object
    result: dict  # Request.result(): the output line, or {"id", "error"}
    request: Request  # its samples, times and scores; the engine has forgotten it


def flat_forward(model, cache, tokens, input_pos, keep=None):
    """tokens, input_pos [1, N] -> logits [len(keep) or N, V]: the step's one forward."""
    return model(tokens, input_pos, cache, keep=keep)[0]


def pooled_forward(model, cache, tokens, input_pos, keep, rows):
    """flat_forward's logits, and the final (normed) hidden states of the flat indices `rows`,
    float32 [len(rows), dim]: what embeddings pool, as HF's base models return them."""
    x = model.forward_layers(model.embed(tokens), input_pos, cache, model.layers)  # [1, N, dim]
    logits = model.head(x[:, keep])[0] if len(keep) else x.new_empty(0, model.config.vocab_size)
    return logits, model.norm(x[0, rows]).float()


class Engine:
    """model, cache (paged.PagedKVCache), scheduler (over the cache's blocks; scoring.PromptScores
    to score prompts); stop_ids: end tokens; tokenizer: for text and stop strings; compile: steps
    that only decode or verify drafts."""

    def __init__(
        self,
        model,
        cache,
        scheduler,
        tokenizer=None,
        stop_ids=(),
        compile=False,
        batch_invariant=False,
        speculate=None,
    ):
        mine, theirs = (
            [cache.num_blocks] + [cache.window_blocks] * bool(cache.window_blocks),
            [a.num_blocks for a in scheduler.pools],
        )
        if (mine, cache.block_size) != (theirs, scheduler.block_size):
            raise ValueError(
                f"the cache has pools of {mine} blocks of {cache.block_size} tokens, the "
                f"scheduler's allocators {theirs} of {scheduler.block_size}"
            )
        self.model, self.cache, self.scheduler, self.tokenizer = model, cache, scheduler, tokenizer
        self.device, self.stop_ids = model.norm.weight.device, set(stop_ids)
        self.max_model_len = model.config.max_position_embeddings
        self.queue_times = deque(maxlen=QUEUE_TIMES)  # seconds from arrival to the first step
        # pending: abort's events, for the next step
        self.requests, self.pending, self.next_id = {}, [], 0
        self.speculate = speculate  # speedups/prompt_lookup.py, speedups/draft_model.py
        self.drafted = dict(draft_tokens=0, draft_tokens_accepted=0)
        self.adapters = None  # LoRA adapters (lora.Adapters) wrapping the model, if any
        self.decode_fn = None
        if compile:  # an option: compiling.py (and torch.compile) imported where it is switched on
            from compiling import compile_decode

            self.decode_fn = compile_decode(str(self.device), flat_forward, autotune=False)
        # batch_invariant.py: one route and one attention for every row; `pieces` cuts prefill
        # chunks
        self.batch_invariant, self.pieces = batch_invariant, None
        if batch_invariant:
            if compile:
                raise ValueError(
                    "--batch_invariant runs eager steps (a compiled step's kernels follow its "
                    "batch); leave out --compile"
                )
            import batch_invariant as invariant  # an option: imported where it is switched on

            invariant.enable(model, cache)
            self.pieces = invariant.pieces
        self.layout = Layout(cache.block_size, len(scheduler.pools), model, self.pieces)

    @classmethod
    def for_model(
        cls,
        model,
        num_blocks: int,
        block_size: int = 16,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 512,
        prefix_caching: bool = True,
        policy: str = "fcfs",
        stop_ids=(),
        tokenizer=None,
        compile: bool = False,
        reserve_tokens: int = None,
        batch_invariant: bool = False,
        window_blocks: int = None,
        speculate=None,
        tier=None,
    ):
        """An engine with its own KV pools (memory.pools) and prompt scoring; speculate: a proposer
        (prompt_lookup.PromptLookup, draft_model.DraftModel: `propose(seqs, max_model_len)` sets
        each seq.draft, at most `k` tokens, and seq.draft_probs) or None; tier: a second tier for
        evicted prefix blocks (speedups/kv_tier.py) or None."""
        allocator, windows, cache = pools(
            model,
            num_blocks,
            block_size,
            prefix_caching and not reserve_tokens,
            window_blocks,
            max_num_seqs,
            max_num_batched_tokens,
        )
        # prompt scores by prefix block: host memory (~40 KB a block at top-20), so bounded apart
        # from the pool
        scores = PromptScores(
            block_size, capacity=min(num_blocks, 8192) if allocator.prefix_caching else 0
        )
        scheduler = Scheduler(
            allocator,
            max_num_seqs,
            max_num_batched_tokens,
            policy,
            reserve_tokens,
            scores,
            windows,
            tier,
        )
        if tier is not None:  # what a loaded block must look like (speedups/kv_tier.py)
            tier.expected = cache.block_shapes()  # per pool
        return cls(
            model, cache, scheduler, tokenizer, stop_ids, compile, batch_invariant, speculate
        )

    # -- the request lifecycle -----------------------------------------------------------------
    def add_request(self, prompt, params: RequestParams = None, request_id=None):
        """Queue a request; returns its id. Raises ValueError (and queues nothing) if it is bad."""
        params = params or RequestParams()
        if params.pooling is None or params.score_tokens:
            self.model.check_head()
        if params.pooling and getattr(self, "ranks", 1) > 1:  # (pooled_forward is one process's)
            raise ValueError("embeddings run in one process; this engine is tensor-parallel")
        check_request(
            prompt,
            params,
            self.model.config.vocab_size,
            self.max_model_len,
            self.scheduler,
            self.tokenizer,
        )
        if request_id is None:
            request_id, self.next_id = self.next_id, self.next_id + 1
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        req = Request(request_id, prompt, params, self.device)
        if params.adapter is not None:  # its rows' slot; its prefixes hashed apart from others'
            if self.adapters is None:
                raise ValueError(f"adapter {params.adapter!r}: this engine serves no adapters")
            req.lora_slot = self.adapters.slot_of(params.adapter, self.requests.values())
            req.hash_root = self.adapters.host[params.adapter].key
        req.seqs[0].stream = self._stream(params)
        if params.constraint is not None:  # compiled now, so a bad grammar fails here, alone
            from constrain import compile_constraint

            req.seqs[0].matcher = compile_constraint(
                params.constraint,
                self.tokenizer,
                self.model.config.vocab_size,
                self.stop_ids | set(params.stop_token_ids),
            )
        self.requests[request_id] = req
        if self.scheduler.tier is not None:  # its prefix read from disk while it waits
            self.scheduler.tier.prefetch(req, self.scheduler.pools)
        self.scheduler.add(req.seqs[0])
        return request_id

    def _stream(self, params):
        return TextStream(self.tokenizer, params.stop) if self.tokenizer else None

    @staticmethod
    def _ended(
        seq, reason: str
    ) -> Token:  # a sample ends without a token: the text its stream held back
        return Token(
            seq.request.id, seq.index, None, seq.stream and seq.stream.finish(reason), reason, None
        )

    def abort(self, request_id, error: str = None):
        """End a request now (`error`: as failed), its blocks free at once; its "abort" events and
        Finished come with the next step. Aborting it again does nothing."""
        if request_id not in self.requests:
            raise ValueError(
                f"no request {request_id!r} here: never added, or already returned as Finished"
            )
        req = self.requests[request_id]
        req.error = req.error or error
        for seq in req.seqs:
            if not seq.finish_reason:
                self.scheduler.finish(seq, "abort")
                self.pending.append(self._ended(seq, "abort"))
        for k in range(
            len(req.seqs), req.params.n if req.needs_fork else 0
        ):  # samples not forked yet
            self.pending.append(
                Token(req.id, k, None, "" if self.tokenizer else None, "abort", None)
            )
        req.needs_fork = False

    def has_unfinished(self) -> bool:
        return bool(self.requests)  # (pending events belong to requests not yet Finished)

    def metrics(self) -> dict:
        """A snapshot (plain numbers, which another thread may read). Time in the queue: from
        a request's arrival to its first step, over the last QUEUE_TIMES admitted; the oldest
        waiting: the longest any request now waiting, and not yet run, has been in the queue (read
        after a step, on the engine's thread; server/engine_loop.py keeps that snapshot)."""
        s, now = self.scheduler, time.perf_counter()
        waited = sorted(self.queue_times)
        return {
            **s.stats,
            **(s.tier.stats if s.tier else {}),
            **self.drafted,
            "requests": len(self.requests),
            "kv_blocks_total": sum(a.num_blocks - 1 for a in s.pools),
            "running": len({q.request.id for q in s.running}),
            "kv_blocks_used": s.blocks_used(),
            "waiting": len({q.request.id for q in s.waiting}),
            "queue_time_p50_s": waited[len(waited) // 2] if waited else 0.0,
            "queue_time_p99_s": waited[min(len(waited) - 1, len(waited) * 99 // 100)]
            if waited
            else 0.0,
            "oldest_waiting_s": max(
                (now - q.request.arrival for q in s.waiting if q.request.admitted is None),
                default=0.0,
            ),
        }

    def _note_admitted(self, plan):
        """A request's first step ends its time in the queue."""
        now = time.perf_counter()
        for seq in plan.runs:
            if seq.request.admitted is None:
                seq.request.admitted = now
                self.queue_times.append(now - seq.request.arrival)

    def run_batch(self, prompts, params) -> list:
        """Offline: every prompt (ids) with its params (one, or one per prompt) -> its result, in
        order."""
        params = params if isinstance(params, list) else [params] * len(prompts)
        ids, results = [self.add_request(p, q) for p, q in zip(prompts, params)], {}
        while self.has_unfinished():
            results.update((e.request_id, e.result) for e in self.step() if isinstance(e, Finished))
        return [results[i] for i in ids]

    def step(self) -> list:
        """One iteration: a Token per new token (or sample ended without one), then a Finished per
        request over."""
        if (
            self.speculate and self.scheduler.draft_budget() > 0
        ):  # drafts for the sequences that decode, verified by this step's forward
            self.speculate.propose(self.scheduler.running, self.max_model_len)
        plan, events = (
            self.scheduler.schedule(),
            [],
        )  # pending stays until returned (a step may raise)
        self.pending += [self._ended(seq, "length") for seq in plan.ended]
        self._note_admitted(plan)
        for h, parent, tokens, block, pool in plan.saves:  # evicted: to the tier before writes
            self.scheduler.tier.put(h, parent, tokens, *self.cache.block_kv(block, pool), pool)
        for block, kv, pool in plan.loads:  # the tier's blocks of admitted prefixes, in
            self.cache.load_block(block, *kv, pool)
        self.scheduler.loaded(plan)
        for src, dst, pool in plan.copies:  # copy-on-write, before the forward writes
            self.cache.copy_block(src, dst, pool)
        if plan.runs:
            done, logits, embedded = self._forward(plan)
            results = self._sample(plan, done, logits, events)
            events += [self._ended(seq, "stop") for seq in embedded]  # done: nothing to sample
            self.scheduler.update(plan, results + [(seq, None, "stop") for seq in embedded])
            for seq in plan.runs if self.scheduler.scores else ():
                self.scheduler.scores.remember(seq)
        events, self.pending = self.pending + events, []
        for rid in [rid for rid, r in self.requests.items() if r.finished]:
            req = self.requests.pop(rid)
            events.append(Finished(rid, req.result(), req))
        return events

    # -- running a step ------------------------------------------------------------------------
    def _forward(self, plan):
        """The step's one forward -> (sequences that sample now, their logits [1 + drafts each,
        V], embeddings whose prompt is now whole)."""
        scores, drafts = self.scheduler.scores, (lambda s: len(plan.drafts.get(s, ())))
        compiled = self.decode_fn is not None and all(
            (n == 1 or s in plan.drafts)
            and not (s.request.scoring or s.request.params.pooling or s.request.params.adapter)
            for s, n in plan.runs.items()
        )
        k = self.speculate.k if plan.drafts else 0
        order, tokens, pos, groups, ends, slots = self.layout(plan, compiled, k)
        # each row's adapter (speedups/lora.py: its columns), for this forward only
        rows = self.adapters.rows(slots) if self.adapters else contextlib.nullcontext()
        pooled = any(s.request.params.pooling for s in order)
        done = [
            s
            for s in order
            if s.num_computed + plan.runs[s] == len(s.tokens) + drafts(s)
            and not s.request.params.pooling
        ]  # these sample
        sampling = set(done)
        sampled = [
            i for s, e in zip(order, ends) if s in sampling for i in range(e - drafts(s), e + 1)
        ]
        scored = (
            scores.positions(order, ends, plan.runs) if scores else []
        )  # (request, flat index, token)
        heads = [  # embeddings that are their last position's logits (a reranker's yes and no)
            (s, e)
            for s, e in zip(order, ends)
            if s.request.params.score_tokens and s.num_computed + plan.runs[s] == len(s.tokens)
        ]
        tokens, pos = (
            torch.tensor([tokens], device=self.device),
            torch.tensor([pos], device=self.device),
        )
        with torch.no_grad(), self.cache.step_groups(groups), rows:
            if compiled:
                logits = self.decode_fn(self.model, self.cache, tokens, pos)[sampled]
            else:
                flat = sampled + [e for _, e, _ in scored] + [e for _, e in heads]
                keep = torch.tensor(flat, dtype=torch.long, device=self.device)
                if pooled:
                    rows, spans = pooled_rows(plan, order, ends)
                    logits, states = pooled_forward(self.model, self.cache, tokens, pos, keep, rows)
                else:
                    logits = flat_forward(self.model, self.cache, tokens, pos, keep)
        if scored:
            scores.score(scored, logits[len(sampled) : len(sampled) + len(scored)])
        embedded = []  # the embeddings' states into their requests; those whose prompt is whole
        for s, i, m in spans if pooled else ():
            whole = s.num_computed + plan.runs[s] == len(s.tokens)
            s.request.pool(states[i : i + m], s.num_computed == 0, whole)
            if whole:
                embedded.append(s)
        for (s, _), row in zip(heads, logits[len(sampled) + len(scored) :]):
            s.request.pooled = row[s.request.params.score_tokens].float().cpu()
        return done, logits[: len(sampled)], embedded

    def _sample(self, plan, done, logits, events) -> list:
        """The next token(s) of each sequence in `done` (n samples fork at the first): [(sequence,
        token, finish reason or None)] for the scheduler (plan.runs: a drafted one's kept); appends
        the events."""
        now, rows, results, i = time.perf_counter(), [], [], 0
        for seq in done:
            rows.append((seq, i))
            req = seq.request
            if req.needs_fork:  # the prompt is in the cache: its other samples start here
                twins = [seq.fork(k, self._stream(req.params)) for k in range(1, req.params.n)]
                req.seqs, req.needs_fork = req.seqs + twins, False
                plan.forks.append((seq, twins))
                rows += [(twin, i) for twin in twins]
            i += 1 + len(plan.drafts.get(seq, ()))
        greedy = logits.argmax(-1).tolist() if len(done) else []
        for seq, i in rows:
            req = seq.request
            if seq.finish_reason:  # its request failed on an earlier row
                continue
            if req.params.max_new_tokens == 0:  # only the prompt's scores were asked for
                results.append((seq, None, "length"))
                events.append(self._ended(seq, "length"))
                continue
            draft = plan.drafts.get(seq, [])
            try:  # a fault here (sampling, a constraint, detokenizing) ends this request only
                new = self._verify(
                    seq, logits[i : i + 1 + len(draft)], greedy[i : i + 1 + len(draft)], draft, now
                )
            except Exception as e:
                self._fail(req, e)
                continue
            results += [(seq, token, reason) for token, _, reason in new]
            events += [
                Token(req.id, seq.index, *t, lp)
                for t, lp in zip(new, seq.logprobs[-len(new) :] or [None] * len(new))
            ]
            if draft:  # its K/V is valid up to the last token it kept
                plan.runs[seq] = len(new)
                self.drafted["draft_tokens"] += len(draft)
                self.drafted["draft_tokens_accepted"] += sum(
                    t == d for (t, _, _), d in zip(new, draft)
                )
        return results

    def _verify(self, seq, rows, greedy: list, draft: list, now: float) -> list:
        """seq's tokens from its rows [1 + len(draft), V], each sampled as plain decoding would
        (given seq.draft_probs, the distributions the drafts were drawn from: by sampling.sample's
        rule for them), while they equal the draft's -> [(token, text, reason)]."""
        new, q = [], seq.draft_probs
        for j in range(len(draft) + 1):
            drafted = (q[j], draft[j]) if q is not None and j < len(draft) else ()
            token, text, reason = self._next_token(
                seq, rows[j], greedy[j], now, [t for t, _, _ in new], drafted
            )
            new.append((token, text, reason))
            if reason or j == len(draft) or token != draft[j]:
                return new

    def _next_token(self, seq, row, greedy: int, now: float, new=(), drafted=()):
        """seq's next token from its row [V], after `new` this step (drafted: (q, token) to keep or
        replace) -> (token, text made final, reason or None)."""
        req, p = seq.request, seq.request.params
        if (
            req.sampling.temperature == 0
            and seq.matcher is None
            and not req.sampling.adjusts_logits
        ):
            token = greedy
        else:  # the constraint's mask, bias and penalties make new tensors: `row` stays raw
            allowed = row if seq.matcher is None else seq.matcher.mask_logits(row)
            token = int(
                sample(
                    allowed[None],
                    req.sampling,
                    seq.generator,
                    [req.prompt],
                    [seq.output + list(new)],
                    *drafted,
                )
            )
        if p.logprobs is not None:  # the model's own distribution: before any of that
            seq.logprobs += token_logprobs(row[None], [token], [p.logprobs])
        seq.token_times.append(now)
        reason = (
            "stop"
            if token in p.stop_token_ids or (token in self.stop_ids and not p.ignore_eos)
            else None
        )
        length = len(seq.tokens) + len(new) + 1
        if not reason and (
            length - len(req.prompt) >= p.max_new_tokens or length >= self.max_model_len
        ):
            reason = "length"
        text = seq.stream.add(token, reason) if seq.stream else None
        reason = (
            "stop" if seq.stream and seq.stream.stop_string else reason
        )  # a stop string wins over "length"
        if seq.matcher is not None and not reason:
            seq.matcher.advance(token)
            if seq.matcher.error:
                raise ValueError(f"the constraint failed: {seq.matcher.error}")
            if seq.matcher.finished:
                reason, text = "stop", text + seq.stream.finish("stop")
        return token, text, reason

    def _fail(self, req, exc):
        req.error = f"{type(exc).__name__}: {exc}"
        for seq in req.seqs:
            if not seq.finish_reason:
                self.scheduler.finish(seq, "error")
