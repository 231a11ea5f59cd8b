"""An OpenAI-compatible HTTP server on the continuous-batching engine (engine.py).

    pip install -r requirements-serve.txt
    python serve.py                                   # the embedded model on http://127.0.0.1:8000
    python serve.py --checkpoint PATH --port 8080 --api_key secret

    curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \
         -d '{"prompt": "The capital of France is", "max_tokens": 16, "temperature": 0}'

Endpoints: POST /v1/completions, POST /v1/chat/completions (both with "stream": true as
server-sent events), POST /v1/responses (server/responses.py), POST /v1/embeddings and POST
/v1/rerank (server/embeddings.py), GET /v1/models[/{id}], GET /health, GET /metrics (Prometheus
text), POST /tokenize, POST /detokenize; with LoRA adapters (--lora NAME=PATH, server/adapters.py)
a request's "model" picks one, and POST /v1/load_lora_adapter and /v1/unload_lora_adapter change
them while the server runs.

This file only wires the parts. server/engine_loop.py runs the engine in one background thread;
HTTP handlers (FastAPI, on asyncio) hand it requests and receive each new token through an asyncio
queue per request, so every concurrent HTTP request is batched into the same steps. `Server`
(server/completions.py) holds what the handlers share and has one method per step (check, encode,
params, respond, ...); server/delivery.py answers whole or streamed, server/info_routes.py serves
the routes that run no model step; make_app routes.

A server left running meets hostile traffic, so every request is checked against `Limits`
(server/server_limits.py) before any work is queued (body size -> 413; n, stop strings, prompts per
request, context -> 400; a full waiting queue -> 503 with Retry-After), text is tokenized off the
event loop, and a client that goes away (streaming or not) aborts its request, which frees its KV
blocks. SIGTERM or SIGINT drain: new requests get 503, /health says "draining", running requests
have --shutdown_timeout seconds to finish, the rest end with finish_reason "abort", the process
exits 0.
"""

import argparse
import gc
import os
import sys
import threading

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException

from runtime import log
from server.completions import Server
from server.embeddings import Embeddings, embedding_spec
from server.engine_loop import EngineThread
from server.info_routes import ROUTES, InfoRoutes
from server.openai_format import Refused, error, field_path
from server.responses import Responses
from server.server_limits import (
    DrainingServer,
    Guard,
    Limits,
    add_limit_args,
    fewer_malloc_arenas,
    server_config,
)
from speedups.kv_tier import keep_pool

API_KEY_ENV = "LLM_SERVER_API_KEY"


async def refused(request, exc: Refused):
    return exc.response


async def bad_request(request, exc: RequestValidationError):
    first = exc.errors()[0] if exc.errors() else {}
    where = field_path(first.get("loc", ())[1:]) or None
    return error(400, f"{where or 'body'}: {first.get('msg', 'invalid request')}", param=where)


async def http_error(request, exc: HTTPException):
    if exc.status_code == 404:
        return error(
            404, f"no route {request.method} {request.url.path}: this server serves {ROUTES}"
        )
    return error(exc.status_code, str(exc.detail))


def make_app(
    engine,
    tokenizer,
    model_name: str,
    api_key: str = None,
    limits: Limits = None,
    thread=None,
    embedding=(None, None),
):
    """The FastAPI app: validation, limits, the OpenAI wire format, and nothing else. `thread`:
    the EngineThread the engine was loaded on (server/engine_loop.py says why), else a new one;
    embedding: server/embeddings.embedding_spec's (spec, why not)."""
    limits = limits or Limits()
    server = Server(engine, tokenizer, model_name, limits, thread)
    retrieval = Embeddings(server, *embedding)
    info = InfoRoutes(server)
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
    app.get("/health")(info.health)
    app.get("/metrics")(info.metrics)
    app.get("/v1/models")(info.models)
    app.get("/v1/models/{model_id:path}")(info.model)
    app.post("/tokenize")(info.tokenize)
    app.post("/detokenize")(info.detokenize)
    app.post("/v1/completions")(server.completions)
    app.post("/v1/chat/completions")(server.chat_completions)
    app.post("/v1/responses")(responses.create)
    app.post("/v1/embeddings")(retrieval.embeddings)
    app.post("/v1/rerank")(retrieval.rerank)
    app.post("/rerank")(retrieval.rerank)  # llama.cpp's and Jina's clients' path
    app.post("/v1/load_lora_adapter")(server.adapter_routes.load)  # vLLM's names and bodies
    app.post("/v1/unload_lora_adapter")(server.adapter_routes.unload)
    return app


def main(argv=None) -> int:
    from server.engine_flags import engine_options
    from server.tp_engine import (  # tensor-parallel under torchrun
        ignore_signals_unless_rank_zero,
        load_engine,
    )

    args = parse_args(argv)
    ignore_signals_unless_rank_zero()
    fewer_malloc_arenas()  # before the threads start
    thread = EngineThread()  # loads the model and then steps it (server/engine_loop.py says why)
    try:
        engine, tokenizer, info = thread.call(load_engine, **engine_options(args)).result()
        embedding = embedding_spec(info.source, args.pooling, engine.model)
    except (ValueError, OSError) as e:
        log(f"error: {e}")
        return 2
    name = args.model_name or os.path.basename(str(info.source).rstrip("/"))
    limits = Limits(**{k: getattr(args, k) for k in Limits.__dataclass_fields__})
    app = make_app(engine, tokenizer, name, args.api_key, limits, thread, embedding)
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
    try:  # drained: a disk tier (--kv_disk_cache) keeps the pool's prefixes too
        app.state.engine_loop.call(keep_pool, engine).result(timeout=60)
    except Exception as e:  # (its files are renamed into place whole: none is left half written)
        log(f"warning: the pool's prefixes were not all written to the KV disk tier ({e})")
    return 0


def parse_args(argv=None) -> argparse.Namespace:
    """serve.py's flags (its own, the limits', the engine's), checked: a bad one exits naming
    it."""
    from server.engine_flags import add_engine_args, check_engine_args

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
        help=f"require 'Authorization: Bearer KEY' on everything but /health (default: "
        f"${API_KEY_ENV} if set)",
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
        "max_inputs",
        "max_stop",
        "max_model_len",
        "max_logprob_entries",
    ):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    return args


if __name__ == "__main__":
    sys.exit(main())
