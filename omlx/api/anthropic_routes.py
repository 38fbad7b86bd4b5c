"""Anthropic Messages API routes: /v1/messages and /v1/messages/count_tokens."""

from __future__ import annotations

from dataclasses import replace

from fastapi import APIRouter, Request
from fastapi.responses import Response

from omlx.api import pipeline
from omlx.api.anthropic_format import (
    MessageEncoder,
    MessageFormat,
    chat_messages,
    chat_tools,
    output_grammar,
    sampling_request,
    server_tools,
    template_kwargs,
    uses_cache_control,
)
from omlx.api.anthropic_models import served_model
from omlx.api.anthropic_schemas import CountTokensRequest, MessagesRequest
from omlx.api.hosted_tools import dropped_header
from omlx.api.images import ImageSink
from omlx.api.pipeline import Call, Prepared
from omlx.api.state import state_of

router = APIRouter()


def _call(body: CountTokensRequest, request: Request) -> Call:
    """The prompt side of a Messages body; a bad conversation is refused before any
    model loads."""
    state = state_of(request)
    images = ImageSink(state.settings.models.image_url_allowlist)
    return Call(
        model=served_model(state.pool, body.model),
        kind="messages",
        id_prefix="msg_",
        messages=chat_messages(body, images),
        tools=chat_tools(body),
        images=images,
        template_kwargs=template_kwargs(body),
        # Anthropic's clients parse thinking blocks whatever the model.
        reasoning=True,
        # message_start carries the cached/new split, known at admission.
        wants_admission=True,
        headers=dropped_header(server_tools(body)),
    )


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, request: Request) -> dict[str, int]:
    return {"input_tokens": await pipeline.prompt_tokens(request, _call(body, request))}


@router.post("/v1/messages")
async def create_message(body: MessagesRequest, request: Request) -> Response:
    call = replace(
        _call(body, request),
        sampling=sampling_request(body),
        spec=output_grammar(body),
        stream=body.stream,
    )

    async def encoder(prepared: Prepared) -> MessageEncoder:
        fmt = MessageFormat(
            prepared.request_id,
            prepared.engine.name,
            prepared.parser(),
            num_prompt_tokens=len(prepared.prompts[0].ids),
            stop_sequences=prepared.params[0].stop,
            reports_cache_writes=uses_cache_control(body),
            window_bound=prepared.budgets[0].clamped,
        )
        return MessageEncoder(fmt)

    return await pipeline.run(request, call, encoder)
