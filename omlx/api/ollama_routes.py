"""Ollama-compatible routes on the same port: /api/chat, /api/generate, /api/tags,
/api/show, /api/ps, /api/version; the rest answer what to use instead.

The same pipeline as the OpenAI and Anthropic routes (pool lease, chat template,
sampling, grammar, output parser, memory preflight at submit), in Ollama's shapes.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass
from functools import partial
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from omlx.api.generation import ClientGone, Generation, unless_disconnected
from omlx.api.images import ImageSink
from omlx.api.metrics import observer_for
from omlx.api.ollama_format import (
    OllamaReply,
    Timings,
    chat_messages,
    check_generate,
    generate_messages,
    keep_alive_s,
    loaded_reply,
    ollama_name,
    omlx_name,
    output_grammar,
    sampling_request,
    template_kwargs,
)
from omlx.api.ollama_models import ps_entry, read_facts, show_body, tags_entry
from omlx.api.ollama_schemas import ChatRequest, GenerateRequest, ModelRequest
from omlx.api.output_parser import parser_for
from omlx.api.prompts import (
    RenderedPrompt,
    build_sampling,
    make_request,
    new_request_id,
    render_chat,
)
from omlx.api.render_pool import RENDER_POOL
from omlx.api.state import state_of
from omlx.api.structured import bind_grammar, with_unenforced_header
from omlx.engine.model_engine import ModelEngine
from omlx.engine.pool import EnginePool
from omlx.engine.stream import StreamEvent
from omlx.errors import InvalidRequestError, ModelNotFoundError, UnsupportedEndpointError
from omlx.grammar.spec import GrammarSpec
from omlx.grammar.tools import ToolConstraint

router = APIRouter()

# The Ollama API level these routes follow; clients gate features (tools, think) on it.
OLLAMA_API_VERSION = "0.12.0"
NDJSON = "application/x-ndjson"


def _resolve(pool: EnginePool, requested: str) -> str:
    """The model folder for ``NAME`` or ``NAME:latest``; 404 listing Ollama names."""
    try:
        return pool.resolve(omlx_name(requested)).name
    except ModelNotFoundError as exc:
        raise ModelNotFoundError(requested, [ollama_name(n) for n in exc.available]) from None


# ---- models ---------------------------------------------------------------------------


@router.get("/api/version")
async def version() -> dict[str, str]:
    return {"version": OLLAMA_API_VERSION}


@router.get("/api/tags")
async def tags(request: Request) -> dict[str, Any]:
    pool = state_of(request).pool
    models = pool.available()
    named = [(models[n], pool.public_name(n)) for n in sorted(models)]
    facts = await asyncio.to_thread(lambda: [read_facts(info, name) for info, name in named])
    return {"models": [tags_entry(f) for f in facts]}


@router.post("/api/show")
async def show(body: ModelRequest, request: Request) -> dict[str, Any]:
    pool = state_of(request).pool
    name = _resolve(pool, body.model_name())
    info = pool.available()[name]
    facts = await asyncio.to_thread(read_facts, info, pool.public_name(name))
    return show_body(facts, pool.request_defaults(name).sampling)


@router.get("/api/ps")
async def ps(request: Request) -> dict[str, Any]:
    pool = state_of(request).pool
    models = pool.available()
    entries = []
    for status in pool.status():
        engine = pool.engine(status["name"])
        if engine is None or status["name"] not in models:
            continue
        facts = await asyncio.to_thread(read_facts, models[status["name"]], status["id"])
        expiry = pool.idle_expiry_s(status["name"])
        entries.append(ps_entry(facts, status["memory_bytes"], expiry, engine.context_window))
    return {"models": entries}


# ---- endpoints omlx does not provide ---------------------------------------------------

_INSTEAD = {
    "/api/pull": "omlx does not pull from the Ollama registry; download an MLX model from "
    "Hugging Face with 'omlx pull REPO_ID' or on the admin panel's Models page",
    "/api/push": "omlx does not push models to a registry",
    "/api/create": "omlx does not create models from a Modelfile; put an MLX model folder in "
    "a model dir, import a GGUF with 'omlx models import-gguf FILE', and set a model's "
    "defaults (sampling, alias) in the admin panel",
    "/api/copy": "omlx does not copy models; give a model a second name with an alias in "
    "the admin panel's model settings",
    "/api/delete": "omlx does not delete models over the API; use 'omlx models rm NAME'",
}


def _unsupported(path: str) -> Callable[[], Any]:
    async def refuse() -> None:
        raise UnsupportedEndpointError(_INSTEAD[path])

    return refuse


for _path in _INSTEAD:
    _methods = ["DELETE"] if _path == "/api/delete" else ["POST"]
    router.add_api_route(_path, _unsupported(_path), methods=_methods, include_in_schema=False)


# ---- chat and generate -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Ask:
    """What one chat or generate request asks of the pipeline."""

    body: ChatRequest | GenerateRequest
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    spec: GrammarSpec | ToolConstraint | None
    chat: bool
    # Ollama's load idiom: no messages, or no prompt (keep_alive 0: unload).
    empty: bool
    raw: bool = False
    images: ImageSink | None = None


@router.post("/api/chat")
async def chat(body: ChatRequest, request: Request) -> Response:
    # A bad conversation is refused before any model loads.
    images = ImageSink()
    messages = chat_messages(body.messages, images)
    tools = body.tools if body.tools and body.tool_choice != "none" else None
    spec = output_grammar(body.format, body.tools, body.tool_choice)
    ask = _Ask(body, messages, tools, spec, chat=True, empty=not body.messages, images=images)
    return await _answer(request, ask)


@router.post("/api/generate")
async def generate(body: GenerateRequest, request: Request) -> Response:
    check_generate(body)
    if body.raw and body.system:
        raise InvalidRequestError(
            "system needs the chat template; with raw=true write it into the prompt",
            param="system",
        )
    spec = output_grammar(body.format, None)
    images = ImageSink()
    messages = generate_messages(body, images)
    empty = not body.prompt and not body.images
    ask = _Ask(body, messages, None, spec, chat=False, empty=empty, raw=body.raw, images=images)
    return await _answer(request, ask)


async def _answer(request: Request, ask: _Ask) -> Response:
    pool = state_of(request).pool
    timings = Timings()
    ttl_s = keep_alive_s(ask.body.keep_alive)
    name = _resolve(pool, ask.body.model)
    model = ollama_name(pool.public_name(name))
    # Pinned models stay loaded whatever keep_alive says.
    if ask.empty and ttl_s == 0 and pool.model_state(name) != "pinned":
        await pool.unload(name)
        return JSONResponse(loaded_reply(model, timings, chat=ask.chat, reason="unload"))
    # The lease keeps unload/release from taking the engine before the submit.
    async with pool.lease(name) as engine:
        timings.loaded_s = time.perf_counter()
        pool.keep_alive(name, ttl_s)
        if ask.empty:
            return JSONResponse(loaded_reply(model, timings, chat=ask.chat, reason="load"))
        gen, reply = await _start(request, ask, engine, model, timings)

    # keep_alive counts from the end of the request, as Ollama's does.
    def finished() -> None:
        pool.keep_alive(name, ttl_s)

    if ask.body.stream:
        stream = StreamingResponse(_ndjson(gen, reply, finished), media_type=NDJSON)
        return with_unenforced_header(stream, ask.spec, model)
    try:
        await unless_disconnected(
            request, gen.collect(lambda _, event: _add(gen, reply, event)), gen.abort_unfinished
        )
    except ClientGone:
        return Response(status_code=499)  # nobody is listening; nginx's "client closed"
    finally:
        finished()
    return with_unenforced_header(JSONResponse(reply.body()), ask.spec, model)


async def _start(
    request: Request, ask: _Ask, engine: ModelEngine, model: str, timings: Timings
) -> tuple[Generation, OllamaReply]:
    """Render, sample, bind the grammar and submit: the generation and its reply."""
    state = state_of(request)
    defaults = state.pool.request_defaults(engine.name)
    prompt = await _prompt(
        ask,
        engine,
        defaults.template_kwargs(template_kwargs(ask.body.think)),
        state.settings.server.template_timeout_s,
    )
    num_prompt = len(prompt.ids)
    body = ask.body
    wanted = sampling_request(body.options, num_prompt, engine.context_window, body.speculative)
    params = build_sampling(
        engine, num_prompt, wanted, defaults.sampling, defaults.generation, defaults.forced
    )
    grammar = await bind_grammar(engine, ask.spec)
    rid = new_request_id("ollama")
    req = make_request(rid, prompt.ids, params, grammar, prompt.images)
    gen = Generation(engine, [req], observer=observer_for(request))
    thinks = bool(ask.body.think) or bool(getattr(engine.tokenizer, "has_thinking", False))
    parser = parser_for(
        engine.tokenizer,
        tools_requested=ask.tools is not None,
        reasoning=thinks and not ask.raw,
        prompt_text=prompt.text,
        tool_schemas=ask.tools,
    )
    reply = OllamaReply(model, parser, timings, chat=ask.chat)
    gen.submit()
    timings.submitted_s = time.perf_counter()
    return gen, reply


async def _prompt(
    ask: _Ask, engine: ModelEngine, kwargs: dict[str, Any], timeout_s: float
) -> RenderedPrompt:
    if ask.raw:
        assert isinstance(ask.body, GenerateRequest)
        text = ask.body.prompt
        return RenderedPrompt(
            text, list(await RENDER_POOL.run(partial(engine.tokenizer.encode, text)))
        )
    return await render_chat(
        engine,
        ask.messages,
        tools=ask.tools,
        template_kwargs=kwargs,
        timeout_s=timeout_s,
        images=ask.images,
    )


def _add(gen: Generation, reply: OllamaReply, event: StreamEvent) -> list[dict[str, Any]]:
    objects = reply.add(event)
    if event.finish_reason is not None:
        kind = "ollama-chat" if reply.chat else "ollama-generate"
        gen.log_done(kind, reply.num_prompt_tokens, reply.num_output_tokens, [event.finish_reason])
    return objects


def _line(obj: dict[str, Any]) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False) + "\n"


async def _ndjson(
    gen: Generation, reply: OllamaReply, finished: Callable[[], None]
) -> AsyncIterator[str]:
    """One JSON object a line; an error mid-stream is an {"error"} line, as Ollama's.
    The client going away aborts the request."""
    try:
        # aclosing: a disconnect cancels us mid-iteration; close the pump tasks now.
        async with aclosing(gen.events(keepalive_s=3600.0)) as events:
            async for item in events:
                if item is None:
                    continue  # Ollama streams send nothing while waiting
                _, event = item
                if event.error is not None:
                    yield _line({"error": event.error.message})
                    break
                for obj in _add(gen, reply, event):
                    yield _line(obj)
    finally:
        gen.abort_unfinished()
        finished()
