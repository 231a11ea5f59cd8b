"""The retrieval routes: POST /v1/embeddings (OpenAI's shape) and POST /v1/rerank (the shape of
Jina's, Cohere's and llama.cpp's servers), both run by the same engine as generation: each input
is a prefill-only request (sequence.py: RequestParams.pooling) sharing the step budget, and the
prefix cache, with everything else.

    curl localhost:8000/v1/embeddings -d '{"input": ["a text", "another"], "dimensions": 256}'
    curl localhost:8000/v1/rerank -d '{"query": "q", "documents": ["d1", "d2"], "top_n": 1}'

Embeddings pool as the checkpoint's sentence-transformers files say (formats/pooling.py), or as
serve.py's --pooling; `dimensions` keeps the first components and normalizes again (Matryoshka),
`encoding_format` "base64" sends little-endian float32, `truncate` (an extension) cuts an input
over the context instead of refusing it. Rerank scores each document as Qwen3-Reranker does: its
prompt format, then at the last position p = softmax(logit("no"), logit("yes"))[1], the two logits
taken by the engine from the step's own head (RequestParams.score_tokens); a checkpoint whose
tokenizer has no single "yes" and "no" tokens is refused by name.
"""

import asyncio
import base64
import re
import time
from typing import Literal

import torch
from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import Field

from formats.pooling import encode_input, finish, read_spec
from runtime import CheckpointError
from sequence import RequestParams
from server.delivery import collect
from server.engine_loop import Unavailable
from server.openai_format import Body, Refused, unavailable
from server.server_limits import text_size

SLICE = 64  # inputs queued at a time: a request of 2048 never fills the waiting queue alone
RERANK_SYSTEM = (
    "Judge whether the Document meets the requirements based on the Query and the Instruct "
    'provided. Note that the answer can only be "yes" or "no".'
)
RERANK_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
RERANK_PREFIX = f"<|im_start|>system\n{RERANK_SYSTEM}<|im_end|>\n<|im_start|>user\n"
RERANK_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


class EmbeddingRequest(Body):
    input: str | list[str] | list[int] | list[list[int]]
    model: str = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int = Field(None, ge=1)
    user: str = None
    truncate: bool = False  # an input over the context is cut to it rather than refused


class RerankRequest(Body):
    query: str
    documents: list[str | dict]  # texts, or Cohere's {"text": ...}
    model: str = None
    top_n: int = Field(None, ge=1)
    return_documents: bool = True
    instruction: str = None  # Qwen3-Reranker's <Instruct> (default: web search)
    truncate: bool = False


def embedding_spec(source, pooling: str, model):
    """(formats.pooling.Spec, None), or (None, why embeddings are not served) for a model that
    generates; a CheckpointError at load for a model without a head that cannot pool."""
    try:
        return read_spec(source, pooling), None
    except CheckpointError as e:
        if model.lm_head is None:
            raise
        return None, str(e)


class Out:
    """delivery.collect's sink for pooled requests: each request's state, by its first index."""

    def __init__(self):
        self.states = {}

    def add(self, index, token, text, reason, logprob):
        return ""

    def over(self, event):
        self.states[event.first] = event.embedding


class Embeddings:
    """The two routes over a completions.Server's engine loop, tokenizer and limits."""

    def __init__(self, server, spec=None, why_not: str = None):
        self.server, self.spec = server, spec
        self.why_not = why_not or "this server was started without embeddings"
        self.model = server.engine.model

    # routes have no return annotations: FastAPI would take them as response models
    async def embeddings(self, body: EmbeddingRequest, request: Request):
        spec = self._check(body.dimensions)
        texts = body.input if isinstance(body.input, list) else [body.input]
        if texts and isinstance(texts[0], int):
            texts = [texts]  # one input of token ids
        cut = self.server.context if body.truncate else None
        prompts = await self._encode(
            texts, "input", lambda t: encode_input(self.tok, t, spec.chat, cut)
        )
        prompts = self._fit(prompts, "input", body.truncate)
        adapter = self.server.adapter_routes.adapter_of(body.model)  # a LoRA adapter's states
        params = RequestParams(pooling=spec.pooling, adapter=adapter)
        states = await self._pool(request, prompts, params, "input")
        vectors = finish(states, spec.normalize, body.dimensions)
        data = [
            {"object": "embedding", "index": i, "embedding": self._encoded(v, body)}
            for i, v in enumerate(vectors)
        ]
        used = sum(len(p) for p in prompts)
        reply = {
            "object": "list",
            "data": data,
            "model": adapter or self.server.model_name,
            "usage": {"prompt_tokens": used, "total_tokens": used},
        }
        return await asyncio.to_thread(JSONResponse, reply)

    async def rerank(self, body: RerankRequest, request: Request):
        no, yes = self._yes_no()
        docs = [d.get("text") if isinstance(d, dict) else d for d in body.documents]
        if not all(isinstance(d, str) for d in docs):
            raise Refused('documents: each is a text or {"text": ...}', "documents")
        instruction = body.instruction or RERANK_INSTRUCTION
        pairs = [f"<Instruct>: {instruction}\n<Query>: {body.query}\n<Document>: {d}" for d in docs]
        head, tail = (self.tok.encode(t, bos=False) for t in (RERANK_PREFIX, RERANK_SUFFIX))
        prompts = await self._encode(pairs, "documents", self._plain)
        room = max(0, self.server.context - len(head) - len(tail))  # truncate: the document's end
        prompts = [head + (p[:room] if body.truncate else p) + tail for p in prompts]
        prompts = self._fit(prompts, "documents", False)
        adapter = self.server.adapter_routes.adapter_of(body.model)
        params = RequestParams(pooling="last", score_tokens=[no, yes], adapter=adapter)
        logits = await self._pool(request, prompts, params, "documents")  # [n, 2]: no, yes
        scores = logits.softmax(-1)[:, 1].tolist()
        order = sorted(range(len(docs)), key=lambda i: -scores[i])[: body.top_n or len(docs)]
        results = [
            {"index": i, "relevance_score": scores[i]}
            | ({"document": {"text": docs[i]}} if body.return_documents else {})
            for i in order
        ]
        used = sum(len(p) for p in prompts)
        return {
            "id": f"rerank-{time.time_ns()}",
            "object": "list",
            "model": adapter or self.server.model_name,
            "results": results,
            "usage": {"prompt_tokens": used, "total_tokens": used},
        }

    @property
    def tok(self):
        return self.server.tokenizer

    def _check(self, dimensions):
        """The spec, once the request may run here; Refused naming why not."""
        if getattr(self.server.engine, "ranks", 1) > 1:
            raise Refused("embeddings run in one process; this server is tensor-parallel")
        if self.spec is None:
            raise Refused(f"this server does not serve embeddings: {self.why_not}")
        dim = self.model.config.dim
        if dimensions is not None and dimensions > dim:
            raise Refused(f"dimensions {dimensions} exceeds the model's {dim}", "dimensions")
        return self.spec

    def _yes_no(self):
        """Rerank's two token ids; Refused where the model cannot score documents."""
        if self.model.lm_head is None or getattr(self.server.engine, "ranks", 1) > 1:
            raise Refused("rerank needs the model's output head, in one process")
        ids = [self.tok.encode(w, bos=False) for w in ("no", "yes")]
        if not all(len(i) == 1 for i in ids):
            raise Refused(
                "rerank scores a document by the model's 'yes' against 'no' at the end of "
                "Qwen3-Reranker's prompt; this tokenizer has no single token for each"
            )
        return ids[0][0], ids[1][0]

    def _plain(self, text: str) -> list:
        """A query and document's ids, their special tokens' literals kept as text."""
        plain = getattr(self.tok.backend, "encode_plain", None)
        return plain(text) if plain else self.tok.encode(text, bos=False)

    async def _encode(self, texts, param: str, fn) -> list:
        """Texts (or ids, passed through) -> ids, off the event loop; Refused naming the input."""
        limit = self.server.limits.max_inputs
        if not texts:
            raise Refused(f"{param}: give at least one", param)
        if len(texts) > limit:
            raise Refused(
                f"{param}: {len(texts)} exceed this server's limit of {limit} (--max_inputs)", param
            )
        vocab = self.model.config.vocab_size
        for i, t in enumerate(texts):
            if not t or (isinstance(t, list) and not all(0 <= x < vocab for x in t)):
                why = "is empty" if not t else f"has token ids outside [0, {vocab})"
                raise Refused(f"{param}[{i}] {why}", f"{param}[{i}]")
        try:
            return await self.server.lanes.run(
                text_size(texts), lambda: [fn(t) if isinstance(t, str) else t for t in texts]
            )
        except ValueError as e:
            raise Refused(f"{param}: {e}", param) from None

    def _fit(self, prompts, param: str, truncate: bool) -> list:
        """Each prompt within the context: cut where `truncate` asks, else Refused naming it."""
        context = self.server.context
        for i, p in enumerate(prompts):
            if len(p) > context and not truncate:
                raise Refused(
                    f"{param}[{i}] has {len(p)} tokens, over {self.server.context_name} of "
                    f'{context}; shorten it, or send "truncate": true',
                    f"{param}[{i}]",
                )
        return [p[:context] for p in prompts]

    async def _pool(self, request, prompts, params, param: str):
        """Every prompt through the engine, SLICE at a time -> their vectors [n, dim] (or the
        logits of params.score_tokens)."""
        out = Out()
        for start in range(0, len(prompts), SLICE):
            part = prompts[start : start + SLICE]
            try:
                rids, events = await self.server.loop.submit(part, params)
            except ValueError as e:  # "prompt 3: ..." (engine_loop's) counts in this slice
                found = re.match(r"prompt (\d+): (.*)", str(e), re.S)
                i, why = (int(found[1]), found[2]) if found else (0, str(e))
                raise Refused(f"{param}[{start + i}]: {why}", f"{param}[{start + i}]") from None
            except Unavailable as e:
                raise Refused(str(e), response=unavailable(str(e))) from None
            sink = Out()
            failed = await collect(self.server.loop, request, rids, events, sink)
            if failed:
                raise Refused(str(failed), response=failed)
            if any(v is None for v in sink.states.values()):  # aborted: a shutdown's drain
                message = "the request was aborted before its inputs were embedded; retry"
                raise Refused(message, response=unavailable(message))
            out.states.update((start + i, s) for i, s in sink.states.items())
        return torch.stack([out.states[i] for i in range(len(prompts))])

    @staticmethod
    def _encoded(vector, body):
        if body.encoding_format == "base64":
            return base64.b64encode(vector.numpy().astype("<f4").tobytes()).decode()
        return vector.tolist()
