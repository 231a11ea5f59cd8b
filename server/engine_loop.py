"""The engine (engine.py) in its own thread, for a server: admission with a bounded queue,
aborts from any thread, graceful draining, and metrics. It uses only the engine's API.

One background thread owns the engine and loops over `step()`; callers on an asyncio loop hand it
requests through a thread-safe inbox and receive each new token through an asyncio queue. Every
event a caller receives is one of:

    (choice index, token id, text, finish_reason or None, logprob)   a new token, the text it
                                                 makes final (engine.Token); logprob is its entry
                                                 (scoring.token_logprobs) when asked for, else None
    (choice index, None, text, reason, None)     a sample ended without a token ("abort";
                                                 "length" when max_new_tokens = 0 scored the
                                                 prompt; "stop" for an embedding)
    Over(first choice index, error, prompt_logprobs, cached_tokens, embedding)   one request (one
                                                 prompt) is over; error is None or why it failed
                                                 (the others go on); embedding: its pooled vector

Admission is decided in the engine thread, before anything is queued: while `draining`, or when
`max_waiting` requests already wait for a slot, `submit` raises `Unavailable` (HTTP 503).

Load the model on the thread that will step it (EngineThread, as serve.py does): torch's CPU
ops run on an OpenMP pool that belongs to the thread calling them, so a model loaded on the main
thread and stepped on another leaves two pools. With more OpenMP threads than cores, libgomp
stops spinning between parallel regions and every op then waits for its workers to wake
(benchmarks/RESULTS.md, "Prompt scoring through serve.py" has the cost).
"""

import asyncio
import concurrent.futures
import queue
import threading
import time
import traceback
import uuid
from typing import NamedTuple

from engine import Finished
from speedups.lora import SlotsBusy, UnknownAdapter

ADAPTER_ERRORS = (UnknownAdapter, SlotsBusy)  # kept as they are: the routes answer 404 and 503
TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, float("inf"))


class Over(NamedTuple):
    first: int  # the request's first choice index
    error: str  # None, or why the request failed
    prompt_logprobs: list  # None, or the prompt's (engine Request.prompt_logprobs)
    cached_tokens: int = 0  # prompt tokens whose K/V the prefix cache held (at most the prompt: a
    # readmission after preemption finds its blocks again)
    embedding: object = None  # an embedding request's pooled state, float32 [dim]


async def events_of(rids, events, out):
    """(choice index, new text, finish_reason) per token event of the requests `rids` until all
    are over, each handed to out.add(index, token, text, reason, logprob) first (out.over(Over)
    for a request's end); a failed request's error (str)."""
    left = len(rids)
    while left:
        event = await events.get()
        if isinstance(event, Over):
            left -= 1
            out.over(event)
            if event.error:
                yield event.error
            continue
        index, token, text, reason, logprob = event
        yield index, out.add(index, token, text, reason, logprob), reason


async def collect_all(rids, events, out):
    """Every event into `out`; the first error message, or None."""
    failed = None
    async for event in events_of(rids, events, out):
        if isinstance(event, str):
            failed = failed or event
    return failed


class Unavailable(Exception):
    """The server cannot take this request now (queue full, or shutting down); retry later."""


class EngineThread:
    """One daemon thread that runs the calls it is given, in order: first the model's loading,
    then EngineLoop's loop, so that every torch op of the server runs on this one thread."""

    def __init__(self):
        self.jobs = queue.Queue()
        threading.Thread(target=self._work, daemon=True, name="engine").start()

    def _work(self):
        while True:
            fn, args, kwargs, done = self.jobs.get()
            try:
                done.set_result(fn(*args, **kwargs))
            except BaseException as e:  # handed to the caller
                done.set_exception(e)

    def call(self, fn, *args, **kwargs):
        """Run fn(*args, **kwargs) on the thread; a Future of its result."""
        done = concurrent.futures.Future()
        self.jobs.put((fn, args, kwargs, done))
        return done


class EngineLoop:
    """The engine in its own thread. submit() and abort() may be called from any thread."""

    def __init__(self, engine, max_waiting: int = 256, thread: EngineThread = None):
        self.engine, self.inbox, self.max_waiting = engine, queue.Queue(), max_waiting
        # request id -> (event loop, asyncio.Queue of events, index of its first choice)
        self.streams = {}
        self.draining = False
        self.snapshot = (
            engine.metrics()
        )  # taken on the engine thread after each step, read from any thread
        self.tokens_generated, self.requests_done, self.refused = 0, 0, 0
        self.ttft_counts, self.ttft_sum = [0] * len(TTFT_BUCKETS), 0.0
        (thread or EngineThread()).call(self._run)  # runs until the process ends

    async def submit(self, prompts, params):
        """Queue one engine request per prompt, all or none; returns (ids, asyncio.Queue of events
        for all of them: prompt i's samples are choices i*n .. i*n+n-1). Raises ValueError for a
        request the engine refuses, Unavailable when it cannot take more now."""
        loop = asyncio.get_running_loop()
        done, events = loop.create_future(), asyncio.Queue()
        self.inbox.put(("add", prompts, params, loop, done, events))
        return await done, events

    def abort(self, request_id):
        self.inbox.put(("abort", request_id))

    def drain(self, timeout: float):
        """Stop admission, let running requests finish for up to `timeout` seconds, then abort
        the rest (their clients get finish_reason "abort"). Blocks; call it from any thread."""
        self.draining = True
        deadline = time.monotonic() + timeout
        while self.streams and time.monotonic() < deadline:
            time.sleep(0.02)
        self.inbox.put(("abort_all",))
        while self.streams and time.monotonic() < deadline + 5:
            time.sleep(0.02)

    def _run(self):
        engine = self.engine
        while True:
            try:  # block while idle; between steps, take everything that arrived
                self._handle(self.inbox.get(timeout=None if not engine.has_unfinished() else 0))
                while True:
                    self._handle(self.inbox.get_nowait())
            except queue.Empty:
                pass
            try:
                events = engine.step()
            except (
                Exception
            ) as e:  # a bug in the step itself: end every running request, keep serving
                traceback.print_exc()
                self._abort_all(f"the engine failed during a step ({type(e).__name__}: {e})")
                events = []
            for event in events:
                self._deliver(event)
            self.snapshot = engine.metrics()

    def _deliver(self, event):
        """An engine event to its request's queue."""
        if event.request_id not in self.streams:  # a request of a refused submit (all or none)
            return
        loop, q, first = self.streams[event.request_id]
        if isinstance(event, Finished):
            del self.streams[event.request_id]
            self.requests_done += 1
            ttft = event.result.get("time_to_first_token_s")
            if ttft is not None:
                self._observe_ttft(ttft)
            req = event.request
            loop.call_soon_threadsafe(
                q.put_nowait,
                Over(
                    first,
                    req.error,
                    req.prompt_logprobs,
                    min(req.prompt_tokens_hit, len(req.prompt)),
                    req.embedding,
                ),
            )
            return
        self.tokens_generated += event.token is not None
        loop.call_soon_threadsafe(
            q.put_nowait,
            (first + event.index, event.token, event.text, event.finish_reason, event.logprob),
        )

    def _abort(self, rid, error=None):
        if rid in self.streams:  # else over already
            self.engine.abort(rid, error)

    def _abort_all(self, error=None):
        for rid in list(self.streams):
            try:
                self._abort(rid, error)
            except ValueError:  # never reached the engine (refused while being added)
                pass

    def call(self, fn, *args):
        """fn(*args) on the engine's thread between steps (torch's state is that thread's); a
        Future of its result."""
        done = concurrent.futures.Future()
        self.inbox.put(("call", fn, args, done))
        return done

    def _handle(self, message):
        if message[0] == "call":
            _, fn, args, done = message
            try:
                done.set_result(fn(*args))
            except Exception as e:  # handed to the caller
                done.set_exception(e)
            return
        if message[0] == "abort":
            self._abort(message[1])
            return
        if message[0] == "abort_all":
            self._abort_all()
            return
        _, prompts, params, loop, done, events = message
        try:
            if self.draining:
                raise Unavailable("the server is shutting down")
            if self.engine.metrics()["waiting"] + len(prompts) > self.max_waiting:
                self.refused += 1
                raise Unavailable(
                    f"too many requests are waiting ({self.max_waiting}, --max_waiting); retry "
                    "later"
                )
            ids = []
            for i, prompt in enumerate(prompts):
                try:
                    ids.append(self.engine.add_request(prompt, params, request_id=uuid.uuid4().hex))
                except Exception as e:  # a bad request fails alone; the engine thread goes on
                    for rid in ids:  # all or none: the engine's events for these go nowhere
                        self.engine.abort(rid)
                        del self.streams[rid]
                    message = str(e) if len(prompts) == 1 else f"prompt {i}: {e}"
                    kind = type(e) if type(e) in ADAPTER_ERRORS else ValueError  # (a 404, a 503)
                    raise kind(message) from None
                self.streams[ids[-1]] = (loop, events, i * params.n)
            loop.call_soon_threadsafe(done.set_result, ids)
        except (ValueError, Unavailable) as e:
            loop.call_soon_threadsafe(done.set_exception, e)

    def _observe_ttft(self, seconds: float):
        self.ttft_sum += seconds
        for i, bound in enumerate(TTFT_BUCKETS):
            if seconds <= bound:
                self.ttft_counts[i] += 1

    def metrics(self) -> str:
        m = self.snapshot  # the engine's metrics after its last step (this runs on another thread)
        hit = m["prompt_tokens_hit"] / m["prompt_tokens"] if m["prompt_tokens"] else 0.0
        lines = [
            "# TYPE llm_requests_running gauge",
            f"llm_requests_running {m['running']}",
            "# TYPE llm_requests_waiting gauge",
            f"llm_requests_waiting {m['waiting']}",
            "# TYPE llm_requests_refused_total counter",
            f"llm_requests_refused_total {self.refused}",
            "# TYPE llm_kv_blocks_used gauge",
            f"llm_kv_blocks_used {m['kv_blocks_used']}",
            "# TYPE llm_kv_blocks_total gauge",
            f"llm_kv_blocks_total {m['kv_blocks_total']}",
            "# TYPE llm_prefix_cache_hit_rate gauge",
            f"llm_prefix_cache_hit_rate {hit:.6f}",
            "# TYPE llm_preemptions_total counter",
            f"llm_preemptions_total {m['preemptions']}",
            "# TYPE llm_generation_tokens_total counter",
            f"llm_generation_tokens_total {self.tokens_generated}",
            "# TYPE llm_draft_tokens_total counter",
            f"llm_draft_tokens_total {m['draft_tokens']}",
            "# TYPE llm_draft_tokens_accepted_total counter",
            f"llm_draft_tokens_accepted_total {m['draft_tokens_accepted']}",
            "# TYPE llm_requests_finished_total counter",
            f"llm_requests_finished_total {self.requests_done}",
            "# TYPE llm_queue_time_seconds summary",
            f'llm_queue_time_seconds{{quantile="0.5"}} {m["queue_time_p50_s"]:.6f}',
            f'llm_queue_time_seconds{{quantile="0.99"}} {m["queue_time_p99_s"]:.6f}',
            "# TYPE llm_oldest_waiting_seconds gauge",
            f"llm_oldest_waiting_seconds {m['oldest_waiting_s']:.6f}",
            "# TYPE llm_time_to_first_token_seconds histogram",
        ]
        for bound, count in zip(TTFT_BUCKETS, self.ttft_counts):
            le = "+Inf" if bound == float("inf") else f"{bound}"
            lines.append(f'llm_time_to_first_token_seconds_bucket{{le="{le}"}} {count}')
        lines += [
            f"llm_time_to_first_token_seconds_sum {self.ttft_sum:.6f}",
            f"llm_time_to_first_token_seconds_count {self.ttft_counts[-1]}",
        ]
        for key in sorted(k for k in m if k.startswith("tier_")):  # speedups/kv_tier.py's STATS
            kind = "gauge" if key == "tier_bytes" else "counter"
            name = f"llm_kv_{key}" + ("_total" if kind == "counter" else "")
            lines += [f"# TYPE {name} {kind}", f"{name} {m[key]}"]
        return "\n".join(lines) + "\n"
