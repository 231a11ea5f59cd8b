"""The routes that run no model step: GET /health (200, or 503 while draining), GET /metrics
(Prometheus text), GET /v1/models[/{id}], POST /tokenize and POST /detokenize (vLLM's).
`InfoRoutes` reads what it needs from
server/completions.py's `Server`: the engine loop, the tokenizer and its lanes, the model's name
and context.

    info = InfoRoutes(server)
    app.get("/health")(info.health)          # serve.make_app routes each method
"""

from fastapi.responses import JSONResponse, PlainTextResponse

from server.openai_format import (
    DetokenizeRequest,
    Refused,
    TokenizeRequest,
    encode,
    error,
    template_messages,
)
from server.server_limits import text_size

ROUTES = (
    "POST /v1/completions, POST /v1/chat/completions, POST /v1/responses, POST /v1/embeddings, "
    "POST /v1/rerank, GET /v1/models[/{id}], POST /tokenize, POST /detokenize, GET /health, "
    "GET /metrics, POST /v1/load_lora_adapter, POST /v1/unload_lora_adapter"
)


class InfoRoutes:
    """The model card, health, metrics and tokenizer routes over a completions.Server's state."""

    def __init__(self, server):
        self.engine, self.tokenizer, self.model_name = (
            server.engine,
            server.tokenizer,
            server.model_name,
        )
        self.loop, self.lanes, self.context = server.loop, server.lanes, server.context
        self.adapter_routes = server.adapter_routes

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

    def cards(self) -> list:
        """The base model's card, then each LoRA adapter's (its "parent": the base)."""
        return [self.card(), *self.adapter_routes.cards(self.card())]

    async def models(self):
        return {"object": "list", "data": self.cards()}

    async def model(self, model_id: str):
        for card in self.cards():
            if card["id"] == model_id:
                return card
        names = ", ".join(repr(c["id"]) for c in self.cards())
        message = f"the model {model_id!r} does not exist: this server serves {names}"
        raise Refused(message, response=error(404, message, param="model", code="model_not_found"))

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
