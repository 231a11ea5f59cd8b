"""An OpenAI-compatible HTTP server on the continuous-batching engine (scheduler.py).

    pip install -r requirements-serve.txt
    python serve.py                                   # the embedded model on http://127.0.0.1:8000
    python serve.py --checkpoint PATH --port 8080 --api_key secret

    curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \
         -d '{"prompt": "The capital of France is", "max_tokens": 16, "temperature": 0}'

Endpoints: POST /v1/completions, POST /v1/chat/completions (both with "stream": true as
server-sent events), GET /v1/models, GET /health, GET /metrics (Prometheus text).

This file only translates. engine_loop.py runs the engine in one background thread; HTTP handlers
(FastAPI, on asyncio) hand it requests and receive each new token through an asyncio queue per
request, so every concurrent HTTP request is batched into the same steps.

A server left running meets hostile traffic, so every request is checked against `Limits`
before any work is queued (body size -> 413; n, stop strings, prompts per request, context ->
400; a full waiting queue -> 503 with Retry-After), text is tokenized off the event loop, and a
client that goes away (streaming or not) aborts its request, which frees its KV blocks. SIGTERM
or SIGINT drain: new requests get 503, /health says "draining", running requests have
--shutdown_timeout seconds to finish, the rest end with finish_reason "abort", the process exits 0.
"""
import argparse
import asyncio
import hmac
import json
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException

from engine_loop import EngineLoop, EngineThread, Over, Unavailable
from openai_format import (ChatRequest, CompletionRequest, DetokenizeRequest, Outputs, TokenizeRequest, constraint_of,
                           encode, error, logprob_counts, prompt_list, refusal, template_messages, unavailable)
from runtime import log
from sampling import parse_logit_bias
from scheduler import RequestParams
from tool_calls import call_constraint, check_tools, render_args, tool_format

API_KEY_ENV = "LLM_SERVER_API_KEY"


@dataclass
class Limits:
    """What one request may ask for; each is a serve.py flag."""
    max_waiting: int = 256  # requests queued for a slot; more -> 503
    max_n: int = 16  # samples per prompt
    max_model_len: int = None  # prompt + max_tokens, when lower than the model's context
    max_body_bytes: int = 4 * 2**20  # request body; more -> 413
    max_prompts: int = 64  # prompts in one completions request
    max_stop: int = 16  # stop strings


def authorized(header: bytes, api_key: str) -> bool:
    """'Authorization: Bearer KEY', the scheme name in any case (RFC 7235)."""
    scheme, _, token = header.decode("latin-1").strip().partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), api_key.encode())


class Guard:
    """ASGI middleware, before any handler reads the body: the API key (everything but /health
    needs it when set, /metrics and /docs included), 503 while draining, and the body size (413,
    from Content-Length or while a chunked body arrives)."""

    def __init__(self, app, api_key, max_body_bytes, engine_loop):
        self.app, self.api_key, self.max_body_bytes, self.engine_loop = app, api_key, max_body_bytes, engine_loop

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] == "/health":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.api_key and not authorized(headers.get(b"authorization", b""), self.api_key):
            return await error(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                               "authentication_error")(scope, receive, send)
        if self.engine_loop.draining and scope["method"] == "POST":
            return await unavailable("the server is shutting down")(scope, receive, send)
        limit, length = self.max_body_bytes, headers.get(b"content-length", b"0")
        too_large = f"the request body exceeds {limit} bytes (--max_body_bytes)"
        if not length.isdigit() or int(length) > limit:
            return await error(413, too_large)(scope, receive, send)
        received = 0

        async def bounded_receive():
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > limit:
                raise HTTPException(413, too_large)
            return message

        await self.app(scope, bounded_receive, send)


async def disconnected(request: Request):
    """Returns when the client goes away (the body has been read, so the next message says so)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def make_app(engine, tokenizer, model_name: str, api_key: str = None, limits: Limits = None, thread=None):
    """The FastAPI app: validation, limits, the OpenAI wire format, and nothing else. `thread`:
    the EngineThread the engine was loaded on (engine_loop.py says why), else a new one."""
    limits = limits or Limits()
    app, loop = FastAPI(title="llm inference server"), EngineLoop(engine, limits.max_waiting, thread)
    app.state.engine_loop = loop
    app.add_middleware(Guard, api_key=api_key, max_body_bytes=limits.max_body_bytes, engine_loop=loop)
    context = min(engine.max_model_len, limits.max_model_len or engine.max_model_len)
    context_name = "--max_model_len" if context < engine.max_model_len else "the model's context"

    @app.exception_handler(RequestValidationError)
    async def bad_request(request, exc):
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return error(400, f"{where or 'body'}: {first.get('msg', 'invalid request')}", param=where)

    @app.exception_handler(HTTPException)
    async def http_error(request, exc):
        return error(exc.status_code, str(exc.detail))

    @app.get("/health")
    async def health():
        return JSONResponse({"status": "draining"}, 503) if loop.draining else {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(loop.metrics(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "local",
                                            "max_model_len": context}]}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        try:
            if body.messages is not None:
                text = await asyncio.to_thread(tokenizer.apply_chat_template, template_messages(body))
                ids = await asyncio.to_thread(encode, tokenizer, text, False)
            else:
                ids = await asyncio.to_thread(encode, tokenizer, body.prompt or "", None if body.add_special_tokens else False)
        except Exception as e:
            return error(400, f"cannot tokenize: {e}", param="messages" if body.messages is not None else "prompt")
        return {"count": len(ids), "max_model_len": context, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        vocab = engine.model.config.vocab_size
        if not all(0 <= t < vocab for t in body.tokens):
            return error(400, f"token ids must be in [0, {vocab})", param="tokens")
        return {"prompt": tokenizer.decode(body.tokens)}

    def check(body, num_prompts: int, chat: bool):
        """The limits (and logit_bias ids) that need no tokens: (message, param), or None."""
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if body.n > limits.max_n:
            return f"n = {body.n} exceeds this server's limit of {limits.max_n} samples (--max_n)", "n"
        if len(stop) > limits.max_stop:
            return f"{len(stop)} stop strings exceed this server's limit of {limits.max_stop} (--max_stop)", "stop"
        if num_prompts > limits.max_prompts:
            return f"{num_prompts} prompts exceed this server's limit of {limits.max_prompts} (--max_prompts)", "prompt"
        try:
            parse_logit_bias(body.logit_bias, engine.model.config.vocab_size)
        except ValueError as e:
            return str(e), "logit_bias"
        return refusal(body, chat)

    async def run(request, body, prompts, chat: bool, tools=None, tool_constraint=None):
        lengths = [len(p) for p in prompts]
        default_max = context - max(lengths) if chat else 16
        max_tokens = getattr(body, "max_completion_tokens", None) or body.max_tokens
        max_tokens = max_tokens if max_tokens is not None else default_max
        for i, n in enumerate(lengths):
            if n + max_tokens > context:
                which = "the prompt" if len(prompts) == 1 else f"prompt {i}"
                return error(400, f"{which} ({n} tokens) plus max_tokens ({max_tokens}) exceeds {context_name} "
                                  f"of {context} tokens", param="max_tokens")
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        logprobs, prompt_logprobs = logprob_counts(body, chat)
        try:
            constraint = constraint_of(body)
        except ValueError as e:
            return error(400, e.args[0], param=e.args[1])
        if tool_constraint and constraint:
            return error(400, "a tool_choice that forces a call cannot be combined with response_format",
                         param="tool_choice")
        constraint = constraint or tool_constraint
        try:
            params = RequestParams(max_new_tokens=max_tokens, temperature=body.temperature, top_k=body.top_k,
                                   top_p=body.top_p, seed=body.seed, stop=stop, n=body.n, ignore_eos=body.ignore_eos,
                                   logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                                   min_p=body.min_p, repetition_penalty=body.repetition_penalty,
                                   frequency_penalty=body.frequency_penalty, presence_penalty=body.presence_penalty,
                                   logit_bias=body.logit_bias or {}, constraint=constraint)
            rids, events = await loop.submit(prompts, params)
        except ValueError as e:
            return error(400, str(e))
        except Unavailable as e:
            return unavailable(str(e))
        meta = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{rids[0]}", "created": int(time.time()), "model": model_name}
        out = Outputs(tokenizer, prompts, body.n, stop, chat, logprobs is not None, getattr(body, "echo", False), tools)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.get("include_usage"))
            return StreamingResponse(sse(rids, events, out, meta, include_usage), media_type="text/event-stream")
        collect = asyncio.ensure_future(collect_all(rids, events, out))
        gone = asyncio.ensure_future(disconnected(request))
        try:
            await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not collect.done():  # the client went away (or this handler was cancelled): free its blocks
                collect.cancel()
                for rid in rids:
                    loop.abort(rid)
        if not collect.done() or collect.cancelled():
            return error(499, "the client closed the request")
        if collect.result():
            return error(500, f"the request failed: {collect.result()}", "server_error")
        # plain JSON types already: JSONResponse skips FastAPI's encoder walking every logprob
        return JSONResponse({**meta, "object": "chat.completion" if chat else "text_completion",
                             "choices": [out.choice(i) for i in range(len(out.streams))], "usage": out.usage()})

    async def events_of(rids, events, out):
        """(choice index, new text, finish_reason) until every request is over; an error message
        (str) if one failed."""
        left = len(rids)
        while left:
            event = await events.get()
            if isinstance(event, Over):
                left -= 1
                out.prompt_logprobs[event.first // out.n] = event.prompt_logprobs
                if event.error:
                    yield event.error
                continue
            index, token, reason, logprob = event
            yield index, out.add(index, token, reason, logprob), reason

    async def collect_all(rids, events, out):
        failed = None
        async for event in events_of(rids, events, out):
            if isinstance(event, str):
                failed = failed or event
        return failed

    async def sse(rids, events, out, meta, include_usage):
        kind = "chat.completion.chunk" if out.chat else "text_completion"
        finished = False
        try:
            if out.chat:  # the first chunk of each choice carries the role
                for i in range(len(out.streams)):
                    yield chunk({**meta, "object": kind, "choices": [
                        {"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]})
            async for event in events_of(rids, events, out):
                if isinstance(event, str):  # one request failed: say so, the stream still ends cleanly
                    yield chunk({"error": {"message": f"the request failed: {event}", "type": "server_error",
                                           "param": None, "code": None}})
                    continue
                index, text, reason = event
                part = out.delta(index, text, reason) if text or reason else None
                if part:
                    yield chunk({**meta, "object": kind, "choices": [part]})
            finished = True
            if include_usage:
                yield chunk({**meta, "object": kind, "choices": [], "usage": out.usage()})
            yield "data: [DONE]\n\n"
        finally:
            if not finished:  # the client went away: free its blocks now
                for rid in rids:
                    loop.abort(rid)

    def chunk(obj) -> str:
        return f"data: {json.dumps(obj)}\n\n"

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        prompts = prompt_list(body.prompt)
        if refused := check(body, len(prompts), chat=False):
            return error(400, refused[0], param=refused[1])
        try:  # off the event loop: a long text takes seconds, and /health must still answer
            prompts = await asyncio.to_thread(lambda: [encode(tokenizer, p) if isinstance(p, str) else p
                                                       for p in prompts])
        except ValueError as e:
            return error(400, f"prompt: {e}", param="prompt")
        return await run(request, body, prompts, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        if refused := check(body, 1, chat=True):
            return error(400, refused[0], param=refused[1])
        try:
            messages, extra = template_messages(body), {}
        except ValueError as e:
            return error(400, f"messages: {e}", param="messages")
        tools, tool_constraint = None, None
        if body.tool_choice not in (None, "auto", "none") and not body.tools:
            return error(400, f"tool_choice {body.tool_choice!r} needs tools", param="tool_choice")
        if body.tools and body.tool_choice != "none":
            try:
                check_tools(body.tools, body.tool_choice)
            except ValueError as e:
                return error(400, f"tools: {e}", param="tools")
            fmt = tool_format(tokenizer.chat_template)
            messages, extra = render_args(messages, body.tools, body.tool_choice, tokenizer.chat_template)
            tools, tool_constraint = (fmt, body.tools), call_constraint(body.tools, body.tool_choice, fmt)
        try:
            text = await asyncio.to_thread(tokenizer.apply_chat_template, messages, True, **extra)
        except Exception as e:  # a template that fails on these messages
            return error(400, f"the chat template failed on these messages: {e}", param="messages")
        try:  # the template writes BOS itself where the model wants it
            prompt = await asyncio.to_thread(encode, tokenizer, text, False)
        except ValueError as e:
            return error(400, f"messages: {e}", param="messages")
        return await run(request, body, [prompt], chat=True, tools=tools, tool_constraint=tool_constraint)

    return app


def add_limit_args(p: argparse.ArgumentParser):
    d = Limits()
    p.add_argument("--max_waiting", type=int, default=d.max_waiting,
                   help="requests that may wait for a slot; more get 503 with Retry-After")
    p.add_argument("--max_n", type=int, default=d.max_n, help="most samples (n) per prompt")
    p.add_argument("--max_model_len", type=int, default=None,
                   help="most prompt + max_tokens per request (default: the model's context)")
    p.add_argument("--max_body_bytes", type=int, default=d.max_body_bytes, help="largest request body; more get 413")
    p.add_argument("--max_prompts", type=int, default=d.max_prompts, help="most prompts in one completions request")
    p.add_argument("--max_stop", type=int, default=d.max_stop, help="most stop strings per request")
    p.add_argument("--shutdown_timeout", type=float, default=30.0,
                   help="on SIGTERM/SIGINT, seconds running requests may take to finish before they are aborted")


def main(argv=None) -> int:
    import uvicorn

    from batch import add_engine_args, check_engine_args, engine_options, load_engine

    class DrainingServer(uvicorn.Server):
        """uvicorn, except that the first SIGTERM/SIGINT drains the engine before stopping (and the
        process then exits 0); a second one stops at once."""

        def handle_exit(self, sig, frame):
            if engine_loop.draining:
                self.should_exit = self.force_exit = True
                return
            engine_loop.draining = True
            log(f"signal {signal.Signals(sig).name}: draining (up to {args.shutdown_timeout:g} s)")
            threading.Thread(target=self.drain, daemon=True).start()

        def drain(self):
            engine_loop.drain(args.shutdown_timeout)
            self.should_exit = True

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 exposes the server to the network)")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    p.add_argument("--api_key", default=os.environ.get(API_KEY_ENV),
                   help=f"require 'Authorization: Bearer KEY' on everything but /health (default: ${API_KEY_ENV} if set)")
    p.add_argument("--model_name", default=None, help="the model id clients send and /v1/models lists")
    add_limit_args(p)
    add_engine_args(p)
    args = p.parse_args(argv)
    check_engine_args(p, args)
    for name in ("max_waiting", "max_n", "max_body_bytes", "max_prompts", "max_stop", "max_model_len"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    thread = EngineThread()  # loads the model and then steps it (engine_loop.py says why)
    try:
        engine, tokenizer, info = thread.call(load_engine, **engine_options(args)).result()
    except (ValueError, OSError) as e:
        log(f"error: {e}")
        return 2
    name = args.model_name or os.path.basename(str(info.source).rstrip("/"))
    limits = Limits(**{k: getattr(args, k) for k in Limits.__dataclass_fields__})
    app = make_app(engine, tokenizer, name, args.api_key, limits, thread)
    engine_loop = app.state.engine_loop
    server = DrainingServer(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning"))
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
