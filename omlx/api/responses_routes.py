"""OpenAI Responses API routes: /v1/responses (create, retrieve, delete,
input_items, cancel, input_tokens), on the request pipeline (responses_turn.py)."""

from __future__ import annotations

import asyncio
from typing import Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response

from omlx.api import pipeline
from omlx.api.pipeline import Prepared
from omlx.api.responses_schemas import ResponsesRequest
from omlx.api.responses_store import ResponseStore, StoredResponse
from omlx.api.responses_turn import ResponseEncoder, ResponsesTurn
from omlx.api.state import state_of
from omlx.errors import InvalidRequestError, NotFoundError

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


async def _turn(body: ResponsesRequest, request: Request) -> ResponsesTurn:
    """The checked request with the stored conversation it continues."""
    history = []
    if body.previous_response_id is not None:
        previous = await _stored(request, body.previous_response_id, "previous_response_id")
        history = previous.continued()
    allowlist = tuple(state_of(request).settings.models.image_url_allowlist)
    return ResponsesTurn(body, history, allowlist)


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request) -> Response:
    turn = await _turn(body, request)

    async def encoder(prepared: Prepared) -> ResponseEncoder:
        return ResponseEncoder.of(turn, store_of(request), prepared)

    return await pipeline.run(request, turn.call(), encoder)


@router.post("/v1/responses/input_tokens")
async def count_input_tokens(body: ResponsesRequest, request: Request) -> dict[str, Any]:
    """client.responses.input_tokens.count: the prompt a create would send, in tokens."""
    turn = await _turn(body, request)
    count = await pipeline.prompt_tokens(request, turn.call())
    return {"object": "response.input_tokens", "input_tokens": count}


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
