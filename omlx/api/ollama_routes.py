"""Ollama-compatible generation on the same port: /api/chat and /api/generate, on
the request pipeline, in Ollama's shapes (the model routes: ollama_model_routes.py)."""

from __future__ import annotations

import time
from dataclasses import replace
from functools import partial

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from omlx.api import pipeline
from omlx.api.images import ImageSink
from omlx.api.ollama_format import (
    OllamaEncoder,
    OllamaReply,
    Timings,
    chat_messages,
    check_generate,
    generate_messages,
    keep_alive_s,
    loaded_reply,
    ollama_name,
    output_grammar,
    sampling_request,
    template_kwargs,
)
from omlx.api.ollama_model_routes import resolve
from omlx.api.ollama_schemas import ChatRequest, GenerateRequest
from omlx.api.pipeline import Call, Prepared, Rendering
from omlx.api.prompts import RenderedPrompt
from omlx.api.state import state_of
from omlx.errors import InvalidRequestError

router = APIRouter()


def _call(body: ChatRequest | GenerateRequest, kind: str, raw: bool = False) -> Call:
    options, speculative = body.options, body.speculative
    return Call(
        model=body.model,
        kind=kind,
        id_prefix="ollama-",
        template_kwargs=template_kwargs(body.think),
        sampling=lambda num, window: sampling_request(options, num, window, speculative),
        stream=bool(body.stream),
        # think asks for the split even where the tokenizer names no think markers.
        reasoning=False if raw else (True if body.think else None),
    )


@router.post("/api/chat")
async def chat(body: ChatRequest, request: Request) -> Response:
    # A bad conversation is refused before any model loads.
    images = ImageSink()
    call = replace(
        _call(body, "ollama-chat"),
        messages=chat_messages(body.messages, images),
        tools=body.tools if body.tools and body.tool_choice != "none" else None,
        images=images,
        spec=output_grammar(body.format, body.tools, body.tool_choice),
    )
    return await _answer(request, body, call, chat=True, empty=not body.messages)


@router.post("/api/generate")
async def generate(body: GenerateRequest, request: Request) -> Response:
    check_generate(body)
    if body.raw and body.system:
        raise InvalidRequestError(
            "system needs the chat template; with raw=true write it into the prompt",
            param="system",
        )
    images = ImageSink()
    call = replace(
        _call(body, "ollama-generate", raw=body.raw),
        messages=generate_messages(body, images),
        images=images,
        spec=output_grammar(body.format, None),
        prompts=partial(_raw_prompt, body.prompt) if body.raw else None,
    )
    empty = not body.prompt and not body.images
    return await _answer(request, body, call, chat=False, empty=empty)


async def _raw_prompt(text: str, rendering: Rendering) -> list[RenderedPrompt]:
    """raw=true: the prompt as written, no chat template."""
    ids = await rendering.renderer.run(partial(rendering.engine.tokenizer.encode, text))
    return [RenderedPrompt(text, list(ids))]


async def _answer(
    request: Request, body: ChatRequest | GenerateRequest, call: Call, *, chat: bool, empty: bool
) -> Response:
    pool = state_of(request).pool
    timings = Timings()
    ttl_s = keep_alive_s(body.keep_alive)
    name = resolve(pool, body.model)
    model = ollama_name(pool.public_name(name))
    if empty:  # Ollama's load idiom: no messages, or no prompt (keep_alive 0: unload)
        reason = await _load_or_unload(request, name, ttl_s, timings)
        return JSONResponse(loaded_reply(model, timings, chat=chat, reason=reason))

    async def encoder(prepared: Prepared) -> OllamaEncoder:
        timings.loaded_s = prepared.leased_s
        pool.keep_alive(name, ttl_s)
        timings.submitted_s = time.perf_counter()
        reply = OllamaReply(model, prepared.parser(), timings, chat=chat)
        # keep_alive counts from the end of the request, as Ollama's does.
        return OllamaEncoder(reply, on_close=lambda: pool.keep_alive(name, ttl_s))

    return await pipeline.run(request, replace(call, model=name), encoder)


async def _load_or_unload(
    request: Request, name: str, ttl_s: float | None, timings: Timings
) -> str:
    pool = state_of(request).pool
    # Pinned models stay loaded whatever keep_alive says.
    if ttl_s == 0 and pool.model_state(name) != "pinned":
        await pool.unload(name)
        return "unload"
    async with pool.lease(name):
        timings.loaded_s = time.perf_counter()
        pool.keep_alive(name, ttl_s)
    return "load"
