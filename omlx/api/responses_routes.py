"""OpenAI Responses API routes: /v1/responses (create, retrieve, delete,
input_items, cancel, input_tokens), on the same pipeline as /v1/chat/completions."""

from __future__ import annotations

import asyncio
import json
import logging
import sqlite3
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from omlx.api.generation import ClientGone, Generation, unless_disconnected
from omlx.api.images import ImageSink
from omlx.api.metrics import observer_for
from omlx.api.output_parser import parser_for
from omlx.api.prompts import (
    RenderedPrompt,
    SamplingRequest,
    build_sampling,
    make_request,
    render_chat,
)
from omlx.api.responses_format import Echo, Event, ResponseFormat
from omlx.api.responses_input import (
    Item,
    chat_messages,
    chat_tools,
    input_items,
    new_item_id,
    one_constraint,
    output_spec,
    reasoning_template_vars,
    tool_rule,
)
from omlx.api.responses_schemas import ResponsesRequest
from omlx.api.responses_store import ResponseStore, StoredResponse
from omlx.api.sse import KEEPALIVE, SSE_HEADERS
from omlx.api.state import state_of
from omlx.api.structured import bind_grammar, with_unenforced_header
from omlx.engine.model_engine import ModelEngine
from omlx.errors import ContextLengthExceededError, InvalidRequestError, NotFoundError
from omlx.grammar.spec import GrammarSpec
from omlx.grammar.tools import ToolConstraint
from omlx.models.model_settings import RequestDefaults
from omlx.scheduler import SamplingParams

log = logging.getLogger(__name__)
router = APIRouter()


def store_of(request: Request) -> ResponseStore:
    store: ResponseStore = request.app.state.responses
    return store


async def _stored(request: Request, response_id: str, param: str = "response_id") -> StoredResponse:
    found = await asyncio.to_thread(store_of(request).get, response_id)
    if found is None:
        raise NotFoundError(
            f"no stored response with id '{response_id}' (responses made with store: false "
            "are not kept, and the oldest are dropped past the store's bounds)",
            param=param,
        )
    return found


def sse_event(event: Event) -> str:
    data = json.dumps(event, separators=(",", ":"), ensure_ascii=False)
    return f"event: {event['type']}\ndata: {data}\n\n"


@dataclass(frozen=True, slots=True)
class _Plan:
    """A checked request: the conversation to render and how output is constrained."""

    body: ResponsesRequest
    conversation: list[Item]
    tools: list[dict[str, Any]] | None  # Chat-shaped; None when hidden (tool_choice none)
    rule: GrammarSpec | ToolConstraint | None
    # This request's input items' ids -> "input[i]" (how errors name them).
    names: dict[str, str]


async def _plan(body: ResponsesRequest, request: Request) -> _Plan:
    """Check the request and gather the conversation (a stored one first)."""
    if body.background:
        raise InvalidRequestError(
            "background responses are not supported; send background: false (the default)",
            param="background",
        )
    items = input_items(body.input)
    tools = chat_tools(body.tools)
    rule = one_constraint(
        output_spec(body.text), tool_rule(tools, body.tool_choice, body.parallel_tool_calls)
    )
    history: list[Item] = []
    if body.previous_response_id is not None:
        previous = await _stored(request, body.previous_response_id, "previous_response_id")
        history = previous.continued()
    if not history and not items:
        raise InvalidRequestError("'input' must not be empty", param="input")
    visible = tools if body.tool_choice != "none" else None
    names = {item["id"]: f"input[{i}]" for i, item in enumerate(items)}
    return _Plan(body, [*history, *items], visible, rule, names)


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request) -> Response:
    plan = await _plan(body, request)
    # The lease keeps unload/release from taking the engine before the submit.
    async with state_of(request).pool.lease(body.model) as engine:
        return await _generate(plan, request, engine)


@router.post("/v1/responses/input_tokens")
async def count_input_tokens(body: ResponsesRequest, request: Request) -> dict[str, Any]:
    """client.responses.input_tokens.count: the prompt a create would send, in tokens."""
    plan = await _plan(body, request)
    engine = await state_of(request).pool.get_engine(body.model)
    prompt, _ = await _fitted_prompt(plan, request, engine)
    return {"object": "response.input_tokens", "input_tokens": len(prompt.ids)}


async def _generate(plan: _Plan, request: Request, engine: ModelEngine) -> Response:
    state = state_of(request)
    body = plan.body
    defaults = state.pool.request_defaults(engine.name)
    prompt, conversation = await _fitted_prompt(plan, request, engine)
    params = _sampling(body, engine, len(prompt.ids), defaults)
    grammar = await bind_grammar(engine, plan.rule)
    response_id = new_item_id("resp")
    gen = Generation(
        engine,
        [make_request(response_id, prompt.ids, params, grammar, prompt.images)],
        observer=observer_for(request),
    )
    parser = parser_for(
        engine.tokenizer,
        tools_requested=plan.tools is not None,
        reasoning=bool(getattr(engine.tokenizer, "has_thinking", False)),
        prompt_text=prompt.text,
        tool_schemas=plan.tools,
    )
    fmt = ResponseFormat(
        response_id, _echo(body, state.pool.public_name(engine.name), params), parser
    )
    kept = conversation if body.stores else None
    finished = partial(_finished, request, gen, fmt, kept)
    response = await _answer(request, body.stream is True, gen, fmt, finished)
    return with_unenforced_header(response, plan.rule, response_id)


async def _finished(
    request: Request, gen: Generation, fmt: ResponseFormat, conversation: list[Item] | None
) -> None:
    """Log the request; store the response (when ``store``) with the input it was given."""
    reasons = [fmt.finish_reason or ""]
    gen.log_done("responses", fmt.num_prompt_tokens, fmt.num_output_tokens, reasons)
    if conversation is None:
        return
    try:
        await asyncio.to_thread(store_of(request).put, StoredResponse(fmt.body(), conversation))
    except sqlite3.Error as exc:  # a full disk must not lose the answer being sent
        log.error("could not store response %s in the responses store: %s", fmt.response_id, exc)


async def _answer(
    request: Request,
    stream: bool,
    gen: Generation,
    fmt: ResponseFormat,
    finished: Callable[[], Awaitable[None]],
) -> Response:
    """Submit the generation and answer as SSE events or as one response object."""
    gen.submit()
    if stream:
        keepalive_s = state_of(request).settings.server.sse_keepalive_s
        frames = _stream(gen, fmt, keepalive_s, finished)
        return StreamingResponse(frames, media_type="text/event-stream", headers=SSE_HEADERS)
    try:
        await unless_disconnected(
            request, gen.collect(lambda _, event: fmt.add(event)), gen.abort_unfinished
        )
    except ClientGone:
        return Response(status_code=499)  # nobody is listening; nginx's "client closed"
    await finished()
    return JSONResponse(fmt.body())


async def _fitted_prompt(
    plan: _Plan, request: Request, engine: ModelEngine
) -> tuple[RenderedPrompt, list[Item]]:
    """The rendered prompt; with truncation "auto", the oldest items are dropped until
    the prompt and max_output_tokens fit the context window."""
    state = state_of(request)
    vars_ = reasoning_template_vars(plan.body.reasoning)
    template_kwargs = state.pool.request_defaults(engine.name).template_kwargs(vars_)
    timeout_s = state.settings.server.template_timeout_s
    conversation = plan.conversation
    room = plan.body.max_output_tokens or 1
    while True:
        allowlist = state.settings.models.image_url_allowlist
        images = ImageSink(allowlist) if engine.loaded.vision is not None else None
        messages = chat_messages(plan.body.instructions, conversation, images, plan.names)
        prompt = await render_chat(
            engine,
            messages,
            tools=plan.tools,
            template_kwargs=template_kwargs,
            timeout_s=timeout_s,
            images=images,
        )
        excess = len(prompt.ids) + room - engine.context_window
        if excess <= 0 or not plan.body.truncates or len(conversation) <= 1:
            return prompt, conversation
        # Drop in proportion to the excess, so a long history takes a few renders, not one per item.
        num_drop = max(1, len(conversation) * excess // max(1, len(prompt.ids)))
        conversation = _without_oldest(conversation, min(num_drop, len(conversation) - 1))


def _without_oldest(items: list[Item], num_drop: int) -> list[Item]:
    """``items`` less the first ``num_drop``, then up to the next user message: the
    conversation starts with a user turn (templates that check roles want one), never
    with a tool output cut from its call."""
    rest = items[num_drop:]
    while len(rest) > 1 and not (rest[0]["type"] == "message" and rest[0]["role"] == "user"):
        rest = rest[1:]
    return rest


def _sampling(
    body: ResponsesRequest, engine: ModelEngine, num_prompt_tokens: int, defaults: RequestDefaults
) -> SamplingParams:
    req = SamplingRequest(
        max_tokens=body.max_output_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        max_tokens_param="max_output_tokens",
        speculative=body.speculative,
    )
    try:
        return build_sampling(
            engine, num_prompt_tokens, req, defaults.sampling, defaults.generation, defaults.forced
        )
    except ContextLengthExceededError as exc:
        hint = (
            "" if body.truncates else "; or send truncation: 'auto' to drop the oldest input items"
        )
        param = "input" if exc.param == "messages" else exc.param
        raise ContextLengthExceededError(exc.message + hint, param=param) from None


def _echo(body: ResponsesRequest, model: str, params: SamplingParams) -> Echo:
    text_format = (body.text.format if body.text else None) or {"type": "text"}
    return Echo(
        model=model,
        instructions=body.instructions,
        tools=body.tools or [],
        tool_choice=body.tool_choice or "auto",
        parallel_tool_calls=body.parallel_tool_calls is not False,
        text_format=text_format,
        reasoning_effort=body.reasoning.effort if body.reasoning else None,
        max_output_tokens=body.max_output_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        truncation=body.truncation or "disabled",
        metadata=body.metadata or {},
        store=body.stores,
        previous_response_id=body.previous_response_id,
    )


async def _stream(
    gen: Generation,
    fmt: ResponseFormat,
    keepalive_s: float,
    finished: Callable[[], Awaitable[None]],
) -> AsyncIterator[str]:
    """Named SSE events for one response; the client going away aborts it."""
    try:
        for event in fmt.start():
            yield sse_event(event)
        # aclosing: a disconnect cancels us mid-iteration; close the pump tasks now.
        async with aclosing(gen.events(keepalive_s)) as events:
            async for item in events:
                if item is None:
                    yield KEEPALIVE
                    continue
                _, step = item
                if step.error is not None:
                    for event in fmt.fail(step.error):
                        yield sse_event(event)
                    break
                out = fmt.add(step)
                if step.finish_reason is not None:
                    await finished()  # stored before the client sees response.completed
                for event in out:
                    yield sse_event(event)
    finally:
        gen.abort_unfinished()


@router.get("/v1/responses/{response_id}")
async def retrieve_response(request: Request, response_id: str) -> dict[str, Any]:
    return (await _stored(request, response_id)).response


@router.delete("/v1/responses/{response_id}")
async def delete_response(request: Request, response_id: str) -> dict[str, Any]:
    if not await asyncio.to_thread(store_of(request).delete, response_id):
        await _stored(request, response_id)  # raises the 404
    return {"id": response_id, "object": "response.deleted", "deleted": True}


@router.get("/v1/responses/{response_id}/input_items")
async def list_input_items(
    request: Request,
    response_id: str,
    limit: int = Query(20, ge=1, le=100),
    order: Literal["asc", "desc"] = "desc",
    after: str | None = None,
) -> dict[str, Any]:
    """The items the model was given (earlier turns + this input), paged as OpenAI does."""
    items = list((await _stored(request, response_id)).conversation)
    if order == "desc":
        items.reverse()
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise InvalidRequestError(f"no input item '{after}' in this response", param="after")
        items = items[ids.index(after) + 1 :]
    page = items[:limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(items) > limit,
    }


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(request: Request, response_id: str) -> dict[str, Any]:
    await _stored(request, response_id)  # an unknown id is a 404
    raise InvalidRequestError(
        "only background responses can be cancelled, and this server runs none "
        "(background: true is refused); this response has finished",
        param="response_id",
    )
