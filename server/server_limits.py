"""What one request may ask of serve.py, checked before any handler reads it: the API key, the
body size, the server draining, and the limits each request is held to (`Limits`, one flag each);
how long a connection may keep the server waiting (`GuardedH11`: a request's headers and body
within --header_timeout, a reply the client stops reading cut after --write_timeout); and how
the server ends (`DrainingServer`: drain on the first signal, within a hard bound).

    python -c "from server import server_limits"     # library only; serve.py uses it

`Guard` is ASGI middleware, so a request too large or unauthorized is refused before FastAPI
parses a byte of it; `Limits` are checked by the server's steps (server/completions.py) before
anything is queued. After a
request or reply of 256 KiB or more, and when the server falls idle and no request starts within
half a second, the memory freed goes back to the system (give_back_freed_memory); threads share
two malloc arenas (fewer_malloc_arenas).
"""

import argparse
import asyncio
import contextlib
import ctypes
import functools
import gc
import hmac
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import h11
import uvicorn
from starlette.exceptions import HTTPException
from uvicorn.protocols.http.h11_impl import H11Protocol

from runtime import log
from server.openai_format import error, unavailable


@dataclass
class Limits:
    """What one request may ask for; each is a serve.py flag."""

    max_waiting: int = 256  # requests queued for a slot; more -> 503
    max_n: int = 16  # samples per prompt
    max_model_len: int = None  # prompt + max_tokens, when lower than the model's context
    max_body_bytes: int = 4 * 2**20  # request body; more -> 413
    max_prompts: int = 64  # prompts in one completions request
    max_inputs: int = 2048  # inputs of one embeddings request, documents of one rerank (OpenAI's)
    max_stop: int = 16  # stop strings
    max_stored_responses: int = 256  # Responses API replies kept for previous_response_id (0: none)
    max_logprob_entries: int = (
        2_000_000  # log-probabilities one response may hold (~100 MB of JSON)
    )
    constraint_timeout: float = (
        10.0  # seconds a new constraint may take to compile (0: not tried first)
    )
    header_timeout: float = (
        10.0  # seconds a request's headers and body may take to arrive (slowloris)
    )
    write_timeout: float = (
        30.0  # seconds a reply may wait on a client that reads nothing, before it is cut
    )


class TokenizerLanes:
    """Tokenizing and chat rendering off the event loop, shared fairly: a request whose texts hold
    LONG_TEXT characters or more waits for a thread of its own lane (one at a time), while shorter
    ones keep asyncio's default pool. Eight 4 MB prompts (3.8 s each to tokenize here) had taken
    every thread of that pool, and a short chat behind them waited 13 s instead of 0.65 s."""

    LONG_TEXT = 1 << 16

    def __init__(self, long_workers: int = 1):
        self.long = ThreadPoolExecutor(long_workers, thread_name_prefix="tokenize-long")
        # constraints compile on two threads of their own: llguidance's recursion through a deep
        # schema leaves 4.6 MiB of stack resident on every thread it has run on (RESULTS.md 6b), and
        # two keep one slow schema (up to --constraint_timeout to compile) from holding up the rest
        self.compiling = ThreadPoolExecutor(2, thread_name_prefix="constraint-compile")

    async def run(self, size: int, fn, *args, **kwargs):
        """fn(*args, **kwargs) in a thread; size: the characters of the texts it works on."""
        if size < self.LONG_TEXT:
            return await asyncio.to_thread(fn, *args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(
            self.long, functools.partial(fn, *args, **kwargs)
        )

    async def compile(self, fn, *args):
        """fn(*args) on a constraint-compiling thread."""
        return await asyncio.get_running_loop().run_in_executor(
            self.compiling, functools.partial(fn, *args)
        )

    def close(self):
        self.long.shutdown(wait=False, cancel_futures=True)
        self.compiling.shutdown(wait=False, cancel_futures=True)


def text_size(value) -> int:
    """The characters of the strings in a prompt, a list of them or chat messages (ids count 0)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(map(text_size, value.values()))
    return sum(map(text_size, value)) if isinstance(value, (list, tuple)) else 0


LARGE_BYTES = (
    1 << 18
)  # a request body or reply this large: memory freed after it goes back to the system
GIVE_BACK_DELAY_S = (
    0.5  # ... this long after it, or after the server fell idle and stayed so, once per burst
)


def give_back_freed_memory():
    """glibc keeps what a large request freed in its arenas: twelve 0.9 MB requests (100,000
    choices) grew the server from 510 to 764 MiB resident; with this after each it stayed at 465.
    The trim itself takes 0.2 ms; the collection is cheap only after serve.py's gc.freeze (else 285
    ms here)."""
    gc.collect()  # what it left in cycles: most of it
    with contextlib.suppress(Exception):  # (not glibc: no malloc_trim)
        ctypes.CDLL(None).malloc_trim(0)


M_ARENA_MAX = -8  # glibc's malloc.h


def fewer_malloc_arenas(n: int = 2):
    """glibc gives each thread that allocates an arena of its own (up to 8 per core), and each keeps
    what was freed in it. In a 2,000-request soak of the server, idle after warm-up -> idle at the
    end, that grew resident memory 494 -> 535 MiB (+8%); two arenas kept it at 492 -> 497 (+1%),
    time to first token no worse (RESULTS.md 6b). Call before threads start; $MALLOC_ARENA_MAX
    wins."""
    if "MALLOC_ARENA_MAX" not in os.environ:
        with contextlib.suppress(Exception):  # (not glibc)
            ctypes.CDLL(None).mallopt(M_ARENA_MAX, n)


def authorized(header: bytes, api_key: str) -> bool:
    """'Authorization: Bearer KEY', the scheme name in any case (RFC 7235)."""
    scheme, _, token = header.decode("latin-1").strip().partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(
        token.strip().encode(), api_key.encode()
    )


class Guard:
    """ASGI middleware, before any handler reads the body: the API key (everything but /health
    needs it when set, /metrics and /docs included), 503 while draining, a request framed two ways
    (Content-Length and Transfer-Encoding: 400), and the body size (413, from Content-Length or
    while a chunked body arrives)."""

    def __init__(self, app, api_key, max_body_bytes, engine_loop):
        self.app, self.api_key, self.max_body_bytes, self.engine_loop = (
            app,
            api_key,
            max_body_bytes,
            engine_loop,
        )
        self.giving_back = False  # a give_back_freed_memory is due
        self.active = self.started = (
            0  # requests being answered, and begun: idle, freed memory goes back too
        )
        self.large_freed = False  # a request or reply of LARGE_BYTES ended since the last give-back

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] == "/health":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.api_key and not authorized(headers.get(b"authorization", b""), self.api_key):
            return await error(
                401,
                "invalid or missing API key (send 'Authorization: Bearer <key>')",
                "authentication_error",
            )(scope, receive, send)
        if self.engine_loop.draining and scope["method"] == "POST":
            return await unavailable("the server is shutting down")(scope, receive, send)
        names = [name for name, _ in scope["headers"]]
        if b"transfer-encoding" in names and b"content-length" in names:
            return await error(  # request smuggling's shape: RFC 9112 6.3 lets a server refuse it
                400,
                "a request with both Content-Length and Transfer-Encoding is ambiguous: send one",
                headers={"Connection": "close"},
            )(scope, receive, send)
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

        sent = 0

        async def counted_send(message):
            nonlocal sent
            sent += len(message.get("body", b""))
            await send(message)

        self.active, self.started = self.active + 1, self.started + 1
        try:
            await self.app(scope, bounded_receive, counted_send)
        finally:
            self.active -= 1
            self.large_freed |= max(received, sent) >= LARGE_BYTES
            if (self.large_freed or not self.active) and not self.giving_back:  # one per burst
                self._give_back_later()

    def _give_back_later(self):
        self.giving_back = True
        asyncio.get_running_loop().call_later(GIVE_BACK_DELAY_S, self._give_back, self.started)

    def _give_back(self, started: int):
        """After a large request; or idle, if no request has started since (a collection on the
        loop would stall the streams of one that had)."""
        self.giving_back = False
        if self.large_freed or (not self.active and self.started == started):
            self.large_freed = False
            # on the loop, not in a thread: a collection finalizes the loop's own objects
            give_back_freed_memory()
        elif (
            not self.active
        ):  # idle again after requests that came and went: wait for calm once more
            self._give_back_later()


def add_limit_args(p: argparse.ArgumentParser):
    """Every limit as a flag, its default the Limits field's: sizes, then times."""
    add_size_limits(p, Limits())
    add_time_limits(p, Limits())


def add_size_limits(p, d):
    """How much one request (or the queue) may ask for."""
    p.add_argument(
        "--max_waiting",
        type=int,
        default=d.max_waiting,
        help="requests that may wait for a slot; more get 503 with Retry-After",
    )
    p.add_argument("--max_n", type=int, default=d.max_n, help="most samples (n) per prompt")
    p.add_argument(
        "--max_model_len",
        type=int,
        default=None,
        help="most prompt + max_tokens per request (default: the model's context)",
    )
    p.add_argument(
        "--max_body_bytes",
        type=int,
        default=d.max_body_bytes,
        help="largest request body; more get 413",
    )
    p.add_argument(
        "--max_prompts",
        type=int,
        default=d.max_prompts,
        help="most prompts in one completions request",
    )
    p.add_argument(
        "--max_inputs",
        type=int,
        default=d.max_inputs,
        help="most inputs in one /v1/embeddings request, documents in one /v1/rerank",
    )
    p.add_argument("--max_stop", type=int, default=d.max_stop, help="most stop strings per request")
    p.add_argument(
        "--max_stored_responses",
        type=int,
        default=d.max_stored_responses,
        help="replies of /v1/responses kept in memory for previous_response_id (0 keeps none)",
    )
    p.add_argument(
        "--max_logprob_entries",
        type=int,
        default=d.max_logprob_entries,
        help="most log-probabilities one response may hold (tokens x samples x (1 + alternatives))",
    )


def add_time_limits(p, d):
    """How long a client, a constraint or a shutdown may take."""
    p.add_argument(
        "--constraint_timeout",
        type=float,
        default=d.constraint_timeout,
        help="seconds a new constraint may take to compile in the checking process; 0 compiles it "
        "on the engine thread untried",
    )
    p.add_argument(
        "--header_timeout",
        type=float,
        default=d.header_timeout,
        help="seconds a connection may take to send a whole request (headers and body); then it "
        "is closed",
    )
    p.add_argument(
        "--write_timeout",
        type=float,
        default=d.write_timeout,
        help="seconds a reply may wait on a client whose socket takes no more; then the connection "
        "is closed and its request aborted",
    )
    p.add_argument(
        "--shutdown_timeout",
        type=float,
        default=30.0,
        help="on SIGTERM/SIGINT, seconds running requests may take to finish before they are "
        "aborted",
    )


class GuardedH11(H11Protocol):
    """uvicorn's HTTP/1.1 connection with the two deadlines it lacks. A connection that opens (or
    has its last reply) must send a whole request within config.header_timeout: a client sending
    headers a byte at a time (slowloris) held a socket forever, since any byte resets uvicorn's
    keep-alive timer. A reply whose bytes the client stops taking (the socket's buffers full: the
    transport calls pause_writing) for config.write_timeout is cut: the connection is aborted, and
    the request behind it with it, so a stream that is not read cannot hold its slot."""

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.header_timeout, self.write_timeout = config.header_timeout, config.write_timeout
        self.replies, self.stalled = 0, None

    def connection_made(self, transport):
        super().connection_made(transport)
        self.loop.call_later(self.header_timeout, self._request_due, self.replies)

    def on_response_complete(self):
        super().on_response_complete()
        self.replies += 1
        self.loop.call_later(self.header_timeout, self._request_due, self.replies)

    def _request_due(self, replies: int):
        """Still no whole request since the reply counted `replies` (or the connection): close."""
        waiting = self.conn.their_state in (h11.IDLE, h11.SEND_BODY)
        if replies == self.replies and waiting and not self.transport.is_closing():
            self.transport.close()

    def pause_writing(self):
        super().pause_writing()
        self.stalled = self.loop.call_later(self.write_timeout, self._cut)

    def resume_writing(self):
        super().resume_writing()
        if self.stalled is not None:
            self.stalled.cancel()
            self.stalled = None

    def _cut(self):
        log(
            f"a client took no bytes for {self.write_timeout:g} s (--write_timeout): its "
            "connection is cut"
        )
        self.transport.abort()  # (close() would wait for the unread bytes to drain)


def server_config(app, host: str, port: int, limits: Limits = None) -> uvicorn.Config:
    """uvicorn's settings for serve.py: GuardedH11 with the limits' deadlines (None: Limits()), idle
    keep-alive 5 s."""
    limits = limits or Limits()
    config = uvicorn.Config(
        app, host=host, port=port, log_level="warning", http=GuardedH11, timeout_keep_alive=5
    )
    config.header_timeout, config.write_timeout = limits.header_timeout, limits.write_timeout
    return config


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
