"""What the engine tracks per request: its parameters (RequestParams, checked before anything is
queued), its samples (Sequence: tokens, block table, generator, log-probabilities) and the
request itself (Request: its prompt, its samples, its prompt scores, its output line).
scheduler.py moves these between its queues, engine.py fills them in; nothing here runs the model.

    from sequence import RequestParams
    params = RequestParams(max_new_tokens=32, temperature=0.7, n=2, logprobs=5)
    params.check()      # ValueError naming the field, before anything is queued
"""

import time
from dataclasses import dataclass, field

import torch

from sampling import MAX_LOGPROBS, SamplingParams, check_sampling, parse_logit_bias
from scheduler import blocks_for


@dataclass
class RequestParams:
    max_new_tokens: int = 128
    temperature: float = 1.0  # OpenAI's default; 0 is greedy
    top_k: int = None
    top_p: float = 1.0
    min_p: float = 0.0  # sampling.py defines these five; each default is off
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict = field(default_factory=dict)  # token id -> bias (JSON's string keys accepted)
    seed: int = None  # None: a random seed
    stop: list = field(default_factory=list)  # strings that end the output (not included in text)
    stop_token_ids: list = field(default_factory=list)  # ids that end it, besides the model's own
    ignore_eos: bool = False  # do not stop at the model's end-of-sequence tokens
    n: int = 1  # samples of this prompt
    logprobs: int = (
        None  # per output token: its log-probability and the `logprobs` most likely (0-20)
    )
    prompt_logprobs: int = (
        None  # the same for each prompt token but the first; max_new_tokens may then be 0
    )
    constraint: object = (
        None  # constrain.Constraint: the output must match it (JSON schema, regex, ...)
    )
    priority: int = 0  # lower is sooner, under the "priority" schedule policy only (vLLM's)
    # an embedding: the prompt's final hidden states pooled ("last", "mean" or "cls" token); it
    # generates nothing (max_new_tokens is taken as 0)
    pooling: str = None
    # with pooling "last": the embedding is instead the last position's logits of these token ids
    # (a reranker's "no" and "yes")
    score_tokens: list = None
    adapter: str = (
        None  # a LoRA adapter the engine holds (speedups/lora.py), by name; None: the base
    )

    def check(self):
        check_sampling(
            self.temperature,
            self.top_k,
            self.top_p,
            self.min_p,
            self.repetition_penalty,
            self.frequency_penalty,
            self.presence_penalty,
            self.logit_bias,
        )
        self.logit_bias = parse_logit_bias(self.logit_bias)  # {"123": -100} -> {123: -100.0}
        if 0 < self.temperature < 1e-20:  # logits / temperature would overflow: its limit, greedy
            self.temperature = 0.0
        if self.pooling is not None:
            self._check_pooling()
        scoring = self.prompt_logprobs is not None or self.pooling is not None
        for name, least in (("max_new_tokens", 0 if scoring else 1), ("n", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(
                    f"{name} must be an integer >= {least}, got {value!r}"
                    + (
                        " (0 only when scoring or embedding the prompt)"
                        if name == "max_new_tokens"
                        else ""
                    )
                )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (
                not isinstance(value, int)
                or isinstance(value, bool)
                or not 0 <= value <= MAX_LOGPROBS
            ):
                raise ValueError(f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {value!r}")
        if self.seed is not None and (
            not isinstance(self.seed, int)
            or isinstance(self.seed, bool)
            or not -(2**63) <= self.seed < 2**63
        ):
            raise ValueError(f"seed must be an integer in [-2**63, 2**63), got {self.seed!r}")
        if self.adapter is not None and not (isinstance(self.adapter, str) and self.adapter):
            raise ValueError(f"adapter must be an adapter's name, got {self.adapter!r}")
        if not isinstance(self.priority, int) or isinstance(self.priority, bool):
            raise ValueError(f"priority must be an integer, got {self.priority!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in self.stop_token_ids):
            raise ValueError(
                f"stop_token_ids must be a list of integers, got {self.stop_token_ids!r}"
            )

    def _check_pooling(self):
        if self.pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {', '.join(POOLINGS)}, got {self.pooling!r}")
        if self.n != 1 or self.prompt_logprobs is not None:
            raise ValueError("an embedding (pooling) is one per prompt: n 1, no prompt_logprobs")
        if self.score_tokens is not None and (
            self.pooling != "last"
            or not self.score_tokens
            or not all(isinstance(t, int) and not isinstance(t, bool) for t in self.score_tokens)
        ):
            raise ValueError("score_tokens: token ids, with pooling last")
        self.max_new_tokens = 0


POOLINGS = ("last", "mean", "cls")  # the token whose state is the embedding, or their mean


def check_request(prompt, params: RequestParams, vocab: int, max_model_len: int, s, tokenizer):
    """ValueError naming what is wrong with a request for an engine (s: its scheduler.Scheduler),
    before anything is queued."""
    params.check()
    if len(prompt) == 0:
        raise ValueError("the prompt is empty")
    if not all(isinstance(t, int) and 0 <= t < vocab for t in prompt):
        raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
    parse_logit_bias(params.logit_bias, vocab)  # its ids in the vocabulary
    if params.pooling is not None and len(prompt) > max_model_len:  # (an embedding adds none)
        raise ValueError(
            f"the input has {len(prompt)} tokens; the model's context is {max_model_len}"
        )
    if params.pooling is None and len(prompt) >= max_model_len:
        raise ValueError(
            f"the prompt has {len(prompt)} tokens; the model's context is {max_model_len}, "
            "which leaves no room to generate"
        )
    if not all(0 <= t < vocab for t in params.score_tokens or ()):
        raise ValueError(f"score_tokens must be token ids in [0, {vocab})")
    usable = (
        s.allocator.num_blocks - 1
    )  # (a hybrid's windowed pool holds a sequence's window: memory.py)
    if blocks_for(max(len(prompt) + 1, s.reserve_tokens or 0), s.block_size) > usable:
        raise ValueError(
            f"the prompt has {len(prompt)} tokens but the whole KV pool holds "
            f"{usable * s.block_size}; give more --num_blocks or --kv_cache_memory"
        )
    if params.priority and s.policy != "priority":
        raise ValueError(
            f"priority {params.priority} needs the priority schedule policy "
            f"(--schedule_policy priority); this engine admits by {s.policy}"
        )
    if params.n > s.max_num_seqs:
        raise ValueError(f"n = {params.n} samples exceed max_num_seqs = {s.max_num_seqs}")
    if (params.stop or params.constraint is not None) and tokenizer is None:
        raise ValueError("stop strings and constraints need the engine's tokenizer")
    if params.prompt_logprobs is not None and s.scores is None:
        raise ValueError("this engine's scheduler scores no prompts (give it scoring.PromptScores)")


class Sequence:
    """One sample being generated: its tokens (prompt + output), its block table, and how many of
    its tokens have their K/V in the cache (`num_computed`)."""

    def __init__(self, request, index: int, seed: int, stream=None):
        self.request, self.index = request, index
        self.tokens = list(request.prompt)
        self.num_computed = 0
        self.blocks, self.hashes = [], []  # block table; chained hashes of its full blocks
        self.window_blocks = []  # a hybrid model's windowed layers' block table (scheduler.py)
        self.generator = torch.Generator(device=request.device).manual_seed(seed)
        self.finish_reason, self.token_times = None, []
        self.stream = (
            stream  # text_stream.TextStream: its text, decoded once per token (None: no tokenizer)
        )
        self.matcher = None  # constrain.Matcher, when the request has a constraint
        # per output token, when asked: (its log-probability, [(id, log-probability)] most likely)
        self.logprobs = []
        # tokens proposed to follow it, verified in the next step (speedups/prompt_lookup.py)
        self.draft = []
        # [len(draft), V]: what each was drawn from (speedups/draft_model.py), or None: chosen
        self.draft_probs = None
        self.ngrams = None  # prompt_lookup.NgramIndex of its tokens, once it speculates

    def fork(self, index: int, stream=None):
        """Sample `index` of the same request, from this one's tokens (its prompt just computed;
        the scheduler gives it this one's blocks)."""
        twin = Sequence(self.request, index, self.request.seed + index, stream)
        twin.tokens = list(self.tokens)
        twin.matcher = self.matcher and self.matcher.copy()
        return twin

    @property
    def output(self):
        return self.tokens[len(self.request.prompt) :]

    @property
    def last_hash(self):
        """The prefix-cache hash its next full block chains from (its adapter's key first)."""
        return self.hashes[-1] if self.hashes else self.request.hash_root


class Request:
    def __init__(self, request_id, prompt, params, device):
        self.id, self.prompt, self.params, self.device = request_id, list(prompt), params, device
        self.arrival = time.perf_counter()
        self.admitted = None  # when it first ran (engine.py): its time in the queue is the gap
        self.seed = params.seed if params.seed is not None else int(torch.randint(2**62, ()).item())
        self.seqs = [Sequence(self, 0, self.seed)]
        self.sampling = SamplingParams.from_fields(params)
        self.needs_fork = params.n > 1  # its other samples start once the prompt is computed
        self.prompt_tokens_hit, self.blocks_remembered = 0, 0  # blocks_remembered: scoring.py's
        self.error = None  # why it failed, if a fault ended it (the other requests go on)
        # per prompt token, when asked: None for the first (nothing predicts it), then as
        # Sequence.logprobs
        self.prompt_logprobs = [None] if params.prompt_logprobs is not None else None
        # an embedding's pooled state, float32 [dim] (while "mean" runs: the sum so far)
        self.pooled = None
        # its adapter's slot (lora.Adapters; -1: the base) and key, where its prefix hashes start
        self.lora_slot, self.hash_root = -1, None

    def pool(self, states, from_start: bool, whole: bool):
        """An embedding's final states of this step (float32 [count, dim]) into `pooled`. A "mean"
        sums chunk by chunk (from the first position again after a preemption: it reuses no
        cached prefix) and divides once the prompt is whole (from_start: the step began at
        position 0)."""
        part = states.sum(0)
        if self.params.pooling == "mean":
            self.pooled = part if from_start else self.pooled + part
            if whole:
                self.pooled = self.pooled / len(self.prompt)
        elif len(states):
            self.pooled = part
        if whole:  # the host's from here on (a server encodes it; a GPU's would not convert)
            self.pooled = self.pooled.cpu()

    @property
    def embedding(self):
        """The pooled state, float32 [dim], once the whole prompt is in it (else None: aborted)."""
        return self.pooled if self.seqs[0].finish_reason == "stop" else None

    @property
    def pools_every_token(self) -> bool:
        """A mean or first-token embedding needs every prompt position's state: no prefix reuse."""
        return self.params.pooling in ("mean", "cls")

    @property
    def scoring(self) -> bool:
        """Prompt log-probabilities still to compute: its prefix cannot come from the cache."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt)

    @property
    def finished(self) -> bool:
        return all(s.finish_reason for s in self.seqs)

    def result(self) -> dict:
        """The output line: lists are per sample when n > 1. Text is the streamed text: a stop
        string and what follows it, and the text of a stop token, are not in it."""
        tokens = [s.output for s in self.seqs]
        texts = [s.stream.sent if s.stream else None for s in self.seqs]
        reasons = [s.finish_reason for s in self.seqs]
        first = min((s.token_times[0] for s in self.seqs if s.token_times), default=None)
        pick = (lambda v: v) if self.params.n > 1 else (lambda v: v[0])
        if self.error:
            return {"id": self.id, "error": self.error}
        if self.params.pooling:  # an aborted one has no embedding
            vector = self.embedding
            return {
                "id": self.id,
                "embedding": None if vector is None else vector.tolist(),
                "prompt_tokens": len(self.prompt),
                "finish_reason": reasons[0],
            }
        return {
            "id": self.id,
            "tokens": pick(tokens),
            "text": pick(texts),
            "finish_reason": pick(reasons),
            "time_to_first_token_s": None if first is None else first - self.arrival,
        }
