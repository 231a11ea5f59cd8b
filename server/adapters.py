"""LoRA adapters for batch.py and serve.py: the flags, the adapters loaded at start, which adapter a
request's `model` names, and vLLM's routes that load and unload one while the server runs.

    python serve.py --lora sql=./sql-adapter --lora chat=./chat-adapter --max_loras 4
    curl localhost:8000/v1/completions -d '{"model": "sql", "prompt": "SELECT"}'
    curl localhost:8000/v1/load_lora_adapter -d '{"lora_name": "fr", "lora_path": "./fr"}'
    curl localhost:8000/v1/unload_lora_adapter -d '{"lora_name": "fr"}'

The files are read and checked off the engine's thread (formats/lora_files.py); only the copy into a
slot (speedups/lora.py's Adapters) runs between two steps, so streams go on. Every loaded adapter
stays in host memory until unloaded; one evicted from its slot is placed again when a request asks
for it (a 503 while every slot has requests running). A request names an adapter by `model` (the
base by the server's own name, or no name); with adapters on, any other name is a 404 listing the
names served.
"""

import asyncio

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from server.openai_format import Refused, error, unavailable
from speedups.lora import SlotsBusy


def not_found(message: str, param: str = "model") -> Refused:
    """A 404 in OpenAI's shape: a model (or adapter) this server does not serve."""
    return Refused(message, response=error(404, message, param=param, code="model_not_found"))


def busy(message: str) -> Refused:
    """A 503 with Retry-After: every adapter slot has requests running."""
    return Refused(message, response=unavailable(message))


class LoadBody(BaseModel):
    model_config = ConfigDict(extra="ignore")
    lora_name: str
    lora_path: str = None
    load_inplace: bool = False  # vLLM's: replace an adapter of that name


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
        if model in self.adapters.served():
            return model
        names = ", ".join([self.server.model_name, *self.adapters.served()])
        raise not_found(f"the model {model!r} does not exist: this server serves {names}")

    def cards(self, card: dict) -> list:
        """/v1/models' entries of the adapters, beside the base's `card`."""
        names = self.adapters.served() if self.adapters else []
        host = self.adapters.host if self.adapters else {}
        return [{**card, "id": n, "parent": card["id"], "root": host[n].path} for n in names]

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
            await self._call(self._load, adapter, body.load_inplace)
        except SlotsBusy as e:  # replacing one whose requests still run
            raise busy(str(e)) from None
        except ValueError as e:
            raise Refused(str(e), "lora_name" if "already" in str(e) else "lora_path") from None
        return JSONResponse({"object": "lora_adapter", "id": body.lora_name, "loaded": True})

    async def unload(self, body: LoadBody):
        self._enabled()
        try:
            await self._call(self._unload, body.lora_name)
        except ValueError as e:
            raise not_found(str(e), "lora_name") from None
        return JSONResponse({"object": "lora_adapter", "id": body.lora_name, "loaded": False})

    def _load(self, adapter, replace: bool):
        return self.adapters.load(adapter, self.engine.requests.values(), replace)

    def _unload(self, name: str):
        return self.adapters.unload(name, self.engine.requests.values())

    async def _call(self, fn, *args):
        """fn(*args) on the engine's thread, between two steps."""
        return await asyncio.wrap_future(self.server.loop.call(fn, *args))

    def _enabled(self):
        if self.adapters is None:
            raise not_found(
                "this server runs no adapters: start it with --lora NAME=PATH or --max_loras N",
                "lora_name",
            )
