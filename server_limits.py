"""What one request may ask of serve.py, checked before any handler reads it: the API key, the
body size, the server draining, and the limits each request is held to (`Limits`, one flag each);
and how the server ends (`DrainingServer`: drain on the first signal, within a hard bound).

    python -c "import server_limits"     # library only; serve.py uses it

`Guard` is ASGI middleware, so a request too large or unauthorized is refused before FastAPI
parses a byte of it; `Limits` are checked by serve.py's steps before anything is queued.
"""
import argparse
import hmac
import os
import signal
import threading
import time
from dataclasses import dataclass

import uvicorn
from starlette.exceptions import HTTPException

from openai_format import error, unavailable
from runtime import log


@dataclass
class Limits:
    """What one request may ask for; each is a serve.py flag."""
    max_waiting: int = 256  # requests queued for a slot; more -> 503
    max_n: int = 16  # samples per prompt
    max_model_len: int = None  # prompt + max_tokens, when lower than the model's context
    max_body_bytes: int = 4 * 2**20  # request body; more -> 413
    max_prompts: int = 64  # prompts in one completions request
    max_stop: int = 16  # stop strings
    max_stored_responses: int = 256  # Responses API replies kept for previous_response_id (0: none)
    max_logprob_entries: int = 2_000_000  # log-probabilities one response may hold (~100 MB of JSON)
    constraint_timeout: float = 10.0  # seconds a new constraint may take to compile (0: not tried first)


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
    p.add_argument("--max_stored_responses", type=int, default=d.max_stored_responses,
                   help="replies of /v1/responses kept in memory for previous_response_id (0 keeps none)")
    p.add_argument("--max_logprob_entries", type=int, default=d.max_logprob_entries,
                   help="most log-probabilities one response may hold (tokens x samples x (1 + alternatives))")
    p.add_argument("--constraint_timeout", type=float, default=d.constraint_timeout,
                   help="seconds a new constraint may take to compile in the checking process; 0 compiles it "
                        "on the engine thread untried")
    p.add_argument("--shutdown_timeout", type=float, default=30.0,
                   help="on SIGTERM/SIGINT, seconds running requests may take to finish before they are aborted")


class DrainingServer(uvicorn.Server):
    """uvicorn, except that the first SIGTERM/SIGINT drains the engine before stopping (then exit
    0), with --shutdown_timeout (plus GRACE_S to close) a hard bound; a second one exits at once
    (128 + the signal: 143, 130), without unwinding threads caught mid-step (that aborted the
    process with a traceback). It says its address once bound (with --port 0 the OS picks it)."""
    GRACE_S = 2.0

    def __init__(self, config: uvicorn.Config, engine_loop, shutdown_timeout: float):
        super().__init__(config)
        self.engine_loop, self.shutdown_timeout = engine_loop, shutdown_timeout

    def handle_exit(self, sig, frame):
        name = signal.Signals(sig).name
        if self.engine_loop.draining:
            log(f"signal {name} again: exiting now")
            os._exit(128 + sig)
        self.engine_loop.draining = True
        log(f"signal {name}: draining (up to {self.shutdown_timeout:g} s)")
        threading.Thread(target=self.drain, daemon=True).start()
        threading.Thread(target=self.watchdog, daemon=True).start()

    def drain(self):
        self.engine_loop.drain(self.shutdown_timeout)
        self.should_exit = True

    def watchdog(self):
        time.sleep(self.shutdown_timeout + self.GRACE_S)
        log(f"still closing {self.GRACE_S:g} s after --shutdown_timeout: exiting")
        os._exit(0)

    def announce(self):
        while not self.started:
            time.sleep(0.05)
        host, port = self.servers[0].sockets[0].getsockname()[:2]
        log(f"serving on http://{host}:{port} (OpenAI API under /v1)")
