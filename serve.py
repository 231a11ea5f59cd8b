"""An OpenAI-compatible HTTP server on the continuous-batching engine (engine.py).

    pip install -r requirements-serve.txt
    python serve.py                                   # the embedded model on http://127.0.0.1:8000
    python serve.py --checkpoint PATH --port 8080 --api_key secret

    curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \
         -d '{"prompt": "The capital of France is", "max_tokens": 16, "temperature": 0}'

Endpoints: POST /v1/completions, POST /v1/chat/completions (both with "stream": true as
server-sent events), GET /v1/models, GET /health, GET /metrics (Prometheus text).

This file only translates. engine_loop.py runs the engine in one background thread; HTTP handlers
(FastAPI, on asyncio) hand it requests and receive each new token through an asyncio queue per
request, so every concurrent HTTP request is batched into the same steps. `Server` holds what the
handlers share and has one method per step (check, encode, params, respond, ...); make_app routes.

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

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException

from engine_loop import EngineLoop, EngineThread, Over, Unavailable
from openai_format import (ChatRequest, CompletionRequest, DetokenizeRequest, Outputs, TokenizeRequest, constraint_of,
                           encode, error, logprob_counts, prompt_list, refusal, template_messages, unavailable)
from runtime import log
from sampling import parse_logit_bias
from sequence import RequestParams
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


class Refused(Exception):
    """An error response (400 unless given) before anything is queued: any step raises it, the app sends it."""

    def __init__(self, message: str, param: str = None, response=None):
        super().__init__(message)
        self.response = response if response is not None else error(400, message, param=param)


async def refused(request, exc: Refused):
    return exc.response


async def bad_request(request, exc: RequestValidationError):
    first = exc.errors()[0] if exc.errors() else {}
    where = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
    return error(400, f"{where or 'body'}: {first.get('msg', 'invalid request')}", param=where)


async def http_error(request, exc: HTTPException):
    return error(exc.status_code, str(exc.detail))


def chunk(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


async def events_of(rids, events, out: Outputs):
    """(choice index, new text, finish_reason) until every request is over; a failed one's error (str)."""
    left = len(rids)
    while left:
        event = await events.get()
        if isinstance(event, Over):
            left -= 1
            out.prompt_logprobs[event.first // out.n] = event.prompt_logprobs
            if event.error:
                yield event.error
            continue
        index, token, text, reason, logprob = event
        yield index, out.add(index, token, text, reason, logprob), reason


async def collect_all(rids, events, out: Outputs):
    """Every event into `out`; the first error message, or None."""
    failed = None
    async for event in events_of(rids, events, out):
        if isinstance(event, str):
            failed = failed or event
    return failed


class Server:
    """What the routes share (engine loop, tokenizer, model name, limits, context), one method per step."""

    def __init__(self, engine, tokenizer, model_name: str, limits: Limits, thread=None):
        self.engine, self.tokenizer, self.model_name, self.limits = engine, tokenizer, model_name, limits
        self.loop = EngineLoop(engine, limits.max_waiting, thread)
        self.context = min(engine.max_model_len, limits.max_model_len or engine.max_model_len)
        self.context_name = "--max_model_len" if self.context < engine.max_model_len else "the model's context"

    # routes have no return annotations: FastAPI would take them as response models
    async def health(self):
        return JSONResponse({"status": "draining"}, 503) if self.loop.draining else {"status": "ok"}

    async def metrics(self):
        return PlainTextResponse(self.loop.metrics(), media_type="text/plain; version=0.0.4")

    async def models(self):
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                            "owned_by": "local", "max_model_len": self.context}]}

    async def tokenize(self, body: TokenizeRequest):
        try:
            if body.messages is not None:
                text = await asyncio.to_thread(self.tokenizer.apply_chat_template, template_messages(body))
                ids = await asyncio.to_thread(encode, self.tokenizer, text, False)
            else:
                bos = None if body.add_special_tokens else False
                ids = await asyncio.to_thread(encode, self.tokenizer, body.prompt or "", bos)
        except Exception as e:
            raise Refused(f"cannot tokenize: {e}", "messages" if body.messages is not None else "prompt") from None
        return {"count": len(ids), "max_model_len": self.context, "tokens": ids}

    async def detokenize(self, body: DetokenizeRequest):
        vocab = self.engine.model.config.vocab_size
        if not all(0 <= t < vocab for t in body.tokens):
            raise Refused(f"token ids must be in [0, {vocab})", "tokens")
        return {"prompt": self.tokenizer.decode(body.tokens)}

    async def completions(self, body: CompletionRequest, request: Request):
        prompts = prompt_list(body.prompt)
        self.check(body, len(prompts), chat=False)
        prompts = await self.encode(prompts, "prompt")
        return await self.respond(request, body, prompts, chat=False)

    async def chat_completions(self, body: ChatRequest, request: Request):
        self.check(body, 1, chat=True)
        messages = self.messages(body)
        tools = self.tools(body)
        messages, extra = render_args(messages, body.tools, body.tool_choice, self.tokenizer.chat_template)
        tool_constraint = call_constraint(body.tools, body.tool_choice, tools[0]) if tools else None
        text = await self.render(messages, extra)
        prompt, = await self.encode([text], "messages", bos=False)  # the template writes BOS where the model wants it
        return await self.respond(request, body, [prompt], chat=True, tools=tools, tool_constraint=tool_constraint)

    def check(self, body, num_prompts: int, chat: bool):
        """The limits (and logit_bias ids) that need no tokens; Refused naming the first one broken."""
        limits, stop = self.limits, [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if body.n > limits.max_n:
            raise Refused(f"n = {body.n} exceeds this server's limit of {limits.max_n} samples (--max_n)", "n")
        if len(stop) > limits.max_stop:
            raise Refused(f"{len(stop)} stop strings exceed this server's limit of {limits.max_stop} (--max_stop)",
                          "stop")
        if num_prompts > limits.max_prompts:
            raise Refused(f"{num_prompts} prompts exceed this server's limit of {limits.max_prompts} (--max_prompts)",
                          "prompt")
        try:
            parse_logit_bias(body.logit_bias, self.engine.model.config.vocab_size)
        except ValueError as e:
            raise Refused(str(e), "logit_bias") from None
        if refused := refusal(body, chat):
            raise Refused(*refused)

    async def encode(self, prompts, param: str, bos: bool = None) -> list:
        """Texts -> token ids (ids pass through), off the event loop: /health answers while a long text encodes."""
        try:
            return await asyncio.to_thread(lambda: [encode(self.tokenizer, p, bos) if isinstance(p, str) else p
                                                    for p in prompts])
        except ValueError as e:
            raise Refused(f"{param}: {e}", param) from None

    def messages(self, body: ChatRequest) -> list:
        try:
            return template_messages(body)
        except ValueError as e:
            raise Refused(f"messages: {e}", "messages") from None

    def tools(self, body: ChatRequest):
        """(format, tools) when the reply may hold tool calls (parsed when it ends), else None."""
        if body.tool_choice not in (None, "auto", "none") and not body.tools:
            raise Refused(f"tool_choice {body.tool_choice!r} needs tools", "tool_choice")
        if not body.tools or body.tool_choice == "none":
            return None
        try:
            check_tools(body.tools, body.tool_choice)
        except ValueError as e:
            raise Refused(f"tools: {e}", "tools") from None
        return tool_format(self.tokenizer.chat_template), body.tools

    async def render(self, messages, extra: dict) -> str:
        try:
            return await asyncio.to_thread(self.tokenizer.apply_chat_template, messages, True, **extra)
        except Exception as e:  # a template that fails on these messages
            raise Refused(f"the chat template failed on these messages: {e}", "messages") from None

    def params(self, body, prompts, chat: bool, tool_constraint=None) -> RequestParams:
        """The engine's parameters; Refused if a prompt + max_tokens exceeds the context, or for the constraint."""
        lengths = [len(p) for p in prompts]
        default_max = self.context - max(lengths) if chat else 16
        max_tokens = getattr(body, "max_completion_tokens", None) or body.max_tokens
        max_tokens = max_tokens if max_tokens is not None else default_max
        for i, n in enumerate(lengths):
            if n + max_tokens > self.context:
                which = "the prompt" if len(prompts) == 1 else f"prompt {i}"
                raise Refused(f"{which} ({n} tokens) plus max_tokens ({max_tokens}) exceeds {self.context_name} "
                              f"of {self.context} tokens", "max_tokens")
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        logprobs, prompt_logprobs = logprob_counts(body, chat)
        try:
            constraint = constraint_of(body)
        except ValueError as e:
            raise Refused(e.args[0], e.args[1]) from None
        if tool_constraint and constraint:
            raise Refused("a tool_choice that forces a call cannot be combined with response_format", "tool_choice")
        return RequestParams(max_new_tokens=max_tokens, temperature=body.temperature, top_k=body.top_k,
                             top_p=body.top_p, seed=body.seed, stop=stop, n=body.n, ignore_eos=body.ignore_eos,
                             logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                             min_p=body.min_p, repetition_penalty=body.repetition_penalty,
                             frequency_penalty=body.frequency_penalty, presence_penalty=body.presence_penalty,
                             logit_bias=body.logit_bias or {}, constraint=constraint or tool_constraint)

    async def respond(self, request, body, prompts, chat: bool, tools=None, tool_constraint=None):
        """Queue the prompts (400 if refused, 503 if full); the whole response, or server-sent events if "stream"."""
        params = self.params(body, prompts, chat, tool_constraint)
        try:
            rids, events = await self.loop.submit(prompts, params)
        except ValueError as e:  # RequestParams.check and Engine.add_request, in the engine thread
            raise Refused(str(e)) from None
        except Unavailable as e:
            raise Refused(str(e), response=unavailable(str(e))) from None
        meta = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{rids[0]}", "created": int(time.time()),
                "model": self.model_name}
        out = Outputs(self.tokenizer, prompts, body.n, chat, params.logprobs is not None,
                      getattr(body, "echo", False), tools)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.get("include_usage"))
            return StreamingResponse(self.sse(rids, events, out, meta, include_usage), media_type="text/event-stream")
        return await self.whole(request, rids, events, out, meta)

    async def whole(self, request, rids, events, out: Outputs, meta: dict):
        """The response once every sample is over; a client that goes away first (499) aborts them."""
        collect = asyncio.ensure_future(collect_all(rids, events, out))
        gone = asyncio.ensure_future(disconnected(request))
        try:
            await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not collect.done():  # the client went away (or this handler was cancelled): free its blocks
                collect.cancel()
                for rid in rids:
                    self.loop.abort(rid)
        if not collect.done() or collect.cancelled():
            return error(499, "the client closed the request")
        if collect.result():
            return error(500, f"the request failed: {collect.result()}", "server_error")
        # plain JSON types already: JSONResponse skips FastAPI's encoder walking every logprob
        return JSONResponse({**meta, "object": "chat.completion" if out.chat else "text_completion",
                             "choices": [out.choice(i) for i in range(out.num_choices)], "usage": out.usage()})

    async def sse(self, rids, events, out: Outputs, meta: dict, include_usage: bool):
        """A chunk per new text, usage if asked, then [DONE]; a client that goes away aborts its requests."""
        kind = "chat.completion.chunk" if out.chat else "text_completion"
        finished = False
        try:
            if out.chat:  # the first chunk of each choice carries the role
                for i in range(out.num_choices):
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
                    self.loop.abort(rid)


def make_app(engine, tokenizer, model_name: str, api_key: str = None, limits: Limits = None, thread=None):
    """The FastAPI app: validation, limits, the OpenAI wire format, and nothing else. `thread`:
    the EngineThread the engine was loaded on (engine_loop.py says why), else a new one."""
    limits = limits or Limits()
    server = Server(engine, tokenizer, model_name, limits, thread)
    app = FastAPI(title="llm inference server", exception_handlers={
        RequestValidationError: bad_request, HTTPException: http_error, Refused: refused})
    app.state.engine_loop = server.loop
    app.add_middleware(Guard, api_key=api_key, max_body_bytes=limits.max_body_bytes, engine_loop=server.loop)
    app.get("/health")(server.health)
    app.get("/metrics")(server.metrics)
    app.get("/v1/models")(server.models)
    app.post("/tokenize")(server.tokenize)
    app.post("/detokenize")(server.detokenize)
    app.post("/v1/completions")(server.completions)
    app.post("/v1/chat/completions")(server.chat_completions)
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


class DrainingServer(uvicorn.Server):
    """uvicorn, except that the first SIGTERM/SIGINT drains the engine before stopping (then exit 0);
    a second one stops at once. It says its address once bound (with --port 0 the OS picks it)."""

    def __init__(self, config: uvicorn.Config, engine_loop: EngineLoop, shutdown_timeout: float):
        super().__init__(config)
        self.engine_loop, self.shutdown_timeout = engine_loop, shutdown_timeout

    def handle_exit(self, sig, frame):
        if self.engine_loop.draining:
            self.should_exit = self.force_exit = True
            return
        self.engine_loop.draining = True
        log(f"signal {signal.Signals(sig).name}: draining (up to {self.shutdown_timeout:g} s)")
        threading.Thread(target=self.drain, daemon=True).start()

    def drain(self):
        self.engine_loop.drain(self.shutdown_timeout)
        self.should_exit = True

    def announce(self):
        while not self.started:
            time.sleep(0.05)
        host, port = self.servers[0].sockets[0].getsockname()[:2]
        log(f"serving on http://{host}:{port} (OpenAI API under /v1)")


def main(argv=None) -> int:
    from engine import add_engine_args, check_engine_args, engine_options, load_engine

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
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning")
    server = DrainingServer(config, app.state.engine_loop, args.shutdown_timeout)
    threading.Thread(target=server.announce, daemon=True).start()
    server.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
