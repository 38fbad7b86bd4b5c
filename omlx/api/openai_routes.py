"""OpenAI-compatible routes: /v1/models, /v1/chat/completions, /v1/completions."""

from __future__ import annotations

from functools import partial
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from omlx.api import anthropic_models, pipeline
from omlx.api.formats import ChatFormat, CompletionFormat, OpenAIEncoder
from omlx.api.images import ImageSink
from omlx.api.pipeline import Call, Prepared, Rendering
from omlx.api.prompts import (
    RenderedPrompt,
    chat_messages,
    completion_prompt_ids,
    decoded_prompts,
    openai_sampling,
)
from omlx.api.schemas import ChatCompletionRequest, CompletionRequest
from omlx.api.state import state_of
from omlx.api.structured import grammar_spec
from omlx.api.tool_grammar import combined, openai_tool_constraint
from omlx.engine.pool import EnginePool
from omlx.engine.prompt_scores import prompt_logprobs
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
        # What the prompt and the answer share (the model's settings applied).
        "context_window": pool.context_window(info),
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


def _include_usage(body: ChatCompletionRequest | CompletionRequest) -> bool:
    opts = body.stream_options
    return opts is not None and bool(opts.include_usage)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    extra = body.model_extra or {}
    tools_rule = openai_tool_constraint(
        body.tools, body.tool_choice, extra.get("parallel_tool_calls")
    )
    # A bad conversation is refused before any model loads.
    images = ImageSink(state_of(request).settings.models.image_url_allowlist)
    call = Call(
        model=body.model,
        kind="chat",
        id_prefix="chatcmpl-",
        messages=chat_messages(body, images),
        tools=body.tools if body.tool_choice != "none" else None,
        images=images,
        template_kwargs=body.chat_template_kwargs,
        sampling=openai_sampling(body),
        spec=combined(grammar_spec(body), tools_rule),
        n=body.n,
        stream=bool(body.stream),
    )
    return await pipeline.run(request, call, partial(_chat_encoder, body))


async def _chat_encoder(body: ChatCompletionRequest, prepared: Prepared) -> OpenAIEncoder:
    parsers = [prepared.parser() for _ in range(body.n)]
    logprobs = body.logprobs_wanted() is not None
    fmt = ChatFormat(prepared.request_id, prepared.model, parsers, logprobs=logprobs)
    return OpenAIEncoder(fmt, include_usage=_include_usage(body))


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    if body.suffix:
        raise InvalidRequestError("'suffix' is not supported", param="suffix")
    call = Call(
        model=body.model,
        kind="completion",
        id_prefix="cmpl-",
        sampling=openai_sampling(body),
        spec=grammar_spec(body),
        n=body.n,
        stream=bool(body.stream),
        prompts=partial(_completion_prompts, body),
    )
    return await pipeline.run(request, call, partial(_completion_encoder, body))


async def _completion_prompts(
    body: CompletionRequest, rendering: Rendering
) -> list[RenderedPrompt]:
    """The prompts as given: text is tokenized, never templated."""
    prompts = await completion_prompt_ids(rendering.engine, body, rendering.renderer)
    return [RenderedPrompt("", ids) for ids in prompts]


async def _completion_encoder(body: CompletionRequest, prepared: Prepared) -> OpenAIEncoder:
    """With ``echo`` the prompt text (and, with logprobs, its tokens' logprobs) comes
    first; ``max_tokens`` 0 answers with that alone (lm-eval-harness scores this way)."""
    engine, prompts = prepared.engine, [p.ids for p in prepared.prompts]
    echoes = [""] * len(prompts)
    if body.echo:
        echoes = await decoded_prompts(engine, prompts, prepared.renderer)
    scored = None
    if body.echo and body.logprobs is not None:
        scored = [await prompt_logprobs(engine, ids, body.logprobs) for ids in prompts]
    fmt = CompletionFormat(
        prepared.request_id,
        prepared.model,
        echoes,
        n=body.n,
        logprobs=body.logprobs is not None,
        prompt_logprobs=scored,
    )
    return OpenAIEncoder(fmt, include_usage=_include_usage(body))
