"""The completions and chat routes (POST /v1/completions, POST /v1/chat/completions) as steps of
`Server`, which also holds what every route shares: the engine loop (server/engine_loop.py), the
tokenizer and its lanes, the model's name, the limits and the context. A request is checked
against the limits that need no tokens, its texts encoded off the event loop, its parameters made
(a constraint tried first in a child process), queued, and answered whole or streamed
(server/delivery.py). server/responses.py runs its requests through the same steps.

    server = Server(engine, tokenizer, "tiny", Limits())
    app.post("/v1/completions")(server.completions)    # serve.make_app routes each
    app.post("/v1/chat/completions")(server.chat_completions)
"""

import asyncio
import time

from fastapi import Request
from fastapi.responses import StreamingResponse

from constrain import Compiled, compile_constraint
from sampling import parse_logit_bias
from sequence import RequestParams
from server.adapters import AdapterRoutes, busy, not_found
from server.choices import Outputs
from server.constraint_check import CheckerUnavailable, ConstraintChecker
from server.delivery import sse, whole
from server.engine_loop import EngineLoop, Unavailable
from server.openai_format import (
    ChatRequest,
    CompletionRequest,
    Refused,
    constraint_of,
    encode,
    logprob_counts,
    prompt_list,
    refusal,
    template_messages,
    unavailable,
)
from server.server_limits import Limits, TokenizerLanes, text_size
from server.tool_calls import call_constraint, check_tools, legacy_tools, render_args, tool_format
from speedups.lora import SlotsBusy, UnknownAdapter


def param_of(message: str, body):
    """The request field an engine error names first ("repetition_penalty must be ..."), or None."""
    word = message.split(" ", 1)[0].rstrip(":")
    word = {"max_new_tokens": "max_tokens"}.get(word, word)
    return word if word in type(body).model_fields else None


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
        self.adapter_routes = AdapterRoutes(self)  # LoRA: which adapter a request's model names
        self.context = min(engine.max_model_len, limits.max_model_len or engine.max_model_len)
        self.context_name = (
            "--max_model_len" if self.context < engine.max_model_len else "the model's context"
        )
        # a request with long texts cannot take every tokenizing thread
        self.lanes = TokenizerLanes()
        # constraints tried in a child process first (server/constraint_check.py)
        self.checker = None
        if limits.constraint_timeout and getattr(tokenizer, "source", None):
            self.checker = ConstraintChecker(
                tokenizer.source,
                engine.model.config.vocab_size,
                engine.stop_ids,
                limits.constraint_timeout,
            )

    # routes have no return annotations: FastAPI would take them as response models
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
        # (the template writes BOS)
        (prompt,) = await self.encode([text], "messages", bos=False, messages=messages)
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
                f"{len(stop)} stop strings exceed this server's limit of {limits.max_stop} "
                "(--max_stop)",
                "stop",
            )
        if num_prompts > limits.max_prompts:
            raise Refused(
                f"{num_prompts} prompts exceed this server's limit of {limits.max_prompts} "
                "(--max_prompts)",
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
                    "send tools and tool_choice, or the legacy functions and function_call, not "
                    "both",
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
            which = "the prompt" if len(prompts) == 1 else f"prompt {i}"
            if n > self.context or (n == self.context and max_tokens != 0):  # alone too long
                raise Refused(
                    f"{which} has {n} tokens, and {self.context_name} is {self.context} tokens: "
                    "shorten it",
                    "messages" if chat else "prompt",
                )
            if n + max_tokens > self.context:
                raise Refused(
                    f"{which} ({n} tokens) plus max_tokens ({max_tokens}) exceeds "
                    f"{self.context_name} of {self.context} tokens",
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
                    "alternatives)); this server answers at most "
                    f"{self.limits.max_logprob_entries} (--max_logprob_entries)",
                    "logprobs",
                )
        constraint = self.constraint(body)
        return RequestParams(
            max_new_tokens=max_tokens,
            temperature=body.temperature,
            top_k=body.top_k,
            top_p=body.top_p,
            seed=body.seed,
            priority=body.priority,
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
            adapter=self.adapter_routes.adapter_of(body.model),
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
        except CheckerUnavailable as e:  # its child did not start: not the client's fault
            message = f"the constraint checker is unavailable ({e}); retry"
            raise Refused(message, response=unavailable(message)) from None

    async def submit(self, body, prompts, chat: bool, tool_constraint=None):
        """Queue the prompts: (request ids, their events, the engine's parameters); Refused (400)
        for a request the engine refuses, 503 when it cannot take more now."""
        params = self.params(body, prompts, chat, tool_constraint)
        if params.constraint is not None and self.checker:
            params.constraint = await self.compiled(params.constraint, body, tool_constraint)
        try:
            rids, events = await self.loop.submit(prompts, params)
        except UnknownAdapter as e:  # its adapter unloaded since the request was read
            raise not_found(str(e)) from None
        except SlotsBusy as e:  # its adapter not resident, every slot running requests
            raise busy(str(e)) from None
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
            "model": params.adapter or self.model_name,  # (an adapter by its own name)
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
                sse(self.loop, rids, events, out, meta, include_usage),
                media_type="text/event-stream",
            )
        return await whole(self.loop, request, rids, events, out, meta)
