"""LoRA adapters for batch.py and serve.py: the flags, the adapters loaded at start, which adapter a
request's `model` names, and vLLM's routes that load and unload one while the server runs.

    python serve.py --lora sql=./sql-adapter --lora chat=./chat-adapter --max_loras 4
    curl localhost:8000/v1/completions -d '{"model": "sql", "prompt": "SELECT"}'
    curl localhost:8000/v1/load_lora_adapter -d '{"lora_name": "fr", "lora_path": "./fr"}'
    curl localhost:8000/v1/unload_lora_adapter -d '{"lora_name": "fr"}'

The files are read and checked off the engine's thread (formats/lora_files.py); only the copy into
a slot (lora.Adapters) runs between two steps, so streams go on. A request names an adapter by
`model` (the base by the server's own name, or no name); with adapters on, any other name is a 404
listing the names served.
"""

import asyncio

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from server.openai_format import Refused, error


def in_use(engine) -> set:
    """The adapters the engine's unfinished requests run under (engine thread)."""
    return {r.params.adapter for r in engine.requests.values()}


class LoadBody(BaseModel):
    model_config = ConfigDict(extra="ignore")
    lora_name: str
    lora_path: str = None


class AdapterRoutes:
    """POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's names and bodies), and the
    adapter a request's `model` names."""

    def __init__(self, server):
        self.server, self.engine = server, server.engine

    @property
    def adapters(self):
        return self.engine.adapters

    def adapter_of(self, model: str):
        """The adapter `model` names, or None for the base; Refused (404) for another name."""
        if self.adapters is None or model is None or model == self.server.model_name:
            return None
        if model in self.adapters.resident():
            return model
        names = ", ".join([self.server.model_name, *self.adapters.resident()])
        message = f"the model {model!r} does not exist: this server serves {names}"
        raise Refused(message, response=error(404, message, param="model", code="model_not_found"))

    def cards(self, card: dict) -> list:
        """/v1/models' entries of the adapters, beside the base's `card`."""
        names = self.adapters.resident() if self.adapters else []
        return [{**card, "id": n, "parent": card["id"]} for n in names]

    async def load(self, body: LoadBody):
        from formats.lora_files import read_adapter

        self._enabled()
        if not body.lora_path:
            raise Refused("lora_path: the adapter folder to load", "lora_path")
        if body.lora_name == self.server.model_name:
            raise Refused(f"{body.lora_name!r} is the base model's name", "lora_name")
        config = self.engine.model.config
        try:  # the files read and checked here, off the engine's thread
            adapter = await asyncio.to_thread(read_adapter, body.lora_path, config, body.lora_name)
            self.adapters.check(adapter)
        except ValueError as e:
            raise Refused(str(e), "lora_path") from None
        try:
            await self._call(self._load, adapter)
        except RuntimeError as e:  # every slot busy, or the name in use
            raise Refused(str(e), response=error(503, str(e), "unavailable_error")) from None
        return JSONResponse({"object": "lora_adapter", "id": body.lora_name, "loaded": True})

    async def unload(self, body: LoadBody):
        self._enabled()
        try:
            await self._call(self._unload, body.lora_name)
        except ValueError as e:
            raise Refused(
                str(e), response=error(404, str(e), param="lora_name", code="model_not_found")
            ) from None
        return JSONResponse({"object": "lora_adapter", "id": body.lora_name, "loaded": False})

    def _load(self, adapter):
        return self.adapters.load(adapter, in_use(self.engine))

    def _unload(self, name: str):
        return self.adapters.unload(name, in_use(self.engine))

    async def _call(self, fn, *args):
        """fn(*args) on the engine's thread, between two steps."""
        return await asyncio.wrap_future(self.server.loop.call(fn, *args))

    def _enabled(self):
        if self.adapters is None:
            raise Refused(
                "this server runs no adapters: start it with --lora NAME=PATH or --max_loras N",
                response=error(404, "adapters are off (start with --max_loras N)"),
            )
