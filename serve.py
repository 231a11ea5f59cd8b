"""An OpenAI-compatible HTTP server on the continuous-batching engine (engine.py).

    pip install -r requirements-serve.txt
    python serve.py                                   # the embedded model on http://127.0.0.1:8000
    python serve.py --checkpoint PATH --port 8080 --api_key secret

    curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \
         -d '{"prompt": "The capital of France is", "max_tokens": 16, "temperature": 0}'

Endpoints: POST /v1/completions, POST /v1/chat/completions (both with "stream": true as
server-sent events), POST /v1/responses (server/responses.py), GET /v1/models[/{id}], GET /health,
GET /metrics (Prometheus text), POST /tokenize, POST /detokenize.

This file only translates. server/engine_loop.py runs the engine in one background thread; HTTP
handlers (FastAPI, on asyncio) hand it requests and receive each new token through an asyncio queue
per request, so every concurrent HTTP request is batched into the same steps. `Server` holds what
the handlers share and has one method per step (check, encode, params, respond, ...); make_app
routes.

A server left running meets hostile traffic, so every request is checked against `Limits`
(server/server_limits.py) before any work is queued (body size -> 413; n, stop strings, prompts per
request, context -> 400; a full waiting queue -> 503 with Retry-After), text is tokenized off the
event loop, and a client that goes away (streaming or not) aborts its request, which frees its KV
blocks. SIGTERM or SIGINT drain: new requests get 503, /health says "draining", running requests
have --shutdown_timeout seconds to finish, the rest end with finish_reason "abort", the process
exits 0.
"""

import argparse
import asyncio
import gc
import json
import os
import sys
import threading
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException

from constrain import Compiled, compile_constraint
from runtime import log
from sampling import parse_logit_bias
from sequence import RequestParams
from server.constraint_check import ConstraintChecker
from server.engine_loop import EngineLoop, EngineThread, Unavailable, collect_all, events_of
from server.openai_format import (
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    Outputs,
    Refused,
    TokenizeRequest,
    constraint_of,
    encode,
    error,
    logprob_counts,
    prompt_list,
    refusal,
    template_messages,
    unavailable,
)
from server.responses import Responses
from server.server_limits import (
    DrainingServer,
    Guard,
    Limits,
    TokenizerLanes,
    add_limit_args,
    fewer_malloc_arenas,
    server_config,
    text_size,
)
from server.tool_calls import call_constraint, check_tools, legacy_tools, render_args, tool_format

API_KEY_ENV = "LLM_SERVER_API_KEY"
ROUTES = (
    "POST /v1/completions, POST /v1/chat/completions, POST /v1/responses, GET /v1/models[/{id}], "
    "POST /tokenize, POST /detokenize, GET /health, GET /metrics"
)


async def disconnected(request: Request):
    """Returns when the client goes away (the body has been read, so the next message says so)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def refused(request, exc: Refused):
    return exc.response


async def bad_request(request, exc: RequestValidationError):
    first = exc.errors()[0] if exc.errors() else {}
    where = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
    return error(400, f"{where or 'body'}: {first.get('msg', 'invalid request')}", param=where)


async def http_error(request, exc: HTTPException):
    if exc.status_code == 404:
        return error(
            404, f"no route {request.method} {request.url.path}: this server serves {ROUTES}"
        )
    return error(exc.status_code, str(exc.detail))


def param_of(message: str, body):
    """The request field an engine error names first ("repetition_penalty must be ..."), or None."""
    word = message.split(" ", 1)[0].rstrip(":")
    word = {"max_new_tokens": "max_tokens"}.get(word, word)
    return word if word in type(body).model_fields else None


def chunk(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


class Server:
    """What the routes share (engine loop, tokenizer, model name, limits, context), one method per
    step."""

    def __init__(self, engine, tokenizer, model_name: str, limits: Limits, thread=None):
        self.engine, self.tokenizer, self.model_name, self.limits = (
            engine,
            tokenizer,
            model_name,
            limits,
        )
        self.loop = EngineLoop(engine, limits.max_waiting, thread)
        self.context = min(engine.max_model_len, limits.max_model_len or engine.max_model_len)
        self.context_name = (
            "--max_model_len" if self.context < engine.max_model_len else "the model's context"
        )
        self.lanes = (
            TokenizerLanes()
        )  # a request with long texts cannot take every tokenizing thread
        self.checker = (
            None  # constraints tried in a child process first (server/constraint_check.py)
        )
        if limits.constraint_timeout and getattr(tokenizer, "source", None):
            self.checker = ConstraintChecker(
                tokenizer.source,
                engine.model.config.vocab_size,
                engine.stop_ids,
                limits.constraint_timeout,
            )

    # routes have no return annotations: FastAPI would take them as response models
    async def health(self):
        ranks = getattr(self.engine, "ranks", 1)  # tensor-parallel ranks (server/tp_engine.py)
        if self.loop.draining:
            return JSONResponse({"status": "draining", "ranks": ranks}, 503)
        return {"status": "ok", "ranks": ranks}

    async def metrics(self):
        return PlainTextResponse(self.loop.metrics(), media_type="text/plain; version=0.0.4")

    def card(self) -> dict:
        return {
            "id": self.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "local",
            "max_model_len": self.context,
        }

    async def models(self):
        return {"object": "list", "data": [self.card()]}

    async def model(self, model_id: str):
        if model_id != self.model_name:
            message = (
                f"the model {model_id!r} does not exist: this server serves {self.model_name!r}"
            )
            raise Refused(
                message, response=error(404, message, param="model", code="model_not_found")
            )
        return self.card()

    async def embeddings(self):
        message = (
            "this server does not serve embeddings (/v1/embeddings): it runs a generative model, "
            f"and serves {ROUTES}"
        )
        raise Refused(message, response=error(404, message))

    async def tokenize(self, body: TokenizeRequest):
        try:
            if body.messages is not None:
                messages = template_messages(body)
                size = text_size(messages)
                text = await self.lanes.run(size, self.tokenizer.apply_chat_template, messages)
                ids = await self.lanes.run(size, encode, self.tokenizer, text, False, messages)
            else:
                bos = None if body.add_special_tokens else False
                ids = await self.lanes.run(
                    text_size(body.prompt), encode, self.tokenizer, body.prompt or "", bos
                )
        except Exception as e:
            raise Refused(
                f"cannot tokenize: {e}", "messages" if body.messages is not None else "prompt"
            ) from None
        # the reply built off the event loop too: a 4 MB text's ids held /health for seconds
        reply = {"count": len(ids), "max_model_len": self.context, "tokens": ids}
        return await self.lanes.run(len(ids), JSONResponse, reply)

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
        prompt, tools, tool_constraint = await self.chat_prompt(body)
        return await self.respond(
            request, body, [prompt], chat=True, tools=tools, tool_constraint=tool_constraint
        )

    async def chat_prompt(self, body: ChatRequest):
        """(prompt ids, (format, tools) when the reply may hold calls, the grammar a tool_choice
        imposes)."""
        self.check(body, 1, chat=True)
        messages = self.messages(body)
        tools = self.tools(body)
        messages, extra = render_args(
            messages, body.tools, body.tool_choice, self.tokenizer.chat_template
        )
        parallel, text = body.parallel_tool_calls, self.constraint(body)
        try:
            tool_constraint = (
                call_constraint(body.tools, body.tool_choice, tools[0], parallel, text)
                if tools
                else None
            )
        except ValueError as e:
            raise Refused(e.args[0], e.args[1]) from None
        text = await self.render(messages, extra)
        (prompt,) = await self.encode(
            [text], "messages", bos=False, messages=messages
        )  # (the template writes BOS)
        return prompt, tools, tool_constraint

    def check(self, body, num_prompts: int, chat: bool):
        """The limits (and logit_bias ids) that need no tokens; Refused naming the first one
        broken."""
        limits, stop = (
            self.limits,
            [body.stop] if isinstance(body.stop, str) else list(body.stop or []),
        )
        if body.n > limits.max_n:
            raise Refused(
                f"n = {body.n} exceeds this server's limit of {limits.max_n} samples (--max_n)", "n"
            )
        if len(stop) > limits.max_stop:
            raise Refused(
                f"{len(stop)} stop strings exceed this server's limit of {limits.max_stop} (--max_stop)",
                "stop",
            )
        if num_prompts > limits.max_prompts:
            raise Refused(
                f"{num_prompts} prompts exceed this server's limit of {limits.max_prompts} (--max_prompts)",
                "prompt",
            )
        try:
            parse_logit_bias(body.logit_bias, self.engine.model.config.vocab_size)
        except ValueError as e:
            raise Refused(str(e), "logit_bias") from None
        if refused := refusal(body, chat):
            raise Refused(*refused)

    async def encode(self, prompts, param: str, bos: bool = None, messages=None) -> list:
        """Texts -> token ids (ids pass through), off the event loop: /health answers while a long
        text encodes. A rendered chat comes with its messages (their special-token literals stay
        text)."""
        try:
            return await self.lanes.run(
                text_size(prompts),
                lambda: [
                    encode(self.tokenizer, p, bos, messages) if isinstance(p, str) else p
                    for p in prompts
                ],
            )
        except ValueError as e:
            raise Refused(f"{param}: {e}", param) from None

    def messages(self, body: ChatRequest) -> list:
        try:
            return template_messages(body)
        except ValueError as e:
            raise Refused(f"messages: {e}", "messages") from None

    def tools(self, body: ChatRequest):
        """(format, tools) when the reply may hold tool calls, else None. The legacy `functions` and
        `function_call` are read as tools and tool_choice (and answered in their form)."""
        if body.functions is not None or body.function_call is not None:
            if body.tools is not None or body.tool_choice is not None:
                raise Refused(
                    "send tools and tool_choice, or the legacy functions and function_call, not both",
                    "functions",
                )
            body.tools, body.tool_choice = legacy_tools(body.functions, body.function_call)
        if body.tool_choice not in (None, "auto", "none") and not body.tools:
            raise Refused(f"tool_choice {body.tool_choice!r} needs tools", "tool_choice")
        if not body.tools or body.tool_choice == "none":
            return None
        try:
            check_tools(body.tools, body.tool_choice)
        except ValueError as e:
            param = e.args[1] if len(e.args) > 1 else "tools"
            raise Refused(f"{param}: {e.args[0]}", param) from None
        return tool_format(self.tokenizer.chat_template), body.tools

    async def render(self, messages, extra: dict) -> str:
        try:
            return await self.lanes.run(
                text_size((messages, extra)),
                self.tokenizer.apply_chat_template,
                messages,
                True,
                **extra,
            )
        except Exception as e:  # a template that fails on these messages
            raise Refused(f"the chat template failed on these messages: {e}", "messages") from None

    def params(self, body, prompts, chat: bool, tool_constraint=None) -> RequestParams:
        """The engine's parameters; Refused if a prompt + max_tokens exceeds the context, or for the
        constraint. The tools' grammar (a forced call; calls or the JSON answer under "auto") takes
        response_format's place."""
        lengths = [len(p) for p in prompts]
        default_max = self.context - max(lengths) if chat else 16
        max_tokens = getattr(body, "max_completion_tokens", None) or body.max_tokens
        max_tokens = max_tokens if max_tokens is not None else default_max
        for i, n in enumerate(lengths):
            if n + max_tokens > self.context:
                which = "the prompt" if len(prompts) == 1 else f"prompt {i}"
                raise Refused(
                    f"{which} ({n} tokens) plus max_tokens ({max_tokens}) exceeds {self.context_name} "
                    f"of {self.context} tokens",
                    "max_tokens",
                )
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        logprobs, prompt_logprobs = logprob_counts(body, chat)
        if logprobs is not None:  # what the response would hold, refused up front if too much
            scored = prompt_logprobs is not None
            entries = (
                body.n * sum(length * scored + max_tokens for length in lengths) * (1 + logprobs)
            )
            if entries > self.limits.max_logprob_entries:
                raise Refused(
                    f"this request asks for {entries} log-probabilities (tokens x samples x (1 + "
                    f"alternatives)); this server answers at most {self.limits.max_logprob_entries} "
                    "(--max_logprob_entries)",
                    "logprobs",
                )
        constraint = self.constraint(body)
        return RequestParams(
            max_new_tokens=max_tokens,
            temperature=body.temperature,
            top_k=body.top_k,
            top_p=body.top_p,
            seed=body.seed,
            stop=stop,
            n=body.n,
            ignore_eos=body.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            min_p=body.min_p,
            repetition_penalty=body.repetition_penalty,
            frequency_penalty=body.frequency_penalty,
            presence_penalty=body.presence_penalty,
            logit_bias=body.logit_bias or {},
            constraint=tool_constraint or constraint,
        )

    @staticmethod
    def constraint(body):
        """The output constraint response_format or structured_outputs asks for, or None;
        Refused."""
        try:
            return constraint_of(body)
        except ValueError as e:
            raise Refused(e.args[0], e.args[1]) from None

    async def compiled(self, constraint, body, tool_constraint):
        """The constraint tried in the checker's process (where a crash or a stall harms no one),
        then compiled here on a thread of its lane (TokenizerLanes.compile): constrain.Compiled;
        Refused naming the field."""
        try:
            await asyncio.to_thread(self.checker.check, constraint)
            vocab, stops = self.engine.model.config.vocab_size, self.engine.stop_ids
            return Compiled(
                constraint,
                await self.lanes.compile(
                    compile_constraint, constraint, self.tokenizer, vocab, stops
                ),
            )
        except ValueError as e:
            param = (
                "tools"
                if tool_constraint
                else "response_format"
                if body.response_format
                else "structured_outputs"
            )
            raise Refused(f"{param}: {e}", param) from None

    async def submit(self, body, prompts, chat: bool, tool_constraint=None):
        """Queue the prompts: (request ids, their events, the engine's parameters); Refused (400)
        for a request the engine refuses, 503 when it cannot take more now."""
        params = self.params(body, prompts, chat, tool_constraint)
        if params.constraint is not None and self.checker:
            params.constraint = await self.compiled(params.constraint, body, tool_constraint)
        try:
            rids, events = await self.loop.submit(prompts, params)
        except ValueError as e:  # RequestParams.check and Engine.add_request, in the engine thread
            raise Refused(str(e), param_of(str(e), body)) from None
        except Unavailable as e:
            raise Refused(str(e), response=unavailable(str(e))) from None
        return rids, events, params

    async def respond(self, request, body, prompts, chat: bool, tools=None, tool_constraint=None):
        """Queue the prompts; the whole response, or server-sent events if "stream"."""
        rids, events, params = await self.submit(body, prompts, chat, tool_constraint)
        meta = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{rids[0]}",
            "created": int(time.time()),
            "model": self.model_name,
        }
        legacy = chat and body.functions is not None
        out = Outputs(
            self.tokenizer,
            prompts,
            body.n,
            chat,
            params.logprobs is not None,
            getattr(body, "echo", False),
            tools,
            getattr(body, "parallel_tool_calls", True),
            legacy,
            tool_format(self.tokenizer.chat_template) == "harmony",
        )
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.get("include_usage"))
            return StreamingResponse(
                self.sse(rids, events, out, meta, include_usage), media_type="text/event-stream"
            )
        return await self.whole(request, rids, events, out, meta)

    async def whole(self, request, rids, events, out: Outputs, meta: dict):
        """The response once every sample is over."""
        failed = await self.collect(request, rids, events, out)
        if failed:
            return failed

        # plain JSON types already: JSONResponse skips FastAPI's encoder walking every logprob
        def build():
            return JSONResponse(
                {
                    **meta,
                    "object": "chat.completion" if out.chat else "text_completion",
                    "choices": [out.choice(i) for i in range(out.num_choices)],
                    "usage": out.usage(),
                }
            )

        return await asyncio.to_thread(build)  # off the event loop: log-probabilities can be many

    async def collect(self, request, rids, events, out: Outputs):
        """Every event into `out`: None, or the error response (500 if a request failed; 499, with
        its requests aborted, if the client went away first)."""
        collect = asyncio.ensure_future(collect_all(rids, events, out))
        gone = asyncio.ensure_future(disconnected(request))
        try:
            await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if (
                not collect.done()
            ):  # the client went away (or this handler was cancelled): free its blocks
                collect.cancel()
                for rid in rids:
                    self.loop.abort(rid)
        if not collect.done() or collect.cancelled():
            return error(499, "the client closed the request")
        if collect.result():
            return error(500, f"the request failed: {collect.result()}", "server_error")
        return None

    async def sse(self, rids, events, out: Outputs, meta: dict, include_usage: bool):
        """A chunk per new text, usage if asked, then [DONE]; a client that goes away aborts its
        requests."""
        kind = "chat.completion.chunk" if out.chat else "text_completion"
        finished = False
        try:
            if out.chat:  # the first chunk of each choice carries the role
                for i in range(out.num_choices):
                    yield chunk(
                        {
                            **meta,
                            "object": kind,
                            "choices": [
                                {
                                    "index": i,
                                    "delta": {"role": "assistant", "content": ""},
                                    "finish_reason": None,
                                }
                            ],
                        }
                    )
            async for event in events_of(rids, events, out):
                if isinstance(
                    event, str
                ):  # one request failed: say so, the stream still ends cleanly
                    yield chunk(
                        {
                            "error": {
                                "message": f"the request failed: {event}",
                                "type": "server_error",
                                "param": None,
                                "code": None,
                            }
                        }
                    )
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


def make_app(
    engine, tokenizer, model_name: str, api_key: str = None, limits: Limits = None, thread=None
):
    """The FastAPI app: validation, limits, the OpenAI wire format, and nothing else. `thread`:
    the EngineThread the engine was loaded on (server/engine_loop.py says why), else a new one."""
    limits = limits or Limits()
    server = Server(engine, tokenizer, model_name, limits, thread)
    responses = Responses(server, limits.max_stored_responses)
    app = FastAPI(
        title="llm inference server",
        exception_handlers={
            RequestValidationError: bad_request,
            HTTPException: http_error,
            Refused: refused,
        },
    )
    app.state.engine_loop = server.loop
    app.router.on_shutdown.append(server.lanes.close)
    if server.checker:
        app.router.on_shutdown.append(server.checker.close)
    app.add_middleware(
        Guard, api_key=api_key, max_body_bytes=limits.max_body_bytes, engine_loop=server.loop
    )
    app.get("/health")(server.health)
    app.get("/metrics")(server.metrics)
    app.get("/v1/models")(server.models)
    app.get("/v1/models/{model_id:path}")(server.model)
    app.post("/tokenize")(server.tokenize)
    app.post("/detokenize")(server.detokenize)
    app.post("/v1/completions")(server.completions)
    app.post("/v1/chat/completions")(server.chat_completions)
    app.post("/v1/responses")(responses.create)
    app.post("/v1/embeddings")(server.embeddings)
    return app


def main(argv=None) -> int:
    from server.engine_flags import add_engine_args, check_engine_args, engine_options
    from server.tp_engine import (  # tensor-parallel under torchrun
        ignore_signals_unless_rank_zero,
        load_engine,
    )

    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind (0.0.0.0 exposes the server to the network)",
    )
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    p.add_argument(
        "--api_key",
        default=os.environ.get(API_KEY_ENV),
        help=f"require 'Authorization: Bearer KEY' on everything but /health (default: ${API_KEY_ENV} if set)",
    )
    p.add_argument(
        "--model_name", default=None, help="the model id clients send and /v1/models lists"
    )
    add_limit_args(p)
    add_engine_args(p)
    args = p.parse_args(argv)
    check_engine_args(p, args)
    for name in ("max_stored_responses", "constraint_timeout"):
        if getattr(args, name) < 0:
            p.error(f"--{name} must be >= 0")
    for name in (
        "max_waiting",
        "max_n",
        "max_body_bytes",
        "max_prompts",
        "max_stop",
        "max_model_len",
        "max_logprob_entries",
    ):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    ignore_signals_unless_rank_zero()
    fewer_malloc_arenas()  # before the threads start
    thread = EngineThread()  # loads the model and then steps it (server/engine_loop.py says why)
    try:
        engine, tokenizer, info = thread.call(load_engine, **engine_options(args)).result()
    except (ValueError, OSError) as e:
        log(f"error: {e}")
        return 2
    name = args.model_name or os.path.basename(str(info.source).rstrip("/"))
    limits = Limits(**{k: getattr(args, k) for k in Limits.__dataclass_fields__})
    app = make_app(engine, tokenizer, name, args.api_key, limits, thread)
    gc.collect()  # loading's garbage first: what gc.freeze keeps is never collected
    # what loading made is kept: give_back_freed_memory's collections skip it (285 ms -> 0)
    gc.freeze()
    server = DrainingServer(
        server_config(app, args.host, args.port, limits),
        app.state.engine_loop,
        args.shutdown_timeout,
    )
    threading.Thread(target=server.announce, daemon=True).start()
    server.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
