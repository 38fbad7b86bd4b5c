"""OpenAI-compatible routes: /v1/models, /v1/chat/completions, /v1/completions."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from omlx.api import anthropic_models
from omlx.api.formats import ChatFormat, CompletionFormat
from omlx.api.generation import ClientGone, Generation, sse_stream, unless_disconnected
from omlx.api.metrics import observer_for
from omlx.api.output_parser import parser_for
from omlx.api.prompts import (
    chat_prompt,
    choice_requests,
    completion_prompt_ids,
    decoded_prompts,
    new_request_id,
    sampling_params,
)
from omlx.api.schemas import ChatCompletionRequest, CompletionRequest
from omlx.api.sse import DONE, SSE_HEADERS, sse_data
from omlx.api.state import state_of
from omlx.api.structured import bind_grammar, grammar_spec, with_unenforced_header
from omlx.api.tool_grammar import combined, openai_tool_constraint
from omlx.engine.model_engine import ModelEngine
from omlx.engine.pool import EnginePool
from omlx.engine.prompt_scores import prompt_logprobs
from omlx.engine.stream import StreamEvent
from omlx.errors import InvalidRequestError
from omlx.models.discovery import ModelInfo, capabilities

router = APIRouter()


def _model_entry(pool: EnginePool, info: ModelInfo) -> dict[str, Any]:
    kind = pool.model_settings.get(info.name).model_type or info.kind
    return {
        "id": pool.public_name(info.name),
        "object": "model",
        "created": int(info.path.stat().st_mtime),
        "owned_by": "omlx",
        "state": pool.model_state(info.name),
        "kind": kind,
        "capabilities": capabilities(kind),
    }


def _anthropic_client(request: Request) -> bool:
    """Anthropic's SDK sends this header; it gets /v1/models in Anthropic's shape."""
    return "anthropic-version" in request.headers


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    pool = state_of(request).pool
    if _anthropic_client(request):
        return anthropic_models.model_page(pool, dict(request.query_params))
    models = pool.available()
    return {"object": "list", "data": [_model_entry(pool, models[n]) for n in sorted(models)]}


# `:path`: ids of models two levels down are "org/name".
@router.get("/v1/models/{model_id:path}")
async def retrieve_model(request: Request, model_id: str) -> dict[str, Any]:
    """client.models.retrieve: one entry of /v1/models, by the id (or alias) it shows;
    404 model_not_found listing what exists."""
    pool = state_of(request).pool
    if _anthropic_client(request):
        return anthropic_models.model_entry(pool, pool.resolve(model_id))
    return _model_entry(pool, pool.resolve(model_id))


async def _respond(
    request: Request,
    body: ChatCompletionRequest | CompletionRequest,
    gen: Generation,
    fmt: ChatFormat | CompletionFormat,
    kind: str,
) -> Response:
    """Submit the generation and answer as SSE or as one JSON body."""
    state = state_of(request)
    gen.submit()

    def on_event(index: int, event: StreamEvent) -> dict[str, Any] | None:
        chunk = fmt.chunk(index, event)
        if event.finished and all(c.finish_reason for c in fmt.choices):
            usage = fmt.usage()
            gen.log_done(
                kind,
                usage["prompt_tokens"],
                usage["completion_tokens"],
                [c.finish_reason or "" for c in fmt.choices],
            )
        return chunk

    if body.stream:
        opts = body.stream_options
        include_usage = opts is not None and opts.include_usage
        frames = sse_stream(
            gen,
            state.settings.server.sse_keepalive_s,
            on_event,
            lambda: [fmt.usage_chunk()] if include_usage else [],
        )
        return StreamingResponse(frames, media_type="text/event-stream", headers=SSE_HEADERS)

    try:
        await unless_disconnected(request, gen.collect(on_event), gen.abort_unfinished)
    except ClientGone:
        return Response(status_code=499)  # nobody is listening; nginx's "client closed"
    return JSONResponse(fmt.body())


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    # The lease keeps unload/release from taking the engine before the submit.
    async with state_of(request).pool.lease(body.model) as engine:
        return await _chat_completion(body, request, engine)


async def _chat_completion(
    body: ChatCompletionRequest, request: Request, engine: ModelEngine
) -> Response:
    state = state_of(request)
    defaults = state.pool.request_defaults(engine.name)
    extra = body.model_extra or {}
    tools_rule = openai_tool_constraint(
        body.tools, body.tool_choice, extra.get("parallel_tool_calls")
    )
    spec = combined(grammar_spec(body), tools_rule)
    prompt = await chat_prompt(
        engine,
        body,
        defaults.template_kwargs(body.chat_template_kwargs),
        state.settings.server.template_timeout_s,
        state.settings.models.image_url_allowlist,
    )
    params = sampling_params(
        body, len(prompt.ids), engine, defaults.sampling, defaults.generation, defaults.forced
    )
    grammar = await bind_grammar(engine, spec)
    rid = new_request_id("chatcmpl")
    requests = choice_requests(rid, prompt.ids, params, grammar, body.n, prompt.images)
    gen = Generation(engine, requests, observer=observer_for(request))
    tools = bool(body.tools) and body.tool_choice != "none"
    parsers = [
        parser_for(
            engine.tokenizer,
            tools_requested=tools,
            reasoning=bool(getattr(engine.tokenizer, "has_thinking", False)),
            prompt_text=prompt.text,
            tool_schemas=body.tools if tools else None,
        )
        for _ in range(body.n)
    ]
    fmt = ChatFormat(
        rid,
        state.pool.public_name(engine.name),
        parsers,
        logprobs=body.logprobs_wanted() is not None,
    )
    response = await _respond(request, body, gen, fmt, "chat")
    return with_unenforced_header(response, spec, rid)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    async with state_of(request).pool.lease(body.model) as engine:
        return await _completion(body, request, engine)


async def _completion(body: CompletionRequest, request: Request, engine: ModelEngine) -> Response:
    state = state_of(request)
    if body.suffix:
        raise InvalidRequestError("'suffix' is not supported", param="suffix")
    spec = grammar_spec(body)
    prompts = await completion_prompt_ids(engine, body)
    grammar = await bind_grammar(engine, spec)
    rid = new_request_id("cmpl")
    defaults = state.pool.request_defaults(engine.name)
    requests = []
    for i, ids in enumerate(prompts):
        params = sampling_params(
            body, len(ids), engine, defaults.sampling, defaults.generation, defaults.forced
        )
        requests += choice_requests(f"{rid}-{i}", ids, params, grammar, body.n)
    echoes = await decoded_prompts(engine, prompts) if body.echo else [""] * len(prompts)
    scored = None
    if body.echo and body.logprobs is not None:
        scored = [await prompt_logprobs(engine, ids, body.logprobs) for ids in prompts]
    fmt = CompletionFormat(
        rid,
        state.pool.public_name(engine.name),
        echoes,
        n=body.n,
        logprobs=body.logprobs is not None,
        prompt_logprobs=scored,
    )
    if body.max_tokens == 0:
        return _echo_only(body, fmt, prompts)
    gen = Generation(engine, requests, observer=observer_for(request))
    response = await _respond(request, body, gen, fmt, "completion")
    return with_unenforced_header(response, spec, rid)


def _echo_only(
    body: CompletionRequest, fmt: CompletionFormat, prompts: list[list[int]]
) -> Response:
    """``max_tokens`` 0 with ``echo``: the prompts (and their logprobs) only, nothing
    generated (lm-eval-harness scores a continuation this way)."""
    chunks = [
        fmt.chunk(
            i, StreamEvent(num_prompt_tokens=len(prompts[i // fmt.n]), finish_reason="length")
        )
        for i in range(len(fmt.choices))
    ]
    if not body.stream:
        return JSONResponse(fmt.body())
    opts = body.stream_options
    if opts is not None and opts.include_usage:
        chunks.append(fmt.usage_chunk())
    frames = [sse_data(c) for c in chunks if c is not None] + [DONE]
    return StreamingResponse(iter(frames), media_type="text/event-stream", headers=SSE_HEADERS)
