"""Anthropic Messages API routes: /v1/messages and /v1/messages/count_tokens."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from omlx.api.anthropic_format import (
    PING,
    Frame,
    MessageFormat,
    chat_messages,
    chat_tools,
    new_message_id,
    output_grammar,
    sampling_request,
    template_kwargs,
    uses_cache_control,
)
from omlx.api.anthropic_models import served_model
from omlx.api.anthropic_schemas import CountTokensRequest, MessagesRequest
from omlx.api.errors import anthropic_error_body
from omlx.api.generation import ClientGone, Generation, unless_disconnected
from omlx.api.images import ImageSink
from omlx.api.metrics import observer_for
from omlx.api.output_parser import parser_for
from omlx.api.prompts import RenderedPrompt, build_sampling, make_request, render_chat
from omlx.api.sse import SSE_HEADERS
from omlx.api.state import state_of
from omlx.api.structured import bind_grammar, with_unenforced_header
from omlx.engine.model_engine import ModelEngine
from omlx.engine.stream import StreamEvent
from omlx.grammar.spec import GrammarSpec
from omlx.grammar.tools import ToolConstraint

router = APIRouter()


def sse_event(frame: Frame) -> str:
    """A named SSE event; compact JSON never contains a raw newline."""
    name, payload = frame
    data = json.dumps(payload, separators=(",", ":"), ensure_ascii=False)
    return f"event: {name}\ndata: {data}\n\n"


async def _render(
    request: Request,
    engine: ModelEngine,
    body: CountTokensRequest,
    messages: list[dict[str, Any]],
    images: ImageSink,
) -> tuple[RenderedPrompt, list[dict[str, Any]] | None]:
    tools = chat_tools(body)
    prompt = await render_chat(
        engine,
        messages,
        tools=tools,
        template_kwargs=template_kwargs(body),
        timeout_s=state_of(request).settings.server.template_timeout_s,
        images=images,
    )
    return prompt, tools


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, request: Request) -> dict[str, int]:
    images = ImageSink(state_of(request).settings.models.image_url_allowlist)
    # A bad conversation is refused before any model loads.
    messages = chat_messages(body, images)
    pool = state_of(request).pool
    engine = await pool.get_engine(served_model(pool, body.model), kind="chat")
    prompt, _ = await _render(request, engine, body, messages, images)
    return {"input_tokens": len(prompt.ids)}


@router.post("/v1/messages")
async def create_message(body: MessagesRequest, request: Request) -> Response:
    images = ImageSink(state_of(request).settings.models.image_url_allowlist)
    messages = chat_messages(body, images)
    spec = output_grammar(body)
    pool = state_of(request).pool
    # The lease keeps unload/release from taking the engine before the submit.
    async with pool.lease(served_model(pool, body.model)) as engine:
        return await _message(body, request, engine, (messages, images), spec)


async def _message(
    body: MessagesRequest,
    request: Request,
    engine: ModelEngine,
    conversation: tuple[list[dict[str, Any]], ImageSink],
    spec: GrammarSpec | ToolConstraint | None,
) -> Response:
    state = state_of(request)
    prompt, tools = await _render(request, engine, body, *conversation)
    params = build_sampling(
        engine,
        len(prompt.ids),
        sampling_request(body),
        state.settings.sampling,
        state.settings.generation,
    )
    grammar = await bind_grammar(engine, spec)
    message_id = new_message_id()
    requests = [make_request(message_id, prompt.ids, params, grammar, prompt.images)]
    gen = Generation(engine, requests, observer=observer_for(request), wants_admission=True)
    parser = parser_for(
        engine.tokenizer,
        tools_requested=tools is not None,
        prompt_text=prompt.text,
        tool_schemas=tools,
    )
    fmt = MessageFormat(
        message_id,
        engine.name,
        parser,
        num_prompt_tokens=len(prompt.ids),
        stop_sequences=params.stop,
        reports_cache_writes=uses_cache_control(body),
    )
    gen.submit()
    if body.stream:
        frames = _stream(gen, fmt, state.settings.server.sse_keepalive_s)
        stream = StreamingResponse(frames, media_type="text/event-stream", headers=SSE_HEADERS)
        return with_unenforced_header(stream, spec, message_id)
    try:
        await unless_disconnected(
            request, gen.collect(lambda _, event: _add(gen, fmt, event)), gen.abort_unfinished
        )
    except ClientGone:
        return Response(status_code=499)  # nobody is listening; nginx's "client closed"
    return with_unenforced_header(JSONResponse(fmt.body()), spec, message_id)


def _add(gen: Generation, fmt: MessageFormat, event: StreamEvent) -> list[Frame]:
    frames = fmt.add(event)
    if event.finish_reason is not None:
        gen.log_done(
            "messages", fmt.num_prompt_tokens, fmt.num_output_tokens, [event.finish_reason]
        )
    return frames


async def _stream(gen: Generation, fmt: MessageFormat, keepalive_s: float) -> AsyncIterator[str]:
    """Named SSE events for one message; the client going away aborts it.

    message_start waits for the engine's admission notice (pings cover the
    wait), so its usage splits the prompt into cached and new tokens."""
    started = False
    try:
        # aclosing: a disconnect cancels us mid-iteration; close the pump tasks now.
        async with aclosing(gen.events(keepalive_s)) as events:
            async for item in events:
                if item is None:
                    yield sse_event(PING)  # Anthropic's keep-alive
                    continue
                _, event = item
                if event.error is not None:
                    exc = event.error
                    body = anthropic_error_body(exc.message, exc.error_type, exc.http_status)
                    yield sse_event(("error", body))
                    break
                frames = _add(gen, fmt, event)
                if not started:
                    started, frames = True, fmt.start() + frames
                for frame in frames:
                    yield sse_event(frame)
    finally:
        gen.abort_unfinished()
