"""An OpenAI-compatible HTTP server on the continuous-batching engine (scheduler.py).

    pip install -r requirements-serve.txt
    python serve.py                                   # the embedded model on http://127.0.0.1:8000
    python serve.py --checkpoint PATH --port 8080 --api_key secret

    curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \
         -d '{"prompt": "The capital of France is", "max_tokens": 16, "temperature": 0}'

Endpoints: POST /v1/completions, POST /v1/chat/completions (both with "stream": true as
server-sent events), GET /v1/models, GET /health, GET /metrics (Prometheus text).

This file only translates. One background thread owns the engine and loops over `step()`; HTTP
handlers (FastAPI, on asyncio) hand it requests through a queue and receive each new token
through an asyncio queue per request, so every concurrent HTTP request is batched into the
same steps. A streaming client that disconnects aborts its request, which frees its KV blocks.
"""
import argparse
import asyncio
import json
import os
import queue
import sys
import threading
import time
import traceback
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from runtime import log
from scheduler import RequestParams
from tokenizer import TextStream

API_KEY_ENV = "LLM_SERVER_API_KEY"
TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, float("inf"))


# -- the wire format -------------------------------------------------------------------------------
class Sampling(BaseModel):
    """Fields both endpoints share. Unknown fields are ignored, as OpenAI's own server does."""
    model_config = ConfigDict(extra="ignore")
    model: str = None
    max_tokens: int = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(None, ge=1)  # an extension
    n: int = Field(1, ge=1)
    stop: str | list[str] = None
    seed: int = None
    stream: bool = False
    stream_options: dict = None
    ignore_eos: bool = False  # an extension, for benchmarks


class CompletionRequest(Sampling):
    prompt: str | list[int]


class Message(BaseModel):
    role: str
    content: str


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)


def error(status: int, message: str, kind: str = "invalid_request_error", param: str = None):
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}}, status_code=status)


def choice(stream, index: int, chat: bool) -> dict:
    """One choice of a response from its tokenizer.TextStream."""
    body = {"message": {"role": "assistant", "content": stream.sent}} if chat else {"text": stream.sent, "logprobs": None}
    return {"index": index, **body, "finish_reason": stream.reason}


def usage(prompt_len: int, streams) -> dict:
    completion = sum(s.count for s in streams)
    return {"prompt_tokens": prompt_len, "completion_tokens": completion, "total_tokens": prompt_len + completion}


class EngineLoop:
    """The engine in its own thread. submit() and abort() may be called from any thread."""

    def __init__(self, engine):
        self.engine, self.inbox = engine, queue.Queue()
        self.streams = {}  # request id -> (event loop, asyncio.Queue of events)
        self.started = set()  # requests that have their first token
        self.tokens_generated, self.requests_done = 0, 0
        self.ttft_counts, self.ttft_sum = [0] * len(TTFT_BUCKETS), 0.0
        threading.Thread(target=self._run, daemon=True, name="engine").start()

    async def submit(self, prompt, params: RequestParams):
        """Queue a request; returns (id, asyncio.Queue of (sample index, token, finish_reason)).
        Raises ValueError for a request the engine refuses."""
        loop = asyncio.get_running_loop()
        done, events = loop.create_future(), asyncio.Queue()
        self.inbox.put(("add", prompt, params, loop, done, events))
        return await done, events

    def abort(self, request_id):
        self.inbox.put(("abort", request_id))

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
            except Exception:  # a bug must not hang every client: end all requests, keep serving
                traceback.print_exc()
                for rid in list(engine.requests):
                    engine.abort(rid)
                events = []
            for rid, index, token, reason in events:
                loop, q = self.streams[rid]
                if rid not in self.started:
                    self.started.add(rid)
                    req = engine.requests[rid]
                    self._observe_ttft(req.seqs[index].token_times[0] - req.arrival)
                self.tokens_generated += 1
                loop.call_soon_threadsafe(q.put_nowait, (index, token, reason))
            for rid in [rid for rid, r in engine.requests.items() if r.finished]:
                loop, q = self.streams.pop(rid)
                engine.requests.pop(rid)
                self.started.discard(rid)
                self.requests_done += 1
                loop.call_soon_threadsafe(q.put_nowait, None)  # end of stream

    def _handle(self, message):
        if message[0] == "abort":
            if message[1] in self.engine.requests:
                self.engine.abort(message[1])
            return
        _, prompt, params, loop, done, events = message
        try:
            rid = self.engine.add_request(prompt, params, request_id=uuid.uuid4().hex)
            self.streams[rid] = (loop, events)
            loop.call_soon_threadsafe(done.set_result, rid)
        except (ValueError, TypeError) as e:
            loop.call_soon_threadsafe(done.set_exception, ValueError(str(e)))

    def _observe_ttft(self, seconds: float):
        self.ttft_sum += seconds
        for i, bound in enumerate(TTFT_BUCKETS):
            if seconds <= bound:
                self.ttft_counts[i] += 1

    def metrics(self) -> str:
        e, a = self.engine, self.engine.allocator  # read from another thread: copy before iterating
        running, waiting = list(e.running), list(e.waiting)
        hit = e.stats["prompt_tokens_hit"] / e.stats["prompt_tokens"] if e.stats["prompt_tokens"] else 0.0
        lines = [
            "# TYPE llm_requests_running gauge", f"llm_requests_running {len({s.request.id for s in running})}",
            "# TYPE llm_requests_waiting gauge", f"llm_requests_waiting {len({s.request.id for s in waiting})}",
            "# TYPE llm_kv_blocks_used gauge", f"llm_kv_blocks_used {a.num_used()}",
            "# TYPE llm_kv_blocks_total gauge", f"llm_kv_blocks_total {a.num_blocks - 1}",
            "# TYPE llm_prefix_cache_hit_rate gauge", f"llm_prefix_cache_hit_rate {hit:.6f}",
            "# TYPE llm_preemptions_total counter", f"llm_preemptions_total {e.stats['preemptions']}",
            "# TYPE llm_generation_tokens_total counter", f"llm_generation_tokens_total {self.tokens_generated}",
            "# TYPE llm_requests_finished_total counter", f"llm_requests_finished_total {self.requests_done}",
            "# TYPE llm_time_to_first_token_seconds histogram",
        ]
        for bound, count in zip(TTFT_BUCKETS, self.ttft_counts):
            le = "+Inf" if bound == float("inf") else f"{bound}"
            lines.append(f'llm_time_to_first_token_seconds_bucket{{le="{le}"}} {count}')
        lines += [f"llm_time_to_first_token_seconds_sum {self.ttft_sum:.6f}",
                  f"llm_time_to_first_token_seconds_count {self.ttft_counts[-1]}"]
        return "\n".join(lines) + "\n"


def make_app(engine, tokenizer, model_name: str, api_key: str = None):
    """The FastAPI app: validation, the OpenAI wire format, and nothing else."""
    app, loop = FastAPI(title="llm inference server"), EngineLoop(engine)
    app.state.engine_loop = loop
    context = engine.max_model_len

    @app.middleware("http")
    async def check_key(request: Request, call_next):
        if api_key and request.url.path.startswith("/v1/") and \
                request.headers.get("authorization", "") != f"Bearer {api_key}":
            return error(401, "invalid or missing API key (send 'Authorization: Bearer <key>')", "authentication_error")
        return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def bad_request(request, exc):
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return error(400, f"{where or 'body'}: {first.get('msg', 'invalid request')}", param=where)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(loop.metrics(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "local"}]}

    async def run(body, prompt, chat: bool):
        default_max = context - len(prompt) if chat else 16
        max_tokens = body.max_tokens if body.max_tokens is not None else default_max
        if len(prompt) + max_tokens > context:
            return error(400, f"the prompt ({len(prompt)} tokens) plus max_tokens ({max_tokens}) exceeds the "
                              f"model's context of {context} tokens", param="max_tokens")
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        try:
            params = RequestParams(max_new_tokens=max_tokens, temperature=body.temperature, top_k=body.top_k,
                                   top_p=body.top_p, seed=body.seed, stop=stop, n=body.n, ignore_eos=body.ignore_eos)
            rid, events = await loop.submit(prompt, params)
        except ValueError as e:
            return error(400, str(e))
        meta = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{rid}", "created": int(time.time()), "model": model_name}
        streams = [TextStream(tokenizer, stop) for _ in range(body.n)]
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.get("include_usage"))
            return StreamingResponse(sse(rid, events, streams, meta, chat, len(prompt), include_usage),
                                     media_type="text/event-stream")
        while (event := await events.get()) is not None:
            streams[event[0]].add(*event[1:])
        choices = [choice(s, i, chat) for i, s in enumerate(streams)]
        return {**meta, "object": "chat.completion" if chat else "text_completion", "choices": choices,
                "usage": usage(len(prompt), streams)}

    async def sse(rid, events, streams, meta, chat, prompt_len, include_usage):
        kind = "chat.completion.chunk" if chat else "text_completion"
        finished = False
        try:
            if chat:  # the first chunk of each choice carries the role
                for i in range(len(streams)):
                    yield chunk({**meta, "object": kind, "choices": [
                        {"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]})
            while (event := await events.get()) is not None:
                index, token, reason = event
                text = streams[index].add(token, reason)
                if text or reason:
                    part = {"index": index, "finish_reason": reason}
                    part.update({"delta": {"content": text}} if chat else {"text": text, "logprobs": None})
                    yield chunk({**meta, "object": kind, "choices": [part]})
            finished = True
            if include_usage:
                yield chunk({**meta, "object": kind, "choices": [], "usage": usage(prompt_len, streams)})
            yield "data: [DONE]\n\n"
        finally:
            if not finished:  # the client went away: free its blocks now
                loop.abort(rid)

    def chunk(obj) -> str:
        return f"data: {json.dumps(obj)}\n\n"

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        prompt = tokenizer.encode(body.prompt) if isinstance(body.prompt, str) else body.prompt
        return await run(body, prompt, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest):
        try:
            prompt = tokenizer.encode_chat([m.model_dump() for m in body.messages])
        except Exception as e:  # a template that fails on these messages
            return error(400, f"the chat template failed on these messages: {e}", param="messages")
        return await run(body, prompt, chat=True)

    return app


def main(argv=None) -> int:
    import uvicorn

    from batch import add_engine_args, check_engine_args, engine_options, load_engine

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 exposes the server to the network)")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    p.add_argument("--api_key", default=os.environ.get(API_KEY_ENV),
                   help=f"require 'Authorization: Bearer KEY' (default: ${API_KEY_ENV} if set)")
    p.add_argument("--model_name", default=None, help="the model id clients send and /v1/models lists")
    add_engine_args(p)
    args = p.parse_args(argv)
    check_engine_args(p, args)
    try:
        engine, tokenizer, info = load_engine(**engine_options(args))
    except (ValueError, OSError) as e:
        log(f"error: {e}")
        return 2
    name = args.model_name or os.path.basename(str(info.source).rstrip("/"))
    server = uvicorn.Server(uvicorn.Config(make_app(engine, tokenizer, name, args.api_key), host=args.host,
                                           port=args.port, log_level="warning"))
    threading.Thread(target=announce, args=(server, log), daemon=True).start()
    server.run()
    return 0


def announce(server, log):
    """Print the address once the socket is bound (with --port 0 the OS picked the port)."""
    while not server.started:
        time.sleep(0.05)
    host, port = server.servers[0].sockets[0].getsockname()[:2]
    log(f"serving on http://{host}:{port} (OpenAI API under /v1)")


if __name__ == "__main__":
    sys.exit(main())
