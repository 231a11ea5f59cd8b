"""A queued response delivered: whole, once every sample is over (`whole`, `collect`), or as
server-sent events while its tokens arrive (`sse`: a chunk per new text, usage if asked, then
[DONE]). A client that goes away, streaming or not, aborts its requests, which frees their KV
blocks. server/completions.py's routes answer through it; server/responses.py collects here too.

    return await whole(loop, request, rids, events, out, meta)     # JSON, or 499 / 500
    return StreamingResponse(sse(loop, rids, events, out, meta, include_usage),
                             media_type="text/event-stream")
"""

import asyncio
import json

from fastapi import Request
from fastapi.responses import JSONResponse

from server.choices import Outputs
from server.engine_loop import EngineLoop, collect_all, events_of
from server.openai_format import error


async def disconnected(request: Request):
    """Returns when the client goes away (the body has been read, so the next message says so)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def chunk(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


async def whole(loop: EngineLoop, request, rids, events, out: Outputs, meta: dict):
    """The response once every sample is over."""
    failed = await collect(loop, request, rids, events, out)
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


async def collect(loop: EngineLoop, request, rids, events, out: Outputs):
    """Every event into `out`: None, or the error response (500 if a request failed; 499, with
    its requests aborted, if the client went away first)."""
    collect = asyncio.ensure_future(collect_all(rids, events, out))
    gone = asyncio.ensure_future(disconnected(request))
    try:
        await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        # the client went away (or this handler was cancelled): free its blocks
        if not collect.done():
            collect.cancel()
            for rid in rids:
                loop.abort(rid)
    if not collect.done() or collect.cancelled():
        return error(499, "the client closed the request")
    if collect.result():
        return error(500, f"the request failed: {collect.result()}", "server_error")
    return None


async def sse(loop: EngineLoop, rids, events, out: Outputs, meta: dict, include_usage: bool):
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
            if isinstance(event, str):  # one request failed: say so, the stream still ends cleanly
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
                loop.abort(rid)
